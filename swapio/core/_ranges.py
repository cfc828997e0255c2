"""Profiler ranges that cost nothing unless a profiler is recording.

`section("swapio::step")` is torch.profiler.record_function(name) while torch's autograd profiler is on
(torch.profiler.profile(), with or without CUDA activities) and a shared no-op context otherwise: the hot paths
(each nvme chunk, each offloaded module) open one per phase, and building a RecordFunction there on every call
would cost more than the bookkeeping it measures. The names swapio uses are listed in docs/optim.md and
docs/offload.md ("Seeing where time goes").
"""
import contextlib

import torch

_OFF = contextlib.nullcontext()


def section(name):
    """A context manager: a profiler range named `name` when a profiler is recording, else a no-op."""
    if torch.autograd._profiler_enabled():
        return torch.profiler.record_function(name)
    return _OFF
