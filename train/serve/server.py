"""An OpenAI-compatible HTTP server over the serving engine (FastAPI): /v1/completions and /v1/chat/completions,
streamed as server-sent events or not, /v1/models, /health and Prometheus /metrics. One background thread runs
the engine (train/serve/loop.py); handlers await their tokens on asyncio queues."""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import threading
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from train.data import chat as chat_lib
from train.placed import Placed
from train.serve import fields
from train.serve import protocol as proto
from train.serve.engine import Output, ServingEngine
from train.serve.loop import EngineLoop, QueueFull
from train.serve.requests import RequestError, check_length
from train.serve.responses import Chat, Completion

RETRY_AFTER_S = 1
DEFAULT_STOP = "<|im_end|>"  # the end of a turn of train/data/chat.py's DEFAULT_TEMPLATE, plain text


@dataclasses.dataclass
class Served:
    """What one server serves: the placed model (with its tokenizer; its params may be gone, the engine holds its
    own), its engine, the name clients ask for and the chat renderer `train.prepare --format=chat` uses for the
    model's tokenizer."""
    placed: Placed
    engine: ServingEngine
    name: str
    renderer: chat_lib.Renderer | None = None


class Metrics:
    """The server's Prometheus metrics in a registry of its own (several apps can live in one process)."""

    def __init__(self, served: Served):
        import prometheus_client as prom
        self.prom, self.registry, self.served = prom, prom.CollectorRegistry(), served
        gauge = functools.partial(prom.Gauge, registry=self.registry)
        self.running = gauge("serve_running_requests", "Requests being decoded.")
        self.waiting = gauge("serve_waiting_requests", "Requests queued for a slot.")
        self.pages_used = gauge("serve_kv_pages_used", "KV-cache pages held by sequences.")
        self.pages_free = gauge("serve_kv_pages_free", "KV-cache pages free or holding an idle cached prefix.")
        self.kind_used = gauge("serve_kv_pages_used_by_kind", "KV-cache pages held by sequences, by cache kind "
                               "(causal, or sliding_<window>).", ("kind",))
        self.kind_free = gauge("serve_kv_pages_free_by_kind", "KV-cache pages free or idle, by cache kind.", ("kind",))
        self.hit_rate = gauge("serve_prefix_cache_hit_rate", "Prefix-cache hits per full prompt page looked up.")
        counter = functools.partial(prom.Counter, registry=self.registry)
        self.tokens = counter("serve_generation_tokens", "Tokens generated.")  # exposed as ..._total
        self.prompt_tokens = counter("serve_prompt_tokens", "Prompt tokens prefilled.")
        self.spec_proposed = counter("serve_spec_decode_draft_tokens", "Speculative tokens proposed and verified.")
        self.spec_accepted = counter("serve_spec_decode_accepted_tokens", "Speculative tokens accepted.")
        self.spec_steps = counter("serve_spec_decode_verify_steps", "Sequence-steps that verified proposals.")
        self.spec_length = gauge("serve_spec_decode_mean_accepted_length", "Tokens a sequence gains per step that "
                                 "verifies proposals: the accepted ones and the model's own (0: none verified).")
        self._counted = dict.fromkeys(("tokens_generated", "prefill_tokens", "spec_proposed_tokens",
                                       "spec_accepted_tokens", "spec_verify_steps"), 0)
        buckets = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
        self.ttft = prom.Histogram("serve_time_to_first_token_seconds", "From a request's arrival to its first "
                                   "token.", buckets=buckets, registry=self.registry)
        self.itl = prom.Histogram("serve_inter_token_latency_seconds", "Between a request's successive tokens.",
                                  buckets=buckets, registry=self.registry)
        self.requests = counter("serve_requests", "Requests answered, by endpoint and status.",
                                ("endpoint", "status"))

    def render(self) -> bytes:
        s = self.served.engine.stats()
        self.running.set(s["running"])
        self.waiting.set(s["waiting"])
        self.pages_used.set(s["pages_used"])
        self.pages_free.set(s["pages_free"])
        for key, value in s.items():
            if key.startswith(("pages_used.", "pages_free.")):
                gauge = self.kind_used if key.startswith("pages_used.") else self.kind_free
                gauge.labels(kind=key.split(".", 1)[1]).set(value)
        self.hit_rate.set(s["prefix_hits"] / s["prefix_queries"] if s["prefix_queries"] else 0.0)
        self.spec_length.set(s["spec_mean_accepted_length"])
        for key, counter in (("tokens_generated", self.tokens), ("prefill_tokens", self.prompt_tokens),
                             ("spec_proposed_tokens", self.spec_proposed),
                             ("spec_accepted_tokens", self.spec_accepted), ("spec_verify_steps", self.spec_steps)):
            counter.inc(max(0, s[key] - self._counted[key]))  # the engine counts; the counter follows it
            self._counted[key] = s[key]
        return self.prom.generate_latest(self.registry)


class Service:
    """The app's state: the engine's thread, the metrics, and draining (new requests refused with 503)."""

    def __init__(self, served: Served, api_key: str = ""):
        self.served, self.api_key = served, api_key
        self.metrics = Metrics(served)
        self.loop = EngineLoop(served.engine, self.metrics.ttft.observe, self.metrics.itl.observe)
        self.draining, self.aborted = False, 0  # aborted: what the last drain cut at its deadline

    def drain(self, seconds: float) -> bool:
        """Refuse new requests, let the running ones finish for at most `seconds`, then abort what is left;
        True when everything finished in time."""
        self.draining = True
        deadline = time.monotonic() + seconds
        while self.loop.busy() and time.monotonic() < deadline:
            time.sleep(0.05)
        left = self.loop.request_ids()
        self.aborted = len(left)
        for request_id in left:
            self.loop.abort(request_id, notify=True)  # their clients get finish_reason "abort"
        while self.loop.busy() and time.monotonic() < deadline + 5:
            time.sleep(0.05)
        return not left

    def close(self) -> None:
        self.loop.close()


def _json_error(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                code: str | None = None, headers: dict | None = None):
    return JSONResponse(proto.error_body(message, param, kind, code), status_code=status, headers=headers)


def create_app(served: Served, api_key: str = "") -> FastAPI:
    """The FastAPI app over `served`; `app.state.service` is its Service (close it when done)."""
    service = Service(served, api_key)
    api = Api(service)
    app = FastAPI(title="train.serve", docs_url=None, redoc_url=None)
    app.state.service = service
    app.add_middleware(Gate, service=service)
    app.get("/health")(api.health)
    app.get("/metrics")(api.metrics)
    app.get("/v1/models")(api.models)
    app.post("/v1/completions")(api.completions)
    app.post("/v1/chat/completions")(api.chat_completions)
    app.add_exception_handler(HTTPException, _route_error)
    return app


ROUTES = "POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health, GET /metrics"


async def _route_error(request: Request, exc: HTTPException):
    """404 and 405 (and any other HTTP error Starlette raises) in OpenAI's error format."""
    if exc.status_code == 404:
        message, code = f"{request.url.path}: no such route; this server has {ROUTES}", "not_found"
    elif exc.status_code == 405:
        message, code = f"{request.method} {request.url.path}: method not allowed; this server has {ROUTES}", \
            "method_not_allowed"
    else:
        message, code = str(exc.detail), None
    return _json_error(exc.status_code, message, code=code, headers=exc.headers)


class Gate:
    """ASGI middleware: the API key on /v1/*, and 503 for new generations while draining (plain ASGI, so streamed
    responses pass through untouched)."""

    def __init__(self, app, service: Service):
        self.app, self.service = app, service

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            refusal = self.refusal(scope)
            if refusal is not None:
                await refusal(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def refusal(self, scope):
        key = self.service.api_key
        sent = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
        if key and sent != f"Bearer {key}":
            return _json_error(401, "invalid or missing API key: send `Authorization: Bearer KEY`",
                               code="invalid_api_key")
        if self.service.draining and scope["method"] == "POST":
            return _json_error(503, "the server is shutting down; retry on another replica",
                               kind="service_unavailable", headers={"Retry-After": str(RETRY_AFTER_S)})
        return None


class Api:
    """The routes' handlers over one Service."""

    def __init__(self, service: Service):
        self.service, self.served = service, service.served
        self.engine, self.codec, self.cfg = self.served.engine, self.served.placed.codec, self.served.placed.model
        self.eos = self.codec.eos_id if self.codec is not None else None

    async def health(self):
        draining = self.service.draining
        return JSONResponse({"status": "draining" if draining else "ok"}, status_code=503 if draining else 200)

    async def metrics(self):
        m = self.service.metrics
        return Response(m.render(), media_type=m.prom.CONTENT_TYPE_LATEST)

    async def models(self):
        return {"object": "list", "data": [{"id": self.served.name, "object": "model", "created": 0,
                                            "owned_by": "train", "max_model_len": self.engine.max_context}]}

    async def completions(self, request: Request):
        return await self.generate("completions", request, self.completion_request)

    async def chat_completions(self, request: Request):
        return await self.generate("chat", request, self.chat_request)

    def completion_request(self, body: dict):
        fields.check(body, fields.COMPLETION, "/v1/completions")
        prompt = proto.completion_prompt(body, self.codec, self.cfg.vocab_size)
        max_tokens = proto.max_tokens_of(body, ("max_tokens",), 16)
        check_length(len(prompt), max_tokens, self.engine.max_context)
        top = proto.completion_logprobs(body)
        params = proto.sampling(body, self.cfg.vocab_size, max_tokens, self.eos, top)
        echo = None
        if proto.get(body, "echo", "bool", False):  # the prompt first; with logprobs, its tokens' too
            text = body["prompt"] if isinstance(body["prompt"], str) else \
                (self.codec.decode(prompt) if self.codec is not None else "")
            echo = (prompt, text)
            params = dataclasses.replace(params, prompt_logprobs=top if top else None)
        return prompt, params, Completion(self.served.name, self.codec, params, top, echo)

    def chat_request(self, body: dict):
        fields.check(body, fields.CHAT, "/v1/chat/completions")
        renderer, context = self.served.renderer, self.engine.max_context
        if renderer is None or self.codec is None:
            raise RequestError("this model has no tokenizer to render a chat with", "messages")
        messages = proto.chat_messages(body)
        try:
            text = renderer.render(messages, add_generation_prompt=True)
        except Exception as e:  # noqa: BLE001  (a template may raise anything)
            raise RequestError(f"messages: the chat template cannot render them ({e})", "messages") from None
        prompt = self.codec.encode(text)
        check_length(len(prompt), 1, context)
        max_tokens = proto.max_tokens_of(body, ("max_completion_tokens", "max_tokens"), context - len(prompt))
        check_length(len(prompt), max_tokens, context)
        wanted, top = proto.chat_logprobs(body)
        extra = (DEFAULT_STOP,) if renderer.default else ()
        params = proto.sampling(body, self.cfg.vocab_size, max_tokens, self.eos, max(top, 1) if wanted else 0, extra)
        return prompt, params, Chat(self.served.name, self.codec, params, top if wanted else -1)

    async def body_of(self, request: Request) -> dict:
        """The body, read no further than serve.max_body_bytes (413 past it), parsed and checked (train/serve/
        fields.py), its model the served one."""
        limit = self.engine.settings.max_body_bytes
        too_large = RequestError(f"the body exceeds {limit} bytes (serve.max_body_bytes); send a shorter prompt",
                                 status=413)
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise too_large
        raw = bytearray()
        async for part in request.stream():
            raw += part
            if len(raw) > limit:
                raise too_large
        body = fields.parse(bytes(raw))
        proto.check_model(body, self.served.name)
        return body

    async def generate(self, endpoint: str, request: Request, build):
        """Parse with `build(body) -> (prompt, params, shape)`, queue, then answer (streamed or not)."""
        count = lambda status: self.service.metrics.requests.labels(endpoint, status).inc()  # noqa: E731
        try:
            body = await self.body_of(request)
            prompt, params, shape = build(body)
            stream, include_usage = proto.get(body, "stream", "bool", False), proto.stream_usage(body)
        except RequestError as e:
            count(str(e.status))
            return _json_error(e.status, e.message, e.param, code="request_too_large" if e.status == 413 else None)
        rid, queue, loop = proto.new_id(shape.prefix), asyncio.Queue(), asyncio.get_running_loop()
        try:
            await loop.run_in_executor(None, self.service.loop.submit, rid, prompt, params, queue, loop)
        except QueueFull:
            count("429")
            return _json_error(429, f"the queue is full (serve.max_waiting={self.engine.settings.max_waiting}); "
                               f"retry later", kind="rate_limit_error", code="queue_full",
                               headers={"Retry-After": str(RETRY_AFTER_S)})
        except RequestError as e:  # what the engine refuses that the checks above let through
            count("400")
            return _json_error(400, e.message, e.param)
        count("200")
        if stream:
            return StreamingResponse(self.events(rid, queue, shape, include_usage), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        out = await self.last_output(rid, queue, request)
        if out is None:  # the client is gone: nobody reads a response
            return Response(status_code=499)
        if isinstance(out, Exception):
            return _json_error(500, f"the engine failed: {out}", kind="server_error")
        return shape.whole(rid, out)

    async def last_output(self, rid: str, queue: asyncio.Queue, request: Request) -> Output | Exception | None:
        """A non-streamed request's final Output; None when its client hangs up first, whose request is then
        aborted (its slot and pages free by the next step)."""
        waiting, gone = asyncio.ensure_future(_last_output(queue)), asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({waiting, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not waiting.done():  # hung up, or this handler was cancelled
                waiting.cancel()
                await asyncio.get_running_loop().run_in_executor(None, self.service.loop.abort, rid)
        return None if waiting.cancelled() else waiting.result()

    async def events(self, rid: str, queue: asyncio.Queue, shape, include_usage: bool):
        """The SSE stream: one event per token (text held back while it may be a stop string's start). Tokens that
        queued while the loop was busy go out in one write, each still its own event."""
        sent, done, failed, out = 0, False, False, None
        try:
            for chunk in shape.opening(rid):
                yield _sse(chunk)
            while not (done or failed):
                events, out = [], await queue.get()
                while True:
                    if isinstance(out, Exception):
                        events.append(_sse(proto.error_body(f"the engine failed: {out}", kind="server_error")))
                        failed = True
                        break
                    done, text = out.finished, out.text or ""
                    upto = max(sent, len(text) if done else len(text) - proto.held_back(text, shape.params.stop))
                    delta, sent = text[sent:upto], upto
                    events.append(_sse(shape.chunk(rid, delta, out)))
                    if done or queue.empty():
                        break
                    out = queue.get_nowait()
                if done and include_usage:
                    events.append(_sse(proto.envelope(shape.chunk_kind, rid, self.served.name, [],
                                                      {"usage": proto.usage(out)})))
                yield "".join(events)
            yield "data: [DONE]\n\n"
        finally:
            if not done:
                self.service.loop.abort(rid)  # the client went away mid-stream: its pages go back now


async def _last_output(queue: asyncio.Queue) -> Output | Exception:
    while True:
        out = await queue.get()
        if isinstance(out, Exception) or out.finished:
            return out


async def _disconnected(request: Request) -> None:
    """Returns once the client hangs up (the body is read: what the server receives next is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def run_in_thread(app, host: str = "127.0.0.1", port: int = 0):
    """Start uvicorn on `app` in a daemon thread; (the uvicorn.Server, its port) once it listens."""
    import uvicorn
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the server did not start")
        time.sleep(0.02)
    return server, server.servers[0].sockets[0].getsockname()[1]
