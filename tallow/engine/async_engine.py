"""AsyncEngine: EngineCore.step() in its own thread, bridged to asyncio; RequestStream: one
sequence's outputs as an async iterator.

Requests reach the engine thread through a command deque (add / abort); each step's outputs
come back with one loop.call_soon_threadsafe, into each request's RequestStream.

Failure: the model run of a step failing ends that step's sequences with finish_reason
"error" (EngineCore). A command that raises fails its own request only. Anything else that
raises in the engine thread (the scheduler, the KV cache, output processing) fails the
engine: every request it holds ends at once with finish_reason "error", the thread stops,
`failed` turns true (the server's /health answers 503 and the server exits: a supervisor
restarts it), and submit() refuses new requests.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import Callable

from tallow.config import EngineConfig
from tallow.engine.core import EngineCore, TokenOutput, final_output
from tallow.engine.request import Sequence
from tallow.engine.sampling import SamplingParams
from tallow.errors import TallowError

log = logging.getLogger(__name__)


def merge_outputs(first: TokenOutput, then: TokenOutput) -> TokenOutput:
    """One output for two consecutive ones of a sequence."""
    def joined(a: list | None, b: list | None) -> list | None:
        return None if a is None and b is None else (a or []) + (b or [])

    spec = first.speculation if then.speculation is None else then.speculation if first.speculation is None else (
        first.speculation[0] + then.speculation[0], first.speculation[1] + then.speculation[1])
    return TokenOutput(first.token_ids + then.token_ids, joined(first.logprobs, then.logprobs),
                       joined(first.top_logprobs, then.top_logprobs), then.finish_reason, then.num_prompt_tokens,
                       first.num_cached_tokens, then.stop_token_id, then.fill,
                       first.prompt_logprobs if first.prompt_logprobs is not None else then.prompt_logprobs, spec,
                       then.error)


class RequestStream:
    """Async iterator of one sequence's TokenOutputs. abort() (idempotent) frees it at once.

    Outputs that arrive while the consumer is busy are merged into one (their tokens, logprobs
    and the last one's finish_reason), as vLLM's output collector does: a consumer that falls
    behind catches up in one step instead of one wake-up per token."""

    def __init__(self, engine: "AsyncEngine", seq: Sequence):
        self._engine = engine
        self.seq = seq
        self.request_id = seq.request_id
        self._pending: TokenOutput | None = None  # what arrived and was not taken yet, merged
        self._waiter: asyncio.Future | None = None
        self._done = False
        # Prefill chunks (time, first position, tokens) when submitted with trace_prefill.
        self.prefill_chunks: list[tuple[float, int, int]] | None = None

    def _put(self, out: TokenOutput) -> None:
        """Runs on the event loop."""
        pending = self._pending
        self._pending = out if pending is None else merge_outputs(pending, out)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def __aiter__(self):
        return self

    async def __anext__(self) -> TokenOutput:
        if self._done:
            raise StopAsyncIteration
        while self._pending is None:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        out, self._pending = self._pending, None
        if out.finish_reason is not None:
            self._done = True
        return out

    def abort(self) -> None:
        """Free the sequence (the engine thread does it before its next step) and end this
        iteration at once with an "abort" output, not waiting for that step."""
        if not self._done:
            self._engine._abort(self)

    async def aclose(self) -> None:
        self.abort()

    @property
    def finished(self) -> bool:
        return self._done


class AsyncEngine:
    """Runs EngineCore.step() in its own thread; requests talk to it through queues."""

    def __init__(self, core: EngineCore | Callable[[], EngineCore]):
        """core: an EngineCore, or a function that builds one. A function runs in the engine
        thread itself, so the model is loaded (and its first torch ops run) in the thread that
        steps it: torch's OpenMP intra-op pool belongs to the thread that first uses it, and a
        CPU engine stepped from another thread than the one that built it ran ~2x slower
        (benchmarks/server_tax.py). Returns once the core is built; its error is raised here."""
        self._chat_template = None
        self._streams: dict[int, RequestStream] = {}
        self._commands: deque = deque()
        self._wake = threading.Event()
        self._stop = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._failure: str | None = None  # what failed the engine thread, once it has
        self._failure_waiters: list[asyncio.Future] = []
        built = threading.Event()
        failure: list[BaseException] = []
        build = core if callable(core) else (lambda: core)

        def run() -> None:
            try:
                self.core = build()
            except BaseException as e:  # handed to the constructor's caller
                failure.append(e)
                return
            finally:
                built.set()
            self._run()

        self._thread = threading.Thread(target=run, name="tallow-engine", daemon=True)
        self._thread.start()
        built.wait()
        if failure:
            self._thread.join()
            raise failure[0]
        core = self.core
        self.tokenizer = core.tokenizer
        self.model_config = core.model_config
        self.max_model_len = core.max_model_len
        self.model_name = core.model_name
        self.max_num_seqs = core.config.max_num_seqs
        self.ready = True

    @classmethod
    def from_config(cls, config: EngineConfig) -> "AsyncEngine":
        """Build the EngineCore in the engine thread (see __init__)."""
        return cls(lambda: EngineCore(config))

    @property
    def chat_template(self):
        if self._chat_template is None:
            from tallow.chat_template import ChatTemplate

            tok = self.tokenizer
            self._chat_template = ChatTemplate.for_tokenizer(tok, override=self.core.config.chat_template)
        return self._chat_template

    @property
    def failed(self) -> bool:
        """The engine thread has failed (see the module docstring): it serves nothing more."""
        return self._failure is not None

    @property
    def failure(self) -> str | None:
        """What failed the engine thread (the exception, in one line), or None."""
        return self._failure

    async def wait_failed(self) -> str:
        """Wait until the engine thread fails (forever while it works); what failed it."""
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
        waiter = loop.create_future()
        self._failure_waiters.append(waiter)
        try:
            if self._failure is not None:  # failed before the waiter was seen
                return self._failure
            return await waiter
        finally:
            self._failure_waiters.remove(waiter)

    # ---- the asyncio side -------------------------------------------------------------
    def submit(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
               trace_prefill: bool = False) -> list[RequestStream]:
        """Queue a request: one stream per sample (params.n); siblings share the prompt's blocks.
        With trace_prefill, each stream's prefill_chunks lists its prefill steps."""
        if self._failure is not None:
            raise TallowError(f"the engine has failed ({self._failure}) and takes no more requests", status=503,
                              type="service_unavailable")
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        seqs = self.core.make_sequences(prompt_ids, params, request_id)
        streams = [RequestStream(self, s) for s in seqs]
        for st in streams:
            self._streams[st.seq.seq_id] = st
            if trace_prefill:  # registered before the engine thread can see the sequence
                st.prefill_chunks = self.core.trace_prefill(st.seq)
        self._commands.append(("add", seqs))
        self._wake.set()
        return streams

    def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None) -> RequestStream:
        if params.n != 1:
            raise TallowError("generate() takes n == 1; use submit() for several samples", param="n")
        return self.submit(prompt_ids, params, request_id)[0]

    def _abort(self, stream: RequestStream) -> None:
        """Runs on the event loop: the stream gets its final output now; whatever the engine
        thread still posts for it is dropped. A stream no longer registered (aborted already, or
        its final output delivered) needs nothing."""
        seq = stream.seq
        if self._streams.pop(seq.seq_id, None) is None:
            return
        self._commands.append(("abort", seq))
        self._wake.set()
        stream._put(TokenOutput([], None, None, "abort", seq.num_prompt_tokens, seq.num_cached_tokens,
                                fill=0 if seq.grammar is None else seq.grammar.fill))

    def stats(self) -> dict:
        return self.core.stats()

    async def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        await asyncio.to_thread(self._thread.join, 10)
        await asyncio.to_thread(self.core.shutdown, not self._thread.is_alive())

    def _deliver(self, batch: list[tuple[Sequence, TokenOutput]]) -> None:
        """Runs on the event loop: hand each output to its stream."""
        for seq, out in batch:
            if out.finish_reason is None:
                st = self._streams.get(seq.seq_id)
            else:
                st = self._streams.pop(seq.seq_id, None)
            if st is not None:
                st._put(out)

    def _fail_streams(self) -> None:
        """Runs on the event loop once the engine thread has failed: every stream still open
        ends with finish_reason "error" (submit() refuses new ones from now on)."""
        streams, self._streams = self._streams, {}
        for st in streams.values():
            seq = st.seq
            st._put(TokenOutput([], None, None, "error", seq.num_prompt_tokens, seq.num_cached_tokens,
                                fill=0 if seq.grammar is None else seq.grammar.fill))
        for waiter in self._failure_waiters:
            if not waiter.done():
                waiter.set_result(self._failure)

    # ---- the engine thread ------------------------------------------------------------
    def _post(self, batch: list[tuple[Sequence, TokenOutput]]) -> None:
        if batch and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._deliver, batch)

    def _drain_commands(self) -> list[tuple[Sequence, TokenOutput]]:
        """Apply the queued adds and aborts. One that raises fails its own request only."""
        finals = []
        while self._commands:
            kind, arg = self._commands.popleft()
            if kind == "add":
                for seq in arg:
                    try:
                        self.core.add(seq)
                    except Exception as e:
                        if isinstance(e, TallowError):
                            log.warning("request %s rejected by the scheduler: %s", seq.request_id, e.message)
                        else:
                            log.exception("adding request %s failed; failing that request", seq.request_id)
                        finals.append((seq, self.core.reject(seq)))
            else:
                seq = arg
                try:
                    final = self.core.abort(seq)
                except Exception:  # the stream has its final output already
                    log.exception("aborting request %s failed", seq.request_id)
                    continue
                if final is not None:
                    finals.append((seq, final))
        return finals

    def _run(self) -> None:
        core = self.core
        try:
            while not self._stop:
                finals = self._drain_commands()
                if finals:
                    self._post(finals)
                if not core.has_work():
                    self._wake.wait(0.1)
                    self._wake.clear()
                    continue
                outputs = core.step()
                if outputs:
                    self._post(outputs)
        except Exception as e:  # outside a step's model run (EngineCore fails those steps itself)
            self._fail(e)
            return
        # Shutting down: abort everything left.
        for st in list(self._streams.values()):
            self._post([(st.seq, core.abort(st.seq) or final_output(st.seq))])

    def _fail(self, error: Exception) -> None:
        """The engine thread raised outside the model run: its state is not to be trusted, so it
        stops here, and every request ends with an error (on the event loop)."""
        log.critical("the engine failed outside a step's model run; failing all %d requests and stopping",
                     len(self._streams), exc_info=error)
        self._failure = f"{type(error).__name__}: {error}"
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._fail_streams)
