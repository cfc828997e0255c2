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

    def observe(self, unit):
        if self.last is None:  # the first unit that ever ran starts every forward
            self.first = unit
        self.unseen.pop(unit, None)
        if self.last is not None and self.last is not unit:
            self.next[self.last] = unit
            self.prev[unit] = self.last
        self.last = unit

    @staticmethod
    def _walk(links, unit):
        seen, u = {unit}, links.get(unit)
        while u is not None and u not in seen:
            yield u
            seen.add(u)
            u = links.get(u)

    def ahead(self, unit):
        """The units expected to start after `unit`, nearest first, until the chain loops back (lazily)."""
        seen, u = {unit}, unit
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

    def behind(self, unit):
        """The units that ran before `unit`, nearest first (the order backward needs them in), lazily."""
        return self._walk(self.prev, unit)
