"""Preference pairs a model makes itself: several answers sampled per problem, scored by the task's own checker,
and a right answer paired against a wrong one (RLAIF-free, verifiable: the pairs need no judge and no labels).
DPO on them moves the model toward what it already gets right sometimes. Plain torch: `jobs.sample_pairs` runs
it with the policy's own Sampler (app/train/sampling.py).
"""

from __future__ import annotations

import numpy as np

from app.config.rollout import RolloutSection
from app.data.prompts import prompt_ids
from app.train.rewards import score
from app.train.sampling import Sampler


def answers(sampler: Sampler, tokenizer, records: list[dict], rollout: RolloutSection, seed: int,
            problems_per_batch: int = 8) -> list[list[str]]:
    """rollout.num_generations sampled answers (text) to each record's prompt."""
    texts: list[list[str]] = []
    for start in range(0, len(records), problems_per_batch):
        batch = records[start:start + problems_per_batch]
        done = sampler.sample([prompt_ids(tokenizer, r) for r in batch], rollout, seed + start)
        decoded = [tokenizer.decode(c.ids, skip_special_tokens=True).strip() for c in done]
        texts += [decoded[i * rollout.num_generations:(i + 1) * rollout.num_generations] for i in range(len(batch))]
    return texts


def right_and_wrong(records: list[dict], sampled: list[list[str]], reward: str) -> list[dict]:
    """One pair per problem that has both: its first answer scored 1 (chosen) against its first scored below 1
    (rejected), as preference_chat records that keep the problem's other fields."""
    pairs = []
    for record, texts in zip(records, sampled):
        columns = {k: [v] * len(texts) for k, v in record.items() if k not in ("prompt", "messages")}
        scores = score([reward], [record["prompt"]] * len(texts), texts, [[]] * len(texts), columns)[:, 0]
        right, wrong = np.flatnonzero(scores >= 1.0), np.flatnonzero(scores < 1.0)
        if len(right) and len(wrong):
            pairs.append({**{k: v for k, v in record.items() if k != "messages"},
                          "chosen": [{"role": "assistant", "content": texts[right[0]]}],
                          "rejected": [{"role": "assistant", "content": texts[wrong[0]]}]})
    return pairs
