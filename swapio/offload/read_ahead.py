"""ReadAhead: the fetches the streamer starts ahead along one walk (schedule.ahead in forward, .behind in backward),
kept as a frontier that each module's call extends instead of walking again.

At a module, read-ahead starts the fetches of the next `prefetch` units along the walk (units under SMALL bytes,
norms and biases, ride along without counting), then, for disk reads, as many more as the ring has room for, at
most WALK_UNITS units. Walking those units again at every module, to find them already started, was most of a
forward of many small modules (800 Linear(16, 16) under cpu_offload: 0.35 ms a module, resident 10 us). So the
units the last call started are remembered, nearest first; when the next module is the first of them (the walk
was right), it is taken off and only what the walk now reaches beyond them is started: O(1) a module once the
schedule has learned the order (while it learns, in the first forward, each module compares up to WALK_UNITS
remembered units with the walk, without starting anything).

What is remembered stays true or is forgotten: a unit whose fetch left the fetcher's table since (released, made
room for another, drained; or its copy flag cleared) is forgotten with the units after it, and started again as
the old walk did; a changed schedule has the remembered units compared with its walk (cut at the first that
differs), and a module that is not the first remembered one starts a new frontier. Each call thus starts the
same fetches, with the same copy flags and in the same order, as a walk from scratch would.
"""
import collections
import itertools

SMALL = 1 << 20  # a unit with fewer bytes than this does not count towards `prefetch`
# the most units one read-ahead reaches: without a bound, a model of small modules (each under SMALL, or all in the
# ring) read its whole length ahead at every module
WALK_UNITS = 64


class ReadAhead:
    """The frontier of one walk (schedule.ahead or .behind) of one streamer. Called under the fetcher's lock."""

    def __init__(self, fetcher, schedule, prefetch):
        self.fetcher, self.schedule, self.prefetch = fetcher, schedule, prefetch
        self.by_bytes = fetcher.ring is not None  # disk reads: as far ahead as the ring holds
        self.limit = max(WALK_UNITS, prefetch)
        self.removed = fetcher.watch_removals()  # records whose fetch left the table since the last call
        self.walked = 0  # units the walk gave (tests: a forward takes about one a module, not WALK_UNITS)
        self.dirty = False  # set while a call changes the frontier: one cut short (Ctrl-C) starts anew
        self._reset(None)

    def _reset(self, origin):
        self.origin = origin  # the unit the frontier is ahead of (whose module runs)
        self.units = collections.deque()  # the units whose records were all started, nearest first
        self.at = {}  # record -> deque of the positions in self.units (counted from the start) that hold it
        self.first = 0  # the position of self.units[0]
        self.big = collections.deque()  # per unit: whether it counts towards prefetch
        self.bigs = 0  # units that count, in self.units
        self.near = self.near_bigs = 0  # the leading units started with copy=True, and how many of them count
        self.seen = set() if origin is None else {origin}  # the walk's: origin, self.units, and `pending`
        self.walk, self.pending = None, None  # the walk going on past self.units; a unit it gave, not yet started
        self.version = self.schedule.version

    def __call__(self, walk, unit):
        """Starts the read-ahead of `unit`'s module (walk: the schedule's bound method, looked up by the caller)."""
        if self.dirty or self.fetcher.rewritten is not None:  # (then nothing is read: every start refuses)
            self._reset(None)
        self.dirty = True
        self._forget(self.removed)
        self.removed[:] = []
        self._move_to(walk, unit)
        if self._widen_near():
            self._extend(walk)
        self.dirty = False

    # ---- keeping what is remembered true ------------------------------------------------------------------------
    def _forget(self, records):
        """Forgets the units from the first one holding one of `records` on (all of them after the log's None)."""
        if records and records[-1] is None:
            self._cut(0)
            return
        cut = min((self.at[r][0] for r in records if r in self.at), default=None)
        if cut is not None:
            self._cut(cut - self.first)

    def _left_ahead(self, done):
        """After a start: where a fetch of a remembered unit after self.units[:done] left the table meanwhile (a
        hold() released by the start), the units from it on are forgotten, to be started again as a walk from
        scratch would when it reached them. (Those in self.units[:done], passed already, are forgotten by the
        next call: the log keeps them.)"""
        if self.removed:
            position = self.first + done
            if self.removed[-1] is None:  # (too many to tell which)
                self._cut(done)
                return
            cut = min((p for r in self.removed for p in self.at.get(r, ()) if p >= position), default=None)
            if cut is not None:
                self._cut(cut - self.first)

    def _cut(self, keep):
        """Forgets self.units[keep:] (their fetches stay: a walk from scratch would find them started)."""
        while len(self.units) > keep:
            unit = self.units.pop()
            big = self.big.pop()
            self.bigs -= big
            for record in unit.records:
                self._unmark(record, left=False)
            self.seen.discard(unit)
        if self.near > keep:
            self.near, self.near_bigs = keep, sum(list(self.big)[:keep])  # (the remembered near ones: few)
        self._new_walk()

    def _new_walk(self):
        if self.pending is not None:
            self.seen.discard(self.pending)
        self.walk = self.pending = None

    def _unmark(self, record, left):
        at = self.at[record]
        at.popleft() if left else at.pop()
        if not at:
            del self.at[record]

    def _move_to(self, walk, unit):
        if unit is not self.origin:
            if not self.units or self.units[0] is not unit:
                self._reset(unit)
                return
            self.units.popleft()  # the walk was right: the module that runs is the first one remembered
            big = self.big.popleft()
            for record in unit.records:
                self._unmark(record, left=True)
            self.first += 1
            self.bigs -= big
            self.near, self.near_bigs = max(self.near - 1, 0), self.near_bigs - big if self.near else 0
            self.seen.discard(self.origin)
            self.origin = unit
        if self.version != self.schedule.version:  # compare what is remembered with the walk now
            self.version = self.schedule.version
            same = 0
            for now, then in zip(walk(unit), self.units):
                if now is not then:
                    break
                same += 1
            self._cut(same)

    # ---- starting fetches ---------------------------------------------------------------------------------------
    def _start(self, unit, near, before):
        """Starts `unit`'s records; False when the ring has no room for one, after dropping reads ahead that the
        walk does not reach up to here (those of the origin and of self.units[:before] stay)."""
        fetcher = self.fetcher
        for i, record in enumerate(unit.records):
            fetch = fetcher.start(record, copy=near)
            if fetch is None:
                keep = set(self.origin.records)
                for other in itertools.islice(self.units, before):
                    keep.update(other.records)
                keep.update(unit.records[:i + 1])
                if fetcher.drop_unused(keep=keep):
                    fetch = fetcher.start(record, copy=near)
            if fetch is None:
                return False
        return True

    def _widen_near(self):
        """Starts the remembered units that are among the next `prefetch` counting ones now with copy=True (for
        CUDA: copied to the device as soon as they are read; they are started already). False when that ends
        the call: the ring refused one (its fetch had left the table: the frontier is cut there)."""
        while self.near < len(self.units) and self.near_bigs < self.prefetch:
            unit, done = self.units[self.near], self.near
            if not self._start(unit, True, done):
                self._cut(done)
                return False
            self.near_bigs += self.big[done]
            self.near += 1
            self._left_ahead(done + 1)
        return True

    def _extend(self, walk):
        """Starts the units the walk reaches past self.units, up to the first the ring has no room for."""
        while len(self.units) < self.limit:
            near = self.bigs < self.prefetch
            if not (near or self.by_bytes):
                return
            unit = self.pending
            if unit is None:
                if self.walk is None:
                    last = self.units[-1] if self.units else self.origin
                    self.walk = walk(last, self.seen)
                unit = next(self.walk, None)
                if unit is None:  # the walk ended: the next call walks on from the last unit (the origin moved)
                    self.walk = None
                    return
                self.walked += 1
                self.pending = unit
                self.seen.add(unit)
            if not self._start(unit, near, len(self.units)):
                return  # (the pending unit is tried first next time)
            self.pending = None
            big = sum(r.nbytes for r in unit.records) >= SMALL
            position = self.first + len(self.units)
            self.units.append(unit)
            self.big.append(big)
            for record in unit.records:
                self.at.setdefault(record, collections.deque()).append(position)
            self.bigs += big
            if near:
                self.near += 1
                self.near_bigs += big
