"""The OpenAI-compatible HTTP API over an `Engine`, as a plain FastAPI app (Ray Serve mounts it; tests
drive it directly).

POST /v1/chat/completions and GET /v1/models. With an API key (its sha256 given) every request needs
`Authorization: Bearer <key>` (401 otherwise); a body over `max_body_bytes` is refused (413). Requests
are checked before any token is generated (400, OpenAI's error shape, naming the field). `stream: true`
answers with server-sent events of `chat.completion.chunk` objects ending with `data: [DONE]`; every
non-streamed answer carries `usage`. A client that goes away (or a request timeout) stops its row of
the batch at the next token.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from jinja2 import TemplateError
from starlette.exceptions import HTTPException

from app.errors import first_line
from app.serve.encoder import PromptEncoder
from app.serve.engine import Engine, Job
from app.serve.protocol import ApiError, ChatRequest, validation_error


@dataclass
class Served:
    """What the API answers for: the engine, the model names, the context length, the default limit."""

    engine: Engine
    base_name: str
    adapters: list[str]
    context: int
    max_new_tokens: int = 64

    @property
    def names(self) -> list[str]:
        return [self.base_name, *self.adapters]


def context_length(model, tokenizer) -> int:
    """The positions the model can attend to: its config's, or the tokenizer's if that is smaller."""
    limits = [getattr(model.config, "max_position_embeddings", None), getattr(tokenizer, "model_max_length", None)]
    return min(n for n in limits if isinstance(n, int) and n > 0)


class Gate:
    """ASGI middleware: the API key, then the body size, before the app sees a request."""

    def __init__(self, app, key_sha256: str | None, max_body_bytes: int):
        self.app, self.key, self.max_body_bytes = app, key_sha256, max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.key is not None:
            scheme, _, given = headers.get(b"authorization", b"").partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(key_digest(given.strip()), self.key):
                error = ApiError(401, "a valid API key is required: Authorization: Bearer <key>", None,
                                 "invalid_api_key", "authentication_error")
                return await _send(send, error)
        body, more = b"", True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before sending its body
            body, more = body + message.get("body", b""), message.get("more_body", False)
            if len(body) > self.max_body_bytes:
                return await _send(send, ApiError(413, f"the request body exceeds {self.max_body_bytes} bytes",
                                                  None, "request_too_large"))
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()  # after the body: the disconnect, when it comes
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


async def _send(send, error: ApiError) -> None:
    payload = json.dumps(error.body()).encode()
    await send({"type": "http.response.start", "status": error.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload})


def key_digest(key: str | bytes) -> str:
    """What the server keeps of its API key: the sha256, so the key itself is never a deployment argument."""
    return hashlib.sha256(key.encode() if isinstance(key, str) else key).hexdigest()


def build_api(served: Served, tokenizer, key_sha256: str | None = None, max_body_bytes: int = 1 << 20) -> Gate:
    api = FastAPI(title="ray-lora-fsdp chat completions")
    encoder = PromptEncoder(tokenizer)

    @api.exception_handler(ApiError)
    async def _refused(_, error: ApiError):
        return JSONResponse(error.body(), status_code=error.status)

    @api.exception_handler(RequestValidationError)
    async def _invalid(_, error: RequestValidationError):
        return await _refused(_, validation_error(error.errors()))

    @api.exception_handler(HTTPException)  # a route or method the API does not have: 404, 405, in OpenAI's shape
    async def _no_route(request, error: HTTPException):
        message = f"{request.method} {request.url.path}: {error.detail}; the API serves GET /v1/models and " \
                  "POST /v1/chat/completions"
        return JSONResponse(ApiError(error.status_code, message, None, "not_found").body(),
                            status_code=error.status_code, headers=error.headers)

    @api.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": name, "object": "model", "owned_by": "ray-lora-fsdp"}
                                           for name in served.names]}

    @api.post("/v1/chat/completions")
    async def chat_completions(request: ChatRequest):
        job = _job(served, encoder, request)
        served.engine.submit(job)
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": request.model}
        if request.stream:
            usage = bool(request.stream_options and request.stream_options.include_usage)
            return StreamingResponse(_chunks(job, head, usage), media_type="text/event-stream")
        try:
            text, finish, completion = "", "length", 0
            async for event in _events(job):
                if event[0] == "delta":
                    text += event[1]
                else:
                    finish, completion = event[1], event[2]
        finally:
            job.cancelled.set()  # a no-op once finished; stops the row if this request was cancelled
        return {**head, "object": "chat.completion",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                             "finish_reason": finish}],
                "usage": _usage(job, completion)}

    return Gate(api, key_sha256, max_body_bytes)


def _job(served: Served, encoder: PromptEncoder, request: ChatRequest) -> Job:
    """The request as a generation job, or an ApiError: everything is checked before it is queued."""
    if request.model not in served.names:
        raise ApiError(404, f"model {request.model!r} is not served; GET /v1/models lists them", "model",
                       "model_not_found")
    try:
        prompt = encoder.encode([m.model_dump(include={"role", "content"}) for m in request.messages])
    except TemplateError as e:  # roles or an order the model's template refuses (Gemma: no system; Mistral: alternate)
        raise ApiError(400, f"messages: the model's chat template refuses them ({first_line(e, 200)})", "messages",
                       "invalid_messages") from None
    room = served.context - len(prompt)
    if room < 1:
        raise ApiError(400, f"messages: the prompt is {len(prompt)} tokens; this model's context is "
                       f"{served.context}", "messages", "context_length_exceeded")
    if request.limit is not None and request.limit > room:
        raise ApiError(400, f"max_tokens: {request.limit} is more than the {room} tokens the context leaves "
                       "after the prompt", "max_tokens", "context_length_exceeded")
    return Job(prompt=prompt, adapter=None if request.model == served.base_name else request.model,
               max_tokens=request.limit or min(served.max_new_tokens, room), sampling=request.sampling,
               stops=request.stop, seed=request.seed)


async def _events(job: Job) -> AsyncIterator[tuple]:
    while True:
        event = await job.events.get()
        if event[0] == "error":
            raise ApiError(500, event[1], None, "generation_failed", "server_error")
        yield event
        if event[0] == "end":
            return


def _usage(job: Job, completion: int) -> dict:
    return {"prompt_tokens": len(job.prompt), "completion_tokens": completion,
            "total_tokens": len(job.prompt) + completion}


async def _chunks(job: Job, head: dict, include_usage: bool) -> AsyncIterator[str]:
    def chunk(delta: dict | None, finish: str | None = None, **extra) -> str:
        choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
        return f"data: {json.dumps({**head, 'object': 'chat.completion.chunk', 'choices': choices, **extra})}\n\n"

    try:
        yield chunk({"role": "assistant", "content": ""})
        async for event in _events(job):
            if event[0] == "delta":
                yield chunk({"content": event[1]})
            else:
                yield chunk({}, event[1])
                if include_usage:  # OpenAI's last chunk: no choices, the usage
                    yield chunk(None, usage=_usage(job, event[2]))
        yield "data: [DONE]\n\n"
    except ApiError as error:  # the status line is sent already: the error goes in the stream
        yield f"data: {json.dumps(error.body())}\n\n"
    finally:
        job.cancelled.set()
