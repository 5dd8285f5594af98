"""The base model and its tokenizer: loaded whole with `from_pretrained`, or built weightless on the meta
device (to check a config, plan memory, or load each rank's slices: app/model/slices.py).

`from_pretrained` is the one loading path: a hub id, a local checkpoint of a real model and the embedded
default all go through it. Weights load from safetensors only; remote code runs only when
`model.trust_remote_code` is set.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from app.errors import UserInputError
from app.model.hardware import torch_dtype

if TYPE_CHECKING:  # importable without pydantic: benchmarks/step.py runs on a bare GPU box
    from app.config.sections import LoraSection, ModelSection


def load_tokenizer(model: ModelSection, chat_template: str | None = None):
    """The model's tokenizer; `chat_template` (data.chat_template) replaces its own template."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model.path, revision=model.revision,
                                              trust_remote_code=model.trust_remote_code)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


def load_base_model(model: ModelSection, device: torch.device | str = "cpu"):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        model.path, revision=model.revision, dtype=torch_dtype(model.dtype, device), use_safetensors=True,
        trust_remote_code=model.trust_remote_code, device_map=None, attn_implementation=model.attn_implementation,
    ).to(device)


def build_meta_base_model(model_cfg: ModelSection, config_file: str | None = None):
    """The base model with every parameter on the meta device and tied weights tied; buffers (rotary
    tables, which no checkpoint holds) are computed on the CPU as usual. Reads only the model's config and
    generation config (or `config_file`, a config.json of any model shape)."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    if config_file:
        fields = json.loads(Path(config_file).read_text())
        config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    else:
        config = AutoConfig.from_pretrained(model_cfg.path, revision=model_cfg.revision,
                                            trust_remote_code=model_cfg.trust_remote_code)
    with init_empty_weights(include_buffers=False):
        base = AutoModelForCausalLM.from_config(config, dtype=torch_dtype(model_cfg.dtype),
                                                trust_remote_code=model_cfg.trust_remote_code,
                                                attn_implementation=model_cfg.attn_implementation)
    base.tie_weights()  # init_empty_weights re-creates every parameter, which unties lm_head from the embedding
    if not config_file:
        base.generation_config = checkpoint_generation_config(model_cfg, base.generation_config)
    return base


def checkpoint_generation_config(model_cfg: ModelSection, default):
    """The checkpoint's generation_config.json, as from_pretrained reads it (`default` where it has none): its
    eos ids may name end-of-turn tokens that config.json lacks, which decoding stops on."""
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(model_cfg.path, revision=model_cfg.revision)
    except OSError:
        return default


def enable_activation_checkpointing(model, every_n_layers: int = 1) -> None:
    """Non-reentrant checkpointing (works with a frozen base without enable_input_require_grads) of every n-th
    decoder layer: selective checkpointing, transformers' own."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False},
                                          every_n_layers=every_n_layers)
    model.config.use_cache = False


def check_lora_targets(model: ModelSection, lora: LoraSection) -> None:
    """Every name in lora.target_modules must match a module of the model.

    Checked on a weightless copy of the architecture (meta device), so it costs a second even for a
    70B model, and a typo fails here instead of in every worker after the cluster has started.
    """
    if lora.target_modules == "all-linear":
        return
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model.path, revision=model.revision, trust_remote_code=model.trust_remote_code)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config, trust_remote_code=model.trust_remote_code)
    leaf_names = {name.rsplit(".", 1)[-1] for name, _ in skeleton.named_modules()}
    missing = [t for t in lora.target_modules if t not in leaf_names]
    if missing:
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in skeleton.named_modules() if isinstance(m, torch.nn.Linear)})
        raise UserInputError(f"lora.target_modules: {missing} match no module of {model.path}; "
                             f"its linear layers are {linear}")
