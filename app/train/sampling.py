"""Answers sampled from the current policy for online RL: the frozen base once, the LoRA adapter swapped in after
each optimizer step (only its weights travel: app/train/rollouts.py), decoded by the project's engine (app/engine/:
continuous batching, a prompt that answers share computed once; sliding windows and soft-capped logits as the model
has them), or by transformers' batched `generate` for a model whose attention the engine cannot run.

The policy reaches the engine one of two ways (rollout.policy, decided by the plan): `merged`, the adapter
merged into the sampler's own copy of the base at every sync (app/engine/merging.py: each step runs the base's
products alone), or `lora`, the adapter applied beside the base at every step (PEFT's layers).

A `Sampler` is what a rollout actor's engine holds (app/train/rollout_engine.py), and what the unit tests drive
in the trainer's own process. Each call is seeded by its caller and each answer by its place in the call, so a
resumed run samples the very answers an uninterrupted run would, however the answers are batched. With each
answer come the log-probabilities of its tokens under the policy that sampled it (the logits divided by the
temperature, as the loss takes them), which the trainer's own log-probabilities of the same tokens must match.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
from torch import nn

from app.config.rollout import RolloutSection, rollout_policy_of
from app.data.chat import pad_id
from app.engine.core import EngineCore, UnsupportedModel
from app.engine.merging import MergedAdapter
from app.engine.sampling import SamplingParams
from app.engine.sequence import Sequence, end_token_ids
from app.model.adapter import load_adapter_weights
from app.model.base import load_tokenizer
from app.model.build import build_lora_model

if TYPE_CHECKING:
    from app.config.schema import FinetuneConfig

POLICY = "default"  # the PEFT adapter the policy's weights are loaded into
PROMPT_TOKENS_PER_STEP = 2048  # the prompts an engine step computes beside the answers it decodes


@dataclass
class Completion:
    """One sampled answer: its tokens (up to and with the first end token), their log-probabilities, and
    whether it was cut off at the token limit before any end token."""

    ids: list[int]
    logps: list[float]
    truncated: bool


@dataclass
class Sampled:
    """What the rollout side answers a request with: the answers (None when it holds another adapter than the one
    asked for), the step and checksum of the adapter that sampled them, and how long it had waited for the request
    since its last answer (its idle time)."""

    completions: list[Completion] | None
    version: int
    checksum: str
    idle_seconds: float = 0.0
    restarts: int = 0  # rollout actors that Ray restarted before this answer (each counted in its first answer)


def answer_seed(seed: int, index: int) -> int:
    """The seed of the `index`-th answer of a request seeded `seed`."""
    return (seed * 1_000_033 + index * 7_919 + 1) % 2**63


def drawing(rollout: RolloutSection) -> SamplingParams:
    """How a rollout's tokens are drawn (the rollout section's settings), each one's log-probability under the
    distribution it was drawn from (over the temperature, before top-k and top-p), as the loss takes it."""
    return SamplingParams(max_tokens=rollout.max_completion_tokens, temperature=rollout.temperature,
                          top_p=rollout.top_p, top_k=rollout.top_k, logprobs=0, logprobs_of="sampled")


def seeded_answers(prompts: list[list[int]], rollout: RolloutSection, seed: int, first: int,
                   adapter: str | None = POLICY) -> list[Sequence]:
    """rollout.num_generations answers to each prompt (those of a prompt consecutive), the i-th seeded by its place
    `first + i` in the request, decoded through `adapter` (None: the base, the policy merged into it)."""
    rows = [prompt for prompt in prompts for _ in range(rollout.num_generations)]
    params = drawing(rollout)
    return [Sequence(row, params, adapter, seed=answer_seed(seed, first + i)) for i, row in enumerate(rows)]


def adapter_checksum(weights: dict[str, torch.Tensor]) -> str:
    """A digest of an adapter's weights (their names and fp32 values): what the trainer sent and what the rollout
    side received must agree."""
    digest = hashlib.sha256()
    for name in sorted(weights):
        digest.update(name.encode())
        digest.update(weights[name].detach().float().contiguous().cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


def checked_checksum(weights: dict[str, torch.Tensor], names: set[str], version: int, checksum: str | None) -> str:
    """The checksum of an adapter sent to a sampler whose adapter's weights are `names`; ValueError when they are
    not those weights, or not what the trainer sent (`checksum`)."""
    if set(weights) != names:
        missing = sorted(names - set(weights)) or sorted(set(weights) - names)
        raise ValueError(f"the adapter sent to the sampler does not match its model (first: {missing[0]})")
    received = adapter_checksum(weights)
    if checksum is not None and received != checksum:
        raise ValueError(f"the adapter of step {version} arrived changed (checksum {received}, sent {checksum}): "
                         "the sync is refused")
    return received


def engine_core(model: nn.Module, end_ids: list[int]) -> EngineCore | None:
    """The engine over the policy model, or None where its attention does not go through transformers'
    AttentionInterface (transformers' `generate` decodes those)."""
    try:
        return EngineCore(model, end_ids, max_step_tokens=PROMPT_TOKENS_PER_STEP)
    except UnsupportedModel as e:
        logging.getLogger(__name__).warning("rollouts decode with transformers' generate, one request at a time: %s",
                                            e)
        return None


class Sampler:
    def __init__(self, model: nn.Module, end_ids: list[int], pad_id: int, device: torch.device | str = "cpu",
                 policy: Literal["merged", "lora"] = "lora"):
        self.model, self.end_ids, self.pad_id, self.device = model.eval(), list(end_ids), pad_id, torch.device(device)
        self.names = {name for name, param in model.named_parameters() if param.requires_grad}
        for param in model.parameters():
            param.requires_grad_(False)
        self.version, self.checksum = -1, ""  # the optimizer step whose adapter it holds (-1: the starting one)
        self.idle_since = time.perf_counter()  # when its last request was answered
        self.core = engine_core(model, end_ids)
        # generate (no engine) runs PEFT's forward, which would add the adapter to a base it is merged into
        self.merged = MergedAdapter(model, POLICY) if policy == "merged" and self.core is not None else None
        self.adapter = None if self.merged is not None else POLICY  # what the answers name: the base holds it
        if self.merged is not None:
            self.merged.merge()

    @torch.no_grad()
    def load_adapter(self, weights: dict[str, torch.Tensor], version: int, checksum: str | None = None) -> None:
        """The trained adapter's weights, by parameter name (the trainer's FSDP2 model and this one are the same
        PEFT model, so the names are the same): every LoRA weight, or none; refused (ValueError) when they are not
        what the trainer sent (`checksum`). The held version is forgotten first: a copy that fails part-way leaves
        no adapter labelled as one it is not."""
        received = checked_checksum(weights, self.names, version, checksum)
        self.version, self.checksum = -2, ""  # none until the copy is whole
        parameters = dict(self.model.named_parameters())
        for name, value in weights.items():
            parameters[name].copy_(value.to(parameters[name].dtype))
        if self.merged is not None:
            self.merged.merge()
        self.version, self.checksum = version, received  # a load is no request: the idle time runs on

    def sample_with(self, prompts: list[list[int]], rollout: RolloutSection, seed: int, version: int) -> Sampled:
        """`sample` with the adapter of step `version`; no answers if it holds another."""
        idle = time.perf_counter() - self.idle_since
        if version != self.version:
            return Sampled(None, self.version, self.checksum, idle)
        completions = self.sample(prompts, rollout, seed)
        self.idle_since = time.perf_counter()
        return Sampled(completions, self.version, self.checksum, idle)

    def sample(self, prompts: list[list[int]], rollout: RolloutSection, seed: int, first: int = 0) -> list[Completion]:
        """rollout.num_generations answers to each prompt (those of one prompt consecutive), drawn as the rollout
        section says (temperature, top_p, top_k, max_completion_tokens); the i-th seeded by `seed` and its place
        `first + i` in the request these prompts are part of; at most rollout.batch_rows decoded at once."""
        if self.core is None:
            return self.generated([p for p in prompts for _ in range(rollout.num_generations)], rollout,
                                  answer_seed(seed, first))
        answers = seeded_answers(prompts, rollout, seed, first, self.adapter)
        self.core.max_rows = rollout.batch_rows or len(answers)
        for answer in answers:
            self.core.add(answer)
        while self.core.busy:
            self.core.step()
        failed = next((a.error for a in answers if a.error is not None), None)
        if failed is not None:
            raise RuntimeError(f"sampling failed: {failed}")
        return [self.completion(a) for a in answers]

    def completion(self, answer: Sequence) -> Completion:
        return Completion(answer.ids, [entry.logprob for entry in answer.logprobs], truncated=not answer.ended_by_token)

    @torch.no_grad()
    def generated(self, rows: list[list[int]], rollout: RolloutSection, seed: int) -> list[Completion]:
        """The answers of transformers' `generate`, in one static batch seeded once."""
        width = max(len(row) for row in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, row in enumerate(rows):
            ids[i, width - len(row):], mask[i, width - len(row):] = torch.tensor(row), 1
        torch.manual_seed(seed)
        out = self.model.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device), do_sample=True,
                                  temperature=rollout.temperature, top_p=rollout.top_p, top_k=rollout.top_k,
                                  max_new_tokens=rollout.max_completion_tokens, eos_token_id=self.end_ids,
                                  pad_token_id=self.pad_id, output_logits=True, return_dict_in_generate=True)
        new = out.sequences[:, width:].cpu()
        # the logits before top_p/top_k, over the temperature: the policy's log-probabilities, as the trainer's (TRL's)
        logits = torch.stack(out.logits, dim=1).float().cpu() / rollout.temperature  # [rows, new tokens, vocabulary]
        logps = torch.log_softmax(logits, dim=-1).gather(-1, new[..., None])[..., 0]
        return [self.generated_completion(row, row_logps) for row, row_logps in zip(new, logps)]

    def generated_completion(self, tokens: torch.Tensor, logps: torch.Tensor) -> Completion:
        ended = torch.isin(tokens, torch.tensor(self.end_ids)).nonzero()
        length = int(ended[0, 0]) + 1 if len(ended) else len(tokens)
        return Completion(tokens[:length].tolist(), logps[:length].tolist(), truncated=not len(ended))


def build_sampler(cfg: FinetuneConfig, device: torch.device | str = "cpu",
                  init_adapter: dict[str, torch.Tensor] | None = None) -> Sampler:
    """The policy as a sampler: the whole base on `device` (its `auto` dtype resolved for that device), the LoRA
    adapter from the seed or from model.init_adapter's weights, until the trainer sends its own."""
    device = torch.device(device)
    model = build_lora_model(cfg.model, cfg.lora, cfg.train.seed, device, checkpointed=False)  # auto dtype: device's
    if init_adapter is not None:
        load_adapter_weights(model, init_adapter)
    tokenizer = load_tokenizer(cfg.model, cfg.data.chat_template)
    return Sampler(model, end_token_ids(model.generation_config, tokenizer), pad_id(tokenizer), device,
                   rollout_policy_of(cfg.model, cfg.lora, cfg.rollout, "transformers")[0])
