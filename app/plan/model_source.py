"""What the driver decides about the model's source before Ray starts, reading files and the hub alone (no torch):
the folder every later step reads (a GGUF file dequantized, a packaged model built) and a hub model's commit."""

from __future__ import annotations

import re

from app.config.objectives import objective_of
from app.config.paths import looks_local
from app.config.schema import FinetuneConfig
from app.errors import UserInputError, first_line
from app.model.gguf import dequantized_folder
from app.model.packaged import ensure_packaged
from app.plan.plan import Decision


def model_folder_decisions(cfg: FinetuneConfig) -> tuple[Decision, ...]:
    """A GGUF model's dequantized folder in place of the file, and a packaged model built: every later step (the
    workers, the planner, sharded loading, the adapter's recorded base) reads an ordinary folder."""
    ensure_packaged(cfg.model.path)
    folder = dequantized_folder(cfg.model.path, cfg.model.gguf_file)
    if folder == cfg.model.path:
        return ()
    return (Decision("model.path", folder, f"{folder} (the dequantized folder of {cfg.model.path})"),
            Decision("model.gguf_file", None))


def teacher_folder_decisions(cfg: FinetuneConfig) -> tuple[Decision, ...]:
    """distill.teacher, a model of its own, as an ordinary folder too (a GGUF file dequantized, a packaged model
    built)."""
    teacher = cfg.distill.teacher
    if teacher is None or not objective_of(cfg.train).taught:  # a leftover distill section: nothing to build
        return ()
    ensure_packaged(teacher)
    folder = dequantized_folder(teacher, None, key="distill.teacher")
    return () if folder == teacher else (Decision("distill.teacher", folder, f"{folder} (the dequantized folder "
                                                                             f"of {teacher})"),)


def hub_revision_decision(cfg: FinetuneConfig) -> tuple[Decision, ...]:
    """A hub model's revision (a branch, a tag, or none: main) resolved to its commit here, in the driver:
    every worker then loads the same weights even if the branch moves during the run, the run is tagged
    with the commit, and a resume can check it still trains the same model."""
    path, revision = cfg.model.path, cfg.model.revision
    if looks_local(path) or "://" in path or (revision and re.fullmatch(r"[0-9a-f]{40}", revision)):
        return ()
    from huggingface_hub import HfApi  # start-up: only a hub model needs it (seconds of imports)

    try:
        sha = HfApi().model_info(path, revision=revision).sha
    except Exception as e:  # no network, no such repo or revision, a gated repo without HF_TOKEN
        raise UserInputError(f"model.path={path}: cannot resolve revision {revision or 'main'} on the hub "
                             f"({first_line(e, 200)}); check the id, HF_TOKEN, or give a local directory") from None
    return (Decision("model.revision", sha, f"{sha} (the commit of {revision or 'main'} now)"),)

