"""Which units run next: learned from the order their forwards start in, so prefetches follow the real order.

Before anything ran, units are expected in module registration order, the last followed by the first (the next
forward of a generate() loop). Each forward start records "u came after the previous one", so a model whose
modules run in another order (or skip some) is predicted right from its second forward on.
"""


class Schedule:
    def __init__(self, units):
        n = len(units)
        self.next = {u: units[(i + 1) % n] for i, u in enumerate(units)}
        self.prev = {u: units[i - 1] for i, u in enumerate(units)}
        self.last = None

    def observe(self, unit):
        if self.last is not None and self.last is not unit:
            self.next[self.last] = unit
            self.prev[unit] = self.last
        self.last = unit

    def _walk(self, links, unit, k):
        out, u = [], unit
        for _ in range(k):
            u = links.get(u)
            if u is None or u is unit or u in out:
                break
            out.append(u)
        return out

    def ahead(self, unit, k):
        """The k units expected to start after `unit` (fewer if the chain loops back)."""
        return self._walk(self.next, unit, k)

    def behind(self, unit, k):
        """The k units that ran before `unit` (the order backward needs them in)."""
        return self._walk(self.prev, unit, k)
