"""The OpenAI-compatible HTTP server over the asynchronous engine (FastAPI + uvicorn).

``OpenAIServer(llm, model_name=...)`` wraps an ``LLM`` in an ``AsyncEngine`` and builds the
FastAPI app (``server.app``); ``run_server`` serves it in the foreground (signals drain it
gracefully) and ``start_in_thread`` in a background thread (tests, benchmarks). FastAPI,
uvicorn and prometheus_client are imported only when a server is built, so the rest of the
package imports without them (``pip install 'v41plan[serve]'``).

Endpoints, as vLLM serves them: ``POST /v1/completions``, ``POST /v1/chat/completions``,
``GET /v1/models``, ``GET /health``, ``POST /tokenize``, ``POST /detokenize``, ``GET /metrics``.
Every request body is checked here before anything reaches the engine: bad JSON, an unknown
model, an unknown field, a wrong type or an out-of-range value, a prompt that does not fit
``max_model_len`` get the OpenAI error JSON (``{"error": {"message", "type", "param",
"code"}}``) with status 400; a wrong or missing API key (``--api-key``) 401; a full waiting
queue or a server shutting down 503 with ``Retry-After``. A request that fails inside the
engine fails alone: status 500, or, streaming, an error event before ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import math
import signal
import threading
import time
import uuid
from dataclasses import dataclass, field, fields, replace
from functools import partial

from v41plan.serving.async_engine import AsyncEngine, EngineClosed, QueueFull, RequestEvent
from v41plan.serving.sampling import SamplingParams

__all__ = ["ApiError", "OpenAIServer", "run_server", "start_in_thread"]

MAX_N = 64
"""Choices per request at most."""
MAX_LOGPROBS = 20
"""Top logprobs per token at most (the OpenAI limit)."""
MAX_STOP = 16
"""Stop entries per request at most (each is checked against the text every step)."""
_COMMON = {
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "n",
    "stop",
    "stop_token_ids",
    "stream",
    "stream_options",
    "ignore_eos",
    "user",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
}
COMPLETION_FIELDS = _COMMON | {"prompt", "logprobs", "echo", "suffix", "best_of"}
"""Fields ``/v1/completions`` accepts."""
CHAT_FIELDS = _COMMON | {"messages", "logprobs", "top_logprobs", "max_completion_tokens"}
"""Fields ``/v1/chat/completions`` accepts."""
_CHAT_ROLES = {"system", "developer", "user", "assistant"}
# Optional engine features: field name -> the neutral value that needs no support.
_OPTIONAL = {"min_p": 0.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}
_OPTIONAL_ONE = {"repetition_penalty": 1.0}


class ApiError(Exception):
    """A request refused before it reaches the engine (OpenAI error JSON)."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        err_type: str = "invalid_request_error",
        param: str | None = None,
        headers: dict | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.err_type = err_type
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict:
        """The OpenAI error object."""
        return {
            "error": {
                "message": self.message,
                "type": self.err_type,
                "param": self.param,
                "code": self.status,
            }
        }


# ---- request checking ---------------------------------------------------------------------


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def _num(body: dict, name: str, default, lo: float, hi: float, lo_open: bool = False):
    v = body.get(name)
    if v is None:
        return default
    if not _is_num(v):
        raise ApiError(f"'{name}' must be a number, got {v!r}", param=name)
    if v < lo or v > hi or (lo_open and v == lo):
        bound = f"({lo}, {hi}]" if lo_open else f"[{lo}, {hi}]"
        raise ApiError(f"'{name}' must be in {bound}, got {v!r}", param=name)
    return float(v)


def _int(body: dict, name: str, default, lo: int, hi: int):
    v = body.get(name)
    if v is None:
        return default
    if not _is_int(v):
        raise ApiError(f"'{name}' must be an integer, got {v!r}", param=name)
    if not lo <= v <= hi:
        raise ApiError(f"'{name}' must be in [{lo}, {hi}], got {v!r}", param=name)
    return v


def _bool(body: dict, name: str, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ApiError(f"'{name}' must be a boolean, got {v!r}", param=name)
    return v


@dataclass
class ParsedRequest:
    """A checked completions or chat request."""

    chat: bool
    prompts: list[list[int]]
    """Prompt token ids, one list per prompt (chat: one)."""
    params: list[SamplingParams]
    """One per choice (``n`` of them); choice ``i`` of a seeded request uses ``seed + i``."""
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    logprobs: int | None
    """Top logprobs per token (None: not asked)."""
    n: int
    extra: dict = field(default_factory=dict)


class RequestParser:
    """Checks request bodies against the engine (vocabulary, ``max_model_len``, features)."""

    def __init__(self, llm, model_name: str, params_cls=SamplingParams) -> None:
        self.llm = llm
        self.model_name = model_name
        self.params_cls = params_cls
        self.param_fields = {f.name for f in fields(params_cls)}
        self.vocab_size = int(llm.vocab_size)
        self.max_model_len = int(llm.options.max_model_len)

    def _common(self, body: dict, allowed: set[str]) -> None:
        unknown = sorted(set(body) - allowed)
        if unknown:
            raise ApiError(f"unknown field '{unknown[0]}'", param=unknown[0])
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise ApiError(
                f"the model '{model}' does not exist; this server serves '{self.model_name}'",
                param="model",
            )

    def check_ids(self, ids: list, param: str) -> list[int]:
        """Token ids in the vocabulary."""
        if not ids:
            raise ApiError(f"'{param}' is empty", param=param)
        for t in ids:
            if not _is_int(t) or not 0 <= t < self.vocab_size:
                raise ApiError(
                    f"'{param}' has token id {t!r}, outside [0, {self.vocab_size})", param=param
                )
        return list(ids)

    def _prompts(self, body: dict) -> list[list[int]]:
        p = body.get("prompt")
        if p is None:
            raise ApiError("'prompt' is required", param="prompt")
        if isinstance(p, str) or (isinstance(p, list) and p and all(_is_int(t) for t in p)):
            items = [p]
        elif isinstance(p, list) and p and all(isinstance(x, (str, list)) for x in p):
            items = p
        else:
            raise ApiError(
                "'prompt' must be a string, a list of strings, a list of token ids or a list "
                "of token id lists",
                param="prompt",
            )
        out = []
        for item in items:
            if isinstance(item, str):
                if not item:
                    raise ApiError("'prompt' is empty", param="prompt")
                out.append(self.check_ids(self.llm.encode(item), "prompt"))
            else:
                out.append(self.check_ids(item, "prompt"))
        return out

    def messages(self, body: dict) -> list[dict]:
        """Chat messages as ``{role, content: str}``."""
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise ApiError("'messages' must be a non-empty list", param="messages")
        out = []
        for i, m in enumerate(msgs):
            if not isinstance(m, dict):
                raise ApiError(f"messages[{i}] must be an object", param="messages")
            extra = sorted(set(m) - {"role", "content", "name"})
            if extra:
                raise ApiError(f"unknown field 'messages[{i}].{extra[0]}'", param="messages")
            role = m.get("role")
            if role not in _CHAT_ROLES:
                raise ApiError(
                    f"messages[{i}].role must be one of {sorted(_CHAT_ROLES)}, got {role!r}",
                    param="messages",
                )
            content = m.get("content")
            if isinstance(content, list):
                parts = []
                for part in content:
                    if not (isinstance(part, dict) and part.get("type") == "text"):
                        raise ApiError(
                            f"messages[{i}].content: only text parts are supported",
                            param="messages",
                        )
                    if not isinstance(part.get("text"), str):
                        raise ApiError(f"messages[{i}].content: bad text part", param="messages")
                    parts.append(part["text"])
                content = "".join(parts)
            if not isinstance(content, str):
                raise ApiError(f"messages[{i}].content must be a string", param="messages")
            out.append({"role": "system" if role == "developer" else role, "content": content})
        return out

    def chat_ids(self, messages: list[dict]) -> list[int]:
        """Prompt ids of a chat through the tokenizer's chat format."""
        tok = self.llm.tokenizer
        if hasattr(tok, "apply_chat_template"):
            return list(tok.apply_chat_template(messages))
        from v41plan.serving.tokenizer import role_tagged_chat

        return self.llm.encode(role_tagged_chat(messages))

    def parse(self, body: dict, chat: bool) -> ParsedRequest:
        """Check ``body`` and build the engine's sampling params (raises ``ApiError``)."""
        if not isinstance(body, dict):
            raise ApiError("the request body must be a JSON object")
        self._common(body, CHAT_FIELDS if chat else COMPLETION_FIELDS)
        if chat:
            prompts = [self.check_ids(self.chat_ids(self.messages(body)), "messages")]
        else:
            prompts = self._prompts(body)
        n = _int(body, "n", 1, 1, MAX_N)
        temperature = _num(body, "temperature", 1.0, 0.0, 2.0)  # the OpenAI default
        top_p = _num(body, "top_p", 1.0, 0.0, 1.0, lo_open=True)
        top_k = _int(body, "top_k", 0, -1, self.vocab_size)
        seed = _int(body, "seed", None, 0, 2**63 - 1)
        stream = _bool(body, "stream", False)
        ignore_eos = _bool(body, "ignore_eos", False)
        opts = body.get("stream_options")
        include_usage = False
        if opts is not None:
            if not stream:
                raise ApiError("'stream_options' needs 'stream': true", param="stream_options")
            if not isinstance(opts, dict) or set(opts) - {"include_usage"}:
                raise ApiError(
                    "'stream_options' accepts only 'include_usage'", param="stream_options"
                )
            include_usage = _bool(opts, "include_usage", False)
        if body.get("logit_bias") not in (None, {}):
            raise ApiError("'logit_bias' is not supported", param="logit_bias")
        if body.get("user") is not None and not isinstance(body["user"], str):
            raise ApiError("'user' must be a string", param="user")
        stop_strings, stop_ids = self._stop(body)
        logprobs = self._logprobs(body, chat)
        if not chat:
            if body.get("echo") not in (None, False):
                raise ApiError("'echo' is not supported", param="echo")
            if body.get("suffix") is not None:
                raise ApiError("'suffix' is not supported", param="suffix")
            best_of = body.get("best_of")
            if best_of is not None and best_of != n:
                raise ApiError("'best_of' must equal 'n'", param="best_of")
        longest = max(len(p) for p in prompts)
        if longest >= self.max_model_len:
            raise ApiError(
                f"this model's maximum context length is {self.max_model_len} tokens; the "
                f"prompt has {longest}",
                param="messages" if chat else "prompt",
            )
        room = self.max_model_len - longest
        name = "max_tokens"
        if chat and body.get("max_completion_tokens") is not None:
            name = "max_completion_tokens"
        max_tokens = _int(body, name, None, 1, 2**31 - 1)
        if max_tokens is None:
            max_tokens = min(room, 16) if not chat else room
        elif longest + max_tokens > self.max_model_len:
            raise ApiError(
                f"this model's maximum context length is {self.max_model_len} tokens; "
                f"{longest} in the prompt plus {max_tokens} to generate do not fit",
                param=name,
            )
        kw = {
            "temperature": temperature,
            "top_k": max(0, top_k),
            "top_p": top_p,
            "seed": seed,
            "max_tokens": max_tokens,
            "stop_token_ids": tuple(stop_ids),
            "ignore_eos": ignore_eos,
        }
        for name, neutral in {**_OPTIONAL, **_OPTIONAL_ONE}.items():
            lo, hi = (0.0, 1.0) if name == "min_p" else (-2.0, 2.0)
            if name == "repetition_penalty":
                lo, hi = 0.0, 10.0
            value = _num(body, name, neutral, lo, hi)
            if value != neutral:
                if name not in self.param_fields:
                    raise ApiError(f"'{name}' is not supported by this engine", param=name)
                kw[name] = value
        if logprobs is not None:
            if "logprobs" not in self.param_fields:
                raise ApiError(
                    "logprobs are not available in this engine",
                    param="top_logprobs" if chat else "logprobs",
                )
            kw["logprobs"] = logprobs
        try:
            base = self.params_cls(**kw)
            base.validate(self.vocab_size)
        except (TypeError, ValueError) as exc:
            raise ApiError(str(exc)) from exc
        params = [
            base if seed is None else replace(base, seed=(seed + i) % 2**63) for i in range(n)
        ]
        return ParsedRequest(
            chat, prompts, params, tuple(stop_strings), stream, include_usage, logprobs, n
        )

    def _stop(self, body: dict) -> tuple[list[str], list[int]]:
        stop = body.get("stop")
        items = [] if stop is None else [stop] if isinstance(stop, (str, int)) else stop
        if not isinstance(items, list):
            raise ApiError("'stop' must be a string or a list", param="stop")
        if len(items) > MAX_STOP:
            raise ApiError(f"'stop' takes at most {MAX_STOP} entries", param="stop")
        strings, ids = [], []
        for s in items:
            if isinstance(s, str) and s:
                strings.append(s)
            elif _is_int(s) and 0 <= s < self.vocab_size:
                ids.append(s)
            else:
                raise ApiError(
                    f"'stop' entries are non-empty strings or token ids in [0, "
                    f"{self.vocab_size}), got {s!r}",
                    param="stop",
                )
        extra = body.get("stop_token_ids")
        if extra is not None:
            if not isinstance(extra, list):
                raise ApiError("'stop_token_ids' must be a list", param="stop_token_ids")
            ids += self.check_ids(extra, "stop_token_ids") if extra else []
        return strings, ids

    def _logprobs(self, body: dict, chat: bool) -> int | None:
        if chat:
            want = _bool(body, "logprobs", False)
            top = _int(body, "top_logprobs", None, 0, MAX_LOGPROBS)
            if top is not None and not want:
                raise ApiError("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
            return (top or 0) if want else None
        return _int(body, "logprobs", None, 0, MAX_LOGPROBS)


# ---- responses ----------------------------------------------------------------------------


@dataclass
class _ChoiceOut:
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    error: str | None = None


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _put(loop, queue: asyncio.Queue, base: int, event: RequestEvent) -> None:
    """The engine thread's hand-off into the request's asyncio queue."""
    try:
        loop.call_soon_threadsafe(queue.put_nowait, (base, event))
    except RuntimeError:  # the event loop is closed: nobody listens any more
        pass


class OpenAIServer:
    """An ``LLM`` behind the OpenAI API: the engine loop, the metrics and the FastAPI app."""

    def __init__(
        self,
        llm,
        *,
        model_name: str | None = None,
        api_key: str | None = None,
        max_waiting: int = 256,
        params_cls=SamplingParams,
        engine: AsyncEngine | None = None,
        disconnect_poll_s: float = 0.25,
    ) -> None:
        from v41plan.serving.metrics import ServerMetrics

        self.llm = llm
        self.model_name = model_name or llm.spec.name
        self.api_key = api_key
        self.parser = RequestParser(llm, self.model_name, params_cls)
        self.engine = engine or AsyncEngine(llm, max_waiting=max_waiting)
        self.metrics = ServerMetrics(lambda: self.engine.snapshot, self.model_name)
        self.engine.metrics = self.metrics
        self.created = int(time.time())
        self.disconnect_poll_s = disconnect_poll_s
        self._token_texts: dict[int, str] = {}
        self.app = self._build_app()

    # ---- helpers ------------------------------------------------------------------------------
    def token_text(self, token_id: int) -> str:
        """The text of one token (logprobs' ``token``)."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.llm.decode([token_id])
        return text

    def _completion_logprobs(self, entries: list, ids: list[int], offset: int) -> dict:
        tokens = [self.token_text(t) for t in ids]
        offsets, pos = [], offset
        for t in tokens:
            offsets.append(pos)
            pos += len(t)
        return {
            "tokens": tokens,
            "token_logprobs": [float(e[0]) for e in entries],
            "top_logprobs": [
                {self.token_text(int(k)): float(v) for k, v in e[1].items()} for e in entries
            ],
            "text_offset": offsets,
        }

    def _chat_logprobs(self, entries: list, ids: list[int]) -> list[dict]:
        out = []
        for t, e in zip(ids, entries):
            s = self.token_text(t)
            out.append(
                {
                    "token": s,
                    "logprob": float(e[0]),
                    "bytes": list(s.encode("utf-8")),
                    "top_logprobs": [
                        {
                            "token": self.token_text(int(k)),
                            "logprob": float(v),
                            "bytes": list(self.token_text(int(k)).encode("utf-8")),
                        }
                        for k, v in e[1].items()
                    ],
                }
            )
        return out

    def _check_key(self, request) -> None:
        if self.api_key is None:
            return
        auth = request.headers.get("authorization", "")
        given = auth[7:] if auth.lower().startswith("bearer ") else ""
        if not hmac.compare_digest(given.encode(), self.api_key.encode()):
            raise ApiError(
                "invalid or missing API key", status=401, err_type="authentication_error"
            )

    @staticmethod
    async def _json(request) -> dict:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ApiError(f"the request body is not valid JSON: {exc}") from exc
        if not isinstance(body, dict):
            raise ApiError("the request body must be a JSON object")
        return body

    def _submit(self, parsed: ParsedRequest, loop, queue) -> list:
        handles = []
        try:
            for i, ids in enumerate(parsed.prompts):
                emit = partial(_put, loop, queue, i * parsed.n)
                handles.append(self.engine.submit(ids, parsed.params, emit, parsed.stop))
        except (QueueFull, EngineClosed) as exc:
            for h in handles:
                self.engine.abort(h)
            raise ApiError(
                str(exc), status=503, err_type="service_unavailable", headers={"Retry-After": "1"}
            ) from exc
        return handles

    # ---- the app ------------------------------------------------------------------------------
    def _build_app(self):
        from contextlib import asynccontextmanager

        from fastapi import FastAPI, Request
        from fastapi.responses import JSONResponse, Response, StreamingResponse
        from starlette.exceptions import HTTPException as StarletteHTTPException

        server = self

        def takes_request(fn):
            # This module's annotations are strings; FastAPI must see the class itself.
            fn.__annotations__ = {"request": Request}
            return fn

        @asynccontextmanager
        async def lifespan(app):
            if not server.engine.alive and server.engine.error is None:
                server.engine.start()
            yield
            await asyncio.to_thread(server.engine.stop)

        app = FastAPI(title="v41plan", lifespan=lifespan, docs_url=None, redoc_url=None)

        @app.exception_handler(ApiError)
        async def _api_error(request, exc: ApiError):
            return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

        @app.exception_handler(StarletteHTTPException)
        async def _http_error(request, exc):
            err = ApiError(str(exc.detail), status=exc.status_code, err_type="not_found_error")
            return JSONResponse(err.body(), status_code=exc.status_code)

        @app.get("/health")
        async def health():
            """200 while the engine loop runs, else 503 naming why."""
            if not server.engine.alive:
                err = ApiError(
                    f"the engine loop is not running ({server.engine.error!r})",
                    status=503,
                    err_type="service_unavailable",
                )
                return JSONResponse(err.body(), status_code=503)
            return Response(status_code=200)

        @app.get("/metrics")
        async def metrics():
            """The Prometheus text exposition."""
            return Response(
                server.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8"
            )

        @app.get("/v1/models")
        @takes_request
        async def models(request: Request):
            """The one served model."""
            server._check_key(request)
            card = {
                "id": server.model_name,
                "object": "model",
                "created": server.created,
                "owned_by": "v41plan",
                "root": server.model_name,
                "max_model_len": server.parser.max_model_len,
            }
            return {"object": "list", "data": [card]}

        @app.post("/tokenize")
        @takes_request
        async def tokenize(request: Request):
            """Token ids of a prompt or a chat (``count``, ``max_model_len``, ``tokens``)."""
            server._check_key(request)
            body = await server._json(request)
            server.parser._common(body, {"model", "prompt", "messages", "add_special_tokens"})
            if "messages" in body:
                ids = server.parser.chat_ids(server.parser.messages(body))
            else:
                prompt = body.get("prompt")
                if not isinstance(prompt, str):
                    raise ApiError("'prompt' must be a string", param="prompt")
                add = _bool(body, "add_special_tokens", False)
                ids = server.llm.encode(prompt)
                bos = getattr(server.llm.tokenizer, "bos_token_id", None)
                if add and bos is not None:
                    ids = [bos, *ids]
            return {"count": len(ids), "max_model_len": server.parser.max_model_len, "tokens": ids}

        @app.post("/detokenize")
        @takes_request
        async def detokenize(request: Request):
            """Text of token ids (``prompt``)."""
            server._check_key(request)
            body = await server._json(request)
            server.parser._common(body, {"model", "tokens"})
            tokens = body.get("tokens")
            if not isinstance(tokens, list):
                raise ApiError("'tokens' must be a list of token ids", param="tokens")
            ids = server.parser.check_ids(tokens, "tokens") if tokens else []
            return {"prompt": server.llm.decode(ids)}

        @app.post("/v1/completions")
        @takes_request
        async def completions(request: Request):
            """``/v1/completions``."""
            return await server._generate(request, chat=False)

        @app.post("/v1/chat/completions")
        @takes_request
        async def chat_completions(request: Request):
            """``/v1/chat/completions``."""
            return await server._generate(request, chat=True)

        self._responses = (JSONResponse, StreamingResponse)
        return app

    async def _generate(self, request, chat: bool):
        self._check_key(request)
        body = await self._json(request)
        parsed = self.parser.parse(body, chat)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        handles = self._submit(parsed, loop, queue)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        JSONResponse, StreamingResponse = self._responses
        if parsed.stream:
            gen = self._stream(request, parsed, handles, queue, rid)
            return StreamingResponse(gen, media_type="text/event-stream")
        outs = [_ChoiceOut() for _ in range(len(parsed.prompts) * parsed.n)]
        remaining = len(outs)
        try:
            while remaining:
                try:
                    base, ev = await asyncio.wait_for(queue.get(), self.disconnect_poll_s)
                except TimeoutError:
                    if await request.is_disconnected():
                        return None
                    continue
                out = outs[base + ev.index]
                out.text.append(ev.text)
                out.token_ids += ev.token_ids
                if ev.logprobs:
                    out.logprobs += ev.logprobs
                if ev.finish_reason is not None:
                    out.finish_reason, out.stop_reason, out.error = (
                        ev.finish_reason,
                        ev.stop_reason,
                        ev.error,
                    )
                    remaining -= 1
        finally:
            if remaining:
                for h in handles:
                    self.engine.abort(h)
        errors = [o.error for o in outs if o.finish_reason == "error"]
        if errors:
            err = ApiError(errors[0], status=500, err_type="server_error")
            return JSONResponse(err.body(), status_code=500)
        prompt_tokens = sum(len(p) for p in parsed.prompts)
        completion_tokens = sum(len(o.token_ids) for o in outs)
        choices = []
        for i, o in enumerate(outs):
            text = "".join(o.text)
            c = {"index": i, "finish_reason": o.finish_reason, "stop_reason": o.stop_reason}
            lp = None
            if parsed.logprobs is not None:
                if chat:
                    lp = {"content": self._chat_logprobs(o.logprobs, o.token_ids)}
                else:
                    lp = self._completion_logprobs(o.logprobs, o.token_ids, 0)
            if chat:
                c["message"] = {"role": "assistant", "content": text}
            else:
                c["text"] = text
            c["logprobs"] = lp
            choices.append(c)
        return {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": choices,
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
        }

    async def _stream(self, request, parsed: ParsedRequest, handles, queue, rid: str):
        chat = parsed.chat
        created = int(time.time())
        kind = "chat.completion.chunk" if chat else "text_completion"
        total = len(parsed.prompts) * parsed.n
        text_len = [0] * total
        completion_tokens = 0
        usage_null = {"usage": None} if parsed.include_usage else {}

        def chunk(choices: list) -> str:
            return _sse(
                {
                    "id": rid,
                    "object": kind,
                    "created": created,
                    "model": self.model_name,
                    "choices": choices,
                    **usage_null,
                }
            )

        complete = False
        remaining = total
        try:
            if chat:
                for i in range(total):
                    first = {"role": "assistant", "content": ""}
                    yield chunk([{"index": i, "delta": first, "logprobs": None}])
            while remaining:
                try:
                    base, ev = await asyncio.wait_for(queue.get(), self.disconnect_poll_s)
                except TimeoutError:
                    if await request.is_disconnected():
                        return
                    continue
                index = base + ev.index
                completion_tokens += len(ev.token_ids)
                if ev.finish_reason == "error":
                    err = ApiError(ev.error or "engine error", status=500, err_type="server_error")
                    yield _sse(err.body())
                    yield "data: [DONE]\n\n"
                    return
                lp = None
                if parsed.logprobs is not None and ev.logprobs:
                    if chat:
                        lp = {"content": self._chat_logprobs(ev.logprobs, ev.token_ids)}
                    else:
                        lp = self._completion_logprobs(ev.logprobs, ev.token_ids, text_len[index])
                text_len[index] += len(ev.text)
                choice = {"index": index, "logprobs": lp, "finish_reason": ev.finish_reason}
                if ev.finish_reason is not None:
                    choice["stop_reason"] = ev.stop_reason
                    remaining -= 1
                if chat:
                    choice["delta"] = {"content": ev.text} if ev.text else {}
                else:
                    choice["text"] = ev.text
                if ev.text or ev.finish_reason is not None or lp is not None:
                    yield chunk([choice])
            if parsed.include_usage:
                prompt_tokens = sum(len(p) for p in parsed.prompts)
                usage = {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": completion_tokens,
                    "total_tokens": prompt_tokens + completion_tokens,
                }
                yield _sse(
                    {
                        "id": rid,
                        "object": kind,
                        "created": created,
                        "model": self.model_name,
                        "choices": [],
                        "usage": usage,
                    }
                )
            yield "data: [DONE]\n\n"
            complete = True
        finally:
            if not complete:
                for h in handles:
                    self.engine.abort(h)


# ---- running it ---------------------------------------------------------------------------


def _uvicorn_server(server: OpenAIServer, host: str, port: int, grace_s: float, log_level: str):
    import uvicorn

    engine = server.engine

    class _Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            # In-flight requests get grace_s to finish, then are cut with finish_reason set.
            # The signal is not re-raised after the drain: the command exits 0 (torchrun's
            # other ranks have been told to stop by then).
            engine.drain(grace_s)
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True
            self.should_exit = True

    config = uvicorn.Config(
        server.app,
        host=host,
        port=port,
        log_level=log_level,
        timeout_graceful_shutdown=math.ceil(grace_s) + 5,
        lifespan="on",
    )
    return _Server(config)


def run_server(
    server: OpenAIServer,
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    grace_s: float = 10.0,
    log_level: str = "info",
) -> None:
    """Serve in the foreground until SIGINT/SIGTERM, then drain (``grace_s``) and stop."""
    _uvicorn_server(server, host, port, grace_s, log_level).run()


@dataclass
class BackgroundServer:
    """A server running in a thread (``start_in_thread``)."""

    server: OpenAIServer
    uvicorn_server: object
    thread: threading.Thread
    url: str
    """``http://host:port``."""

    def stop(self, grace_s: float = 5.0, timeout_s: float = 60.0) -> None:
        """Drain for ``grace_s``, stop uvicorn and the engine, join (bounded)."""
        self.server.engine.drain(grace_s)
        self.uvicorn_server.should_exit = True
        self.thread.join(timeout_s)


def start_in_thread(
    server: OpenAIServer,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    grace_s: float = 5.0,
    log_level: str = "warning",
    timeout_s: float = 60.0,
) -> BackgroundServer:
    """Serve in a background thread; returns once it accepts connections (port 0: a free one)."""
    import socket

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    port = sock.getsockname()[1]
    uv = _uvicorn_server(server, host, port, grace_s, log_level)
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.perf_counter() + timeout_s
    while not uv.started:
        if not thread.is_alive() or time.perf_counter() > deadline:
            raise RuntimeError("the server did not start")
        time.sleep(0.02)
    return BackgroundServer(server, uv, thread, f"http://{host}:{port}")
