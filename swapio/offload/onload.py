"""accelerate's offload-hook protocol on the offloaded modules peft wraps: peft's merges reach the stored weights.

peft changes a base weight in place (merge_and_unload, merge_adapter and unmerge_adapter add or subtract the
adapter's delta to `base_layer.weight.data`) inside its onload_layer(layer) context, which, for a base layer
whose `_hf_hook` is an accelerate AlignDevicesHook with offload=True, calls hook.pre_forward(base_layer) first
(the weights come in) and hook.post_forward(base_layer, ...) after (they go back to the offload storage).
Between forwards a swapio-offloaded weight is a meta placeholder, so without such a hook the delta went into
nothing and the merged model silently computed without the adapter. So every offloaded module that is a peft
tuner layer's `base_layer` (wrapped after offloading, or inside a peft model offloaded whole) carries an
OnloadHook as `_hf_hook`: pre_forward puts a private copy of each of its offloaded weights in place,
post_forward writes those that changed where the streamer reads them (as an optimizer step writes trained
weights: training.py, weight_store.py) and puts the placeholders back. accelerate's align_module_device works
the same way on such a module.

What cannot be written is refused in pre_forward, before anything changed: weights read in place from a
checkpoint (disk_offload(checkpoint=...) without offload_dir, from_pretrained), which swapio never writes to,
and weights a swapio optimizer trains (its fp32 master would overwrite the merged weight at its next step).
peft calls the same onload for unload() (no merge), which swapio cannot tell apart, so it is refused there too.
accelerate is imported only when a module gets the hook (peft depends on it).
"""
import weakref

import torch

from ..core._signals import DeferredSigint
from .no_copy import refuse_copy
from .units import check_unchanged, get_entry, set_entry
from .weight_store import current_value

ACTIONS = ("peft's merge_and_unload, merge_adapter, unmerge_adapter and unload (and accelerate's "
           "align_module_device)")


class _Onload:
    """The methods of OnloadHook (see the module); the class itself also derives from accelerate's
    AlignDevicesHook, which peft and accelerate check with isinstance."""

    def setup(self, streamer, unit, before):
        self._streamer, self._unit, self._before = weakref.ref(streamer), unit, before
        self._in = None  # while brought in: [(attr, kind, slot, tensor put in place, its value then, on the CPU)]
        self.original_devices = {attr: streamer.device for attr, _, _ in unit.entries}  # none on meta: peft's disk
        # path (rewriting accelerate's offload folder) is not taken

    def _live(self):
        streamer = self._streamer()
        module = self._unit.module
        if streamer is None or module is None or not streamer.training.attached:
            raise RuntimeError("this module is no longer offloaded by swapio (remove_offload ran): its weights are "
                               "resident, nothing to bring in")
        return streamer, module

    def pre_forward(self, module, *args, **kwargs):
        streamer, own = self._live()
        unit = self._unit
        with unit.lock:
            if unit.depth:
                raise RuntimeError(f"{unit.name or 'the model'}'s offloaded weights cannot be brought in to be "
                                   "changed while its forward runs")
            if self._in is not None:  # a pre_forward whose post_forward never came (an error in between)
                self._put_back(own, self._in)
                self._in = None
            slots = list(dict.fromkeys(slot for _, _, slot in unit.entries))
            _check_writable(streamer, slots)
            self._before(streamer)  # stand-ins (grafting.py) give way to the placeholders first
            streamer.training.settle()
            check_unchanged((unit,))
            device = torch.device(self.execution_device) if self.execution_device is not None else streamer.device
            values = {}
            for slot in slots:
                value = current_value(streamer.fetcher, slot)  # a CPU copy
                t = value.to(device, copy=True)
                if slot.is_param:
                    t = torch.nn.Parameter(t, requires_grad=slot.requires_grad)
                values[slot] = (t, value)
            entries = []
            for attr, kind, slot in unit.entries:
                set_entry(own, attr, kind, values[slot][0])
                entries.append((attr, kind, slot) + values[slot])
            self._in = entries
        return args, kwargs

    def post_forward(self, module, output):
        streamer, own = self._live()
        unit = self._unit
        with unit.lock:
            entries, self._in = self._in, None
            if entries is None:
                return output
            try:
                changed = _changed(own, entries)
                if changed:
                    _write(streamer, changed)
            finally:
                self._put_back(own, entries)
                self.weights_map = None  # peft leaves CPU copies of the merged weights here
        return output

    @staticmethod
    def _put_back(own, entries):
        for attr, kind, slot, *_ in entries:
            set_entry(own, attr, kind, slot.placeholder)

    def init_hook(self, module):
        return module

    def detach_hook(self, module):  # accelerate's remove_hook_from_module: swapio's weights stay where they are
        return module

    def __repr__(self):
        return f"swapio OnloadHook({self._unit!r})"

    def __reduce_ex__(self, protocol):
        refuse_copy()

    def __deepcopy__(self, memo):
        refuse_copy()


_classes = []  # the OnloadHook class, made at the first use (accelerate imported then)


def _hook_class():
    if not _classes:
        from accelerate.hooks import AlignDevicesHook
        _classes.append(type("OnloadHook", (_Onload, AlignDevicesHook), {}))
    return _classes[0]


def _check_writable(streamer, slots):
    training = streamer.training
    trained = next((s for s in slots if training.owned(s)), None)
    if trained is not None:
        raise RuntimeError(f"{trained.name} is trained by a swapio optimizer, which keeps its fp32 master and would "
                           f"overwrite a change made here at its next step: {ACTIONS} cannot change it. Close the "
                           "optimizer (opt.close()) first, or merge before building it")
    records = list(dict.fromkeys(s.record for s in slots))
    if not training.can_rewrite(records):
        raise ValueError(f"{slots[0].name} is read in place from a checkpoint, which swapio never writes to, so "
                         f"{ACTIONS} have nowhere to put a changed weight. Offload with disk_offload(model, "
                         "checkpoint=..., offload_dir=<a directory>) (changed weights are written to offload_dir), "
                         "or save the adapter (peft_model.save_pretrained writes it alone) and merge it on a "
                         "resident base model")


def _changed(own, entries):
    """{slot: its new value} of the weights changed since pre_forward (in place, or assigned a new tensor)."""
    changed = {}
    for attr, kind, slot, _, before in entries:
        now = get_entry(own, attr, kind)
        if not isinstance(now, torch.Tensor) or now.device.type == "meta":
            raise RuntimeError(f"{slot.name} was taken away while brought in (the module's forward ran, or it was "
                               "deleted): a change made to it is lost")
        if tuple(now.shape) != slot.shape or now.dtype != slot.dtype:
            raise RuntimeError(f"{slot.name} was given shape {tuple(now.shape)} and dtype {now.dtype}, but it is "
                               f"offloaded as {slot.shape} {slot.dtype}: an offloaded weight keeps its shape and "
                               "dtype (remove_offload first to change them)")
        new = now.detach().to("cpu").contiguous()
        if not torch.equal(new.view(-1).view(torch.uint8), before.view(-1).view(torch.uint8)):
            changed[slot] = new
    return changed


def _write(streamer, changed):
    """Writes the changed weights where the streamer reads them, a record at a time, and waits for the writes.
    No module runs meanwhile (idle): the records are written from the streamer's unused pinned memory."""
    training = streamer.training
    records = training.in_order({slot.record for slot in changed})
    training.prepare(records, 0)
    try:
        for record in records:
            with DeferredSigint():  # a record begun is ended or aborted before a Ctrl-C acts
                buf = training.begin(record, need_current=True, idle=True)
                try:
                    for slot in record.slots:
                        if slot in changed:
                            training.view(buf, slot).copy_(changed[slot])
                except BaseException:
                    training.abort(record)
                    raise
                training.end(record, buf, changed=[slot for slot in record.slots if slot in changed])
    except BaseException:
        training.return_loans()  # the streamer's memory back before it runs again
        raise
    training.flush()


def attach(streamer, module, before):
    """Gives the offloaded `module` (a unit's module: peft's base layer) an OnloadHook, unless it has a hook.
    before(streamer): what the hook runs before bringing weights in (grafting.restore: stand-ins give way)."""
    unit = next((u for u in streamer.units if u.module is module), None)
    if unit is None or "_hf_hook" in module.__dict__:
        return
    hook = _hook_class()(execution_device=streamer.device, offload=True)
    hook.setup(streamer, unit, before)
    module._hf_hook = hook


def attach_base_layers(streamer, before):
    """OnloadHooks on the units that are peft base layers already (a peft model offloaded whole)."""
    for unit in streamer.units:
        if unit.name == "base_layer" or unit.name.endswith(".base_layer"):
            attach(streamer, unit.module, before)


def remove(units):
    """Takes swapio's OnloadHooks off (remove_offload; idempotent)."""
    for unit in units:
        module = unit.module
        if module is not None and isinstance(module.__dict__.get("_hf_hook"), _Onload):
            del module.__dict__["_hf_hook"]
