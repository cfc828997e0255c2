"""The CPU optimizer kernels' Python API: swapio.ops (the steps), swapio.quant (the int8/bf16 codecs) and the
hyperparameter checks they share. swapio.ops and swapio.quant stay importable under those names."""
