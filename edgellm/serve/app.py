"""The OpenAI-compatible HTTP API over the scheduler (FastAPI; served by uvicorn in edgellm.serve.cli).

  POST /v1/chat/completions   messages through the model's chat template; SSE with "stream": true
  POST /v1/completions        a raw prompt (text or token ids)
  GET  /v1/models             the one model served
  GET  /health                status and slot / queue counts (no key needed)
  GET  /metrics               Prometheus counters: requests, tokens, steps, stalls (edgellm.serve.metrics; no key needed)

Every answer carries usage (prompt, completion and cached prompt tokens; in a stream, in the
chunk with the finish reason). Errors have OpenAI's body {"error": {message, type, param, code}}
and its statuses: 400 for a bad request (bad JSON, a field out of range, a prompt longer than the
context), 401 without the API key, 404 for another model, 413 for a body over the bound, 503
when every slot is busy and the queue is full. A client that goes away cancels its request and
frees its slot before the next model step.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import hmac
import json
import time
import uuid
from dataclasses import dataclass

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from ..errors import EdgeLLMError
from ..sampling import SamplingParams
from . import scheduler as sch
from .metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from .metrics import ServerMetrics
from .schemas import MAX_STOP_LEN, MAX_STOPS, ChatCompletionRequest, CompletionRequest

DEFAULT_MAX_BODY = 1 << 20  # bytes of request body


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass
class ServeConfig:
    model_id: str
    api_key: str | None = None
    max_body: int = DEFAULT_MAX_BODY
    max_tokens_limit: int | None = None  # default: the context
    # seconds between two hand-overs of the model's events to the streams (0: each as soon as the
    # loop runs); tokens that arrive within it go out as one chunk per stream
    stream_interval: float = 0.0


class _Guard:
    """Plain ASGI middleware (no BaseHTTPMiddleware: it wraps the receive channel, which streaming
    responses need for noticing a client that went away): the API key on /v1/, and request bodies
    over `limit` bytes refused (413) by Content-Length or while reading."""

    def __init__(self, app, limit: int, api_key: str | None):
        self.app, self.limit, self.api_key = app, limit, api_key

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.api_key and scope["path"].startswith("/v1/"):
            given = dict(scope.get("headers", [])).get(b"authorization", b"")
            if not hmac.compare_digest(given, f"Bearer {self.api_key}".encode()):
                err = APIError(401, "a valid API key is needed: Authorization: Bearer KEY", "authentication_error",
                               code="invalid_api_key")
                return await JSONResponse(err.body(), status_code=401)(scope, receive, send)
        for k, v in scope.get("headers", []):
            if k == b"content-length" and v.isdigit() and int(v) > self.limit:
                err = APIError(413, f"the request body has {int(v)} bytes; at most {self.limit} are accepted",
                               param=None, code="request_too_large")
                return await JSONResponse(err.body(), status_code=413)(scope, receive, send)
        seen = 0

        async def limited():
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.limit:
                    raise HTTPException(413, f"the request body is over {self.limit} bytes")
            return msg

        return await self.app(scope, limited, send)


def create_app(model, scheduler: sch.Scheduler, cfg: ServeConfig) -> FastAPI:
    if scheduler.metrics is None:
        scheduler.attach_metrics(ServerMetrics())
    metrics = scheduler.metrics

    @contextlib.asynccontextmanager
    async def lifespan(app):
        watcher = asyncio.get_running_loop().create_task(metrics.watch_event_loop())
        yield
        watcher.cancel()
        # shutdown: uvicorn has let running requests finish (or cancelled them after its grace
        # period); whatever is still queued or running is cancelled and the model thread ends
        await run_in_threadpool(scheduler.stop)

    app = FastAPI(title="edgellm", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.add_middleware(_Guard, limit=cfg.max_body, api_key=cfg.api_key)
    tok = model.tokenizer
    ctx = scheduler.ctx
    max_tokens_limit = cfg.max_tokens_limit or ctx
    created = int(time.time())

    # -- errors in OpenAI's shape ------------------------------------------------------------------
    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, e: RequestValidationError):
        errs = e.errors()
        first = errs[0] if errs else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        if first.get("type") == "json_invalid":
            msg, param = f"the request body is not valid JSON: {first.get('ctx', {}).get('error', '')}".rstrip(": "), None
        else:
            param = ".".join(loc) or None
            msg = f"{param or 'body'}: {first.get('msg', 'invalid value')}"
            if "input" in first and first.get("type") != "missing":
                msg += f" (got {json.dumps(first['input'], default=str)[:80]})"
        return JSONResponse(APIError(400, msg, param=param).body(), status_code=400)

    @app.exception_handler(HTTPException)
    async def _http(request, e: HTTPException):
        types = {401: "authentication_error", 404: "not_found_error", 405: "invalid_request_error",
                 413: "invalid_request_error"}
        return JSONResponse(APIError(e.status_code, str(e.detail), types.get(e.status_code, "invalid_request_error")).body(),
                            status_code=e.status_code)

    # -- routes -------------------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        return {"status": "ok", "model": cfg.model_id, **scheduler.counts()}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type=METRICS_CONTENT_TYPE)

    model_card = {"id": cfg.model_id, "object": "model", "created": created, "owned_by": "edgellm",
                  "context_length": ctx}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card]}

    @app.get("/v1/models/{model_id:path}")
    async def one_model(model_id: str):
        _check_model(model_id)
        return model_card

    def _check_model(name: str | None) -> None:
        if name is not None and name not in (cfg.model_id, cfg.model_id + ".gguf"):
            raise APIError(404, f"the model '{name}' does not exist; this server serves '{cfg.model_id}'",
                           "not_found_error", param="model", code="model_not_found")

    def _common(body, prompt: list[int], stops: list[str], logprobs: int | None) -> sch.Request:
        _check_model(body.model)
        if body.n != 1:
            raise APIError(400, f"n={body.n}: only n=1 is supported", param="n")
        if len(stops) > MAX_STOPS or any(len(s) > MAX_STOP_LEN for s in stops):
            raise APIError(400, f"stop: at most {MAX_STOPS} strings of at most {MAX_STOP_LEN} characters", param="stop")
        if not prompt:
            raise APIError(400, "the prompt is empty", param="prompt")
        if len(prompt) >= ctx:
            raise APIError(400, f"the prompt has {len(prompt)} tokens; this server's context holds {ctx} "
                                "(prompt plus at least one generated token)", param="messages",
                           code="context_length_exceeded")
        max_tokens = getattr(body, "max_completion_tokens", None)
        max_tokens = body.max_tokens if max_tokens is None else max_tokens
        if max_tokens is not None and max_tokens > max_tokens_limit:
            raise APIError(400, f"max_tokens={max_tokens} is over this server's limit of {max_tokens_limit}",
                           param="max_tokens")
        room = ctx - len(prompt)  # generation ends at the context's end ('length')
        max_tokens = room if max_tokens is None else min(max_tokens, room)
        try:
            params = SamplingParams(temperature=body.temperature, top_k=body.top_k, top_p=body.top_p,
                                    min_p=body.min_p, repetition_penalty=body.repeat_penalty, seed=body.seed,
                                    frequency_penalty=body.frequency_penalty,
                                    presence_penalty=body.presence_penalty)
        except EdgeLLMError as e:
            raise APIError(400, str(e)) from None
        return sch.Request(prompt=prompt, max_tokens=max_tokens, params=params, stops=tuple(stops),
                           logprobs=logprobs, ignore_eos=body.ignore_eos)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        if body.tools:
            raise APIError(400, "tools are not supported", param="tools")
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                    for m in body.messages]
        try:
            prompt = await run_in_threadpool(model.chat_tokens, messages)
        except EdgeLLMError as e:
            raise APIError(400, str(e), param="messages") from None
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        req = _common(body, prompt, body.stops(), logprobs)
        return await _respond(request, req, body, chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        p = body.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise APIError(400, f"a batch of {len(p)} prompts: send one prompt per request", param="prompt")
            p = p[0]
        if body.echo or body.suffix:
            raise APIError(400, "echo and suffix are not supported", param="echo" if body.echo else "suffix")
        if isinstance(p, str):
            prompt = await run_in_threadpool(tok.encode, p)
        else:
            bad = [t for t in p if not 0 <= t < model.config.vocab_size]
            if bad:
                raise APIError(400, f"token id {bad[0]} is outside the vocabulary [0, {model.config.vocab_size})",
                               param="prompt")
            prompt = list(p)
        req = _common(body, prompt, body.stops(), body.logprobs)
        return await _respond(request, req, body, chat=False)

    outboxes: dict = {}  # event loop -> its _Outbox (one loop in `edgellm serve`)

    async def _respond(request: Request, req: sch.Request, body, chat: bool):
        loop = asyncio.get_running_loop()
        outbox = outboxes.get(loop) or outboxes.setdefault(loop, _Outbox(loop, cfg.stream_interval))
        queue: asyncio.Queue = asyncio.Queue()
        req.on_event = functools.partial(outbox.put, queue)
        try:
            scheduler.submit(req)
        except sch.QueueFullError as e:
            raise APIError(503, str(e), "server_error", code="server_busy") from None
        except sch.ShuttingDownError as e:
            raise APIError(503, str(e), "server_error", code="shutting_down") from None
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        fmt = _Format(rid, cfg.model_id, chat, tok)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(_sse(req, queue, fmt, include_usage), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        text, lps, done = [], [], None
        try:
            while done is None:
                try:
                    ev = queue.get_nowait() if not queue.empty() else await asyncio.wait_for(queue.get(), timeout=0.25)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        req.cancel()
                        return JSONResponse({}, status_code=499)
                    continue
                if isinstance(ev, sch.Piece):
                    text.append(ev.text)
                    lps.extend(ev.logprobs or [])
                elif isinstance(ev, sch.Failed):
                    raise APIError(500, f"generation failed: {ev.message}", "server_error")
                else:
                    done = ev
        finally:
            req.cancel()  # no-op once done; frees the slot at once if we left early
        if done.finish_reason == "cancelled":
            raise APIError(503, "the request was cancelled: the server is shutting down", "server_error",
                           code="shutting_down")
        return fmt.full("".join(text), lps if req.logprobs is not None else None, done)

    async def _sse(req: sch.Request, queue: asyncio.Queue, fmt: "_Format", include_usage: bool):
        """The stream's SSE events. The events waiting in the queue are taken together: their
        pieces become one chunk (text joined, logprobs in order) and one write, so a stream that
        fell behind the model catches up in one write, not one per token."""
        want_lps = req.logprobs is not None
        try:
            if fmt.chat:
                yield _data(fmt.chunk({"role": "assistant", "content": ""}, None, None))
            end = False
            while not end:
                evs = [await queue.get()]
                while not queue.empty():
                    evs.append(queue.get_nowait())
                out, text, lps = [], [], []
                for ev in evs:
                    if isinstance(ev, sch.Piece):
                        text.append(ev.text)
                        if want_lps and ev.logprobs:
                            lps.extend(ev.logprobs)
                        continue
                    end = True
                    if isinstance(ev, sch.Failed):
                        out.append(_data(APIError(500, f"generation failed: {ev.message}", "server_error").body()))
                    elif ev.finish_reason == "cancelled":
                        out.append(_data(APIError(503, "the request was cancelled: the server is shutting down",
                                                  "server_error", code="shutting_down").body()))
                    else:
                        out.append(_data(fmt.chunk("" if not fmt.chat else {}, None, ev.finish_reason,
                                                   usage=_usage(ev))))
                        if include_usage:
                            out.append(_data({**fmt.head("chat.completion.chunk" if fmt.chat else "text_completion"),
                                              "choices": [], "usage": _usage(ev)}))
                        out.append("data: [DONE]\n\n")
                    break  # nothing follows a final event
                joined = "".join(text)
                if joined or lps:
                    out.insert(0, fmt.piece(joined) if not lps else _data(fmt.chunk(joined, lps, None)))
                if out:
                    yield "".join(out)
        finally:
            req.cancel()  # the client went away (or we are done): the slot is free before the next step

    return app


class _Outbox:
    """Events from the model thread to one event loop's request queues. Each call_soon_threadsafe
    wakes the loop (a write to its self-pipe, then a turn of the loop): the events that arrive
    before the loop runs share one wake-up, not one each. With an interval, hand-overs are at
    least that far apart (the events of several steps, one chunk per stream)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, interval: float = 0.0):
        self.loop, self.interval = loop, interval
        self._items: collections.deque = collections.deque()
        self._scheduled = False
        self._last = -float("inf")  # loop time of the last hand-over

    def put(self, queue: asyncio.Queue, ev) -> None:
        """From any thread: ev for queue."""
        self._items.append((queue, ev))
        if not self._scheduled:  # a drain that has not started yet will take it
            self._scheduled = True
            self.loop.call_soon_threadsafe(self._wake)

    def _wake(self) -> None:
        wait = self._last + self.interval - self.loop.time()
        if wait > 0:
            self.loop.call_later(wait, self._drain)
        else:
            self._drain()

    def _drain(self) -> None:
        self._last = self.loop.time()
        self._scheduled = False  # first: an event added from here on schedules the next drain
        items = self._items
        while items:
            queue, ev = items.popleft()
            queue.put_nowait(ev)


def _data(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _usage(done: sch.Done) -> dict:
    return {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.completion_tokens,
            "total_tokens": done.prompt_tokens + done.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": done.cached_tokens}}


class _Format:
    """OpenAI's response objects for one request (chat or text completion)."""

    def __init__(self, rid: str, model_id: str, chat: bool, tok):
        self.rid, self.model_id, self.chat, self.tok = rid, model_id, chat, tok
        self.created = int(time.time())
        self.offset = 0
        # a text piece without logprobs is the chunk of a placeholder with the text put in its place
        mark = "\x00piece\x00"
        whole, quoted = _data(self.chunk(mark, None, None)), json.dumps(mark)
        at = whole.index(quoted)
        self._piece = (whole[:at], whole[at + len(quoted):])

    def piece(self, text: str) -> str:
        """The SSE event of a text piece without logprobs: _data(self.chunk(text, None, None))."""
        head, tail = self._piece
        return head + json.dumps(text, ensure_ascii=False) + tail

    def head(self, obj: str) -> dict:
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model_id,
                "system_fingerprint": "edgellm"}

    def _lp_entry(self, token: int, lp: float) -> dict:
        text = self.tok.token_text(token)
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    def logprobs(self, lps: list | None, text: str):
        if lps is None:
            return None
        if self.chat:
            return {"content": [{**self._lp_entry(t, lp), "top_logprobs": [self._lp_entry(i, v) for i, v in top]}
                                for t, lp, top in lps]}
        tokens = [self.tok.token_text(t) for t, _, _ in lps]
        offsets = []
        for t in tokens:
            offsets.append(self.offset)
            self.offset += len(t)
        return {"tokens": tokens, "token_logprobs": [lp for _, lp, _ in lps],
                "top_logprobs": [{self.tok.token_text(i): v for i, v in top} for _, _, top in lps],
                "text_offset": offsets}

    def chunk(self, delta, lps, finish_reason, usage=None) -> dict:
        if self.chat:
            d = delta if isinstance(delta, dict) else {"content": delta}
            choice = {"index": 0, "delta": d, "logprobs": self.logprobs(lps, ""), "finish_reason": finish_reason}
            out = {**self.head("chat.completion.chunk"), "choices": [choice]}
        else:
            choice = {"index": 0, "text": delta, "logprobs": self.logprobs(lps, delta), "finish_reason": finish_reason}
            out = {**self.head("text_completion"), "choices": [choice]}
        if usage is not None:
            out["usage"] = usage
        return out

    def full(self, text: str, lps: list | None, done: sch.Done) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": self.logprobs(lps, text), "finish_reason": done.finish_reason}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": self.logprobs(lps, text),
                      "finish_reason": done.finish_reason}
            obj = "text_completion"
        return {**self.head(obj), "choices": [choice], "usage": _usage(done)}
