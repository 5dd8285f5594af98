"""A sequence's text as it streams: decoded a token at a time, never half a character, never a piece of a stop
sequence that may yet complete.

Decoding is incremental (the tokens since a recent offset decoded again, as vLLM's detokenizer does: a tokenizer may
join a token to the one before it, so a token is never decoded alone), and a character still being spelled out by
byte tokens (U+FFFD at the end) waits for its last byte. The answer ends before the first stop sequence in it; the
text that could begin one is held back until it cannot.
"""

from __future__ import annotations


class TextStream:
    def __init__(self, tokenizer, stops: tuple[str, ...] = ()):
        self.tokenizer, self.stops = tokenizer, stops
        self.tokens: list[int] = []
        self.text = ""  # the tokens' text so far (complete characters)
        self.prefix, self.read = 0, 0  # token offsets: decoded text before `read` is in `text`
        self.sent = 0  # characters handed on
        self.stopped = False

    def push(self, token: int) -> None:
        """One more token; `stopped` once the text holds a stop sequence (the text cut before it)."""
        self.tokens.append(token)
        before = self.decode(self.tokens[self.prefix:self.read])
        after = self.decode(self.tokens[self.prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            searched_from = max(0, len(self.text) - max(map(len, self.stops), default=0))
            self.text += after[len(before):]
            self.prefix, self.read = self.read, len(self.tokens)
            cuts = [i for i in (self.text.find(stop, searched_from) for stop in self.stops) if i >= 0]
            if cuts:
                self.text, self.stopped = self.text[:min(cuts)], True

    def decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True) if tokens else ""

    def delta(self, final: bool) -> str:
        """The text not handed on yet that is certain (all of it once the sequence has ended)."""
        end = len(self.text) if final or self.stopped else len(self.text) - held_back(self.text, self.stops)
        piece = self.text[self.sent:end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return piece


def held_back(text: str, stops: tuple[str, ...]) -> int:
    """How many trailing characters may not be sent yet: the start of a stop sequence (the longest end of `text`
    that begins one). Linear in the stops' length."""
    return max((overlap(text[-(len(stop) - 1):] if len(stop) > 1 else "", stop) for stop in stops), default=0)


def overlap(tail: str, stop: str) -> int:
    """The length of the longest suffix of `tail` that is a prefix of `stop` (Knuth-Morris-Pratt's matcher run
    over `tail`, shorter than `stop`): O(len(stop))."""
    failure, k = [0] * len(stop), 0
    for i in range(1, len(stop)):
        while k and stop[i] != stop[k]:
            k = failure[k - 1]
        k += stop[i] == stop[k]
        failure[i] = k
    matched = 0
    for char in tail:
        while matched and char != stop[matched]:
            matched = failure[matched - 1]
        matched += char == stop[matched]
        if matched == len(stop):  # a whole stop inside the tail is cut by push; never here
            matched = failure[matched - 1]
    return matched
