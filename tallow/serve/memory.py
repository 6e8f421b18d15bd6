"""Memory back to the system after a big request.

Parsing, rendering and tokenizing a body of megabytes allocates in the planning threads' malloc
arenas; glibc keeps what is freed there (and raises its mmap threshold after a big block is
freed, so the next big block lands in an arena too), so without a trim a server's RSS stays at
its largest request's high-water mark. After a request whose body was at least
TRIM_AFTER_BODY_BYTES long, `HeapTrimmer` calls glibc's malloc_trim(0) in a worker thread
(ctypes releases the GIL for the call): at most one trim runs at a time, and requests that end
during one ask for one more after it. Where the C library has no malloc_trim (musl, macOS) it
does nothing.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging

log = logging.getLogger(__name__)

TRIM_AFTER_BODY_BYTES = 1 << 20


def _malloc_trim():
    try:
        trim = ctypes.CDLL(None).malloc_trim  # the process's C library
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


class HeapTrimmer:
    def __init__(self):
        self._trim = _malloc_trim()
        self._task: asyncio.Task | None = None
        self._again = False
        self.trims = 0  # done so far (tests read it)

    @property
    def available(self) -> bool:
        return self._trim is not None

    def after_request(self, body_bytes: int) -> None:
        """Called on the event loop when a request ends."""
        if self._trim is None or body_bytes < TRIM_AFTER_BODY_BYTES:
            return
        if self._task is not None:
            self._again = True
            return
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        try:
            while True:
                self._again = False
                await asyncio.to_thread(self._trim, 0)
                self.trims += 1
                if not self._again:
                    return
        except Exception:  # never fails a request; the next big one tries again
            log.exception("malloc_trim failed")
        finally:
            self._task = None
