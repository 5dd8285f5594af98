"""Held-out reward accuracy of a DPO adapter, computed outside the product: plain transformers + PEFT.

For each pair, the implicit reward of an answer is beta x (log p_policy(answer | prompt) - log p_ref(answer |
prompt)), the policy being base + adapter and the reference the same model with the adapter disabled (or, for
a run that started from a trained adapter, base + that adapter: --reference-adapter); a pair is right when the
chosen answer's reward beats the rejected one's. The prompt is rendered with the tokenizer's
own chat template (add_generation_prompt), the answer is what the template adds after it.

    python -m benchmarks.reward_accuracy --base .cache/embedded/model --adapter outputs/<run>/adapter \\
        --pairs .cache/embedded/data/preference_eval.jsonl

Prints one JSON line: pairs, reward accuracy, mean margin (beta from the adapter's run config).
"""

from __future__ import annotations

import argparse
import json

import torch
import yaml
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

from app.runs.layout import ADAPTER_RUN_CONFIG


def answer_logp(model, tokenizer, prompt: list[dict], answer: list[dict]) -> float:
    before = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
    full = tokenizer.apply_chat_template(prompt + answer, tokenize=False)
    prompt_ids = tokenizer(before, add_special_tokens=False, return_tensors="pt")["input_ids"]
    answer_ids = tokenizer(full[len(before):], add_special_tokens=False, return_tensors="pt")["input_ids"]
    ids = torch.cat([prompt_ids, answer_ids], dim=1)
    log_probs = model(input_ids=ids).logits[0, prompt_ids.shape[1] - 1:-1].float().log_softmax(-1)
    return log_probs.gather(-1, answer_ids[0, :, None]).sum().item()


def messages(record: dict) -> tuple[list[dict], list[dict], list[dict]]:
    """(prompt, chosen, rejected) of a {"prompt", "chosen", "rejected"} record with strings or messages."""
    if isinstance(record["prompt"], str):
        return ([{"role": "user", "content": record["prompt"]}],
                *([{"role": "assistant", "content": record[side]}] for side in ("chosen", "rejected")))
    return record["prompt"], record["chosen"], record["rejected"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", required=True)
    parser.add_argument("--adapter", required=True)
    parser.add_argument("--pairs", required=True, help="JSONL of preference records")
    parser.add_argument("--max-pairs", type=int, default=0, help="0: all")
    parser.add_argument("--reference-adapter", help="the adapter the run started from (model.init_adapter), its "
                        "DPO reference; default: the base")
    args = parser.parse_args()
    with open(f"{args.adapter}/{ADAPTER_RUN_CONFIG}") as f:  # the run's config, saved beside its adapter
        beta = yaml.safe_load(f)["dpo"]["beta"]
    print(json.dumps(reward_accuracy(args.base, args.adapter, args.pairs, beta, args.max_pairs,
                                     args.reference_adapter)))


def reward_accuracy(base_path: str, adapter: str, pairs: str, beta: float, max_pairs: int = 0,
                    reference_adapter: str | None = None) -> dict:
    """Reward accuracy and mean margin of `adapter` (a PEFT folder with its tokenizer) on the first
    `max_pairs` records of `pairs` (0: all), rewards scaled by `beta`, against the base or `reference_adapter`."""
    tokenizer = AutoTokenizer.from_pretrained(adapter)
    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, adapter, adapter_name="policy").eval()
    if reference_adapter:
        model.load_adapter(reference_adapter, adapter_name="reference")
    records = [json.loads(line) for line in open(pairs) if line.strip()]
    right, margins = 0, []
    with torch.no_grad():
        for record in records[:max_pairs or None]:
            prompt, chosen, rejected = messages(record)
            rewards = []
            for answer in (chosen, rejected):
                model.set_adapter("policy")
                policy = answer_logp(model, tokenizer, prompt, answer)
                if reference_adapter:
                    model.set_adapter("reference")
                    reference = answer_logp(model, tokenizer, prompt, answer)
                else:
                    with model.disable_adapter():
                        reference = answer_logp(model, tokenizer, prompt, answer)
                rewards.append(beta * (policy - reference))
            right += rewards[0] > rewards[1]
            margins.append(rewards[0] - rewards[1])
    return {"pairs": len(margins), "reward_accuracy": right / len(margins),
            "reward_margin": sum(margins) / len(margins), "beta": beta}


if __name__ == "__main__":
    main()
