"""opt.save(dir) whose writes fail (here EFBIG: the process's file size limit, a real failed write): the
directories the save made for it are removed again, as nothing was saved there, and a directory that was there
before is left, its previous checkpoint loadable. Before, the failed first save left an empty directory (and
the parents it made), for which a later load said the checkpoint had lost its file."""
import errno
import os
import resource
import signal

import torch

import swapio.optim as so
from helpers.fork import run_in_child
from helpers.optim import stepped_cpu_adamw


def _fails_for_its_size(save):
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # (the write then fails with EFBIG instead of a signal)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    try:
        save()
    except OSError as exc:
        assert exc.errno == errno.EFBIG, exc
    else:
        raise AssertionError("the save went through under the file size limit")


def test_a_failed_first_save_leaves_no_directories(tmp_path):
    opt = stepped_cpu_adamw(100_000)
    target = tmp_path / "runs" / "step-1"

    def child():
        _fails_for_its_size(lambda: opt.save(target))
        assert os.listdir(tmp_path) == []  # neither step-1 nor the runs/ it made

    assert run_in_child(child) == 0


def test_a_failed_save_into_an_existing_checkpoint_keeps_it(tmp_path):
    small = torch.ones(8, requires_grad=True)
    first = so.OffloadAdamW([small], lr=1e-2, offload="cpu")
    small.grad = torch.ones(8)
    first.step()
    target = tmp_path / "ckpt"
    first.save(target)
    opt = stepped_cpu_adamw(100_000)

    def child():
        _fails_for_its_size(lambda: opt.save(target))
        again = so.OffloadAdamW([torch.zeros(8, requires_grad=True)], lr=1e-2, offload="cpu")
        again.load(target)  # the previous checkpoint, whole
        assert torch.equal(again.state_dict()["state"][0]["exp_avg"], first.state_dict()["state"][0]["exp_avg"])

    assert run_in_child(child) == 0
