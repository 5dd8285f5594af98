"""Where the paths of a config point: the same config must work on a laptop and under `ray job submit`.

Locally, relative paths resolve against the current directory. Under `ray job submit` the current
directory is Ray's unpacked copy of the upload, shared by jobs with the same code and deleted when Ray
evicts it: nothing may be written there, and what .gitignore lists (.cache/) was never uploaded. So in
a job, relative paths that the upload does not hold resolve against the cluster's shared storage,
`$FINETUNE_STORAGE` (cluster/local-up.sh and the manifests set it), and a relative output directory
always does (or the job stops with one line, before anything starts).
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import unquote, urlsplit, urlunsplit

from app.environment import STORAGE_ENV, in_ray_job, shared_storage
from app.errors import UserInputError


def looks_local(path: str) -> bool:
    """A path, not a hub id: it starts with '.', '/' or '~', has a data file's suffix, has other than
    exactly one '/' (a hub id is `org/name`), or exists (here, or in a job on the shared storage)."""
    on_storage = in_ray_job() and shared_storage() and Path(_join(shared_storage(), path)).exists()
    return (path.startswith((".", "/", "~")) or path.count("/") != 1
            or Path(path).suffix in {".jsonl", ".json", ".parquet"} or Path(path).exists() or bool(on_storage))


def input_path(path: str | None) -> str | None:
    """A model or data location made absolute; URIs and hub ids stay as they are."""
    if path is None or "://" in path or not looks_local(path):
        return path
    p = Path(path).expanduser()
    if not p.is_absolute() and in_ray_job() and not p.exists() and shared_storage():
        return _join(shared_storage(), path)
    return str(p.resolve())


def adapter_source(source: str | None) -> str | None:
    """model.init_adapter: an adapter folder here made absolute; anything else (a run name, models:/) as it is."""
    folder = Path(source).expanduser() if source and ":/" not in source else None
    return str(folder.resolve()) if folder and (folder / "adapter_config.json").is_file() else source


def function_source(spec: str) -> str:
    """A user function `file.py:name` with its file made absolute where it will be read: locally from here; in
    a job, a file the uploaded working directory holds stays relative (every worker reads its own copy of that
    directory). `package.module:name` stays as it is."""
    where, _, name = spec.rpartition(":")
    if not where.endswith(".py"):
        return spec
    path = Path(where).expanduser()
    if path.is_absolute() or (in_ray_job() and path.exists()):
        return spec
    return f"{path.resolve()}:{name}"


def embedded_root(path: str | None) -> Path | None:
    """The `.cache/embedded` folder a local path lies in, if it does: where the embedded demo's model and its
    data are (the defaults read it; jobs/embedded.py builds it)."""
    if not path or "://" in path:
        return None
    parts = Path(path).parts
    for i in range(len(parts) - 1):
        if parts[i : i + 2] == (".cache", "embedded"):
            return Path(*parts[: i + 2])
    return None


def output_dir(path: str) -> str:
    """train.output_dir as an absolute path or URI; in a job, never inside the job's working directory."""
    if "://" in path or Path(path).expanduser().is_absolute():
        return path if "://" in path else str(Path(path).expanduser())
    if in_ray_job():
        if not shared_storage():
            raise UserInputError(
                f"train.output_dir={path} is relative, and under `ray job submit` that is Ray's temporary copy "
                f"of the upload: give an absolute path or URI every node reaches (e.g. s3://bucket/runs), or "
                f"set {STORAGE_ENV} on the cluster (cluster/local-up.sh and cluster/k8s do)")
        return _join(shared_storage(), path)
    return str(Path(path).resolve())


def _join(root: str, relative: str) -> str:
    relative = relative.removeprefix("./")
    return f"{root.rstrip('/')}/{relative}" if "://" in root else str(Path(root) / relative)


def why_unwritable(path: Path) -> str | None:
    """Why no directory can be made or written at `path` (a file in the way, a parent this process may not
    write to), or None."""
    for existing in (path, *path.parents):
        if existing.exists():
            if not existing.is_dir():
                return f"{existing} is a file, not a directory"
            return None if os.access(existing, os.W_OK | os.X_OK) else f"{existing} is not writable"
    return None


def without_credentials(uri: str) -> str:
    """`https://user:pass@host/x` -> `https://host/x`; other URIs unchanged."""
    parts = urlsplit(uri)
    if not parts.username and not parts.password:
        return uri
    return urlunsplit(parts._replace(netloc=parts.netloc.rsplit("@", 1)[1]))


def export_credentials(uri: str) -> str:
    """`https://user:pass@host/x` -> `https://host/x`, with user and password moved to the environment
    variables MLflow's client reads (MLFLOW_TRACKING_USERNAME / _PASSWORD); other URIs unchanged."""
    parts = urlsplit(uri)
    for variable, value in (("MLFLOW_TRACKING_USERNAME", parts.username), ("MLFLOW_TRACKING_PASSWORD", parts.password)):
        if value is not None:
            os.environ.setdefault(variable, unquote(value))
    return without_credentials(uri)


def export_tracking_credentials() -> None:
    """The user and password of $MLFLOW_TRACKING_URI moved to MLFLOW_TRACKING_USERNAME / _PASSWORD: the
    explicit step of a process that talks to MLflow (loading a config leaves the environment alone)."""
    export_credentials(os.environ.get("MLFLOW_TRACKING_URI", ""))
