"""tallow serve | generate | chat"""

from __future__ import annotations

import argparse
import logging
import sys
import time

from tallow.config import EngineConfig, ServerConfig
from tallow.output.events import ContentEvent


# Flags of vLLM's and llama-server's command lines that tallow takes as they are (it always does
# what they turn on, or they concern nothing tallow has): accepted, noted in the log.
ACCEPTED_NO_OPS = {
    "--trust-remote-code": "tallow runs no code from model folders",
    "--disable-log-requests": "tallow logs no request bodies",
    "--enable-log-requests": "per-request logs: --trace",
    "--disable-log-stats": "tallow logs no periodic stats",
    "--enable-chunked-prefill": "chunked prefill is always on",
    "--enable-prefix-caching": "prefix caching is on by default (--no-prefix-caching turns it off)",
    "--enable-auto-tool-choice": "tool calls are parsed whenever the chat template has tools (--tool-call-parser)",
    "--jinja": "chat templates are always jinja",
}

# Flags of theirs that would change what runs and that tallow does not have: an error naming what
# to do instead.
FOREIGN_FLAGS = {flag: why for flags, why in [
    (("-ngl", "--n-gpu-layers"), "tallow puts every layer on the GPU with --device cuda (the default where CUDA is "
                                 "present)"),
    (("-t", "--threads"), "tallow's CPU kernels use every core; set OMP_NUM_THREADS to use fewer"),
    (("--tokenizer",), "the tokenizer comes with the model (the GGUF file's metadata or the HF folder)"),
    (("--load-format",), "the format follows --model (a .gguf file or an HF folder with safetensors)"),
    (("--ssl-keyfile", "--ssl-certfile"), "tallow serves plain HTTP; put a TLS proxy in front of it"),
    (("--root-path",), "tallow serves at the root; a reverse proxy can strip a prefix"),
    (("--allowed-origins",), "tallow sends no CORS headers (its chat page is served from the same origin)"),
    (("--generation-config",), "sampling defaults come from the request (and the GGUF's or folder's generation "
                               "config)"),
    (("--download-dir", "--revision"), "tallow downloads nothing: pass a local .gguf file or HF folder as the model"),
    (("--lora-modules", "--enable-lora"), "LoRA adapters are not supported"),
    (("--pipeline-parallel-size", "-pp"), "pipeline parallelism is not supported (--tensor-parallel-size is)"),
] for flag in flags}


def _engine_args(p: argparse.ArgumentParser, positional_model: bool = False) -> None:
    d = EngineConfig()
    if positional_model:  # vLLM's `vllm serve MODEL`
        p.add_argument("model_arg", nargs="?", metavar="MODEL", default=None, help="the model, as --model")
    p.add_argument("-m", "--model", default=d.model,
                   help="default (the embedded SmolLM2-135M-Instruct) | path/to/model.gguf | HF folder (config.json "
                        "and *.safetensors) | dummy:<preset> (random weights); nothing is downloaded")
    p.add_argument("--device", default=d.device, help="auto | cpu | cuda[:N]")
    p.add_argument("--dtype", default=d.dtype, help="auto | float32 | bfloat16 | float16")
    p.add_argument("-q", "--quantization", default=d.quantization, help="CPU weight format: auto (int4) | int4 | int8 (tallow's kernels where they build) | int4-torch | int8-torch | bf16 | none; on CUDA (sm_89+): fp8 (e4m3 weights, per-channel scales); on CUDA a GGUF file keeps its quantized blocks unless none (dequantized to --dtype)")
    p.add_argument("--fp8-large-batch", default=d.fp8_large_batch, choices=("weight_only", "w8a8", "scaled_mm"),
                   help="fp8 weights: batches of 64+ rows keep bf16 activations (weight_only: batch-invariant greedy "
                        "output) or quantize them per token for fp8 tensor cores (w8a8, scaled_mm)")
    p.add_argument("--max-num-seqs", "-np", "--parallel", type=int, default=d.max_num_seqs,
                   help="most sequences decoded together (llama-server's -np)")
    p.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                   help="most tokens one engine step runs (prompt chunks and decode tokens)")
    p.add_argument("--max-model-len", "-c", "--ctx-size", type=int, default=None,
                   help="context length in tokens (default: the model's own, max_position_embeddings; "
                        "llama-server's -c)")
    p.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV-cache block")
    p.add_argument("--kv-cache-dtype", default=d.kv_cache_dtype,
                   help="auto (float16 on the CPU with int4/int8 weights, else the model's dtype) | float16 | float32 | bfloat16 | int8 (alias q8_0; CPU: a scale per 32 values, 0.56x float16's memory) | fp8 (CUDA: e4m3 with per-layer scales)")
    p.add_argument("--kv-cache-scale", default=d.kv_cache_scale,
                   help="an fp8 KV cache's K/V scale: a number (1.0 as vLLM) | calibrate (from the first prefill)")
    p.add_argument("--kv-cache-memory", type=float, default=None,
                   help="KV cache size in GiB (default: sized from the context and --max-num-seqs on the CPU, "
                        "from --gpu-memory-utilization on CUDA; given, it wins on either)")
    p.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization,
                   help="CUDA: the share of the GPU's memory the weights and KV cache may take (ignored on the CPU)")
    p.add_argument("--no-prefix-caching", "--no-enable-prefix-caching", action="store_true",
                   help="do not reuse the KV cache of earlier prompts' common prefixes")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--async-scheduling", choices=("auto", "on", "off"), default="auto",
                   help="schedule and launch step N+1 while step N runs (auto: on CUDA without tensor parallelism)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=d.tensor_parallel_size,
                   help="shard the model over N processes (one per GPU on CUDA, NCCL; gloo on the CPU)")
    p.add_argument("--seed", type=int, default=d.seed, help="the engine's random seed (unseeded requests)")
    p.add_argument("--chat-template", "--chat-template-file", default=None,
                   help="chat template for chat requests instead of the model's own: a jinja file, or its text "
                        "(a base model without one answers chat requests with a 400)")
    for flag, why in ACCEPTED_NO_OPS.items():
        p.add_argument(flag, action="append_const", const=flag, dest="no_ops", help=f"accepted, no effect: {why}")
    p.add_argument("--speculative-method", choices=("ngram", "draft"), default=None,
                   help="speculative decoding in the batch: ngram (prompt lookup) or draft (--speculative-model); "
                        "off by default")
    p.add_argument("--speculative-model", default=None,
                   help="the draft model's source (the model's vocabulary) for --speculative-method draft")
    p.add_argument("--num-speculative-tokens", type=int, default=d.num_speculative_tokens,
                   help="longest draft a speculating step verifies (default: 6 on the CPU, 4 on CUDA)")
    p.add_argument("--ngram-max", type=int, default=d.ngram_max, help="longest suffix the ngram proposer looks up")
    p.add_argument("--ngram-min", type=int, default=d.ngram_min, help="shortest suffix the ngram proposer looks up")
    p.add_argument("--speculative-row-cost", type=float, default=None,
                   help="cost of one more query row relative to a decode step, in [0, 1): a sequence drafts a "
                        "position only while its drafts reach it more often (default 0.7 on the CPU, 0.1 on CUDA)")


def engine_config_from(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model, device=args.device, dtype=args.dtype, quantization=args.quantization,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len, block_size=args.block_size, kv_cache_dtype=args.kv_cache_dtype,
        kv_cache_scale=args.kv_cache_scale, fp8_large_batch=args.fp8_large_batch,
        kv_cache_memory_bytes=int(args.kv_cache_memory * 1024**3) if args.kv_cache_memory else None,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enable_prefix_caching=not args.no_prefix_caching, enforce_eager=args.enforce_eager,
        tensor_parallel_size=args.tensor_parallel_size, seed=args.seed,
        async_scheduling={"on": True, "off": False}.get(args.async_scheduling, "auto"),
        chat_template=args.chat_template, speculative_method=args.speculative_method, num_speculative_tokens=args.num_speculative_tokens,
        speculative_model=args.speculative_model,
        ngram_max=args.ngram_max, ngram_min=args.ngram_min, speculative_row_cost=args.speculative_row_cost,
    )


def cmd_generate(args: argparse.Namespace) -> int:
    from tallow.engine.core import EngineCore

    core = EngineCore(engine_config_from(args))
    try:
        return _generate(core, args)
    finally:
        core.shutdown()


def _generate(core, args: argparse.Namespace) -> int:
    from tallow.engine.sampling import SamplingParams
    from tallow.output.offline import OfflineRun
    from tallow.output.pipeline import make_sink

    tok = core.tokenizer
    if args.chat:
        from tallow.chat_template import ChatTemplate

        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": args.prompt}]
        prompt = ChatTemplate.for_tokenizer(tok, override=core.config.chat_template).render_prompt(
            messages, add_generation_prompt=True)
        ids = tok.encode(prompt.text, literal_spans=prompt.literal_spans)
    else:
        ids = tok.encode(args.prompt)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, stop=args.stop or [])
    seq = core.make_sequences(ids, params)[0]
    run = OfflineRun(core)
    pipeline = run.add(seq, make_sink(tok, params))
    t0 = time.perf_counter()
    t_first = None
    n = 0
    for _, _, events in run.outputs():
        if pipeline.taken:
            n += pipeline.taken
            t_first = t_first or time.perf_counter()
        _write_content(events)
    result, finish_reason = pipeline.finish()
    _write_content(result.events)
    sys.stdout.write("\n")
    t1 = time.perf_counter()
    if args.verbose and t_first:
        rate = (n - 1) / (t1 - t_first) if n > 1 else 0.0
        print(f"[{len(ids)} prompt tokens, {n} generated, first token {1000 * (t_first - t0):.0f} ms, "
              f"{rate:.1f} tok/s decode, finish {finish_reason}]", file=sys.stderr)
    return 0


def _write_content(events) -> None:
    """The content of the events, to stdout at once (a plain-text sink makes only content events)."""
    text = "".join(e.text for e in events if isinstance(e, ContentEvent))
    if text:
        sys.stdout.write(text)
        sys.stdout.flush()


def cmd_chat(args: argparse.Namespace) -> int:
    from tallow.chat_cli import LocalChat, RemoteChat, run_chat

    options = {"max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p,
               "seed": args.chat_seed}
    backend = RemoteChat(args.url, args.api_key) if args.url else LocalChat(engine_config_from(args))
    try:
        return run_chat(backend, options, system=args.system)
    finally:
        backend.close()


def cmd_serve(args: argparse.Namespace) -> int:
    from tallow.serve.app import run_server

    scfg = ServerConfig(host=args.host, port=args.port, served_model_name=args.served_model_name,
                        max_queue=args.max_queue, log_level=args.log_level, trace=args.trace,
                        shutdown_timeout=args.shutdown_timeout, max_body_bytes=args.max_body_bytes,
                        max_prompts=args.max_prompts, http_read_timeout=args.http_read_timeout,
                        keep_alive_timeout=args.keep_alive_timeout, max_connections=args.max_connections,
                        allow_special_tokens_in_content=args.allow_special_tokens_in_content,
                        strict_model_names=args.strict_model_names, strict_tools=args.strict_tools,
                        ui=not args.no_ui)
    # Trace lines are asked for (--trace or x-tallow-trace: 1): shown whatever the log level.
    logging.getLogger("tallow.trace").setLevel(logging.INFO)
    if args.api_key:
        scfg.api_key = args.api_key
    scfg.metrics_key = args.metrics_key
    for name in ("tool_call_parser", "reasoning_parser"):
        if getattr(args, name, None):
            setattr(scfg, name, getattr(args, name))
    return run_server(engine_config_from(args), scfg)  # 1 when the engine failed


class _DefaultsShown(argparse.HelpFormatter):
    """Help that ends an option's text with its default, where it has one worth showing."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default not in (None, False, argparse.SUPPRESS) and action.option_strings and "%(default)" not in text:
            text += " (default: %(default)s)"
        return text


def main(argv: list[str] | None = None) -> int:
    # (no abbreviations: a typo or another server's flag must not land on a flag of ours)
    parser = argparse.ArgumentParser(prog="tallow", description="A local-first LLM inference server",
                                     allow_abbrev=False)
    sub = parser.add_subparsers(dest="cmd", required=True)
    shown = {"allow_abbrev": False, "formatter_class": _DefaultsShown}

    g = sub.add_parser("generate", help="generate text for one prompt, streamed to the terminal", **shown)
    g.add_argument("prompt")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--system", default=None)
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--stop", action="append")
    g.add_argument("-v", "--verbose", action="store_true")
    _engine_args(g)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="chat in the terminal, with the model loaded here or a server (--url)", **shown)
    c.add_argument("--url", default=None, help="a running server (http://host:port); default: load --model here")
    c.add_argument("--api-key", default=None, help="the server's API key (with --url)")
    c.add_argument("--system", default=None, help="system prompt")
    c.add_argument("--max-tokens", type=int, default=1024)
    c.add_argument("--temperature", type=float, default=None, help="default: the model's")
    c.add_argument("--top-p", type=float, default=None, help="default: the model's")
    c.add_argument("--chat-seed", type=int, default=None, help="sampling seed of each reply")
    _engine_args(c)
    c.set_defaults(func=cmd_chat, log_level="warning")

    s = sub.add_parser("serve", help="start the OpenAI/Anthropic-compatible HTTP server", **shown)
    sd = ServerConfig()
    s.add_argument("--host", default=sd.host, help="the address to listen on (0.0.0.0: every interface)")
    s.add_argument("--port", type=int, default=sd.port, help="the port to listen on")
    s.add_argument("--served-model-name", "-a", "--alias", nargs="+", default=None,
                   help="the names the model answers to in /v1/models and replies (the first in replies); "
                        "default: the model's file or folder name")
    s.add_argument("--max-queue", type=int, default=sd.max_queue,
                   help="requests waiting beyond the running ones, past which requests get 429 (Anthropic: 529)")
    s.add_argument("--api-key", default=None,
                   help="every route but /health needs it (Authorization: Bearer or x-api-key): /v1, "
                        "/stats, /metrics, /docs, /openapi.json, /tokenize")
    s.add_argument("--metrics-key", default=None, help="a key /metrics takes besides --api-key (for a scraper)")
    s.add_argument("--log-level", "--uvicorn-log-level", type=str.lower, default=sd.log_level,
                   choices=("critical", "error", "warning", "info", "debug", "trace"), help="the server's log level")
    s.add_argument("--no-ui", action="store_true", help="no chat page at GET /")
    s.add_argument("--trace", action="store_true",
                   help="log one JSON line per request with its phases (or per request: x-tallow-trace: 1)")
    s.add_argument("--shutdown-timeout", type=float, default=sd.shutdown_timeout,
                   help="seconds running requests get to finish after SIGTERM before they are aborted")
    s.add_argument("--max-body-bytes", type=int, default=sd.max_body_bytes,
                   help="larger request bodies are refused with 413 (a /v1 body longer than any request that "
                        "fits the model's context is a 400 before that)")
    s.add_argument("--max-prompts", type=int, default=sd.max_prompts,
                   help="most prompts in one /v1/completions request (more: 400)")
    s.add_argument("--http-read-timeout", type=float, default=sd.http_read_timeout,
                   help="seconds a request's headers and body have to arrive (then 408 and the connection is "
                        "closed); not a limit on the response")
    s.add_argument("--keep-alive-timeout", type=float, default=sd.keep_alive_timeout,
                   help="seconds an idle keep-alive connection stays open")
    s.add_argument("--max-connections", type=int, default=None,
                   help="open connections at once, past which requests get 503 (default: the open-file "
                        "limit less a reserve)")
    s.add_argument("--allow-special-tokens-in-content", action="store_true",
                   help="read special-token strings (<|im_end|>, ...) in chat message content, tool definitions "
                        "and tool-call arguments as control tokens; by default they are plain text, so a client "
                        "cannot forge turns (/v1/completions prompts always read them)")
    s.add_argument("--strict-model-names", action="store_true",
                   help="answer 404 to a model name other than the served one (by default any name is "
                        "served by the one model, as agent CLIs send their own names)")
    s.add_argument("--strict-tools", action="store_true",
                   help="refuse (400) Responses requests with hosted tools this server cannot run (web_search, "
                        "file_search, code_interpreter, ...); by default they are dropped and named in the "
                        "X-Tallow-Dropped-Tools response header")
    from tallow.output.reasoning import REASONING_PARSERS
    from tallow.output.tool_parsers import TOOL_PARSERS

    s.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                   help="tool-call markup to parse (default: the one the chat template implies)")
    s.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                   help="reasoning markup to split out (default: the one the chat template implies)")
    _engine_args(s, positional_model=True)
    s.set_defaults(func=cmd_serve)

    args, unknown = parser.parse_known_args(argv)
    subparser = {"generate": g, "chat": c, "serve": s}[args.cmd]
    if unknown:
        names = [flag.split("=")[0] for flag in unknown]
        hints = [f"{name}: {FOREIGN_FLAGS[name]}" for name in names if name in FOREIGN_FLAGS]
        subparser.error(f"unrecognized arguments: {' '.join(unknown)}" + ("".join(f"\n  {h}" for h in hints)))
    if getattr(args, "model_arg", None) is not None:
        if args.model not in (subparser.get_default("model"), args.model_arg):
            subparser.error(f"the model is given twice: {args.model_arg!r} and --model {args.model!r}")
        args.model = args.model_arg
    logging.basicConfig(level=getattr(logging, str(getattr(args, "log_level", "warning")).upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from tallow.errors import TallowError

    for flag in getattr(args, "no_ops", None) or ():
        logging.getLogger("tallow").info("%s: accepted, no effect (%s)", flag, ACCEPTED_NO_OPS[flag])
    try:
        return args.func(args)
    except TallowError as e:  # a bad model, option or set-up: one line, not a traceback
        print(f"tallow {args.cmd}: error: {e.message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
