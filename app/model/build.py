"""Base model + tokenizer loading, the LoRA adapter, activation checkpointing.

`from_pretrained` is the one loading path: a hub id, a local checkpoint of a real model and the
embedded default all go through it. Weights load from safetensors only; remote code runs only
when `model.trust_remote_code` is set.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from typing import TYPE_CHECKING

import torch

from app.errors import UserInputError
from app.model.hardware import torch_dtype
from app.model.lora_init import init_lora_weights, rows_of_loaded_model

if TYPE_CHECKING:  # importable without pydantic: benchmarks/step.py runs on a bare GPU box
    from app.config.schema import LoraSection, ModelSection


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


def apply_lora(base, lora: LoraSection, seed: int, reference: bool = False):
    """Wrap `base` in a PEFT LoRA model: base frozen, adapter weights in fp32.

    Its initial weights are set by app.model.lora_init afterwards, from the seed, the same on every rank and
    for either loading path (or by app.model.init_adapter, from a trained adapter). With `reference`, a second
    adapter of the same shape, frozen and without dropout, for DPO's reference (app.model.init_adapter.REFERENCE).
    """
    from peft import LoraConfig, get_peft_model

    from app.model.init_adapter import REFERENCE

    torch.manual_seed(seed)
    config = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, use_dora=lora.use_dora,
                        use_rslora=lora.use_rslora, target_modules=lora.target_modules, task_type="CAUSAL_LM",
                        bias="none")
    with peft_on_transformers_5():
        model = get_peft_model(base, config, autocast_adapter_dtype=True)  # upcasts LoRA weights to fp32
        if reference:  # PEFT leaves an added adapter frozen while "default" is the active one
            frozen = copy.deepcopy(config)
            frozen.lora_dropout, frozen.inference_mode = 0.0, True
            model.add_adapter(REFERENCE, frozen)
    return model


@contextlib.contextmanager
def peft_on_transformers_5():
    """Around PEFT's model wrapping and adapter loading: PEFT 0.21 reads transformers 5's deprecated
    `is_gradient_checkpointing`, a FutureWarning in every job's and server's log that no setting of ours
    causes (PEFT's to change)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        yield


def enable_activation_checkpointing(model) -> None:
    """Non-reentrant checkpointing: works with a frozen base without enable_input_require_grads."""
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False


def build_lora_model(model_cfg: ModelSection, lora_cfg: LoraSection, seed: int, device="cpu", reference: bool = False):
    model = apply_lora(load_base_model(model_cfg, device), lora_cfg, seed, reference)
    init_lora_weights(model, seed, rows_of_loaded_model(model))
    if model_cfg.gradient_checkpointing:
        enable_activation_checkpointing(model)
    return model
