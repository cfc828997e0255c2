"""Killing a saver at a random moment of its save: shared by the crash tests of optimizer checkpoints
(test_crash_save.py) and of swapio.checkpoint (test_checkpoint_crash.py)."""
import os
import time


def kill_while_saving(ctx, saver, args_of, sig, deadline, delay):
    """Starts saver(*args_of(saved, saving)) in a process, waits until its first save is under way (saving set)
    or done (saved >= 0), sleeps `delay` seconds, sends `sig` and reaps it. Returns (saved, was_saving): the shared
    Value of the last save it completed, and whether a save was under way when the signal was sent."""
    saved, saving = ctx.Value("q", -1, lock=False), ctx.Value("b", 0, lock=False)
    proc = ctx.Process(target=saver, args=args_of(saved, saving), daemon=True)
    proc.start()
    while saved.value < 0 and saving.value == 0:
        assert proc.is_alive() and time.monotonic() < deadline, "the saver never started"
        time.sleep(0.001)
    time.sleep(delay)
    was_saving = saving.value
    os.kill(proc.pid, sig)
    proc.join(30)
    assert proc.exitcode is not None
    return saved, was_saving
