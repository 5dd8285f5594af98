"""Whether a model path can load at all: the checks that read only its directory (no torch, no transformers),
run by the driver before Ray starts and by the planner."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from app.errors import UserInputError

if TYPE_CHECKING:
    from app.config.sections import ModelSection


def check_model_files(model: ModelSection) -> None:
    """Fail fast, in the driver, on a model path that cannot load."""
    path = Path(model.path)
    if path.is_absolute() or path.exists():
        if not path.is_dir():
            raise UserInputError(f"model.path={model.path}: no such directory; build the embedded model with "
                                 "`make embedded`, or give a Hugging Face model directory or hub id")
        if not (path / "config.json").is_file():
            raise UserInputError(f"model.path={model.path}: no config.json there; "
                                 "expected a directory written by save_pretrained")
        if not any(path.glob("*.safetensors")):
            raise UserInputError(f"model.path={model.path}: no *.safetensors weights; convert the "
                                 "checkpoint to safetensors (pickled .bin weights are not loaded)")
        config = json.loads((path / "config.json").read_text())
        if config.get("quantization_config"):
            raise UserInputError(f"model.path={model.path} is quantized (quantization_config in config.json); "
                                 "LoRA + FSDP2 here trains on unquantized weights: give the bf16/fp16/fp32 checkpoint")
        auto_map = config.get("auto_map")
        if auto_map and not model.trust_remote_code:
            raise UserInputError(f"model.path={model.path} needs custom code (auto_map in config.json); "
                                 "review it, then set model.trust_remote_code=true")
