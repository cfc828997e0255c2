"""Saved activations of one forward: where each saved storage went, and how it comes back for backward.

One Entry per saved storage (views of one storage share it): the storage's bytes go
- CPU tensor, to="nvme": written to the session's swap file straight from the tensor's own memory (no copy: the
  file offset has the address's place in its page, so the whole pages in between go by direct I/O and only the
  two partial pages at the ends through the page cache). The tensor is held while its write is in flight and,
  written, while the staging room allows: at most `staging_bytes` of tensors are held (beyond that the oldest
  written one goes, else the forward waits for the oldest write), which bounds the RAM that saved activations
  hold, and the last ones a forward saves, the first its backward needs, are still there when it starts. The
  others are read back the same way, into recycled blocks (activation_blocks.py);
- CUDA tensor: copied on the device-to-host side stream into a pinned block (the forward does not wait); for
  to="cpu" the block is where it stays, for to="nvme" it is written out once the copy finished and then reused,
  the blocks in flight bounded by `staging_bytes` as above.
Backward asks for entries in about the reverse order of saving: each unpack starts the reads (and host-to-device
copies) of the next `prefetch` entries below it that need one before waiting for its own. What comes back is a
storage of the same size, device and bytes, and every saved view is rebuilt on it with its own dtype, size,
stride and offset, so views that shared a storage share one again. The bytes on disk and in pinned memory stay
until autograd drops the saved tensor (after its node ran, or with the graph): a second backward
(retain_graph=True) reads them again. The swap file's blocks are allocated ahead of the writes, as many as the
largest forward before needed, and freed by a thread once the file left its directory.
"""
import collections
import os
import threading
import time
import weakref

import torch

from ..core import _swapdir
from ..core._align import ALIGN, round_up
from ..core._in_flight import MAX_IN_FLIGHT
from ..core._owned_fd import OwnedFd
from ..core._signals import DeferredSigint
from ..core.cuda_copy import DeviceCopyFuture, allocating_on_side_stream, copy_async, copy_stream
from ..core.futures import Future
from ..core.tensors import CAN_SET_VERSION, set_version
from .kept import Kept, modified_in_place


def on_gpu(tensor):
    """Whether a saved tensor is on a CUDA device (its bytes go through the pinned pool). One place to ask, so
    that the simulated-GPU tests (tests/helpers/fake_gpu_activations.py) can count CPU tensors as on a GPU."""
    return tensor.device.type == "cuda"


class Entry:
    __slots__ = ("index", "nbytes", "device", "gpu", "reading", "key", "storage_ref", "version", "host", "pooled",
                 "offset", "write", "d2h", "last_copy", "loaded", "restored", "refs", "staged", "watch",
                 "changed_in_flight", "generation", "waiting", "held", "owner_ref", "base_ref", "base_version",
                 "restored_own")

    def __init__(self, index, nbytes, device, gpu, storage, version, owner):
        self.index, self.nbytes, self.device, self.version = index, nbytes, device, version
        self.gpu = gpu        # a CUDA tensor: copied through pinned blocks of the pool
        self.reading = None   # (pinned block, its read) of the load whose copy to the device is not queued yet
        self.key, self.storage_ref = storage.data_ptr(), weakref.ref(storage)
        self.owner_ref = weakref.ref(owner)  # the tensor whose version counter `version` was read from
        self.host = None      # the bytes in host memory: the CPU tensor itself, or a pinned block
        self.pooled = False   # host is a block of the pinned pool
        self.offset = None    # where the bytes lie in the session's file (to="nvme")
        self.write = None     # the pwrite in flight
        self.d2h = None       # the device-to-host copy's event, until the copy is known finished
        self.last_copy = None  # the event of the last host-to-device copy reading self.host
        self.loaded = None    # a future of the bytes back on self.device (prefetched)
        self.restored = None  # weakref to the storage back on the device, while something uses it
        self.restored_own = False  # restored is the CPU tensor's own memory (host), not bytes read back
        # Every saved view is rebuilt as a view of one uint8 tensor over that storage (weakly referenced, held with
        # the storage below), so that they share its version counter: a backward that changes one in place moves
        # it, and the later unpacks see that, as autograd sees it without offload
        self.base_ref = None
        self.base_version = 0
        self.refs = 0         # saved tensors (views) using this entry
        self.staged = 0       # bytes this entry counts against staging_bytes
        self.watch = None     # the tensor's detached view, sharing its version counter: a CPU tensor's while host
        #                       holds it, a CUDA tensor's until its copy to the host is seen finished
        self.changed_in_flight = False  # changed in place before the transfer reading it was seen finished
        # A storage saved by several nodes (a tanh's output that the next linear saves as its input) is read back
        # once: from the read that brought it back (a new generation) it is held until every saved tensor using it
        # then has been unpacked or dropped (`waiting` of them), where a weak reference let it go after the first
        # node and the second read it again, a miss the backward waited for.
        self.generation = 0
        self.waiting = 0
        self.held = None


class Saved:
    """What autograd keeps for one saved tensor: the entry and the view to rebuild on its storage."""
    __slots__ = ("session", "entry", "dtype", "size", "stride", "offset", "generation")

    def __init__(self, session, entry, tensor):
        self.session, self.entry = session, entry
        self.generation = -1  # the entry's generation this saved tensor was last unpacked in
        self.dtype, self.size, self.stride = tensor.dtype, tuple(tensor.size()), tuple(tensor.stride())
        self.offset = tensor.storage_offset()

    def __del__(self):
        session = self.session
        if session is not None:
            self.session = None
            # A finalizer (autograd freeing what it saved): the last drop ends the session, waiting for its writes
            # and removing its file. Cut short by a Ctrl-C, that stayed half done until close(): the Ctrl-C waits
            # for the drop to be whole. (Python then drops it, as any exception raised in a finalizer.)
            with DeferredSigint():
                session.drop(self.entry, self.generation)


class KeptBy(Kept):
    """A saved tensor a session's pack left where it was, with the session (a backward that fails discards it)."""
    __slots__ = ("session",)

    def __init__(self, session, tensor):
        super().__init__(tensor)
        self.session = session


def counter_owner(tensor):
    """A view's base, else the tensor: it holds the version counter that the tensor uses, and it lives as long as
    any of its views."""
    base = tensor._base
    return tensor if base is None else base


def counts_with(owner, tensor):
    """Whether `tensor` counts its changes in place on the version counter of `owner` (None: gone), so that a copy
    saved for one, at the same version, stands for the other. Tensors of one storage that are not views of one
    base may not: torch.unsafe_chunk's pieces (the CPU GRU's gates) and .data aliases each have their own counter,
    and one can be changed with no counter of the other moving. Others do (detach(), a view with another dtype):
    Python cannot read a counter's identity, so this bumps the tensor's and looks whether the owner's moved too,
    then puts it back (under the GIL; a change in place racing a save from another thread is a race already)."""
    if owner is tensor:
        return True
    if owner is None:
        return False
    version = tensor._version
    if owner._version != version or not CAN_SET_VERSION:  # (no way to tell: a copy of its own)
        return False
    set_version(tensor, version + 1)
    try:
        return owner._version == version + 1
    finally:
        set_version(tensor, version)


def byte_view(storage, device, nbytes):
    """A flat uint8 tensor over a whole storage."""
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage, 0, (nbytes,), (1,))


class _Working:
    """Counts the operations of a session in progress (entered under res.lock, so from one thread at a time); the
    last to end handles the drops that the garbage collector made meanwhile."""
    __slots__ = ("session", "depth")

    def __init__(self, session):
        self.session, self.depth = session, 0

    def __enter__(self):
        self.depth += 1

    def __exit__(self, exc_type, exc, tb):
        self.depth -= 1
        if not self.depth and self.session.dropped:
            self.session._drop_deferred()


class Session:
    """The entries saved inside one `with` of an ActivationOffload (one forward)."""

    def __init__(self, res, number):
        self.res, self.number = res, number
        self.entries = []
        # storage data_ptr -> its live entries (one per version counter and version saved; checked against the
        # storage itself): the pieces of an unsafe_chunk, saved in turns, each find their own again
        self.by_storage = {}
        self.pending = []      # entries with a copy or write in flight, oldest first
        self.resident = collections.deque()  # CPU entries written and still held in RAM, oldest first
        self.staged = 0        # bytes counted against staging_bytes now
        self.live = 0          # entries some saved tensor still uses
        self.open = True       # the forward is still running
        self.aborted = False
        self.path = self.identity = None
        self.file_end = 0
        self.reserved = 0      # bytes of the file allocated ahead of the writes
        self.nothing_below = 0  # entries below this index need no read-ahead (dead, or CPU tensors still in RAM)
        self.working = _Working(self)  # an operation of this session is in progress (under res.lock)
        self.dropped = []      # (entry, generation) of the drops that came in meanwhile, handled after it

    # ---- forward ----------------------------------------------------------------------------------------------
    def pack(self, tensor):
        res = self.res
        if not self.open:  # its hooks outlived their `with` (left under others), or close() came inside it
            raise RuntimeError(
                "a tensor was saved into an ActivationOffload forward that has ended: "
                + ("the ActivationOffload was closed (or the forward interrupted) inside its `with` block"
                   if self.aborted else "its saved-tensor hooks were still pushed after its `with` block, under "
                   "hooks pushed inside the block and left there")
                + "; exit contexts in the reverse order of entering them, and close() after the block")
        if not res.wanted(tensor):
            return KeptBy(self, tensor)
        storage, owner = tensor.untyped_storage(), counter_owner(tensor)
        with res.lock, self.working:
            version = tensor._version
            entry = next((e for e in self.by_storage.get(storage.data_ptr(), ())
                          if e.refs and e.storage_ref() is storage and e.version == version
                          and counts_with(e.owner_ref(), owner)), None)
            if entry is None:
                entry = self._offload(tensor, storage, owner)
                entry.refs += 1
                saved = Saved(self, entry, tensor)
                # with the entry in use: a write that finished at once keeps it resident. (An earlier write's error
                # raised here drops `saved` as the exception goes, and the entry with it: none left in use for good)
                self.poll()
                return saved
            else:
                res.stats["shared_views"] += 1
                entry.refs += 1
            return Saved(self, entry, tensor)

    def _offload(self, tensor, storage, owner):
        res, nbytes, device = self.res, storage.nbytes(), tensor.device
        entry = Entry(len(self.entries), nbytes, device, on_gpu(tensor), storage, tensor._version, owner)
        source = byte_view(storage, device, nbytes)
        to_disk = res.to == "nvme"
        if to_disk:
            self._make_room(nbytes)
            entry.staged = nbytes
            self.staged += nbytes
            res.stats["peak_staged_bytes"] = max(res.stats["peak_staged_bytes"], self.staged)
        try:
            if entry.gpu:
                block = res.pool.alloc(nbytes)
                entry.host, entry.pooled = block, True
                ready = torch.cuda.Event()
                ready.record(torch.cuda.current_stream(device))
                entry.d2h = copy_async(block[:nbytes], source, copy_stream(device, "to_host"), wait_for=ready)
                self.pending.append(entry)
            else:
                entry.host = source  # the tensor's own memory, held until written and the staging room is needed
            entry.watch = tensor.detach()  # (no grad_fn: no cycle through the graph that holds this entry)
            if to_disk:
                entry.offset = self._file_space(nbytes, storage.data_ptr() if entry.d2h is None else 0)
                if entry.d2h is None:
                    entry.write = res.handle.pwrite(source, self.path, entry.offset, identity=self.identity)
                    self.pending.append(entry)
        except BaseException:
            self._forget(entry)
            raise
        self.entries.append(entry)
        self.by_storage.setdefault(entry.key, []).append(entry)
        self.live += 1
        res.stats["tensors"] += 1
        res.stats["bytes"] += nbytes
        return entry

    def _forget(self, entry):
        """A save whose copy or write could not start (the file's creation or the write's submission failed): what
        it took goes back. (It counted against the staging room for good, and a CUDA tensor's entry stayed in
        `pending`, to be written later at no offset.)"""
        if entry in self.pending:
            self.pending.remove(entry)
        if entry.d2h is not None:
            try:
                entry.d2h.synchronize()  # the copy writes into the pinned block, which goes back to the pool
            except Exception:  # noqa: BLE001 - the save's own error is the one raised
                pass
            entry.d2h = None
        self.staged -= entry.staged
        entry.staged = 0
        self._release_host(entry)

    def _file_space(self, nbytes, address):
        """Where nbytes from memory at `address` go in the file: at the same place in a page as the address, so
        the direct I/O needs no bounce copy in either direction."""
        if self.path is None:
            self.path = os.path.join(self.res.directory, f"activations-{self.number}.swap")
            self.identity = _swapdir.create_private_file(self.path)
            self.res.owner.files.add(self.path)
        offset = round_up(self.file_end) + address % ALIGN
        self.file_end = offset + nbytes
        self._reserve(round_up(self.file_end))
        return offset

    def _reserve(self, end):
        """Allocates the file's blocks ahead of the writes (as much as the last forward used, at once): writes
        that extend a file take its inode lock exclusively, one at a time, and the I/O threads spun on it."""
        if end <= self.reserved:
            return
        size = max(end, self.res.file_hint, 2 * self.reserved)
        try:
            with OwnedFd.open(self.path, os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC) as owned:
                if _swapdir.identity_of(owned.fileno()) == self.identity:
                    os.posix_fallocate(owned.fileno(), 0, size)
        except OSError:
            size = float("inf")  # not supported (or no room for the reserve): the writes will say what is wrong
        self.reserved = size

    def _make_room(self, nbytes):
        """Lets the oldest written tensors go, then waits for the oldest transfers, until nbytes more fit
        staging_bytes (or nothing is left in flight)."""
        self.poll()
        while self.resident and self.staged + nbytes > self.res.staging_bytes:
            self._unstage(self.resident.popleft())
        if self.pending and self.staged + nbytes > self.res.staging_bytes:
            t0 = time.perf_counter()
            while self.pending and self.staged + nbytes > self.res.staging_bytes:
                self._advance(self.pending[0], block=True)
                self.poll()
                while self.resident and self.staged + nbytes > self.res.staging_bytes:
                    self._unstage(self.resident.popleft())
            self.res.stats["forward_wait_s"] += time.perf_counter() - t0
        # each write holds the file open until it finishes: a forward saving hundreds of small tensors had as many
        # in flight (EMFILE near ulimit -n), which the staging room, in bytes, let through
        while sum(e.write is not None for e in self.pending) >= MAX_IN_FLIGHT:
            t0 = time.perf_counter()
            self._advance(next(e for e in self.pending if e.write is not None), block=True)
            self.poll()
            self.res.stats["forward_wait_s"] += time.perf_counter() - t0

    def poll(self):
        """Moves finished transfers on, oldest first (a copy finished: its write starts; a write finished: its
        memory goes), without waiting."""
        for entry in list(self.pending):
            self._advance(entry, block=False)
        self.pending = [e for e in self.pending if e.d2h is not None or e.write is not None]

    def _advance(self, entry, block):
        res = self.res
        if entry.d2h is not None:
            if not block and not entry.d2h.query():
                return
            entry.d2h.synchronize()
            entry.d2h = None
            self._seen_read(entry)
            if entry.refs == 0:
                # dropped while its copy ran (a graph let go in the forward): its block goes now (to="cpu" kept it
                # until the session's last saved tensor went), with nothing to write (to="nvme" wrote it all the same)
                self._unstage(entry)
                return
            if res.to == "nvme":
                entry.write = res.handle.pwrite(entry.host[:entry.nbytes], self.path, entry.offset,
                                                identity=self.identity)
        if entry.write is not None:
            if not block and not entry.write.done():
                return
            write, entry.write = entry.write, None
            write.wait()  # raises the write's OSError
            if not entry.pooled:
                self._seen_read(entry)
            if entry.pooled or entry.refs == 0:
                self._unstage(entry)
            else:
                # A CPU tensor stays while the staging room allows: the last ones a forward saves are the first
                # its backward needs, and these it finds in memory (no read, no wait)
                self.resident.append(entry)

    @staticmethod
    def _changed(entry):
        """Whether the tensor was changed in place since it was saved (while its view is watched)."""
        return entry.watch is not None and entry.watch._version != entry.version

    def _seen_read(self, entry):
        """The transfer that reads the tensor's own memory (a CUDA tensor's copy to the host, a CPU tensor's
        write) was seen to finish. A change in place seen by now may have met the bytes on their way out: unpack
        raises, as autograd does without offload. (A change after that leaves the saved bytes as they were.)"""
        if self._changed(entry):
            entry.changed_in_flight = True
        if entry.pooled:
            entry.watch = None  # the device memory is the caching allocator's again

    def _unstage(self, entry):
        """The entry's bytes are on disk: its host memory goes (unless a backward is using it right now)."""
        self.staged -= entry.staged
        entry.staged = 0
        if entry.host is not None and not entry.pooled and entry.refs:
            self.nothing_below = min(self.nothing_below, entry.index)  # to be read back now: read-ahead looks again
        self._release_host(entry)

    def _release_host(self, entry):
        if entry.restored_own:
            # what an earlier unpack got was the tensor's own memory (an unpack in the forward, a first backward
            # with retain_graph): with the watch on its version gone, a change in place would go unseen, so the
            # next unpack reads back what was saved
            entry.restored = entry.base_ref = entry.held = None
            entry.restored_own = False
        host, entry.host, entry.watch = entry.host, None, None
        if host is not None and entry.pooled:
            self.res.pool.free(host, entry.last_copy)

    def close_forward(self):
        """The forward ended: transfers that finished let go of their memory (the rest as they finish)."""
        with self.res.lock, self.working:
            self.open = False
            self.poll()
            self._finish_if_done()

    # ---- backward ---------------------------------------------------------------------------------------------
    def unpack(self, saved):
        res = self.res
        with res.lock, self.working:
            if self.aborted:
                raise RuntimeError("these saved activations were discarded: the forward or backward that made "
                                   "them was interrupted, or the ActivationOffload was closed. Run the forward "
                                   "again.")
            entry = saved.entry
            storage, fresh = self._restore(entry)
            if fresh:
                entry.generation += 1
                entry.waiting = entry.refs
            if saved.generation != entry.generation:
                saved.generation = entry.generation
                entry.waiting -= 1
            base = None if fresh or entry.base_ref is None else entry.base_ref()
            if base is None:  # (or gone while the storage lived on: autograd keeps a shallow copy of what it unpacks)
                base = byte_view(storage, entry.device, entry.nbytes)
                entry.base_ref, entry.base_version = weakref.ref(base), base._version
            entry.held = base if entry.waiting > 0 else None
            changed_in_backward = base._version != entry.base_version
        if saved.entry.changed_in_flight:
            raise modified_in_place(saved.dtype, saved.size, "was changed in place while swapio was still copying "
                                    "it out of the forward, so what it saved may be half changed")
        if changed_in_backward:
            # a node that unpacked this storage earlier in the backward changed it in place (without offload the one
            # tensor's version counter moved, and autograd refuses the later unpack)
            raise modified_in_place(saved.dtype, saved.size, "was changed in place during the backward, by a node "
                                    "that unpacked it earlier")
        nbytes, itemsize = entry.nbytes, saved.dtype.itemsize
        whole = base if nbytes % itemsize == 0 else base[:nbytes - nbytes % itemsize]
        return whole.view(saved.dtype).as_strided(saved.size, saved.stride, saved.offset)

    def _restore(self, entry):
        """(The entry's storage back on its device: the one already back while something still uses it, whether
        it was brought back now)."""
        storage = entry.restored() if entry.restored is not None else None
        if storage is not None and entry.host is not None and not entry.pooled and self._changed(entry):
            storage = None  # the CPU tensor's own memory, changed in place since: back from the disk as saved
        if storage is None:
            if entry.loaded is None:
                if entry.host is None or entry.pooled:
                    self.res.stats["unpack_misses"] += 1
                self._load(entry)
            loaded, entry.loaded = entry.loaded, None
            try:
                self._prefetch_below(entry.index)
                t0 = time.perf_counter()
                storage = loaded.wait().untyped_storage()
            except BaseException:
                self._let_go_of_read(entry)  # (its copy to the device never queued: the block is still the read's)
                raise
            self.res.stats["backward_wait_s"] += time.perf_counter() - t0
            entry.restored = weakref.ref(storage)
            entry.restored_own = entry.host is not None and not entry.pooled
            return storage, True
        self._prefetch_below(entry.index)
        return storage, False

    def _prefetch_below(self, index):
        """Keeps the `prefetch` live entries below `index` loaded or on their way (the ones already are count;
        CPU tensors still in memory need nothing brought back, and do not)."""
        ahead, i, lowest = 0, index - 1, index
        while ahead < self.res.prefetch and i >= self.nothing_below:
            entry = self.entries[i]
            i -= 1
            if entry.refs == 0 or (entry.host is not None and not entry.pooled):
                continue
            ahead, lowest = ahead + 1, entry.index
            if entry.loaded is None and (entry.restored is None or entry.restored() is None):
                self._load(entry)
            elif entry.loaded is not None:
                entry.loaded.done()  # (a CUDA tensor's: its read finished since, its copy to the device goes now)
        if ahead < self.res.prefetch:
            # every entry below `lowest` needs nothing: the next unpacks stop there instead of walking down to the
            # first entry each time (quadratic in a backward with thousands of entries kept in RAM)
            self.nothing_below = lowest

    def _load(self, entry):
        """Starts bringing the entry's bytes back to its device: entry.loaded, a future of a uint8 tensor."""
        res, n = self.res, entry.nbytes
        self.poll()
        if not entry.gpu:
            if entry.host is not None and self._changed(entry):
                # changed in place since it was saved: what the file has is what was saved
                if entry.write is not None:
                    self._advance(entry, block=True)
                self._unstage(entry)
            if entry.host is not None:  # still in memory (kept, or its write is in flight)
                entry.loaded = Future.finished(entry.host)
                return
            target = res.read_blocks.take(n, entry.offset % ALIGN)
            read = res.handle.pread(target, self.path, entry.offset, identity=self.identity)
            entry.loaded = read._chain(lambda _: target)
            res.stats["read_bytes"] += n
            return
        if entry.d2h is not None or entry.write is not None:
            # still on its way out (the last tensors of a forward): let it arrive, so that the pinned block is
            # never freed while a copy back reads it
            self._advance(entry, block=True)
        with allocating_on_side_stream(entry.device):
            target = torch.empty(n, dtype=torch.uint8, device=entry.device)
        stream = copy_stream(entry.device)
        if entry.host is not None:  # to="cpu": the pinned copy stays until autograd drops the saved tensor
            host, read, keep = entry.host, Future.finished(n), True
        else:
            host, keep = res.pool.alloc(n), False
            try:
                read = res.handle.pread(host[:n], self.path, entry.offset, identity=self.identity)
            except BaseException:
                res.pool.free(host)  # refused at submission (ESTALE, EMFILE): nothing reads into it
                raise
            entry.reading = (host, read)
            res.stats["read_bytes"] += n

        def issue():
            # (a Ctrl-C between the copy queued and the block handed to it would give the block back on the read's
            # end alone, with the copy still reading it)
            with DeferredSigint(), res.lock:
                event = copy_async(target, host[:n], stream)
                if keep:
                    entry.last_copy = event
                else:
                    entry.reading = None
                    res.pool.free(host, event)
            return event
        entry.loaded = DeviceCopyFuture(read, issue, target)
        # queued now if the bytes are in host memory already (to="cpu"), else by a later unpack that sees its read
        # finished (done() queues it): the unpack then finds it running or done. (Each copy was queued only by
        # its own unpack, which held the host until it finished, and to="cpu" read nothing ahead at all.)
        entry.loaded.done()

    def _let_go_of_read(self, entry):
        """The load of a CUDA tensor's bytes from the disk ends with no copy to the device queued (its read or
        the copy's queueing failed, the unpack failed before it, or the saved tensor went with the load unused):
        its pinned block goes back to the pool, to be handed out again once the read is done with it. (Each
        left it counted in use for good, and pinned a new block for every later load.)"""
        if entry.reading is not None:
            host, read = entry.reading
            entry.loaded = entry.reading = None
            self.res.pool.free(host, _ReadDone(read))

    # ---- end ----------------------------------------------------------------------------------------------------
    def drop(self, entry, generation):
        """A saved tensor using `entry`, last unpacked in `generation`, was dropped by autograd."""
        with self.res.lock:
            if self.working.depth:
                # the garbage collector, run by an allocation inside this session's own save, unpack or end, freed
                # a graph caught in a reference cycle: dropped once that is done, not in its middle (a last drop
                # there reset the swap file under the save in progress, whose tensor then shared the file with
                # the next ones)
                self.dropped.append((entry, generation))
                return
            with self.working:
                self._drop(entry, generation)

    def _drop_deferred(self):
        """The drops that came in while this session was busy (under res.lock)."""
        with DeferredSigint(), self.working:  # (as Saved.__del__ has it: a Ctrl-C waits for the session to be whole)
            while self.dropped:
                self._drop(*self.dropped.pop(0))

    def _drop(self, entry, generation):
        entry.refs -= 1
        if generation != entry.generation and entry.waiting > 0:
            entry.waiting -= 1  # never unpacked since the storage came back: nothing waits for it now
            if entry.waiting == 0:
                entry.held = None
        if entry.refs > 0:
            return
        self.live -= 1
        self._let_go_of_read(entry)
        entry.loaded = entry.restored = entry.held = entry.base_ref = None
        if entry.d2h is None and entry.write is None:
            self._unstage(entry)  # (a resident one is skipped when its turn to go comes)
        same = self.by_storage.get(entry.key, [])
        if entry in same:
            same.remove(entry)
            if not same:
                del self.by_storage[entry.key]
        self._finish_if_done()

    def _finish_if_done(self):
        if self.live:
            return
        while self.pending:  # long finished by now, as a rule: the backward ran after them
            entry = self.pending[0]
            try:
                self._advance(entry, block=True)
            except OSError:
                entry.d2h = entry.write = None
                self._unstage(entry)
            self.pending.pop(0)
        self.resident.clear()
        for entry in self.entries:
            self._release_host(entry)
        self.res.file_hint = max(self.res.file_hint, round_up(self.file_end))
        if self.open:
            # a `with` around several steps (a training loop, each backward inside): nothing saved is left, so the
            # next forward writes the file from its start again (its entries and file grew step after step)
            self.entries.clear()
            self.file_end = self.nothing_below = 0
            return
        self._remove_file()
        self.res.sessions.discard(self)

    def abort(self):
        """Discards everything of this session now (an interrupt, or close()): transfers in flight are waited
        for (their memory is in use by the kernel or the GPU), then the memory and the file go."""
        interrupted = None
        with self.res.lock, self.working:
            self.aborted, self.open = True, False
            for entry in self.pending:
                try:
                    if entry.d2h is not None:
                        entry.d2h.synchronize()
                    if entry.write is not None:
                        entry.write.exception()
                except Exception:  # noqa: BLE001 - a transfer of what is being discarded: nothing to report
                    pass
                except BaseException as exc:  # noqa: BLE001 - Ctrl-C: the user's, raised once all is cleaned up
                    interrupted = interrupted or exc
                    if entry.d2h is not None and not entry.d2h.query():
                        # the copy into the block may still run: the pool hands the block out after it only
                        entry.last_copy = entry.d2h
                entry.d2h = entry.write = None
            self.pending.clear()
            self.resident.clear()
            for entry in self.entries:
                self._let_go_of_read(entry)
                entry.loaded = entry.restored = entry.held = entry.base_ref = None
                if entry.staged:
                    self.staged -= entry.staged
                    entry.staged = 0
                self._release_host(entry)
            self.entries.clear()
            self.by_storage.clear()
            self._remove_file()
            self.res.sessions.discard(self)
            self.res.read_blocks.clear()
        if interrupted is not None:
            raise interrupted

    def _remove_file(self):
        if self.path is not None:
            remove_soon(self.path)
            self.res.owner.files.discard(self.path)
            self.path = None


class _ReadDone:
    """A read from the disk into a pinned block, as the pool takes a block's last use (an event's query and
    synchronize): the block is handed out again only once the read finished, failed or not."""
    __slots__ = ("read",)

    def __init__(self, read):
        self.read = read

    def query(self):
        return self.read.done()

    def synchronize(self):
        self.read.exception()  # waits (its error was the unpack's, or nobody's: the load went unused)


def remove_soon(path):
    """Removes the file from its directory now and lets a thread free its blocks: the last reference to a large
    file frees them, and on ext4 the step waited 45-60 ms for that (with almost no CPU) at each backward's end."""
    try:
        owned = OwnedFd.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        owned = None  # gone already, or not a file of ours (a symlink planted there): the unlink below says
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    finally:
        if owned is not None:
            try:
                threading.Thread(target=owned.close, name="swapio-free-activations", daemon=True).start()
            except BaseException as exc:
                # No new threads (the interpreter is exiting), or a Ctrl-C inside start(), which may leave a thread
                # that never runs (Python keeps it listed, and with it the descriptor) or one that runs all the
                # same: closed here, the thread then finds it closed
                owned.close()
                if not isinstance(exc, RuntimeError):
                    raise
