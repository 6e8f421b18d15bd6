"""PackedWeights: a GGUF file's weights as repacked for the CPU kernels, kept on disk and mapped.

load_native repacks each block-quantized weight from the file's rows into its kernel's tiles
(gguf_linear.repacked). That costs little arithmetic, but the result lives in fresh anonymous
memory: on a VM that backs guest memory lazily and takes freed memory back (the 2-core
machines here), zeroing those pages was 82% of loading a 1.47 GB Q8_0 file (12-13 s, against
1.4 s for llama-server, which maps the file and runs from the page cache). So the first load
also writes the repacked buffers to one file under the cache folder, and later loads map that
file (copy-on-write, never written) instead of reading and repacking: the weights then live in
the page cache as the GGUF itself would.

The file: each buffer at a 64-byte boundary, then a JSON index (the source's path, size and
mtime, the kernels' variant, ABI and tile width, and per repack in load order its key and its
buffers' dtype, shape and offset), then the index's offset and a magic number. A load takes the
records in order and checks each key against the one it would repack; any difference (or a
torn file) drops the cache and the load repacks from the GGUF. The name carries a digest of the
source and the kernels, so a changed file or kernel build never reads an old cache; writing one
deletes the other caches of the same path and those whose file is gone or changed
(cache_files.remove_stale). The cache holds the repacked projections and LM head
only: no larger than the GGUF file.
"""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import shutil
import struct

import numpy as np
import torch

from tallow.models.cache_files import remove_stale, source_key

log = logging.getLogger("tallow.models")

FORMAT = 1
_MAGIC = b"TLPACK01"
_ALIGN = 64  # (cache lines: what the kernels' vector loads want)
_DTYPES = {"uint8": np.uint8, "int8": np.int8, "float16": np.float16}  # the repacked buffers' types


class PackedMismatch(Exception):
    """The cache does not hold what this load repacks (another build wrote it, or it is torn)."""


def _kernels() -> dict:
    from tallow.ops import cpu_native

    return {"variant": cpu_native.variant(), "abi": cpu_native.ABI_VERSION, "tile": cpu_native.tile_channels()}


def cache_path(path: str, cache_dir: str) -> str:
    stem = os.path.basename(path).removesuffix(".gguf")
    key = json.dumps([FORMAT, source_key(path), _kernels()])
    return os.path.join(cache_dir, "gguf-packed", f"{stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.packed")


class PackedWeights:
    """One load's view of the cache: `reading` (take() hands out the mapped buffers in order) or
    writing (put() appends each repack's buffers; finish() publishes the file)."""

    def __init__(self, path: str, target: str, reading: bool):
        self.path, self.target, self.reading = path, target, reading
        self._next = 0
        if reading:
            with open(target, "rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
            if hasattr(mmap, "MADV_HUGEPAGE"):
                # Pages read back in after the page cache dropped them come in 2 MB folios mapped
                # whole: decode streams every weight a token, and 4 KB pages cost an 8B model 12%
                # of its rate here (4.35 against 4.9 tok/s).
                self._map.madvise(mmap.MADV_HUGEPAGE)
            index = _index(self._map)
            if index.get("source") != source_key(path) or index.get("kernels") != _kernels():
                raise PackedMismatch("another source or kernel build")
            self._records = index["records"]
        else:
            self._tmp = f"{target}.{os.getpid()}.tmp"  # (open() made the folder)
            self._file = open(self._tmp, "wb")
            self._records = []

    @classmethod
    def open(cls, path: str, cache_dir: str | None) -> PackedWeights | None:
        """The cache of this GGUF file: reading where a valid one exists, else writing (None where
        there is no cache folder, TALLOW_GGUF_PACKED=0, or too little free disk for a copy)."""
        if not cache_dir or os.environ.get("TALLOW_GGUF_PACKED", "1") == "0":
            return None
        target = cache_path(path, cache_dir)
        if os.path.exists(target):
            try:
                return cls(path, target, reading=True)
            except (OSError, ValueError, KeyError, PackedMismatch) as e:
                _drop(target, e)
        try:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            if shutil.disk_usage(os.path.dirname(target)).free < os.path.getsize(path) + (1 << 30):
                return None
            return cls(path, target, reading=False)
        except OSError:
            return None

    def take(self, key: list) -> dict[str, torch.Tensor | None]:
        """The next repack's buffers, mapped from the file; PackedMismatch unless its key is `key`."""
        if self._next >= len(self._records):
            raise PackedMismatch("fewer records than weights")
        record = self._records[self._next]
        self._next += 1
        if record["key"] != key:
            raise PackedMismatch(f"record {self._next - 1} is {record['key']}, not {key}")
        out: dict[str, torch.Tensor | None] = {}
        for name, spec in record["buffers"].items():
            if spec is None:
                out[name] = None
                continue
            np_dtype = _DTYPES[spec["dtype"]]
            count = int(np.prod(spec["shape"]))
            arr = np.frombuffer(self._map, dtype=np_dtype, count=count, offset=spec["offset"])
            out[name] = torch.from_numpy(arr.reshape(spec["shape"]))
        return out

    def put(self, key: list, buffers: dict[str, torch.Tensor | None]) -> None:
        if self._file is None:
            return
        specs = {}
        try:
            for name, t in buffers.items():
                if t is None:
                    specs[name] = None
                    continue
                pad = -self._file.tell() % _ALIGN
                self._file.write(b"\0" * pad)
                specs[name] = {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                               "offset": self._file.tell()}
                self._file.write(memoryview(t.contiguous().numpy()).cast("B"))
        except OSError as e:
            self.abandon(e)
            return
        self._records.append({"key": key, "buffers": specs})

    def finish(self) -> None:
        """Reading: check every record was used. Writing: the index, then the file in place."""
        if self.reading:
            if self._next != len(self._records):
                raise PackedMismatch("more records than weights")
            return
        if self._file is None:
            return
        try:
            at = self._file.tell()
            self._file.write(json.dumps({"source": source_key(self.path), "kernels": _kernels(),
                                         "records": self._records}).encode())
            self._file.write(struct.pack("<Q", at) + _MAGIC)
            self._file.close()
            self._file = None
            remove_stale(self.path, self.target, ".packed", _recorded_source, same_source_too=True)
            os.replace(self._tmp, self.target)
        except OSError as e:
            self.abandon(e)

    def drop(self, error: Exception) -> None:
        """Reading: the cache turned out not to hold this load's weights; delete it."""
        _drop(self.target, error)

    def abandon(self, error: Exception | None = None) -> None:
        """Writing: drop the partial file (a failed write only costs the next load its repack)."""
        if self.reading or self._file is None:
            return
        if error is not None:
            log.warning("%s: cannot write repacked weights (%s)", self.target, error)
        self._file.close()
        self._file = None
        _remove(self._tmp)


def _index(buf) -> dict:
    """The JSON index at the end of a cache file's bytes (a mapping of it)."""
    size = len(buf)
    if size < 16 or buf[size - 8:] != _MAGIC:
        raise PackedMismatch("no index")
    at = struct.unpack("<Q", buf[size - 16:size - 8])[0]
    return json.loads(bytes(buf[at:size - 16]))


def _recorded_source(cache: str) -> list | None:
    with open(cache, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        return _index(m).get("source")


def _drop(target: str, error: Exception) -> None:
    log.warning("%s: repacked weights unusable (%s); repacking from the file", target, error)
    _remove(target)


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass
