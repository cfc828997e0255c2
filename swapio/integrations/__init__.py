"""Glue between swapio and training frameworks. Each module imports its framework; swapio itself imports none."""
