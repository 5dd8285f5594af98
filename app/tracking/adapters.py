"""An adapter by the name a user gives it: an adapter folder, a run name under the output directory, or a
registered version (models:/NAME/VERSION, or models:/NAME@ALIAS: the version the alias names when asked),
and the base model it was trained on.

An adapter names its base in its run's `finetune_config.yaml` (model.path, model.revision) or, failing
that, PEFT's `adapter_config.json`; a registered version also records the sha256 of a local base's weights in
its MLmodel metadata. A base with a recorded sha256 is used only if its weights have it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from app.errors import UserInputError, first_line
from app.model.packaged import build_packaged, packaged_folder, packaged_name
from app.runs.layout import ADAPTER, ADAPTER_RUN_CONFIG


@dataclass(frozen=True)
class Base:
    path: str
    revision: str | None = None
    sha256: str | None = None

    def same_as(self, other: Base) -> bool:
        if self.sha256 and other.sha256:
            return self.sha256 == other.sha256
        return same_location(self.path, other.path) and self.revision == other.revision

    def __str__(self) -> str:
        return self.path + (f"@{self.revision}" if self.revision else "") + \
            (f" (sha256 {self.sha256[:12]})" if self.sha256 else "")


def same_location(one: str, other: str) -> bool:
    """Whether two model paths name the same place: the same directory, or the same hub id."""
    where = lambda path: str(Path(path).resolve()) if Path(path).exists() else path
    return where(one) == where(other)


def registered_version(client, uri: str) -> tuple[str, str]:
    """(name, version) of models:/NAME/VERSION or models:/NAME@ALIAS, as the registry has them now."""
    from mlflow.exceptions import MlflowException  # start-up: jobs.serve checks its arguments before MLflow loads

    spec = uri.removeprefix("models:/").strip("/")
    name, at, alias = spec.partition("@")
    try:
        if at:
            return name, str(client.get_model_version_by_alias(name, alias).version)
        name, _, version = spec.rpartition("/")
        if not name or not version.isdigit():
            raise UserInputError(f"{uri}: expected models:/NAME/VERSION or models:/NAME@ALIAS")
        return name, str(client.get_model_version(name, version).version)
    except MlflowException as e:
        raise UserInputError(f"{uri}: {first_line(e, 200)}") from None


def pinned(source: str, client=None) -> str:
    """A registry alias as the version it names now (models:/NAME/VERSION); any other source as it is."""
    if not (source.startswith("models:/") and "@" in source):
        return source
    from mlflow.tracking import MlflowClient  # start-up: as above

    return "models:/{}/{}".format(*registered_version(client or MlflowClient(), source))


def adapter_folder(source: str, output_dir: str = "outputs") -> Path:
    """A local adapter folder for `source`: a folder, a run name under `output_dir`, or models:/NAME/VERSION
    (the registered MLflow Model's adapter artifact, downloaded)."""
    if source.startswith("models:/"):
        import mlflow

        return Path(mlflow.artifacts.download_artifacts(f"{pinned(source).rstrip('/')}/artifacts/adapter"))
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
        settings = json.loads((adapter / "adapter_config.json").read_text())
        path, revision = settings.get("base_model_name_or_path") or "an unnamed base", None
    sha256 = None
    if source.startswith("models:/"):
        import mlflow

        metadata = mlflow.models.Model.load(source.rstrip("/")).metadata or {}
        sha256, revision = metadata.get("base_model_sha256"), metadata.get("base_model_revision", revision)
    return Base(located_here(path), revision, sha256)


def located_here(path: str) -> str:
    """A recorded base as this machine has it: a packaged model (`.cache/models/NAME`) that another checkout or
    machine recorded under its own path is this one's copy, built on first use (a registered version's sha256
    still decides whether its weights are the same)."""
    name = packaged_name(path)
    if name is None or Path(path).exists():
        return path
    return str(build_packaged(name, packaged_folder(name)))


def check_base(path: str, recorded: Base, who: str) -> None:
    """Refuse a local base whose weights differ from the sha256 recorded for `who`."""
    from app.tracking.pyfunc import weights_digest  # start-up: the registered model's module imports MLflow

    if recorded.sha256 and Path(path).is_dir() and (found := weights_digest(Path(path))) != recorded.sha256:
        raise ValueError(f"base {path}: its weights' sha256 {found[:12]} is not {recorded.sha256[:12]}, the base "
                         f"{who} was trained on")
