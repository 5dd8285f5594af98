"""Several LoRA adapters trained side by side over one sharded base (`adapters:`, app/config/adapters.py).

The base is loaded and sharded once, with every adapter's LoRA weights beside it (PEFT adapters by name, all
trainable). Each step takes the step's global batch once from the job's data, and once from each data of the
adapters' own (an adapter that sets train_path, mixture_weights or eval_path: a stream per distinct data); then
the adapters run their batches, train.adapters_per_micro_batch at a time: each micro-batch made of one block of
rows per adapter (the same rows copied, or each adapter's own), each block routed through its own adapter's LoRA
weights (app/model/row_routing.py), so one forward and backward serves them all. Each adapter's loss is normalised over
its own batch's tokens, its gradients reduce-scattered and clipped by its own norm, and one AdamW steps every
adapter's parameter group with its own learning rate and schedule. So each adapter takes the steps it takes
trained alone (tests/unit/train/test_side_by_side.py): the same starting weights (a generator of the seed per
adapter), the same rows, the same dropout masks (drawn from the position in training and the layer's name:
app/model/dropout.py).

Each adapter is ranked by train.best_metric on its own evaluations; one whose loss or gradient is not finite
keeps its last finite weights and stops, as does one whose early-stopping patience is spent, and the others go
on. Each is evaluated on its own eval rows. Figures are logged with the adapter's name as prefix (`a/train_loss`,
`a/eval_loss`); the job's own
`train_loss` is the mean over the adapters still training, its `eval_loss` the best adapter's. The adapters are
exported to the run's `adapter/<name>/`, each a folder `PeftModel.from_pretrained` loads, with the config it
would have been trained with alone.
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from app.config.adapters import AdapterSection, data_streams
from app.config.sections import TrainSection
from app.data.stream import MODEL_INPUTS, RankStream
from app.errors import warn
from app.model.adapter import adapter_of
from app.model.row_routing import AdapterRouting
from app.model.sharding import full_grad_norm, reshard
from app.train.checkpoint import TrainerState, gather_trainable_state, save_adapter
from app.train.evaluation import BestEvaluation
from app.train.halving import behind, rung_at, rung_metric
from app.train.optimizer import build_grouped_optimizer
from app.train.progress import peak_memory_gb
from app.train.recipe import FinetuneRecipe, real_tokens


@dataclass
class TrainedAdapter:
    """One adapter of the job: its settings, its parameter group, where it stands."""

    section: AdapterSection
    train: TrainSection  # the job's, with its learning rate and schedule
    best: BestEvaluation
    group: int  # its parameter group in the optimizer
    stopped: str = ""  # why it stopped training; "" while it trains
    train_loss: float = math.nan
    eval_figures: dict[str, float] = field(default_factory=dict)
    data: str = ""  # its stream of rows: "" for the job's data, else its data's (app.config.adapters.data_streams)
    position: tuple[int, int] = (0, 0)  # with data of its own: (pass, rows into it) where its stream resumes

    @property
    def name(self) -> str:
        return self.section.name

    def state(self, stream: RankStream | None) -> dict:
        """What a checkpoint keeps of it; with data of its own, where its `stream` stands."""
        return {"best": self.best.state(), "stopped": self.stopped, "train_loss": self.train_loss,
                "position": [stream.pass_index, stream.rows_into_pass] if stream else [0, 0]}


def prefixed(name: str, figures: dict[str, float]) -> dict[str, float]:
    return {f"{name}/{key}": value for key, value in figures.items()}


def joined(blocks: list[dict]) -> dict:
    """The model's inputs of `blocks` (a micro-batch per adapter sharing a pass) as one micro-batch, one block of
    rows after another."""
    return {key: torch.cat([block[key] for block in blocks]) for key in MODEL_INPUTS if key in blocks[0]}


class SideBySideRecipe(FinetuneRecipe):
    """FinetuneRecipe over the adapters of `adapters:`, every step for each adapter still training. With adapters
    that have data of their own, `train_pass(pass_index, data=name)` and `eval_pass(data=name)` give their rows
    (app/launch/rank.py); the job's are `train_pass(pass_index)` and `eval_pass()` as for one adapter."""

    def __init__(self, plan, *args, **kwargs):
        super().__init__(plan, *args, **kwargs)
        train = self.cfg.train
        streams = data_streams(self.cfg.adapters, self.cfg.data)
        self.adapters = [TrainedAdapter(section, section.train_of(train),
                                        BestEvaluation(train.best_metric, train.early_stopping_patience), group,
                                        data=streams[section.name])
                         for group, section in enumerate(self.cfg.adapters)]

    def build_model(self) -> None:
        super().build_model()
        self.routing = AdapterRouting(self.model)
        if not self.cfg.fsdp.reshard_after_forward:  # each layer gathered once a step, for every adapter's pass
            self.model.set_reshard_after_backward(False)

    def build_optimizer(self):
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        return build_grouped_optimizer([([p for n, p in named if adapter_of(n) == adapter.name], adapter.train)
                                        for adapter in self.adapters])

    def optimizer_settings(self) -> list[TrainSection]:
        return [adapter.train for adapter in self.adapters]

    def continue_from(self, state: TrainerState, best_adapter: dict[str, torch.Tensor] | None) -> None:
        super().continue_from(state, best_adapter)
        train = self.cfg.train
        for adapter in self.adapters:
            saved = state.adapters[adapter.name]
            adapter.best = BestEvaluation(train.best_metric, train.early_stopping_patience, **saved["best"])
            adapter.stopped, adapter.train_loss = saved["stopped"], saved["train_loss"]
            adapter.position = tuple(saved.get("position", (0, 0)))

    def train_batches(self) -> RankStream:
        """The job's stream of micro-batches (returned), and one for each data of the adapters' own (`self.streams`,
        by TrainedAdapter.data), each from where the run stands."""
        job = super().train_batches()
        ctx = self.ctx
        self.streams = {"": job} | {
            adapter.data: RankStream(functools.partial(self.train_pass, data=adapter.data), ctx.device,
                                     *adapter.position, ctx.rank, ctx.world_size)
            for adapter in self.adapters if adapter.data}
        return job

    def adapters_state(self) -> dict:
        return {adapter.name: adapter.state(self.streams[adapter.data] if adapter.data else None)
                for adapter in self.adapters}

    def train_step(self) -> dict[str, float]:
        """Every adapter still training takes one optimizer step on its global batch."""
        ctx, t0 = self.ctx, time.perf_counter()
        training = [adapter for adapter in self.adapters if not adapter.stopped]
        steps = {data: [next(self.streams[data]) for _ in range(self.plan.grad_accum_steps_on(ctx.world_size))]
                 for data in dict.fromkeys(adapter.data for adapter in training)}  # the streams still trained on
        data_wait = time.perf_counter() - t0
        normalisers = {data: self.objective.normaliser(batches) for data, batches in steps.items()}
        shared, sums = self.cfg.train.adapters_per_micro_batch, []
        for first in range(0, len(training), shared):  # their gradients reduce-scattered after their last pass
            sums += self.accumulate_for(training[first:first + shared], steps, normalisers)
        reshard(self.model)  # gathered once for every adapter's pass; the shards step next
        norms = [full_grad_norm(torch.nn.utils.clip_grad_norm_(self.optimizer.param_groups[a.group]["params"],
                                                               self.cfg.train.max_grad_norm)) for a in training]
        tokens = [real_tokens(steps[adapter.data]).to(ctx.device).reshape(1) for adapter in training]
        totals = torch.cat([*tokens, *sums])
        dist.all_reduce(totals)  # each adapter's non-pad tokens, loss and metric sums
        totals = torch.cat([totals, torch.stack([normalisers[a.data] for a in training]).double().reshape(-1),
                            torch.stack(norms).double().to(ctx.device)]).tolist()
        tokens, totals = totals[:len(training)], totals[len(training):]
        figures = self.adapter_steps(training, totals)
        seconds = time.perf_counter() - t0
        self.meter.add(sum(tokens), seconds, data_wait)
        trained = [adapter.train_loss for adapter in training if not adapter.stopped]
        self.train_loss = sum(trained) / len(trained) if trained else math.nan
        self.stopped_early = not trained
        return {"train_loss": self.train_loss,
                **{key: max(figures[f"{a.name}/{key}"] for a in training) for key in ("learning_rate", "grad_norm")},
                "tokens_per_second": sum(tokens) / seconds, "peak_memory_gb": peak_memory_gb(ctx.device),
                "data_wait_seconds": data_wait, "step_tokens": sum(tokens), "adapters_training": len(trained),
                "workers": ctx.world_size, **figures,
                **{f"{a.name}/step_tokens": count for a, count in zip(training, tokens, strict=True)},
                **self.batches.take_figures(seconds)}

    def accumulate_for(self, group: list[TrainedAdapter], steps: dict[str, list[dict]],
                       normalisers: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        """Forward and backward of the step's micro-batches for the adapters of `group`: one adapter through PEFT's
        own forward, or several in one pass, each micro-batch one block of rows per adapter (its stream's), each
        block routed through its own adapter (app/model/row_routing.py). Each adapter's loss sum (this rank's)."""
        if len(group) == 1:
            self.routing.activate(group[0].name)
            return [self.accumulate(steps[group[0].data], normalisers[group[0].data])]
        scales = torch.stack([normalisers[adapter.data] for adapter in group])

        def loss_of(blocks: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
            rows = [len(block["input_ids"]) for block in blocks]  # a pass's last micro-batch may hold fewer
            self.routing.size_blocks(rows)
            return self.objective.block_losses(self.model, joined(blocks), scales, self.ctx.world_size, rows)

        with self.routing.rows_through([adapter.name for adapter in group]):
            sums = self.backward_over(list(zip(*(steps[adapter.data] for adapter in group))), loss_of)
        return list(sums.reshape(-1, 1))

    def adapter_steps(self, training: list[TrainedAdapter], totals: list[float]) -> dict[str, float]:
        """Each adapter's step from its reduced sums: an adapter whose loss or gradient norm is not finite is
        stopped before the optimizer steps (its weights stay its last finite ones); the others step."""
        width, count = 1 + len(self.objective.metric_names), len(training)
        normalisers, norms = totals[count * width:count * (width + 1)], totals[count * (width + 1):]
        figures = {}
        for i, (adapter, normaliser) in enumerate(zip(training, normalisers, strict=True)):
            loss_total, *metric_totals = totals[i * width:(i + 1) * width]
            group = self.optimizer.param_groups[adapter.group]
            adapter.train_loss = loss_total / normaliser
            if not (math.isfinite(adapter.train_loss) and math.isfinite(norms[i])):
                adapter.stopped = f"step {self.step + 1}: train_loss {adapter.train_loss}, grad_norm {norms[i]}"
                for param in group["params"]:
                    param.grad = None  # AdamW passes over it
                if self.ctx.is_main:
                    warn(f"adapter {adapter.name} stopped ({adapter.stopped}); the other adapters go on")
            figures |= prefixed(adapter.name, {"train_loss": adapter.train_loss, "learning_rate": group["lr"],
                                               "grad_norm": norms[i],
                                               **self.objective.step_figures(metric_totals, normaliser)})
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return figures

    def evaluate(self, step: int = 0) -> dict[str, float]:
        """Each adapter's evaluation on its eval rows, its figures under its name; the job's eval_loss is the best
        adapter's (with data of their own, on other rows: a comparison of the adapters only where they share them)."""
        figures = {}
        for adapter in self.adapters:
            self.routing.activate(adapter.name)
            eval_pass = functools.partial(self.eval_pass, data=adapter.data) if adapter.data else self.eval_pass
            adapter.eval_figures = self.objective.evaluate(self.model, eval_pass, self.ctx, self.tokenizer)
            figures |= prefixed(adapter.name, adapter.eval_figures)
        losses = [a.eval_figures["eval_loss"] for a in self.adapters if math.isfinite(a.eval_figures["eval_loss"])]
        self.eval_loss = min(losses) if losses else math.nan
        self.eval_figures, self.eval_step = figures, step
        return figures

    def rank_evaluation(self, step: int) -> bool:
        """Rank each adapter still training on its own evaluation (with train.export=best keep the weights of each
        one that improved: a collective, the same on every rank); True when no adapter trains any more."""
        improved = {adapter.name for adapter in self.adapters
                    if not adapter.stopped and adapter.best.update(step, adapter.eval_figures)}
        if improved and self.cfg.train.export == "best":
            weights = gather_trainable_state(self.model)
            self.best_adapter = (self.best_adapter or {}) | {k: v for k, v in weights.items()
                                                             if adapter_of(k) in improved}
        training = [adapter for adapter in self.adapters if not adapter.stopped]
        rung = rung_at(self.cfg, step)
        metric = rung_metric(self.cfg)
        slow = behind(self.cfg, {a.name: a.eval_figures[metric] for a in training}) if rung is not None else {}
        for adapter in training:
            if adapter.name in slow:
                adapter.stopped = f"step {step}: rung {rung}, {slow[adapter.name]}"
            elif adapter.best.patience_spent:
                adapter.stopped = f"step {step}: early stopping, best {adapter.best.value} at step {adapter.best.step}"
        return all(adapter.stopped for adapter in self.adapters)

    def sample_table(self) -> None:
        """No sample table: each adapter's answers are in its eval figures."""
        return None

    def write_adapter(self, folder: Path, last_weights: dict[str, torch.Tensor]) -> None:
        """Each adapter into `folder/<name>/`, with the config it would have been trained with alone."""
        best = self.best_adapter if self.cfg.train.export == "best" and self.best_adapter else {}
        for adapter in self.adapters:
            weights = {k: v for k, v in last_weights.items() if adapter_of(k) == adapter.name}
            weights |= {k: v for k, v in best.items() if adapter_of(k) == adapter.name}
            alone = self.cfg.adapter_alone(adapter.section).to_yaml()
            save_adapter(self.model, weights, folder, self.tokenizer, alone, adapter_name=adapter.name)

    def adapter_figures(self) -> dict[str, float]:
        figures = {}
        for adapter in self.adapters:
            figures |= prefixed(adapter.name, {
                "final_train_loss": adapter.train_loss, "final_eval_loss": adapter.eval_figures.get("eval_loss"),
                "best_step": adapter.best.step, "best_value": adapter.best.value,
                "stopped": float(bool(adapter.stopped))})
        return figures
