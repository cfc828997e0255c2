"""offload="nvme": the fp32 master and the moments live in one swap file, walked in chunks.

Layout. Parameters are packed, in param-group order, into chunks of at most `capacity` elements; chunks hold
parameters of one kind (which fp32 arrays they keep, and whether they sit on a GPU), a large parameter spans
several chunks and small ones share one. A chunk of n elements is one record in the swap file:
field 0 [n fp32, padded to 4 KiB] field 1 [...] ..., in the order master?, exp_avg, exp_avg_sq,
max_exp_avg_sq?; records start at 4 KiB boundaries, so each is one aligned read and one aligned write straight
from a pinned buffer (zero copy under O_DIRECT). Parameters are placed when the optimizer first sees them
(first step, state_dict, load); the file is grown with ftruncate, so unplaced holes read as zeros.

Pipeline. `buffer_count` pinned slots of buffer_bytes // buffer_count bytes rotate: while chunk i is computed,
reads of chunks i+1 .. i+buffer_count-2 are in flight and the write of chunk i-1 drains, on separate read and
write handles. A slot is reused only after its write (and any CUDA copy out of it) has finished, so host memory
for the state is bounded by buffer_bytes whatever the model size.
"""
import errno
import os
import weakref

import torch

from .. import _swapdir
from ..handle import AioHandle
from ..pinned import empty_pinned
from ._common import FP32, finish_all, init_segment, run_segment

ALIGN = 4096
FILE_NAME = "state.swap"


def _round_up(x, a=ALIGN):
    return (x + a - 1) // a * a


class _Segment:
    __slots__ = ("p", "a", "b", "off")

    def __init__(self, p, a, b, off):
        self.p, self.a, self.b, self.off = p, a, b, off  # elements [a, b) of p at element `off` of the chunk


class _Chunk:
    __slots__ = ("fields", "cuda", "n", "offset", "segments")

    def __init__(self, fields, cuda):
        self.fields, self.cuda, self.n, self.offset, self.segments = fields, cuda, 0, -1, []  # -1: not yet in the file

    @property
    def region(self):
        return _round_up(self.n * 4)

    @property
    def record_bytes(self):
        return len(self.fields) * self.region


def _cleanup(handles, owner):
    if owner.pid != os.getpid():
        return  # a forked child's copy: the directory and the handles' workers are the parent's
    for h in handles:
        try:
            h.close()
        except Exception:  # noqa: BLE001 - best effort at teardown
            pass
    owner.remove_everything()


def _check_direct(path):
    """OSError(EINVAL) now, not at the first step, when direct=True but the file system refuses O_DIRECT."""
    try:
        os.close(os.open(path, os.O_RDWR | os.O_DIRECT | os.O_CLOEXEC))
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        raise OSError(errno.EINVAL, "direct=True, but the file system of swap_dir refuses O_DIRECT (ramfs, some "
                      "FUSE and network file systems): pass direct=None or False, or use a disk", path) from None


class NvmeState:
    def __init__(self, opt, swap_dir, buffer_bytes, buffer_count, io_settings):
        if swap_dir is None:
            raise ValueError('offload="nvme" needs swap_dir, a directory on the disk that holds the state')
        swap_dir = os.fspath(swap_dir)
        if not os.path.isdir(swap_dir):
            raise ValueError(f"swap_dir {swap_dir!r} is not a directory")
        self.opt = weakref.proxy(opt)  # no cycle: dropping the optimizer frees its files at once
        self.buffer_count = buffer_count
        self.slot_bytes = buffer_bytes // buffer_count // ALIGN * ALIGN
        _swapdir.warn_if_ram_backed(os.path.abspath(swap_dir), "swap_dir")
        owner = _swapdir.private_directory(swap_dir)  # mode 0700; removes those of processes that died
        self.directory = owner.directory
        handles = []
        self._finalizer = weakref.finalize(self, _cleanup, handles, owner)
        try:
            handles.append(AioHandle.from_config(dict(io_settings)))
            handles.append(AioHandle.from_config(dict(io_settings)))
            self.rh, self.wh = handles
            self.path = os.path.join(self.directory, FILE_NAME)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            os.close(fd)
            if io_settings.get("direct") is True:
                _check_direct(self.path)
        except BaseException:
            self._finalizer()
            raise
        self.chunks = []
        self.placed = {}   # p -> (fields, cuda, [(chunk, segment)])
        self.file_bytes = 0
        self._slots = None
        self._pending = [[] for _ in range(buffer_count)]  # per slot: futures to finish before reuse
        self._events = [[] for _ in range(buffer_count)]   # per slot: CUDA events of copies out of it

    # ---- layout -------------------------------------------------------------------------------------------
    def capacity(self, fields, cuda):
        per_elem = 4 * len(fields) + (8 if cuda else 0)  # + pinned staging of grad in / param out for a GPU
        return self.slot_bytes // (per_elem * 1024) * 1024

    def place(self, params_fields):
        """Places parameters not placed yet (or whose kind changed while they have no state). params_fields:
        (p, the rule's fields for p) pairs."""
        new = []
        for p, fields in params_fields:
            cuda = p.device.type == "cuda"
            where = self.placed.get(p)
            if where is not None:
                if where[0] == fields and where[1] == cuda:
                    continue
                if self.opt.state.get(p):
                    raise RuntimeError(
                        "a parameter changed dtype, device, contiguity or amsgrad after the optimizer placed its "
                        f"state (was {where[0]} on {'cuda' if where[1] else 'cpu'}, now {fields} on {p.device})")
                self.forget(p)
            new.append((p, fields, cuda))
        if not new:
            return
        kinds = {}
        for p, fields, cuda in new:
            kinds.setdefault((fields, cuda), []).append(p)
        for (fields, cuda), params in kinds.items():
            cap = self.capacity(fields, cuda)
            chunk = None
            for p in params:
                segs = []
                a, numel = 0, p.numel()
                while a < numel:
                    if chunk is None or chunk.n == cap:
                        chunk = _Chunk(fields, cuda)
                        self.chunks.append(chunk)
                    b = min(numel, a + cap - chunk.n)
                    seg = _Segment(p, a, b, chunk.n)
                    chunk.segments.append(seg)
                    chunk.n += b - a
                    segs.append((chunk, seg))
                    a = b
                self.placed[p] = (fields, cuda, segs)
        self._assign_offsets()

    def _assign_offsets(self):
        end = self.file_bytes
        for chunk in self.chunks:
            if chunk.offset < 0:
                chunk.offset = end
                end += chunk.record_bytes
        if end != self.file_bytes:
            os.truncate(self.path, end)
            self.file_bytes = end
        self._grow_slots()

    def forget(self, p):
        where = self.placed.pop(p, None)
        if where is not None:
            for chunk, seg in where[2]:
                chunk.segments.remove(seg)

    # ---- the pipeline -------------------------------------------------------------------------------------
    def _slot_need(self):
        """Bytes a slot needs for the largest record (with the GPU staging behind it), at most slot_bytes: a state
        smaller than the budget pins only what it uses."""
        need = max((c.record_bytes + (2 * c.region if c.cuda else 0) for c in self.chunks), default=ALIGN)
        return min(self.slot_bytes, _round_up(need))

    def _slot(self, s):
        if self._slots is None:
            size = self._slot_need()
            self._slots = [empty_pinned(size, torch.uint8) for _ in range(self.buffer_count)]
        return self._slots[s]

    def _grow_slots(self):
        """After new parameters are placed: drop slots too small for a new record (allocated again on use)."""
        if self._slots is not None and self._slots[0].numel() < self._slot_need():
            self.wait_all()
            self._slots = None

    def _views(self, s, chunk):
        buf, n, region = self._slot(s), chunk.n, chunk.region
        views = {name: buf[k * region:k * region + n * 4].view(FP32) for k, name in enumerate(chunk.fields)}
        stage = len(chunk.fields) * region
        if chunk.cuda:
            views["_stage_g"] = buf[stage:stage + region]
            views["_stage_o"] = buf[stage + region:stage + 2 * region]
        return buf[:chunk.record_bytes], views

    def _drain(self, s):
        pending, self._pending[s] = self._pending[s], []
        events, self._events[s] = self._events[s], []
        for ev in events:
            ev.synchronize()
        finish_all(f.wait for f in pending)

    def wait_all(self):
        finish_all(lambda s=s: self._drain(s) for s in range(self.buffer_count))

    def run(self, chunks, read, work, write):
        """For each chunk: read its record (if read(chunk)) into a slot, call work(chunk, views, slot) in this
        thread (it may return futures that must finish before the slot is reused), then write the record back
        (if write). Reads run up to buffer_count-2 chunks ahead; writes drain behind."""
        n = len(chunks)
        count = self.buffer_count
        ahead = max(1, count - 2)
        reads = {}

        def prepare(j):
            s = j % count
            self._drain(s)
            if read(chunks[j]):
                record, _ = self._views(s, chunks[j])
                reads[j] = self.rh.pread(record, self.path, chunks[j].offset)

        ok = False
        try:
            for j in range(min(ahead, n)):
                prepare(j)
            for i in range(n):
                if i + ahead < n:
                    prepare(i + ahead)
                f = reads.pop(i, None)
                if f is not None:
                    f.wait()
                s = i % count
                record, views = self._views(s, chunks[i])
                futures = list(work(chunks[i], views, s) or ())
                if write:
                    futures.append(self.wh.pwrite(record, self.path, chunks[i].offset))
                self._pending[s] = futures
            ok = True
        finally:
            for f in reads.values():
                try:
                    f.wait()
                except BaseException:  # noqa: BLE001 - a read nobody needs any more
                    pass
            if ok:
                self.wait_all()
            else:
                try:
                    self.wait_all()
                except BaseException:  # noqa: BLE001 - the first error is already propagating
                    pass

    # ---- operations ---------------------------------------------------------------------------------------
    def step(self, works, threads):
        self.place(self.opt.param_fields())
        state = self.opt.state
        by_param = {w.p: w for w in works}
        stateful = {p for p in self.placed if state.get(p) and not (p in by_param and by_param[p].new)}
        chunks = [c for c in self.chunks if any(seg.p in by_param for seg in c.segments)]

        def work(chunk, views, s):
            for seg in chunk.segments:
                w = by_param.get(seg.p)
                if w is None:
                    continue
                fields = {name: views[name][seg.off:seg.off + seg.b - seg.a] for name in chunk.fields}
                if w.new:
                    init_segment(w, seg.a, seg.b, fields)
                run_segment(w, seg.a, seg.b, fields, views.get("_stage_g"), views.get("_stage_o"), threads)
                if w.cuda:
                    ev = torch.cuda.Event()
                    ev.record(torch.cuda.current_stream(w.p.device))
                    self._events[s].append(ev)

        self.run(chunks, lambda c: any(seg.p in stateful for seg in c.segments), work, True)

    def dump(self, params, fields_of, sink):
        """sink(p, field, first_element, fp32 view) for each exported field of each parameter in params, chunk by
        chunk; futures it returns are waited before the slot is reused."""
        wanted = set(params)
        chunks = [c for c in self.chunks if any(seg.p in wanted for seg in c.segments)]

        def work(chunk, views, s):
            futures = []
            for seg in chunk.segments:
                if seg.p not in wanted:
                    continue
                for name in fields_of(seg.p):
                    f = sink(seg.p, name, seg.a, views[name][seg.off:seg.off + seg.b - seg.a])
                    if f is not None:
                        futures.append(f)
            return futures

        self.run(chunks, lambda c: True, work, False)

    def tensors(self, params, fields_of):
        """{p: {field: new fp32 tensor shaped like p}} of the exported fields, read from the swap file (the whole
        state in RAM: save() streams instead)."""
        out = {p: {name: torch.empty(p.shape, dtype=FP32) for name in fields_of(p)} for p in params}

        def sink(p, name, a, view):
            out[p][name].view(-1)[a:a + view.numel()].copy_(view)

        self.dump([p for p in params if p in self.placed], fields_of, sink)
        return out

    def io_handles(self):
        """(read handle, write handle, owned) for checkpoints: the swap file's own handles."""
        return self.rh, self.wh, False

    def fill(self, entries, source, placement, state, check, commit):
        """Loads a whole new state, all or nothing: a new layout for `placement` [(p, fields)] is written to a
        new swap file beside the live one; then check(), the new file is renamed over the live one, and commit()
        makes `state` live. entries: {p: (fields, fields the source has)}; source(p, field, first, view) fills the
        view or returns a future that will; a missing master is taken from the parameter. On failure the live
        file and layout are untouched and the new file is removed."""
        self.wait_all()
        live = (self.chunks, self.placed, self.file_bytes, self.path)
        new_path = self.path + ".load"
        try:
            os.unlink(new_path)
        except FileNotFoundError:
            pass
        os.close(os.open(new_path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600))
        try:
            self.chunks, self.placed, self.file_bytes, self.path = [], {}, 0, new_path
            self.place(placement)
            self._fill_records(entries, source)
            check()
            os.replace(new_path, live[3])
        except BaseException:
            self.chunks, self.placed, self.file_bytes = live[:3]
            try:
                os.unlink(new_path)
            except FileNotFoundError:
                pass
            raise
        finally:
            self.path = live[3]
        commit()

    def _fill_records(self, entries, source):
        chunks = [c for c in self.chunks if any(seg.p in entries for seg in c.segments)]
        flat = {}

        def work(chunk, views, s):
            futures = []
            try:
                for seg in chunk.segments:
                    entry = entries.get(seg.p)
                    if entry is None:
                        continue
                    for name in chunk.fields:
                        view = views[name][seg.off:seg.off + seg.b - seg.a]
                        if name in entry[1]:
                            f = source(seg.p, name, seg.a, view)
                            if f is not None:
                                futures.append(f)
                        else:
                            if seg.p not in flat:
                                flat[seg.p] = seg.p.detach().reshape(-1)
                            view.copy_(flat[seg.p][seg.a:seg.b])
                    if seg.b == seg.p.numel():
                        flat.pop(seg.p, None)
            finally:  # the record is written after this returns; no read may outlive its slot
                finish_all(f.wait for f in futures)

        self.run(chunks, lambda c: False, work, True)

    def close(self):
        self._finalizer()

