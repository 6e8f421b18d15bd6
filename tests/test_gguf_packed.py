"""The repacked weights of a GGUF file kept on disk (tallow/models/gguf_packed.py): the first
native load writes them, a later one maps them instead of reading and repacking the file, and
its logits are bit for bit the repacking load's; a changed file or a damaged cache is never
read, and a cache of the same path is replaced, not kept beside."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from gguf_files import write_llama_gguf
from test_gguf_native import ALL_OF, Q4_K_M, Q5_K_M, logits_of, needs_kernels
from tallow.models import gguf_linear as gl
from tallow.models import gguf_packed

PROMPTS = [list(range(5, 30)), [7, 3, 99, 150, 2, 2, 41]]


def _load(path: str, cache_dir: str):
    from tallow.models.loader import load_model

    loaded = load_model(path, dtype=torch.float32, device="cpu", cache_dir=cache_dir)
    return loaded.model, loaded.config


def _packed_files(cache_dir) -> list[str]:
    folder = os.path.join(str(cache_dir), "gguf-packed")
    return sorted(os.listdir(folder)) if os.path.isdir(folder) else []


def _no_repacking(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("repacked from the file although the cache holds the weights")

    monkeypatch.setattr(gl, "repacked", refuse)


@needs_kernels
@pytest.mark.parametrize("types,arch,tied", [(Q4_K_M, "llama", False), (Q5_K_M, "qwen2", False),
                                             (ALL_OF["Q8_0"], "llama", True), (ALL_OF["Q4_1"], "llama", False),
                                             (dict(ALL_OF["Q4_0"], attn_v="F16"), "llama", False)],
                         ids=["Q4_K_M-mix", "Q5_K_M-mix-qwen2", "Q8_0-tied", "Q4_1", "Q4_0-with-F16-part"])
def test_a_second_load_maps_the_repacked_weights_to_the_same_logits(types, arch, tied, tmp_path, monkeypatch):
    path, cache = str(tmp_path / "m.gguf"), str(tmp_path / "cache")
    write_llama_gguf(path, types, arch=arch, tied=tied)
    first, config = _load(path, cache)
    files = _packed_files(cache)
    assert len(files) == 1 and not any(f.endswith(".tmp") for f in files)
    assert os.path.getsize(os.path.join(cache, "gguf-packed", files[0])) <= os.path.getsize(path)
    _no_repacking(monkeypatch)
    second, _ = _load(path, cache)
    assert [type(m) for m in second.modules()] == [type(m) for m in first.modules()]
    assert torch.equal(logits_of(second, config, PROMPTS), logits_of(first, config, PROMPTS))
    assert _packed_files(cache) == files


@needs_kernels
def test_an_edited_file_is_repacked_and_its_old_cache_removed(tmp_path, monkeypatch):
    path, cache = str(tmp_path / "m.gguf"), str(tmp_path / "cache")
    write_llama_gguf(path, Q4_K_M, seed=0)
    _load(path, cache)
    old = _packed_files(cache)
    write_llama_gguf(path, Q4_K_M, seed=1)  # new weights, size and mtime
    os.utime(path, ns=(os.stat(path).st_atime_ns, os.stat(path).st_mtime_ns + 10**9))
    edited, config = _load(path, cache)
    new = _packed_files(cache)
    assert len(new) == 1 and new != old
    fresh, _ = _load(path, None)  # no cache at all
    assert torch.equal(logits_of(edited, config, PROMPTS), logits_of(fresh, config, PROMPTS))


@needs_kernels
@pytest.mark.parametrize("damage", ["truncated", "other-key"])
def test_a_damaged_cache_is_dropped_and_the_file_repacked(damage, tmp_path, caplog):
    path, cache = str(tmp_path / "m.gguf"), str(tmp_path / "cache")
    write_llama_gguf(path, Q4_K_M)
    good, config = _load(path, cache)
    target = os.path.join(cache, "gguf-packed", _packed_files(cache)[0])
    with open(target, "r+b") as f:
        data = f.read()
        if damage == "truncated":
            f.truncate(len(data) // 2)
        else:  # a record that names another tensor: a cache this load would misread
            at = data.rindex(b'"blk.0.attn_output"')
            f.seek(at)
            f.write(b'"blk.0.attn_outpux"')
    with caplog.at_level(logging.WARNING, logger="tallow.models"):
        reloaded, _ = _load(path, cache)
    assert "repacked weights unusable" in caplog.text
    assert torch.equal(logits_of(reloaded, config, PROMPTS), logits_of(good, config, PROMPTS))
    # and the cache written again is whole
    assert gguf_packed.PackedWeights.open(path, cache).reading


@needs_kernels
def test_no_cache_where_it_is_turned_off(tmp_path, monkeypatch):
    path, cache = str(tmp_path / "m.gguf"), str(tmp_path / "cache")
    write_llama_gguf(path, Q4_K_M)
    monkeypatch.setenv("TALLOW_GGUF_PACKED", "0")
    _load(path, cache)
    assert _packed_files(cache) == []


@needs_kernels
def test_a_failed_write_leaves_no_file_and_the_load_stands(tmp_path, monkeypatch):
    """A full disk (or any write error) while the cache is written costs the next load its repack,
    never this load: its model is whole and no partial file is left behind."""
    path, cache = str(tmp_path / "m.gguf"), str(tmp_path / "cache")
    write_llama_gguf(path, Q4_K_M)
    real_open = open
    writes = {"n": 0}

    class Full:
        def __init__(self, f):
            self.f = f

        def write(self, data):
            writes["n"] += 1
            if writes["n"] > 3:
                raise OSError(28, "No space left on device")
            return self.f.write(data)

        def __getattr__(self, name):
            return getattr(self.f, name)

    def opener(file, mode="r", *args, **kwargs):
        f = real_open(file, mode, *args, **kwargs)
        return Full(f) if str(file).endswith(".tmp") else f

    monkeypatch.setattr("builtins.open", opener)
    model, config = _load(path, cache)
    monkeypatch.undo()
    assert writes["n"] > 3 and _packed_files(cache) == []
    fresh, _ = _load(path, None)
    assert torch.equal(logits_of(model, config, PROMPTS), logits_of(fresh, config, PROMPTS))


@needs_kernels
def test_each_kernel_build_reads_only_its_own_layout(tmp_path, monkeypatch):
    """The two builds lay the K-quant bit planes out differently: a cache written under one is
    never read under the other (the key names the build), and each load computes its build's
    logits."""
    from tallow.ops import cpu_native

    variants = cpu_native.supported_variants()
    if len(variants) < 2:
        pytest.skip("one kernel build on this CPU")
    path, cache = str(tmp_path / "m.gguf"), str(tmp_path / "cache")
    write_llama_gguf(path, Q4_K_M)
    for variant in variants + variants[:1]:  # e.g. avx512, avx2, then avx512 again
        monkeypatch.setattr(cpu_native, "_lib", cpu_native.load(variant))
        monkeypatch.setattr(cpu_native, "_tried", True)
        cached, config = _load(path, cache)
        fresh, _ = _load(path, None)
        assert torch.equal(logits_of(cached, config, PROMPTS), logits_of(fresh, config, PROMPTS))
        assert len(_packed_files(cache)) == 1


@needs_kernels
@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs Linux's /proc/self/smaps")
def test_the_mapped_cache_asks_for_huge_pages(tmp_path):
    """Decode streams every weight each token; the mapping is advised MADV_HUGEPAGE so pages the
    page cache reads back come as 2 MB folios (VmFlags 'hg' in smaps)."""
    path, cache = str(tmp_path / "m.gguf"), str(tmp_path / "cache")
    write_llama_gguf(path, Q4_K_M)
    _load(path, cache)
    model, _ = _load(path, cache)
    target = os.path.join(cache, "gguf-packed", _packed_files(cache)[0])
    flags, current = None, None
    with open("/proc/self/smaps") as f:
        for line in f:
            if "-" in line.split(" ", 1)[0]:
                current = line.rstrip("\n").split(None, 5)[5:] or [""]
            elif line.startswith("VmFlags:") and current[0] == target:
                flags = line.split()[1:]
    assert flags is not None, "the cache file is not mapped"
    assert "hg" in flags
    del model
