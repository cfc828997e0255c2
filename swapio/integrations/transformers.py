"""Hugging Face Trainer checkpoints of the offloaded optimizers (OffloadAdam[W], OffloadLion) through swapio's
streaming save/load.

Trainer saves an optimizer with torch.save(optimizer.state_dict()). For an nvme-resident state that reads the
whole state into RAM first (state_dict() materialises it) and writes it through the page cache: the RAM the
offload saved comes back at every checkpoint. With this callback, each checkpoint instead gets
checkpoint-N/swapio-optim/ written by opt.save() (streamed through the optimizer's pinned buffers, fsynced,
atomic), and optimizer.pt holds only a reference to it; resume_from_checkpoint loads the reference and streams
the state back with opt.load(). benchmarks/optimizer_checkpoint.py measures the difference (docs/guide.md).

    trainer = Trainer(model, args, train_dataset=data, optimizers=(opt, sched),
                      callbacks=[StreamingCheckpointCallback()])

Any way of giving Trainer the optimizer works: optimizers=(opt, sched), optimizer_cls_and_kwargs, or a Trainer
subclass overriding create_optimizer.

How: saving: right before Trainer saves (on_step_end / on_epoch_end with should_save) the callback writes the
checkpoint and gives the optimizer instance a state_dict of its own that returns the reference once. Loading:
Trainer may build the optimizer inside train() (optimizer_cls_and_kwargs, a create_optimizer override) and loads
the checkpoint right after, with no callback event in between, so no instance can be patched in time. So the
offloaded optimizers' own load_state_dict (OffloadOptimizer's) recognises a reference and streams the checkpoint
in with opt.load(); other optimizers refuse a reference.

SwapioCheckpointCallback (at the end) does the same for any torch optimizer, writing its state with
swapio.checkpoint (checkpoint-N/optimizer.safetensors); there the instance given to Trainer gets a load_state_dict
that loads the reference (_install's load_reference).
"""
import os
from typing import Any, Callable, Dict, Optional

from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ..core._errors import warn_once
from ..optim import OffloadOptimizer
from ..optim.optimizer import REFERENCE_KEY

SUBDIR = "swapio-optim"
_PENDING = "_swapio_pending_reference"  # attribute of a patched optimizer: the reference its state_dict returns


def _offload_optimizer(optimizer: Any) -> Optional[OffloadOptimizer]:
    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps it
    return inner if isinstance(inner, OffloadOptimizer) else None


def reference(path: str) -> Dict[str, Any]:
    """A state dict that points at the streaming checkpoint in `path` instead of holding the state. Its empty
    param_groups make any other optimizer's load_state_dict refuse it rather than load nothing."""
    return {"state": {}, "param_groups": [], REFERENCE_KEY: os.path.abspath(path)}


def _install(opt: Any, load_reference: Optional[Callable[[Any, str], None]] = None) -> None:
    """Gives `opt` a state_dict that returns the pending reference once (set by the callback when it saves).
    load_reference(opt, path): how this instance's load_state_dict loads a reference (any torch optimizer, for
    SwapioCheckpointCallback); without it, OffloadOptimizer's class-level load_state_dict does (opt.load)."""
    if hasattr(opt, _PENDING):
        return
    cls = type(opt)
    pending: Dict[str, Dict[str, Any]] = {}

    def state_dict() -> Dict[str, Any]:
        ref = pending.pop("ref", None)
        return ref if ref is not None else cls.state_dict(opt)

    # instance attributes set with setattr: a patch of this one object, which type checkers cannot follow
    setattr(opt, "state_dict", state_dict)
    setattr(opt, _PENDING, pending)
    if load_reference is None:
        return

    def load_state_dict(state_dict: Dict[str, Any]) -> Any:
        path = state_dict.get(REFERENCE_KEY) if isinstance(state_dict, dict) else None
        if path is None:
            return cls.load_state_dict(opt, state_dict)
        return load_reference(opt, path)

    setattr(opt, "load_state_dict", load_state_dict)


class _SavesBeforeTrainer(TrainerCallback):
    """Writes the optimizer's checkpoint right before Trainer saves (on_step_end / on_epoch_end with should_save:
    subclasses' _save) and leaves a reference for optimizer.pt; on_save drops a reference Trainer did not take."""

    def _save(self, args: Any, state: Any, control: Any, optimizer: Any) -> None:
        raise NotImplementedError

    def on_step_end(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kwargs: Any) -> None:
        self._save(args, state, control, optimizer)

    def on_epoch_end(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kwargs: Any) -> None:
        self._save(args, state, control, optimizer)

    def on_save(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kwargs: Any) -> None:
        opt = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps it
        if opt is not None and hasattr(opt, _PENDING):
            getattr(opt, _PENDING).pop("ref", None)  # Trainer did not ask for it: drop it


class StreamingCheckpointCallback(_SavesBeforeTrainer):
    """Checkpoints an offloaded optimizer (OffloadAdam[W], OffloadLion) given to Trainer with opt.save()/opt.load()
    (see the module)."""

    def _save(self, args: Any, state: Any, control: Any, optimizer: Any) -> None:
        opt = _offload_optimizer(optimizer)
        if opt is None or not control.should_save or args.save_only_model:
            return
        _install(opt)  # here, not at on_init_end: an optimizer Trainer builds itself appears only in train()
        path = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}", SUBDIR)
        opt.save(path)
        getattr(opt, _PENDING)["ref"] = reference(path)



# ---- any torch optimizer, through swapio.checkpoint ---------------------------------------------------------
OPTIMIZER_FILE = "optimizer.safetensors"


def _load_optimizer_file(opt: Any, path: str) -> None:
    from ..checkpoint import load
    if not os.path.isfile(path):
        raise FileNotFoundError(f"the optimizer checkpoint names {path}, which does not exist (was the checkpoint "
                                "moved? load it with opt.load_state_dict(swapio.checkpoint.load(<checkpoint>/"
                                f"{OPTIMIZER_FILE})))")
    type(opt).load_state_dict(opt, load(path))


class SwapioCheckpointCallback(_SavesBeforeTrainer):
    """Trainer checkpoints of any torch optimizer's state through swapio.checkpoint: checkpoint-N/optimizer.safetensors
    (O_DIRECT, fsynced, atomic), with optimizer.pt holding only a reference to it, loaded back on
    resume_from_checkpoint. The model is left to Trainer, which writes model.safetensors already. The same
    mechanism as StreamingCheckpointCallback (above); offloaded optimizers (OffloadOptimizer) are left to that one."""

    def on_init_end(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kwargs: Any) -> None:
        opt = getattr(optimizer, "optimizer", optimizer)
        if opt is not None and _offload_optimizer(optimizer) is None:
            _install(opt, _load_optimizer_file)

    def _save(self, args: Any, state: Any, control: Any, optimizer: Any) -> None:
        opt = getattr(optimizer, "optimizer", optimizer)
        if opt is None or _offload_optimizer(optimizer) is not None or not control.should_save \
                or args.save_only_model or not args.should_save:
            return
        if not hasattr(opt, _PENDING):
            # Trainer built this optimizer itself (optimizer_cls_and_kwargs, create_optimizer) after on_init_end,
            # and it will load optimizer.pt right after building it on resume, with no event between in which a
            # callback could teach the instance to follow a reference. So Trainer saves it its own way: a resume
            # that works beats a faster save that cannot be resumed.
            warn_once("swapio-callback-late-optimizer", "SwapioCheckpointCallback saves the optimizer with "
                      "swapio.checkpoint only when it is given to Trainer (optimizers=(opt, scheduler)); this "
                      "optimizer was built by Trainer, so Trainer saves it with torch.save")
            return
        from ..checkpoint import save
        directory = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, OPTIMIZER_FILE)
        save(type(opt).state_dict(opt), path)
        getattr(opt, _PENDING)["ref"] = reference(path)

