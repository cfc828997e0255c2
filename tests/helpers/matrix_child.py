"""The child side of test_optim_fault_matrix: imported once by the fork server (preload), so each child starts
warm. A child trains two steps, saves a checkpoint, then takes step 3 and saves again, with a signal (SIGINT or
SIGKILL) sent to itself at a chosen point of that step or save."""
import os
import signal

import torch

import swapio
from swapio import ops
from swapio.core import _durable
from swapio.optim import checkpoint
from helpers.resume import make_opt, make_params, set_grads, train


def _fire_at(owner, name, at, sig, counts=lambda *a, **k: True):
    """The at-th call (0-based) of owner.name that `counts` sends sig to this process first."""
    real, calls = getattr(owner, name), [0]

    def wrapper(*args, **kwargs):
        if counts(*args, **kwargs):
            calls[0] += 1
            if calls[0] - 1 == at:
                os.kill(os.getpid(), sig)
        return real(*args, **kwargs)

    setattr(owner, name, wrapper)


def _arm(opt, point, at, sig):
    if point == "kernel":
        _fire_at(ops, "adam_step_", at, sig)
    elif point == "swap_write":
        _fire_at(swapio.AioHandle, "pwrite", at, sig,
                 lambda self, t, path, *a, **k: os.path.dirname(os.fspath(path)) == opt.swap_path)
    elif point == "data_write":  # the at-th write into the checkpoint's temporary file
        _fire_at(swapio.AioHandle, "pwrite", at, sig,
                 lambda self, t, path, *a, **k: os.path.basename(os.fspath(path)).startswith(f".{checkpoint.FILE}"))
    elif point == "file_fsync":  # 0: the temporary file written whole, before it is renamed into place
        _fire_at(_durable, "fsync_path", at, sig, lambda path, directory=False: not directory)
    elif point == "dir_fsync":  # 0: the file renamed into place (the commit)
        _fire_at(_durable, "fsync_path", at, sig, lambda path, directory=False: directory)
    else:
        raise ValueError(point)


def child(mode, swap_dir, ckpt, dump, phase, point, at, sig):
    """Exit code 0 when the signal changed nothing, 130 after a KeyboardInterrupt."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    params = make_params()
    opt = make_opt("adamw", params, mode, swap_dir)
    train(opt, params, 1, 2)
    opt.save(ckpt)
    try:
        if phase == "step":
            _arm(opt, point, at, sig)
        set_grads(params, 3)
        opt.step()
        if phase == "save":
            _arm(opt, point, at, sig)
        opt.save(ckpt)
    except KeyboardInterrupt:
        if phase == "step":  # a user's emergency save: what the model holds, and the optimizer
            torch.save([p.detach() for p in params], dump)
            opt.save(ckpt)
        opt.close()
        os._exit(130)
    opt.close()
    os._exit(0)


make_opt("adamw", make_params(shapes=[(8,)]), "cpu", None).close()  # warm up the lazy imports
