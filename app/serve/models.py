"""The served model: one base and its adapters (found by app/tracking/adapters.py), all on the base they
were trained on. Every adapter served together must name the same base (the same sha256 where both have one,
else the same path and revision), and a base with a recorded sha256 is loaded only if its weights have it: a
mismatch is refused in one line.
"""

from __future__ import annotations

from app.model.adapter import peft_on_transformers_5
from app.tracking.adapters import adapter_folder, base_of, check_base, same_location


def load(adapters: dict[str, str], base: str | None = None, output_dir: str = "outputs"):
    """(PeftModel with every adapter, tokenizer): the adapters by name, on the base they all name (or
    `base`, checked against their recorded sha256)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

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
