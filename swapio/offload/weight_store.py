"""Where an optimizer step rewrites an offloaded model's compute-dtype weights: a record at a time.

An optimizer updates every trainable slot of a record, then the record's bytes go back where the streamer reads
them: cpu_offload's host copy is rewritten in place (HostStore); on disk (DiskStore) the record is written
whole, with one aligned O_DIRECT request from a pinned buffer, over its place in swapio's own data file in
offload_dir. A record that mixes frozen and trainable weights, or a first step (which needs the current values
for the fp32 master), reads the record first. The fetcher forgets its copy of the record before, and reads it
again only after the write finished (Fetcher.forget / wrote).

A checkpoint= is never written to: before the first step, the records an optimizer trains move into a new data
file in offload_dir (offload_dir.write, committed with its index), and the streamer reads them from there. So
training a model offloaded from a checkpoint needs disk_offload(model, checkpoint=..., offload_dir=...); a new
process that offloads the same way reads the trained weights from offload_dir again.
"""
import os
import threading

import torch

from ..core._in_flight import MAX_IN_FLIGHT
from ..core._signals import DeferredSigint
from ..core.pinned import empty_pinned
from ..safetensors.files import wait_checked
from . import offload_dir as odir
from .fetch import REWRITING, view
from .layout import pack, place_on_disk, round_up


def current_value(fetcher, slot):
    """A CPU copy of the slot's value as the streamer reads it now."""
    with DeferredSigint():  # a Ctrl-C lands once the fetch is released (streamer._put_weights_in says why)
        fetch = fetcher.acquire(slot.record)
        try:
            return view(fetch, slot).to("cpu", copy=True)
        finally:
            fetcher.release(fetch)


class RecordTurns:
    """One rewrite of a record at a time, from begin() to end() or abort(): two optimizers that each train some
    of a record's weights (in_backward=True: each on its own worker thread) take turns, the second starting from
    the bytes the first wrote. An update begins its records in the streamer's order, so turns cannot deadlock."""

    def __init__(self):
        self._busy = set()
        self._turns = threading.Condition()

    def take_turn(self, record):
        with self._turns:
            while record in self._busy:
                self._turns.wait()
            self._busy.add(record)

    def end_turn(self, record):
        with self._turns:
            self._busy.discard(record)
            self._turns.notify_all()


class HostStore(RecordTurns):
    """cpu_offload: the records' host copies are the storage."""

    def __init__(self, fetcher):
        super().__init__()
        self.fetcher = fetcher

    def can_rewrite(self, records):
        return True

    def ensure_owned(self, records):
        pass

    def reserve(self, pool_bytes):
        pass

    def pinned(self):
        return {}

    def begin(self, record, need_current, idle=False):
        """The record's memory to write the new values into (holding the current ones)."""
        self.take_turn(record)
        try:
            self.fetcher.rewriting(record)  # and waits for a device copy out of the host copy still in flight
        except BaseException:
            self.end_turn(record)
            raise
        return self.fetcher.hosts[record][:record.nbytes]

    def end(self, record, buf, keep=()):
        self.fetcher.wrote(record, None)  # written in place; weights not stepped (keep) were never touched
        self.end_turn(record)

    def abort(self, record):
        self.fetcher.wrote(record, None)
        self.end_turn(record)

    def flush(self):
        pass

    def return_loans(self):
        pass

    def close(self):
        pass


class DiskStore(RecordTurns):
    """disk_offload: records in swapio's packed data file of offload_dir, rewritten in place. `locations`: slot ->
    (path, offset, nbytes) as the streamer reads it; `writable`: the data file swapio owns (None: checkpoint only).
    The pinned buffers of the records being rewritten are a pool of at most `pool_bytes`, which each optimizer
    training the model raises to its batch (reserve()), or one buffer of the largest record when that is larger:
    the pool does not grow with the model."""

    def __init__(self, streamer_records, fetcher, handle, locations, offload_dir, claim, writable, pool_bytes=0):
        super().__init__()
        self.records, self.fetcher, self.handle = streamer_records, fetcher, handle
        self.locations, self.offload_dir, self.claim, self.writable = locations, offload_dir, claim, writable
        self.pool_bytes = pool_bytes
        self._free = []                # pinned buffers no write uses
        self._writes = []              # (future, buffer) of the writes in flight, oldest first
        self._taken = {}               # record -> its buffer, from begin() to end() / abort()
        self._lent = {}                # data_ptr of a buffer the fetcher lent -> its loan (not the pool's)
        self._pool = 0                 # bytes of pinned buffers allocated
        self._error = None             # a write that failed, found while reusing its buffer, raised by flush()
        self._lock = threading.Lock()  # the pool is shared by the optimizers of one model (their own threads)

    def owned(self, record):
        spans = record.spans
        return (len(spans) == 1 and spans[0][0] == self.writable and spans[0][3] == 0
                and spans[0][2] == record.nbytes)

    def can_rewrite(self, records):
        """ensure_owned() can make the records writable: they are in swapio's data file, or may move there."""
        return self.offload_dir is not None or all(self.owned(r) for r in records)

    def ensure_owned(self, records):
        """Moves the records not yet in swapio's own data file there (with every record already in it)."""
        moving = [r for r in records if not self.owned(r)]
        if not moving:
            return
        if self.offload_dir is None:
            names = ", ".join(repr(s.name) for s in moving[0].slots[:3])
            raise ValueError(f"the offloaded weights ({names}, ...) are read from a checkpoint, which swapio never "
                             "writes to: to train them, offload with disk_offload(model, checkpoint=..., "
                             "offload_dir=<a directory>), where each step writes the trained weights")
        self.flush()
        keep = [r for r in self.records if self.owned(r) or r in moving]
        for record in keep:
            self.fetcher.forget(record)
        old = dict(self.locations)

        def source_of(slot):
            path, offset, nbytes = old[slot]
            t = torch.empty(nbytes, dtype=torch.uint8)
            if nbytes:
                io_path, identity = self.fetcher.io_of(path)  # a checkpoint's file: still the one it was
                read = self.handle.pread(t, io_path, offset, identity=identity, staged="auto")
                # written in place since: never copied into offload_dir
                wait_checked([read], lambda: self.fetcher.check_read([path]))
            return t

        saved = {r: (dict(r.offsets), r.nbytes, list(r.spans)) for r in keep}
        try:
            pack(keep)
            new = odir.write(self.offload_dir, keep, source_of, self.handle, claim=self.claim)
        except BaseException:
            for r, (offsets, nbytes, spans) in saved.items():
                r.offsets, r.nbytes, r.spans = offsets, nbytes, spans
            raise
        self.writable = next(iter(new.values()))[0]
        place_on_disk(keep, new, {self.writable: os.path.getsize(self.writable)})
        self.locations.update(new)
        self.fetcher.resize_spare(max(r.nbytes for r in self.records))

    # ---- the pinned buffers: a pool, bounded by `pool_bytes` (more only for one batch larger than that) ----
    def reserve(self, pool_bytes):
        """An optimizer begins up to pool_bytes of records at once (its batch): the pool may hold that much."""
        with self._lock:
            self.pool_bytes = max(self.pool_bytes, pool_bytes)

    def pinned(self):
        """{"weight_pool": {"bytes": pinned now, "budget": the most it holds}}: pool_bytes, or the largest record
        when that is larger (an optimizer's batch holds up to pool_bytes of records, or a single record)."""
        largest = max((round_up(r.nbytes) for r in self.records), default=0)
        with self._lock:
            budget = max(self.pool_bytes, largest) if self.pool_bytes else 0
            return {"weight_pool": {"bytes": self._pool, "budget": budget}}

    def _take(self, nbytes, idle):
        """A buffer of at least nbytes: with the model idle, the fetcher's unused memory if it has enough (see
        Fetcher.lend), once the oldest write from it finished if need be; else a free one of the pool (its last
        write finished), else one allocated while the pool stays under its bound (dropping free buffers too small
        for this record to make room), else the oldest write's once it finished. With no write in flight it
        allocates anyway: the records begun together (one batch) are what the pool must hold."""
        while idle:  # waiting for a write from lent memory rather than pinning more
            lent = self.fetcher.lend(nbytes)
            if lent is not None:
                with self._lock:
                    self._lent[lent[1].data_ptr()] = lent[0]
                return lent[1]
            oldest = self._oldest_lent_write()
            if oldest is None:
                break
            self._reap(oldest)
        need = round_up(nbytes)
        while True:
            with self._lock:
                fits = [b for b in self._free if b.numel() >= nbytes]
                if fits:
                    buf = min(fits, key=lambda b: b.numel())
                    self._free = [b for b in self._free if b is not buf]  # by identity: tensors compare by value
                    return buf
                while self._free and self._pool + need > self.pool_bytes:
                    self._pool -= self._free.pop(0).numel()
                oldest = self._writes[0] if self._writes else None
                if oldest is None or self._pool + need <= self.pool_bytes:
                    self._pool += need
                    break
            self._reap(oldest)
        return empty_pinned(need, torch.uint8)

    def _reap(self, entry):
        """Waits for one write (future, buffer) and puts its buffer back; its error is flush()'s to raise."""
        failed = entry[0].exception()
        with DeferredSigint(), self._lock:  # out of the writes and back where it came from, or neither
            if any(e is entry for e in self._writes):
                self._writes = [e for e in self._writes if e is not entry]
                self._put_back(entry[1])
            self._error = self._error or failed

    def _put_back(self, buf):
        """A buffer no write uses any more goes back where it came from (under self._lock). A Ctrl-C between
        taking a buffer and recording it, or between un-recording it and this, would lose a loan (the streamer's
        ring short of it for good): the callers' spans defer it (DeferredSigint) to where their state is whole."""
        loan = self._lent.pop(buf.data_ptr(), None)
        if loan is not None:
            self.fetcher.take_back(loan)
        else:
            self._free.append(buf)

    def begin(self, record, need_current, idle=False):
        """A pinned buffer for the record's new bytes (holding the current ones when need_current); end() writes
        it, abort() gives it up. The record is not read ahead meanwhile (Fetcher.rewriting). Several records may
        be begun at once (one update of a batch of records). idle: the model runs no module until the writes
        are flushed (step()), so the buffer may be the fetcher's idle memory."""
        self.take_turn(record)
        try:
            with self.fetcher.lock:
                written = self.fetcher.writing.pop(record, None)
            if written is not None and written is not REWRITING:
                written.exception()  # the last step's write of this record (failed: rewritten now anyway)
        except BaseException:
            self.end_turn(record)
            raise
        try:
            self.fetcher.rewriting(record)  # (inside: a Ctrl-C as it returns must reach the abort below)
            with DeferredSigint():  # the buffer is recorded as taken before a Ctrl-C acts (see _put_back)
                whole = self._take(record.nbytes, idle)
                with self._lock:
                    self._taken[record] = whole
            buf = whole[:record.nbytes]
            if need_current:
                path, offset, length, _ = record.spans[0]
                self.handle.pread(buf[:length], path, offset).wait()
            else:
                buf.zero_()  # the padding between tensors
        except BaseException:
            self.abort(record)  # the old bytes are still the record's
            raise
        return buf

    def abort(self, record):
        """Gives up a begin() without writing: the record's bytes are as they were."""
        with DeferredSigint():
            with self._lock:
                whole = self._taken.pop(record, None)
                if whole is not None:
                    self._put_back(whole)
            self.fetcher.wrote(record, None)
            self.end_turn(record)

    def end(self, record, buf, keep=()):
        """Writes the record from `buf`; `keep`: slots whose bytes in buf are not valid (an update that failed
        before them, on a buffer begin() did not fill), read back from the file first."""
        path, offset, length, _ = record.spans[0]
        try:  # each write holds the file open until done: a batch of hundreds of small records had as many
            while True:
                with self._lock:
                    oldest = self._writes[0] if len(self._writes) >= MAX_IN_FLIGHT else None
                if oldest is None:
                    break
                self._reap(oldest)
        except BaseException:  # (a Ctrl-C while waiting: given up as a failed submission is, below)
            self.abort(record)
            raise
        with DeferredSigint():  # from taken to written, or back (see _put_back)
            with self._lock:
                whole = self._taken.pop(record)
            try:
                if keep:
                    old = torch.empty(record.nbytes, dtype=torch.uint8)
                    self.handle.pread(old[:length], path, offset).wait()
                    for slot in keep:
                        record.view(buf, slot, writable=True).copy_(record.view(old, slot))
                future = self.handle.pwrite(buf[:length], path, offset)
            except BaseException:
                with self._lock:
                    self._taken[record] = whole
                self.abort(record)
                raise
            self.fetcher.wrote(record, future)
            with self._lock:
                self._writes.append((future, whole))
            self.end_turn(record)

    def return_loans(self):
        """Waits for the writes from memory the fetcher lent, which goes back to it (errors stay for flush())."""
        while (entry := self._oldest_lent_write()) is not None:
            self._reap(entry)

    def _oldest_lent_write(self):
        """The oldest write in flight from memory the fetcher lent, or None."""
        with self._lock:
            return next((e for e in self._writes if e[1].data_ptr() in self._lent), None)

    def flush(self):
        """Waits for every write; raises the first error (the record stays marked failed in the fetcher until
        a later write of it succeeds)."""
        while True:
            with self._lock:
                entry = self._writes[0] if self._writes else None
            if entry is None:
                break
            self._reap(entry)
        with self._lock:
            error, self._error = self._error, None
        if error is not None:
            raise error

    def close(self):
        try:
            self.flush()
        except OSError:  # reported by the step that wrote it
            pass
        self._free, self._pool = [], 0
