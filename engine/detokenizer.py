"""Streaming text out of a growing token sequence.

Decoding one token at a time is wrong for two reasons: SentencePiece decoders
strip the leading space of the *first* token they see (so "▁time" decodes to
"time" alone but " time" after "Once upon a"), and a character may span several
byte tokens (an emoji is four ``<0xXX>`` tokens, or four byte-level BPE pieces)
whose partial decode is U+FFFD. :class:`IncrementalDetokenizer` uses the
prefix-offset/read-offset technique (as in vLLM/TGI): decode a short window
that starts a few tokens back, and emit only what the new token appended to it.

:class:`StopChecker` then cuts the stream at user stop strings without ever
emitting the beginning of a stop string that later completes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

_REPLACEMENT = "\ufffd"
_PROMPT_CONTEXT = 5  # prompt tokens decoded as left context for the first delta


class _Decoder(Protocol):
    byte_token_ids: frozenset[int]
    all_special_ids: Sequence[int]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Turn generated token ids into text deltas, one :meth:`add` per token.

    With an empty prompt (or a prompt of special tokens only) the deltas
    concatenate to ``tokenizer.decode(generated_ids)``. With a text prompt they
    concatenate to what ``decode(prompt + generated)`` adds after the prompt
    text, i.e. the first delta keeps its leading space (" time" after
    "Once upon a"), which is what a completion API must return.

    Text is held back (``add`` returns "") while it ends in U+FFFD (an
    unfinished multi-byte character) or while the last token is a
    ``<0xXX>`` byte-fallback token: the HF ByteFallback decoder turns a whole
    run of byte tokens into U+FFFDs if any later byte makes the run invalid,
    so text from a run is only final once a normal token ends it.
    """

    def __init__(self, tokenizer: _Decoder, prompt_ids: Sequence[int], skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._byte_ids = tokenizer.byte_token_ids
        # Skipped special tokens vanish before decoding, so byte runs continue across them.
        self._transparent = frozenset(tokenizer.all_special_ids) if skip_special_tokens else frozenset()
        self._ids: list[int] = list(prompt_ids)
        self._read = len(self._ids)  # everything before this is already emitted (or prompt)
        prefix = max(0, self._read - _PROMPT_CONTEXT)
        # Never start the window inside a byte-token run: its text depends on the whole run.
        in_run = self._byte_ids | self._transparent
        while 0 < prefix < self._read and self._ids[prefix] in in_run and self._ids[prefix - 1] in in_run:
            prefix -= 1
        self._prefix = prefix
        self._n_prompt = len(self._ids)
        self._emitted: list[str] = []

    @property
    def generated_ids(self) -> list[int]:
        return self._ids[self._n_prompt :]

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._emitted)

    def _delta(self, final: bool) -> str:
        prefix_text = self._tokenizer.decode(self._ids[self._prefix : self._read], skip_special_tokens=self._skip)
        new_text = self._tokenizer.decode(self._ids[self._prefix :], skip_special_tokens=self._skip)
        if not final:
            if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT):
                return ""
            if self._ends_in_byte_run():
                return ""
        delta = new_text[len(prefix_text) :]
        self._prefix = self._read
        self._read = len(self._ids)
        if delta:
            self._emitted.append(delta)
        return delta

    def _ends_in_byte_run(self) -> bool:
        """Is the last token that survives decoding a ``<0xXX>`` byte token?"""
        for tid in reversed(self._ids):
            if tid not in self._transparent:
                return tid in self._byte_ids
        return False

    def add(self, token_id: int) -> str:
        """Append one generated token; returns the newly final text (maybe "")."""
        self._ids.append(int(token_id))
        return self._delta(final=False)

    def flush(self) -> str:
        """End of generation: release whatever is held back (even U+FFFD)."""
        if self._read >= len(self._ids):
            return ""
        return self._delta(final=True)


@dataclass(frozen=True)
class StopUpdate:
    """Result of feeding text to a :class:`StopChecker`.

    ``text``: safe to emit now (never contains any part of a matched stop).
    ``stopped``: a stop string was found; generation should end.
    ``stop``: which stop string matched (None if not stopped).
    """

    text: str
    stopped: bool = False
    stop: str | None = None


class StopChecker:
    """Cut a text stream at the first occurrence of any stop string.

    Feed deltas with :meth:`add`; it returns the part that can be emitted.
    A suffix that could still grow into a stop string (e.g. "<|im" for stop
    "<|im_end|>") is held back until the next delta resolves it, so a client
    never sees the start of a stop string that then completes. The stop
    string itself is never emitted. Call :meth:`flush` when generation ends
    for another reason to release a held-back tail.
    """

    def __init__(self, stops: Sequence[str]):
        self.stops: tuple[str, ...] = tuple(dict.fromkeys(s for s in stops if s))
        self._max_len = max((len(s) for s in self.stops), default=0)
        self._buffer = ""  # received but not yet emitted
        self._stopped: str | None = None

    @property
    def stopped(self) -> bool:
        return self._stopped is not None

    def add(self, delta: str) -> StopUpdate:
        if self._stopped is not None:
            return StopUpdate("", True, self._stopped)
        if not self.stops:
            return StopUpdate(delta)
        self._buffer += delta
        buf = self._buffer
        # Earliest match wins; among matches at the same index, the longest.
        best: tuple[int, int, str] | None = None
        for stop in self.stops:
            idx = buf.find(stop)
            if idx >= 0 and (best is None or (idx, -len(stop)) < (best[0], best[1])):
                best = (idx, -len(stop), stop)
        if best is not None:
            self._stopped = best[2]
            self._buffer = ""
            return StopUpdate(buf[: best[0]], True, best[2])
        hold = self._partial_suffix_len(buf)
        emit, self._buffer = buf[: len(buf) - hold], buf[len(buf) - hold :]
        return StopUpdate(emit)

    def _partial_suffix_len(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop."""
        for k in range(min(self._max_len - 1, len(text)), 0, -1):
            tail = text[-k:]
            if any(stop.startswith(tail) for stop in self.stops):
                return k
        return 0

    def flush(self) -> str:
        """Generation ended without a stop: the held tail is plain text after all."""
        if self._stopped is not None:
            return ""
        out, self._buffer = self._buffer, ""
        return out
