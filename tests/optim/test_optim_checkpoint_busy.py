"""A checkpoint directory in use by another save or load of this same process (another thread, another optimizer):
flock conflicts between two opens of the directory, so the save or load is refused with EBUSY, as for another
process. The message said "another live process", which sent the user looking for one; it now names this process
too, and a refused load says what a load would have read."""
import errno

import pytest

from helpers.optim import stepped_cpu_adamw
from swapio.core import _dir_lock


def test_a_save_while_this_process_saves_there_is_refused_naming_this_process(tmp_path):
    opt = stepped_cpu_adamw(64)
    ckpt = tmp_path / "ckpt"
    opt.save(ckpt)
    with _dir_lock.locked(str(ckpt), exclusive=True):  # another save of this process, in progress
        with pytest.raises(OSError, match=r"another save or load of this one\) is using") as info:
            opt.save(ckpt)
        assert info.value.errno == errno.EBUSY
        with pytest.raises(OSError, match=r"another save of this one\) is saving into .*a load now would read") as info:
            opt.load(ckpt)
        assert info.value.errno == errno.EBUSY
    opt.save(ckpt)  # the other one over: both go through
    opt.load(ckpt)
