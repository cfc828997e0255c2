"""The child side of test_offload_export's kill test: imported once by the fork server (preload). A child exports a
model and SIGKILLs itself right before its n-th change to the file system (a rename, link, unlink, rmdir or fsync),
so the parent can check the directory at every step of an export, deterministically."""
import os
import signal

import torch

WIDTH, DEPTH = 64, 6  # six 16 KiB weights (+ biases)
STEPS = ("rename", "replace", "link", "unlink", "rmdir", "fsync")


def model_of(value):
    """A model whose every number is `value`: a directory read back as a mix of two exports is caught."""
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)])
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
    return model


def export_until(directory, value, max_shard_size, kill_at):
    """save_checkpoint(model_of(value), directory, max_shard_size), SIGKILLed right before its kill_at-th step."""
    from swapio.offload import save_checkpoint
    count = [0]

    def counted(real):
        def step(*args, **kwargs):
            count[0] += 1
            if count[0] == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            return real(*args, **kwargs)
        return step

    for name in STEPS:
        setattr(os, name, counted(getattr(os, name)))
    save_checkpoint(model_of(value), directory, max_shard_size=max_shard_size)
