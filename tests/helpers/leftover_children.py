"""Child side of test_optim_leftovers: nvme optimizers built with ever fewer file descriptors left, each failing
(EMFILE) at another point of its setup, then one with enough. Imported once by the fork server (preload)."""
import errno
import json
import os
import resource
import warnings

import torch

import swapio.optim as so

ENGINES = ("uring", "aio", "psync")


def out_of_descriptors(swap_dir, result_path):
    warnings.simplefilter("ignore")
    p = torch.zeros(5000, requires_grad=True)
    p.grad = torch.ones(5000)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    failed = 0
    for engine in ENGINES:
        for extra in range(-3, 3):
            used = len(os.listdir("/proc/self/fd")) - 1
            resource.setrlimit(resource.RLIMIT_NOFILE, (used + extra, hard))
            try:
                with so.OffloadAdamW([p], offload="nvme", swap_dir=swap_dir, engine=engine) as opt:
                    opt.step()
            except OSError as exc:
                assert exc.errno == errno.EMFILE, exc
                failed += 1
            finally:
                resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    with so.OffloadAdamW([p], offload="nvme", swap_dir=swap_dir) as opt:  # the next user of swap_dir
        opt.step()
        with open(result_path, "w") as f:
            json.dump({"failed": failed}, f)
