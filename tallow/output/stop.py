"""StopMatcher: stop strings on streamed text."""

from __future__ import annotations

from tallow.output.partial_match import partial_suffix_len


class StopMatcher:
    """Cuts the text at the first stop string.

    Rule: the occurrence that starts earliest in the text wins; between stop strings
    that start at the same place, the shortest (it completes first). push() releases the
    text that can no longer be part of a stop string and holds back the rest: the
    longest tail that is a prefix of some stop string, and, when a match is found while
    an earlier-starting partial match is still open, everything from that earlier start
    until it resolves. On a match it releases the text before the stop string (plus the
    stop string with include_stop_str_in_output), sets `stopped` and `matched`, and
    ignores all later text. Empty stop strings are ignored.
    """

    def __init__(self, stops: list[str], include_stop_str_in_output: bool = False):
        self._stops = sorted({s for s in stops if s}, key=len)
        self._include = include_stop_str_in_output
        self._held = ""
        self.stopped = False
        self.matched: str | None = None

    def push(self, text: str) -> str:
        if self.stopped:
            return ""
        if not self._stops:
            return text
        text = self._held + text
        start, stop = self._first_match(text)
        held_from = len(text) - partial_suffix_len(text, self._stops)
        # A match is final unless a stop string that starts earlier may still complete.
        if stop is not None and start <= held_from:
            return self._stop_at(text, start, stop)
        self._held = text[held_from:]
        return text[:held_from]

    def flush(self) -> str:
        """At the end of generation: the held text, cut at a stop string it holds."""
        if self.stopped:
            return ""
        text, self._held = self._held, ""
        start, stop = self._first_match(text)
        if stop is not None:
            return self._stop_at(text, start, stop)
        return text

    def _first_match(self, text: str) -> tuple[int, str | None]:
        best_start, best = len(text), None
        for stop in self._stops:  # shortest first: ties keep the shortest
            start = text.find(stop)
            if start != -1 and start < best_start:
                best_start, best = start, stop
        return best_start, best

    def _stop_at(self, text: str, start: int, stop: str) -> str:
        self.stopped, self.matched, self._held = True, stop, ""
        return text[:start] + (stop if self._include else "")
