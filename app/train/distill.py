"""On-policy distillation (train.objective=distill): the student (the LoRA policy) answers each step's prompts
through the rollout actors, as GRPO's do; here the teacher scores every token of those answers, and the student
moves its whole next-token distribution at every place of its own answers toward the teacher's.

The loss is TRL's generalized Jensen-Shannon divergence (DistillationTrainer's `beta`) between the student's (s)
and the teacher's (t) distributions over the full vocabulary, both at rollout.temperature: beta 1 the reverse
KL(s || t), beta 0 the forward KL(t || s), between them beta KL(t || m) + (1 - beta) KL(s || m) with the mixture
m = (1 - beta) s + beta t. The full vocabulary, not its top-k: the divergence is exact, and the teacher's logits
are computed here in the same step, so nothing of the distribution travels or is stored. Each token weighs
alike: the sum over the global batch's answer tokens / their count (as TRL's `num_items_in_batch`); with
rollout.importance_correction=tis a token sampled by a stale adapter is weighted by min(pi_now / pi_sampler, cap).

The teacher is the student's base with the teacher's adapter (distill.teacher_adapter), the frozen second adapter
of the same sharded model (app/model/adapter.py's REFERENCE, as DPO's starting adapter is): switching it in costs
the teacher one forward without gradients and no second copy of the base. A teacher of its own base
(distill.teacher) is built and sharded as the student is, over the same mesh (sharded_teacher).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from app.config.distill import teacher_model
from app.config.schema import FinetuneConfig
from app.data.chat import IGNORE_INDEX, pad_id
from app.model.adapter import FrozenAdapter
from app.model.build import build_training_model
from app.model.sharding import reshard
from app.train.dpo import reference_switch
from app.train.group import RankContext
from app.train.grpo import METRIC_MAXIMA, importance_weights
from app.train.reward_eval import greedy_eval_answers, scored_table

METRIC_SUMS = ("entropy", "sampler_gap", "tokens")


def generalized_jsd(student: torch.Tensor, teacher: torch.Tensor, beta: float) -> torch.Tensor:
    """The divergence at each place ([..., vocabulary] log-probabilities in, [...] out)."""
    if beta == 0.0:
        return (teacher.exp() * (teacher - student)).sum(-1)
    if beta == 1.0:
        return (student.exp() * (student - teacher)).sum(-1)
    mixture = torch.logaddexp(student + math.log(1 - beta), teacher + math.log(beta))
    return (beta * (teacher.exp() * (teacher - mixture)).sum(-1)
            + (1 - beta) * (student.exp() * (student - mixture)).sum(-1))


def answer_window(labels: torch.Tensor) -> int:
    """The first place (of labels[:, 1:]) any row has an answer token: the logits before it weigh nothing."""
    trained = (labels[:, 1:] != IGNORE_INDEX).any(0).nonzero()
    return int(trained[0]) if len(trained) else 0


def next_token_logps(model, input_ids: torch.Tensor, start: int, temperature: float) -> torch.Tensor:
    """log-softmax(logits / temperature) of the places from `start` on that predict a next token: [rows, places,
    vocabulary] in fp32. The head runs over every place: transformers' logits_to_keep hands it a strided slice,
    which CPU kernels multiply as a batch of copies of the head's weight (20x slower on SmolLM2)."""
    logits = model(input_ids=input_ids, use_cache=False).logits[:, start:-1].float()
    return F.log_softmax(logits / temperature if temperature != 1.0 else logits, dim=-1)


def over_shared_rows(student: torch.Tensor, teacher: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two distributions over the rows of the output layer both models have: models of one family pad their
    embeddings to different sizes (Qwen2.5 0.5B: 151,936 rows, 7B: 152,064) past the tokenizer's tokens, which the
    driver checks both cover. Either is renormalised over the shared rows where they differ."""
    width = min(student.shape[-1], teacher.shape[-1])
    if student.shape[-1] == teacher.shape[-1]:
        return student, teacher
    return tuple(t[..., :width] - t[..., :width].logsumexp(-1, keepdim=True) for t in (student, teacher))


def token_divergences(model, batch: dict, temperature: float, beta: float, teacher_model=None):
    """(each answer token's divergence from the teacher, its log-probability under the student, the student's
    entropy there, the mask of answer tokens): [rows, places] each, from the first answer token on. The teacher is
    `teacher_model`, or where there is none the student's own model with its frozen second adapter. Every rank
    runs both forwards whatever its rows hold (the shards are gathered in lockstep)."""
    ids, labels = batch["input_ids"], batch["labels"]
    start = answer_window(labels)
    student = next_token_logps(model, ids, start, temperature)
    own_base = teacher_model is not None
    with torch.no_grad(), contextlib.nullcontext() if own_base else reference_switch(model):
        teacher = next_token_logps(teacher_model if own_base else model, ids, start, temperature)
    if own_base:
        reshard(teacher_model)  # its root stays gathered after a forward (as the student's): freed till the next
        student, teacher = over_shared_rows(student, teacher)
    targets = labels[:, 1 + start:].to(student.device)
    mask = targets != IGNORE_INDEX
    divergence = generalized_jsd(student, teacher, beta)
    logps = student.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():
        entropy = -(student.exp() * student).sum(-1)
    return divergence, logps, entropy, mask


class Distillation:
    """On-policy distillation: the student against the teacher's distribution on the student's own answers."""

    metric_names, metric_maxima = METRIC_SUMS, METRIC_MAXIMA
    normaliser_name = "step_completion_tokens"
    answers_artifact = "eval/completions.json"  # its evaluation is greedy answers to every eval prompt
    answers_hold_every_eval_row = True

    def __init__(self, cfg: FinetuneConfig):
        self.cfg, self.rollout, self.beta = cfg, cfg.rollout, cfg.distill.beta
        self.answers: dict[str, list] | None = None
        self.teacher_adapter: FrozenAdapter | None = None  # a teacher of its own base: its adapter, until loaded
        self.teacher_model = None  # that teacher, sharded like the student, built at its first forward

    def reference_adapter(self, init_adapter: dict | None, teacher: FrozenAdapter | None) -> FrozenAdapter | None:
        """The teacher's adapter, frozen beside the student's, where the teacher is the student's base; a teacher
        of its own base (distill.teacher) takes it instead."""
        if self.cfg.distill.teacher is None:
            return teacher
        self.teacher_adapter = teacher
        return None

    def teacher(self, model):
        """The teacher model of its own base (None: the student's model is the teacher's too), built on the first
        call as the student was (model.load, the dtypes) and sharded over the student's mesh, frozen."""
        if self.cfg.distill.teacher is None or self.teacher_model is not None:
            return self.teacher_model
        reshard(model)  # after a forward without gradients the gathered copies stand in for the shards
        shard = next(p for p in model.parameters() if p.requires_grad)  # a DTensor on the student's mesh
        self.teacher_model = sharded_teacher(self.cfg, self.teacher_adapter, shard.device_mesh, shard.device)
        self.teacher_adapter = None
        return self.teacher_model

    def normaliser(self, micro_batches: list[dict]) -> torch.Tensor:
        """The global batch's answer tokens (one all-reduce), at least 1."""
        count = sum((b["labels"][:, 1:] != IGNORE_INDEX).sum() for b in micro_batches).to(torch.float64)
        if dist.is_initialized():
            dist.all_reduce(count)
        return count.clamp(min=1.0)

    def micro_batch_loss(self, model, batch: dict, normaliser: torch.Tensor, world_size: int):
        """(the loss to backpropagate, its unscaled sum, sums of `metric_names` then `metric_maxima`)."""
        divergence, logps, entropy, mask = token_divergences(model, batch, self.rollout.temperature, self.beta,
                                                             self.teacher(model))
        sampler = batch["sampler_logps"][:, -logps.shape[1]:].to(logps.device)
        if self.rollout.importance_correction == "tis":
            divergence = divergence * importance_weights(logps.detach(), sampler, self.rollout.importance_cap)
        m = mask.to(divergence.dtype)
        loss_sum = (divergence * m).sum()
        gap = (logps.detach() - sampler).abs()
        sums = torch.stack([(entropy * m).sum(), (gap * m).sum(), m.sum(), (gap * m).max()]).double()
        return loss_sum * (world_size / normaliser), loss_sum.detach(), sums

    def step_figures(self, sums: list[float], normaliser: float) -> dict[str, float]:
        """TRL's names: the student's entropy, and how far the trainer's log-probabilities of the sampled tokens
        are from the sampler's (a stale adapter on the rollout side, or another numeric path, shows here)."""
        totals = dict(zip(METRIC_SUMS + METRIC_MAXIMA, sums))
        tokens = max(totals["tokens"], 1.0)
        return {"entropy": totals["entropy"] / tokens,
                "sampling/sampling_logp_difference/mean": totals["sampler_gap"] / tokens,
                "sampling/sampling_logp_difference/max": totals["sampler_gap_max"]}

    def evaluate(self, model, eval_pass: Callable[[], Iterable], ctx: RankContext, tokenizer) -> dict[str, float]:
        """Greedy answers to every eval prompt, their task metrics (eval.metrics), and eval_loss: the divergence
        from the teacher per token of those answers. The answers' table is kept."""
        mine, records, prompts, answers = greedy_eval_answers(model, eval_pass, tokenizer, ctx.device,
                                                              self.rollout.max_completion_tokens)
        figures, self.answers = scored_table(mine, records, answers, tokenizer, None, self.cfg.grpo, self.cfg.eval)
        divergence = self.answer_divergence(model, prompts, answers, len(mine), pad_id(tokenizer), ctx)
        return figures | {"eval_loss": divergence}

    @torch.no_grad()
    def answer_divergence(self, model, prompts: list[torch.Tensor], answers: list[torch.Tensor], rows: int, pad: int,
                          ctx: RankContext) -> float:
        """The mean divergence per answer token over every rank's answers (this rank's: the first `rows`),
        train.micro_batch_size rows at a time (as many forwards on every rank: a rank with fewer rows repeats its
        first, which does not count)."""
        size = self.cfg.train.micro_batch_size
        most = torch.tensor([float(rows)], device=ctx.device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX)
        total = torch.zeros(2, dtype=torch.float64, device=ctx.device)
        was_training = model.training
        model.eval()
        for start in range(0, int(most.item()), size):
            chunk = [(prompts[i] if i < rows else None, answers[i] if i < rows else None, i < rows)
                     for i in range(start, min(start + size, int(most.item())))]
            batch = answer_rows([(p, a) if real else (prompts[0], answers[0]) for p, a, real in chunk],
                                [real for *_, real in chunk], pad, ctx.device)
            divergence, _, _, mask = token_divergences(model, batch, self.rollout.temperature, self.beta,
                                                       self.teacher(model))
            total += torch.stack([(divergence * mask).sum(), mask.sum()]).double().to(ctx.device)
        model.train(was_training)
        dist.all_reduce(total)
        return (total[0] / total[1].clamp(min=1)).item()


def sharded_teacher(cfg: FinetuneConfig, adapter: FrozenAdapter | None, mesh: DeviceMesh, device: torch.device):
    """A teacher of its own base (distill.teacher) built as the student is: loaded as model.load says, each
    decoder layer and the root fully_shard-ed over the student's mesh, so a teacher several times the student's
    size costs each worker its share; its adapter (if any) beside its base, frozen (without one, the LoRA layers
    the builder adds are switched off)."""
    base = teacher_model(cfg.model, cfg.distill)
    lora = adapter.lora if adapter is not None else cfg.lora
    model = build_training_model(base, lora, cfg.fsdp, mesh, cfg.train.seed, device,
                                 init_adapter=adapter.weights if adapter is not None else None)
    if adapter is None:
        model.base_model.disable_adapter_layers()  # its forwards run the base alone: no LoRA products to add 0
    return model.eval().requires_grad_(False)


def answer_rows(pairs: list[tuple[torch.Tensor, torch.Tensor]], counted: list[bool], pad: int,
                device: torch.device) -> dict:
    """input_ids (prompt + answer, right-padded) and labels (the answer's tokens, on rows that count)."""
    width = max(len(p) + len(a) for p, a in pairs)
    ids = torch.full((len(pairs), width), pad, dtype=torch.long)
    labels = torch.full_like(ids, IGNORE_INDEX)
    for i, ((prompt, answer), counts) in enumerate(zip(pairs, counted)):
        ids[i, :len(prompt) + len(answer)] = torch.cat([prompt.cpu(), answer.cpu()])
        if counts:
            labels[i, len(prompt):len(prompt) + len(answer)] = answer.cpu()
    return {"input_ids": ids.to(device), "labels": labels.to(device)}
