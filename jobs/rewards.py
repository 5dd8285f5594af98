"""Reward functions for the embedded GRPO demo (spelling numbers out), written as for TRL's GRPOTrainer:
`f(prompts, completions, **columns) -> list[float | None]`, so the same file runs there unchanged.

Each record has an `answer` column (the number in words); a completion is a string for a plain prompt, or
[{"role": "assistant", "content": ...}] for a conversational one.
"""


def _text(completion) -> str:
    return completion[0]["content"] if isinstance(completion, list) else completion


def _words(text: str) -> list[str]:
    return text.lower().replace("-", " - ").split()


def exact_words(completions, answer, **kwargs) -> list[float]:
    """1 when the completion spells the number exactly (up to case and spacing), else 0."""
    return [float(_words(_text(c)) == _words(a)) for c, a in zip(completions, answer)]


def words_in_place(completions, answer, **kwargs) -> list[float]:
    """Partial credit: the share of words in the right place, over the longer of the two spellings (a missing
    or an extra word costs as much as a wrong one)."""
    scores = []
    for completion, reference in zip(completions, answer):
        got, want = _words(_text(completion)), _words(reference)
        scores.append(sum(g == w for g, w in zip(got, want)) / max(len(got), len(want), 1))
    return scores
