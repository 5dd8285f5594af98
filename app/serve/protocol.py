"""The OpenAI chat-completions request as served here, and OpenAI-style error answers.

Every field a client may send is either honoured or refused by name: unknown fields are refused
(`extra="forbid"`), and fields kept for compatibility (penalties, logprobs) are accepted only at their
neutral values. A refusal is `{"error": {"message", "type", "param", "code"}}` with status 400.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from app.serve.encoder import ROLES


class ApiError(Exception):
    """A request the server refuses: status, one-line message, the field (`param`) and a code."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def validation_error(errors: list[dict]) -> ApiError:
    """FastAPI's (pydantic's) list of errors as one 400 that names the first bad field."""
    first = errors[0]
    path = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return ApiError(400, f"the body is not valid JSON ({first.get('msg', '')})", None, "invalid_json")
    if first.get("type") == "extra_forbidden":
        return ApiError(400, f"{'.'.join(path)}: this server does not support the field",
                        ".".join(path), "unsupported_parameter")
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    param = ".".join(path) or None
    return ApiError(400, f"{param}: {message}" if param else message, param, "invalid_value")


MAX_STOP_CHARS = 512  # a stop is looked for after every token: its length bounds that work


def _unicode(text: str) -> str:
    """Text a tokenizer can encode: JSON allows lone surrogates (\\ud800), which UTF-8 cannot hold."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"not valid Unicode text (a lone surrogate at character {e.start})") from None
    return text


Text = Annotated[str, AfterValidator(_unicode)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Message(_Strict):
    role: Literal[ROLES]  # the roles the chat template is written for
    content: Text
    name: Text | None = None  # OpenAI's participant name: accepted, not shown to the model


class StreamOptions(_Strict):
    include_usage: bool = False


class ChatRequest(_Strict):
    model: str
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # the newer name of max_tokens
    temperature: float = Field(0.0, ge=0.0, le=2.0)  # greedy unless asked (OpenAI: 1)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = 1
    stop: str | list[str] | None = Field(None, validate_default=True)
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)  # what torch's generator takes
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # an end-user id for the caller's records: accepted, unused
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: bool = False

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError("only n=1 is supported (one choice per request)")
        return n

    @field_validator("stop")
    @classmethod
    def _stops(cls, stop: str | list[str] | None) -> list[str]:
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if len(stops) > 4 or not all(stops):
            raise ValueError("at most 4 stop sequences, none empty")
        if max(map(len, stops), default=0) > MAX_STOP_CHARS:
            raise ValueError(f"each stop sequence is at most {MAX_STOP_CHARS} characters")
        return [_unicode(stop) for stop in stops]

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, value: float) -> float:
        if value != 0:
            raise ValueError("penalties are not supported (only 0)")
        return value

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, value: bool) -> bool:
        if value:
            raise ValueError("logprobs are not supported")
        return value

    @model_validator(mode="after")
    def _one_limit(self) -> ChatRequest:
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise ValueError("max_tokens and max_completion_tokens disagree: give one")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream: true")
        return self

    @property
    def limit(self) -> int | None:
        return self.max_tokens if self.max_tokens is not None else self.max_completion_tokens

    @property
    def sampling(self) -> tuple:
        """What must be equal for two requests to share one generate call: greedy, or the sampling
        settings (a seeded one samples alone: the engine's rule, Job.seeded)."""
        if self.temperature == 0:
            return ("greedy",)
        return ("sample", self.temperature, self.top_p)
