"""Hugging Face Trainer checkpoints of OffloadAdam/OffloadAdamW through swapio's streaming save/load.

Trainer saves an optimizer with torch.save(optimizer.state_dict()). For an nvme-resident state that reads the
whole state into RAM first (state_dict() materialises it) and writes it through the page cache: the RAM the
offload saved comes back at every checkpoint. With this callback, each checkpoint instead gets
checkpoint-N/swapio-optim/ written by opt.save() (streamed through the optimizer's pinned buffers, fsynced,
atomic), and optimizer.pt holds only a reference to it; resume_from_checkpoint loads the reference and streams
the state back with opt.load(). benchmarks/optimizer_checkpoint.py measures the difference (docs/guide.md).

    trainer = Trainer(model, args, train_dataset=data, optimizers=(opt, sched),
                      callbacks=[StreamingCheckpointCallback()])

How: the callback finds the OffloadAdam among Trainer's optimizers when the Trainer is built (on_init_end) and
gives that instance two methods of its own: load_state_dict, which recognises a reference, and state_dict, which
returns the reference once, right after the callback has saved the checkpoint (on_step_end / on_epoch_end when
Trainer is about to save). Other optimizers are left alone.
"""
import os

from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ..optim import OffloadAdam

SUBDIR = "swapio-optim"
REFERENCE_KEY = "swapio_checkpoint"


def _offload_optimizer(optimizer):
    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps it
    return inner if isinstance(inner, OffloadAdam) else None


def reference(path):
    """A state dict that points at the streaming checkpoint in `path` instead of holding the state. Its empty
    param_groups make any other optimizer's load_state_dict refuse it rather than load nothing."""
    return {"state": {}, "param_groups": [], REFERENCE_KEY: os.path.abspath(path)}


def _install(opt, load_reference=None):
    """load_reference(opt, path): how a reference is loaded (default: opt.load(path), OffloadAdam's own)."""
    if "load_state_dict" in vars(opt):
        return
    cls = type(opt)
    pending = {}

    def state_dict():
        ref = pending.pop("ref", None)
        return ref if ref is not None else cls.state_dict(opt)

    def load_state_dict(state_dict):
        path = state_dict.get(REFERENCE_KEY) if isinstance(state_dict, dict) else None
        if path is None:
            return cls.load_state_dict(opt, state_dict)
        if not os.path.isdir(path):
            if load_reference is None:
                raise FileNotFoundError(f"the optimizer checkpoint names {path}, which does not exist (was the "
                                        "checkpoint moved? load it with opt.load(<checkpoint>/swapio-optim))")
        if load_reference is None:
            opt.load(path)
        else:
            load_reference(opt, path)

    opt.state_dict, opt.load_state_dict = state_dict, load_state_dict
    opt._swapio_pending_reference = pending


class StreamingCheckpointCallback(TrainerCallback):
    """Checkpoints an OffloadAdam/OffloadAdamW given to Trainer with opt.save()/opt.load() (see the module)."""

    def on_init_end(self, args, state, control, optimizer=None, **kwargs):
        opt = _offload_optimizer(optimizer)
        if opt is not None:
            _install(opt)

    def _save(self, args, state, control, optimizer):
        opt = _offload_optimizer(optimizer)
        if opt is None or not control.should_save or args.save_only_model:
            return
        _install(opt)  # an optimizer Trainer created itself (optimizers=(None, ...)) appears only now
        path = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}", SUBDIR)
        opt.save(path)
        opt._swapio_pending_reference["ref"] = reference(path)

    def on_step_end(self, args, state, control, optimizer=None, **kwargs):
        self._save(args, state, control, optimizer)

    def on_epoch_end(self, args, state, control, optimizer=None, **kwargs):
        self._save(args, state, control, optimizer)

    def on_save(self, args, state, control, optimizer=None, **kwargs):
        opt = _offload_optimizer(optimizer)
        if opt is not None and hasattr(opt, "_swapio_pending_reference"):
            opt._swapio_pending_reference.pop("ref", None)  # Trainer did not ask for it: drop it


# ---- any torch optimizer, through swapio.checkpoint ---------------------------------------------------------
OPTIMIZER_FILE = "optimizer.safetensors"


def _load_optimizer_file(opt, path):
    from ..checkpoint import load
    if not os.path.isfile(path):
        raise FileNotFoundError(f"the optimizer checkpoint names {path}, which does not exist (was the checkpoint "
                                "moved? load it with opt.load_state_dict(swapio.checkpoint.load(<checkpoint>/"
                                f"{OPTIMIZER_FILE})))")
    type(opt).load_state_dict(opt, load(path))


class SwapioCheckpointCallback(TrainerCallback):
    """Trainer checkpoints of any torch optimizer's state through swapio.checkpoint: checkpoint-N/optimizer.safetensors
    (O_DIRECT, fsynced, atomic), with optimizer.pt holding only a reference to it, loaded back on
    resume_from_checkpoint. The model is left to Trainer, which writes model.safetensors already. The same
    mechanism as StreamingCheckpointCallback (above); OffloadAdam optimizers are left to that one."""

    def on_init_end(self, args, state, control, optimizer=None, **kwargs):
        opt = getattr(optimizer, "optimizer", optimizer)
        if opt is not None and _offload_optimizer(optimizer) is None:
            _install(opt, _load_optimizer_file)

    def _save(self, args, state, control, optimizer):
        opt = getattr(optimizer, "optimizer", optimizer)
        if opt is None or _offload_optimizer(optimizer) is not None or not control.should_save \
                or args.save_only_model or not args.should_save:
            return
        from ..checkpoint import save
        _install(opt, _load_optimizer_file)  # an optimizer Trainer created itself appears only now
        directory = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, OPTIMIZER_FILE)
        save(type(opt).state_dict(opt), path)
        opt._swapio_pending_reference["ref"] = reference(path)

    def on_step_end(self, args, state, control, optimizer=None, **kwargs):
        self._save(args, state, control, optimizer)

    def on_epoch_end(self, args, state, control, optimizer=None, **kwargs):
        self._save(args, state, control, optimizer)

    def on_save(self, args, state, control, optimizer=None, **kwargs):
        opt = getattr(optimizer, "optimizer", optimizer)
        if opt is not None and hasattr(opt, "_swapio_pending_reference"):
            opt._swapio_pending_reference.pop("ref", None)
