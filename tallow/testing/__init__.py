"""Test fixtures that ship with tallow but never load unless asked for: importing this package
registers the `replay:` model source (replay.py); `python -m tallow.testing` is tallow's CLI
with it registered, and with fault injection for the engine-failure tests (faults.py).

This package sits at the top of the dependency order, beside the CLI: nothing in tallow
imports it."""

from tallow.testing.replay import register_replay_source

register_replay_source()
