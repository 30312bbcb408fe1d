"""HTTP front of one server (FastAPI): OpenAI-compatible /v1/completions, /v1/chat/completions,
/v1/models; SGLang-style /generate; /health; /metrics.

The engine loop runs in its own thread; handlers hand requests to it with `EngineLoop.submit` and
receive `StepOutput`s through an asyncio queue. Bad input → 400 with an OpenAI-style error body
{"error": {"message", "type", "param", "code"}}; unknown fields are rejected. A client that
disconnects mid-request aborts it, which frees its KV pages.
"""

from __future__ import annotations

import asyncio
import contextlib
import difflib
import functools
import hmac
import json
import logging
import time
import typing
import uuid
from typing import Any, AsyncIterator, Callable, Literal

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdlab.runtime.core import FinishReason, Req, SamplingParams, StepOutput
from pdlab.runtime.engine.loop import EngineLoop
from pdlab.runtime.scheduler.output import TextCodec
from pdlab.runtime.server.metrics import RuntimeMetrics
from pdlab.runtime.server.request_id import EchoRequestId, request_id

log = logging.getLogger("pdlab.runtime")
MAX_TOKENS_CAP = 1 << 20  # larger is absurd for any model; the context check gives the precise limit
MAX_STOP_STRINGS = 16  # per request, on every route


# ---- request bodies ------------------------------------------------------------------------------
class _Strict(BaseModel):
    # strict: a JSON boolean is no integer and a string no number or boolean (OpenAI refuses them; lax pydantic took
    # `"max_tokens": true` as 1); an integer stays a valid number
    # allow_inf_nan: Python's JSON reader takes NaN and Infinity, which no JSON has
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingFields(_Strict):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_CAP)
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    n: int = Field(1, ge=1, le=1, description="only 1 is supported")
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(0.0, ge=0.0, le=0.0, description="not supported: must be 0")
    frequency_penalty: float = Field(0.0, ge=0.0, le=0.0, description="not supported: must be 0")
    user: str | None = None


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] = Field(..., description="text, token ids, or a list of one text")
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = Field(False, description="not supported: must be false")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[TextPart]
    name: str | None = None


class ChatRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_CAP)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)


class GenerateSamplingParams(_Strict):
    max_new_tokens: int = Field(128, ge=1, le=MAX_TOKENS_CAP)
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True


class GenerateRequest(_Strict):
    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: GenerateSamplingParams = Field(default_factory=GenerateSamplingParams)
    stream: bool = False
    rid: str | None = Field(None, min_length=1, max_length=200)
    return_logprob: bool = False
    top_logprobs_num: int = Field(0, ge=0, le=20)


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, type_: str = "invalid_request_error"):
        self.status, self.message, self.param, self.type = status, message, param, type_


async def _disconnected(request: Request) -> None:
    """Returns when the client has closed the connection (the request body is already read, so the
    next ASGI message is http.disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _unicode(text: str, param: str) -> str:
    """`text` when it is valid Unicode; else ApiError 400 naming the first lone surrogate (JSON may escape one,
    \\ud800-\\udfff without its pair, which no tokenizer can take)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ApiError(400, f"{param} is not valid Unicode: a lone surrogate \\u{ord(text[exc.start]):04x} at "
                       f"character {exc.start} (a JSON \\ud800-\\udfff escape without its pair); send UTF-8 text",
                       param) from None
    return text


# pydantic's error kinds for a value of the wrong JSON type
_TYPE_ERRORS = {"int_type", "float_type", "bool_type", "string_type", "list_type", "dict_type", "model_type",
                "model_attributes_type"}

# pydantic's error kinds for a value of the right type out of its range
_RANGE_ERRORS = {"greater_than", "greater_than_equal", "less_than", "less_than_equal"}

# request fields of several types: pydantic reports one error per type tried, which says little
_UNION_FIELDS = {"prompt": "expects a string, a list of token ids or a list of one string",
                 "stop": "expects a string or a list of strings",
                 "content": 'expects a string or a list of {"type": "text", "text": ...} parts'}


# OpenAI request fields this server does not implement: refused by name rather than as unknown (misspelt) fields
_UNSUPPORTED_FIELDS = {"best_of": "one choice per request", "logit_bias": "no logit bias",
                       "suffix": "no insertion", "response_format": "no structured output",
                       "tools": "no tool calling", "tool_choice": "no tool calling",
                       "parallel_tool_calls": "no tool calling", "functions": "no function calling",
                       "function_call": "no function calling", "audio": "text only", "modalities": "text only",
                       "prediction": "no predicted outputs"}
# fields accepted with one value only: a value out of that "range" is an unsupported feature
_ONE_VALUE_FIELDS = {"n": "n={value} is not supported: one choice per request; send n=1 or leave it out, and send "
                          "several requests for several choices",
                     "presence_penalty": "presence_penalty is not supported: send 0 or leave it out",
                     "frequency_penalty": "frequency_penalty is not supported: send 0 or leave it out"}


# the fields of another API that a client of this route most likely meant (the OpenAI routes vs SGLang's /generate)
_OTHER_API_NAMES = {"max_tokens": "max_new_tokens", "prompt": "text", "logprobs": "return_logprob",
                    "top_logprobs": "top_logprobs_num", "max_new_tokens": "max_tokens"}


def _body_model(path: str) -> type[BaseModel] | None:
    return {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatRequest,
            "/generate": GenerateRequest}.get(path)


def _model_in(annotation) -> type[BaseModel] | None:
    """The request-body model inside a field's type (`StreamOptions | None`, `list[ChatMessage]`), or None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return next((m for m in map(_model_in, typing.get_args(annotation)) if m is not None), None)


def _near_field(model: type[BaseModel] | None, loc: list[str]) -> str | None:
    """The field of `model` (at the nested object `loc[:-1]` names) that the unknown field `loc[-1]` most likely
    meant: its other-API name (max_tokens in /generate's sampling_params: max_new_tokens) or the closest spelling."""
    for part in loc[:-1]:
        if model is None or part.isdigit():  # a list index: the items' model is already the current one
            continue
        field = model.model_fields.get(part)
        if field is None:
            return None
        model = _model_in(field.annotation)
    if model is None or not loc:
        return None
    fields, name = list(model.model_fields), loc[-1]
    if _OTHER_API_NAMES.get(name) in fields:
        return _OTHER_API_NAMES[name]
    near = difflib.get_close_matches(name, fields, n=1, cutoff=0.75)
    return near[0] if near else None


def _union_field(loc: list[str]) -> int | None:
    """The index in `loc` of a field of `_UNION_FIELDS` followed by the type pydantic tried there, or None."""
    for i, part in enumerate(loc[:-1]):
        nxt = loc[i + 1]
        if part in _UNION_FIELDS and (nxt in ("str", "int") or "[" in nxt):
            return i
    return None


def _stop_strings(stop: str | list[str] | None, param: str) -> list[str]:
    """A request's `stop` as a list; ApiError 400 naming `param` for an empty string or more than MAX_STOP_STRINGS
    (each one is searched for in the text after every token)."""
    stop = [stop] if isinstance(stop, str) else list(stop or [])
    if any(not s for s in stop):
        raise ApiError(400, "stop strings must be non-empty", param)
    if len(stop) > MAX_STOP_STRINGS:
        raise ApiError(400, f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}; send fewer", param)
    return stop


def _json_kind(value: Any) -> str:
    """What a parsed JSON value is, in JSON's words: "a boolean", "a string", "a decimal number"..."""
    kinds = {list: "an array", dict: "an object", type(None): "null", str: "a string", bool: "a boolean",
             int: "an integer", float: "a decimal number"}
    return kinds.get(type(value), type(value).__name__)


def _not_an_object(body: Any) -> str:
    """The 400 message for a request body that parsed to something other than a JSON object."""
    if isinstance(body, (bytes, bytearray)):  # a body FastAPI did not parse (no JSON content type)
        return "the request body was not read as JSON: send a JSON object with 'Content-Type: application/json'"
    return f"the request body must be a JSON object, got {_json_kind(body)}"


def _unreadable_body(cause: BaseException | None) -> str | None:
    """The 400 message for a body the JSON reader raised `cause` on (other than malformed JSON), None if unknown."""
    if isinstance(cause, UnicodeDecodeError):
        return (f"the request body is not valid UTF-8: byte 0x{cause.object[cause.start]:02x} at position "
                f"{cause.start}; send the JSON encoded as UTF-8")
    if isinstance(cause, RecursionError):
        return "the JSON body nests arrays and objects too deeply to read; send a flatter body"
    return None


def _error_type(status: int) -> str:
    """The OpenAI-style error type of an HTTP status: the request's fault, or the server's side."""
    return {500: "server_error", 502: "bad_gateway", 503: "service_unavailable"}.get(
        status, "invalid_request_error" if status < 500 else "server_error")


def error_body(status: int, message: str, param: str | None = None, type_: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": status}}


def bearer_matches(header: str, api_key: str) -> bool:
    """Whether an Authorization header carries `api_key` as a bearer token: the scheme is case-insensitive
    (RFC 7235), the key is compared in constant time."""
    scheme, _, token = header.strip().partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), api_key.encode())


# ---- the app -------------------------------------------------------------------------------------
def create_app(loop: EngineLoop, codec: TextCodec | None, metrics: RuntimeMetrics, *, model_name: str = "pdlab",
               api_key: str | None = None, max_queue: int = 4096, max_context_len: int | None = None,
               extra_metrics: Callable[[], str] | None = None) -> FastAPI:
    """The FastAPI app over a started (or to-be-started) `EngineLoop` (or an object with its
    submit/abort/scheduler). extra_metrics: returns more Prometheus text to append to /metrics."""
    async def _auth(request: Request) -> None:
        # a dependency, not an HTTP middleware: BaseHTTPMiddleware hides client disconnects from handlers
        if api_key and request.url.path not in ("/health", "/metrics"):
            if not bearer_matches(request.headers.get("authorization", ""), api_key):
                raise ApiError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                               type_="authentication_error")

    app = FastAPI(title="pdlab runtime", version="0.1.0", dependencies=[Depends(_auth)])
    app.add_middleware(EchoRequestId)
    ctx_len = max_context_len or loop.scheduler.max_context_len
    vocab = getattr(getattr(loop.scheduler, "engine", None), "vocab_size", None)
    inflight: dict[str, Any] = {}

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        errs = exc.errors()
        first = errs[0] if errs else {"loc": (), "msg": "invalid request"}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        msg = first.get("msg", "invalid request")
        kind = first.get("type")
        u = _union_field(loc)
        if kind == "json_invalid":  # loc holds the character offset, which is no field
            where = f" at character {loc[0]}" if loc else ""
            msg, loc = f"malformed JSON body{where}: {first.get('ctx', {}).get('error', msg)}", []
        elif not loc and kind == "missing":
            msg = "the request body is empty; send a JSON object (Content-Type: application/json)"
        elif not loc and kind in ("model_attributes_type", "dict_type"):
            msg = _not_an_object(first.get("input"))
        elif u is not None:  # one problem however many of the field's types pydantic tried
            loc = loc[:u + 1]
            errs = [first] + [e for e in errs if [str(x) for x in e.get("loc", ()) if x != "body"][:u + 1] != loc]
            msg = f"{'.'.join(loc)}: {_UNION_FIELDS[loc[-1]]}"
        elif kind == "extra_forbidden" and len(loc) == 1 and loc[0] in _UNSUPPORTED_FIELDS:
            msg = f"{loc[0]} is not supported by this server ({_UNSUPPORTED_FIELDS[loc[0]]}); remove it"
        elif kind == "extra_forbidden":
            near = _near_field(_body_model(request.url.path), loc)
            hint = f"did you mean {'.'.join([*loc[:-1], near])!r}? Else remove it" if near else "remove it"
            msg = f"unknown field {'.'.join(loc)!r}; {hint} (this server rejects unknown fields)"
        elif len(loc) == 1 and loc[0] in _ONE_VALUE_FIELDS and kind in _RANGE_ERRORS:
            msg = _ONE_VALUE_FIELDS[loc[0]].format(value=first.get("input"))
        elif loc:
            msg = f"{'.'.join(loc)}: {msg}"
            if kind in _TYPE_ERRORS and "input" in first:  # strict types: say what came instead
                msg += f", got {_json_kind(first['input'])}"
        if len(errs) > 1:
            msg += f" (and {len(errs) - 1} more problem(s))"
        return JSONResponse(error_body(400, msg, ".".join(loc) or None), status_code=400)

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError):
        return JSONResponse(error_body(exc.status, exc.message, exc.param, exc.type), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        msg = str(exc.detail)
        if exc.status_code == 400 and _unreadable_body(exc.__cause__):  # FastAPI's "error parsing the body"
            msg = _unreadable_body(exc.__cause__)
        elif exc.status_code == 404 and msg == "Not Found":  # an unknown route, not one of our own 404s
            msg = (f"no route {request.url.path}; this server serves POST /v1/completions, /v1/chat/completions, "
                   "/generate, /flush_cache and GET /v1/models, /metrics, GET or HEAD /health")
        elif exc.status_code == 405:
            allowed = (exc.headers or {}).get("Allow", "")
            msg = f"method {request.method} not allowed on {request.url.path}" + (f"; use {allowed}" if allowed else "")
        return JSONResponse(error_body(exc.status_code, msg, None,
                                       "not_found_error" if exc.status_code == 404 else "invalid_request_error"),
                            status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception):
        log.exception("unhandled error in a request handler")
        return JSONResponse(error_body(500, f"internal error: {type(exc).__name__}: {exc}", None, "server_error"),
                            status_code=500)

    @app.api_route("/health", methods=["GET", "HEAD"])  # load balancers probe with HEAD (the server sends no body)
    async def health():
        alive = loop._thread is None or loop._thread.is_alive()
        return JSONResponse({"status": "ok" if alive else "engine loop stopped"}, status_code=200 if alive else 503)

    @app.get("/metrics")
    async def metrics_text():
        text = metrics.render(loop.scheduler.stats()) + (extra_metrics() if extra_metrics is not None else "")
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    @app.post("/flush_cache")
    async def flush_cache():
        """Evict every prefix-cache page no running request reads (a cold cache, e.g. before a measurement)."""
        if getattr(loop.scheduler, "prefix_cache", None) is None:
            raise ApiError(400, "this server keeps no prefix cache; start it with --enable-prefix-caching")
        aloop, done = asyncio.get_running_loop(), asyncio.get_running_loop().create_future()

        def clear(sched) -> None:  # in the engine loop's thread, between steps
            freed, kept = sched.prefix_cache.clear(), sched.prefix_cache.num_pages
            aloop.call_soon_threadsafe(lambda: done.done() or done.set_result((freed, kept)))

        loop.call(clear)
        try:
            freed, kept = await asyncio.wait_for(done, timeout=30.0)
        except asyncio.TimeoutError:
            raise ApiError(503, "the engine loop did not take the flush within 30 s", type_="server_error") from None
        return {"flushed_pages": freed, "cached_pages": kept}

    @app.get("/v1/models")
    async def models():
        card = {"id": model_name, "object": "model", "created": int(time.time()), "owned_by": "pdlab",
                "max_model_len": ctx_len}
        if vocab is not None:  # the range of prompt token ids (load generators draw random prompts in it)
            card["vocab_size"] = int(vocab)
        return {"object": "list", "data": [card]}

    # ---- shared machinery ------------------------------------------------------------------------
    def _start(ids: list[int], sp: SamplingParams, rid: str | None = None,
               fields: Callable[[str], str] = lambda name: name) -> tuple[Req, asyncio.Queue]:
        """Queue a request. fields: the request's own name of a `SamplingParams` / `Req` field ("prompt",
        "max_tokens", ...) that a 400 names in `param`."""
        if app.state.draining:
            raise ApiError(503, "server is shutting down: it takes no new requests; retry on another server",
                           type_="service_unavailable")
        if len(inflight) >= max_queue:
            raise ApiError(503, f"server busy: {len(inflight)} requests in flight (max_queue {max_queue}); retry later",
                           type_="server_busy")
        if sp.max_tokens is None:
            sp.max_tokens = max(1, ctx_len - len(ids))
        try:
            sp.validate()
            req = Req(ids, sp, rid=rid or f"req-{uuid.uuid4().hex[:16]}")
            if req.rid in inflight:
                raise ValueError(f"request id {req.rid!r} is already in flight; use a unique rid")
            q: asyncio.Queue = asyncio.Queue()
            aloop = asyncio.get_running_loop()
            loop.submit(req, lambda out: aloop.call_soon_threadsafe(q.put_nowait, out))
        except ValueError as exc:
            param = getattr(exc, "param", None)
            raise ApiError(400, str(exc), param=fields(param) if param else None) from None
        inflight[req.rid] = req
        return req, q

    async def _outputs(req: Req, q: asyncio.Queue) -> AsyncIterator[StepOutput]:
        try:
            while True:
                out: StepOutput = await q.get()
                yield out
                if out.finished:
                    return
        finally:
            if inflight.pop(req.rid, None) is not None and not req.finished:
                loop.abort(req.rid, "client disconnected")

    async def _collect(req: Req, q: asyncio.Queue, request: Request) -> tuple[list[StepOutput], StepOutput]:
        outs: list[StepOutput] = []
        gen = _outputs(req, q)
        watch = asyncio.ensure_future(_disconnected(request))
        nxt: asyncio.Future = watch
        try:
            while True:
                nxt = asyncio.ensure_future(gen.__anext__())
                await asyncio.wait({nxt, watch}, return_when=asyncio.FIRST_COMPLETED)
                if not nxt.done():  # the client went away first
                    nxt.cancel()
                    raise ApiError(499, "client disconnected")
                try:
                    out = nxt.result()
                except StopAsyncIteration:
                    break
                outs.append(out)
                if out.finished:
                    break
        finally:
            watch.cancel()
            if not nxt.done():  # cancelled while waiting (the server stopping): the generator is still running
                nxt.cancel()
                with contextlib.suppress(BaseException):
                    await nxt
            await gen.aclose()
        final = outs[-1]
        if final.error or final.finish_reason in (FinishReason.ERROR, FinishReason.ABORT):
            # a failure, also after the first token (a failed step, the server stopping): the client gets the
            # cause's status, as a stream gets it in its error event, never a 200 with part of an answer
            why = final.error or "the request was aborted"
            if final.completion_tokens:
                why += f" (after {final.completion_tokens} generated tokens; the partial output is dropped)"
            raise ApiError(final.error_status, why, type_=_error_type(final.error_status))
        return outs, final

    def _usage(final: StepOutput) -> dict:
        usage = {"prompt_tokens": final.prompt_tokens, "completion_tokens": final.completion_tokens,
                 "total_tokens": final.prompt_tokens + final.completion_tokens}
        if final.cached_tokens is not None:  # a server with a prefix cache: OpenAI's field for it
            usage["prompt_tokens_details"] = {"cached_tokens": final.cached_tokens}
        return usage

    def _sse(obj: Any) -> str:
        return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"

    def _openai_stream(req: Req, q: asyncio.Queue, head: dict, choice: Callable[[StepOutput], dict],
                       include_usage: bool) -> StreamingResponse:
        """SSE of one request: a chunk per output that carries text, tokens or the finish, an error
        chunk if it fails, the usage chunk when asked, then [DONE]."""

        async def events():
            final = None
            async for out in _outputs(req, q):
                final = out
                if out.error:
                    yield _sse(error_body(out.error_status, out.error, type_=_error_type(out.error_status)))
                    continue  # an error output is the request's last one
                if out.text or out.finished or out.token_ids:
                    yield _sse({**head, "choices": [choice(out)]})
            if include_usage and final is not None:
                yield _sse({**head, "choices": [], "usage": _usage(final)})
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    def _finish_reason(out: StepOutput) -> str | None:
        return out.finish_reason.value if out.finished and out.finish_reason else None


    @functools.lru_cache(maxsize=1 << 16)
    def _tok_text(t: int) -> tuple[str, bytes]:
        """A token's text in logprobs and its own bytes. A token that is part of a character (alone it decodes to
        U+FFFD) reads "bytes:\\xNN..." as in OpenAI's API, so that every token has a text of its own (they are the
        keys of /v1/completions' top_logprobs)."""
        if codec is None:
            return str(t), str(t).encode()
        text = codec.decode([t], False)
        raw = codec.token_bytes(t) if "\ufffd" in text else None
        if raw is None:
            return text, text.encode()
        try:
            return raw.decode("utf-8"), raw
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), raw

    def _tok_str(t: int) -> str:
        return _tok_text(t)[0]

    def _tok_bytes(t: int) -> list[int]:
        return list(_tok_text(t)[1])

    def _params(body: _SamplingFields, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        return SamplingParams(temperature=body.temperature, top_k=body.top_k, top_p=body.top_p, min_p=body.min_p,
                              seed=body.seed, max_tokens=max_tokens, stop=_stop_strings(body.stop, "stop"),
                              stop_token_ids=list(body.stop_token_ids or []), ignore_eos=body.ignore_eos,
                              logprobs=logprobs, skip_special_tokens=body.skip_special_tokens)

    def _check_model(model: str | None) -> None:
        """ApiError 404 for a `model` this server does not serve (absent or empty: the served one)."""
        if model and model != model_name:
            raise ApiError(404, f"the model {model!r} does not exist on this server; it serves {model_name!r} "
                           f"(GET /v1/models): send \"model\": {json.dumps(model_name)} or leave model out",
                           "model", "not_found_error")

    def _check_stream_options(body: _SamplingFields) -> bool:
        """include_usage of a stream; ApiError 400 for stream_options on a request that does not stream."""
        if body.stream_options is not None and not body.stream:
            raise ApiError(400, "stream_options is only allowed with stream=true; remove it or set stream to true",
                           "stream_options")
        return bool(body.stream_options and body.stream_options.include_usage)

    def _check_chars(chars: int, param: str) -> None:
        """ApiError 400 for text of `chars` characters that no tokenization fits into the context: it is refused
        before tokenizing (megabytes take seconds, holding the GIL, so every other request waits)."""
        limit = codec.max_text_chars(ctx_len) if codec is not None else None
        if limit is not None and chars > limit:
            raise ApiError(400, f"{param} has {chars} characters: too long for the context of {ctx_len} tokens "
                           f"(prompt + output) however it is tokenized ({ctx_len} tokens of this tokenizer hold at "
                           f"most {limit} characters); shorten it", param)

    def _encode(text: str, param: str = "prompt") -> list[int]:
        if codec is None:
            raise ApiError(400, "this server has no tokenizer: send token ids instead of text", param)
        _check_chars(len(text), param)
        return codec.encode(_unicode(text, param))

    # ---- /v1/completions ---------------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        _check_model(body.model)
        include_usage = _check_stream_options(body)
        if body.echo:
            raise ApiError(400, "echo is not supported; send echo=false", "echo")
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise ApiError(400, "batched prompts are not supported: send one prompt per request "
                               f"(got {len(prompt)})", "prompt")
            prompt = prompt[0]
        ids = _encode(prompt) if isinstance(prompt, str) else list(prompt)
        req, q = _start(ids, _params(body, body.max_tokens or 16, body.logprobs))
        cid, created = f"cmpl-{req.rid}", int(time.time())
        head = {"id": cid, "object": "text_completion", "created": created, "model": model_name}

        def lp_obj(outs: list[StepOutput]):
            if body.logprobs is None:
                return None
            toks, lps = [], []
            for o in outs:
                for t, lp in zip(o.token_ids, o.logprobs):
                    toks.append(t)
                    lps.append(lp)
            return {"tokens": [_tok_str(t) for t in toks], "token_logprobs": [lp[0] for lp in lps],
                    # the sampled token's too, as OpenAI's (up to logprobs + 1 entries)
                    "top_logprobs": [{**{_tok_str(i): v for i, v in lp[1]}, _tok_str(t): lp[0]}
                                     for t, lp in zip(toks, lps)]}

        if body.stream:

            return _openai_stream(req, q, head, lambda out: {"index": 0, "text": out.text, "logprobs": lp_obj([out]),
                                                             "finish_reason": _finish_reason(out)}, include_usage)
        outs, final = await _collect(req, q, request)
        return {**head, "choices": [{"index": 0, "text": "".join(o.text for o in outs), "logprobs": lp_obj(outs),
                                     "finish_reason": final.finish_reason.value if final.finish_reason else None}],
                "usage": _usage(final)}

    # ---- /v1/chat/completions ----------------------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        _check_model(body.model)
        include_usage = _check_stream_options(body)
        if codec is None:
            raise ApiError(400, "this server has no tokenizer, so chat is unavailable; use /v1/completions with ids")
        _check_chars(sum(len(m.content) if isinstance(m.content, str) else sum(len(p.text) for p in m.content)
                         for m in body.messages), "messages")
        msgs = [{"role": m.role, "content": _unicode(m.content if isinstance(m.content, str)
                                                     else "".join(p.text for p in m.content), f"messages[{i}].content"),
                 **({"name": _unicode(m.name, f"messages[{i}].name")} if m.name is not None else {})}
                for i, m in enumerate(body.messages)]
        try:
            ids = codec.chat_prompt(msgs)
        except Exception as exc:  # template errors (unknown role, ...) are the request's fault
            raise ApiError(400, f"cannot apply the chat template to these messages: {exc}", "messages") from None
        if body.top_logprobs is not None and not body.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs=true", "top_logprobs")
        nlp = (body.top_logprobs or 0) if body.logprobs else None
        names = {"prompt": "messages", "logprobs": "top_logprobs",
                 "max_tokens": "max_completion_tokens" if body.max_completion_tokens else "max_tokens"}
        req, q = _start(ids, _params(body, body.max_completion_tokens or body.max_tokens, nlp),
                        fields=lambda name: names.get(name, name))
        cid, created = f"chatcmpl-{req.rid}", int(time.time())

        def lp_obj(outs: list[StepOutput]):
            if nlp is None:
                return None
            content = []
            for o in outs:
                for t, lp in zip(o.token_ids, o.logprobs):
                    content.append({"token": _tok_str(t), "logprob": lp[0], "bytes": _tok_bytes(t),
                                    "top_logprobs": [{"token": _tok_str(i), "logprob": v, "bytes": _tok_bytes(i)}
                                                     for i, v in lp[1]]})
            return {"content": content}

        if body.stream:
            head = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model_name}

            first = [True]

            def choice(out: StepOutput) -> dict:
                # the role rides on the first token's chunk, so chunk times are token times
                delta = {"role": "assistant", "content": out.text} if first[0] else {"content": out.text}
                first[0] = False
                return {"index": 0, "delta": delta, "logprobs": lp_obj([out]), "finish_reason": _finish_reason(out)}

            return _openai_stream(req, q, head, choice, include_usage)
        outs, final = await _collect(req, q, request)
        return {"id": cid, "object": "chat.completion", "created": created, "model": model_name,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(o.text for o in outs)},
                             "logprobs": lp_obj(outs),
                             "finish_reason": final.finish_reason.value if final.finish_reason else None}],
                "usage": _usage(final)}

    # ---- /generate (SGLang style) ------------------------------------------------------------------
    @app.post("/generate")
    async def generate(body: GenerateRequest, request: Request):
        if (body.text is None) == (body.input_ids is None):
            raise ApiError(400, "send exactly one of 'text' or 'input_ids'", "text")
        ids = _encode(body.text, "text") if body.text is not None else list(body.input_ids)
        if body.top_logprobs_num and not body.return_logprob:
            raise ApiError(400, "top_logprobs_num needs return_logprob=true", "top_logprobs_num")
        s = body.sampling_params
        sp = SamplingParams(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, min_p=s.min_p, seed=s.seed,
                            max_tokens=s.max_new_tokens, stop=_stop_strings(s.stop, "sampling_params.stop"),
                            stop_token_ids=list(s.stop_token_ids or []),
                            ignore_eos=s.ignore_eos, skip_special_tokens=s.skip_special_tokens,
                            logprobs=body.top_logprobs_num if body.return_logprob else None)
        rid = body.rid
        if rid is None:  # the client's X-Request-Id names the request as a `rid` would
            try:
                rid = request_id(request.headers)
            except ValueError as exc:
                raise ApiError(400, str(exc), "X-Request-Id") from None
        names = {"prompt": "text" if body.text is not None else "input_ids", "logprobs": "top_logprobs_num",
                 "max_tokens": "sampling_params.max_new_tokens"}
        req, q = _start(ids, sp, rid, fields=lambda name: names.get(name, f"sampling_params.{name}"))

        def meta(final: StepOutput | None, n: int) -> dict:
            # the client's id where it chose one: a disaggregated server runs the request under the router's transfer id
            m = {"id": rid or req.rid, "prompt_tokens": req.prompt_len, "completion_tokens": n,
                 "finish_reason": {"type": final.finish_reason.value} if final and final.finish_reason else None}
            if final is not None and final.cached_tokens is not None:
                m["cached_tokens"] = final.cached_tokens
            if body.return_logprob:
                m["output_token_logprobs"] = [[lp[0], t] for lp, t in zip(req.output_logprobs, req.output_ids)]
                if body.top_logprobs_num:  # per output token, the top [logprob, token id] pairs
                    m["output_top_logprobs"] = [[[v, i] for i, v in lp[1]] for lp in req.output_logprobs]
            return m

        if body.stream:
            async def events():
                text, ids_out = "", []
                async for out in _outputs(req, q):
                    if out.error:
                        yield _sse(error_body(out.error_status, out.error, type_=_error_type(out.error_status)))
                        continue  # an error output is the request's last one
                    text += out.text
                    ids_out += out.token_ids
                    yield _sse({"text": text, "output_ids": ids_out,
                                "meta_info": meta(out if out.finished else None, len(ids_out))})
                yield "data: [DONE]\n\n"
            return StreamingResponse(events(), media_type="text/event-stream")
        outs, final = await _collect(req, q, request)
        ids_out = [t for o in outs for t in o.token_ids]
        return {"text": "".join(o.text for o in outs), "output_ids": ids_out, "meta_info": meta(final, len(ids_out))}

    def abort_inflight(reason: str, status: int) -> None:
        """End every request in flight with `reason` (HTTP `status` for its client): the server is stopping."""
        for rid in list(inflight):
            loop.abort(rid, reason, status)

    app.state.loop = loop
    app.state.inflight = inflight
    app.state.draining = False  # set when the server stops: new requests get a 503
    app.state.abort_inflight = abort_inflight
    return app
