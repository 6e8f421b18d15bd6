"""Every default in one place. Nothing else reads the environment."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from tallow.errors import TallowError


def _default_cache_dir() -> str:
    return os.environ.get("TALLOW_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tallow"
    )


def cpu_kernels_variant() -> str | None:
    """$TALLOW_CPU_KERNELS: which build of tallow's CPU kernels to run ("avx512", "avxvnni", "avx2"; "none"
    for torch's kernels), None for the best one the CPU runs (tallow/ops/cpu_native.py)."""
    return os.environ.get("TALLOW_CPU_KERNELS") or None


def cpu_amx_allowed() -> bool:
    """$TALLOW_AMX: "0" keeps the AVX-512 kernels off AMX tiles; unset (or anything else) lets
    them run there where the CPU lists them and a probe in a child process survives a tile
    product (tallow/ops/cpu_native.py). They compute the same floats either way."""
    return os.environ.get("TALLOW_AMX", "").strip() != "0"


def hf_hub_cache_dir() -> str:
    """Where huggingface_hub keeps downloaded repositories (models--ORG--NAME/snapshots/REV), as it
    finds it: $HF_HUB_CACHE (or the older $HUGGINGFACE_HUB_CACHE), else $HF_HOME/hub, else
    $XDG_CACHE_HOME/huggingface/hub or ~/.cache/huggingface/hub. tallow only looks there: it
    downloads nothing."""
    hub = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if hub:
        return os.path.expanduser(hub)
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface")
    return os.path.join(os.path.expanduser(home), "hub")


# The names EngineConfig takes (checked when it is made, before anything loads; the CPU weight
# formats are models/quant.py's). A dtype name -> the torch dtype's name ("float" is float32, as
# vLLM's --dtype float); the KV cache takes those, int8 (llama.cpp's q8_0) and fp8 (e4m3) names.
DTYPE_NAMES = {"float32": "float32", "fp32": "float32", "float": "float32", "bfloat16": "bfloat16",
               "bf16": "bfloat16", "float16": "float16", "fp16": "float16", "half": "float16"}
DTYPES = ("auto", *DTYPE_NAMES)
QUANTIZATIONS = ("auto", "int4", "int8", "int4-torch", "int8-torch", "bf16", "none", "fp8")
INT8_KV_NAMES = ("int8", "q8_0")
FP8_KV_NAMES = ("fp8", "fp8_e4m3", "float8_e4m3fn")
KV_CACHE_DTYPES = (*DTYPES, *INT8_KV_NAMES, *FP8_KV_NAMES)
_DEVICE = re.compile(r"(cpu|cuda)(:\d+)?")


def dtype_error(name: object) -> TallowError:
    return TallowError(f"unknown dtype {name!r}: use auto (float32 on the CPU, bfloat16 on CUDA), float32 "
                       "(aliases fp32, float), bfloat16 (bf16) or float16 (fp16, half)", param="dtype")


def quantization_error(name: object) -> TallowError:
    return TallowError(
        f"unknown quantization {name!r}: use auto (int4 on the CPU), int4, int8, int4-torch, int8-torch, bf16 or "
        "none (CPU weight formats), or fp8 (CUDA sm_89+: float weights quantized to e4m3 at load). AWQ and GPTQ "
        "checkpoints are not supported; a GGUF file keeps its own quantized blocks and an fp8 checkpoint "
        "(compressed-tensors, fbgemm_fp8) its fp8 weights without this option", param="quantization")


def kv_cache_dtype_error(name: object) -> TallowError:
    e5m2 = " (fp8_e5m2 is not supported: tallow's fp8 cache is e4m3)" if "e5m2" in str(name).lower() else ""
    return TallowError(
        f"unknown kv_cache_dtype {name!r}{e5m2}: use auto, the model's dtype (float32, bfloat16, float16), "
        "float16 (CPU), int8 (alias q8_0; CPU) or fp8 (alias fp8_e4m3; CUDA)", param="kv_cache_dtype")


def check_device(name: object) -> None:
    """A TallowError unless `name` is "cpu" or "cuda[:N]" and, for CUDA, torch sees that device
    here ("auto" is resolved by the engine)."""
    if not isinstance(name, str) or not _DEVICE.fullmatch(name):
        raise TallowError(f"unknown device {name!r}: use auto (cuda when available, else cpu), cpu, cuda or "
                          "cuda:N", param="device")
    if name == "cpu" or name.startswith("cpu:"):
        return
    import torch

    if not torch.cuda.is_available():
        why = ("this torch is built without CUDA" if torch.version.cuda is None
               else "no CUDA GPU is visible (torch.cuda.is_available() is False)")
        raise TallowError(f"device {name!r}: {why}; use --device cpu (or auto)", param="device")
    index = int(name.partition(":")[2] or 0)
    if index >= torch.cuda.device_count():
        raise TallowError(f"device {name!r}: only {torch.cuda.device_count()} CUDA device(s) are visible",
                          param="device")


@dataclass
class EngineConfig:
    model: str = "default"
    # "auto": float32 on CPU, bfloat16 on CUDA.
    dtype: str = "auto"
    # "auto": cuda when available, else cpu.
    device: str = "auto"
    # Weight format for Linear layers on the CPU: "auto" is int4 (tallow's Q4 kernels, the LM
    # head Q8; torch's int4/int8 kernels where those cannot build), "int8", "int4-torch",
    # "int8-torch", "bf16"; "none" keeps dense weights. "fp8" (CUDA, sm_89+): float weights
    # quantized per output channel to e4m3 at load (an fp8 checkpoint is fp8 whatever this says).
    # On CUDA a GGUF file's block-quantized weights stay in their blocks (Triton kernels) unless
    # this is "none" (dequantized to dtype).
    quantization: str = "auto"
    # FP8 weights (CUDA): the path of batches of 64 rows or more (prefill, big decode batches):
    # "weight_only" (bf16 activations: greedy output batch invariant), "w8a8" (activations
    # quantized per token, fp8 tensor cores: tallow's kernel) or "scaled_mm" (torch._scaled_mm).
    fp8_large_batch: str = "weight_only"
    seed: int = 0

    # KV cache
    block_size: int = 16
    # "auto": float16 on the CPU where tallow's kernels run the model (int4/int8 weights: attention
    # reads half the bytes), else the model's dtype; "float16" or the model's dtype by name;
    # "int8" / "q8_0" on the CPU (int8 codes with a float32 scale per 32); "fp8" on CUDA.
    kv_cache_dtype: str = "auto"
    # "fp8" caches (float8_e4m3fn, CUDA): each layer's K and V scale, "1.0" as vLLM's default or
    # "calibrate" (amax of the first prefill's K / 200 and V / 100, as vLLM's calculate_kv_scales).
    kv_cache_scale: str = "1.0"
    # Bytes for the KV pool on the CPU (None: a share of free RAM, capped).
    kv_cache_memory_bytes: int | None = None
    cpu_kv_cache_fraction: float = 0.25
    cpu_kv_cache_max_bytes: int = 2 * 1024**3
    gpu_memory_utilization: float = 0.90
    num_kv_blocks: int | None = None  # override for tests
    enable_prefix_caching: bool = True

    # Scheduling
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's context
    # Longest prefill chunk for one sequence in one step (None: the token budget).
    long_prefill_token_threshold: int | None = None

    # CUDA
    enforce_eager: bool = False
    cuda_graph_max_batch: int = 256
    # Asynchronous scheduling: step N+1 is scheduled and launched while step N runs on the
    # device, its decode tokens read from step N's sampled ids on the device. "auto": on CUDA
    # without tensor parallelism (on the CPU the forward is synchronous: nothing to overlap);
    # True forces it (tests run it on the CPU), False turns it off.
    async_scheduling: bool | str = "auto"

    # Structured output: append the tokens a grammar forces without sampling them ("fill").
    grammar_jump_forward: bool = True
    # While more than this many sequences run, forced tokens are computed one per step (a
    # single-token row that does not sample, which a decode CUDA graph replays) instead of as a
    # chunk (which makes the whole step eager). None: no limit (on an H200, stop 30, chunks won
    # at 8 and 32 sequences: 0.14 / 0.17 s against 0.34 / 0.36 s with a limit of 4).
    jump_forward_chunk_max_seqs: int | None = None
    # Speculative decoding inside the continuous batch (tallow/engine/speculative/): None (off)
    # or "ngram" (prompt lookup: the longest recent suffix of ngram_max down to ngram_min tokens
    # found earlier in the prompt or output proposes the tokens that followed it). A speculating
    # sequence verifies up to num_speculative_tokens proposed tokens per step (None: by the
    # device, 6 on the CPU and 4 on CUDA; on a 2-core Xeon with AMX, stop 39, a grounded rewrite
    # at one sequence gained 2.05-2.10x with 6 against 1.94-1.97x with 4, side by side in two
    # sittings; a later run of 6 alone gave 1.88x, its plain side faster).
    speculative_method: str | None = None
    # The chat template for every chat front end instead of the model's own: a jinja file's
    # path, or the template's text (vLLM's --chat-template). A model without one of its own
    # (a base model) answers chat requests with a 400 unless this gives one.
    chat_template: str | None = None
    # "draft": the draft model's source (same vocabulary as the model), loaded as the model is.
    speculative_model: str | None = None
    num_speculative_tokens: int | None = None
    ngram_max: int = 4
    ngram_min: int = 2
    # What one more query row of a step costs, relative to a plain decode step of one sequence:
    # a sequence proposes a draft position only while its recent drafts reached that position
    # more often than this (the adaptive off-switch; engine/speculative/state.py scales it up
    # with the batch for requests whose text cannot depend on it). None: by the kernels in use,
    # measured on the default model: 0.25 for tallow's AVX-512 VNNI build (a 2-core Xeon: 5.0 ms
    # for one row, +1.3 ms a row), 0.4 for the AVX2 one (Zen 3: 5 rows cost 2.2-2.9x one), 0.7
    # for torch's CPU kernels, 0.1 on CUDA; 0.02 where the AVX-512 build runs many rows on AMX
    # tiles (a Xeon with AMX: steps of 8 and 32 rows 19.3 and 35 ms, so a row past 8 costs about
    # 0.27 of a token's share of the step, which the batch pricing gives at 8 sequences from
    # 0.05; 8 sequences' grounded drafts then paid, 1.09-1.13x, and chat 1.13-1.16x, against
    # 1.02-1.05x and 0.97x at 0.25; lower still paid more: grounded at 8 sequences 1.23-1.25x at
    # 0.02 against 1.19-1.24x at 0.05 in stop 38, 1.32x against 1.28x with 6-token drafts in
    # stop 39: steps of many rows cost less a row than the first rows past 8). A constant, not a
    # timing: a seeded request's text must not depend on how fast the machine was.
    speculative_row_cost: float | None = None

    # Where converted weights are cached (GGUF dequantization is slow on first load).
    cache_dir: str = field(default_factory=_default_cache_dir)

    # Tensor parallelism: one process per rank (gloo on the CPU, NCCL on CUDA). The timeout
    # bounds each collective of a step, and how long rank 0 waits for the workers to load.
    tensor_parallel_size: int = 1
    distributed_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        """The names of the load-time choices, checked before anything loads (a TallowError naming
        the accepted values; the CLI prints it as one line), and a CUDA device's presence. Whether
        the rest suits this machine and model (fp8 on this GPU, an int8 KV cache for this model's
        head_dim) is checked at load."""
        if self.dtype not in DTYPES:
            raise dtype_error(self.dtype)
        if self.quantization not in QUANTIZATIONS:
            raise quantization_error(self.quantization)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise kv_cache_dtype_error(self.kv_cache_dtype)
        if self.device != "auto":
            check_device(self.device)

    def speculative_tokens(self, device_type: str) -> int:
        """The longest draft a speculating step verifies: num_speculative_tokens, or where None
        the device's default (6 on the CPU, 4 on CUDA)."""
        if self.num_speculative_tokens is not None:
            return self.num_speculative_tokens
        return 4 if device_type == "cuda" else 6


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    # the names the model answers to (the first in responses); None: the model's own name
    served_model_name: str | list[str] | None = None
    max_queue: int = 256
    api_key: str | None = field(default_factory=lambda: os.environ.get("TALLOW_API_KEY"))
    # A second key that /metrics also takes (a Prometheus scraper need not hold the API key).
    metrics_key: str | None = None
    # The body cap (413). A /v1 route also refuses, with a 400 before parsing, a body longer than any
    # request whose prompt fits the model's context could be (serve/security.py, body_bound).
    max_body_bytes: int = 32 * 1024 * 1024
    # Prompts in one /v1/completions request (each runs n sequences).
    max_prompts: int = 64
    max_messages: int = 4096
    max_stop_strings: int = 16
    max_logit_bias: int = 1024
    max_n: int = 16
    max_top_logprobs: int = 20
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    trace: bool = False
    log_level: str = "info"
    shutdown_timeout: float = 30.0
    responses_ttl_s: float = 3600.0
    responses_max_bytes: int = 64 * 1024 * 1024
    # Slow clients (slowloris): a request's headers and body must arrive within this many seconds
    # of its first byte (of the connection, for the first request); a response may take as long as
    # it takes. Then 408 and the connection is closed (serve/http_protocol.py).
    http_read_timeout: float = 30.0
    # An idle keep-alive connection is closed after this many seconds (uvicorn's timeout_keep_alive).
    keep_alive_timeout: float = 5.0
    # Open connections at once; past it a request is answered 503 (and its connection closed).
    # None: the open-file limit less a reserve (http_protocol.connection_cap).
    max_connections: int | None = None
    # The longest a chat template may take to render one request (then 400).
    template_timeout_s: float = 5.0
    # Special-token strings ("<|im_end|>") in what a chat client sends become control tokens, as
    # before tallow kept them text (a user could then forge turns). /v1/completions always reads them.
    allow_special_tokens_in_content: bool = False
    # Any model name in a request is served by the one model (agent CLIs send their own names);
    # with this, a name other than the served one answers 404 model_not_found.
    strict_model_names: bool = False
    # Responses' hosted tools (web_search, file_search, ...) are dropped from what the model sees,
    # named in the X-Tallow-Dropped-Tools header and the log; with this they are a 400.
    strict_tools: bool = False
    # The chat page at GET / (tallow/serve/ui/); --no-ui turns it off.
    ui: bool = True
    # The key that authenticates (and encrypts) Responses' reasoning.encrypted_content blobs; unset:
    # a random key per server process (blobs from before a restart are then refused).
    reasoning_key: str | None = field(default_factory=lambda: os.environ.get("TALLOW_REASONING_KEY"))
