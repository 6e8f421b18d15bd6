"""The float32 cache of a GGUF file (the default model's warm start): a new cache of a file
replaces the caches its earlier copies left (reinstalled wheel, edited file), never those of
another file of the same name that still exists."""

from __future__ import annotations

import os

import torch

from gguf_files import write_llama_gguf
from tallow.models import gguf


def _caches(cache_dir: str) -> list[str]:
    return sorted(os.listdir(os.path.join(cache_dir, "gguf")))


def _write(path: str, cache_dir: str) -> None:
    config, metadata, _ = gguf.read_gguf(path)
    gguf.write_cache(path, cache_dir, config, metadata, {"w": torch.zeros(4)})
    assert gguf.read_cache(path, cache_dir) is not None


def test_new_cache_replaces_stale_ones_of_the_same_file(tmp_path):
    cache_dir = str(tmp_path / "cache")
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    first, other = str(a / "model.gguf"), str(b / "model.gguf")
    write_llama_gguf(first, {}, hidden=64, inter=128)
    write_llama_gguf(other, {}, hidden=64, inter=128)
    _write(first, cache_dir)
    _write(other, cache_dir)
    assert len(_caches(cache_dir)) == 2  # two files of one name: both kept

    st = os.stat(first)
    os.utime(first, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # the file changed (a reinstall)
    assert gguf.read_cache(first, cache_dir) is None
    _write(first, cache_dir)
    assert len(_caches(cache_dir)) == 2  # the old cache of `first` is gone, `other`'s kept
    assert gguf.read_cache(other, cache_dir) is not None

    os.remove(other)  # a file that is gone: its cache goes at the next write of that name
    st = os.stat(first)
    os.utime(first, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    _write(first, cache_dir)
    assert len(_caches(cache_dir)) == 1


def test_caches_of_other_names_and_old_formats(tmp_path):
    cache_dir = str(tmp_path / "cache")
    path = str(tmp_path / "model.gguf")
    write_llama_gguf(path, {}, hidden=64, inter=128)
    folder = tmp_path / "cache" / "gguf"
    folder.mkdir(parents=True)
    old = folder / "model-0123456789abcdef.safetensors"  # an earlier format's cache: no source recorded
    old.write_bytes(b"not a safetensors file")
    unrelated = folder / "model-q8-0123456789abcdef.safetensors"  # another file's name
    unrelated.write_bytes(b"x")
    _write(path, cache_dir)
    names = _caches(cache_dir)
    assert old.name not in names and unrelated.name in names and len(names) == 2
