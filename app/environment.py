"""Where this process runs, as its environment says: the driver of a `ray job submit` job (and its id), and
the cluster's shared storage for run files (`$FINETUNE_STORAGE`, set by cluster/local-up.sh and the manifests).
Read-only facts, imported by the layers that resolve paths and claim runs."""

from __future__ import annotations

import json
import os

STORAGE_ENV = "FINETUNE_STORAGE"
RAY_JOB_CONFIG_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"  # what Ray gives the driver of a `ray job submit` job


def in_ray_job() -> bool:
    """True in the driver of a `ray job submit` job."""
    return bool(os.environ.get(RAY_JOB_CONFIG_ENV))


def ray_job_id() -> str | None:
    """The submission id of the `ray job submit` job this driver runs in; None outside one."""
    return json.loads(os.environ.get(RAY_JOB_CONFIG_ENV) or "{}").get("metadata", {}).get("job_submission_id")


def shared_storage() -> str | None:
    return os.environ.get(STORAGE_ENV) or None


def joins_a_cluster() -> bool:
    """True under `ray job submit` or with RAY_ADDRESS set: a job then joins that cluster."""
    return bool(os.environ.get("RAY_ADDRESS")) or in_ray_job()
