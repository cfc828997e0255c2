"""Hugging Face Trainer checkpoints of the offloaded optimizers (OffloadAdam[W], OffloadLion, OffloadAdafactor)
through swapio's streaming save/load.

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

SwapioTrainer / OffloadedTrainerMixin (at the end) train a model offloaded by swapio.offload with a swapio
optimizer: placement, clipping, zero_grad, model checkpoints and resume (docs/offload.md).

SwapioCheckpointCallback does the same for any torch optimizer, writing its state with
swapio.checkpoint (checkpoint-N/optimizer.safetensors); there the instance given to Trainer gets a load_state_dict
that loads the reference (_install's load_reference).
"""
import os
from typing import Any, Callable, Dict, Optional

import torch
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ..core._errors import warn_once
from ..optim import OffloadOptimizer
from ..optim import checkpoint as optim_checkpoint, reference

SUBDIR = "swapio-optim"
_PENDING = "_swapio_pending_reference"  # attribute of a patched optimizer: the reference its state_dict returns


def _offload_optimizer(optimizer: Any) -> Optional[OffloadOptimizer]:
    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps it
    return inner if isinstance(inner, OffloadOptimizer) else None




def _install(opt: Any, load_reference: Optional[Callable[[Any, Dict[str, Any]], None]] = None) -> None:
    """Gives `opt` a state_dict that returns the pending reference once (set by the callback when it saves).
    load_reference(opt, ref): how this instance's load_state_dict loads a reference (any torch optimizer, for
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
        path = reference.target(state_dict)
        if path is None:
            return cls.load_state_dict(opt, state_dict)
        return load_reference(opt, state_dict)

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
    """Checkpoints an offloaded optimizer (OffloadAdam[W], OffloadLion, OffloadAdafactor) given to Trainer with
    opt.save()/opt.load() (see the module)."""

    def _save(self, args: Any, state: Any, control: Any, optimizer: Any) -> None:
        opt = _offload_optimizer(optimizer)
        # args.should_save: only the process Trainer writes optimizer.pt from (DDP ranks hold the same state and
        # would all save into the one directory at once)
        if opt is None or not control.should_save or args.save_only_model or not args.should_save:
            return
        _install(opt)  # here, not at on_init_end: an optimizer Trainer builds itself appears only in train()
        path = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}", SUBDIR)
        opt.save(path)
        getattr(opt, _PENDING)["ref"] = reference.make(path, os.path.join(path, optim_checkpoint.FILE),
                                                       checksummed=True)



# ---- any torch optimizer, through swapio.checkpoint ---------------------------------------------------------
OPTIMIZER_FILE = "optimizer.safetensors"


def _load_optimizer_file(opt: Any, ref: Dict[str, Any]) -> None:
    from ..checkpoint import load
    path = reference.located(ref)
    reference.check(ref, path, path, f"opt.load_state_dict(swapio.checkpoint.load(<checkpoint>/{OPTIMIZER_FILE}))")
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
        getattr(opt, _PENDING)["ref"] = reference.make(path, path)



# ---- training offloaded weights (swapio.offload) with Trainer -------------------------------------------------
def _offloaded(model: Any) -> bool:
    """Whether swapio.offload (disk_offload / cpu_offload) streams any of the model's modules."""
    from ..offload.registry import offloaded
    return model is not None and any(offloaded.get(m) is not None for m in model.modules())


def _peft_model(model: Any) -> bool:
    """Whether the model is a peft PeftModel: Trainer saves and resumes only its adapters (save_pretrained,
    load_adapter), which stay resident over an offloaded base, so its own way works and is the resident run's."""
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def _owned_optimizer(optimizer: Any) -> Optional[OffloadOptimizer]:
    """The swapio optimizer inside Trainer's optimizer when it trains offloaded weights, else None."""
    opt = _offload_optimizer(optimizer)
    return opt if opt is not None and bool(opt._offloaded) else None


class _OffloadedGrads(TrainerCallback):
    """Trainer clears gradients with model.zero_grad(), which cannot reach offloaded weights' gradient sums (they
    live in the optimizer, not in .grad): right after each optimizer step they are dropped with opt.zero_grad()."""

    def on_optimizer_step(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kwargs: Any) -> None:
        opt = _owned_optimizer(optimizer)
        if opt is not None:
            opt.zero_grad()


class OffloadedTrainerMixin:
    """Makes a Trainer (or a subclass: SFTTrainer...) train a model offloaded by swapio.offload.disk_offload /
    cpu_offload with a swapio optimizer that owns its offloaded weights (docs/offload.md, "Training offloaded
    weights with Trainer"):

        class OffloadedTrainer(OffloadedTrainerMixin, Trainer): ...   # or swapio's SwapioTrainer below

    What it changes, only when the model is offloaded:
    - placement: the model stays where swapio streams it (Trainer's and accelerate's model.to(device) would try to
      copy the meta placeholders of the offloaded weights);
    - clipping (max_grad_norm) and the logged grad_norm go through opt.clip_grad_norm_, the global norm over
      every gradient the optimizer owns: model.parameters() shows no .grad for offloaded weights;
    - gradients are cleared with opt.zero_grad() after each step (model.zero_grad() does not reach them);
    - checkpoints: the model's current weights are streamed by swapio.offload.save_checkpoint (the shards and
      index save_pretrained writes, never a full state dict in RAM), the optimizer by opt.save
      (StreamingCheckpointCallback, added unless a swapio checkpoint callback is given); resume_from_checkpoint
      reads only the resident tensors from the checkpoint, and the optimizer's load rewrites every offloaded
      weight from its fp32 master; a peft model's adapters are saved and resumed by Trainer (resident);
    - DDP / FSDP / DeepSpeed over offloaded weights: a ValueError (not supported).
    For a resident model, only with an optimizer that updates its GPU parameters during backward (in_backward=True):
    the norm Trainer logs with max_grad_norm=0 is taken without rewriting the gradients, and max_grad_norm > 0 or
    gradient accumulation is a ValueError when the trainer is built."""

    # Trainer's, which the mixin is put in front of (annotations only, for type checkers)
    model: Any
    args: Any
    accelerator: Any
    optimizer: Any
    processing_class: Any
    callback_handler: Any
    add_callback: Callable[..., Any]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[call-arg]
        if not _offloaded(self.model):
            self._check_in_backward(self.optimizer)  # (a GPU model's optimizer with in_backward=True)
            return
        if not any(isinstance(c, _SavesBeforeTrainer) for c in self.callback_handler.callbacks):
            self.add_callback(StreamingCheckpointCallback())
        self.add_callback(_OffloadedGrads())
        self._check_in_backward(self.optimizer)
        if self.args.load_best_model_at_end and not _peft_model(self.model):
            # Trainer would load the best checkpoint with load_state_dict after the whole run, which cannot change
            # offloaded weights: refused here, before training, instead of at its end
            raise ValueError("load_best_model_at_end=True is not supported for a model offloaded by swapio.offload "
                             "(Trainer loads the best checkpoint with load_state_dict, which cannot change offloaded "
                             "weights): train with load_best_model_at_end=False, then offload the best checkpoint "
                             "(trainer.state.best_model_checkpoint) with swapio.offload.from_pretrained or "
                             "disk_offload(model, checkpoint=...)")

    def _check_in_backward(self, optimizer: Any) -> None:
        """ValueError, before any weight changes, for what an optimizer with in_backward=True cannot do: clip (it
        updates each module during backward) or accumulate gradients over several backward passes."""
        if _offloaded(self.model):
            opt = _owned_optimizer(optimizer)
            active = opt is not None and opt._offloaded.in_backward
        else:  # a resident model: backward updates its parameters only where they are on a GPU
            opt = _offload_optimizer(optimizer)
            active = opt is not None and opt._updates_gpu_in_backward
        if not active:
            return
        if self.args.max_grad_norm:
            raise ValueError(f"max_grad_norm={self.args.max_grad_norm}, but the {type(opt).__name__} has "
                             "in_backward=True, which updates each module during backward, before the global norm "
                             "exists: pass max_grad_norm=0 (no clipping), or build the optimizer with "
                             "in_backward=False to clip")
        if self.args.gradient_accumulation_steps > 1:
            raise ValueError(f"gradient_accumulation_steps={self.args.gradient_accumulation_steps}, but the "
                             f"{type(opt).__name__} has in_backward=True, where every backward is one step: pass "
                             "gradient_accumulation_steps=1, or build the optimizer with in_backward=False")

    def _move_model_to_device(self, model: Any, device: Any) -> None:
        if not _offloaded(model):
            super()._move_model_to_device(model, device)  # type: ignore[misc]

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()  # type: ignore[misc]
        if not _offloaded(self.model):
            self._log_norm_without_clipping()
            return
        accelerator = self.accelerator
        kind = str(getattr(accelerator.distributed_type, "value", accelerator.distributed_type))  # DistributedType
        if kind != "NO" or self.args.world_size > 1:
            raise ValueError(f"training a model offloaded by swapio.offload under {kind} "
                             "is not supported: its offloaded weights live in one process's offload storage and "
                             "optimizer (no DDP, FSDP or DeepSpeed over them); train on one process")
        accelerator.device_placement = False  # prepare() leaves the model where swapio streams it
        generic = accelerator.clip_grad_norm_

        def clip_grad_norm_(parameters: Any, max_norm: float, norm_type: float = 2) -> Any:
            opt = _owned_optimizer(self.optimizer)
            if opt is None:
                return generic(parameters, max_norm, norm_type=norm_type)
            if opt._offloaded.in_backward and max_norm == float("inf"):
                return None  # only the logged norm (max_grad_norm=0): backward already stepped, none to give
            return opt.clip_grad_norm_(max_norm, norm_type, parameters=parameters)  # torch's order: its bits

        setattr(accelerator, "clip_grad_norm_", clip_grad_norm_)  # this instance only

    def _log_norm_without_clipping(self) -> None:
        """A resident model: Trainer takes the norm it logs with max_grad_norm=0 through
        accelerator.clip_grad_norm_(params, inf), which rewrites every gradient (times 1). An optimizer updating GPU
        parameters during backward (in_backward=True) refuses a gradient changed after its update at step(), so it
        gets the same norm without the rewrite."""
        accelerator = self.accelerator
        generic = accelerator.clip_grad_norm_

        def clip_grad_norm_(parameters: Any, max_norm: float, norm_type: float = 2) -> Any:
            opt = _offload_optimizer(self.optimizer)
            if opt is None or not opt._updates_gpu_in_backward or max_norm != float("inf"):
                return generic(parameters, max_norm, norm_type=norm_type)
            grads = [p.grad for p in parameters if p.grad is not None]
            return torch.nn.utils.get_total_norm(grads, norm_type) if grads else torch.tensor(0.0)

        setattr(accelerator, "clip_grad_norm_", clip_grad_norm_)  # this instance only

    def create_optimizer(self, model: Any = None) -> Any:
        optimizer = super().create_optimizer(model)  # type: ignore[misc]
        if _offloaded(self.model) and _owned_optimizer(optimizer) is None \
                and any(p.device.type == "meta" and p.requires_grad for p in self.model.parameters()):
            raise ValueError(f"{type(optimizer).__name__} cannot train the offloaded weights of this model: give "
                             "Trainer an OffloadAdamW, OffloadAdam, OffloadLion or OffloadAdafactor (swapio.optim) "
                             "built over model.parameters(), with optimizers=(opt, scheduler) or "
                             "optimizer_cls_and_kwargs")
        self._check_in_backward(optimizer)
        return optimizer

    def _save(self, output_dir: Optional[str] = None, state_dict: Any = None) -> None:
        if not _offloaded(self.model) or _peft_model(self.model):
            return super()._save(output_dir, state_dict)  # type: ignore[misc]
        from ..offload import save_checkpoint
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if not self.args.should_save:
            return None
        os.makedirs(output_dir, exist_ok=True)
        save_checkpoint(self.model, output_dir)  # shards + model.safetensors.index.json, as save_pretrained writes
        config = getattr(self.model, "config", None)
        if config is not None and hasattr(config, "save_pretrained"):
            config.save_pretrained(output_dir)
        # the rest as Trainer._save writes it: the tokenizer (or the data collator's) and the training arguments
        tokenizer = self.processing_class
        if tokenizer is None:
            tokenizer = getattr(getattr(self, "data_collator", None), "tokenizer", None)
        if tokenizer is not None:
            tokenizer.save_pretrained(output_dir)
        import torch
        from transformers.trainer import TRAINING_ARGS_NAME
        torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))
        return None

    def _load_optimizer_and_scheduler(self, checkpoint: Optional[str]) -> None:
        # a reference in optimizer.pt is looked for in this checkpoint first: a moved or copied one resumes
        with reference.resuming_from(checkpoint):
            super()._load_optimizer_and_scheduler(checkpoint)  # type: ignore[misc]

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        model = self.model if model is None else model
        if not _offloaded(model) or _peft_model(model):
            return super()._load_from_checkpoint(resume_from_checkpoint, model)  # type: ignore[misc]
        _load_resident(model, resume_from_checkpoint)
        return None


def _load_resident(model: Any, directory: str) -> None:
    """Copies the checkpoint's values into the model's resident tensors (kept_resident modules, buffers), one
    tensor at a time; offloaded weights (meta placeholders) are left to the optimizer's load, which rewrites them
    from their fp32 master. The checkpoint comes from outside: its headers and index are checked by
    swapio.safetensors (shards inside the directory), and every tensor's shape and dtype before any is copied (a
    copy_ would broadcast or cast a wrong one silently); a tensor missing from it is a ValueError, unless it is tied
    to one found (save_checkpoint stores a tie once)."""
    from safetensors import safe_open
    from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME
    import torch
    from ..safetensors import check_against, open_checkpoint
    if not any(os.path.isfile(os.path.join(directory, n)) for n in (SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME)):
        raise FileNotFoundError(f"{directory} holds no model weights ({SAFE_WEIGHTS_INDEX_NAME} or "
                                f"{SAFE_WEIGHTS_NAME})")
    checkpoint = open_checkpoint(directory)
    wanted = {name: t for name, t in model.state_dict(keep_vars=True).items()
              if isinstance(t, torch.Tensor) and t.device.type != "meta"}
    found = {name: check_against(checkpoint, name, t.shape, t.dtype, directory)
             for name, t in wanted.items() if name in checkpoint}
    stored = {id(wanted[name]) for name in found}
    for name, t in wanted.items():
        if name not in found and id(t) not in stored:
            check_against(checkpoint, name, t.shape, t.dtype, directory)  # the ValueError of a missing tensor
    with torch.no_grad():
        for name, loc in found.items():
            with safe_open(loc.path, framework="pt") as f:
                wanted[name].copy_(f.get_tensor(name))


def _swapio_trainer() -> Any:
    from transformers import Trainer

    class SwapioTrainer(OffloadedTrainerMixin, Trainer):
        """Trainer that also trains models offloaded by swapio.offload (OffloadedTrainerMixin)."""

    return SwapioTrainer


SwapioTrainer = _swapio_trainer()
