"""The LoRA + FSDP2 fine-tuning recipe that every worker runs, in four named steps:

    setup()       tokenizer, sharded LoRA model, AdamW, LR schedule; restore the latest checkpoint
    train_step()  one optimizer step: micro-batches -> loss over the global batch -> clip -> step
    evaluate()    the objective's figures (eval loss; DPO's reward figures; GRPO's rewards of greedy answers), task
                  metrics of greedy answers, all ranks together
    finish()      sample generations, the adapter gathered from every shard, the run's summary

The objective (app/train/objectives.py, by train.objective) says what the loss is: next-token loss on
the target tokens (sft), DPO on preference pairs (dpo), or GRPO on answers sampled and scored each step (grpo:
the rollouts arrive as the step's batches, app/train/rollouts.py).

Plain torch: the process group must exist, and batches arrive as iterables of token-row tensors
({"input_ids", "labels", ...}; for pairs "chosen_input_ids", "rejected_labels", ...). Ray
(app/launch/worker.py) provides both on a cluster, plus a checkpoint store; the unit tests provide them
with torch.multiprocessing and lists (tests/unit/train/test_recipe.py).
"""

from __future__ import annotations

import math
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
import torch.distributed as dist

from app.config.sections import TrainSection
from app.data.passes import source_key
from app.data.stream import RankPass, RankStream
from app.model.base import load_tokenizer
from app.model.build import build_training_model
from app.model.dropout import key_lora_dropout
from app.model.sharding import build_device_mesh, full_grad_norm, trainable_parameters
from app.plan.plan import Plan
from app.train.checkpoint import (
    TrainerState,
    gather_trainable_state,
    load_best_adapter,
    load_stream_state,
    load_training_state,
    save_adapter,
    save_training_state,
)
from app.train.evaluation import BestEvaluation, eval_metrics
from app.train.generation import generation_table
from app.train.group import RankContext, combined_figures, max_over_ranks, split_maxima
from app.train.measured import measured_on_workers, measured_params
from app.train.objectives import objective_for
from app.train.optimizer import build_optimizer, follow_config
from app.train.ports import NoTracking, RecipeParts
from app.train.preemption import DrainNotice
from app.train.progress import Progress, StartupClock, ThroughputMeter, peak_memory_gb
from app.train.rollouts import RolloutStream


class FinetuneRecipe:
    """Train until `train.max_steps` optimizer steps are done, the same number on every rank, or until
    `train.early_stopping_patience` evaluations in a row have not beaten the best one.

    Starts from the latest checkpoint when there is one (a restarted worker group or a resumed run). What else
    it is handed is one RecipeParts.
    """

    def __init__(self, plan: Plan, ctx: RankContext, train_pass: RankPass, eval_pass: Callable[[], Iterable],
                 parts: RecipeParts | None = None):
        self.plan, self.ctx, self.train_pass, self.eval_pass = plan, ctx, train_pass, eval_pass
        self.cfg = cfg = plan.cfg  # what the workers measure is decided in build_model()
        parts = parts or RecipeParts()
        self.tracker = parts.tracker or NoTracking()
        self.checkpoints, self.run_dir = parts.checkpoints, parts.run_dir
        self.job_start_time = parts.job_start_time or time.time()
        self.started = time.perf_counter()
        self.meter = ThroughputMeter()
        self.startup = parts.startup or StartupClock(self.job_start_time, memory=True)
        self.time_to_first_step = float("nan")  # job start to this attempt's first step (none if none is left)
        self.source_names = parts.source_names if len(parts.source_names) > 1 else ()
        self.objective = objective_for(cfg, parts.scorer)
        self.rollouts, self.scorer = parts.rollouts, parts.scorer
        self.init_adapter, self.teacher = parts.init_adapter, parts.teacher  # copied into the shards by build_model
        self.pace = parts.pace
        self.rows_per_source = torch.zeros(len(self.source_names), dtype=torch.float64)
        self.notice = DrainNotice()
        self.loop_seconds = self.save_seconds = 0.0  # the last step's (all of it) and checkpoint's, for a drain
        self.last_drain_check = time.perf_counter()
        # built by setup(): the sharded model and what trains it, and the stream of this rank's micro-batches
        self.tokenizer = self.model = self.optimizer = self.scheduler = self.batches = None
        self.params: list[torch.nn.Parameter] = []
        # where the run stands: the latest checkpoint's, or step 0 (setup() decides)
        self.state: TrainerState | None = None
        self.step, self.train_loss, self.stopped_early = 0, math.nan, False
        # this attempt's latest evaluation, and the run's best (its adapter weights too with train.export=best)
        self.eval_loss: float | None = None
        self.eval_figures: dict[str, float] = {}
        self.eval_step: int | None = None
        self.best = BestEvaluation(cfg.train.best_metric, cfg.train.early_stopping_patience)
        self.best_adapter: dict[str, torch.Tensor] | None = None

    def setup(self) -> None:
        """The model and its optimizer; then where the run stands: the latest checkpoint (a restarted worker group
        or a resumed run), or step 0, evaluated first with train.eval_on_start."""
        self.startup.reached("worker_started")
        self.build_model()
        self.startup.reached("model_built")
        restored = (self.checkpoints.restore(lambda d: (load_training_state(d, self.model, self.optimizer,
                                                                             self.ctx.device), load_best_adapter(d),
                                                         load_stream_state(d)))
                    if self.checkpoints else None)
        if restored is None:
            self.start_fresh()
        else:
            self.continue_from(*restored[:2])
        self.batches = self.train_batches()
        if restored is not None:
            self.batches.restore(restored[2])
        self.startup.reached("setup_done")  # optimizer, the restore check, step 0's figures logged

    def train_batches(self) -> RankStream | RolloutStream:
        """This rank's micro-batches from where the run stands: its rows of each pass (SFT, DPO), or with
        train.objective=grpo answers sampled to its prompts and scored (app/train/rollouts.py)."""
        ctx = self.ctx
        rows = RankStream(self.train_pass, ctx.device, self.state.pass_index, self.state.rows_into_pass, ctx.rank,
                          ctx.world_size)
        if self.rollouts is None:
            return rows
        return RolloutStream(rows, self.rollouts, self.scorer, self.cfg, ctx.rank, self.tokenizer, self.model,
                             lambda: self.step)

    def build_model(self) -> None:
        """`auto` dtypes and compile agreed by every rank, the tokenizer, the FSDP2-sharded LoRA model (its adapter
        from the seed or model.init_adapter), AdamW over the LoRA weights and the LR schedule."""
        ctx = self.ctx
        self.plan, compile_figures = measured_on_workers(self.plan, ctx)
        cfg = self.cfg = self.plan.cfg
        self.tracker.log_params(measured_params(self.plan))
        if compile_figures:
            self.tracker.log_metrics(compile_figures, step=0, once_per_step=False)
        torch.manual_seed(cfg.train.seed)
        self.tokenizer = load_tokenizer(cfg.model, cfg.data.chat_template)
        self.model = build_training_model(cfg.model, cfg.trained_lora(), cfg.fsdp,
                                          build_device_mesh(ctx.device.type, cfg.scaling.mesh_shape(ctx.world_size)),
                                          cfg.train.seed, ctx.device, self.init_adapter,
                                          self.objective.reference_adapter(self.init_adapter, self.teacher))
        self.init_adapter = self.teacher = None  # in the shards (or a teacher base's: the objective)
        self.dropout_key = key_lora_dropout(self.model)
        self.params = trainable_parameters(self.model)
        self.optimizer, self.scheduler = self.build_optimizer()

    def build_optimizer(self) -> tuple[torch.optim.Optimizer, object]:
        return build_optimizer(self.params, self.cfg.train)

    def optimizer_settings(self) -> TrainSection | list[TrainSection]:
        """The train settings of each of the optimizer's parameter groups (one: the job's)."""
        return self.cfg.train

    def start_fresh(self) -> None:
        figures = self.evaluate() if self.cfg.train.eval_on_start else {}
        self.state = TrainerState(step=0, pass_index=0, rows_into_pass=0, scheduler={},
                                  initial_eval_loss=self.eval_loss if figures else math.nan,
                                  initial_eval={k: v for k, v in figures.items() if k.startswith("eval_")})
        if figures:
            self.rank_evaluation(0)
            self.startup.reached("initial_eval_done")
        self.tracker.log_metrics(figures | self.startup.seconds, step=0)

    def continue_from(self, state: TrainerState, best_adapter: dict[str, torch.Tensor] | None) -> None:
        cfg = self.cfg
        self.state, self.best_adapter = state, best_adapter
        self.best = BestEvaluation(cfg.train.best_metric, cfg.train.early_stopping_patience, **state.best)
        self.scheduler.load_state_dict(state.scheduler)
        follow_config(self.optimizer, self.scheduler, self.optimizer_settings())
        self.step, self.train_loss, self.stopped_early = state.step, state.train_loss, state.stopped_early
        self.tracker.log_metrics({"resumed_from_step": state.step}, step=state.step, once_per_step=False)

    def train(self) -> dict[str, float]:
        """setup, then the loop, then finish: what each worker runs."""
        self.setup()
        first, last = self.state.step + 1, self.state.step if self.stopped_early else self.cfg.train.max_steps
        progress = Progress(first, last, enabled=self.ctx.is_main)
        self.model.train()
        for step in range(first, last + 1):
            metrics = self.train_step()
            self.step = step
            if step == first:
                self.startup.reached("first_step_done")
                self.time_to_first_step = metrics["time_to_first_step_seconds"] = time.time() - self.job_start_time
            evaluated = step % self.cfg.train.eval_every == 0 or step == last
            if evaluated:
                metrics |= self.evaluate(step)
                self.stopped_early = self.rank_evaluation(step) and step != last
            if step % self.cfg.train.log_every == 0 or evaluated or step == first:
                self.tracker.log_metrics(metrics, step)
                progress.line(step, metrics)
            if self.stopped_early:
                break
            if self.pace is not None:
                self.pace(step)
            drain = self.drain_checkpoint_due(step)
            if self.checkpoints and (step % self.cfg.train.checkpoint_every == 0 or drain) and step != last:
                self.save_checkpoint(step)
        return self.finish()  # saves the last checkpoint, with the run's summary

    def drain_checkpoint_due(self, step: int) -> bool:
        """A node of this group is being reclaimed (a drain with a deadline): checkpoint out of schedule, at
        once and again as late as the deadline allows (app/train/preemption.py). Asked every step, on every
        rank, which all take the same branches: the notice is agreed by Ray Train, the closing by a max."""
        deadline = self.checkpoints.preemption_deadline() if self.checkpoints else None
        now = time.perf_counter()
        self.loop_seconds, self.last_drain_check = now - self.last_drain_check, now  # evaluations included
        if deadline is None:
            return False
        if self.notice.is_new(deadline):
            self.tracker.log_metrics({"preemption_notice_seconds_left": deadline - time.time()}, step,
                                     once_per_step=False)
            return True
        closing = self.notice.closing(time.time(), self.loop_seconds, self.save_seconds,
                                      self.checkpoints.registration_seconds())
        if not self.notice.late_save_done and max_over_ranks(float(closing), self.ctx):
            self.notice.late_save_taken()
            self.tracker.log_metrics({"preemption_late_checkpoint_seconds_left": deadline - time.time()}, step,
                                     once_per_step=False)
            return True
        return False

    def train_step(self) -> dict[str, float]:
        """One optimizer step over `grad_accum_steps` micro-batches; returns the step's metrics.

        The loss is the mean over every target token (or pair) of the global batch, so any worker count and
        accumulation split takes the same step. Gradients are reduce-scattered once, after the last micro-batch.
        """
        ctx, objective, t0 = self.ctx, self.objective, time.perf_counter()
        micro_batches = [next(self.batches) for _ in range(self.plan.grad_accum_steps_on(ctx.world_size))]
        data_wait = time.perf_counter() - t0
        normaliser = objective.normaliser(micro_batches)
        sums = self.accumulate(micro_batches, normaliser)
        grad_norm = full_grad_norm(torch.nn.utils.clip_grad_norm_(self.params, self.cfg.train.max_grad_norm))
        learning_rate = self.optimizer.param_groups[0]["lr"]  # the rate this step uses
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

        sums, maxima = split_maxima(sums, len(objective.metric_maxima))
        step_totals = torch.cat([real_tokens(micro_batches).to(ctx.device).reshape(1),
                                 self._rows_per_source(micro_batches).to(ctx.device), sums])
        dist.all_reduce(step_totals)  # non-pad token count, records of each source, loss and metric sums
        if len(maxima):
            dist.all_reduce(maxima, op=dist.ReduceOp.MAX)
        tokens, *totals, normaliser, grad_norm = torch.cat(  # the step's one host sync
            [step_totals, maxima, normaliser.reshape(1), grad_norm.reshape(1).double()]).tolist()
        source_rows, (loss_total, *metric_totals) = totals[:len(self.source_names)], totals[len(self.source_names):]
        self.train_loss = loss_total / normaliser
        seconds = time.perf_counter() - t0
        self.meter.add(tokens, seconds, data_wait)
        self.rows_per_source += torch.tensor(source_rows, dtype=torch.float64)
        shares = {f"data_share/{source_key(name)}": (rows / self.rows_per_source.sum()).item()
                  for name, rows in zip(self.source_names, self.rows_per_source)}
        return {"train_loss": self.train_loss, "learning_rate": learning_rate, "grad_norm": grad_norm,
                "tokens_per_second": tokens / seconds, "peak_memory_gb": peak_memory_gb(ctx.device),
                "data_wait_seconds": data_wait, "step_tokens": tokens, objective.normaliser_name: normaliser,
                "workers": ctx.world_size,
                **objective.step_figures(metric_totals, normaliser), **shares, **self.batches.take_figures(seconds)}

    def accumulate(self, micro_batches: list[dict], normaliser: torch.Tensor) -> torch.Tensor:
        """Forward and backward over the step's micro-batches, gradients reduce-scattered after the last one;
        the loss and metric sums (this rank's)."""
        def loss_of(batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
            loss, loss_sum, metric_sums = self.objective.micro_batch_loss(self.model, batch, normaliser,
                                                                          self.ctx.world_size)
            return loss, torch.cat([loss_sum.double().reshape(1), metric_sums])

        return self.backward_over(micro_batches, loss_of, len(self.objective.metric_maxima))

    def backward_over(self, micro_batches: list, loss_of: Callable, maxima: int = 0) -> torch.Tensor:
        """`loss_of(batch)` -> (loss, sums) for each micro-batch, each loss backpropagated under its micro-batch's
        dropout key, gradients reduce-scattered after the last one; the sums added up (this rank's), the last
        `maxima` of them kept at their largest."""
        total = None
        for i, batch in enumerate(micro_batches):
            self.model.set_requires_gradient_sync(i == len(micro_batches) - 1)
            with self.dropout_at(i):
                loss, sums = loss_of(batch)
                loss.backward()
            total = sums.double() if total is None else combined_figures(total, sums.double(), maxima)
        return total

    def dropout_at(self, micro_batch: int):
        """LoRA dropout's masks for this micro-batch of the step, drawn from (seed, step, rank, micro-batch) and each
        layer's name (app/model/dropout.py): adapters trained side by side draw what each would alone."""
        return self.dropout_key.at(self.cfg.train.seed, self.step, self.ctx.rank, micro_batch)

    def write_adapter(self, folder: Path, last_weights: dict[str, torch.Tensor]) -> None:
        """The run's adapter, as train.export chose it, into `folder` (rank 0)."""
        weights = self.best_adapter if self.cfg.train.export == "best" and self.best_adapter else last_weights
        save_adapter(self.model, weights, folder, self.tokenizer, self.cfg.to_yaml())

    def adapter_figures(self) -> dict[str, float]:
        """Each adapter's own summary figures, beside the run's (none here: one adapter)."""
        return {}

    def _rows_per_source(self, micro_batches: list[dict]) -> torch.Tensor:
        n = len(self.source_names)
        if not n:
            return torch.zeros(0, dtype=torch.float64)
        return sum(b["records"].sum(0) for b in micro_batches).double()

    def evaluate(self, step: int = 0) -> dict[str, float]:
        """The objective's eval figures (loss and perplexity, DPO's loss and rewards, or GRPO's rewards of greedy
        answers, whose table is logged at every evaluation); with eval.generation_rows, the task metrics of
        greedy answers. The objective keeps its answers: the final evaluation's become the sample table."""
        objective = self.objective
        figures = objective.evaluate(self.model, self.eval_pass, self.ctx, self.tokenizer)
        answers = objective.answers
        if objective.answers_artifact and answers is not None:
            self.tracker.log_table(answers | {"step": [step] * len(answers["prompt"])}, objective.answers_artifact)
        self.eval_loss, self.eval_figures, self.eval_step = figures.get("eval_loss"), figures, step
        return figures

    def rank_evaluation(self, step: int) -> bool:
        """Keep the best evaluation by train.best_metric (with train.export=best, its adapter weights: a
        collective, taken on every rank alike since the figures are reduced over all ranks); True when
        train.early_stopping_patience evaluations in a row have not beaten it."""
        if self.best.update(step, self.eval_figures) and self.cfg.train.export == "best":
            self.best_adapter = gather_trainable_state(self.model)
        return self.best.patience_spent

    def sample_table(self) -> dict[str, list] | None:
        """`train.sample_prompts` generations: the final evaluation's answers, with each row's scores, when it
        answered that many (or every eval row); else decoded now."""
        cfg, count, objective = self.cfg, self.cfg.train.sample_prompts, self.objective
        if not count:
            return None
        answers = objective.answers
        if answers is not None and (objective.answers_hold_every_eval_row or cfg.eval.generation_rows >= count):
            return {column: values[:count] for column, values in answers.items()}
        return generation_table(self.model, self.objective.prompts(self.eval_pass()), self.tokenizer, count,
                                cfg.train.sample_max_new_tokens, self.ctx.device, "train.sample_max_new_tokens")

    def save_checkpoint(self, step: int, summary: dict[str, float] | None = None) -> None:
        """A sharded checkpoint (with train.checkpoint_adapter, the PEFT adapter of the step in its `adapter/`),
        reported with the step's figures: its evaluation's, if it had one (a sweep's scheduler ranks by them),
        and with `summary` the run's (the driver reads it from Ray Train, not from MLflow)."""
        position = TrainerState(step, self.batches.pass_index, self.batches.rows_into_pass, self.scheduler.state_dict(),
                                self.state.initial_eval_loss, self.train_loss, self.best.state(), self.stopped_early,
                                self.state.initial_eval, self.adapters_state())
        adapter = gather_trainable_state(self.model) if self.cfg.train.checkpoint_adapter else None
        evaluation = self.eval_figures if self.eval_step == step else {}

        def write(directory: Path) -> None:
            save_training_state(directory, self.model, self.optimizer, position, self.ctx.device, self.best_adapter,
                                self.batches.state())
            if adapter is not None and self.ctx.is_main:
                save_adapter(self.model, adapter, directory / "adapter", self.tokenizer, self.cfg.to_yaml())

        t_save = time.perf_counter()
        self.checkpoints.save(write, {"step": step, "train_loss": self.train_loss, **evaluation, **(summary or {})})
        self.save_seconds = time.perf_counter() - t_save
        self.tracker.log_metrics({"checkpoint_save_seconds": self.save_seconds}, step)

    def adapters_state(self) -> dict:
        """What a checkpoint keeps of each adapter trained side by side (none here: one adapter)."""
        return {}

    def finish(self) -> dict[str, float]:
        """Every collective first (final eval, sample decoding, adapter gather, peak memory, the last
        checkpoint), then rank 0 writes the adapter to the run directory and only then uploads: a slow
        tracking server never holds other ranks in a collective."""
        ctx = self.ctx
        if not self.eval_figures:  # resumed from the final checkpoint: nothing trained in this attempt
            self.evaluate(self.step)
        samples = self.sample_table()  # every rank decodes in lockstep
        last_weights = gather_trainable_state(self.model)
        summary = {"steps": self.step, "final_train_loss": self.train_loss,
                   "final_eval_loss": self.eval_loss, "initial_eval_loss": self.state.initial_eval_loss,
                   **{f"final_{k}": v for k, v in self.eval_figures.items() if k not in eval_metrics(0.0)},
                   **{f"initial_{k}": v for k, v in self.state.initial_eval.items() if k not in eval_metrics(0.0)},
                   **self.meter.summary(), **self.batches.run_figures(),
                   "time_to_first_step_seconds": self.time_to_first_step,
                   **self.startup.seconds,
                   "peak_memory_gb_max_over_workers": max_over_ranks(peak_memory_gb(ctx.device), ctx),
                   "worker_seconds": time.perf_counter() - self.started,
                   "best_step": self.best.step, "best_value": self.best.value,
                   "final_workers": ctx.world_size,  # the last attempt's group: the figures above are its own
                   "stopped_early": float(self.stopped_early), **self.adapter_figures()}
        if self.checkpoints:
            self.save_checkpoint(self.step, summary)
        if ctx.is_main and self.run_dir is not None:
            with tempfile.TemporaryDirectory(prefix="adapter-") as staged:
                self.write_adapter(Path(staged), last_weights)
                self.run_dir.publish_adapter(Path(staged))
                self.tracker.log_artifacts(Path(staged), "adapter")
        if samples is not None:
            self.tracker.log_table(samples, "eval/sample_generations.json")
        # an attempt that trained no step (resumed to redo the export) has no throughput: nothing to overwrite
        # (the start-up points were logged at step 0; the summary carries them to the driver)
        finite = {k: v for k, v in summary.items()
                  if v is not None and math.isfinite(v) and not k.startswith("startup_")}
        self.tracker.log_metrics(finite, self.step, once_per_step=False)
        return summary


def real_tokens(micro_batches: list[dict]) -> torch.Tensor:
    """Tokens that are not padding: the throughput figure counts only these."""
    return sum(b["length"].sum() for b in micro_batches).to(torch.float64)
