"""offload="nvme": the fp32 master and the moments live in one swap file, walked in chunks.

Layout. Parameters are packed, in param-group order, into chunks of at most `capacity` elements; chunks hold
parameters of one kind (which arrays they keep, and whether they sit on a GPU), a large parameter spans
several chunks and small ones share one. A chunk of n elements is one record in the swap file:
field 0 [n elements of its dtype, padded to 4 KiB] field 1 [...] ..., in the rule's order (master?, exp_avg,
exp_avg_sq, max_exp_avg_sq?, then the int8 scales: one fp32 per 256 elements); records start at 4 KiB
boundaries, so each is one aligned read and one aligned write straight from a pinned buffer (zero copy under
O_DIRECT). Every piece of a parameter starts at a multiple of the state format's `align` in its chunk and in its
parameter, so int8 scale blocks line up. Parameters are placed when the optimizer first sees them (first step,
state_dict, load); the file is grown with ftruncate, so unplaced holes read as zeros.

Pipeline. `buffer_count` pinned slots of buffer_bytes // buffer_count bytes rotate: while chunk i is computed,
reads of chunks i+1 .. i+buffer_count-2 are in flight and the write of chunk i-1 drains, on separate read and
write handles. A slot is reused only after its write (and any CUDA copy out of it) has finished, so host memory
for the state is bounded by buffer_bytes whatever the model size.
"""
import errno
import os
import weakref

import torch

from ..core import _durable, _swapdir
from ..core._align import ALIGN, round_up
from ..core._owned_fd import OwnedFd
from ..core._ranges import section
from ..core._signals import DeferredSigint
from ..core.handle import AioHandle
from ..core.pinned import empty_pinned
from .finish import finish_all
from .params import on_gpu, shard
from .cuda_staging import StepCopies
from .segment import init_segment, run_segment
from .timing import IoClock, now

FILE_NAME = "state.swap"


class _Segment:
    __slots__ = ("p", "a", "b", "off", "factors")

    def __init__(self, p, a, b, off):
        self.p, self.a, self.b, self.off = p, a, b, off  # elements [a, b) of p at element `off` of the chunk
        self.factors = {}  # factor field -> (first element in the chunk's array of it, elements)


class _Chunk:
    __slots__ = ("fields", "cuda", "fmt", "n", "offset", "segments", "factor_n")

    def __init__(self, fields, cuda, fmt):
        self.fields, self.cuda, self.fmt = fields, cuda, fmt
        self.n, self.offset, self.segments = 0, -1, []  # offset -1: not yet in the file
        # factor fields (whole parameters only): their arrays packed in placement order, never moved (a
        # forgotten segment leaves its place unused), so the record's layout is fixed once it is in the file
        self.factor_n = {name: 0 for name in fields if fmt.is_factor(name)}

    def add(self, seg, shape):
        """Appends segment seg (of a parameter of `shape`), with room for its factors."""
        self.segments.append(seg)
        self.n = seg.off + seg.b - seg.a
        for name in self.factor_n:
            count = self.fmt.count(name, seg.b - seg.a, shape)
            seg.factors[name] = (self.factor_n[name], count)
            self.factor_n[name] += count

    def regions(self):
        """(field, byte offset in the record, elements, dtype) of each field."""
        out, at = [], 0
        for name in self.fields:
            dtype = self.fmt.dtype(name)
            count = self.factor_n[name] if name in self.factor_n else self.fmt.count(name, self.n)
            out.append((name, at, count, dtype))
            at += round_up(count * dtype.itemsize)
        return out, at

    @property
    def record_bytes(self):
        return self.regions()[1]

    def bytes_with(self, off, numel, shape):
        """record_bytes + stage_bytes once a whole parameter of `shape` (numel elements) is added at element off:
        its factors count as they are, which for a 1 x 1 convolution is two numbers per element, not none."""
        n, at = off + numel, 0
        for name in self.fields:
            count = self.factor_n[name] + self.fmt.count(name, numel, shape) if name in self.factor_n else \
                self.fmt.count(name, n)
            at += round_up(count * self.fmt.dtype(name).itemsize)
        return at + (2 * round_up(n * 4) if self.cuda else 0)

    @property
    def stage_bytes(self):
        """Pinned staging behind the record for a GPU chunk: gradients in and parameters out, 4 bytes each."""
        return 2 * round_up(self.n * 4) if self.cuda else 0


def _available_ram(meminfo="/proc/meminfo"):
    """MemAvailable in bytes (what can be allocated without swapping), or None where it cannot be read."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _check_fits_in_ram(slot_bytes, count):
    """MemoryError before allocating slots the machine cannot hold: each allocation alone succeeds (memory is
    overcommitted) and the process would be killed at its first step instead. Slots outgrow buffer_bytes only
    for a rule that steps whole parameters (Adafactor): each slot then holds the largest parameter's record."""
    need, available = slot_bytes * count, _available_ram()
    if available is not None and need > available:
        raise MemoryError(f"the nvme pipeline needs {count} pinned slots of {slot_bytes} bytes ({need} bytes) for its "
                          f"largest record, more than this machine has available ({available} bytes): lower "
                          "buffer_count (at least 3), or keep the largest parameter's state in RAM "
                          "(offload=\"cpu\")")


def _cleanup(handles, owner):
    if owner.pid != os.getpid():
        return  # a forked child's copy: the directory and the handles' workers are the parent's
    with DeferredSigint():  # runs once (a finalizer): a Ctrl-C is raised when all of it is done
        for h in handles:
            try:
                h.close()
            except Exception:  # noqa: BLE001 - best effort at teardown
                pass
        owner.remove_everything()


def _check_direct(path):
    """OSError(EINVAL) now, not at the first step, when direct=True but the file system refuses O_DIRECT."""
    try:
        OwnedFd.open(path, os.O_RDWR | os.O_DIRECT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC).close()
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        raise OSError(errno.EINVAL, "direct=True, but the file system of swap_dir refuses O_DIRECT (ramfs, some "
                      "FUSE and network file systems): pass direct=None or False, or use a disk", path) from None


class StepOnly(dict):
    """optimizer.state[p] in nvme mode: "step" alone, the arrays being in the swap file. Asking it for an array
    (code written for torch, or for cpu mode, reading opt.state[p]["exp_avg"]) is a KeyError that says so; setting
    one (torch's way to reset a moment) is a RuntimeError, since the step would go on with the swap file's."""

    def __missing__(self, key):
        if key == "step":  # no state yet: as torch's
            raise KeyError(key)
        raise KeyError(f"{key!r}: in nvme mode optimizer.state[p] holds only 'step'; the optimizer's arrays are in "
                       "its swap file. Read a copy with opt.state_dict()['state'][index] (index: p's position in "
                       "the param groups); change them through load_state_dict()")

    def __setitem__(self, key, value):
        if key != "step":
            raise RuntimeError(unread_entries_message([key]))
        super().__setitem__(key, value)

    # dict's own update, setdefault and |= do not go through __setitem__
    def update(self, *args, **kwargs):
        for key, value in dict(*args, **kwargs).items():
            self[key] = value

    def setdefault(self, key, default=None):
        if key not in self:
            self[key] = default
        return self[key]

    def __ior__(self, other):  # type: ignore[misc]  # (returns self, as dict's does)
        self.update(other)
        return self


def _count(entry):
    step = entry.get("step") if entry else None
    try:
        return float(step)
    except (TypeError, ValueError, RuntimeError):
        return None


def unread_entries_message(keys, where="optimizer.state[p]"):
    """Why state arrays set in an nvme optimizer's state entry cannot be honoured, and what to do instead."""
    return (f"{where} was given {sorted(keys)}, which in nvme mode the optimizer never reads: its state arrays are "
            "in its swap file, and stepping on with those while opt.state[p] shows others would differ from torch. "
            "To change them, edit a copy from opt.state_dict() and load_state_dict() it; to start the parameter "
            "afresh, del opt.state[p]")


def _amsgrad_off(placed, fields):
    """Whether a parameter placed with `placed` fields now asks for those less Adam's running maximum: its group's
    amsgrad was turned off after its first step. torch steps on without reading the maximum and keeps it in the
    state (turned on again, the step goes on from it); the record keeps it likewise, and the step leaves it."""
    return tuple(name for name in placed if name != "max_exp_avg_sq") == fields != placed


class NvmeState:
    """The state in a swap file under a private directory of swap_dir. fmt: the StateFormat; state: the
    optimizer's state dict (the same object for the optimizer's life; read only, to know which parameters have
    state); budget: the BufferBudget (slot size and count); io_settings: AioHandle settings."""

    def __init__(self, fmt, state, swap_dir, budget, io_settings, whole=False):
        if swap_dir is None:
            raise ValueError('offload="nvme" needs swap_dir, a directory on the disk that holds the state')
        swap_dir = os.fsdecode(swap_dir)  # (a bytes path too: the swap files get str names)
        _swapdir.make_parent(swap_dir)
        self.format, self.state = fmt, state
        state.default_factory = StepOnly  # (torch's state is a defaultdict(dict)) the entries step() makes
        # the rule steps whole parameters (rules.Rule.whole): a parameter is never split over chunks, and a
        # slot grows to the largest parameter's record where that exceeds buffer_bytes / buffer_count
        self.whole = whole
        self.buffer_count = buffer_count = budget.count
        self.slot_bytes = budget.slot_bytes
        _swapdir.warn_if_ram_backed(os.path.abspath(swap_dir), "swap_dir")
        owner = _swapdir.private_directory(swap_dir)  # mode 0700; removes those of processes that died
        self.directory = owner.directory
        self.pid = owner.pid  # the process whose swap file this is (check_process)
        handles = []
        self._finalizer = weakref.finalize(self, _cleanup, handles, owner)
        try:
            handles.append(AioHandle.from_config(dict(io_settings)))
            handles.append(AioHandle.from_config(dict(io_settings)))
            self.rh, self.wh = handles
            self.path = os.path.join(self.directory, FILE_NAME)
            self.identity = _swapdir.create_private_file(self.path)
            if io_settings.get("direct") is True:
                _check_direct(self.path)
        except BaseException:
            self._finalizer()
            raise
        self.chunks = []
        self.placed = {}   # p -> (fields, cuda, [(chunk, segment)])
        self._entries = {}  # p -> (state[p] after its last step or load, its count then): replaced_entry()
        self.file_bytes = 0
        self._slots = None
        self._pending = [[] for _ in range(buffer_count)]  # per slot: futures to finish before reuse
        self._writing = [None] * buffer_count               # per slot: the chunk whose record it writes
        self._events = [[] for _ in range(buffer_count)]   # per slot: CUDA events of copies out of it
        self.written = set()  # chunks whose record the last run() wrote, each write waited and successful
        self.clock = IoClock()  # kernel time, I/O waits and bytes moved by run() (opt.step_report())

    def check_process(self):
        """RuntimeError in a child forked after this backend was made (os.fork, a DataLoader worker, a fork-started
        multiprocessing pool): the swap file is the parent's, and the child's placements (resizes), writes and
        loads (a new file renamed over it) would change the parent's state under it."""
        if os.getpid() != self.pid:
            raise RuntimeError(f"this optimizer's swap file belongs to process {self.pid}, which made it; a child "
                               "forked from it (os.fork, a DataLoader worker, a multiprocessing pool) cannot step, "
                               "load or export it, as it would change the parent's state. Use the optimizer in "
                               "the process that made it; in the child, build a new optimizer and load() a "
                               "checkpoint that process saved")

    # ---- layout -------------------------------------------------------------------------------------------
    def capacity(self, fields, cuda):
        """The most elements, a multiple of 1024 (and so of the int8 block), of a chunk whose record and GPU
        staging fit a slot."""
        probe = _Chunk(fields, cuda, self.format)
        fmt, many = self.format, 1 << 20
        per_elem = sum(fmt.count(name, many) * fmt.dtype(name).itemsize for name in fields
                       if not fmt.is_factor(name)) / many  # (factors: counted as each parameter is placed)
        per_elem = max(per_elem, 1.0)  # factors alone (Adafactor, fp32 CPU parameters): chunks of slot_bytes elements
        probe.n = int(self.slot_bytes / (per_elem + (8 if cuda else 0))) // 1024 * 1024  # before padding: a bound
        while probe.n > 1024 and probe.record_bytes + probe.stage_bytes > self.slot_bytes:
            probe.n -= 1024
        return probe.n

    def place(self, params_fields, group_of=None):
        """Places parameters not placed yet (or whose kind changed while they have no state). params_fields:
        (p, the rule's fields for p) pairs. group_of(p): parameters stepped together apart from the rest (an
        offloaded module's weights, stepped a record at a time) share no chunk with other groups, so stepping
        one group reads and writes no other group's state."""
        self.check_process()
        new = []
        for p, fields in params_fields:
            cuda = on_gpu(p)
            where = self.placed.get(p)
            if where is not None:
                if where[1] == cuda and (where[0] == fields or _amsgrad_off(where[0], fields)):
                    continue
                if self.state.get(p):
                    raise RuntimeError(
                        "a parameter changed dtype, device, contiguity, amsgrad or (OffloadAdafactor: a vector keeps "
                        "variance, a matrix its factors) number of dimensions after the optimizer placed its "
                        f"state (was {where[0]} on {'cuda' if where[1] else 'cpu'}, now {fields} on {shard(p).device} "
                        f"with shape {tuple(shard(p).shape)}); give the optimizer a new parameter instead")
                self.forget(p)
            new.append((p, fields, cuda))
        if not new:
            if any(chunk.offset < 0 for chunk in self.chunks):
                self._assign_offsets()  # a placement whose file growth failed (ENOSPC), retried
            return
        kinds = {}
        for p, fields, cuda in new:
            kinds.setdefault((fields, cuda), []).append(p)
        align = self.format.align
        for (fields, cuda), params in kinds.items():
            # Chunks of about 1/buffer_count of the state placed now, up to what a slot holds: a state smaller
            # than buffer_bytes pins about its own size (buffer_count slots of its largest record), not more.
            share = -(-sum(shard(p).numel() for p in params) // self.buffer_count)
            cap = min(self.capacity(fields, cuda), max(1024, -(-share // 1024) * 1024))
            chunk, group = None, None
            for p in params:
                mine = group_of(p) if group_of is not None else None
                if mine is not None or group is not None:
                    if mine is not group:
                        chunk = None  # a new group starts a new chunk
                    group = mine
                segs = []
                a, numel = 0, shard(p).numel()
                if self.whole:  # one segment: in the current chunk if it fits, else in a new one
                    off = -(-chunk.n // align) * align if chunk is not None else cap
                    # fits: in elements, and in bytes with its factors (cap counts none); alone, it may exceed a
                    # slot, which then grows to its record
                    if chunk is None or off + numel > cap or (
                            chunk.n and chunk.bytes_with(off, numel, shard(p).shape) > self.slot_bytes):
                        chunk, off = _Chunk(fields, cuda, self.format), 0
                        self.chunks.append(chunk)
                    seg = _Segment(p, 0, numel, off)
                    chunk.add(seg, shard(p).shape)
                    segs.append((chunk, seg))
                    a = numel
                while a < numel:
                    off = -(-chunk.n // align) * align if chunk is not None else cap
                    if off >= cap:
                        chunk, off = _Chunk(fields, cuda, self.format), 0
                        self.chunks.append(chunk)
                    b = min(numel, a + cap - off)  # cap and off are multiples of align: so is b unless it ends p
                    seg = _Segment(p, a, b, off)
                    chunk.add(seg, None)
                    segs.append((chunk, seg))
                    a = b
                self.placed[p] = (fields, cuda, segs)
        self._assign_offsets()

    def _assign_offsets(self):
        """Gives the chunks not yet in the file their records at its end, and grows it. All or nothing: when the
        growth fails (ENOSPC), those chunks get no offset, so the next placement (the step retried) assigns them
        again; offsets kept past a failed growth would place the next parameters over them, and the file's
        resize to that shorter end would cut off records already written."""
        end = self.file_bytes
        fresh = [chunk for chunk in self.chunks if chunk.offset < 0]
        for chunk in fresh:
            chunk.offset = end
            end += chunk.record_bytes
        if end != self.file_bytes:
            try:
                _swapdir.resize_private_file(self.path, self.identity, end)
            except BaseException:
                for chunk in fresh:
                    chunk.offset = -1
                raise
            self.file_bytes = end
        self._grow_slots()

    def held_fields(self, p):
        """The state fields p's records hold (None: not placed yet)."""
        where = self.placed.get(p)
        return where[0] if where is not None else None

    def note_entry(self, p, entry):
        """Records state[p], the entry whose count the swap file's arrays of p go with (after a step or a load;
        None or empty: p has no state there)."""
        if entry:
            self._entries[p] = (entry, _count(entry))
        else:
            self._entries.pop(p, None)

    def replaced_entry(self, p):
        """(the count the swap file's arrays of p go with, or None where it holds none; the count state[p] holds
        now) where state[p] is not the entry recorded and counts otherwise (a copy of opt.state put back to roll
        back: the copy holds only counts, the moments stayed in the file), else None. A count edited in the entry
        itself (as torch's is) is not a replacement."""
        recorded, entry = self._entries.get(p), self.state.get(p)
        if not entry or (recorded is not None and entry is recorded[0]):
            return None
        now = _count(entry)
        if recorded is None:
            return None, now
        return None if now == recorded[1] else (recorded[1], now)

    def adopt_entry(self, p, names):
        """Nothing: state[p] holds only the count here (arrays put there are unread_entries)."""
        return None

    def unread_entries(self, p):
        """The keys of state[p] beside "step": arrays put there (a whole entry replaced, `opt.state[p] = {...}`)
        that this backend does not read."""
        return sorted(k for k in self.state.get(p, ()) if k != "step")

    def state_misfit(self, p, t):
        """What p's placed state was made for where it does not fit a parameter like t (None where it does): its
        element count, and the size of its factored moments."""
        where = self.placed.get(p)
        if where is None:
            return None
        segs = where[2]
        numel = segs[-1][1].b if segs else 0
        if numel != t.numel():
            return f"was made for {numel} elements"
        for name, (_, count) in (segs[0][1].factors.items() if segs else ()):  # a whole parameter's factors
            if t.dim() < 2 or count != self.format.count(name, numel, t.shape):
                return f"holds {name} of {count} elements"
        return None

    def forget(self, p):
        where = self.placed.pop(p, None)
        if where is not None:
            for chunk, seg in where[2]:
                chunk.segments.remove(seg)

    # ---- the pipeline -------------------------------------------------------------------------------------
    def _slot_need(self):
        """Bytes a slot needs for the largest record (with the GPU staging behind it), at most slot_bytes: a state
        smaller than the budget pins only what it uses."""
        need = max((c.record_bytes + c.stage_bytes for c in self.chunks), default=ALIGN)
        return round_up(need) if self.whole else min(self.slot_bytes, round_up(need))

    def _slot(self, s):
        if self._slots is None:
            size = self._slot_need()
            _check_fits_in_ram(size, self.buffer_count)
            self._slots = [empty_pinned(size, torch.uint8) for _ in range(self.buffer_count)]
        return self._slots[s]

    def _grow_slots(self):
        """After new parameters are placed: drop slots too small for a new record (allocated again on use)."""
        if self._slots is not None and self._slots[0].numel() < self._slot_need():
            self.wait_all()
            self._slots = None

    def _views(self, s, chunk):
        buf = self._slot(s)
        regions, record_bytes = chunk.regions()
        views = {name: buf[at:at + count * dtype.itemsize].view(dtype) for name, at, count, dtype in regions}
        if chunk.cuda:
            half = chunk.stage_bytes // 2
            views["_stage_g"] = buf[record_bytes:record_bytes + half]
            views["_stage_o"] = buf[record_bytes + half:record_bytes + 2 * half]
        return buf[:record_bytes], views

    def _segment_views(self, chunk, views, seg):
        """{field: the elements of segment seg in the slot's views}."""
        end = seg.off + seg.b - seg.a
        out = {}
        for name in chunk.fields:
            if name in seg.factors:
                first, count = seg.factors[name]
                out[name] = views[name][first:first + count]
            else:
                out[name] = self.format.part(name, views[name], seg.off, end)
        return out

    def _drain(self, s):
        pending, self._pending[s] = self._pending[s], []
        events, self._events[s] = self._events[s], []
        chunk, self._writing[s] = self._writing[s], None
        if not (pending or events):
            return
        t0 = now()
        with section("swapio::write_wait"):  # the slot's write (and GPU copies out of it) must finish first
            for ev in events:
                ev.synchronize()
            finish_all(f.wait for f in pending)
        self.clock.io_wait_s += now() - t0
        if chunk is not None:
            self.written.add(chunk)

    def wait_all(self):
        finish_all(lambda s=s: self._drain(s) for s in range(self.buffer_count))

    def run(self, chunks, read, work, write, between=None):
        """For each chunk: read its record (if read(chunk)) into a slot, call work(chunk, views, slot) in this
        thread (it may return futures that must finish before the slot is reused), then write the record back
        (if write; also when work raised, so that what it changed is not lost). Reads run up to buffer_count-2
        chunks ahead; writes drain behind. between(i), if given, runs before chunk i > 0 is computed. Every chunk
        whose write finished without error goes into self.written; a write that failed, or whose end the run did
        not see (it failed first), leaves its chunk out."""
        self.written = set()
        n = len(chunks)
        count = self.buffer_count
        ahead = max(1, count - 2)
        reads = {}
        clock = self.clock

        def prepare(j):
            s = j % count
            self._drain(s)
            if read(chunks[j]):
                record, _ = self._views(s, chunks[j])
                reads[j] = self.rh.pread(record, self.path, chunks[j].offset, identity=self.identity)
                clock.bytes_read += record.numel()

        ok = False
        try:
            for j in range(min(ahead, n)):
                prepare(j)
            for i in range(n):
                if i and between is not None:
                    between(i)
                if i + ahead < n:
                    prepare(i + ahead)
                f = reads.pop(i, None)
                if f is not None:
                    t0 = now()
                    with section("swapio::read_wait"):
                        f.wait()
                    clock.io_wait_s += now() - t0
                s = i % count
                record, views = self._views(s, chunks[i])
                futures = []
                try:
                    futures.extend(work(chunks[i], views, s) or ())
                finally:
                    if write:
                        futures.append(self.wh.pwrite(record, self.path, chunks[i].offset, identity=self.identity))
                        clock.bytes_written += record.numel()
                        self._writing[s] = chunks[i]
                    self._pending[s] = futures
            ok = True
        finally:
            interrupted = None  # a Ctrl-C meanwhile: the user's, raised once the slots are free (not lost with
            # the errors ignored here)
            for f in reads.values():
                try:
                    f.wait()
                except Exception:  # noqa: BLE001 - a read nobody needs any more
                    pass
                except BaseException as exc:  # noqa: BLE001 - see `interrupted`
                    interrupted = interrupted or exc
            if ok and interrupted is None:
                self.wait_all()
            else:
                try:
                    self.wait_all()
                except Exception:  # noqa: BLE001 - the first error is already propagating; self.written
                    pass            # tells what reached the file
                except BaseException as exc:  # noqa: BLE001 - see `interrupted`
                    interrupted = interrupted or exc
            if interrupted is not None:
                raise interrupted

    # ---- operations ---------------------------------------------------------------------------------------
    def step(self, works, threads, ctrl_c):
        """Steps the chunks that hold parameters with gradients (the optimizer has placed every parameter first,
        place()). A parameter is done (w.done) once its last segment is computed and every record holding it
        written (a failed write leaves it torn, and the optimizer refuses it until a load);
        ctrl_c.poll() runs at chunk boundaries that no stepped parameter spans, after the writes before it are
        finished, where each parameter is fully stepped or untouched."""
        self.check_process()
        state = self.state
        by_param = {w.p: w for w in works}
        stateful = {p for p in self.placed if state.get(p) and not (p in by_param and by_param[p].new)}
        chunks = [c for c in self.chunks if any(seg.p in by_param for seg in c.segments)]
        finished = []  # works whose last segment was computed, in order
        for w in works:
            if w.numel == 0:  # no segments, nothing to compute or store: stepped (its count advances, as in cpu
                w.done = True  # mode and torch)

        def work(chunk, views, s):
            for seg in chunk.segments:
                w = by_param.get(seg.p)
                if w is None:
                    continue
                views_of = self._segment_views(chunk, views, seg)
                fields = {name: views_of[name] for name in w.fields}  # (amsgrad off: its maximum stays as it was)
                t0 = now()
                grad, out = w.grad[seg.a:seg.b], None
                if w.cuda:  # through the slot's staging: gradient in, the kernel's new values out
                    # at the segment's own place: the copy out of an earlier segment of this chunk still runs
                    n = seg.b - seg.a
                    gs, ts = w.grad.element_size(), w.t.element_size()
                    staged = views["_stage_g"][seg.off * gs:(seg.off + n) * gs].view(w.grad.dtype)
                    copies.to_host(staged, grad, w.t.device).synchronize()  # this copy only
                    grad, out = staged, views["_stage_o"][seg.off * ts:(seg.off + n) * ts].view(w.t.dtype)
                self.clock.io_wait_s += now() - t0
                t0 = now()
                with section("swapio::kernel"):
                    if w.new:
                        init_segment(w, seg.a, seg.b, fields)
                    run_segment(w, seg.a, seg.b, fields, grad, out, threads)
                self.clock.kernel_s += now() - t0
                if w.cuda:  # the slot is reused only after this copy out of it finished
                    self._events[s].append(copies.to_device(w.dst[seg.a:seg.b], out, w.t.device))
                    if seg.b == w.numel and w.tmp is not None:
                        copies.to_device(w.t.detach(), w.tmp, w.t.device)
                if seg.b == w.numel:
                    finished.append(w)

        def settle():
            """Marks done the finished parameters whose records are all in the file."""
            for w in finished:
                w.done = all(chunk in self.written for chunk, _ in self.placed[w.p][2])

        def between(i):
            if not ctrl_c.pending or any(seg.p in by_param and seg.b < by_param[seg.p].numel
                                         for seg in chunks[i - 1].segments):
                return  # no Ctrl-C, or a parameter goes on in chunk i: not a consistent point
            self.wait_all()
            settle()
            ctrl_c.poll()

        copies = StepCopies()
        try:
            self.run(chunks, lambda c: any(seg.p in stateful for seg in c.segments), work, True, between)
        finally:
            copies.end()
            settle()

    def dump(self, params, sink):
        """sink(p, first_element, end_element, {field: view of every stored field}) for each piece of each
        parameter in params, chunk by chunk; futures it returns are waited before the slot is reused."""
        self.check_process()
        wanted = set(params)
        chunks = [c for c in self.chunks if any(seg.p in wanted for seg in c.segments)]

        def work(chunk, views, s):
            futures = []
            for seg in chunk.segments:
                if seg.p in wanted:
                    futures.extend(sink(seg.p, seg.a, seg.b, self._segment_views(chunk, views, seg)) or ())
            return futures

        self.run(chunks, lambda c: True, work, False)

    def live_tensors(self, params, fields_of):
        """None: the state is in the swap file; state_dict() decodes it through dump()."""
        return None

    def io_handles(self):
        """(read handle, write handle, owned) for checkpoints: the swap file's own handles."""
        self.check_process()
        return self.rh, self.wh, False

    def fill(self, entries, source, placement, state, check, commit):
        """Loads a whole new state, all or nothing: a new layout for `placement` [(p, fields)] is written to a
        new swap file beside the live one; then check(), the new file is renamed over the live one, and commit()
        makes `state` live. entries: {p: fields}; source(p, first_element, end_element, {field: view}) fills
        the views of a piece of p or returns futures that will. On failure the live file and layout are
        untouched and the new file is removed."""
        self.check_process()
        self.wait_all()
        live = (self.chunks, self.placed, self.file_bytes, self.path, self.identity)
        new_path = self.path + ".load"
        _durable.discard(new_path)  # a leftover of an interrupted load
        identity = _swapdir.create_private_file(new_path)
        # A Ctrl-C is raised between the records written to the new file (the load is then abandoned, the live file
        # untouched) and not after check(): landing after the rename, it would put back the old layout and identity
        # over the new file (the old one gone: every later read refused, ESTALE), or leave the new records under
        # the old step counts and groups. From there it is raised once the load is whole.
        with DeferredSigint() as ctrl_c:
            try:
                self.chunks, self.placed, self.file_bytes, self.path, self.identity = [], {}, 0, new_path, identity
                self.place(placement)
                self._fill_records(entries, source, ctrl_c)
                check()
                ctrl_c.poll()
                os.replace(new_path, live[3])
            except BaseException:
                self.chunks, self.placed, self.file_bytes = live[:3]
                self.identity = live[4]  # on success the new file, renamed over the live path, keeps its identity
                _durable.discard(new_path)
                raise
            finally:
                self.path = live[3]
            commit()

    def _fill_records(self, entries, source, ctrl_c):
        chunks = [c for c in self.chunks if any(seg.p in entries for seg in c.segments)]

        def work(chunk, views, s):
            futures = []
            try:
                for seg in chunk.segments:
                    if seg.p in entries:
                        futures.extend(source(seg.p, seg.a, seg.b, self._segment_views(chunk, views, seg)) or ())
            finally:  # the record is written after this returns; no read may outlive its slot
                finish_all(f.wait for f in futures)

        self.run(chunks, lambda c: False, work, True, lambda i: ctrl_c.poll())

    def memory(self):
        """The swap file's bytes, the pinned slots (now, and the most they hold for the state placed so far), and
        the bytes a step that touches every chunk reads and writes."""
        pinned = sum(t.numel() for t in self._slots) if self._slots is not None else 0
        budget = self.buffer_count * (self._slot_need() if self.chunks else self.slot_bytes)
        return {"state_bytes": self.file_bytes, "pinned_bytes": pinned, "pinned_budget": budget,
                "io_bytes_per_step": 2 * sum(c.record_bytes for c in self.chunks)}

    def close(self):
        with DeferredSigint():  # the finalizer runs once: a Ctrl-C is raised when it is done
            self._finalizer()

