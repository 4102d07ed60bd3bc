"""Grammar-constrained decoding: JSON schemas, regexes and Lark grammars through llguidance.

Why llguidance (and not xgrammar, or the hand-written JSON automaton this
replaces): it needs no torch or compiler at run time (one Rust extension,
a few MB), computes a token mask in tens of microseconds on a CPU without a
precompilation step per schema (xgrammar compiles each grammar up front, and
pulls a torch-versioned build), accepts JSON Schema, regexes, Lark and GBNF
(via its converter) with one matcher type, and is what llama.cpp and vLLM
ship for the same job, so its coverage of real schemas is well exercised.

One :class:`GrammarVocab` per model (building the token trie is the costly
part: about a second for a 150k-token vocabulary); one
:class:`GrammarConstraint` per request, implementing the engine's
``TokenConstraint`` (``allowed`` -> a [V] bool mask, ``advance`` after each
sampled token).

The token budget is part of the contract ("the output parses"): a matcher
knows which tokens may come next, not how many it takes to finish. So near
the end of the budget the constraint computes a short way to close the
document on a copy of the matcher (forced tokens first, then single-character
closers: a quote, a brace, a bracket, a digit...) and, once that path is
about as long as the tokens left, allows only its next token. For JSON this
closes every open string and container in few tokens; a regex or Lark grammar
the closer cannot finish ends at the budget like any other request. A budget
below the format's shortest output is refused up front.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Any, Literal, Sequence

import numpy as np
import torch

from llmsys.engine.tokenizer import Tokenizer
from llmsys.kernels.common.errors import InvalidParameterError

# JSON on one line with the separators Python's json.dumps writes (and most models were tuned on):
# a model left free to write whitespace can fill its whole budget with newlines.
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# The closers tried, in order, when the constraint must finish the document within the budget.
_CLOSERS = b'"}]01tfn,: a[{'
_CLOSE_MARGIN = 8  # tokens: one sampled token can lengthen the way out by several (a quote opening a key)
_CLOSE_MAX_STEPS = 256  # the closer gives up past this many tokens (a grammar it cannot finish)
_CLOSE_SLACK = 32  # start checking the way out this many tokens before the minimal document's length runs out

GrammarKind = Literal["json_schema", "regex", "lark", "gbnf"]


@dataclass(frozen=True)
class GrammarSpec:
    """What a request asks its output to match. ``source``: a JSON schema (text), a regex,
    or a grammar in Lark or GBNF syntax."""

    kind: GrammarKind
    source: str

    @staticmethod
    def json(schema: dict[str, Any] | None = None) -> GrammarSpec:
        """Any JSON object (``json_object`` mode), or one matching ``schema``."""
        return GrammarSpec("json_schema", json.dumps({"type": "object"} if schema is None else schema))

    def compile(self) -> str:
        """The llguidance grammar (its own JSON form); errors come from :meth:`GrammarVocab.matcher`."""
        import llguidance

        if self.kind == "json_schema":
            try:
                return llguidance.LLMatcher.grammar_from_json_schema(self.source, defaults=JSON_OPTIONS)
            except Exception as e:  # ValueError for bad JSON; anything the compiler raises is the schema's fault
                raise InvalidParameterError(f"the JSON schema is not valid: {_first_line(str(e))}") from None
        if self.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.source)
        if self.kind == "gbnf":
            from llguidance.gbnf_to_lark import gbnf_to_lark

            try:
                return llguidance.LLMatcher.grammar_from_lark(gbnf_to_lark(self.source))
            except Exception as e:  # the converter raises plain exceptions on bad syntax
                raise InvalidParameterError(f"the GBNF grammar is not valid: {_first_line(str(e))}") from None
        return llguidance.LLMatcher.grammar_from_lark(self.source)


class _PieceTokenizer:
    """llguidance's ``TokenizerWrapper`` protocol over a vocabulary given as raw bytes per token
    (llama2.c's). Its tokenize is greedy longest-match over the pieces: llama2.c's own encoder
    adds a dummy-prefix space, which would make every forced text start with a space."""

    def __init__(self, tok: Tokenizer, pieces: list[bytes]):
        self.eos_token_id = min(tok.eos_token_ids) if tok.eos_token_ids else 0
        self.bos_token_id = tok.bos_token_id
        self.tokens = pieces
        self.special_token_ids = list(tok.all_special_ids)
        special = set(self.special_token_ids)
        self._ids: dict[bytes, int] = {}
        for tid, p in enumerate(pieces):
            if p and tid not in special:
                self._ids.setdefault(p, tid)
        self._longest = max(len(p) for p in self._ids)

    def __call__(self, s: str | bytes) -> list[int]:
        data = s.encode("utf-8") if isinstance(s, str) else s
        out, i = [], 0
        while i < len(data):
            for n in range(min(self._longest, len(data) - i), 0, -1):
                tid = self._ids.get(data[i:i + n])
                if tid is not None:
                    out.append(tid)
                    i += n
                    break
            else:
                raise ValueError(f"byte {data[i]:#x} has no token")  # a byte-fallback vocabulary has them all
        return out


class GrammarVocab:
    """One model's vocabulary as llguidance sees it, shared by every constrained request.
    Thread-safe: matchers are created under a lock (the tokenizer object is shared)."""

    def __init__(self, tok: Tokenizer, vocab_size: int, eos_token_ids: Sequence[int]):
        import llguidance

        self.vocab_size = vocab_size  # the model's logits width (may exceed the tokenizer's)
        eos = sorted(t for t in eos_token_ids if t < vocab_size) or [0]
        source = tok.vocabulary()
        if not isinstance(source, str):
            source = llguidance.TokenizerWrapper(_PieceTokenizer(tok, source))
        self.lltok = llguidance.LLTokenizer(source, n_vocab=min(tok.vocab_size, vocab_size), eos_token=eos)
        self.eos = eos
        self._lock = threading.Lock()
        single: dict[int, int] = {}
        for tid in range(self.lltok.vocab_size):
            b = self.lltok.decode_bytes([tid])
            if len(b) == 1 and b[0] in _CLOSERS and b[0] not in single and not self.lltok.is_special_token(tid):
                single[b[0]] = tid
        self.closers = [single[c] for c in _CLOSERS if c in single]  # token ids in closing order

    def special_token(self, text: str) -> int | None:
        """The id of ``text`` when the vocabulary has it as one special token (grammar syntax ``<[id]>``)."""
        ids = self.lltok.tokenize_str(text, parse_special=True)
        return ids[0] if len(ids) == 1 and self.lltok.is_special_token(ids[0]) else None

    def matcher(self, spec: GrammarSpec) -> Any:
        """A fresh llguidance matcher for ``spec``; a grammar it rejects is a one-line
        :class:`InvalidParameterError` naming what is wrong."""
        import llguidance

        grammar = spec.compile()
        with self._lock:
            m = llguidance.LLMatcher(self.lltok, grammar, log_level=0)
        if m.is_error():
            what = {"json_schema": "JSON schema", "regex": "regex", "lark": "grammar", "gbnf": "grammar"}[spec.kind]
            raise InvalidParameterError(f"the {what} cannot be used: {_first_line(m.get_error())}")
        return m

    def mask(self, m: Any) -> torch.Tensor:
        """[vocab_size] bool: the tokens ``m`` allows next."""
        bits = np.unpackbits(np.frombuffer(m.compute_bitmask(), dtype=np.uint8), bitorder="little")  # [ceil(V/32)*32]
        out = torch.zeros(self.vocab_size, dtype=torch.bool)
        n = min(self.lltok.vocab_size, self.vocab_size)
        out[:n] = torch.from_numpy(bits[:n].view(np.bool_))
        return out

    def closing(self, m: Any, limit: int) -> list[int] | None:
        """A short token path that ends the document from ``m``'s state (on a copy), at most
        ``limit`` tokens; None when the closer finds none."""
        c = m.deep_copy()
        path: list[int] = []
        while len(path) <= limit:
            if c.is_stopped() or c.is_accepting():
                return path
            ff = c.compute_ff_tokens()
            if ff:
                if not c.consume_tokens(ff):
                    return None
                path += ff
                continue
            allowed = np.unpackbits(np.frombuffer(c.compute_bitmask(), dtype=np.uint8), bitorder="little")
            options = [t for t in self.closers if allowed[t]]
            if not options:  # none of the usual closers fits here: any allowed token, lowest id first
                options = [int(t) for t in np.flatnonzero(allowed[:self.lltok.vocab_size])[:8]
                           if t not in self.eos]
            if not options:
                return None
            tid = options[0]
            for t in options:  # a closer that ends the document right away wins over the usual order
                trial = c.deep_copy()
                if trial.consume_token(t) and (trial.is_accepting() or trial.is_stopped()):
                    tid = t
                    break
            c.consume_token(tid)
            path.append(tid)
        return None


class GrammarConstraint:
    """One request's grammar (the engine's ``TokenConstraint``); ``budget``: the most tokens it may
    generate, so the document is closed in time (module docstring)."""

    def __init__(self, vocab: GrammarVocab, spec: GrammarSpec, budget: int):
        self.vocab = vocab
        self.m = vocab.matcher(spec)
        self.left = budget
        self._forced: list[int] = []  # the closing path being followed, once the budget demands it
        minimal = vocab.closing(self.m, _CLOSE_MAX_STEPS)
        if minimal is not None and len(minimal) > budget:
            raise InvalidParameterError(f"the shortest output this format allows is {len(minimal)} tokens but the "
                                        f"request may generate only {budget}; raise max_tokens")
        self._watch = (len(minimal) if minimal is not None else 0) + _CLOSE_SLACK
        self._check_at = self._watch  # the next ``left`` at which the way out is measured again
        self._ready: torch.Tensor | Exception | None = None  # a mask computed ahead (prefetch), or its failure

    def prefetch(self) -> None:
        """Compute the next mask now: the engine calls this on its mask thread while the step's
        forward runs (the mask depends only on tokens already sampled), so constrained rows do
        not hold up the batch; a failure is kept and raised by :meth:`allowed`."""
        try:
            self._ready = self._next_mask()
        except Exception as e:
            self._ready = e

    def allowed(self, vocab_size: int) -> torch.Tensor:
        ready, self._ready = self._ready, None
        if isinstance(ready, Exception):
            raise ready
        mask = ready if ready is not None else self._next_mask()  # [self.vocab.vocab_size]
        if mask.shape[0] == vocab_size:
            return mask
        out = torch.zeros(vocab_size, dtype=torch.bool)
        n = min(vocab_size, mask.shape[0])
        out[:n] = mask[:n]
        return out

    def _next_mask(self) -> torch.Tensor:
        if self.m.is_error():
            raise ValueError(_first_line(self.m.get_error()))
        if not self._forced and self.left <= self._check_at:
            path = self.vocab.closing(self.m, _CLOSE_MAX_STEPS)
            if path and len(path) + _CLOSE_MARGIN >= self.left:
                self._forced = path
            else:  # measured again when half the slack is spent (a token rarely lengthens it by more)
                need = (len(path) if path else 0) + _CLOSE_MARGIN
                self._check_at = self.left - max(1, (self.left - need) // 2)
        out = torch.zeros(self.vocab.vocab_size, dtype=torch.bool)
        if self._forced:
            out[self._forced[0]] = True
            return out
        # Complete, and near the budget (or unable to go on): end here rather than open a part
        # (another tool call, say) that may not fit.
        if self.m.is_stopped() or (self.left <= self._watch and self.m.is_accepting()):
            out[self.vocab.eos] = True
            return out
        return self.vocab.mask(self.m)

    def advance(self, token_id: int) -> None:
        self._ready = None
        self.left -= 1
        if self._forced:
            self._forced.pop(0)
        if token_id in self.vocab.eos and (self.m.is_accepting() or self.m.is_stopped()):
            return
        if not self.m.consume_token(token_id):
            raise ValueError(f"token {token_id} does not fit the grammar: {_first_line(self.m.get_error())}")


def _first_line(text: str) -> str:
    return (text or "no detail").strip().splitlines()[0][:300]
