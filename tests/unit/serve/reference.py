"""What the served answers are compared with: plain PEFT generation, one prompt at a time, no server."""

from __future__ import annotations

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

QUESTION = [{"role": "user", "content": "Write 347 in words."}]


def random_adapter(base, folder, seed: int, r: int = 8):
    """A LoRA adapter with random (non-zero) weights: it changes what the base answers."""
    torch.manual_seed(seed)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base),
                           LoraConfig(r=r, lora_alpha=64, target_modules="all-linear", init_lora_weights=False))
    model.save_pretrained(folder)
    return folder


def plain_greedy(base, adapter, messages=QUESTION, max_new_tokens: int = 12) -> str:
    """The answer as every engine sends it: never half a character (one still being spelled out by byte tokens when
    the tokens run out, which decoding shows as U+FFFD, is not sent)."""
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                        return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.eval().generate(input_ids=ids, max_new_tokens=max_new_tokens, do_sample=False,
                                    pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).rstrip("\ufffd")


def plain_logprobs(base, adapter, ids: list[int]) -> list[float]:
    """Each token's log-probability after the ones before it (the first has none), by plain PEFT alone."""
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    with torch.no_grad():
        logits = model.eval()(input_ids=torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, -1)[:-1].gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1).tolist()
