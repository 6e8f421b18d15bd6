"""Fault injection for the engine-failure tests: nothing here runs unless a test asks for it."""

from __future__ import annotations

import os


def fail_scheduler_when(path: str) -> None:
    """From now on (in this process) Scheduler.schedule() raises RuntimeError once `path`
    exists: a test creates the file when its requests are under way, and the engine thread
    fails outside a step's model run."""
    from tallow.engine.scheduler import Scheduler

    schedule = Scheduler.schedule

    def schedule_or_fail(self):
        if os.path.exists(path):
            raise RuntimeError(f"injected fault: {path} exists")
        return schedule(self)

    Scheduler.schedule = schedule_or_fail
