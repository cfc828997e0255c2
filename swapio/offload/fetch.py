"""Fetcher: brings records into memory ahead of use, through a ring of pinned buffers.

A Fetch is one record on its way in: disk records are read with one aligned O_DIRECT request per span into a
region of the PinnedRing (or, for a record larger than the ring or while the ring is held by running modules,
into one spare buffer sized for the largest record, where a tied record also waits between its users, read
once); host records (cpu_offload) need no read. For a CUDA execution device the region is then copied to a
fresh device tensor on the side copy stream, as soon as the read is seen finished; the compute stream waits on
that copy's event, never on a whole-stream synchronize, and the region goes back to the ring only after that
event completed. Host memory for weights is therefore bounded by buffer_bytes + the largest record (temporary
buffers beyond that only when nested modules hold both, counted in stats["temp"]). Backward computes with the
fetched region itself (hold(): it returns to the ring when autograd drops the weight), and an optimizer's
step() borrows what the weights do not use meanwhile (lend()) to write the trained records from.
"""
import collections
import ctypes
import errno
import os
import weakref

import torch

from ..core import cuda_copy
from ..core._fork_lock import ForkAwareLock
from ..core._ranges import section
from ..core.pinned import GrowingBlock, empty_pinned, is_pinned
from ..safetensors.files import WrittenInPlace, check_unchanged, wait_checked
from .layout import round_up, slot_view
from .ring import PinnedRing
from .units import FORWARD


# Counters (swapio.offload.stats): wait_s and forward_s are seconds the streamer measures (streamer.py)
REWRITING = object()  # Fetcher.writing's mark of a record whose new bytes an optimizer step computes now
LENT = object()       # Fetcher._spare_user while lend() gave the spare out

# check_unchanged's words for a checkpoint written in place while a model was offloaded from it
OFFLOADED = ("in place while a model was offloaded from it",
             "the model, which reads its weights from the file at every forward, can no longer compute or bring "
             "them back (remove_offload): build it again and offload it from the file as it is now "
             "(disk_offload(model, checkpoint=...) or swapio.offload.from_pretrained)")

REMOVALS_KEPT = 1024  # records a removal log (watch_removals) keeps before it says only "many"

ZERO_STATS = {"reads": 0, "bytes_read": 0, "temp": 0, "copies": 0, "wait_s": 0.0, "forward_s": 0.0}


class Fetch:
    __slots__ = ("record", "host", "alloc", "reads", "device", "event", "users", "copy", "holds", "detached",
                 "unchecked")

    def __init__(self, record, host, alloc, copy):
        self.record, self.host, self.alloc = record, host, alloc  # alloc: ("ring", start) | spare | temp | host
        self.reads, self.device, self.event, self.users = [], None, None, 0
        self.unchecked = []  # the checkpoint files read (their paths): check_read once the reads finished
        self.copy = copy  # CUDA: copy to the device as soon as the bytes are in (else only when acquired)
        self.holds = set()  # of the users, the Claims that an alias from hold() owns
        self.detached = False  # forgotten or drained while held: its memory is freed when the last alias dies

    @property
    def held(self):
        return len(self.holds)

    @property
    def data(self):
        """The record's bytes where the module computes: device copy for CUDA, else the host region."""
        return self.device if self.device is not None else self.host

    @property
    def transient(self):
        """True when this memory is reused after release (ring, spare, temp buffers and device copies)."""
        return self.device is not None or self.alloc[0] != "host"


class Claim:
    """One acquire() of a fetch, released exactly once: by Fetcher.let_go(), or by the death of the alias that
    Fetcher.hold() made of it, whichever comes first (both under the fetcher's lock). A Ctrl-C anywhere between
    the acquire and the alias's registration leaves a claim the caller's let_go() still releases."""
    __slots__ = ("fetch", "aliased")

    def __init__(self, fetch):
        self.fetch, self.aliased = fetch, False


class Fetcher:
    """Fetches records for one offloaded model. `hosts`: record -> host tensor (cpu_offload), else disk reads
    through `handle` into a ring of `buffer_bytes`."""

    def __init__(self, records, device, *, handle=None, hosts=None, buffer_bytes=0, sources=None):
        self.device, self.cuda = device, device.type == "cuda"
        self.handle, self.hosts = handle, hosts
        self.pid = os.getpid()  # the process whose handle reads (check_process)
        # a checkpoint file's path -> a Location in it (its source: the file whose header gave the offsets): a file
        # replaced at that name since is refused by the reads (OSError ESTALE), never read at the old header's
        # offsets, and one written in place since by the check after each read (check_read). swapio's own data
        # files are not listed.
        self.sources = dict(sources or {})
        self.rewritten = None  # check_read's error once a checkpoint file was written in place: every fetch fails
        total = sum(r.nbytes for r in records)  # a ring larger than all the weights would only waste memory
        self.ring = PinnedRing(min(buffer_bytes, total)) if hosts is None else None
        self.spare_bytes = max((r.nbytes for r in records), default=0)
        self._spare, self._spare_user = GrowingBlock(size=round_up), None  # pinned at its first use
        self.fetches = {}     # record -> Fetch, in the order they were started
        # hold()'s aliases: {id(weakref to the alias's memory): (that weakref, its Claim)}; a weakref lands in
        # _died when the memory dies, appended by C code (no Python runs there: see hold())
        self._aliases = {}
        self._died = collections.deque()
        self._deferred = []   # (event, fetch): regions to free once the copy out of them completed
        self.writing = {}     # record -> future of a write of its new bytes (training): read only after it
        self.lock = ForkAwareLock("this offloaded model", FORWARD)  # (a fork child: see units.Unit.lock)
        self.stats = dict(ZERO_STATS)
        self._removal_logs = []  # lists that each get the record of a fetch taken out of `fetches` (read_ahead.py)

    def watch_removals(self):
        """A list that gets the record of every fetch taken out of the table from now on, or whose copy flag is
        cleared; its owner empties it. Past REMOVALS_KEPT records it ends with None instead (a reader that did not
        look for long, the backward's during inference, gets no longer): the reader forgets all it knew."""
        log = []
        self._removal_logs.append(log)
        return log

    def _removed(self, record):
        for log in self._removal_logs:
            if len(log) < REMOVALS_KEPT:
                log.append(record)
            elif log[-1] is not None:
                log.append(None)

    def check_process(self):
        """RuntimeError in a fork child of the process that offloaded to disk: the reads go through that process's
        I/O handle, whose threads the child does not have (the handle's own error said to make a new handle, which
        a model's user cannot)."""
        if self.handle is not None and os.getpid() != self.pid:
            raise RuntimeError(
                f"this model's weights were offloaded with disk_offload in process {self.pid}, and this process was "
                "forked from it (os.fork, a DataLoader worker, a multiprocessing pool): its reads go through the "
                "parent's I/O handle. Offload the model in the child (disk_offload(model, checkpoint=...) reads a "
                "checkpoint in place), or run it in the parent")

    def io_of(self, path):
        """(the path to read, the identity the file there must have: None for swapio's own files) of a span's path."""
        loc = self.sources.get(path)
        return (path, None) if loc is None else (loc.io_path, loc.identity)

    def check_read(self, paths):
        """After reads from these files finished (or failed), before their bytes are used: files.WrittenInPlace (an
        OSError ESTALE and a ValueError) naming a checkpoint file written in place since its header was read (cp
        over it: the bytes read may mix its old and new tensors), and from then on at every fetch, so that no
        later forward computes with them."""
        if self.rewritten is None:
            try:
                check_unchanged((self.sources[p] for p in paths if p in self.sources), OFFLOADED)
            except WrittenInPlace as exc:
                self.rewritten = exc.args + (exc.filename,)
        self._refuse_rewritten()

    def _refuse_rewritten(self):
        if self.rewritten is not None:
            raise WrittenInPlace(*self.rewritten)

    def prepare(self, records):
        """Allocates the ring now (at offload time) rather than inside the first forward, and the spare too when
        a record will use it in every forward (a tied one, or one larger than the ring)."""
        if self.ring is not None and self.ring.capacity:
            self.ring.arena  # noqa: B018 - the property allocates
            if any(len(r.units) > 1 or r.nbytes > self.ring.capacity for r in records):
                self._spare_region(0)

    # ---- memory ---------------------------------------------------------------------------------------------
    def pinned(self):
        """{part: {"bytes": pinned now, "budget": the most it holds}}: for disk records the ring (buffer_bytes, at
        most all the weights) and the spare (the largest record); for cpu_offload to a GPU the pinned host copies
        (the weights themselves). Temporary buffers (stats["temp"], nested modules holding both) are not counted."""
        with self.lock:
            if self.hosts is not None:
                pinned = sum(h.numel() for h in self.hosts.values() if is_pinned(h))
                return {"weight_hosts": {"bytes": pinned, "budget": pinned}} if pinned else {}
            ring = self.ring.capacity if self.ring._arena is not None else 0
            spare = self._spare.nbytes
            return {"weight_ring": {"bytes": ring, "budget": self.ring.capacity},
                    "weight_spare": {"bytes": spare, "budget": round_up(self.spare_bytes)}}

    def _spare_region(self, nbytes):
        return self._spare.at_least(round_up(self.spare_bytes))[:round_up(nbytes)]

    def _allocate(self, record, required):
        n = record.nbytes
        fits_ring = n <= self.ring.capacity
        # a record larger than the ring needs the spare; a tied one (several users) takes it when free, so that
        # it can stay there between its users (see release) without holding ring space meanwhile
        spare_first = not fits_ring or len(record.units) > 1

        def take(spare_allowed):
            if spare_first and self._spare_user is None:
                return self._take_spare(record)
            if fits_ring:
                got = self.ring.alloc(n)
                if got is not None:
                    return ("ring", got[0]), got[1]
            if spare_allowed and self._spare_user is None:
                return self._take_spare(record)
            return None

        for attempt in range(3):
            self._reclaim(block=attempt == 2)
            got = take(required)
            if got is not None or not required:
                return got
            if attempt == 0:  # make room: drop fetched records nobody uses now, furthest ahead first
                for f in reversed(list(self.fetches.values())):
                    if f.users == 0:
                        self._drop(f)
                        got = take(True)
                        if got is not None:
                            return got
        self.stats["temp"] += 1
        return ("temp",), empty_pinned(round_up(n), torch.uint8)

    def _take_spare(self, record):
        self._spare_user = record
        return ("spare",), self._spare_region(record.nbytes)

    def _free(self, fetch):
        kind = fetch.alloc[0]
        if kind == "ring":
            self.ring.free(fetch.alloc[1], fetch.record.nbytes)
        elif kind == "spare":
            self._spare_user = None
        fetch.host = None

    def _reclaim(self, block):
        keep = []
        for event, fetch in self._deferred:
            if event.query():
                self._free(fetch)
            else:
                keep.append((event, fetch))
        if block and keep:
            keep[0][0].synchronize()  # waits for that one copy only
            self._free(keep.pop(0)[1])
        self._deferred = keep

    # ---- fetching -------------------------------------------------------------------------------------------
    def start(self, record, required=False, copy=True):
        """Starts bringing `record` in (no-op if it is on its way); None when `required` is False and there is
        no room now. `copy`: for CUDA, copy it to the device as soon as it is read (False: read ahead into host
        memory only, so device memory holds no more than the records expected soon)."""
        with self.lock:
            self._settle_holds()
            if self.rewritten is not None:  # a checkpoint file changed under the model: nothing is read any more
                if not required:
                    return None
                self._refuse_rewritten()
            fetch = self.fetches.get(record)
            if fetch is not None:
                fetch.copy = fetch.copy or copy
                return fetch
            written = self.writing.get(record)
            if written is REWRITING:  # an optimizer step is computing its new bytes: read ahead later
                if not required:
                    return None
                raise RuntimeError(f"a module needs the weights of {record} while an optimizer step rewrites them "
                                   "(a forward running during step()?)")
            if written is not None:  # the new bytes are on their way to the file: read them, not the old
                failed = written.exception()
                if failed is not None:  # kept until a write succeeds: the bytes in the file are unknown
                    if not required:
                        return None
                    raise OSError(getattr(failed, "errno", None) or errno.EIO,
                                  f"the last write of the trained weights of {record} failed ({failed}): load() "
                                  "an optimizer checkpoint, which rewrites them", getattr(failed, "filename", None))
                del self.writing[record]
            if self.hosts is not None:
                fetch = Fetch(record, self.hosts[record], ("host",), copy)
            else:
                got = self._allocate(record, required)
                if got is None:
                    return None
                fetch = Fetch(record, got[1], got[0], copy)
                try:
                    for path, offset, length, region_offset in record.spans:
                        io_path, identity = self.io_of(path)
                        fetch.reads.append(self.handle.pread(fetch.host[region_offset:region_offset + length],
                                                             io_path, offset, identity=identity))
                        self.stats["reads"] += 1
                        self.stats["bytes_read"] += length
                        if path in self.sources and path not in fetch.unchecked:
                            fetch.unchecked.append(path)
                except BaseException:
                    # a read refused at submission (EMFILE, ESTALE): the region goes back once the reads of the
                    # record's other spans, submitted already, are done with it (it stayed taken for good)
                    for f in fetch.reads:
                        f.exception()
                    self._free(fetch)
                    raise
            self.fetches[record] = fetch
            if self.cuda and copy and fetch.device is None and not fetch.reads:
                self._copy_to_device(fetch)
            return fetch

    def _checked(self, fetch):
        """check_read of the checkpoint files the fetch read, once its reads finished (or failed)."""
        if fetch.unchecked:
            self.check_read(fetch.unchecked)
            fetch.unchecked = []

    def _copy_to_device(self, fetch):
        """Copies the record to a new device tensor laid out with every slot 256-byte aligned (one copy per run
        of slots whose host offsets already keep that alignment: one for swapio's own layouts, one per tensor
        for a safetensors checkpoint's packed offsets)."""
        _, nbytes, runs = fetch.record.device_layout()
        stream = cuda_copy.copy_stream(self.device)
        with section("swapio::copy"):  # issued here; the copy itself runs on the side stream
            with torch.cuda.stream(stream):  # allocated on the copy stream: the copy waits for nothing
                fetch.device = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            for host, at, length in runs:
                fetch.event = cuda_copy.copy_async(fetch.device[at:at + length], fetch.host[host:host + length],
                                                   stream)  # one stream: the last event covers every run
        self.stats["copies"] += 1

    def pump(self):
        """CUDA: issues the device copy of every record whose read has finished (called at each module)."""
        if not self.cuda:
            return
        with self.lock:
            for fetch in list(self.fetches.values()):
                if fetch.copy and fetch.device is None and all(f.done() for f in fetch.reads):
                    if all(f.exception() is None for f in fetch.reads):
                        try:
                            self._checked(fetch)  # before its bytes go to the device
                        except WrittenInPlace:  # said by the next start() or acquire(), not here (leave())
                            self._drop(fetch)
                            continue
                        fetch.reads = []
                        self._copy_to_device(fetch)

    def acquire(self, record):
        """The record, in memory where the module computes, ready for the current stream; release() it after."""
        with self.lock:
            fetch = self.start(record, required=True)
            fetch.users += 1
            try:
                if fetch.reads:
                    with section("swapio::read_wait"):
                        wait_checked(fetch.reads, lambda: self._checked(fetch))
                else:
                    self._checked(fetch)
                fetch.reads = []
                if self.cuda:  # (a CUDA out-of-memory error here leaves the fetch unused, as a failed read does)
                    if fetch.device is None:
                        self._copy_to_device(fetch)
                    stream = torch.cuda.current_stream(self.device)
                    stream.wait_event(fetch.event)
                    fetch.device.record_stream(stream)
            except BaseException:
                fetch.users -= 1
                self._drop(fetch)
                raise
            return fetch

    def release(self, fetch):
        with self.lock:
            self._settle_holds()
            self._release(fetch)

    def _release(self, fetch):
        fetch.users -= 1
        if fetch.users:
            return
        if fetch.detached:
            fetch.detached = False
            self._free(fetch)
        elif self.fetches.get(fetch.record) is fetch:
            if fetch.alloc[0] == "spare" and len(fetch.record.units) > 1:
                self._keep(fetch)
            else:
                self._drop(fetch)

    def hold(self, claim, tensor):
        """An alias of `tensor` (host memory inside the fetch acquired by `claim`) that owns the acquisition: the
        fetch is released when the last tensor sharing the alias's memory dies, not by the caller. Backward uses
        it for the weights it fetches again, instead of a private copy of each: a copy of the largest record (an
        embedding or LM head) was that much heap beyond the ring at the start of every backward. Released by
        whichever thread frees the alias, or by the next call into the fetcher (see _alias_died). The caller
        let_go()es the claim if this raises (a Ctrl-C): the release then happens once, by whichever comes first."""
        fetch = claim.fetch
        nbytes = tensor.numel() * tensor.element_size()
        if not nbytes or not tensor.is_contiguous():
            copy = tensor.clone()  # before the region can go back to the ring
            self.let_go(claim)
            return copy
        region = (ctypes.c_uint8 * nbytes).from_address(tensor.data_ptr())
        region.block = fetch.host  # the pinned block stays allocated while the alias lives, even past drain()
        alias = torch.frombuffer(region, dtype=torch.uint8).view(tensor.dtype).view(tensor.shape)
        with self.lock:
            fetch.holds.add(claim)
            # The release is queued by deque.append, C code, as the memory dies: a Python finalizer could be cut
            # short at its first bytecode by a Ctrl-C, which Python drops there, and the release with it
            died = weakref.ref(region, self._died.append)
            self._aliases[id(died)] = (died, claim)
            weakref.finalize(region, self._alias_died, claim)  # releases it at once, where it can
            claim.aliased = True
        return alias

    def claim(self, record):
        """acquire() of `record` as a Claim, for hold() or let_go()."""
        return Claim(self.acquire(record))

    def let_go(self, claim):
        """Releases the claim's fetch unless an alias owns it now (hold() finished) or released it already."""
        with self.lock:
            self._settle_holds()
            if not claim.aliased:
                self._settle(claim)

    def _settle(self, claim):
        """Releases the claim's acquisition if nobody did yet (under the lock)."""
        fetch, claim.fetch = claim.fetch, None
        if fetch is not None:
            fetch.holds.discard(claim)
            self._release(fetch)

    def _alias_died(self, claim):
        """Releases the claim at once, unless this thread is inside the fetcher (a garbage collection there must
        not change the tables under it) or another thread is: the queued weakref (hold()) then has the next
        call release it, as it does when a Ctrl-C cuts this finalizer short."""
        if not self.lock._is_owned() and self.lock.acquire(blocking=False):
            try:
                self._settle(claim)
                self._settle_holds()
            finally:
                self.lock.release()

    def lend(self, nbytes):
        """(loan, region): pinned memory for nbytes that no fetch uses now (free ring space, else the spare if
        free and already pinned), or None. An optimizer step, which runs while the model does not, writes a
        record's new bytes from it instead of pinning a buffer of its own: the weights' memory serves both.
        take_back() it once its write finished; fetches meanwhile find it in use, as if a module held it."""
        if self.ring is None:  # cpu_offload: no ring, and its records are rewritten in place
            return None
        with self.lock:
            self._settle_holds()
            self._reclaim(block=False)
            n = round_up(max(nbytes, 1))
            got = self.ring.alloc(n) if n <= self.ring.capacity else None
            if got is not None:
                return ("ring", got[0], n), got[1]
            spare_pinned = self._spare.nbytes >= round_up(self.spare_bytes)  # lending never pins more
            if self._spare_user is None and spare_pinned and n <= self._spare.nbytes:
                self._spare_user = LENT
                return ("spare",), self._spare_region(n)
            return None

    def take_back(self, loan):
        with self.lock:
            if loan[0] == "ring":
                self.ring.free(loan[1], loan[2])
            elif self._spare_user is LENT:
                self._spare_user = None

    @staticmethod
    def is_region(fetch, tensor):
        """True when `tensor` lies in the fetch's host memory (view() copies a slot the file misaligned)."""
        start = fetch.host.data_ptr()
        return start <= tensor.data_ptr() < start + fetch.host.numel()

    def _settle_holds(self):
        """Releases the fetches whose aliases died since the last call (under the lock). Each is taken off the
        queue only once released (_settle is idempotent): a Ctrl-C between the two leaves it for the next call."""
        while self._died:
            died = self._died[0]
            _, claim = self._aliases.get(id(died), (None, None))
            if claim is not None:
                self._settle(claim)
                del self._aliases[id(died)]
            self._died.popleft()

    def _keep(self, fetch):
        """A tied record in the spare stays there, read once, until its next user runs (GPT-2's wte, then
        lm_head, then wte of the next step) or a record needs the spare. Its device copy goes: device memory
        holds only what runs or comes next, and the spare is reused only after that copy finished (event)."""
        fetch.device, fetch.copy = None, False
        self._removed(fetch.record)

    def resize_spare(self, nbytes):
        """Records changed size (moved to offload_dir for training): the spare fits the largest again."""
        with self.lock:
            self.spare_bytes = nbytes
            if self._spare.nbytes < round_up(nbytes) and self._spare_user is None:
                self._spare.release()

    def forget(self, record):
        """Before the record's bytes are rewritten (training): drops its fetch, so that the next start() reads the
        new bytes, after waiting for any read into it and any device copy out of it (whose source may be the
        very host copy about to change). RuntimeError if a running module uses it now."""
        with self.lock:
            self._settle_holds()
            fetch = self.fetches.get(record)
            if fetch is not None:
                if fetch.users > fetch.held:
                    raise RuntimeError(f"the weights of {record} are rewritten by an optimizer step while a module "
                                       "runs with them (step() or a gradient inside that module's forward?)")
                if fetch.users:
                    self._detach(fetch)  # backward's aliases keep the old bytes; the next start() reads the new
                else:
                    self._drop(fetch)
            for event, f in self._deferred:
                if f.record is record:
                    event.synchronize()  # that one copy only
            self._reclaim(block=False)

    def rewriting(self, record):
        """An optimizer step starts computing the record's new bytes: forget() it, and read it ahead no more
        until wrote()."""
        with self.lock:
            self.forget(record)
            self.writing[record] = REWRITING

    def wrote(self, record, future):
        """The record's new bytes are in place (future None) or being written by `future`, which the next
        start() of it waits for first."""
        with self.lock:
            if future is None:
                self.writing.pop(record, None)
            else:
                self.writing[record] = future

    def drop_unused(self, keep):
        """Drops the ring's fetches that nobody uses and that are not in `keep` (read ahead for modules that no
        longer come next); returns whether it dropped any."""
        with self.lock:
            self._settle_holds()
            stale = [f for f in self.fetches.values()
                     if f.users == 0 and f.alloc[0] == "ring" and f.record not in keep]
            for f in stale:
                self._drop(f)
            return bool(stale)

    def _detach(self, fetch):
        """Takes a fetch that only aliases from hold() still use out of the table; the last of them frees it."""
        del self.fetches[fetch.record]
        self._removed(fetch.record)
        fetch.detached = True

    def _drop(self, fetch):
        for f in fetch.reads:  # a read cannot be cancelled: its buffer is reused only after it finished (a Ctrl-C
            f.exception()      # meanwhile leaves the fetch in the table, for the next drop to free)
        if self.fetches.get(fetch.record) is fetch:
            del self.fetches[fetch.record]
            self._removed(fetch.record)
        fetch.reads = []
        fetch.device = None
        if fetch.event is not None and not fetch.event.query():
            self._deferred.append((fetch.event, fetch))
        else:
            self._free(fetch)

    def drain(self):
        """Waits for everything in flight and gives all memory back (remove_offload, errors)."""
        with self.lock:
            for written in self.writing.values():
                if written is not REWRITING:
                    written.exception()  # waits; the writer reports its own error
            self.writing = {}
            self._settle_holds()
            for fetch in list(self.fetches.values()):
                if fetch.held:
                    self._detach(fetch)
                else:
                    self._drop(fetch)
            for event, fetch in self._deferred:
                event.synchronize()
                self._free(fetch)
            self._deferred = []
            if self.ring is not None:
                self.ring.release_arena()
            self._spare.release()


def view(fetch, slot):
    """The slot's tensor inside a fetched record (a copy only if the file put it at a misaligned offset)."""
    offset = fetch.record.offsets[slot] if fetch.device is None else fetch.record.device_layout()[0][slot]
    return slot_view(fetch.data, offset, slot)
