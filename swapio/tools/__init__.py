"""The `swapio` command and what it is built from (bench, tune, info, the load generator).

The library (swapio.*, swapio.optim) never imports this package.
"""
