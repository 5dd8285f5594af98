"""Loading a config: a YAML file plus `--set section.key=value` overrides -> one validated FinetuneConfig,
with its paths made absolute where they will be read, its defaults filled in (run name, tracking URI) and no
credentials in it. Every mistake is one UserInputError line that names the key, file or value.
"""

from __future__ import annotations

import difflib
import os
import re
import time
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from app.config import paths
from app.config.objectives import objective_of
from app.config.rollout import MOVED_FROM_GRPO
from app.config.schema import FinetuneConfig, entry_model
from app.errors import UserInputError, first_line
from app.runs.layout import OutputDir

LISTS = ("adapters",)  # fields that are lists of entries, not sections


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    section, _, key = dotted.partition(".")
    if section in LISTS:  # every entry at once: --set 'adapters=[{name: a, r: 8}, ...]'
        if key:
            raise UserInputError(f"--set {dotted}: {section} is a list of entries, set whole: "
                                 f"--set '{section}=[{{name: a, r: 8}}, {{name: b, learning_rate: 1e-3}}]'")
        tree[section] = value
        return
    if section not in FinetuneConfig.model_fields or not key or "." in key:
        raise UserInputError(f"--set {dotted}: unknown key{_suggest(dotted)}; keys look like section.key")
    fields = entry_model(FinetuneConfig.model_fields[section]).model_fields
    if key not in fields:
        raise UserInputError(f"--set {dotted}: unknown key{_suggest(dotted)}")
    tree.setdefault(section, {})
    if not isinstance(tree[section], dict):
        raise UserInputError(f"config section '{section}' must be a mapping")
    tree[section][key] = value


def _all_keys() -> list[str]:
    return [*LISTS, *(f"{s}.{k}" for s, f in FinetuneConfig.model_fields.items() if s not in LISTS
                      for k in f.annotation.model_fields)]


def _suggest(dotted: str) -> str:
    section, _, key = dotted.partition(".")
    if section == "grpo" and key in MOVED_FROM_GRPO:
        return f" (it moved to the rollout section: set rollout.{MOVED_FROM_GRPO[key]})"
    close = difflib.get_close_matches(dotted, _all_keys(), n=1)
    return f" (did you mean {close[0]}?)" if close else ""


def _one_line(err: ValidationError, source: str) -> str:
    first = err.errors()[0]
    where = ".".join(str(p) for p in first["loc"])
    if first["type"] == "extra_forbidden":
        return f"{source}: unknown key '{where}'{_suggest(where)}"
    if first["type"] == "value_error":  # our own cross-field checks carry their message
        return f"{source}: {first['msg'].removeprefix('Value error, ')}"
    got = first.get("input")
    got = "" if isinstance(got, dict) else f" (got {got!r})"
    return f"{source}: {where}: {first['msg']}{got}"


def load_config(path: str | os.PathLike | None, overrides: list[str] = ()) -> FinetuneConfig:
    """YAML file (optional) + `key=value` overrides -> validated config with absolute local paths."""
    tree: dict[str, Any] = {}
    source = "config"
    if path is not None:
        source = str(path)
        if not Path(path).is_file():
            raise UserInputError(f"--config {path}: no such file; the shipped configs are in jobs/configs/")
        try:
            tree = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
        except yaml.YAMLError as e:
            raise UserInputError(f"{path}: not valid YAML: {first_line(e)}") from None
        except UnicodeDecodeError as e:
            raise UserInputError(f"--config {path}: not UTF-8 text (byte {e.start}); save it as UTF-8") from None
        except OSError as e:
            raise UserInputError(f"--config {path}: cannot read it ({e.strerror})") from None
        if not isinstance(tree, dict):
            raise UserInputError(f"{path}: the top level must be a mapping of sections (model:, lora:, ...)")
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep:
            raise UserInputError(f"--set {item}: expected key=value, e.g. --set train.max_steps=50")
        try:
            value = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError as e:
            raise UserInputError(f"--set {item}: the value is not valid YAML ({first_line(e)}); quote it, "
                                 "e.g. --set 'key=\"a: b\"'") from None
        _set_dotted(tree, key.strip(), value)
    try:
        cfg = FinetuneConfig.model_validate(tree)
    except ValidationError as e:
        raise UserInputError(_one_line(e, source)) from None
    stamp = time.strftime("%Y%m%d-%H%M%S")
    stem = re.sub(r"[^A-Za-z0-9._=,+-]+", "-", Path(path).stem if path else "finetune").strip(".-") or "finetune"
    try:
        return _resolved(cfg, default_run_name=f"{stem.replace('..', '.')}-{stamp}")
    except ValidationError as e:
        raise UserInputError(_one_line(e, source)) from None


def _template_text(template: str | None) -> str | None:
    """data.chat_template as the template itself: a file's contents travel to every worker with the config."""
    if template is None or "{" in template:
        return template
    path = Path(template).expanduser()
    if not path.is_file():
        raise UserInputError(f"data.chat_template={template}: neither a Jinja template (no '{{' in it) nor a file")
    return path.read_text()


def _resolved(cfg: FinetuneConfig, default_run_name: str) -> FinetuneConfig:
    """Paths made absolute where they will be read (app/config/paths.py), defaults filled in, credentials left out."""
    out_dir = paths.output_dir(cfg.train.output_dir)
    tracking_uri = resolve_tracking_uri(cfg.mlflow.tracking_uri, OutputDir(out_dir))
    record_format = objective_of(cfg.train).record_format  # one pair or prompt a row
    return cfg.with_set({
        "model.path": paths.input_path(cfg.model.path),
        "model.init_adapter": paths.adapter_source(cfg.model.init_adapter),
        "distill.teacher": paths.input_path(cfg.distill.teacher) if cfg.distill.teacher else None,
        "distill.teacher_adapter": paths.adapter_source(cfg.distill.teacher_adapter),
        "data.train_path": (paths.input_path(cfg.data.train_path) if isinstance(cfg.data.train_path, str)
                            else [paths.input_path(p) for p in cfg.data.train_path]),
        "data.eval_path": paths.input_path(cfg.data.eval_path),
        "adapters": [adapter.with_paths(paths.input_path).model_dump(exclude_none=True) for adapter in cfg.adapters],
        "data.chat_template": _template_text(cfg.data.chat_template),
        "data.format": record_format or cfg.data.format,
        "data.packing": cfg.data.packing and not record_format,
        "train.output_dir": out_dir, "train.run_name": cfg.train.run_name or default_run_name,
        "train.best_metric": _best_metric(cfg),
        "grpo.reward_funcs": [paths.function_source(spec) for spec in cfg.grpo.reward_funcs],
        "mlflow.tracking_uri": tracking_uri,
    })


def _best_metric(cfg: FinetuneConfig) -> str:
    """train.best_metric as given, or the objective's headline figure (a grpo run has no eval loss: eval_reward)."""
    if "best_metric" not in cfg.train.model_fields_set:
        return objective_of(cfg.train).best_metric
    return cfg.train.best_metric


def resolve_tracking_uri(configured: str | None, output: OutputDir) -> str:
    """mlflow.tracking_uri, else $MLFLOW_TRACKING_URI, else the local store under the output directory.

    The config, and so every param, artifact, summary and log line made from it, holds the URI without
    the credentials that $MLFLOW_TRACKING_URI may carry (`https://user:pass@host`); a process that talks
    to MLflow moves them to MLflow's variables itself (paths.export_tracking_credentials)."""
    uri = configured or os.environ.get("MLFLOW_TRACKING_URI")
    if uri is None:
        if not output.is_local:
            raise UserInputError(f"train.output_dir={output.root} is a URI, where no local MLflow store can live: "
                                 "set mlflow.tracking_uri (or $MLFLOW_TRACKING_URI) to a tracking server")
        uri = f"sqlite:///{output.mlflow_store}"
    return paths.without_credentials(uri)
