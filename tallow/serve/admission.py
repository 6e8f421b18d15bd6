"""A bounded admission queue: past the engine's running slots plus `max_queue`, answer 429."""

from __future__ import annotations

from tallow.serve.plan import Rejection

# What a 429 tells the client to wait before trying again, in seconds.
RETRY_AFTER_S = 1


class AdmissionQueue:
    """Counts the sequences the server has in flight (a request with n choices for each of its
    prompts weighs prompts x n).

    A request that would pass capacity is refused with a 429, whatever is in flight. One
    heavier than the whole capacity could never be admitted: the route answers it 400 at once
    (`too_heavy`), never a 429 to retry. All calls come from the event loop, so plain counters
    suffice.
    """

    def __init__(self, max_running: int, max_queue: int):
        self.capacity = max_running + max_queue
        self.in_flight = 0
        self.num_rejected = 0

    def try_admit(self, weight: int) -> "Admission | None":
        if self.in_flight + weight > self.capacity:
            self.num_rejected += 1
            return None
        self.in_flight += weight
        return Admission(self, weight)

    def too_heavy(self, weight: int, n: int) -> Rejection:
        """The 400 of a request of `weight` sequences, over the capacity (n: its choices per prompt)."""
        prompts = weight // n
        what = f"{prompts} prompts x n = {n}" if prompts > 1 else f"n = {n}"
        return Rejection.invalid(
            f"this request runs {weight} sequences ({what}), more than this server's capacity of "
            f"{self.capacity} (running slots plus queue: --max-num-seqs and --max-queue)",
            "prompt" if prompts > 1 and prompts >= n else "n")


class Admission:
    """One admitted request's place; release() is idempotent."""

    def __init__(self, queue: AdmissionQueue, weight: int):
        self._queue = queue
        self._weight = weight

    def release(self) -> None:
        self._queue.in_flight -= self._weight
        self._weight = 0
