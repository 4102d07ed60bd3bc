"""Grammar-constrained decoding: JSON schemas, regexes and Lark grammars through llguidance.

Why llguidance: one Rust extension (no torch or compiler at run time), a CPU token mask with no
per-schema compile step (xgrammar needs both), JSON Schema / regex / Lark / GBNF in one matcher, and
what llama.cpp and vLLM ship. One :class:`GrammarVocab` per model (its token trie is the costly part),
one :class:`GrammarConstraint` per request (the engine's ``TokenConstraint``). The token budget is part
of the contract: near its end only a shortest way to close the document is allowed (forced tokens, then
one-character closers). A format that cannot finish within the budget or llguidance's limits is refused
before it runs (a 400); a matcher that errors or allows nothing mid-run ends the request with
finish_reason "error". Timings: docs/benchmarks.md.
"""

from __future__ import annotations

import enum
import json
import threading
from collections import deque
from dataclasses import dataclass, field
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
# The up-front check's search (GrammarConstraint.__init__): the most tokens it chooses one by one (forced runs
# count once), and how many of the lowest-id allowed tokens it tries besides the closers at each step.
_CHECK_MAX_STEPS = 2048
_TRY_LOWEST = 16
_TRY_SAMPLE = 32  # and, when exploring, how many allowed tokens drawn at random
_BACKTRACK = 32  # how many of its latest choices the search can go back to from a dead end

GrammarKind = Literal["json_schema", "regex", "lark", "gbnf"]
_WHAT = {"json_schema": "JSON schema", "regex": "regex", "lark": "grammar", "gbnf": "grammar"}


class Outcome(enum.Enum):
    """How a search for a way to end the document went (:meth:`GrammarVocab.way_out`)."""

    FOUND = "found"  # ``path`` ends the document
    FORCED_TOO_LONG = "forced_too_long"  # the grammar forces more tokens than the limit: ``at_least`` of them
    EMPTY = "empty"  # nothing may come first and the empty output is not complete: no string matches
    DEAD_END = "dead_end"  # the search reached a state that allows nothing (not a proof of emptiness)
    GAVE_UP = "gave_up"  # past the token limit (``path`` that long) or the step limit, without an end
    ENGINE_LIMIT = "engine_limit"  # llguidance stopped on one of its limits (lexer states, Earley items)


@dataclass(frozen=True)
class WayOut:
    """One search's result: ``path`` (token ids; the way out when FOUND, how far it got otherwise),
    ``at_least`` (FORCED_TOO_LONG: the tokens the grammar forces), ``detail`` (ENGINE_LIMIT: llguidance's
    error, one line)."""

    outcome: Outcome
    path: list[int] = field(default_factory=list)
    at_least: int = 0
    detail: str = ""


@dataclass(frozen=True)
class GrammarSpec:
    """What a request asks its output to match. ``source``: a JSON schema (text), a regex,
    or a grammar in Lark or GBNF syntax."""

    kind: GrammarKind
    source: str
    # Free text beside the documents (:class:`GrammarOrText`; tool calls in a format without markers):
    # "never" (the output is a document), "or" (a document or free text that does not begin like one,
    # as the first token decides), "only" (free text that does not begin like a document).
    free_text: Literal["never", "or", "only"] = "never"

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
        self._free_starts: dict[str, torch.Tensor] = {}  # free_start()'s masks, by the excluded first characters

    def special_token(self, text: str) -> int | None:
        """The id of ``text`` when the vocabulary has it as one special token (grammar syntax ``<[id]>``)."""
        ids = self.lltok.tokenize_str(text, parse_special=True)
        return ids[0] if len(ids) == 1 and self.lltok.is_special_token(ids[0]) else None

    def free_start(self, excluded: str) -> torch.Tensor:
        """[vocab_size] bool: the tokens that can begin free text which is not a document of a grammar
        whose documents begin with one of ``excluded``'s characters: not special, not blank, and the
        first non-blank character (blank as ``str.strip`` reads it: a parser strips that too) none
        of ``excluded`` (a blank token first would let a document begin unchecked right after it).
        Computed once per ``excluded`` (one pass over the vocabulary)."""
        with self._lock:
            got = self._free_starts.get(excluded)
            if got is not None:
                return got
            free = [False] * self.vocab_size
            for tid in range(min(self.lltok.vocab_size, self.vocab_size)):
                if tid not in self.eos and not self.lltok.is_special_token(tid):
                    head = self._text(tid).lstrip()
                    free[tid] = bool(head) and head[0] not in excluded
            out = torch.tensor(free, dtype=torch.bool)
            self._free_starts[excluded] = out
            return out

    def first_chars(self, mask: torch.Tensor) -> str:
        """The first non-blank characters of the tokens ``mask`` allows (what a document can begin with)."""
        out = set()
        for tid in torch.nonzero(mask[:self.lltok.vocab_size]).flatten().tolist():
            if tid not in self.eos and not self.lltok.is_special_token(tid):
                head = self._text(tid).lstrip()
                if head:
                    out.add(head[0])
        return "".join(sorted(out))

    def _text(self, tid: int) -> str:
        return self.lltok.decode_bytes([tid]).decode("utf-8", errors="replace")  # a partial character: U+FFFD

    def matcher(self, spec: GrammarSpec) -> Any:
        """A fresh llguidance matcher for ``spec``; a grammar it rejects is a one-line
        :class:`InvalidParameterError` naming what is wrong."""
        import llguidance

        grammar = spec.compile()
        with self._lock:
            m = llguidance.LLMatcher(self.lltok, grammar, log_level=0)
        if m.is_error():
            raise InvalidParameterError(f"the {_WHAT[spec.kind]} cannot be used: {_first_line(m.get_error())}")
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
        ``limit`` tokens; None when the closer finds none (in its plain order, then exploring)."""
        for explore in (False, True):
            way = self.way_out(m, limit, _CLOSE_MAX_STEPS, explore)
            if way.outcome is Outcome.FOUND:
                return way.path
            if way.outcome not in (Outcome.GAVE_UP, Outcome.DEAD_END):
                return None
        return None

    def way_out(self, m: Any, limit: int, max_steps: int, explore: bool = False) -> WayOut:
        """Search, on a copy of ``m``, for a token path of at most ``limit`` tokens that ends the
        document, choosing at most ``max_steps`` tokens one by one. Greedy: forced tokens first; a
        token that completes the document at once wins; else the first closer that fits, then the
        lowest-id allowed token (the order that closes JSON best). ``explore``: the candidates also
        hold a seeded sample of the allowed tokens, and the one chosen least often so far wins: it
        leaves a loop such as ``a`` in ``[a-z]*z``, where the plain order picks ``a`` forever.
        A state that allows nothing (``"a" x`` with ``x: x``) sends the search back to its latest
        choice, another token tried there (up to ``_BACKTRACK`` choices back: a copy is kept of each)."""
        rng = np.random.default_rng(0) if explore else None
        c = m.deep_copy()
        path: list[int] = []
        used: dict[int, int] = {}
        # the latest choices: (the matcher before it, the path's length there, the tokens tried there)
        choices: deque[tuple[Any, int, set[int]]] = deque(maxlen=_BACKTRACK)
        tried: set[int] = set()  # the tokens already tried, and found to lead nowhere, from this state
        failed = ""  # llguidance's error on a token tried and refused (a limit), if any
        for _ in range(max_steps):
            if c.is_error():
                return WayOut(Outcome.ENGINE_LIMIT, path, detail=_first_line(c.get_error()))
            if c.is_stopped() or c.is_accepting():
                return WayOut(Outcome.FOUND, path)
            if len(path) >= limit:
                return WayOut(Outcome.ENGINE_LIMIT, path, detail=failed) if failed else WayOut(Outcome.GAVE_UP, path)
            ff = c.compute_ff_tokens()
            if ff:
                if len(path) + len(ff) > limit:  # checked before consuming: a huge forced run exhausts the lexer
                    return WayOut(Outcome.FORCED_TOO_LONG, path, at_least=len(path) + len(ff))
                if not c.consume_tokens(ff):
                    return WayOut(Outcome.ENGINE_LIMIT, path, detail=_first_line(c.get_error()))
                path += ff
                continue
            allowed = np.unpackbits(np.frombuffer(c.compute_bitmask(), dtype=np.uint8), bitorder="little")
            if c.is_error():
                if not _dead_end(c):
                    continue  # a limit: reported at the top of the loop
                allowed[:] = 0  # nothing can follow: llguidance says so as an error (NoExtension)
            lowest = [int(t) for t in np.flatnonzero(allowed[:self.lltok.vocab_size])[:_TRY_LOWEST + len(self.eos)]
                      if t not in self.eos][:_TRY_LOWEST]
            closers = [t for t in self.closers if allowed[t]]
            options = closers + [t for t in lowest if t not in closers]
            if rng is not None:
                everyone = np.flatnonzero(allowed[:self.lltok.vocab_size])
                sample = rng.choice(everyone, size=min(_TRY_SAMPLE, len(everyone)), replace=False)
                options += [int(t) for t in sample if t not in self.eos and t not in options]
                options = [options[i] for i in rng.permutation(len(options))]  # ties among the least used: at random
            empty = not options and not path and not tried  # nothing at all may come first
            options = [t for t in options if t not in tried]
            if not options:
                if failed:
                    return WayOut(Outcome.ENGINE_LIMIT, path, detail=failed)
                if empty:
                    return WayOut(Outcome.EMPTY, path)
                if not choices:
                    return WayOut(Outcome.DEAD_END, path)
                c, n, tried = choices.pop()  # back to the latest choice, the token taken there now tried
                del path[n:]
                continue
            tid, fits = None, []
            for t in options:  # a token that ends the document right away wins over the usual order
                trial = c.deep_copy()
                if not trial.consume_token(t):  # allowed yet refused: llguidance ran into a limit on it
                    failed = failed or _first_line(trial.get_error())
                    continue
                fits.append(t)
                if trial.is_accepting() or trial.is_stopped():
                    tid = t
                    break
            if not fits:
                return WayOut(Outcome.ENGINE_LIMIT, path, detail=failed)
            if tid is None:
                tid = min(fits, key=lambda t: used.get(t, 0)) if explore else fits[0]
            used[tid] = used.get(tid, 0) + 1
            choices.append((c.deep_copy(), len(path), tried | {tid}))
            tried = set()
            c.consume_token(tid)
            path.append(tid)
        return WayOut(Outcome.ENGINE_LIMIT, path, detail=failed) if failed else WayOut(Outcome.GAVE_UP, path)

    def check(self, m: Any, spec: GrammarSpec, budget: int) -> list[int]:
        """The shortest way found to a complete output from ``m``'s (fresh) state, or a one-line
        :class:`InvalidParameterError` saying why ``spec`` cannot be honoured in ``budget`` tokens:
        it matches nothing, its shortest output is longer, or the engine cannot run it. When the
        budget is beyond what the search covers (``_CHECK_MAX_STEPS`` choices) and it found no end,
        the request runs (it ends at its budget, finish_reason "length"). A search that gives up
        within the budget refuses: the greedy search can miss a way a model would find, but the
        formats it misses are ones whose outputs are long or pathological."""
        what = _WHAT[spec.kind]
        limit = max(budget, _CLOSE_MAX_STEPS)  # a little past the budget: the message can say how long it is
        for steps in (_CLOSE_MAX_STEPS, _CHECK_MAX_STEPS):  # a short search first: most formats end quickly
            way = self.way_out(m, limit, steps)
            if way.outcome in (Outcome.GAVE_UP, Outcome.DEAD_END):  # the plain order loops or strays: explore
                other = self.way_out(m, limit, steps, explore=True)
                if other.outcome is not Outcome.GAVE_UP or way.outcome is Outcome.GAVE_UP:
                    way = other
            if way.outcome is not Outcome.GAVE_UP or len(way.path) >= limit:
                break
        if way.outcome is Outcome.FOUND:
            if len(way.path) > budget:
                raise InvalidParameterError(f"the shortest output this {what} allows is {len(way.path)} tokens but the "
                                            f"request may generate only {budget}; raise max_tokens")
            return way.path
        if way.outcome is Outcome.EMPTY:
            raise InvalidParameterError(_empty_message(spec))
        if way.outcome is Outcome.FORCED_TOO_LONG:
            raise InvalidParameterError(f"the {what} needs at least {way.at_least} tokens but the request may "
                                        f"generate only {budget}; raise max_tokens or shorten the {what}")
        if way.outcome is Outcome.ENGINE_LIMIT:
            raise InvalidParameterError(f"the {what} is beyond the grammar engine's limits ({way.detail}); "
                                        f"simplify it (fewer or smaller repetitions, longer literals)")
        if way.outcome is Outcome.DEAD_END or len(way.path) >= budget:
            raise InvalidParameterError(f"no output of this {what} that fits in {budget} tokens was found (every way "
                                        f"tried runs longer or leads nowhere); raise max_tokens or simplify the {what}")
        return []  # not decided within the search's steps: the request runs, bounded by its budget


def _empty_message(spec: GrammarSpec) -> str:
    """Why a format with no valid output at all is refused, in the terms of its syntax."""
    if spec.kind == "regex":
        return "the regex matches no string (an empty character class or set, e.g. [^\\x00-\\x{10FFFF}])"
    if spec.kind == "json_schema":
        return ("the JSON schema matches no value (e.g. a $ref to itself with nothing else, or contradictory "
                "constraints)")
    start, sep = ("root", " ::= ") if spec.kind == "gbnf" else ("start", ": ")
    return (f"the grammar matches no string: rule '{start}' never terminates (recursion with no base case, "
            f"e.g. '{start}{sep}{start}', or an empty language)")


class GrammarConstraint:
    """One request's grammar (the engine's ``TokenConstraint``); ``budget``: the most tokens it may
    generate, so the document is closed in time (module docstring)."""

    def __init__(self, vocab: GrammarVocab, spec: GrammarSpec, budget: int):
        self.vocab = vocab
        self.m = vocab.matcher(spec)
        self.left = budget
        self._forced: list[int] = []  # the closing path being followed, once the budget demands it
        minimal = vocab.check(self.m, spec, budget)
        if self.m.is_error():  # the search's copies share the lexer: its limit reached there reaches this one
            raise InvalidParameterError(f"the {_WHAT[spec.kind]} is beyond the grammar engine's limits "
                                        f"({_first_line(self.m.get_error())}); simplify it")
        self._watch = len(minimal) + _CLOSE_SLACK
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
        out = self.vocab.mask(self.m)
        # Nothing may follow (llguidance allows only EOS and, on its own, enters an error state) while
        # the output is incomplete: ending here would look like a normal stop with output that breaks
        # the format. A limit reached mid-generation (an error) fails the request the same way.
        if _dead_end(self.m) or (not self.m.is_accepting() and int(out.sum()) == int(out[self.vocab.eos].sum())):
            raise ValueError("the grammar allows no next token and the output is incomplete (a dead end)")
        if self.m.is_error():
            raise ValueError(_first_line(self.m.get_error()))
        return out

    def advance(self, token_id: int) -> None:
        self._ready = None
        self.left -= 1
        if self._forced:
            self._forced.pop(0)
        if token_id in self.vocab.eos:
            if self.m.is_accepting() or self.m.is_stopped():
                return
            raise ValueError("the output ended before it was complete under the grammar")
        if not self.m.consume_token(token_id):
            raise ValueError(f"token {token_id} does not fit the grammar: {_first_line(self.m.get_error())}")


class GrammarOrText:
    """Either a document of the grammar or free text, decided by the first token (the engine's
    ``TokenConstraint``): a tool call in a format without marker tokens, under ``tool_choice: auto``;
    with ``spec.free_text == "only"``, the free text alone (``tool_choice: none``).

    The first token is one the grammar allows, or one that cannot begin a document (its first
    non-blank character is none that the grammar's documents begin with, :meth:`GrammarVocab.free_start`),
    so an output that opens like a document must be one. After a free first token nothing is
    constrained: a plain answer ends where the model ends it, not where the grammar's budget would.
    A grammar whose shortest document does not fit the budget leaves only the free text; a grammar
    that cannot be used at all is the request's error (:class:`InvalidParameterError`)."""

    def __init__(self, vocab: GrammarVocab, spec: GrammarSpec, budget: int):
        self.vocab = vocab
        self.inner: GrammarConstraint | None = None
        try:
            if spec.free_text != "only":
                self.inner = GrammarConstraint(vocab, spec, budget)
        except InvalidParameterError:
            pass  # the budget, not the grammar, if a fresh matcher accepts it (else the next line raises)
        opens = self.inner.allowed(vocab.vocab_size) if self.inner is not None else vocab.mask(vocab.matcher(spec))
        self._opens = opens  # [vocab.vocab_size] bool: the first tokens of a document
        free = vocab.free_start(vocab.first_chars(opens))
        self._first = free | opens if self.inner is not None else free  # [vocab.vocab_size] bool
        self.mode: Literal["first", "grammar", "free"] = "first"

    def prefetch(self) -> None:
        if self.mode == "grammar" and self.inner is not None:
            self.inner.prefetch()

    def allowed(self, vocab_size: int) -> torch.Tensor:
        if self.mode == "grammar" and self.inner is not None:
            return self.inner.allowed(vocab_size)
        if self.mode == "free":
            return torch.ones(vocab_size, dtype=torch.bool)
        out = torch.zeros(vocab_size, dtype=torch.bool)
        n = min(vocab_size, self._first.shape[0])
        out[:n] = self._first[:n]
        return out

    def advance(self, token_id: int) -> None:
        if self.mode == "first":
            opens = self.inner is not None and token_id < self._opens.shape[0] and bool(self._opens[token_id])
            self.mode = "grammar" if opens else "free"
            if not opens:
                self.inner = None
                return
        if self.mode == "grammar" and self.inner is not None:
            self.inner.advance(token_id)


def _dead_end(m: Any) -> bool:
    """Whether ``m`` stopped because no byte can follow (llguidance reports it as an error whose
    first line is the stop reason, NoExtension or NoExtensionBias), as opposed to a limit."""
    return m.is_error() and _first_line(m.get_error()).startswith("NoExtension")


def _first_line(text: str) -> str:
    return (text or "no detail").strip().splitlines()[0][:300]
