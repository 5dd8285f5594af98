"""Held-out rewards of an adapter, computed outside the product: plain transformers + PEFT, greedy decoding.

Each prompt record ({"prompt": str or messages, "answer": str, other columns}) is rendered with the tokenizer's
own chat template (add_generation_prompt) and answered greedily by base + adapter (or the base alone); each
reward function (TRL's signature: completions, the record's columns) scores the answers, and its mean is reported.

    python -m benchmarks.exact_match --base .cache/embedded/model --adapter outputs/<run>/adapter \\
        --prompts .cache/embedded/data/grpo_eval.jsonl [--adapter outputs/<other run>/adapter ...] \\
        [--reward app.data.gym_tasks:score_answer ...] [--max-new-tokens 24]

Prints one JSON line per adapter: prompts and each reward function's mean (keyed by its name).
"""

from __future__ import annotations

import argparse
import json

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

from app.train.rewards import load_reward_function

EMBEDDED_REWARDS = ("jobs/rewards.py:exact_words", "jobs/rewards.py:words_in_place")


def greedy_answers(base_path: str, adapter: str | None, records: list[dict], max_new_tokens: int = 16) -> list[str]:
    tokenizer = AutoTokenizer.from_pretrained(adapter or base_path)
    model = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    if adapter:
        model = PeftModel.from_pretrained(model, adapter)
    model.eval()
    answers = []
    with torch.no_grad():
        for record in records:
            prompt = record["prompt"] if isinstance(record["prompt"], list) else [
                {"role": "user", "content": record["prompt"]}]
            ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, return_tensors="pt",
                                                return_dict=True)["input_ids"]
            out = model.generate(input_ids=ids, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
            answers.append(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    return answers


def held_out_rewards(base_path: str, adapter: str | None, prompts: str, rewards=EMBEDDED_REWARDS,
                     max_new_tokens: int = 16, max_prompts: int = 0) -> dict:
    """{"adapter", "prompts", <reward function name>: its mean over the greedy answers}."""
    records = [json.loads(line) for line in open(prompts) if line.strip()][:max_prompts or None]
    answers = greedy_answers(base_path, adapter, records, max_new_tokens)
    completions = [[{"role": "assistant", "content": a}] if isinstance(r["prompt"], list) else a
                   for a, r in zip(answers, records)]
    columns = {key: [r.get(key) for r in records] for key in records[0] if key != "prompt"}
    result = {"adapter": adapter, "prompts": len(records)}
    for spec in rewards:
        scores = load_reward_function(spec)(completions=completions, prompts=[r["prompt"] for r in records],
                                            **columns)
        result[spec.rpartition(":")[2]] = sum(scores) / len(records)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", required=True)
    parser.add_argument("--adapter", action="append", help="an adapter folder (repeatable); none: the base alone")
    parser.add_argument("--prompts", required=True, help="JSONL of prompt records with an `answer`")
    parser.add_argument("--reward", action="append", help="a reward function spec (repeatable); default: "
                        + ", ".join(EMBEDDED_REWARDS))
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--max-prompts", type=int, default=0, help="0: all")
    args = parser.parse_args()
    for adapter in args.adapter or [None]:
        print(json.dumps(held_out_rewards(args.base, adapter, args.prompts, args.reward or EMBEDDED_REWARDS,
                                          args.max_new_tokens, args.max_prompts)), flush=True)


if __name__ == "__main__":
    main()
