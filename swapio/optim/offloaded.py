"""An optimizer's offloaded parameters: weights of a model offloaded by swapio.offload that it trains.

Such a parameter is the weight's meta placeholder (what model.parameters() yields); the optimizer keeps its fp32
master with the moments (state field "master", in RAM or in the swap file) and, after each update, writes the
compute-dtype copy back into the offload storage, a record (a module's weights) at a time
(swapio.offload.weight_store). OffloadedParams is the models' TrainableOwner (swapio.offload.trainable): the
streamer's hooks hand it each gradient (swapio.offload.training), off the execution device as soon as each
module's backward produced them, and it calls only the Training object's public methods. Gradients are either
  summed in fp32 (grad_store: RAM in cpu mode, a file beside the state in nvme mode) until step(), or,
  with in_backward=True, handed to a worker thread that updates each record as soon as all of its gradients are
  in, while backward goes on with earlier modules: the gradient is never stored. step() waits for that worker,
  updates what backward left (weights whose gradient was still incomplete) and then the resident parameters.
Records are updated in batches (consecutive records, up to batch_bytes of gradients) so that the state pipeline
flows from one record to the next; in backward, at most two batches' gradients wait for the worker, beyond
that backward waits (memory stays bounded).
The optimizer hands OffloadedParams what it needs of it, never itself: `step` (steps given weights in given memory,
see OffloadOptimizer._step_offloaded), held weakly but for the work in flight (worker.HeldStep: a backward that
handed it a gradient and the worker's runs keep the optimizer alive, so an in_backward update lands even when the
program drops the optimizer right after backward), and its state dict (the step counts), as the state backends get
theirs. An in_backward optimizer freed with work it could not finish (an update that failed, gradients step()
would have applied) hands a RuntimeError to the models, whose next forward or remove_offload raises it.
"""
import threading

import torch

from ..core import cuda_copy
from ..core._align import round_up
from ..core._errors import check_bool
from ..core._fork_lock import ForkAwareLock
from ..core._signals import DeferredSigint
from ..offload.trainable import TrainableOwner
from ..offload.training import lookup
from .grad_marker import new_marker
from .grad_store import FileGrads, RamGrads
from .finish import finish_all
from .params import FP32, MASTER
from .worker import IN_BACKWARD, HeldStep, UpdateWorker, second_backward_error


class OffloadedParams(TrainableOwner):
    """The offloaded weights one optimizer trains. step(params, grad_of, data_of): the optimizer's bound method
    that steps `params` with the gradients grad_of(p) into the compute-dtype memory data_of(p), all or nothing per
    parameter (raising while an earlier failure left its state torn); state: the optimizer's state dict (set once
    it exists)."""

    def __init__(self, step, in_backward, batch_bytes):
        in_backward = check_bool("in_backward", in_backward, "a bool")
        self.step = HeldStep(step, self._dropped)  # self.step() is the method, while the optimizer lives
        self.state = {}      # the optimizer's state dict: p -> {"step", ...}
        self.in_backward = in_backward
        self.entries = {}    # p -> (Training, slot)
        self.param_of = {}   # slot -> p
        self.grads = None    # RamGrads | FileGrads, from start()
        self.partial = {}    # in_backward: p -> fp32 gradient of this backward, until its record is updated
        self.parts = {}      # (backward, p) -> the sum of p's uses' gradients in that backward, until the last arrives
        self.markers = {}    # p -> (GradMarker set as p.grad while p has a gradient, its version then)
        self.consumed = set()  # in_backward: weights whose gradient a finished step() applied, until zero_grad()
        self.fresh = set()   # in_backward: weights that got a gradient since the last step()
        self.queued = {}     # in_backward: record handed to the worker since the last step() -> its backward
        self.failed_backwards = set()  # in_backward: backwards that raised since the last step() or zero_grad()
        self.answered = False  # in_backward: step() (or a load) was called since the last record was handed over
        self.ready = []      # in_backward: (Training, record, grads, bytes) waiting for the worker, in order
        self.ready_bytes = 0
        self.batch_bytes = batch_bytes  # gradient bytes of the records one update steps together
        self.failed = False  # an update of the worker failed since the last step() or zero_grad(): it updates no more
        self.closed = False
        # (a fork child is refused them if another thread held them at the fork, never left waiting: _fork_lock)
        self.lock = ForkAwareLock("this optimizer", IN_BACKWARD)
        self.accepting = ForkAwareLock("this optimizer", IN_BACKWARD)  # _accept: one gradient at a time (a hook
        # may hand over another)
        self.ready_changed = threading.Condition(self.lock)
        self.worker = UpdateWorker(self.lock, "swapio-in-backward")

    def __bool__(self):
        return bool(self.entries)

    def group_of(self, p):
        """The record of an offloaded weight (stepped a record at a time), else None."""
        entry = self.entries.get(p)
        return entry[1].record if entry is not None else None

    # ---- setting up --------------------------------------------------------------------------------------------
    def device_of(self, p):
        """The device p's module computes on: where a resident p's gradient would be."""
        return self.entries[p][0].streamer.device

    def placeholder_for(self, p):
        """p, or the placeholder of the offloaded weight whose stand-in p is (grafting.py): what the model's
        parameters() yield from its next forward on. A wrapper's parameters() before that forward (a backbone and
        a new head, built and given to the optimizer at once) gave the stand-ins, which were taken for resident
        parameters: the first gradient then said no swapio optimizer owned the weight."""
        found = lookup(p)
        return found[1].placeholder if found is not None else p

    def adopt(self, p):
        """Takes p if it is an offloaded weight's placeholder (claiming its slot); returns whether it did."""
        found = lookup(p)
        if found is None:
            return False
        training, slot = found
        training.claim(slot, self)
        self.entries[p], self.param_of[slot] = (training, slot), p
        return True

    def start(self, offload, backend, io_settings):
        """After the state backend exists: gradient sums beside it, and the trained records in storage swapio owns."""
        if self.grads is None:
            self.grads = FileGrads(backend.directory, io_settings) if offload == "nvme" else RamGrads()
        for training, records in self._records().items():
            training.prepare(records, self.batch_bytes)  # an update begins up to a batch of records at once

    def _records(self):
        """{Training: its records holding a weight of this optimizer, in the streamer's order}."""
        out = {}
        for training, slot in self.entries.values():
            out.setdefault(training, set()).add(slot.record)
        return {t: ordered for t, rs in out.items() if (ordered := t.in_order(rs))}

    # ---- gradients (the backward thread) --------------------------------------------------------------------
    def gradient(self, slot, g, complete, backward):
        """A gradient of `slot` arrived (complete: the last of this backward). The gradients of a weight used
        several times in a forward (ties, a module called twice) are summed first, in their own dtype and in
        arrival order, as autograd sums a leaf's inputs before accumulating them into .grad."""
        if self.in_backward:
            self.step.hold_for_backward()  # its updates are part of this backward: dropping the optimizer stops none
        self._raise_error()
        p = self.param_of[slot]
        g = cuda_copy.to_host(g)
        with self.lock:
            part = self.parts.pop((backward, p), None)
            g = g.clone() if part is None and not complete and g.device.type == "cpu" and cuda_copy.in_staging(g) else g
            g = g if part is None else part + g
            if not complete:
                self.parts[backward, p] = g
                return
        self._accept(p, slot, g, backward)

    def backward_ended(self, slot, backward):
        p = self.param_of.get(slot)
        with self.lock:
            g = None if p is None else self.parts.pop((backward, p), None)
        if g is not None:
            self._accept(p, slot, g, backward)

    def backward_abandoned(self, slot, backward):
        p = self.param_of.get(slot)
        with self.lock:
            self.parts.pop((backward, p), None)
            if self.in_backward:
                self.failed_backwards.add(backward)
        if self.in_backward:
            # the updates the failed backward handed over end before its error reaches the caller, as torch's
            # optimizer-in-backward hooks have: they use the options of then, not those the caller sets next
            # (this runs in autograd's finalizer, where a second Ctrl-C could only be printed: it waits whole)
            with DeferredSigint():
                self.worker.idle()

    def _accept(self, p, slot, g, backward=None):
        """p's whole gradient of a backward: through the hooks registered on p, as torch runs a leaf's (its
        gradient hooks, then the accumulation, then its post-accumulate-grad hooks), into the sum or the update.
        One at a time: backwards of two threads would otherwise add to one sum at once (torch's AccumulateGrad
        takes a lock too)."""
        with self.accepting:
            self._accept_one(p, slot, g, backward)

    def _accept_one(self, p, slot, g, backward):
        g = run_grad_hooks(p, g)
        if not self.in_backward:
            self._sync(p)  # what model.zero_grad() or p.grad.zero_() did since the last gradient
            self.grads.add(p, g)
            self._mark(p)
            run_post_accumulate_hooks(p)
            return
        training = self.entries[p][0]
        with self.lock:
            if self._updated_in_backward(slot.record):
                self.answered = True  # (its error names the way on: zero_grad())
                raise second_backward_error(f"{slot.name!r} got a gradient")
            if p in self.consumed and self._marker_state(p) == "kept":
                self.answered = True
                raise RuntimeError(f"{slot.name!r} got a gradient while p.grad still holds the one the last step() "
                                   "applied: torch would add the two and step with the sum, but with in_backward=True "
                                   "the last gradient is not kept. Call opt.zero_grad() (or model.zero_grad()) after "
                                   "each step(), or build the optimizer with in_backward=False")
            self.consumed.discard(p)
            self.fresh.add(p)
            s = self.partial.get(p)
            self.partial[p] = g.to(FP32, copy=True) if s is None else s.add_(g)
        self._mark(p)
        run_post_accumulate_hooks(p)
        state = self._marker_state(p)  # a hook may have dropped (p.grad = None) or zeroed the gradient
        if state != "kept":
            with self.lock:
                if state is None:
                    self.partial.pop(p, None)
                    self.fresh.discard(p)  # no gradient of this backward reaches the update (check_dropped)
                else:
                    self.partial[p].zero_()
                    self._mark(p)
        self._maybe_queue(training, slot.record, backward)

    def check_backward(self, record):
        """A backward needs the weights of `record` (training.py): refused once this backward updated them."""
        if not self.in_backward:
            return
        with self.lock:
            updated = self._updated_in_backward(record)
        if updated:
            self.answered = True
            raise second_backward_error(f"a backward needs the weights of {record}")

    def _updated_in_backward(self, record):
        """A backward since the last step() updated the record: a next backward may not, unless that backward
        raised and model.zero_grad() (p.grad = None) dropped what it applied since (then, as after opt.zero_grad(),
        the next backward is a step of its own, as with torch's optimizer-in-backward hooks)."""
        if record not in self.queued:
            return False
        if self.queued[record] in self.failed_backwards and all(
                self._marker_state(self.param_of[s]) is None for s in record.slots if s in self.param_of):
            del self.queued[record]
            return False
        return True

    def _mark(self, p):
        """p.grad shows whether p has a gradient, as .grad does in torch: a GradMarker (meta: no memory, no values)
        while it has one, so that model.zero_grad() (p.grad = None) drops it and p.grad.zero_() zeroes it."""
        marker = self.markers.get(p, (None,))[0]
        if marker is None or p.grad is not marker:
            marker = p.grad = new_marker(p, self.entries[p][1].name)
        self.markers[p] = (marker, marker._version)

    def _marker_state(self, p):
        """What p.grad says of p's gradient since the optimizer marked it: "kept", "zeroed" (p.grad.zero_()), or
        None (never marked, or set to None or replaced since: model.zero_grad())."""
        marker = self.markers.get(p)
        if marker is None or p.grad is not marker[0]:
            return None
        return "kept" if marker[0]._version == marker[1] else "zeroed"

    def _sync(self, p):
        """Makes p's gradient sum what torch's .grad would be after what was done to p.grad: dropped when it was
        set to None, zeroed when it was zeroed. Returns whether p has a sum."""
        state = self._marker_state(p)
        if state is None:
            self.markers.pop(p, None)
            self.grads.drop(p)
            return False
        if state == "zeroed":
            self.grads.zero(p)
            self._mark(p)
        return self.grads.has(p)

    def _flush_parts(self):
        """Gradients whose last use never got one (an unused output): taken as they are."""
        with self.lock:
            parts, self.parts = self.parts, {}
        for (_, p), g in parts.items():
            self._accept(p, self.entries[p][1], g)

    def _maybe_queue(self, training, record, backward):
        owned = [s for s in record.slots if s in self.param_of]
        with self.ready_changed:
            if record in self.queued or not all(training.complete(s, backward) for s in owned):
                return
            keep = self.step()  # the optimizer lives until the worker's run returns
            grads = {self.param_of[s]: self.partial.pop(self.param_of[s]) for s in owned
                     if self.param_of[s] in self.partial}
            if not grads:
                return
            nbytes = max(sum(g.nbytes for g in grads.values()), record.nbytes)
            item = (training, record, grads, nbytes)
            self.ready.append(item)
            self.ready_bytes += nbytes
            try:
                self.worker.start(self._work, keep)
            except BaseException:  # no thread (the thread limit): the gradients stay this backward's, for step()
                self.ready.remove(item)
                self.ready_bytes -= nbytes
                self.partial.update(grads)
                raise
            self.queued[record] = backward
            self.answered = False
            # backward waits while more gradients than two batches' worth wait for the worker
            while self.ready_bytes > 2 * self.batch_bytes and self.worker.working:
                self.ready_changed.wait()
        self._raise_error()

    def _work(self):
        """The worker: updates the ready records, a batch at a time (consecutive records of one model, up to
        batch_bytes of gradients: one pass of the state pipeline), until none is ready. Its error is kept in
        the worker and raised once, by the next gradient() (in backward) or by wait() (step, zero_grad...); after
        it the worker drops the batches still ready (their weights untouched) until step() or zero_grad()."""
        while True:
            with self.ready_changed:
                if not self.ready:
                    self.worker.working = None
                    self.ready_changed.notify_all()
                    return
                batch, size = [self.ready.pop(0)], 0
                size = batch[0][3]
                while self.ready and self.ready[0][0] is batch[0][0] and size + self.ready[0][3] <= self.batch_bytes:
                    batch.append(self.ready.pop(0))
                    size += batch[-1][3]
            try:
                grads = {p: g for _, _, gs, _ in batch for p, g in gs.items()}
                if not self.failed:
                    with torch.no_grad():
                        self.update(batch[0][0], [record for _, record, _, _ in batch], grads)
            except BaseException as exc:  # noqa: BLE001 - reported by _raise_error
                if not self.failed:
                    self.failed = self.worker.keep_error(exc)
            finally:
                with self.ready_changed:
                    self.ready_bytes -= size
                    self.ready_changed.notify_all()

    def _raise_error(self):
        self.worker.raise_error()

    def settle(self):
        """A forward is about to read weights: the updates handed to the worker finish first (and a dropped
        optimizer's last run has reported what it could not finish, see _dropped)."""
        working = self.worker.working
        self.worker.idle()
        if working:
            self._raise_error()

    def wait(self):
        """Waits until the worker has updated every ready record; raises the first error not raised yet."""
        self.worker.wait()

    # ---- updates -------------------------------------------------------------------------------------------
    def update(self, training, records, grads, idle=False):
        """Steps this optimizer's weights in `records` (consecutive, of one model) with grads {p: fp32 gradient}
        in one pass of the state pipeline, and writes each record back; a record none of whose weights got
        stepped (an error before it) keeps its bytes. idle: called by step(), while no module runs (see
        Training.begin)."""
        plan = [(r, [self.param_of[s] for s in r.slots if self.param_of.get(s) in grads])
                for r in training.in_order(records)]  # the order rewrites take turns in
        plan = [(r, params) for r, params in plan if params]
        steps = {p: self._step_of(p) for _, params in plan for p in params}
        begun = []
        try:
            # a record begun is in `begun` before a Ctrl-C acts, so that its end (or abort) below runs: one landing
            # as begin() returned left it marked as being rewritten, unreadable for good
            with DeferredSigint():
                for record, params in plan:
                    need_current = any(steps[p] == 0 for p in params) or len(params) < len(record.slots)
                    begun.append((record, training.begin(record, need_current, idle), need_current, params))
            data = {p: training.view(buf, self.entries[p][1]) for record, buf, _, params in begun for p in params}
            self.step()([p for _, _, _, params in begun for p in params], grads.get, data.get)
        finally:
            with DeferredSigint():  # every begun record ended, whatever lands meanwhile
                finish_all(lambda b=b: self._end(training, steps, *b) for b in begun)

    def _end(self, training, steps, record, buf, need_current, params):
        stepped = {id(p) for p in params if self._step_of(p) != steps[p]}
        if not stepped:
            training.abort(record)
            return
        kept = [self.entries[p][1] for p in params if id(p) not in stepped]  # not stepped: the old bytes
        training.end(record, buf, keep=kept if kept and not need_current else (),
                     changed=[self.entries[p][1] for p in params if id(p) in stepped])

    def _step_of(self, p):
        st = self.state.get(p)
        return int(st["step"].item()) if st and "step" in st else 0

    def _batches(self, records, nbytes_of):
        """Consecutive runs of `records` holding up to batch_bytes (at least one record each)."""
        batch, size = [], 0
        for record in records:
            n = nbytes_of(record)
            if batch and size + n > self.batch_bytes:
                yield batch
                batch, size = [], 0
            batch.append(record)
            size += n
        if batch:
            yield batch

    def check_step(self):
        """RuntimeError, before step() changes anything, when it would step again with gradients that
        in_backward=True applied already (torch would reuse .grad; here it is gone)."""
        if not self.in_backward:
            return
        again = [p for p in self.entries if p in self.consumed and self._marker_state(p) is not None]
        if again:
            names = ", ".join(repr(self.entries[p][1].name) for p in again[:3])
            raise RuntimeError(f"step() again without a new backward: p.grad of {names}"
                               f"{', ...' if len(again) > 3 else ''} still shows the gradient the last step() "
                               "applied. torch would step again with the same .grad, but with in_backward=True each "
                               "gradient is applied during backward and not kept. Call zero_grad() and backward() "
                               "before each step(), or build the optimizer with in_backward=False")

    def check_assigned(self):
        """RuntimeError, before step() or a clip changes anything, when p.grad of an offloaded weight was assigned a
        tensor of the user's (`p.grad = torch.zeros_like(p)` for a weight that got no gradient, as code that
        all-reduces or fills in missing gradients does). Such a tensor is meta, with no values to read, and was
        dropped without a word, where torch steps with it (Adam's moments and the weight decay still move a weight
        whose .grad is zero)."""
        for p in self.entries:
            g = p.grad
            if g is not None and g is not self.markers.get(p, (None,))[0]:
                raise RuntimeError(
                    f"p.grad of the offloaded weight {self.entries[p][1].name!r} was assigned a tensor "
                    f"({tuple(g.shape)} {g.dtype} on {g.device}) that is not the gradient its swapio optimizer keeps: "
                    "an offloaded weight's gradient lives in the optimizer, which cannot read values from such a "
                    "tensor (torch would step with them; a weight given p.grad = torch.zeros_like(p) still moves "
                    "with Adam's moments and the weight decay). Set p.grad = None to drop a gradient, or "
                    "p.grad.zero_() to zero one the optimizer holds; a weight that got no gradient cannot be given "
                    "one: leave p.grad None, and step() skips it as torch's optimizers skip such a parameter")

    def check_dropped(self):
        """RuntimeError, before step() changes anything, where p.grad of a weight that a backward (one that ended)
        updated with in_backward=True was dropped or zeroed since (p.grad = None to freeze a layer for a step,
        model.zero_grad() or p.grad.zero_() before step()): torch's step() would skip that weight or step it with
        zeros, but its update has run. Before, step() went on silently."""
        if not self.in_backward:
            return
        with self.lock:
            done = {r for r, backward in self.queued.items() if backward not in self.failed_backwards}
            changed = [p for p in self.entries  # (in the optimizer's order)
                       if p in self.fresh and self.entries[p][1].record in done and self._marker_state(p) != "kept"]
        if changed:
            names = ", ".join(repr(self.entries[p][1].name) for p in changed[:3])
            raise RuntimeError(f"p.grad of {names}{', ...' if len(changed) > 3 else ''} was dropped or zeroed after "
                               "in_backward=True had already used the gradient to update the weight during backward: "
                               "torch's step() would skip it (or step it with zeros), but its update has run. To "
                               "decide after backward which weights step, build the optimizer with "
                               "in_backward=False; zero_grad() goes on from here")

    def finish(self):
        """step(): waits for the worker, then updates every weight that has a gradient and no update yet."""
        self.wait()
        self._flush_parts()
        self.check_step()
        self.check_assigned()
        self.check_dropped()
        for training, slot in self.entries.values():
            training.check_attached(slot)
        summed = set() if self.in_backward else {p for p in self.entries if self._sync(p)}
        try:
            for training, records in self._records().items():
                def owned(record):
                    return [self.param_of[s] for s in record.slots if s in self.param_of]

                def pending(record):
                    return [p for p in owned(record) if p in (self.partial if self.in_backward else summed)]

                with_grads = [r for r in records if pending(r)]
                batches = list(self._batches(with_grads, lambda r: _batch_bytes(r, pending(r))))
                wanted = [[p for r in batch for p in pending(r)] for batch in batches]
                if self.in_backward:
                    reads = [lambda ps=ps: {p: self.partial.pop(p) for p in ps} for ps in wanted]
                else:  # the next batch's sums are read while this one steps
                    reads = [None] * len(batches)
                    if batches:
                        reads[0] = self.grads.start_reads(wanted[0], 0)
                try:
                    for i, batch in enumerate(batches):
                        grads, reads[i] = reads[i](), None
                        if not self.in_backward and i + 1 < len(batches):
                            reads[i + 1] = self.grads.start_reads(wanted[i + 1], (i + 1) % 2)
                        self.update(training, batch, grads, idle=True)
                finally:  # no read may still fill an arena when the error propagates
                    if not self.in_backward:
                        finish_all(r for r in reads if r is not None)
                training.flush()
        finally:
            for training in self._records():
                training.return_loans()  # after an error: the streamer's memory back before the next forward
                training.reset(stepped=True)
            self.queued.clear()
            self.failed_backwards.clear()
            self.partial.clear()
            self.consumed |= self.fresh
            self.fresh.clear()
            self.failed = False

    def norms(self):
        """{p: the 2-norm of p's gradient sum} (clip_grad_norm_), gradients still partial included."""
        self.wait()
        self._flush_parts()
        self.check_assigned()
        for p in list(self.entries):
            self._sync(p)
        return self.grads.norms(list(self.entries))

    def flush(self):
        """Waits for the updates of the worker and the writes of the new weights (opt.save(), remove_offload)."""
        self.wait()
        for training in self._records():
            training.flush()

    def zero_grad(self, set_to_none=True):
        """Drops every gradient; set_to_none=False zeroes the sums instead, as torch zeroes .grad (a step()
        then steps with zeros). Returns whether a backward that ended (not one that raised) had updated weights
        (in_backward=True) since the last step(): a step skipped after backward, which cannot be."""
        self.wait()
        unstepped = self.in_backward and not self.answered and any(b not in self.failed_backwards
                                                                   for b in self.queued.values())
        self.answered = False
        if self.grads is not None:
            summed = [] if set_to_none or self.in_backward else [p for p in self.entries if self._sync(p)]
            if summed:
                for p in summed:
                    self.grads.zero(p)
                kept = {id(p) for p in summed}  # by identity: tensors compare by value
                for p in [p for p in self.entries if id(p) not in kept]:
                    self.grads.drop(p)
            else:
                self.grads.clear()
                self.markers.clear()
        self.partial.clear()
        self.parts.clear()
        self.queued.clear()
        self.failed_backwards.clear()
        self.consumed.clear()
        self.fresh.clear()
        self.failed = False
        for training in self._records():
            training.reset(stepped=False)
        return unstepped

    def rewrite_from_master(self, read_state):
        """After a load: every offloaded weight with state is rewritten from its fp32 master (rounded to nearest
        even, as the kernels round), so the storage holds the weights the loaded state implies. read_state(params,
        sink): the optimizer's (OffloadOptimizer.read_state)."""
        self.wait()
        for training, records in self._records().items():
            for record in records:
                owned = [self.param_of[s] for s in record.slots if s in self.param_of]
                stateful = [p for p in owned if self._step_of(p) > 0]
                if not stateful:
                    continue
                with DeferredSigint():  # a record begun is ended or aborted before a Ctrl-C acts
                    buf = training.begin(record, len(stateful) < len(record.slots))
                    try:
                        views = {p: training.view(buf, self.entries[p][1]).view(-1) for p in stateful}

                        def sink(p, a, b, fields, views=views):
                            views[p][a:b].copy_(fields[MASTER][:b - a])

                        read_state(stateful, sink)
                    except BaseException:
                        training.abort(record)  # the record keeps its bytes; a later load rewrites it
                        raise
                    training.end(record, buf, changed=[self.entries[p][1] for p in stateful])
            training.flush()

    def current(self, p):
        """p's compute-dtype value as the offload storage holds it (a CPU copy)."""
        training, slot = self.entries[p]
        return training.current(slot)

    def checksum(self, p):
        """The checksum of current(p) (computed again only after a rewrite of its record began)."""
        training, slot = self.entries[p]
        return training.checksum(slot)

    def grad_bytes(self):
        return self.grads.nbytes() if self.grads is not None else 0

    def pinned(self):
        """{part: {"bytes": pinned now, "budget": the most it holds}} of the pinned memory behind the offloaded
        weights: the models' weight ring, spare and pool, the gradient buffers (nvme, accumulating) and the
        CUDA gradient staging. Batches hold up to batch_bytes (gradients and records), or one larger record."""
        parts = {}

        def add(name, nbytes, budget):
            part = parts.setdefault(name, {"bytes": 0, "budget": 0})
            part["bytes"] += nbytes
            part["budget"] += budget

        largest_grads, largest_weight, cuda = 0, 0, False
        for training, records in self._records().items():
            for record in records:
                owned = [self.param_of[s] for s in record.slots if s in self.param_of]
                largest_grads = max(largest_grads, _batch_bytes(record, owned))
                largest_weight = max([largest_weight] + [p.numel() * p.element_size() for p in owned])
            for name, part in training.pinned().items():
                add(name, part["bytes"], part["budget"])
            cuda = cuda or training.on_cuda
        if self.grads is not None and self.entries:  # no offloaded weights: nothing to sum, nothing pinned for it
            accumulating = isinstance(self.grads, FileGrads) and not self.in_backward
            add("grads", self.grads.pinned_bytes(), 2 * max(self.batch_bytes, largest_grads) if accumulating else 0)
        staged = cuda_copy.staging_bytes()
        if staged or cuda:  # one buffer per device, shared by every optimizer: the largest gradient copied so far
            add("grad_staging", staged, max(staged, largest_weight) if cuda else staged)
        return parts

    def _dropped(self):
        """The optimizer was freed without close() (never while its in_backward work is in flight: see HeldStep):
        what its last backward began and it could not finish is a RuntimeError for the models' next forward or
        remove_offload, not a silent half-update: an update that failed (the weights it had not reached keep their
        values), and gradients left for step() (incomplete when backward ended: a forward whose backward never
        ran, an output left unused)."""
        if not self.in_backward or self.closed:
            return
        error = self.worker.take_error()
        left = [self.entries[p][1].name for p in [*self.partial, *(p for _, p in self.parts)]]
        if error is not None:
            problem = RuntimeError(f"an update of the offloaded weights during backward (in_backward=True) failed "
                                   f"after the optimizer was dropped: {error!r}. The weights it had not reached keep "
                                   "their old values. Keep a reference to the optimizer and call step() after each "
                                   "backward (it raises such an error, then updates what is left), or load() a "
                                   "checkpoint of the optimizer")
            problem.__cause__ = error
        elif left:
            problem = RuntimeError(f"the in_backward=True optimizer was dropped before step() while the gradients of "
                                   f"{', '.join(map(repr, left[:3]))}{', ...' if len(left) > 3 else ''} were still "
                                   "waiting for it (incomplete when backward ended: a forward whose backward never "
                                   "ran); they were not applied. Call step() before dropping the optimizer")
        else:
            return
        for training in {training for training, _ in self.entries.values()}:
            training.report(problem)

    def close(self):
        self.closed = True
        try:
            self.worker.close()
        finally:  # (a Ctrl-C while it waited for the worker is raised after this: the worker's thread has ended)
            for training in self._records():
                training.release(self)
            if self.grads is not None:
                self.grads.close()
                self.grads = None


def run_grad_hooks(p, g):
    """The gradient hooks registered on p (p.register_hook), in order, as torch runs a leaf's: each gets the
    gradient and may return the one to use instead."""
    hooks = p._backward_hooks
    if not hooks:
        return g
    if cuda_copy.in_staging(g):
        g = g.clone()  # a hook may keep it: not a view of the staging buffer that the next gradient reuses
    for hook in list(hooks.values()):
        new = hook(g)
        if new is not None:
            if not isinstance(new, torch.Tensor) or new.shape != g.shape:
                raise RuntimeError(f"hook {getattr(hook, '__name__', hook)!r} has changed the size of value")
            g = new
    return g


def run_post_accumulate_hooks(p):
    """The post-accumulate-grad hooks registered on p, given p, as torch calls them once .grad holds the sum."""
    hooks = p._post_accumulate_grad_hooks
    for hook in list(hooks.values()) if hooks else ():
        hook(p)


def _batch_bytes(record, params):
    """What a record weighs in a batch: its params' fp32 gradients as read (4 KiB-aligned each), or its own bytes
    (the weight store's buffer) when larger; a batch holds up to batch_bytes of both."""
    return max(sum(round_up(4 * p.numel()) for p in params), record.nbytes)
