"""A bounded admission queue: past the engine's running slots plus `max_queue`, answer 429."""

from __future__ import annotations

# What a 429 tells the client to wait before trying again, in seconds.
RETRY_AFTER_S = 1


class AdmissionQueue:
    """Counts the sequences the server has in flight (a request with n choices weighs n).

    A request that would pass capacity is refused, unless nothing is in flight (so a lone
    request heavier than capacity still runs). All calls come from the event loop, so plain
    counters suffice.
    """

    def __init__(self, max_running: int, max_queue: int):
        self.capacity = max_running + max_queue
        self.in_flight = 0
        self.num_rejected = 0

    def try_admit(self, weight: int) -> "Admission | None":
        if self.in_flight + weight > self.capacity and self.in_flight > 0:
            self.num_rejected += 1
            return None
        self.in_flight += weight
        return Admission(self, weight)


class Admission:
    """One admitted request's place; release() is idempotent."""

    def __init__(self, queue: AdmissionQueue, weight: int):
        self._queue = queue
        self._weight = weight

    def release(self) -> None:
        self._queue.in_flight -= self._weight
        self._weight = 0
