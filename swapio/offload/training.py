"""Trainable offloaded weights: the streamer's side (gradients out, new weights in).

model.parameters() of an offloaded model yields each offloaded weight's meta placeholder, one object per weight
(ties kept). An owner (a TrainableOwner, trainable.py: swapio.optim's OffloadedParams) claims their slots: it
keeps the fp32 master with the moments and rewrites the compute-dtype copy in the offload storage at every step
(weight_store.py), so the next forward reads the new weights. swapio.offload calls the owner only through
TrainableOwner; the owner calls only Training's public methods below (the "for owners" section).

Gradients: each forward with grad enabled makes a fresh leaf Parameter of every trainable weight it fetches
(watch()). Once autograd has accumulated that leaf's gradient (a post-accumulate-grad hook, so the leaf's .grad
never outlives the call), the gradient is handed to the slot's owner and the leaf's .grad dropped; every 64 MiB
of gradients handed over, the C heap gives its free pages back (core/heap.py). `made` holds, per slot, the
leaves forwards made since the last step() and those of the step before still alive (a forward before step()
may have its backward after it), `arrived` per backward (autograd graph task) the leaves it brought a
gradient of. When the running backward will reach no other leaf of the slot (autograd says which it will: not
those of a forward whose loss this is not, nor a checkpoint's recomputation), the slot's gradient of this backward
is complete, which is when an optimizer stepping in backward may update it; an incomplete one ends at the
backward's end. Each backward is one gradient, as torch's .grad gets one per backward (gradient hooks run once per
backward on it), and backwards that overlap (two threads, a reentrant checkpoint's inside another) are kept apart.
A backward that raised gets no end: autograd frees its final callback uncalled (core/backward_end.py), and the uses it
brought of an incomplete gradient are dropped, as autograd drops a leaf's inputs it had not yet accumulated.
A trainable weight with no owner is a ValueError at its first gradient: a torch optimizer would step the
placeholder, a silent no-op.

One gradient's path: autograd -> watch()'s hook -> _arrived -> owner.gradient (optim/offloaded.py: summed, or
handed to the update worker) -> the owner's update: begin(record) -> the optimizer's kernel writes the new
values into view(buf, slot) -> end(record, buf) -> the weight store writes the record (weight_store.py) -> the
next forward fetches it (fetch.py).
"""
import weakref

import torch

from ..core import _checksum
from ..core._fork_lock import ForkAwareLock
from ..core.backward_end import on_backward_end
from ..core.heap import HeapTrim
from .compiled import methods_run_eagerly
from .trainable import TrainableOwner
from .units import FORWARD
from .weight_store import current_value

_by_placeholder = {}  # id(placeholder) -> (weakref to it, weakref to Training, slot); tensors compare by value
OWNERS = "OffloadAdamW, OffloadAdam, OffloadLion or OffloadAdafactor (swapio.optim)"


def _forget(key):
    """Drops the entry under `key` once its placeholder or its Training is gone. The Training's going matters: a
    model dropped without remove_offload never unregisters, and the entry's slot holds the placeholder, so the
    placeholder's own going never came (every dropped model's slots, records and units stayed for good)."""
    entry = _by_placeholder.get(key)
    if entry is not None and (entry[0]() is None or entry[1]() is None):
        del _by_placeholder[key]


def _entry(t, training, slot):
    key = id(t)
    return key, (weakref.ref(t, lambda _, k=key: _forget(k)), weakref.ref(training, lambda _, k=key: _forget(k)),
                 slot)


def lookup(p):
    """(Training, slot) of an offloaded weight's placeholder, or None for any other tensor."""
    entry = _by_placeholder.get(id(p))
    if entry is None or entry[0]() is not p:
        return None
    training = entry[1]()
    return None if training is None else (training, entry[2])


# A backward called inside a compiled function (a compiled training step: loss.backward() then opt.step()) runs
# autograd's hooks and final callbacks under dynamo, which traced into them and failed on the gradient markers
# ("storage_offset() on p.grad of the offloaded weight"). They hand gradients to the optimizer: eager.
_EAGER_GRADIENTS = ("an offloaded weight's gradient leaves for the swapio optimizer that trains it from autograd's "
                    "hooks, which run eagerly; compile without fullgraph=True")


@methods_run_eagerly("_arrived", "_backward_ended", reason=_EAGER_GRADIENTS)
class Training:
    """Per offloaded model: who owns each trainable slot, and the gradients in flight."""

    def __init__(self, streamer, store):
        self._streamer = weakref.ref(streamer)
        self._store = store  # WeightStore: where the compute-dtype copies are rewritten
        self.owners = {}    # slot -> weakref to the TrainableOwner that owns it
        self.made = {}      # slot -> weakrefs to the leaves forwards made since the last step()
        self.made_before = {}  # slot -> those of the forwards before it still alive at that step()
        self.arrived = {}   # graph task (a backward) -> {slot: [ids of the leaves it brought a gradient of, complete]}
        self.lock = ForkAwareLock("this offloaded model", FORWARD)  # (a fork child: see units.Unit.lock)
        self.closed = False  # remove_offload: the model's weights are resident again, no longer these slots
        self.reported = None  # report(): an error of a gone owner's updates, for the next forward or remove_offload
        self.heap = HeapTrim()  # gradients freed one after another in backward: the heap gives their pages back
        self.rewrites = {}  # slot -> how many times a rewrite of its record changed it (end()): what the tokens of
        # a backward check
        self.aborts = {}  # record -> rewrites given up (abort()): with `rewrites`, when a checksum() is stale
        self._checksums = {}  # slot -> ((its rewrites, its record's aborts), checksum of its value)

    @property
    def streamer(self):
        return self._streamer()

    def register(self, slots):
        for slot in slots:
            if slot.is_param:
                key, entry = _entry(slot.placeholder, self, slot)
                _by_placeholder[key] = entry

    def register_stand_in(self, slot):
        """lookup() finds the slot from its stand-in too (grafting.py: shown while the model is put under a module
        of its own, until its next forward): an optimizer built from that module's parameters before the forward
        gets the stand-ins, and takes each for its placeholder (OffloadedParams.placeholder_for)."""
        if slot.is_param and slot.stand_in is not None:
            key, entry = _entry(slot.stand_in, self, slot)
            _by_placeholder[key] = entry

    def unregister(self, slots):
        self.closed = True
        for slot in slots:
            for t in (slot.placeholder, slot.stand_in):
                entry = _by_placeholder.get(id(t))
                if t is not None and entry is not None and entry[1]() is self:
                    del _by_placeholder[id(t)]

    # ---- for owners: ownership ------------------------------------------------------------------------------
    def claim(self, slot, owner):
        """`owner` (a TrainableOwner) takes the gradients of `slot` and rewrites its weight. ValueError when another
        owner has it."""
        if not isinstance(owner, TrainableOwner):
            raise TypeError(f"an owner of offloaded weights must be a swapio.offload.trainable.TrainableOwner, got "
                            f"{type(owner).__name__}")
        with self.lock:
            current = self.owners.get(slot)
            current = current() if current is not None else None
            if current is not None and current is not owner:
                raise ValueError(f"the offloaded weight {slot.name!r} is already trained by another swapio optimizer "
                                 "(close() it, or give each optimizer its own weights)")
            self.owners[slot] = weakref.ref(owner)

    def release(self, owner):
        """`owner` gives up every slot it claimed."""
        with self.lock:
            for slot in [s for s, o in self.owners.items() if o() is owner or o() is None]:
                del self.owners[slot]

    def owned(self, slot):
        """An owner (a swapio optimizer) trains the slot's weight now."""
        with self.lock:
            return self._owner_of(slot) is not None

    def can_rewrite(self, records):
        """The records' bytes may be rewritten (not read in place from a checkpoint with no offload_dir)."""
        return self._store.can_rewrite(records)

    def check_attached(self, slot):
        """RuntimeError for an owner of `slot` once the model is no longer offloaded (see attached)."""
        if not self.attached:
            raise RuntimeError(f"the model holding the offloaded weight {slot.name!r} was remove_offload()ed (or "
                               "dropped): its weights are resident parameters now, which this optimizer does not "
                               "own; build a new optimizer over model.parameters()")

    @property
    def attached(self):
        """The model is still offloaded (not remove_offload()ed or dropped): its slots' weights are the owner's."""
        return not self.closed and self.streamer is not None

    def in_order(self, records):
        """`records` in the order the streamer fetches them: the order rewrites begin in (see RecordTurns)."""
        wanted = set(records)
        return [r for r in self.streamer.records if r in wanted]

    # ---- for owners: rewriting the weights ---------------------------------------------------------------------
    def prepare(self, records, batch_bytes):
        """Before the first update: the records move into storage swapio may write (weight_store.ensure_owned),
        and the store's pinned pool may hold batch_bytes of records begun together."""
        self._store.ensure_owned(records)
        self._store.reserve(batch_bytes)

    def begin(self, record, need_current, idle=False):
        """Starts rewriting `record`: its memory (uint8) to write the new values into, holding the current ones when
        need_current. One rewrite of a record at a time: a second begin() waits for end() or abort(). idle: no
        module of the model runs until flush() or return_loans() (an optimizer's step()), so the memory may be
        what the streamer keeps for weights and does not use meanwhile."""
        return self._store.begin(record, need_current, idle)

    @staticmethod
    def view(buf, slot):
        """The tensor of `slot` inside its record's memory from begin(), to write its new value into."""
        return slot.record.view(buf, slot, writable=True)

    def end(self, record, buf, keep=(), changed=None):
        """Writes the record's new bytes (asynchronously: flush() waits). keep: slots whose bytes in buf were not
        written (an update that failed before them) and must keep their old value. changed: the slots given new
        values (None: all of them)."""
        for slot in record.slots if changed is None else changed:
            self.rewrites[slot] = self.rewrites.get(slot, 0) + 1
        self._store.end(record, buf, keep=keep)

    def abort(self, record):
        """Gives a begin() up: the record keeps the bytes it had."""
        self.aborts[record] = self.aborts.get(record, 0) + 1  # (its slots' bytes should be as they were: see checksum)
        self._store.abort(record)

    def flush(self):
        """Waits for the writes of ended rewrites; raises the first error."""
        self._store.flush()

    def return_loans(self):
        """Waits for the writes from the streamer's memory (idle begins) and gives it back; errors stay for
        flush(). After a step that failed before its flush()."""
        self._store.return_loans()

    def report(self, error):
        """An owner that is going away hands over an error about its updates of this model that it can no longer
        raise itself (an in_backward optimizer dropped right after backward, whose update failed): the next forward
        or remove_offload raises it, once. The first one is kept."""
        with self.lock:
            if self.reported is None:
                self.reported = error

    def current(self, slot):
        """A CPU copy of the slot's value as the streamer reads it now."""
        return current_value(self.streamer.fetcher, slot)

    def checksum(self, slot):
        """The checksum (core/_checksum.py) of the slot's value as the streamer reads it now, read and computed again
        only once a rewrite changed it (end()) or one of its record was given up (abort(): counted as a change, to
        be safe): an optimizer's checkpoints record the weights it holds no state of (a frozen base passed to it),
        and each would otherwise read them all. A value read while a rewrite runs is cached under counts that its
        end() or abort() moves."""
        self.check_attached(slot)  # else a resident parameter now, which may change without a rewrite
        generation = (self.rewrites.get(slot, 0), self.aborts.get(slot.record, 0))
        cached = self._checksums.get(slot)
        if cached is not None and cached[0] == generation:
            return cached[1]
        value = _checksum.digest(self.current(slot).contiguous())
        self._checksums[slot] = (generation, value)
        return value

    def pinned(self):
        """{part: {"bytes": pinned now, "budget": the most it holds}} of the model's pinned memory: the weights'
        ring, spare or pinned host copies (fetch.py) and the store's pool (weight_store.py)."""
        return {**self.streamer.fetcher.pinned(), **self._store.pinned()}

    @property
    def on_cuda(self):
        """The model computes on a CUDA device (its gradients arrive there)."""
        return self.streamer.device.type == "cuda"

    # ---- the streamer's side: calls to the owners --------------------------------------------------------------
    def settle(self):
        """Waits for the updates the owners run on their own threads (in_backward) before a forward reads weights."""
        for owner in self._owners_alive():
            owner.settle()
        self._raise_reported()

    def check_backward(self, record):
        """A backward needs the record's weights: RuntimeError from an owner that already updated it in this
        backward (in_backward=True: a second backward before step(), e.g. retain_graph=True)."""
        for owner in self._owners_alive():
            owner.check_backward(record)

    def flush_owners(self):
        """remove_offload: every owner finishes its updates and their writes (TrainableOwner.flush)."""
        for owner in self._owners_alive():
            owner.flush()
        self._raise_reported()

    def _raise_reported(self):
        with self.lock:
            error, self.reported = self.reported, None
        if error is not None:
            raise error

    def _owner_of(self, slot):
        ref = self.owners.get(slot)
        return ref() if ref is not None else None

    def _owners_alive(self):
        return {o for o in (r() for r in list(self.owners.values())) if o is not None}

    # ---- gradients --------------------------------------------------------------------------------------------
    def watch(self, slot, leaf):
        """A forward made `leaf` for the trainable `slot`: its gradient goes to the slot's owner."""
        with self.lock:
            leaves = self.made.setdefault(slot, [])
            if len(leaves) >= 8:  # forwards whose backward never ran (evaluation with grad enabled): not kept
                leaves[:] = [r for r in leaves if r() is not None]
            leaves.append(weakref.ref(leaf))
        leaf.register_post_accumulate_grad_hook(lambda t: self._arrived(slot, t))

    def _arrived(self, slot, leaf):
        grad, leaf.grad = leaf.grad, None
        if not slot.requires_grad:
            # frozen (requires_grad_(False) on model.parameters()) since the forward made the leaf: autograd's
            # AccumulateGrad drops the gradient of a parameter that no longer requires grad, so this one goes too
            # (the slot then counts as incomplete: its record's other weights are stepped by step())
            return
        task = torch._C._current_graph_task_id()
        with self.lock:
            seen = self.arrived.get(task)
            new = seen is None
            if new:
                seen = self.arrived[task] = {}
            entry = seen.setdefault(slot, [set(), False])
            entry[0].add(id(leaf))
            others = [o for o in (r() for r in self._leaves(slot)) if o is not None and id(o) not in entry[0]]
        complete = not any(_will_reach(o) for o in others)
        if complete:
            entry[1] = True
        if new and task >= 0:
            on_backward_end(self._backward_ended, task)
        owner = self._owner_of(slot)
        if owner is None:
            raise ValueError(f"a gradient reached the offloaded weight {slot.name!r}, which requires grad, but no "
                             f"swapio optimizer owns it: build an {OWNERS} over model.parameters() to train it (a "
                             "torch.optim optimizer would step the meta placeholder and never update the weight), "
                             "or freeze it (requires_grad_(False)), or keep its module resident with "
                             "keep_resident=[...]")
        nbytes = grad.numel() * grad.element_size()
        owner.gradient(slot, grad, complete, task)
        del grad  # summed or queued by the owner: its heap memory comes back with the next trim
        self.heap.freed(nbytes)

    def _backward_ended(self, task, ended):
        """The end of a backward that brought gradients (ended): slots some of whose leaves got none have their
        gradient of this backward in full all the same. Or its failure (not ended: it raised): every slot it
        brought a gradient of is abandoned (the uses of an incomplete one are lost)."""
        with self.lock:
            seen = self.arrived.pop(task, {})
            short = [s for s, (_, complete) in seen.items() if not complete or not ended]
        error = None
        for slot in short:
            owner = self._owner_of(slot)
            if owner is None:
                continue
            if ended and error is None:
                try:
                    owner.backward_ended(slot, task)
                    continue
                except BaseException as e:  # noqa: B036 - fails the backward once the rest are dropped
                    error = e
            owner.backward_abandoned(slot, task)  # a failed backward's: nothing of it may stay for the next
        if error is not None:
            raise error

    def complete(self, slot, task):
        """Every leaf of the slot got its gradient in the backward `task` (the one gradient() was given)."""
        with self.lock:
            entry = self.arrived.get(task, {}).get(slot)
            return entry[1] if entry is not None else not (self.made.get(slot) or self.made_before.get(slot))

    def _leaves(self, slot):
        return self.made.get(slot, []) + self.made_before.get(slot, [])

    def reset(self, stepped):
        """step() (stepped) / zero_grad(): the gradients of backward passes that did not end are dropped. The leaves
        of forwards made before a step() stay while their graphs live, until the next step(): a forward made before
        step() (a GAN's generator loss) may have its backward after it, and its weights' gradients are complete
        only once every leaf it made got one. Older ones are let go, so that graphs a program keeps (losses
        summed or appended without .item()) cost no time in each later backward."""
        with self.lock:
            for slot, refs in list(self.made.items()):
                refs[:] = [r for r in refs if r() is not None]
                if not refs:
                    del self.made[slot]
            if stepped:
                self.made_before, self.made = self.made, {}
            self.arrived.clear()


def _will_reach(leaf):
    """The running backward will still accumulate a gradient into `leaf` (its AccumulateGrad is in its graph)."""
    if not leaf.requires_grad:  # frozen since its forward: autograd accumulates nothing into it
        return False
    with torch.enable_grad():
        node = leaf.view_as(leaf).grad_fn.next_functions[0][0]
    return torch._C._will_engine_execute_node(node)

