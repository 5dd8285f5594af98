"""GGUF checkpoints as a model source: dequantized once, by transformers' own GGUF loader, into an ordinary
safetensors folder (model, tokenizer, chat template, generation config) that every later step loads with a
plain `from_pretrained`. Workers, the planner and sharded loading never see the GGUF file: they read the
folder, like any other checkpoint.

The folder is a cache keyed by the file's name, size and a hash of its first bytes, under `.cache/gguf/`
(under `ray job submit`: the cluster's shared storage, as the embedded demo is); it is written once, under a
lock, and lands with a rename, never half-written.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import sys
from pathlib import Path

from app.config.paths import input_path
from app.errors import UserInputError, first_line

GGUF_SUFFIX = ".gguf"
CACHE = ".cache/gguf"
HASHED_BYTES = 16 * 2**20  # the header and the first tensors: enough to tell two files of one size apart


def gguf_source(path: str, gguf_file: str | None = None) -> tuple[Path, str] | None:
    """(folder, file name) of a GGUF checkpoint: `path` is a .gguf file, or a folder with `gguf_file` in it;
    None for any other model path."""
    if gguf_file:
        return Path(path), gguf_file
    if path.endswith(GGUF_SUFFIX) and "://" not in path:
        return Path(path).parent, Path(path).name
    return None


def file_key(file: Path) -> str:
    digest = hashlib.sha256(str(file.stat().st_size).encode())
    with open(file, "rb") as f:
        digest.update(f.read(HASHED_BYTES))
    return f"{file.stem}-{digest.hexdigest()[:12]}"


def dequantized_folder(path: str, gguf_file: str | None = None, cache: str | None = None,
                       key: str = "model.path") -> str:
    """The safetensors folder of a GGUF model (written here the first time); any other path as it is. `key`
    names where the path came from in errors (a command's --base)."""
    source = gguf_source(path, gguf_file)
    if source is None:
        return path
    folder, name = source
    file = folder / name
    if not file.is_file():
        raise UserInputError(f"{'model.gguf_file' if gguf_file else key}: no GGUF file {file}; give the path of a "
                             ".gguf file (or a folder and model.gguf_file)")
    out = Path(cache or input_path(CACHE)) / file_key(file)
    if not (out / "config.json").is_file():
        write_once(file, out, key)
    return str(out)


def write_once(file: Path, out: Path, key: str = "model.path") -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f"{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (out / "config.json").is_file():  # written by another process while this one waited
            return
        print(f"dequantizing {file} into {out} (once)", file=sys.stderr, flush=True)
        partial = out.with_name(f"{out.name}.partial-{os.getpid()}")
        try:
            save_dequantized(file, partial, key)
            os.rename(partial, out)
        finally:
            shutil.rmtree(partial, ignore_errors=True)


def save_dequantized(file: Path, out: Path, key: str) -> None:
    """Load `file` with transformers' GGUF support (float32: the quantized values exactly), drop the GGUF
    quantization record that forbids saving, and write the checkpoint, tokenizer and generation config."""
    import torch  # start-up: the commands that take a model path import this module before they need torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {"gguf_file": file.name}
    try:
        tokenizer = AutoTokenizer.from_pretrained(file.parent, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(file.parent, dtype=torch.float32, **kwargs)
    except ImportError as e:  # the gguf package is missing
        raise UserInputError(f"{key}={file}: {first_line(e)}") from None
    except (ValueError, KeyError, NotImplementedError) as e:  # an architecture or a quantization it cannot read
        raise UserInputError(f"{key}={file}: transformers cannot dequantize this GGUF file "
                             f"({first_line(e, 200)}); give a safetensors checkpoint of the model instead") from None
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
