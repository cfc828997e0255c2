"""InFlight: at most MAX_IN_FLIGHT requests of one loop in flight at once. Each request holds its file open (one
or two descriptors) until it finishes, so a loop that submitted one request per tensor and waited at the end
(an optimizer checkpoint of 800 parameters, a checkpoint of many big tensors, saved or loaded) held as many
descriptors as the disk had not finished yet: hundreds on a fast disk, thousands on a slow one, EMFILE under
`ulimit -n 1024`.
The queue each request keeps inside the handle is what keeps the disk busy; this many requests more is plenty."""
from collections import deque
from typing import Any, Callable, Deque

MAX_IN_FLIGHT = 32


class InFlight:
    def __init__(self, limit: int = MAX_IN_FLIGHT) -> None:
        self._futures: Deque[Any] = deque()
        self._limit = limit

    def submit(self, request: Callable[[], Any]) -> Any:
        """request()'s future, once fewer than the limit of those submitted here are unfinished. The older ones
        are only waited for here: their outcome (an error included) stays for whoever waits on them. An
        interruption while waiting submits nothing."""
        while len(self._futures) >= self._limit:
            self._futures[0].exception()
            self._futures.popleft()
        future = request()
        self._futures.append(future)
        return future
