"""The batches of an online objective's step (GRPO, distillation): this rank's prompts, answers sampled by the
rollout side (with GRPO, scored by the reward functions: their advantages), as micro-batches of the trainer's rows.

At the first micro-batch of a step with no rollouts left, the stream gathers the adapter's full weights from the
FSDP2 shards (a collective: every rank is at the same step) and hands them to the rollout side, which swaps them
in (only the LoRA weights travel: a few MB, never the base); then it takes its next prompts, has `num_generations`
answers sampled to each (seeded by the run's seed, the step and the rank, so a resumed run samples the same),
scores them, and builds `global_batch_size / workers` rows of prompt + answer, the answer's tokens the labels.
With grpo.num_iterations > 1 the log-probabilities of the policy that sampled them are computed once, before
any update, and the rows serve that many optimizer steps; with grpo.beta the reference's are computed too.

Plain torch and Python: the rollout side (`Rollouts`) and the scorer are given: Ray actors and tasks in a job
(app/launch/rollout_group.py), a Sampler in this process in the unit tests.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from typing import Protocol

import numpy as np
import torch
import torch.distributed as dist

from app.config.grpo import reward_name
from app.data.chat import IGNORE_INDEX, pad_id
from app.data.stream import RankStream
from app.train.checkpoint import gather_trainable_state
from app.train.dpo import reference_switch
from app.train.grpo import group_advantages
from app.train.loss import sampled_token_logps
from app.train.rewards import combined
from app.train.sampling import Completion, Sampled, Sampler, adapter_checksum

# prompts, completions, completion ids, the records' other columns, the first answer's number -> [answers, functions]
Scorer = Callable[[list, list, list[list[int]], dict[str, list], int], np.ndarray]
NOT_COLUMNS = ("prompt", "completion", "completion_ids")  # what TRL does not pass on as a reward's column


class Rollouts(Protocol):
    """The rollout side: holds the policy's adapter, samples answers with it."""

    def sync(self, weights: dict[str, torch.Tensor], version: int, checksum: str) -> None:
        """Swap in the adapter's weights of optimizer step `version` (refused unless they match `checksum`). Called
        by every rank with the same weights; it returns once the rollout side holds them for every rank's next
        sample."""

    def submit(self, prompts: list[list[int]], seed: int, version: int) -> Callable[[], Sampled]:
        """num_generations answers to each prompt (those of a prompt consecutive), sampled with the adapter of step
        `version` after what was submitted before, while the caller goes on; calling the result waits for them."""


class LocalRollouts:
    """A Sampler in the trainer's process, one per rank (the unit tests; what a rollout actor wraps in a job):
    it samples at submit, so nothing overlaps."""

    def __init__(self, sampler: Sampler, rollout):
        self.sampler, self.rollout = sampler, rollout

    def sync(self, weights: dict[str, torch.Tensor], version: int, checksum: str) -> None:
        self.sampler.load_adapter(weights, version, checksum)

    def submit(self, prompts: list[list[int]], seed: int, version: int) -> Callable[[], Sampled]:
        sampled = self.sampler.sample_with(prompts, self.rollout, seed, version)
        return lambda: sampled


def sampling_seed(seed: int, step: int, rank: int) -> int:
    """The seed of one rank's rollouts after `step` optimizer steps: the same in every attempt of the run."""
    return ((seed * 1_000_003 + step) * 1_009 + rank) % 2**31


def as_answers(texts: list[str], records: list[dict]) -> list:
    """What a reward function gets as `completions`: the text for a plain prompt, an assistant message for a
    conversational one (TRL's shapes)."""
    return [[{"role": "assistant", "content": text}] if isinstance(record.get("prompt"), list) else text
            for text, record in zip(texts, records)]


def reward_columns(records: list[dict]) -> dict[str, list]:
    """Every field of the records but the prompt, as lists (one entry per answer)."""
    names = [name for name in records[0] if name not in NOT_COLUMNS] if records else []
    return {name: [record.get(name) for record in records] for name in names}


class RolloutStream:
    """Micro-batches of scored answers for the recipe's steps (an iterator, as the SFT stream is). `step_of()`
    says how many optimizer steps the run has taken.

    With rollout.max_staleness k > 0 the next k steps' prompts go to the rollout side right after each sync, with the
    adapter just sent, and are sampled there while this rank trains (`ahead`): a batch trains at most k steps after
    the adapter that sampled it. Every batch's adapter is checked: its step and checksum must be what this rank
    sent, else the run stops (a lost or corrupted sync); one sampled more than k steps ago is sampled again."""

    def __init__(self, prompts: RankStream, rollouts: Rollouts, scorer: Scorer, cfg, rank: int, tokenizer, model,
                 step_of: Callable[[], int]):
        self.prompts, self.rollouts, self.scorer, self.cfg = prompts, rollouts, scorer, cfg
        self.rank, self.tokenizer, self.model, self.step_of = rank, tokenizer, model, step_of
        self.device = prompts.device
        self.buffer: list[dict] = []  # micro-batches still to train, in order (num_iterations times each)
        self.synced_step: int | None = None  # the step whose adapter the rollout side holds (None: not yet sent)
        self.sent: dict[int, str] = {}  # step -> checksum of the adapters sent that a batch may still carry
        self.ahead: list[tuple[dict, int, Callable[[], Sampled]]] = []  # (prompts, adapter step, answers) to come
        self.figures: dict[str, float] = {}  # the last batch of rollouts', for the step that made it
        self.restarts = 0  # rollout actors Ray restarted, as their answers said, this attempt
        self.totals = {"completions": 0.0, "generated_tokens": 0.0, "idle_seconds": 0.0, "seconds": 0.0}
        self.warmed_up = False  # an attempt's first step (its warm-up) is left out of the totals
        # GRPO's (DAPO's) choice: a cut-off answer's reward says little; a teacher scores every token of any answer
        self.masks_truncated = scorer is not None and cfg.grpo.mask_truncated_completions

    @property
    def pass_index(self) -> int:
        return self.prompts.pass_index

    @property
    def rows_into_pass(self) -> int:
        return self.prompts.rows_into_pass

    def __iter__(self) -> Iterator[dict]:
        return self

    def __next__(self) -> dict:
        if not self.buffer:
            self.refill()
        return {k: v.to(self.device, non_blocking=True) for k, v in self.buffer.pop(0).items()}

    def take_figures(self, step_seconds: float) -> dict[str, float]:
        """The last batch of rollouts' figures (once), with the share of the step that made it spent syncing,
        waiting for answers and scoring, the trainer's idle share (syncing and waiting) and the rollout side's
        (waiting for this request); the run's totals count every step but an attempt's first (its warm-up)."""
        figures, self.figures = self.figures, {}
        if not figures or step_seconds <= 0:
            return figures
        idle = figures["rollout/sync_seconds"] + figures["rollout/generate_seconds"]
        if self.warmed_up:
            for key, value in (("completions", figures["rollout/completions"]), ("idle_seconds", idle),
                               ("generated_tokens", figures["rollout/generated_tokens"]), ("seconds", step_seconds)):
                self.totals[key] += value
        self.warmed_up = True
        return figures | {f"rollout/{part}_share": figures[f"rollout/{part}_seconds"] / step_seconds
                          for part in ("sync", "generate", "score")} | {
            "rollout/trainer_idle_share": idle / step_seconds,
            "rollout/actor_idle_share": min(figures["rollout/actor_idle_seconds"] / step_seconds, 1.0)}

    def run_figures(self) -> dict[str, float]:
        """The attempt's steady figures for the run's summary: completions and generated tokens per second (every
        rank's), and the share of the trainers' time spent waiting for the rollout side."""
        seconds, totals = self.totals["seconds"], self.totals
        if not seconds:
            return {}
        return {"completions_per_second": totals["completions"] / seconds,
                "generated_tokens_per_second": totals["generated_tokens"] / seconds,
                "trainer_idle_share": totals["idle_seconds"] / seconds}

    def state(self) -> dict:
        """What a checkpoint keeps of this rank's stream: the rollouts still to train (num_iterations > 1) and
        those sampled ahead (their prompts are past the data position), with the checksums of their adapters."""
        ahead = [(batch, version, handle()) for batch, version, handle in self.ahead]
        self.ahead = [(batch, version, lambda sampled=sampled: sampled) for batch, version, sampled in ahead]
        return {"buffer": self.buffer, "ahead": ahead, "sent": self.sent}

    def restore(self, state: dict) -> None:
        self.buffer = list(state.get("buffer", []))
        self.ahead = [(batch, version, lambda sampled=sampled: sampled) for batch, version, sampled in
                      state.get("ahead", [])]
        self.sent = dict(state.get("sent", {}))

    def refill(self) -> None:
        """The next batch of rollouts: the adapter synced, answers sampled (or taken from those sampled ahead),
        scored where rewards score them (GRPO: their advantages), rows built."""
        step, rollout = self.step_of(), self.cfg.rollout
        started = time.perf_counter()
        sync_bytes = self.sync(step)
        synced = time.perf_counter()
        batch, sampled = self.next_rollouts(step)
        completions = sampled.completions
        sampled_at = time.perf_counter()
        real = torch.as_tensor(batch["is_prompt"]).repeat_interleave(rollout.num_generations).bool()
        advantages, figures = self.scored(batch, completions, real)
        scored = time.perf_counter()
        sources = torch.as_tensor(batch["records"]).repeat_interleave(rollout.num_generations, 0) \
            if "records" in batch else None  # each answer counts for its prompt's source (data_share/<name>)
        micro_batches = self.micro_batches(prompt_lists(batch), completions, advantages, real, sources)
        self.buffer = [mb for _ in range(self.cfg.grpo.num_iterations) for mb in micro_batches]
        self.figures = figures | {
            "rollout/sync_bytes": sync_bytes, "rollout/sync_seconds": synced - started,
            "rollout/generate_seconds": sampled_at - synced, "rollout/score_seconds": scored - sampled_at,
            "rollout/prepare_seconds": time.perf_counter() - scored} | self.sampling_figures(step, sampled)

    def scored(self, batch: dict, completions: list[Completion], real: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """Each answer's advantage and the batch's figures: with a scorer (GRPO), its rewards compared within each
        prompt's group, and TRL's reward figures; without (distillation: the teacher scores every token in the
        loss), no advantage, the answers' lengths."""
        if self.scorer is None:
            return torch.zeros(len(completions)), completion_statistics(completions, real)
        grpo, group = self.cfg.grpo, self.cfg.rollout.num_generations
        records = [record for record in (json.loads(r) for r in batch["record"]) for _ in range(group)]
        per_function = self.score(records, completions)
        rewards = combined(per_function, grpo.weights)
        stats = reward_statistics(per_function, rewards, completions, real, grpo)
        advantages, zero_std = group_advantages(torch.as_tensor(rewards, dtype=torch.float64), group,
                                                grpo.scale_rewards, torch.tensor(stats["reward_std"],
                                                                                 dtype=torch.float64))
        return advantages.float(), stats | {"frac_reward_zero_std": frac_over_ranks(zero_std[real], real.sum())}

    def next_rollouts(self, step: int) -> tuple[dict, Sampled]:
        """This step's prompts and their answers, checked: those sampled ahead if no more than max_staleness steps
        old, else sampled now; then the next steps' prompts handed to the rollout side with the adapter of `step`."""
        if self.ahead:
            batch, version, handle = self.ahead.pop(0)
            if step - version > self.cfg.rollout.max_staleness:  # a resumed run that now allows less: sampled anew
                version, handle = step, self.submit(batch, step, step)
        else:
            batch = next(self.prompts)
            version, handle = step, self.submit(batch, step, step)
        while len(self.ahead) < self.cfg.rollout.max_staleness:
            later = next(self.prompts)
            self.ahead.append((later, step, self.submit(later, step + 1 + len(self.ahead), step)))
        return batch, self.verified(handle(), version, step)

    def submit(self, batch: dict, trains_at: int, version: int) -> Callable[[], Sampled]:
        """The batch's prompts to the rollout side, seeded by the step they train after (the same answers at any
        staleness but for the adapter)."""
        return self.rollouts.submit(prompt_lists(batch), sampling_seed(self.cfg.train.seed, trains_at, self.rank),
                                    version)

    def verified(self, sampled: Sampled, asked: int, step: int) -> Sampled:
        """The answers, if the adapter that sampled them is the one asked for, sent by this rank, and no more than
        max_staleness steps old; else the run stops."""
        self.restarts += sampled.restarts
        fresh = step - sampled.version <= self.cfg.rollout.max_staleness
        if (sampled.completions is None or not fresh or self.sent.get(sampled.version) != sampled.checksum
                or sampled.version != asked):
            raise RuntimeError(f"rank {self.rank}: the rollout side answered with the adapter of step "
                               f"{sampled.version} (checksum {sampled.checksum or 'none'}) where step {asked} "
                               f"(checksum {self.sent.get(asked)}) was asked for, at step {step}: a sync was lost "
                               "or changed; the run stops rather than train on these answers")
        return sampled

    def sampling_figures(self, step: int, sampled: Sampled) -> dict[str, float]:
        """The batch's staleness (mean and max over ranks), the rollout side's idle time before it, the restarts
        seen, and the completions and generated tokens of every rank."""
        figures = torch.tensor([step - sampled.version, step - sampled.version, sampled.idle_seconds,
                                self.restarts, len(sampled.completions),
                                sum(len(c.ids) for c in sampled.completions)], dtype=torch.float64)
        if dist.is_initialized():
            most = figures.clone()
            dist.all_reduce(figures)
            dist.all_reduce(most, op=dist.ReduceOp.MAX)
            figures[1] = most[1]
        ranks = dist.get_world_size() if dist.is_initialized() else 1
        return {"rollout/staleness_mean": figures[0].item() / ranks, "rollout/staleness_max": figures[1].item(),
                "rollout/actor_idle_seconds": figures[2].item() / ranks, "rollout/actor_restarts": figures[3].item(),
                "rollout/completions": figures[4].item(), "rollout/generated_tokens": figures[5].item()}

    def sync(self, step: int) -> float:
        """The adapter of `step` to the rollout side, if it does not hold it yet; the bytes sent."""
        if self.synced_step == step:
            return 0.0
        weights = gather_trainable_state(self.model)  # a collective: every rank is here at the same step
        checksum = adapter_checksum(weights)
        self.rollouts.sync(weights, step, checksum)
        self.synced_step = step
        self.sent = {version: sent for version, sent in self.sent.items()
                     if step - version <= self.cfg.rollout.max_staleness} | {step: checksum}
        return float(sum(t.numel() * t.element_size() for t in weights.values()))

    def score(self, records: list[dict], completions: list[Completion]) -> np.ndarray:
        texts = self.tokenizer.batch_decode([c.ids for c in completions], skip_special_tokens=True)
        return self.scorer([r["prompt"] for r in records], as_answers(texts, records), [c.ids for c in completions],
                           reward_columns(records), 0)

    def micro_batches(self, prompts: list[list[int]], completions: list[Completion], advantages: torch.Tensor,
                      real: torch.Tensor, sources: torch.Tensor | None = None) -> list[dict]:
        """The rows of prompt + answer in micro-batches of train.micro_batch_size, each as wide as its longest
        row: labels on the answer's tokens (none for a stand-in prompt, or a truncated answer with
        grpo.mask_truncated_completions, GRPO's), the sampler's log-probabilities, the advantage; the policy's and the
        reference's log-probabilities where the loss needs them (grpo.num_iterations > 1, grpo.beta)."""
        rollout, size = self.cfg.rollout, self.cfg.train.micro_batch_size
        answered = [(prompts[i // rollout.num_generations], c) for i, c in enumerate(completions)]
        batches = []
        for start in range(0, len(answered), size):
            rows = answered[start:start + size]
            trains = [bool(r) and not (self.masks_truncated and c.truncated)
                      for r, (_, c) in zip(real[start:start + size].tolist(), rows)]
            batch = completion_rows(rows, trains, pad_id(self.tokenizer))
            batch |= {"advantages": advantages[start:start + size], "real": real[start:start + size].float()}
            if sources is not None:
                batch["records"] = sources[start:start + size]
            batches.append(self.with_logps(batch))
        return batches

    @torch.no_grad()
    def with_logps(self, batch: dict) -> dict:
        """The old policy's (num_iterations > 1) and the reference's (beta > 0) log-probabilities of the answer's
        tokens, computed by the trainer's model before any update (a collective forward, as every rank does)."""
        grpo, rollout, chunk = self.cfg.grpo, self.cfg.rollout, self.cfg.train.loss_chunk_tokens
        device = next(self.model.parameters()).device
        inputs = {k: batch[k].to(device) for k in ("input_ids", "labels")}
        if grpo.num_iterations > 1:
            batch["old_logps"] = sampled_token_logps(self.model, inputs, chunk, rollout.temperature)[0].cpu()
        if grpo.beta:
            with reference_switch(self.model):
                batch["ref_logps"] = sampled_token_logps(self.model, inputs, chunk, rollout.temperature)[0].cpu()
        return batch


def prompt_lists(batch: dict) -> list[list[int]]:
    """A batch's prompts as token id lists, without their padding."""
    return [ids[:n].tolist() for ids, n in zip(batch["prompt_input_ids"], batch["prompt_length"].tolist())]


def completion_rows(rows: list[tuple[list[int], Completion]], trains: list[bool], pad: int) -> dict:
    """input_ids (prompt + answer, right-padded), labels (the answer's tokens where the row trains), the sampler's
    log-probabilities aligned with labels[:, 1:], and each row's real tokens (`length`)."""
    width = max(len(prompt) + len(c.ids) for prompt, c in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    labels = torch.full_like(ids, IGNORE_INDEX)
    logps = torch.zeros((len(rows), width - 1), dtype=torch.float32)
    for i, ((prompt, completion), trains_row) in enumerate(zip(rows, trains)):
        end = len(prompt) + len(completion.ids)
        ids[i, :end] = torch.tensor(prompt + completion.ids)
        if trains_row:
            labels[i, len(prompt):end] = torch.tensor(completion.ids)
        logps[i, len(prompt) - 1:end - 1] = torch.tensor(completion.logps)
    length = torch.tensor([len(prompt) + len(c.ids) for prompt, c in rows])
    return {"input_ids": ids, "labels": labels, "sampler_logps": logps, "length": length}


def reward_statistics(per_function: np.ndarray, rewards: np.ndarray, completions: list[Completion],
                      real: torch.Tensor, grpo) -> dict[str, float]:
    """TRL's figures of a batch of rollouts over every rank's answers: reward and reward_std, each function's
    rewards/<name>/mean and /std (NaN ones left out), and completion_statistics'. One all-reduce of sums (a std
    from the sum of squares, Bessel-corrected as TRL's)."""
    keep = real.numpy()
    sums = []
    for values in [rewards] + [per_function[:, i] for i in range(per_function.shape[1])]:
        valid = values[keep & ~np.isnan(values)]
        sums += [valid.sum(), (valid ** 2).sum(), len(valid)]
    *moments, length_sum, clipped_sum, answers = summed_over_ranks(sums + completion_sums(completions, keep))
    names = ["reward"] + [f"rewards/{reward_name(spec)}" for spec in grpo.reward_funcs]
    figures = {}
    for name, (total, squares, count) in zip(names, (moments[i:i + 3] for i in range(0, len(moments), 3))):
        mean = total / count if count else float("nan")
        std = ((squares - count * mean ** 2) / (count - 1)) ** 0.5 if count > 1 else float("nan")
        figures |= {name: mean, f"{name}_std": std} if name == "reward" else {f"{name}/mean": mean, f"{name}/std": std}
    return figures | length_figures(length_sum, clipped_sum, answers)


def completion_statistics(completions: list[Completion], real: torch.Tensor) -> dict[str, float]:
    """TRL's completions/mean_length and /clipped_ratio over every rank's answers (one all-reduce)."""
    return length_figures(*summed_over_ranks(completion_sums(completions, real.numpy())))


def completion_sums(completions: list[Completion], keep: np.ndarray) -> list[float]:
    lengths = np.array([len(c.ids) for c in completions])[keep]
    clipped = np.array([c.truncated for c in completions])[keep]
    return [lengths.sum(), clipped.sum(), keep.sum()]


def length_figures(length_sum: float, clipped_sum: float, answers: float) -> dict[str, float]:
    return {"completions/mean_length": length_sum / max(answers, 1),
            "completions/clipped_ratio": clipped_sum / max(answers, 1)}


def summed_over_ranks(sums: list[float]) -> list[float]:
    totals = torch.tensor(sums, dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(totals)
    return totals.tolist()


def frac_over_ranks(flags: torch.Tensor, count: torch.Tensor) -> float:
    """The share of true flags over every rank's."""
    totals = torch.tensor([flags.sum().item(), float(count)], dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(totals)
    return totals[0].item() / max(totals[1].item(), 1.0)
