"""The OpenAI-compatible HTTP API over an `Engine`, as a plain FastAPI app (Ray Serve mounts it; tests
drive it directly).

POST /v1/chat/completions, POST /v1/completions (text or token-id prompts, `echo`, `logprobs`: what
lm-evaluation-harness's `local-completions` sends) and GET /v1/models. With an API key (its sha256 given)
every request needs `Authorization: Bearer <key>` (401 otherwise); a body over `max_body_bytes` is refused
(413). Requests are checked before any token is generated (400, OpenAI's error shape, naming the field).
`stream: true` answers with server-sent events of chunk objects ending with `data: [DONE]`; every
non-streamed answer carries `usage`. Log-probabilities (app/engine/sampling.py) come on request. A client
that goes away (or a request timeout) stops its row of the batch at the next token.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from jinja2 import TemplateError
from starlette.exceptions import HTTPException

from app.errors import first_line
from app.serve.answers import TokenText, answer, chat_logprobs, completion_logprobs, stream, usage
from app.serve.encoder import PromptEncoder
from app.serve.engines import Engines
from app.serve.jobs import Job
from app.serve.protocol import ApiError, ChatRequest, CompletionRequest, validation_error


@dataclass
class Served:
    """What the API answers for: the engines, the model names, the context length and vocabulary, the default
    limit."""

    engines: Engines
    base_name: str
    adapters: list[str]
    context: int
    vocabulary: int
    max_new_tokens: int = 64
    routes: dict[str, str] = field(default_factory=dict)  # a served name -> the adapter answering it now
    labels: dict[str, str] = field(default_factory=dict)  # an adapter -> what it is (models:/NAME/VERSION)
    reload: Callable[[], dict] | None = None  # moves names that follow an alias to its version now

    @property
    def names(self) -> list[str]:
        return [self.base_name, *self.adapters]

    def submit(self, job: Job) -> None:
        self.engines.of(job.adapter).submit(job)

    def adapter(self, model: str) -> str | None:
        """The adapter a request's `model` names (None: the base alone), or 404."""
        if model not in self.names:
            raise ApiError(404, f"model {model!r} is not served; GET /v1/models lists them", "model", "model_not_found")
        return None if model == self.base_name else self.routes.get(model, model)

    def label(self, adapter: str | None) -> str:
        """What answers a job: the registered version or folder behind its adapter, or the base's name."""
        return self.base_name if adapter is None else self.labels.get(adapter, adapter)

    def room(self, prompt: list[int], param: str) -> int:
        """The tokens the context leaves after `prompt`, or 400 when it leaves none to read it in."""
        if len(prompt) > self.context:
            raise ApiError(400, f"{param}: the prompt is {len(prompt)} tokens; this model's context is {self.context}",
                           param, "context_length_exceeded")
        return self.context - len(prompt)


def context_length(config, tokenizer) -> int:
    """The positions the model can attend to: its config's, or the tokenizer's if that is smaller."""
    config = getattr(config, "text_config", None) or config
    limits = [getattr(config, "max_position_embeddings", None), getattr(tokenizer, "model_max_length", None)]
    return min(n for n in limits if isinstance(n, int) and n > 0)


def vocabulary_size(config) -> int:
    """Token ids the model's embedding has rows for."""
    return (getattr(config, "text_config", None) or config).vocab_size


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
    api = FastAPI(title="ray-lora-fsdp completions")
    encoder, text = PromptEncoder(tokenizer), TokenText(tokenizer)

    @api.exception_handler(ApiError)
    async def _refused(_, error: ApiError):
        return JSONResponse(error.body(), status_code=error.status)

    @api.exception_handler(RequestValidationError)
    async def _invalid(_, error: RequestValidationError):
        return await _refused(_, validation_error(error.errors()))

    @api.exception_handler(HTTPException)  # a route or method the API does not have: 404, 405, in OpenAI's shape
    async def _no_route(request, error: HTTPException):
        message = f"{request.method} {request.url.path}: {error.detail}; the API serves GET /v1/models, " \
                  "POST /v1/chat/completions and POST /v1/completions"
        return JSONResponse(ApiError(error.status_code, message, None, "not_found").body(),
                            status_code=error.status_code, headers=error.headers)

    @api.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": name, "object": "model", "owned_by": "ray-lora-fsdp"}
                                           for name in served.names]}

    @api.post("/v1/admin/reload")
    async def reload() -> dict:
        """Move every name that follows a registry alias to the version it names now (the server also polls)."""
        if served.reload is None:
            raise ApiError(404, "this server follows no registry alias (serve models:/NAME@ALIAS to follow one)", None,
                           "not_found")
        try:
            return {"adapters": await asyncio.to_thread(served.reload)}
        except Exception as e:  # the registry unreachable, a version on another base: the old one serves on
            raise ApiError(502, f"reload failed, the versions served are unchanged: {first_line(e, 300)}", None,
                           "reload_failed", "server_error") from None

    @api.post("/v1/chat/completions")
    async def chat_completions(request: ChatRequest):
        job = _chat_job(served, encoder, request)
        served.submit(job)
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": request.model,
                "system_fingerprint": served.label(job.adapter)}
        logprobs = (lambda entries: chat_logprobs(entries, text)) if job.logprobs is not None else (lambda _: None)
        if request.stream:
            def piece(delta: str, entries, finish):
                return {"delta": {"content": delta} if delta else {}, "logprobs": logprobs(entries),
                        "finish_reason": finish}
            opening = lambda: {"delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            return _events(job, {**head, "object": "chat.completion.chunk"}, request, piece, opening)
        content, finish, completion = await answer(job)
        return {**head, "object": "chat.completion",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                             "logprobs": logprobs(job.logprobs_of), "finish_reason": finish}],
                "usage": usage([job], completion)}

    @api.post("/v1/completions")
    async def completions(request: CompletionRequest):
        jobs = [_completion_job(served, tokenizer, request, prompt, i) for i, prompt in enumerate(request.prompts)]
        for job in jobs:
            served.submit(job)
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": request.model, "system_fingerprint": served.label(jobs[0].adapter)}
        if request.stream:
            return _completion_stream(jobs[0], head, request, text)
        try:
            answers = await asyncio.gather(*map(answer, jobs))
        finally:
            for job in jobs:
                job.cancel()
        choices = [_completion_choice(job, i, *answered, text) for i, (job, answered) in enumerate(zip(jobs, answers))]
        return {**head, "choices": choices, "usage": usage(jobs, sum(done[2] for done in answers))}

    return Gate(api, key_sha256, max_body_bytes)


def _chat_job(served: Served, encoder: PromptEncoder, request: ChatRequest) -> Job:
    """The request as a generation job, or an ApiError: everything is checked before it is queued."""
    adapter = served.adapter(request.model)
    try:
        prompt = encoder.encode([m.model_dump(include={"role", "content"}) for m in request.messages])
    except TemplateError as e:  # roles or an order the model's template refuses (Gemma: no system; Mistral: alternate)
        raise ApiError(400, f"messages: the model's chat template refuses them ({first_line(e, 200)})", "messages",
                       "invalid_messages") from None
    room = served.room(prompt, "messages")
    _check_limit(request.limit, room)
    return Job(prompt=prompt, adapter=adapter, max_tokens=request.limit or min(served.max_new_tokens, room),
               temperature=request.drawn_temperature, top_p=request.top_p, stops=request.stop, seed=request.seed,
               logprobs=request.alternatives)


def _completion_job(served: Served, tokenizer, request: CompletionRequest, prompt: str | list[int], i: int) -> Job:
    param = "prompt" if request.single else f"prompt.{i}"
    adapter = served.adapter(request.model)
    ids = tokenizer(prompt)["input_ids"] if isinstance(prompt, str) else prompt
    if not ids:
        raise ApiError(400, f"{param}: the prompt is empty", param, "invalid_value")
    if max(ids) >= served.vocabulary:
        raise ApiError(400, f"{param}: token id {max(ids)} is not in this model's vocabulary of {served.vocabulary}",
                       param, "invalid_value")
    room = served.room(ids, param)
    _check_limit(request.max_tokens, room)
    limit = request.max_tokens if request.max_tokens is not None else min(served.max_new_tokens, room)
    return Job(prompt=ids, adapter=adapter, max_tokens=limit, temperature=request.drawn_temperature,
               top_p=request.top_p, stops=request.stop, seed=request.seed, logprobs=request.logprobs, echo=request.echo)


def _check_limit(limit: int | None, room: int) -> None:
    if (limit is not None and limit > room) or (limit is None and room < 1):
        raise ApiError(400, f"max_tokens: {limit or 1} is more than the {room} tokens the context leaves after the "
                       "prompt", "max_tokens", "context_length_exceeded")


def _completion_choice(job: Job, index: int, completion: str, finish: str, _: int, text: TokenText) -> dict:
    shown = text.of_all(job.prompt) if job.echo else ""
    logprobs = None
    if job.logprobs is not None:
        logprobs = completion_logprobs((job.prompt_logprobs or []) + job.logprobs_of, text)
    return {"index": index, "text": shown + completion, "logprobs": logprobs, "finish_reason": finish}


def _completion_stream(job: Job, head: dict, request: CompletionRequest, text: TokenText) -> StreamingResponse:
    shown = text.of_all(job.prompt) if job.echo else ""
    offset = len(shown)
    logprobs = job.logprobs is not None

    def piece(delta: str, entries, finish) -> dict:
        nonlocal offset
        body = {"text": delta, "logprobs": completion_logprobs(entries, text, offset) if logprobs else None,
                "finish_reason": finish}
        offset += len(delta)
        return body

    def opening() -> dict:
        return {"text": shown, "finish_reason": None,
                "logprobs": completion_logprobs(job.prompt_logprobs or [], text) if logprobs and job.echo else None}

    return _events(job, head, request, piece, opening)


def _events(job: Job, head: dict, request, piece, opening: dict) -> StreamingResponse:
    include = bool(request.stream_options and request.stream_options.include_usage)
    return StreamingResponse(stream(job, head, include, piece, opening), media_type="text/event-stream")
