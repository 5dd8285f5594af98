"""What one step computes, token by token: every token of the step laid end to end in one row (a decoding
sequence's next token, a new prompt's chunk), with its slot and position, and what the attention function needs to
read each token's own sequence from the cache.

A decoding token attends to its slot's positions up to its own; the decoding tokens are attended together, their
slots read as one view of the cache (`decode_rows`: a range when they are consecutive, as they are unless a slot
moved this step). A prompt chunk (`Segment`) attends causally to its own earlier positions: to the cache's columns
before it, when the prompt came in several chunks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from app.engine.cache import SlotCache


@dataclass(frozen=True)
class Segment:
    """`length` tokens of one prompt, from flat token `first`, at positions start..start+length-1 of `slot`."""

    first: int
    slot: int
    start: int
    length: int


@dataclass
class StepLayout:
    cache: SlotCache
    input_ids: torch.Tensor  # [1, tokens]
    position_ids: torch.Tensor  # [1, tokens]
    token_slots: torch.Tensor  # [tokens]
    decoding: int  # the step's first tokens are one decoding token each
    decode_rows: slice | torch.Tensor  # their slots, in the same order
    decode_lengths: torch.Tensor  # [decoding]: positions each attends to (its own included)
    decode_width: int  # positions of each slot read: the longest's, or the cache's whole capacity when that is
    # not much more (the slots' whole rows are one compact block: matrix products read it without a copy)
    segments: list[Segment]
    masks: dict[int | None, torch.Tensor] = field(default_factory=dict)  # decoding masks, by sliding window

    @property
    def tokens(self) -> int:
        return self.input_ids.shape[1]

    def decode_mask(self, window: int | None, dtype: torch.dtype) -> torch.Tensor:
        """[decoding, 1, 1, width]: 0 where a decoding token attends, -inf elsewhere (past its own position, or
        before a sliding window)."""
        if window not in self.masks:
            columns = torch.arange(self.decode_width, device=self.decode_lengths.device)
            lengths = self.decode_lengths[:, None]
            attends = columns < lengths
            if window is not None:
                attends &= columns >= lengths - window
            mask = torch.zeros(attends.shape, dtype=dtype, device=attends.device)
            self.masks[window] = mask.masked_fill_(~attends, float("-inf"))[:, None, None, :]
        return self.masks[window]


def step_layout(cache: SlotCache, decoding: list[tuple[int, int, int]], chunks: list[tuple[int, int, list[int]]],
                device: torch.device) -> StepLayout:
    """The layout of a step: `decoding` (slot, position, token) for each decoding sequence, then `chunks` (slot,
    start, tokens) for each prompt chunk; the flat tokens in that order."""
    ids, positions, slots, segments = [], [], [], []
    for slot, position, token in decoding:
        ids.append(token)
        positions.append(position)
        slots.append(slot)
    for slot, start, tokens in chunks:
        segments.append(Segment(len(ids), slot, start, len(tokens)))
        ids += tokens
        positions += range(start, start + len(tokens))
        slots += [slot] * len(tokens)
    decode_slots = [slot for slot, _, _ in decoding]
    consecutive = bool(decoding) and decode_slots == list(range(decode_slots[0], decode_slots[0] + len(decoding)))
    as_tensor = lambda values: torch.tensor(values, dtype=torch.long).to(device, non_blocking=True)
    longest = max((position + 1 for _, position, _ in decoding), default=0)
    width = cache.capacity if consecutive and 2 * longest >= cache.capacity else longest
    return StepLayout(
        cache=cache, input_ids=as_tensor(ids)[None], position_ids=as_tensor(positions)[None],
        token_slots=as_tensor(slots), decoding=len(decoding),
        decode_rows=slice(decode_slots[0], decode_slots[-1] + 1) if consecutive else as_tensor(decode_slots),
        decode_lengths=as_tensor([position + 1 for _, position, _ in decoding]), decode_width=width,
        segments=segments)
