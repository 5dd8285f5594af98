"""What the driver checks before Ray starts: what reads only files (the model's directory, every data source
and its records), so that the commonest mistakes cost a second, once the plan has its model's folder and commit. What
loads the model stack is checked while Ray starts (app/launch/model_checks.py). Either way one line naming
the key, file or line."""

from __future__ import annotations

import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import TYPE_CHECKING

from app.config.adapters import data_streams
from app.config.distill import teacher_model
from app.config.objectives import objective_of
from app.config.schema import FinetuneConfig
from app.config.sections import DataSection
from app.data.gym_tasks import is_task_source, questions_of
from app.data.sources import DataSource, checked_records, resolve_source, source_digest
from app.errors import UserInputError, first_line
from app.model.files import check_model_files
from app.plan.model_source import hub_revision_decision, model_folder_decisions, teacher_folder_decisions
from app.plan.plan import Plan
from app.plan.rollout_sizing import check_asked_engine
from app.runs.layout import RunDir

if TYPE_CHECKING:  # read before torch loads: the files' checks run first
    from app.model.adapter import FrozenAdapter


@dataclass(frozen=True)
class CheckedSources:
    train: list[DataSource]  # one per data.train_path source
    eval: DataSource | None
    train_rows: list[int]  # records of each train source (-1: remote, counted when read)
    eval_rows: int
    train_digests: list[str]  # app.data.sources.source_digest of each train source
    eval_digest: str | None
    adapters: dict[str, CheckedSources]  # adapters' own data, by stream (app.config.adapters.data_streams)

    def datasets(self) -> list[tuple[str, DataSource, str]]:
        """(context, source, digest) of every source the job reads, its adapters' included ("train/<name>")."""
        own = [("train", source, digest) for source, digest in zip(self.train, self.train_digests, strict=True)]
        own += [("eval", self.eval, self.eval_digest)] if self.eval else []
        return own + [(f"{context}/{name}", source, digest) for name, sources in self.adapters.items()
                      for context, source, digest in sources.datasets()]

    def every_train_source(self) -> tuple[list[str], list[str]]:
        """(locations, digests) of the job's train sources, then each adapter's: what a resumed run must find."""
        train = [(source.location, digest) for source, digest in zip(self.train, self.train_digests, strict=True)]
        train += [pair for sources in self.adapters.values() for pair in zip(*sources.every_train_source())]
        return [location for location, _ in train], [digest for _, digest in train]


@dataclass(frozen=True)
class CheckedInputs(CheckedSources):
    tokenizer: object
    init_adapter: dict | None = None  # model.init_adapter's weights (saved key -> tensor)
    init_adapter_sha256: str | None = None  # of its weights file: a resumed run must start from the same
    teacher: FrozenAdapter | None = None  # distill.teacher_adapter's LoRA settings and weights
    teacher_sha256: str | None = None  # of its weights file: recorded with the run


def plan_files(cfg: FinetuneConfig) -> tuple[Plan, CheckedSources]:
    """Before Ray starts: the plan's first decisions (the model's folder, a hub model's commit:
    app/plan/model_source.py), a rollout engine asked for that cannot run the model, then what reads files alone
    (the model's directory, every data source and record: the commonest mistakes)."""
    plan = Plan(cfg).decided(*model_folder_decisions(cfg), *teacher_folder_decisions(cfg))
    plan = plan.decided(*hub_revision_decision(plan.cfg))
    check_asked_engine(plan.cfg)
    return plan, checked_sources(plan.cfg)


def checked_sources(cfg: FinetuneConfig) -> CheckedSources:
    """What reads files alone (no torch, no transformers): the model's directory (and a teacher's of its own), the
    data sources and every local record, the job's and each adapter's."""
    check_model_files(cfg.model)
    if cfg.distill.teacher and objective_of(cfg.train).taught:
        try:
            check_model_files(teacher_model(cfg.model, cfg.distill))
        except UserInputError as e:
            raise UserInputError(str(e).replace("model.path=", "distill.teacher=", 1)) from None
    own = set(data_streams(cfg.adapters, cfg.data).values()) - {""}  # each data of adapters' own, once
    adapters = {adapter.name: checked_data(adapter.data_of(cfg.data), f"adapters.{adapter.name}.", {})
                for adapter in cfg.adapters if adapter.name in own}
    return checked_data(cfg.data, "data.", adapters)


def checked_data(data: DataSection, key: str, adapters: dict[str, CheckedSources]) -> CheckedSources:
    """One data section's sources and records; errors name `key` (data. or adapters.<name>.) and the field."""
    eval_ = resolve_source(data.eval_path, f"{key}eval_path") if data.eval_path else None
    held_out = frozenset(questions_of(eval_.files[0])) if is_task_source(data.eval_path) else frozenset()
    train = [resolve_source(path, f"{key}train_path", held_out) for path in data.train_paths]
    train_rows = [checked_records(source, data.format, f"{key}train_path", data.split) for source in train]
    eval_rows = checked_records(eval_, data.format, f"{key}eval_path", data.split) if eval_ else -1
    return CheckedSources(train, eval_, train_rows, eval_rows, [source_digest(source) for source in train],
                          source_digest(eval_) if eval_ else None, adapters)


def check_tracking_server(uri: str, timeout_s: float = 10.0) -> None:
    """A tracking server must answer before anything starts: the job opens its MLflow run before training (the run
    id names where every step is logged). Any HTTP answer will do (its /health needs no credentials)."""
    if not uri.startswith(("http://", "https://")):
        return
    try:
        urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=timeout_s).close()
    except urllib.error.HTTPError:
        return  # it answers (behind a proxy that wants credentials, say)
    except (OSError, ValueError) as e:  # refused, unresolvable, timed out
        reason = e.reason if isinstance(getattr(e, "reason", None), BaseException) else e
        raise UserInputError(f"mlflow.tracking_uri={uri}: the tracking server does not answer "
                             f"({first_line(reason, 200)}); start it (cluster/local-up.sh starts one), or point "
                             "mlflow.tracking_uri at one that runs; nothing has started") from None


def check_resumed_data(run_dir: RunDir, train_paths: list[str], digests: list[str]) -> None:
    """A resumed run trains on the data it started with: its passes continue where they stopped only over the same
    rows. Data vanished since is refused by the source checks; data changed since, here, before Ray starts."""
    started = run_dir.recorded_train_digests()
    if started is None or started == digests:  # None: recorded by a version that kept no digests
        return
    if len(started) != len(digests):
        raise UserInputError(f"--resume: data.train_path names {len(digests)} sources, and run {run_dir.name} "
                             f"started with {len(started)}; name the sources it started with, or start a new run")
    path, was, now = next((p, a, b) for p, a, b in zip(train_paths, started, digests) if a != b)
    raise UserInputError(f"--resume: data.train_path={path} changed since run {run_dir.name} started (digest {was} "
                         f"then, {now} now): its passes would hold other rows; put the data back as it was, or start "
                         "a new run (another train.run_name)")
