"""`python -m tallow.testing [--fail-scheduler-when PATH] serve|generate ...`: tallow's CLI with
the test model sources registered (replay:<file.json>), optionally with the scheduler failing
once PATH exists (tallow/testing/faults.py)."""

from __future__ import annotations

import argparse
import sys

import tallow.testing  # noqa: F401  (registers the replay: model source)
from tallow.cli import main as cli_main
from tallow.testing.faults import fail_scheduler_when


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tallow.testing",
                                     description="tallow's CLI with the test fixtures registered")
    parser.add_argument("--fail-scheduler-when", metavar="PATH", default=None,
                        help="the engine's scheduler raises once PATH exists (an engine-thread failure)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="tallow's command line: serve | generate ...")
    args = parser.parse_args(argv)
    if args.fail_scheduler_when:
        fail_scheduler_when(args.fail_scheduler_when)
    return cli_main(args.command)


if __name__ == "__main__":
    sys.exit(main())
