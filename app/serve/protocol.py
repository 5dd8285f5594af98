"""The OpenAI chat-completions request as served here, and OpenAI-style error answers.

Every field a client may send is either honoured or refused by name: unknown fields are refused
(`extra="forbid"`), and fields kept for compatibility (penalties, `n`, `best_of`) are accepted only at their
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
    named, said, _ = message.partition(": ")  # a rule across fields names the one it refuses first
    param = ".".join(path) or (named if said and named.isidentifier() else None)
    return ApiError(400, message if not path or not param else f"{param}: {message}", param, "invalid_value")


MAX_TOP_LOGPROBS = 20  # OpenAI's bound on the alternatives per token
MIN_SAMPLING_TEMPERATURE = 1e-4  # below: greedy, what it would sample anyway (logits / 5e-324 overflow to inf)
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


class _Generation(_Strict):
    """What chat and text completions share: sampling, stops, streaming, and the fields kept at neutral values."""

    model: str
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

    @model_validator(mode="after")
    def _stream_options_with_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed with stream: true")
        return self

    @property
    def drawn_temperature(self) -> float:
        """The temperature tokens are drawn at: 0 (greedy) below MIN_SAMPLING_TEMPERATURE."""
        return 0.0 if self.temperature < MIN_SAMPLING_TEMPERATURE else self.temperature


class ChatRequest(_Generation):
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # the newer name of max_tokens
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    @model_validator(mode="after")
    def _one_limit(self) -> ChatRequest:
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise ValueError("max_tokens and max_completion_tokens disagree: give one")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs: true")
        return self

    @property
    def limit(self) -> int | None:
        return self.max_tokens if self.max_tokens is not None else self.max_completion_tokens

    @property
    def alternatives(self) -> int | None:
        """Alternatives per token when log-probabilities are asked for, else None."""
        return (self.top_logprobs or 0) if self.logprobs else None


MAX_PROMPTS = 128  # prompts in one text-completions request (each is a row of the batches)
TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


class CompletionRequest(_Generation):
    """The (legacy) text completions request: what lm-evaluation-harness's `local-completions` sends. A prompt
    is text or token ids, one or a list (one choice each); `echo` with `logprobs` scores the prompt itself,
    and `max_tokens: 0` with `echo` scores it without generating."""

    prompt: Text | list[Text] | TokenIds | list[TokenIds]
    max_tokens: int | None = Field(None, ge=0)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    best_of: int = 1

    @field_validator("best_of")
    @classmethod
    def _one_candidate(cls, best_of: int) -> int:
        if best_of != 1:
            raise ValueError("only best_of=1 is supported")
        return best_of

    @field_validator("prompt")
    @classmethod
    def _some_prompts(cls, prompt):
        if isinstance(prompt, list) and not 1 <= len(prompt) <= MAX_PROMPTS:
            raise ValueError(f"1 to {MAX_PROMPTS} prompts per request")
        return prompt

    @model_validator(mode="after")
    def _scoring_needs_echo(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens: 0 generates nothing: it needs echo: true (to score the prompt)")
        if self.max_tokens == 0 and self.stream:
            raise ValueError("max_tokens: 0 (scoring only) cannot be streamed")
        if self.stream and not self.single:
            raise ValueError("prompt: a streamed request takes one prompt")
        return self

    @property
    def single(self) -> bool:
        """One prompt (text, or a list of token ids), not a list of them."""
        return isinstance(self.prompt, str) or isinstance(self.prompt[0], int)

    @property
    def prompts(self) -> list[str | list[int]]:
        return [self.prompt] if self.single else list(self.prompt)
