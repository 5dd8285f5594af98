"""The served model: one base and its adapters (found by app/tracking/adapters.py), all on the base they
were trained on. Every adapter served together must name the same base (the same sha256 where both have one,
else the same path and revision), and a base with a recorded sha256 is loaded only if its weights have it: a
mismatch is refused in one line.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from app.model.adapter import peft_on_transformers_5
from app.tracking.adapters import adapter_folder, base_of, check_base, same_location


@dataclass(frozen=True)
class ServedFiles:
    """Where the served weights are: the base (a folder or hub id, at a revision) and each adapter's folder."""

    base: str
    revision: str | None
    folders: dict[str, Path]

    @property
    def tokenizer_source(self) -> str | Path:
        """The run saved its tokenizer with the adapter; a bare PEFT folder has none: the base's then."""
        return next((f for f in self.folders.values() if (f / "tokenizer_config.json").exists()), self.base)


def served_files(adapters: dict[str, str], base: str | None = None, output_dir: str = "outputs") -> ServedFiles:
    """The adapters' folders by name and the base they all name (or `base`, checked against their recorded
    sha256)."""
    folders = {name: adapter_folder(source, output_dir) for name, source in adapters.items()}
    bases = {name: base_of(folders[name], source) for name, source in adapters.items()}
    first, *others = bases
    for name in others:
        if not bases[name].same_as(bases[first]):
            raise ValueError(f"adapters {first} and {name} were trained on different bases ({bases[first]} vs "
                             f"{bases[name]}): serve them separately")
    path = base or bases[first].path
    revision = bases[first].revision if same_location(path, bases[first].path) else None
    for name in {recorded.sha256: name for name, recorded in bases.items() if recorded.sha256}.values():
        check_base(path, bases[name], f"adapter {name}")  # the base's bytes hashed once per recorded digest
    return ServedFiles(path, revision, folders)


def load_tokenizer(files: ServedFiles):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(files.tokenizer_source, revision=files.revision)
    tokenizer.padding_side = "left"
    return tokenizer


def load_model(files: ServedFiles, dtype=None):
    """A PeftModel with every adapter (each under its name) on the base, in `dtype` (fp32 unless given)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(files.base, revision=files.revision, dtype=dtype or torch.float32)
    (first, folder), *others = files.folders.items()
    with peft_on_transformers_5():
        model = PeftModel.from_pretrained(model, folder, adapter_name=first).eval()
        for name, other in others:
            model.load_adapter(other, adapter_name=name)
    return model


def load(adapters: dict[str, str], base: str | None = None, output_dir: str = "outputs", dtype=None):
    """(PeftModel with every adapter, tokenizer)."""
    files = served_files(adapters, base, output_dir)
    return load_model(files, dtype), load_tokenizer(files)
