"""reasoning-gym tasks as data, reward and metric: procedurally generated problems, each with its own answer
checker (`score_answer`), the environment library RL frameworks use.

A source names a task, its size, seed and parameters, anywhere a data path goes:

    rg://chain_sum?size=2000&seed=1&min_terms=2&max_terms=2&min_digits=1&max_digits=1

The driver generates it once into a JSONL file under `.cache/reasoning_gym/` (the cluster's shared storage in a
job), and from there it takes the same Ray Data path as any file. Each record serves every objective:

    {"messages": [user: question, assistant: answer]}    SFT (data.format auto: chat)
    {"prompt": [user: question]}                          GRPO (data.format prompt), the policy samples the answer
    "answer", "task", "metadata" (JSON)                   what the rewards read (TRL's signature: as columns)

Train and eval rows are kept apart by content: a train source drops every problem whose question an eval
source asks (tasks with a small space, such as one-digit sums, repeat questions across seeds), and says so.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

from app.config.paths import input_path
from app.errors import UserInputError, first_line, warn

SCHEME = "rg://"
CACHE = ".cache/reasoning_gym"
NUMBER = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?")
ANSWER_TAG = re.compile(r"<answer>\s?(.*?)\s?</answer>", re.DOTALL)


@dataclass(frozen=True)
class TaskSpec:
    name: str
    size: int
    seed: int
    params: tuple[tuple[str, object], ...] = ()

    @property
    def key(self) -> str:
        """The generated file's name: the task and a digest of everything that shapes its records."""
        digest = hashlib.sha256(json.dumps([self.name, self.size, self.seed, self.params]).encode()).hexdigest()
        return f"{self.name}-{digest[:12]}"


def is_task_source(location: str | None) -> bool:
    return bool(location) and location.startswith(SCHEME)


def task_name(location: str) -> str:
    """The task a source names (a short name for the source in metrics and tags)."""
    return urlsplit(location).netloc or location


def _value(text: str) -> object:
    try:
        return json.loads(text)  # numbers, true/false, lists
    except json.JSONDecodeError:
        return text


def parse_spec(location: str, key: str) -> TaskSpec:
    """`rg://NAME?size=N&seed=S&param=value...` -> TaskSpec; one line naming the key when it is wrong."""
    parts = urlsplit(location)
    pairs = [item.partition("=") for item in parts.query.split("&") if item]  # not parse_qsl: '+' stays a plus
    params = {unquote(k): _value(unquote(v)) for k, _, v in pairs}
    size, seed = params.pop("size", None), params.pop("seed", None)
    if not parts.netloc or not isinstance(size, int) or not isinstance(seed, int) or size <= 0:
        raise UserInputError(f"{key}={location}: a reasoning-gym source is rg://TASK?size=N&seed=S[&param=value...] "
                             "with a positive size and an integer seed")
    return TaskSpec(parts.netloc, size, seed, tuple(sorted(params.items())))


def task_entries(spec: TaskSpec, key: str) -> list[dict]:
    """The task's problems, as reasoning-gym generates them: {question, answer, metadata}."""
    import reasoning_gym  # start-up: 1.5 s of imports, for the jobs that read a task only

    if spec.name not in reasoning_gym.factory.DATASETS:
        raise UserInputError(f"{key}: reasoning-gym has no task {spec.name!r}; its tasks are "
                             f"{', '.join(sorted(reasoning_gym.factory.DATASETS))}")
    try:
        dataset = reasoning_gym.create_dataset(spec.name, size=spec.size, seed=spec.seed, **dict(spec.params))
        return list(dataset)
    except (TypeError, ValueError, AssertionError) as e:  # an unknown parameter, or one out of its range
        raise UserInputError(f"{key}: reasoning-gym task {spec.name} refuses {dict(spec.params)} "
                             f"({first_line(e, 200) or type(e).__name__})") from None


def task_record(entry: dict, task: str) -> dict:
    question = [{"role": "user", "content": entry["question"]}]
    return {"messages": question + [{"role": "assistant", "content": str(entry["answer"])}], "prompt": question,
            "answer": str(entry["answer"]), "task": task, "metadata": json.dumps(entry["metadata"], default=str)}


def questions_of(file: str | Path) -> set[str]:
    """The questions a task source's generated file asks."""
    return {json.loads(line)["prompt"][0]["content"] for line in Path(file).read_text().splitlines() if line}


def write_task_source(location: str, key: str, held_out: set[str] = frozenset(), cache: str | None = None) -> Path:
    """Generate a task source's records into its JSONL file (once for the same spec and held-out set); the
    problems whose questions are in `held_out` are left out, with one line saying how many."""
    spec = parse_spec(location, key)
    entries = task_entries(spec, key)
    records = [task_record(e, spec.name) for e in entries if e["question"] not in held_out]
    dropped = len(entries) - len(records)
    if not records:
        raise UserInputError(f"{key}={location}: every one of its {len(entries)} problems is also an eval problem "
                             f"(the task's space is too small to keep them apart); widen its parameters")
    if dropped:
        warn(f"{key}={location}: {dropped} of {len(entries)} problems ask an eval question and are left out "
             f"(the task's space is small), {len(records)} train")
    suffix = hashlib.sha256("\n".join(sorted(held_out)).encode()).hexdigest()[:8] if dropped else "all"
    out = Path(cache or input_path(CACHE)) / f"{spec.key}-{suffix}.jsonl"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        partial = out.with_name(f"{out.name}.partial-{os.getpid()}")
        partial.write_text("".join(json.dumps(r) + "\n" for r in records))
        os.rename(partial, out)
    return out


# ---- answers: what a completion says, and the task's own score of it ----

def completion_text(completion) -> str:
    """A completion as TRL passes it: a string, or [{"role": "assistant", "content": ...}]."""
    return completion[0]["content"] if isinstance(completion, list) else str(completion)


def lenient_answer(text: str, reference: str) -> str:
    """The answer a text gives: its last <answer> tag; else, where the reference is a number, the last number in
    it; else the text itself."""
    tagged = strict_answer(text)
    if tagged is not None:
        return tagged
    if NUMBER.fullmatch(reference.strip()):
        numbers = NUMBER.findall(text)
        return numbers[-1] if numbers else ""
    return text.strip()


def strict_answer(text: str) -> str | None:
    """The answer inside the text's last <answer>...</answer> tag; None when it has none."""
    tags = ANSWER_TAG.findall(text)
    return tags[-1].strip() if tags else None


@functools.cache
def get_score_fn(task: str):
    """The task's own `score_answer(answer, entry)`."""
    from reasoning_gym import get_score_answer_fn  # start-up: as in task_entries

    return get_score_answer_fn(task)


def _scores(completions, answer, task, metadata, extract) -> list[float]:
    scores = []
    for completion, reference, name, meta in zip(completions, answer, task, metadata):
        reference = str(reference)  # a reader may have typed a numeric answer column as numbers
        entry = {"answer": reference, "metadata": json.loads(meta) if isinstance(meta, str) else meta}
        given = extract(completion_text(completion), reference)
        scores.append(float(get_score_fn(name)(given, entry)) if given is not None else 0.0)
    return scores


def score_answer(completions, answer, task, metadata, **kwargs) -> list[float]:
    """Reward (TRL's signature, grpo.reward_funcs: app.data.gym_tasks:score_answer): the task's own
    `score_answer` of the completion's answer (its <answer> tag, else its last number for a numeric task)."""
    return _scores(completions, answer, task, metadata, lenient_answer)


def score_answer_strict(completions, answer, task, metadata, **kwargs) -> list[float]:
    """As score_answer, but only an answer inside <answer>...</answer> counts (0 without the tag)."""
    return _scores(completions, answer, task, metadata, lambda text, _: strict_answer(text))


def answer_match(prediction: str, reference: str) -> float:
    """eval.metrics function (app.data.gym_tasks:answer_match, logged as eval_answer_match) for SFT's held-out
    answers, where only the reference is known: the answer a prediction gives, scored as reasoning-gym's
    arithmetic tasks score theirs (numbers up to sign, commas, leading zeros and trailing decimals), other
    answers by equality."""
    from reasoning_gym.utils import compute_decimal_reward  # start-up: as in task_entries

    given = lenient_answer(prediction, reference)
    if NUMBER.fullmatch(reference.strip()):
        return float(compute_decimal_reward(given, oracle_answer=reference.strip(), strip_commas=True))
    return float(given == reference.strip())
