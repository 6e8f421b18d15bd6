"""FastAPI routes: OpenAI Chat Completions, Completions and Responses, Anthropic Messages, health,
models, stats."""

from __future__ import annotations

import asyncio
import logging
import sys
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing, asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tallow.config import EngineConfig, ServerConfig
from tallow.errors import TallowError
from tallow.serve.admission import RETRY_AFTER_S, AdmissionQueue
from tallow.serve.access_log import current_request, mark_phase
from tallow.serve.errors import ANTHROPIC, OPENAI, error_response, protocol_for_path
from tallow.serve.executor import CompletionAborted, CompletionExecutor, CompletionRun
from tallow.serve.gate import GateState, RequestGate, body_limit
from tallow.serve.http_protocol import connection_cap, timed_protocol
from tallow.serve.instrument import RequestStats
from tallow.serve.metrics import ServerMetrics
from tallow.serve.security import ContextBound, exposure_warning
from tallow.serve.shutdown import ABORT_GRACE_S, DrainingServer
from tallow.serve.openapi import declare_request_bodies
from tallow.serve.plan import Rejection
from tallow.serve.protocols.anthropic import AnthropicMessages, with_idle_pings
from tallow.serve.protocols.anthropic_schemas import MessagesInput, MessagesRequest
from tallow.serve.protocols.base import StreamProtocol
from tallow.serve.protocols.openai_schemas import ChatCompletionRequest, CompletionRequest
from tallow.serve.protocols.responses_schemas import ResponsesRequest
from tallow.serve.protocols.openai_chat import OpenAIChat
from tallow.serve.protocols.openai_completions import OpenAICompletions
from tallow.serve.protocols.responses import OpenAIResponses
from tallow.serve.reasoning_blob import ReasoningSealer
from tallow.serve.responses_store import ResponsesStore
from tallow.serve.tokenize import (DetokenizeRequest, TokenizeRequest, detokenize_request, tokenize_request,
                                   tokenizer_info)

log = logging.getLogger(__name__)

class ReleasingStream(StreamingResponse):
    """An SSE response that calls `release` once it is over, however it ends (even when the
    client left before the body started, so the generator never ran).

    Its frames are sent straight from the route's task: no task group listening for the
    disconnect beside them (Starlette's way), since the route's own watcher (abort_on_disconnect)
    aborts the run when the client goes away, and that ends the frames. A string of several
    frames goes out in one write."""

    def __init__(self, frames: AsyncIterator[str], release: Callable[[], None], headers: dict | None = None,
                 protocol=None):
        super().__init__(frames, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})})
        self.release = release
        self.protocol = protocol  # the StreamProtocol writing the frames

    async def __call__(self, scope, receive, send) -> None:
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async with aclosing(self.body_iterator) as frames:
                async for frame in frames:
                    if frame:
                        await send({"type": "http.response.body", "body": frame.encode(), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:  # the client went away (a server that raises on writes to a closed socket)
            pass
        finally:
            self.release()


def internal_error_response(path: str, error: Exception) -> JSONResponse:
    """The 500 of an unexpected exception, in the protocol's shape of `path`."""
    return error_response(protocol_for_path(path), 500, f"internal server error: {type(error).__name__}",
                          "server_error")


class CatchUnhandled:
    """An exception no handler took becomes its protocol's 500 here, logged once with its
    traceback, and is not raised on to the server: Starlette's ServerErrorMiddleware would
    answer too, but then re-raise, and uvicorn would log it again and close the keep-alive
    connection (a pooled client's next request on it would meet a reset). An exception after
    the response has started cannot be answered: it goes on up (the connection must close)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_tracked(message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, send_tracked)
        except Exception as e:
            if started:
                raise
            log.exception("unhandled error on %s", scope["path"])
            await internal_error_response(scope["path"], e)(scope, receive, send)


def not_found_or_not_allowed(request: Request, e: StarletteHTTPException) -> JSONResponse:
    """An HTTP error the router raises (an unknown route: 404; a wrong method: 405, with its
    Allow header) in the protocol's error shape, as OpenAI words it: "Invalid URL (POST /v1/x)"."""
    method, path = request.method, request.url.path
    headers = getattr(e, "headers", None)
    if e.status_code == 404:
        message = f"Invalid URL ({method} {path})"
        kind = "invalid_request_error"
    elif e.status_code == 405:
        allowed = (headers or {}).get("Allow") or (headers or {}).get("allow")
        message = f"Method Not Allowed ({method} {path})" + (f": this route takes {allowed}" if allowed else "")
        kind = "invalid_request_error"
    else:
        message, kind = str(e.detail), None
    return error_response(protocol_for_path(path), e.status_code, message, kind, headers=headers)


def engine_slots(engine) -> int:
    """How many sequences the engine runs at once. AsyncEngine keeps it in its core's config
    until it exposes max_num_seqs itself."""
    if hasattr(engine, "max_num_seqs"):
        return engine.max_num_seqs
    return engine.core.config.max_num_seqs


def attach_engine(app: FastAPI, engine) -> None:
    """Serve `engine` from now on (run_server calls this once the model has loaded)."""
    state = app.state
    state.engine = engine
    state.executor = CompletionExecutor(engine)
    state.admission = AdmissionQueue(engine_slots(engine), state.config.max_queue)
    # The body bound the model's context implies (the gate refuses longer bodies before parsing).
    state.gate.context_bound = ContextBound.for_model(engine.tokenizer, engine.max_model_len)
    served = state.config.served_model_name
    # every name the server answers to (vLLM's --served-model-name a b): the first in responses
    state.model_names = ([served] if isinstance(served, str) else list(served or ())) or [engine.model_name]
    state.model_name = state.model_names[0]
    state.metrics.bind(engine, state.model_name)


def build_app(engine, server_config: ServerConfig) -> FastAPI:
    """The HTTP app over `engine`; pass None while the model loads (every route answers 503)."""
    app = FastAPI(title="tallow")
    app.state.config = server_config
    app.state.engine = None
    app.state.counters = Counter()
    app.state.metrics = ServerMetrics()
    app.state.gate = GateState()
    app.add_middleware(CatchUnhandled)  # inside RequestGate, which logs the 500 it sends
    app.add_middleware(RequestGate, config=server_config, metrics=app.state.metrics, state=app.state.gate)
    if engine is not None:
        attach_engine(app, engine)
    if server_config.ui:
        from tallow.serve.ui import add_ui_routes

        add_ui_routes(app)  # GET / and /ui/*: the chat page (static; not on the API's path)

    def serving_engine():
        engine = app.state.engine
        if engine is None or not engine.ready:
            raise TallowError("the model is still loading", status=503, type="service_unavailable")
        return engine

    @app.exception_handler(TallowError)
    async def tallow_error(request: Request, e: TallowError) -> JSONResponse:
        return Rejection.from_error(e).response(protocol_for_path(request.url.path))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        return not_found_or_not_allowed(request, e)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception) -> JSONResponse:
        # What CatchUnhandled did not see (an error in RequestGate itself): answered here, though
        # Starlette's ServerErrorMiddleware re-raises it to the server then.
        log.exception("unhandled error on %s", request.url.path)
        return internal_error_response(request.url.path, e)

    @app.get("/health")
    async def health() -> JSONResponse:
        engine = app.state.engine
        if engine is not None and getattr(engine, "failed", False):
            return JSONResponse({"status": "failed", "error": f"the engine failed: {engine.failure}"}, 503)
        ready = engine is not None and engine.ready
        return JSONResponse({"status": "ok" if ready else "loading"}, 200 if ready else 503)

    @app.get("/v1/models")
    async def models() -> dict:
        engine = serving_engine()
        return {"object": "list", "data": [model_card(engine, name) for name in app.state.model_names]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        engine = serving_engine()
        if model_id not in app.state.model_names:
            raise TallowError(f"the model {model_id!r} does not exist", status=404, param="model",
                              code="model_not_found")
        return model_card(engine, model_id)

    @app.get("/metrics")
    async def metrics() -> Response:
        text, content_type = await asyncio.to_thread(app.state.metrics.render)
        return Response(text, media_type=content_type)

    @app.get("/stats")
    async def stats() -> dict:
        engine = serving_engine()
        counters = dict(app.state.counters)
        counters["in_flight"] = app.state.admission.in_flight
        bound = app.state.gate.context_bound
        limits = {"admission_capacity": app.state.admission.capacity, "max_prompts": server_config.max_prompts,
                  "body_bytes": {path: body_limit(server_config, bound, path)[0]
                                 for path in ("/v1/chat/completions", "/v1/completions")}}
        return {"engine": await asyncio.to_thread(engine.stats), "requests": counters, "limits": limits}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await complete(request, OpenAIChat)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await complete(request, OpenAICompletions)

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        return with_idle_pings(await complete(request, AnthropicMessages))

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> Response:
        engine, raw = serving_engine(), await request.body()
        counted = await asyncio.to_thread(AnthropicMessages.count_tokens, raw, engine, server_config)
        if isinstance(counted, Rejection):
            return counted.response(ANTHROPIC)
        return JSONResponse(counted)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        engine, raw = serving_engine(), await request.body()
        result = await asyncio.to_thread(tokenize_request, raw, engine, server_config)
        return result.response(OPENAI) if isinstance(result, Rejection) else JSONResponse(result)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        engine, raw = serving_engine(), await request.body()
        result = await asyncio.to_thread(detokenize_request, raw, engine)
        return result.response(OPENAI) if isinstance(result, Rejection) else JSONResponse(result)

    @app.get("/tokenizer_info")
    async def get_tokenizer_info() -> dict:
        return tokenizer_info(serving_engine())

    responses_store = ResponsesStore(server_config.responses_ttl_s, server_config.responses_max_bytes)
    app.state.reasoning_sealer = ReasoningSealer(server_config.reasoning_key)
    responses_protocol = OpenAIResponses.with_store(responses_store, app.state.reasoning_sealer)

    @app.post("/v1/responses")
    async def create_response(request: Request) -> Response:
        return await complete(request, responses_protocol)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> dict:
        stored = responses_store.get(response_id)
        if stored is None:
            raise TallowError(f"Response with id '{response_id}' not found.", status=404, param="response_id")
        return stored.response

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> dict:
        if not responses_store.delete(response_id):
            raise TallowError(f"Response with id '{response_id}' not found.", status=404, param="response_id")
        return {"id": response_id, "object": "response", "deleted": True}

    def model_card(engine, name: str) -> dict:
        return {"id": name, "object": "model", "created": 0, "owned_by": "tallow",
                "max_model_len": engine.max_model_len}

    async def complete(request: Request, protocol_cls: type[StreamProtocol]) -> Response:
        engine = serving_engine()
        state, counters = app.state, app.state.counters
        counters["total"] += 1
        raw = await request.body()  # under the body cap: the RequestGate enforced it
        plan = await asyncio.to_thread(protocol_cls.plan_request, raw, engine, server_config)
        mark_phase("plan")
        if isinstance(plan, Rejection):
            counters["rejected"] += 1
            return plan.response(protocol_cls.error_protocol)
        if server_config.strict_model_names and plan.model is not None and plan.model not in state.model_names:
            counters["rejected"] += 1
            served = "', '".join(state.model_names)
            return error_response(protocol_cls.error_protocol, 404,
                                  f"The model '{plan.model}' does not exist; this server serves '{served}'",
                                  "invalid_request_error", "model", "model_not_found")
        weight = len(plan.prompts) * plan.params.n
        if weight > state.admission.capacity:  # would never be admitted, even on an idle server
            counters["rejected"] += 1
            return state.admission.too_heavy(weight, plan.params.n).response(protocol_cls.error_protocol)
        admission = state.admission.try_admit(weight)
        if admission is None:
            counters["queue_full"] += 1
            return error_response(protocol_cls.error_protocol, protocol_cls.queue_full_status,
                                  "the server is at capacity; retry shortly", "rate_limit_error",
                                  headers={"Retry-After": str(RETRY_AFTER_S)})
        request_id = protocol_cls.id_prefix + uuid.uuid4().hex
        protocol = protocol_cls(plan, state.model_name, engine.tokenizer, request_id)
        run = state.executor.start(plan, request_id, RequestStats(state.metrics, current_request.get()))

        if plan.stream:
            async def frames() -> AsyncIterator[str]:
                try:
                    async with abort_on_disconnect(request, run):
                        yield "".join(protocol.start())
                        async for update in run.updates():
                            yield "".join(protocol.add_events(update, run.usage))
                    yield "".join(protocol.finish(run.usage))
                    counters["completed"] += 1
                except CompletionAborted:
                    counters["disconnected"] += 1
                except asyncio.CancelledError:  # Starlette saw the disconnect first
                    counters["disconnected"] += 1
                    raise
                except TallowError as e:
                    if e.status < 500:  # the request's own doing (its grammar): its 4xx, in the stream
                        counters["rejected"] += 1
                        log.warning("request %s ended while streaming: %s", request_id, e.message)
                    else:
                        counters["failed"] += 1
                        log.exception("request %s failed while streaming", request_id)
                    yield "".join(protocol.error(e.message, e.status))
                except Exception as e:
                    counters["failed"] += 1
                    log.exception("request %s failed while streaming", request_id)
                    yield "".join(protocol.error(f"internal error: {type(e).__name__}"))

            return ReleasingStream(frames(), admission.release, plan.response_headers, protocol)
        try:
            async with abort_on_disconnect(request, run):
                async for _ in run.updates():
                    pass
        except CompletionAborted:
            counters["disconnected"] += 1
            return Response(status_code=499)
        except TallowError as e:
            counters["rejected" if e.status < 500 else "failed"] += 1
            raise
        except Exception:
            counters["failed"] += 1
            raise
        finally:
            admission.release()
        counters["completed"] += 1
        return JSONResponse(protocol.response(run.summary()), headers=plan.response_headers or None)

    declare_request_bodies(app, {
        "/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest,
        "/v1/messages": MessagesRequest, "/v1/messages/count_tokens": MessagesInput,
        "/v1/responses": ResponsesRequest, "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest})
    return app


@asynccontextmanager
async def abort_on_disconnect(request: Request, run: CompletionRun) -> AsyncIterator[None]:
    """While inside, a client that goes away aborts `run` (whose updates() then raise
    CompletionAborted). Leaving, by any path, aborts whatever is left of the run without an
    await, so it holds under cancellation too."""
    async def watch() -> None:
        # The body has been read, so the server's receive() now waits for the disconnect.
        while (await request.receive())["type"] != "http.disconnect":
            pass
        run.abort()

    watcher = asyncio.create_task(watch())
    try:
        yield
    finally:
        watcher.cancel()
        run.abort()


def run_server(engine_config: EngineConfig, server_config: ServerConfig) -> int:
    """Serve over HTTP (uvicorn) at once; /health answers 503 until the model has loaded. The
    exit status: 0 after a shutdown, 1 when the engine failed (see _exit_on_engine_failure)."""
    import uvicorn

    app = build_app(None, server_config)
    warning = exposure_warning(server_config.host, server_config.api_key)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    # No uvicorn access log: RequestGate writes one line per request, with tokens and timings.
    # The protocol: httptools' with read timeouts and a connection cap (http_protocol.py).
    protocol = timed_protocol(server_config.http_read_timeout, connection_cap(server_config.max_connections))
    config = uvicorn.Config(app, host=server_config.host, port=server_config.port,
                            log_level=server_config.log_level, access_log=False,
                            timeout_graceful_shutdown=ABORT_GRACE_S, http=protocol,
                            timeout_keep_alive=server_config.keep_alive_timeout)
    server = DrainingServer(config, app.state.gate, server_config.shutdown_timeout,
                            abort_all=lambda: _abort_all(app))
    return _run_event_loop(_serve(server, app, engine_config))


def _run_event_loop(main: Awaitable[int]) -> int:
    """Run the server's event loop: uvloop where it is installed (with uvicorn's httptools
    parser, a streamed token costs the event loop about half the CPU of asyncio's own loop
    and h11: on a 2-core machine that CPU comes out of the engine's threads), else asyncio."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


async def _abort_all(app: FastAPI) -> None:
    """Stop the engine: every request still running ends with finish_reason "abort"."""
    if app.state.engine is not None:
        await app.state.engine.shutdown()


def _load_engine(engine_config: EngineConfig):
    from tallow.engine.async_engine import AsyncEngine  # torch and the model load off the event loop

    engine = AsyncEngine.from_config(engine_config)
    # Every token's bytes, computed now rather than inside the first request (0.3 s for a
    # 49k-token vocabulary, more for larger ones).
    engine.tokenizer.token_bytes_table()
    return engine


async def _exit_on_engine_failure(server, engine) -> None:
    """The engine thread failed (its requests have ended with an error): /health answers 503
    through the shutdown timeout, the grace period in which clients and a load balancer see
    it, then the server stops and exits with status 1 (a supervisor restarts it)."""
    failure = await engine.wait_failed()
    log.critical("the engine failed (%s): exiting in %.0f s", failure, server.shutdown_timeout)
    await asyncio.sleep(server.shutdown_timeout)
    server.should_exit = True


async def _serve(server, app: FastAPI, engine_config: EngineConfig) -> int:
    serving = asyncio.create_task(server.serve())
    t0 = time.monotonic()
    try:
        engine = await asyncio.to_thread(_load_engine, engine_config)
    except BaseException:
        server.should_exit = True
        await serving
        raise
    attach_engine(app, engine)
    config = app.state.config
    print(f"tallow: serving {app.state.model_name} at http://{config.host}:{config.port}/v1 "
          f"(ready in {time.monotonic() - t0:.1f} s)", flush=True)
    watch = asyncio.create_task(_exit_on_engine_failure(server, engine))
    try:
        await serving
    finally:
        watch.cancel()
        await engine.shutdown()
    return 1 if engine.failed else 0
