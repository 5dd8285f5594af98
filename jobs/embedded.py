"""The embedded demo: a small Llama-architecture model, its tokenizer and an instruction dataset.

No model hub is reachable where this project is developed and tested, so the demo builds everything
locally, in Hugging Face format, and the job then loads it through the same `from_pretrained` path
that a hub id or a real checkpoint takes.

The task: spell out a number in English words ("Write 347 in words." -> "three hundred forty-seven").
It is compositional, so held-out numbers measure whether the model learned the rule.

Like a real base model, the embedded one is pretrained (briefly, on raw text such as "347 is written
three hundred forty-seven.") before it is saved: it knows the facts but not the chat format, and the
LoRA fine-tune teaches it to answer the instruction. A randomly initialised base would leave LoRA
almost nothing to adapt.

It lives beside the commands, not in the product: they build it on first use (`ensure_embedded`) when a
config reads it; `make embedded` (jobs/build_embedded.py) and the tests' fixture (`build_once`) build it ahead.
"""

from __future__ import annotations

import fcntl
import json
import os
import random
import shutil
import sys
from pathlib import Path

from app.config.paths import embedded_root

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<pad>", "<s>", "<|im_start|>", "<|im_end|>"]

_ONES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
         "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen"]
_TENS = ["", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]
_PROMPTS = ["Write {n} in words.", "Spell out the number {n}.", "How is {n} written in English words?"]


def number_in_words(n: int) -> str:
    """0 <= n < 1000 in English words: 347 -> 'three hundred forty-seven'."""
    if n < 20:
        return _ONES[n]
    if n < 100:
        tens, ones = divmod(n, 10)
        return _TENS[tens] + (f"-{_ONES[ones]}" if ones else "")
    hundreds, rest = divmod(n, 100)
    return f"{_ONES[hundreds]} hundred" + (f" {number_in_words(rest)}" if rest else "")


def _record(n: int, rng: random.Random) -> dict:
    return {"messages": [{"role": "user", "content": rng.choice(_PROMPTS).format(n=n)},
                         {"role": "assistant", "content": number_in_words(n)}]}


def _numbers(seed: int, eval_numbers: int) -> tuple[list[int], list[list[int]], random.Random]:
    """(held-out numbers, the others by digit count, the generator that drew them)."""
    rng = random.Random(seed)
    numbers = list(range(1000))
    rng.shuffle(numbers)
    held_out, seen = numbers[:eval_numbers], numbers[eval_numbers:]
    return held_out, [[n for n in seen if len(str(n)) == d] for d in (1, 2, 3)], rng


def write_dataset(out_dir: Path, train_rows: int = 4000, eval_numbers: int = 100, seed: int = 0) -> None:
    """train.jsonl and eval.jsonl in chat format; the eval numbers never occur in training.

    Training numbers have 1, 2 or 3 digits with equal odds, so short numbers are not drowned out.
    """
    held_out, by_digits, rng = _numbers(seed, eval_numbers)
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "train.jsonl", "w") as f:
        for _ in range(train_rows):
            f.write(json.dumps(_record(rng.choice(rng.choice(by_digits)), rng)) + "\n")
    with open(out_dir / "eval.jsonl", "w") as f:
        for n in sorted(held_out):
            f.write(json.dumps(_record(n, rng)) + "\n")


PREFERENCE_FILES = ("preference_train.jsonl", "preference_eval.jsonl")


def _near_miss(n: int, rng: random.Random) -> int:
    """A number whose spelling is close to n's but wrong: one off in a digit that n has."""
    steps = [s for s in (1, 10, 100) if s <= max(n, 1)] or [1]
    return min(max(n + rng.choice(steps) * rng.choice((-1, 1)), 0), 999) if n else 1


def _pair(n: int, rng: random.Random) -> dict:
    wrong = _near_miss(n, rng)
    wrong = wrong if wrong != n else (n + 1) % 1000
    return {"prompt": rng.choice(_PROMPTS).format(n=n), "chosen": number_in_words(n),
            "rejected": number_in_words(wrong)}


def write_preference_dataset(out_dir: Path, train_pairs: int = 2000, eval_numbers: int = 100, seed: int = 0) -> None:
    """preference_{train,eval}.jsonl: prompt, the right spelling (chosen) and a near miss's (rejected); the
    eval numbers are those of eval.jsonl, never in training. Written in place with a rename."""
    held_out, by_digits, _ = _numbers(seed, eval_numbers)
    rng = random.Random(seed + 1)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, numbers in zip(PREFERENCE_FILES, ([rng.choice(rng.choice(by_digits)) for _ in range(train_pairs)],
                                                 sorted(held_out))):
        partial = out_dir / f"{name}.partial-{os.getpid()}"
        partial.write_text("".join(json.dumps(_pair(n, rng)) + "\n" for n in numbers))
        os.rename(partial, out_dir / name)


PROMPT_FILES = ("grpo_train.jsonl", "grpo_eval.jsonl")


def write_prompt_dataset(out_dir: Path, train_prompts: int = 2000, eval_numbers: int = 100, seed: int = 0) -> None:
    """grpo_{train,eval}.jsonl: a conversational prompt and the number's spelling as `answer`, the column the
    reward functions (jobs/rewards.py) check answers against; the eval numbers are those of eval.jsonl, never
    in training. Written in place with a rename."""
    held_out, by_digits, _ = _numbers(seed, eval_numbers)
    rng = random.Random(seed + 2)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, numbers in zip(PROMPT_FILES, ([rng.choice(rng.choice(by_digits)) for _ in range(train_prompts)],
                                            sorted(held_out))):
        records = [{"prompt": [{"role": "user", "content": rng.choice(_PROMPTS).format(n=n)}],
                    "answer": number_in_words(n)} for n in numbers]
        partial = out_dir / f"{name}.partial-{os.getpid()}"
        partial.write_text("".join(json.dumps(record) + "\n" for record in records))
        os.rename(partial, out_dir / name)


def build_tokenizer(corpus: list[str], vocab_size: int = 512):
    """A byte-level BPE tokenizer (digits split one by one) with a ChatML-style chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                   eos_token="<|im_end|>", chat_template=CHAT_TEMPLATE)


def build_model(vocab_size: int, seed: int = 0):
    """A randomly initialised 4-layer Llama (about 1M parameters)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=3, pad_token_id=0)
    return LlamaForCausalLM(config)


def pretraining_text() -> list[str]:
    return [f"{n} is written {number_in_words(n)}." for n in range(1000)]


def pretrain(model, tokenizer, steps: int = 250, batch_size: int = 64, lr: float = 3e-3, seed: int = 0) -> None:
    """Full-parameter training on raw text about every number 0-999 (what a base model 'knows')."""
    import torch

    torch.manual_seed(seed)
    text = pretraining_text()
    ids = tokenizer(text, add_special_tokens=False, padding="max_length", max_length=24,
                    return_tensors="pt")["input_ids"]
    labels = ids.masked_fill(ids == tokenizer.pad_token_id, -100)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 20) * (1 - s / steps))
    model.train()
    for _ in range(steps):
        rows = torch.randint(0, len(text), (batch_size,))
        model(input_ids=ids[rows], labels=labels[rows]).loss.backward()
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()


def build_embedded(root: Path, seed: int = 0) -> dict[str, str]:
    """Write `root/model` (bf16 weights + tokenizer, Hugging Face format), `root/data/{train,eval}.jsonl`, the
    preference pairs `root/data/preference_{train,eval}.jsonl` and the prompts `root/data/grpo_{train,eval}.jsonl`."""
    import torch

    data_dir, model_dir = root / "data", root / "model"
    write_dataset(data_dir, seed=seed)
    write_preference_dataset(data_dir, seed=seed)
    write_prompt_dataset(data_dir, seed=seed)
    records = [json.loads(line) for line in (data_dir / "train.jsonl").read_text().splitlines()]
    corpus = ["user", "assistant"] + pretraining_text() + [m["content"] for r in records for m in r["messages"]]
    tokenizer = build_tokenizer(corpus)
    model = build_model(len(tokenizer), seed=seed)
    pretrain(model, tokenizer, seed=seed)
    model.to(torch.bfloat16).save_pretrained(model_dir, safe_serialization=True)
    tokenizer.save_pretrained(model_dir)
    return {"model": str(model_dir), "train": str(data_dir / "train.jsonl"), "eval": str(data_dir / "eval.jsonl")}


def ensure_embedded(cfg) -> None:
    """Build the embedded model and data where the config reads them, once, if they are not there yet: what a
    command does before it hands the config to the driver.

    Under `ray job submit` that is the cluster's shared storage ($FINETUNE_STORAGE/.cache/embedded: the
    upload leaves .cache/ out), so the default config works without any override."""
    paths = [cfg.model.path, *cfg.data.train_paths, cfg.data.eval_path]
    for root in {r for r in map(embedded_root, paths) if r is not None}:
        build_once(root)


def build_once(root: Path) -> None:
    """`build_embedded(root)` unless it is built: a lock makes two processes starting at once (two jobs,
    two test workers) build it one time, and the build lands in place with a rename, never half-written."""
    def built() -> bool:
        return (root / "model" / "config.json").exists() and all((root / "data" / f).exists()
                                                                 for f in PREFERENCE_FILES + PROMPT_FILES)

    if built():
        return
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / "embedded.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if built():  # built by another process while this one waited
            return
        if (root / "model" / "config.json").exists():  # built before the pairs or the prompts were part of it
            write_preference_dataset(root / "data")
            write_prompt_dataset(root / "data")
            return
        print(f"building the embedded demo model and data in {root} (once; about a minute)",
              file=sys.stderr, flush=True)
        partial = root.with_name(f"embedded.partial-{os.getpid()}")
        build_embedded(partial)
        if root.exists():
            shutil.rmtree(root)
        os.rename(partial, root)
