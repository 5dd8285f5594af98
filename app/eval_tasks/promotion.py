"""The gate between a trained adapter and the one in service: a candidate replaces the champion only when it
scores better by at least the margin asked for, on the same tasks scored the same way."""

from __future__ import annotations

from dataclasses import dataclass

NOT_PROMOTED = 3  # jobs.promote's exit code when the gate stays shut (0: promoted; 2: a mistake in the input)


@dataclass(frozen=True)
class Decision:
    promote: bool
    reason: str  # one line


def decide(metric: str, candidate: float, champion: float | None, min_gain: float = 0.0,
           higher_is_better: bool = True, names: tuple[str, str] = ("the candidate", "the champion")) -> Decision:
    """Promote when there is no champion, or the candidate's gain over it (in the better direction) is at
    least `min_gain` and more than nothing."""
    if champion is None:
        return Decision(True, f"{names[0]} becomes the champion: there is none yet ({metric} {candidate:.4g})")
    gain = candidate - champion if higher_is_better else champion - candidate
    figures = f"{metric} {candidate:.4g} for {names[0]} against {champion:.4g} for {names[1]}"
    if gain > 0 and gain >= min_gain:
        return Decision(True, f"promoted: {figures} (a gain of {gain:.4g}, at least {min_gain:g} asked)")
    need = f"a gain of at least {min_gain:g}" if min_gain > 0 else "a gain"
    return Decision(False, f"not promoted: {figures} ({need} is needed, {gain:.4g} found)")
