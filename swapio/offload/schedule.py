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

    @staticmethod
    def _walk(links, unit):
        seen, u = {unit}, links.get(unit)
        while u is not None and u not in seen:
            yield u
            seen.add(u)
            u = links.get(u)

    def ahead(self, unit):
        """The units expected to start after `unit`, nearest first, until the chain loops back (lazily)."""
        return self._walk(self.next, unit)

    def behind(self, unit):
        """The units that ran before `unit`, nearest first (the order backward needs them in), lazily."""
        return self._walk(self.prev, unit)
