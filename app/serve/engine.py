"""The serving engines behind the API, one interface: `submit` a job, `load_adapter` a new one under a name,
`retire` a name once its replacement answers, `broken` when the engine died.

`TransformersEngine` is the project's own engine (app/engine/): continuous batching over the base and every
adapter loaded into it with PEFT (sequences of different adapters share each step), a job's events sent from the
engine's thread as its text comes. The vLLM engine (app/serve/vllm_engine.py) implements the same interface.
"""

from __future__ import annotations

import functools
from typing import Protocol

import torch

from app.engine.core import EngineCore
from app.engine.engine import Engine
from app.engine.sequence import Sequence, end_token_ids
from app.engine.text import TextStream
from app.model.adapter import peft_on_transformers_5
from app.serve.jobs import Job


class ServingEngine(Protocol):
    name: str

    def submit(self, job: Job) -> None: ...

    def load_adapter(self, name: str, folder: str) -> None:
        """The adapter in `folder` answers `name` from now on (blocking until it can)."""

    def retire(self, name: str) -> None:
        """`name` is asked for no more: freed once its requests have ended."""

    def close(self) -> None: ...

    @property
    def broken(self) -> str | None: ...


def heard(job: Job, seq: Sequence, done: bool) -> None:
    """A step's news of `seq` as the job's events (on the engine's thread)."""
    if seq.error is not None:
        job.emit("error", f"generation failed: {seq.error.split(':')[0]}")
        return
    if seq.prompt_logprobs is not None:
        job.prompt_logprobs = seq.prompt_logprobs
    delta = seq.text.delta(final=done)
    if delta:
        job.emit("delta", delta, len(seq.logprobs))
    if done:
        job.emit("end", seq.finish, seq.generated)


class TransformersEngine:
    """This project's engine over a PEFT model holding the base and every adapter served."""

    name = "transformers"

    def __init__(self, model, tokenizer, max_rows: int = 64, max_step_tokens: int = 512,
                 cache_gb: float | None = None):
        self.model, self.tokenizer = model, tokenizer
        self.engine = Engine(EngineCore(model, end_token_ids(model.generation_config, tokenizer), max_rows=max_rows,
                                        max_step_tokens=max_step_tokens, cache_gb=cache_gb), name="serve-engine")

    @property
    def steps(self) -> int:
        return self.engine.steps

    @property
    def broken(self) -> str | None:
        return None if self.engine.broken is None else repr(self.engine.broken)

    def submit(self, job: Job) -> None:
        seq = Sequence(job.prompt, job.params, job.adapter, job.seed, TextStream(self.tokenizer, tuple(job.stops)),
                       listener=functools.partial(heard, job), cancelled=job.cancelled)
        job.logprobs_of = seq.logprobs  # appended by the engine's thread, read up to what each event says
        self.engine.submit(seq)

    def close(self) -> None:
        """Nothing to stop: the engine's thread ends with the process."""

    def load_adapter(self, name: str, folder: str) -> None:
        model = self.model

        def load() -> None:
            with peft_on_transformers_5():
                model.load_adapter(folder, adapter_name=name)
            in_model_dtype(model.eval())

        self.engine.between_steps(load).result()

    def retire(self, name: str) -> None:
        self.engine.retire(name, lambda: self.model.delete_adapter(name))


def in_model_dtype(model) -> None:
    """Every adapter's LoRA weights in the base's dtype (PEFT loads them in fp32: one dtype per product), frozen."""
    dtype = next(p for n, p in model.named_parameters() if "lora_" not in n).dtype
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.requires_grad_(False)
                param.data = param.data.to(dtype)
