"""Held-out exact match of an adapter, computed outside the product: plain transformers + PEFT, greedy decoding.

Each prompt record ({"prompt": str or messages, "answer": str}) is rendered with the adapter's tokenizer's own
chat template (add_generation_prompt) and answered greedily by base + adapter; an answer is right when its
words are the reference's (up to case and spacing). The reward file's functions score the same answers.

    python -m benchmarks.exact_match --base .cache/embedded/model --adapter outputs/<run>/adapter \\
        --prompts .cache/embedded/data/grpo_eval.jsonl [--adapter outputs/<other run>/adapter ...]

Prints one JSON line per adapter: prompts, exact match, mean words-in-place reward.
"""

from __future__ import annotations

import argparse
import json

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

from jobs.rewards import exact_words, words_in_place


def greedy_answers(base_path: str, adapter: str, records: list[dict], max_new_tokens: int = 16) -> list[str]:
    tokenizer = AutoTokenizer.from_pretrained(adapter)
    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, adapter).eval()
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


def exact_match(base_path: str, adapter: str, prompts: str, max_prompts: int = 0) -> dict:
    records = [json.loads(line) for line in open(prompts) if line.strip()][:max_prompts or None]
    answers = greedy_answers(base_path, adapter, records)
    references = [r["answer"] for r in records]
    return {"adapter": adapter, "prompts": len(records),
            "exact_match": sum(exact_words(answers, references)) / len(records),
            "words_in_place": sum(words_in_place(answers, references)) / len(records)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", required=True)
    parser.add_argument("--adapter", required=True, action="append", help="an adapter folder (repeatable)")
    parser.add_argument("--prompts", required=True, help="JSONL of prompt records with an `answer`")
    parser.add_argument("--max-prompts", type=int, default=0, help="0: all")
    args = parser.parse_args()
    for adapter in args.adapter:
        print(json.dumps(exact_match(args.base, adapter, args.prompts, args.max_prompts)), flush=True)


if __name__ == "__main__":
    main()
