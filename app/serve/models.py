"""The served model: one base and its adapters, each found from where the user says it is, and the base
checked against what the adapters were trained on.

An adapter names its base in its run's `finetune_config.yaml` (model.path, model.revision) or, failing
that, PEFT's `adapter_config.json`; a registered version (models:/NAME/VERSION) also records the sha256
of a local base's weights in its MLmodel metadata. Every adapter served together must name the same
base (the same sha256 where both have one, else the same path and revision), and a base with a
recorded sha256 is loaded only if its weights have it: a mismatch is refused in one line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from app.runs.layout import ADAPTER, ADAPTER_RUN_CONFIG


@dataclass(frozen=True)
class Base:
    path: str
    revision: str | None = None
    sha256: str | None = None

    def same_as(self, other: Base) -> bool:
        if self.sha256 and other.sha256:
            return self.sha256 == other.sha256
        return (_where(self.path), self.revision) == (_where(other.path), other.revision)

    def __str__(self) -> str:
        return self.path + (f"@{self.revision}" if self.revision else "") + \
            (f" (sha256 {self.sha256[:12]})" if self.sha256 else "")


def _where(path: str) -> str:
    return str(Path(path).resolve()) if Path(path).exists() else path


def adapter_folder(source: str, output_dir: str = "outputs") -> Path:
    """A local adapter folder for `source`: a folder, a run name under `output_dir`, or models:/NAME/VERSION
    (the registered MLflow Model's adapter artifact, downloaded)."""
    if source.startswith("models:/"):
        import mlflow

        return Path(mlflow.artifacts.download_artifacts(f"{source.rstrip('/')}/artifacts/adapter"))
    for candidate in (Path(source), Path(output_dir) / source / ADAPTER):
        if (candidate / "adapter_config.json").exists():
            return candidate
    raise ValueError(f"adapter {source}: neither an adapter folder, a run under {output_dir}, nor models:/NAME/VERSION")


def base_of(adapter: Path, source: str = "") -> Base:
    """The base model an adapter was trained on: the run's recorded model.path and revision, and for a
    registered version the sha256 recorded with it."""
    import yaml

    recorded = adapter / ADAPTER_RUN_CONFIG
    if recorded.exists():
        model = yaml.safe_load(recorded.read_text())["model"]
        path, revision = model["path"], model.get("revision")
    else:
        path, revision = json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"], None
    sha256 = None
    if source.startswith("models:/"):
        import mlflow

        metadata = mlflow.models.Model.load(source.rstrip("/")).metadata or {}
        sha256, revision = metadata.get("base_model_sha256"), metadata.get("base_model_revision", revision)
    return Base(path, revision, sha256)


def check_base(path: str, recorded: Base, who: str) -> None:
    """Refuse a local base whose weights differ from the sha256 recorded for `who`."""
    from app.serve.pyfunc import weights_digest

    if recorded.sha256 and Path(path).is_dir() and (found := weights_digest(Path(path))) != recorded.sha256:
        raise ValueError(f"base {path}: its weights' sha256 {found[:12]} is not {recorded.sha256[:12]}, the base "
                         f"{who} was trained on")


def load(adapters: dict[str, str], base: str | None = None, output_dir: str = "outputs"):
    """(PeftModel with every adapter, tokenizer): the adapters by name, on the base they all name (or
    `base`, checked against their recorded sha256)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from app.model.build import peft_on_transformers_5

    folders = {name: adapter_folder(source, output_dir) for name, source in adapters.items()}
    bases = {name: base_of(folders[name], source) for name, source in adapters.items()}
    first, *others = bases
    for name in others:
        if not bases[name].same_as(bases[first]):
            raise ValueError(f"adapters {first} and {name} were trained on different bases ({bases[first]} vs "
                             f"{bases[name]}): serve them separately")
    path = base or bases[first].path
    revision = bases[first].revision if _where(path) == _where(bases[first].path) else None
    for name in {recorded.sha256: name for name, recorded in bases.items() if recorded.sha256}.values():
        check_base(path, bases[name], f"adapter {name}")  # the base's bytes hashed once per recorded digest
    # the run saved its tokenizer with the adapter; a bare PEFT folder has none: the base's then
    tokenizer = AutoTokenizer.from_pretrained(next(
        (f for f in folders.values() if (f / "tokenizer_config.json").exists()), path), revision=revision)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(path, revision=revision, dtype=torch.float32)
    with peft_on_transformers_5():
        model = PeftModel.from_pretrained(model, folders[first], adapter_name=first).eval()
        for name in others:
            model.load_adapter(folders[name], adapter_name=name)
    return model, tokenizer
