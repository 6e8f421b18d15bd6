"""Files the loader derives from a GGUF file and keeps in the cache folder (gguf.py's float32
conversion, gguf_packed.py's repacked weights): each is named `<stem>-<16 hex digits><suffix>`
and records the source it came from as source_key() gave it, so that writing one can delete the
others that no longer serve (their source gone or changed)."""

from __future__ import annotations

import os
from collections.abc import Callable


def source_key(path: str) -> list:
    """What identifies a GGUF file's contents for a cache: [real path, size, mtime in ns]."""
    st = os.stat(path)
    return [os.path.realpath(path), st.st_size, st.st_mtime_ns]


def remove_stale(path: str, keep: str, suffix: str, read_source: Callable[[str], list | None],
                 same_source_too: bool = False) -> None:
    """Delete the files beside `keep` derived from files of path's name whose source is gone or
    changed (a reinstalled wheel, an edited file: each would otherwise leave a copy of the model
    behind for good), that record none (an older format) or cannot be read (a torn write); with
    same_source_too, also the others derived from path itself (another build's layout). Files of
    another file of the same name that still exists are kept. read_source(file): its recorded
    source, None if it has none; raising counts as unreadable."""
    stem = os.path.basename(path).removesuffix(".gguf")
    folder, real = os.path.dirname(keep), os.path.realpath(path)
    for name in os.listdir(folder):
        other = os.path.join(folder, name)
        if other == keep or not (name.startswith(stem + "-") and name.endswith(suffix)) \
                or len(name) != len(stem) + 1 + 16 + len(suffix):
            continue
        try:
            source = read_source(other)
            stale = source is None or not os.path.exists(source[0]) or source_key(source[0]) != source \
                or (same_source_too and source[0] == real)
        except Exception:  # unreadable: a torn write or another format
            stale = True
        if stale:
            try:
                os.remove(other)
            except OSError:
                pass
