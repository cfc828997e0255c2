"""Which units run next: learned from the order their forwards start in, so prefetches follow the real order.

Each forward start records "u came after the previous one", so a model whose modules run in another order (or
skip some) is predicted right from its second forward on. Where nothing was learned yet after a unit, the units
that never ran come next, in module registration order, then the unit that started the first forward (the next
forward of a generate() loop) and what was learned after it. Following registration links instead predicted the
first forward wrong wherever registration and execution orders differ: transformers' decoder layers register
their norms after attention and MLP but run them before, so a walk from input_layernorm along registration links
skipped the layer's own projections; read-ahead dropped their reads to make room for the next layer and read
them again (up to 11 times each: a Llama's first forward read 2.4-5x its checkpoint).
"""


class Schedule:
    def __init__(self, units):
        self.next = {}  # learned: the unit that started after each one
        self.first = units[0] if units else None  # the unit a forward starts with: the first one that ran
        self.prev = {u: units[i - 1] for i, u in enumerate(units)}
        self.unseen = dict.fromkeys(units)  # units that never ran, in registration order (an ordered set)
        self.last = None
        self.version = 0  # changes whenever a walk may have changed (read_ahead.py checks what it walked then)

    def observe(self, unit):
        last, changed = self.last, False
        if last is None and self.first is not unit:  # the first unit that ever ran starts every forward
            self.first, changed = unit, True
        if unit in self.unseen:
            del self.unseen[unit]
            changed = True
        if last is not None and last is not unit and (self.next.get(last) is not unit
                                                      or self.prev.get(unit) is not last):
            self.next[last] = unit
            self.prev[unit] = last
            changed = True
        self.last = unit
        if changed:
            self.version += 1

    @staticmethod
    def _walk(links, unit, seen=None):
        seen, u = {unit} if seen is None else seen, links.get(unit)
        while u is not None and u not in seen:
            yield u
            seen.add(u)
            u = links.get(u)

    def ahead(self, unit, seen=None):
        """The units expected to start after `unit`, nearest first, until the chain loops back (lazily). `seen`:
        the units not to yield (default {unit}), which the walk adds to: with `unit` the last one a walk yielded
        and its `seen`, the rest of that walk."""
        seen, u = {unit} if seen is None else seen, unit
        while True:
            following = self.next.get(u)
            if following is None:  # nothing learned yet: the units that never ran, then the next forward
                for v in list(self.unseen):
                    if v not in seen:
                        seen.add(v)
                        yield v
                following = self.first
            if following is None or following in seen:
                return
            yield following
            seen.add(following)
            u = following

    def behind(self, unit, seen=None):
        """The units that ran before `unit`, nearest first (the order backward needs them in), lazily (`seen`:
        as for ahead)."""
        return self._walk(self.prev, unit, seen)
