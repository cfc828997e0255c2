"""Streams and events of a simulated GPU, for testing CUDA pipelines on the CPU: a stream runs its queued work only
when made to (the host waits for an event recorded after it, or another stream waits for one), as a GPU may run it
late, so an ordering the code forgot shows up as wrong values. `trace` (optional) records what ran and what the host
waited for."""


class Stream:
    def __init__(self, name="stream", trace=None):
        self.name, self.trace, self.ops, self.ran = name, trace, [], 0

    def enqueue(self, op, what="op"):
        self.ops.append((op, what))

    def run_until(self, mark):
        while self.ran < mark:
            op, what = self.ops[self.ran]
            self.ran += 1
            op()
            if self.trace is not None:
                self.trace.append(("ran", self.name, what))

    def run_all(self):
        self.run_until(len(self.ops))

    def wait_event(self, event):
        self.enqueue(event.synchronize_quietly, "wait")

    def wait_stream(self, other):
        event = Event()
        event.record(other)
        self.wait_event(event)


class Event:
    trace = None  # where the host's waits for unfinished work are recorded (a test's fixture sets it)

    def __init__(self, *args, **kwargs):
        self.stream, self.mark = None, 0

    def record(self, stream=None):
        self.stream, self.mark = stream, len(stream.ops)

    def query(self):
        return self.stream is None or self.stream.ran >= self.mark

    def synchronize_quietly(self):
        if self.stream is not None:
            self.stream.run_until(self.mark)

    def synchronize(self):
        if not self.query() and Event.trace is not None:  # with how many copies to the device queued after it
            later = sum(1 for _, what in self.stream.ops[self.mark:] if what == "to device")
            Event.trace.append(("host waits", self.stream.name, self.stream.ops[self.mark - 1][1], later))
        self.synchronize_quietly()
