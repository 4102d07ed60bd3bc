"""``response_format: json_object``: decode only text that can become JSON.

Why a character-level pushdown automaton over the *decoded* text (not a
grammar over token ids): the tokenizer's pieces (``▁the``, ``Ġ{"``, byte
fallbacks) differ per family, but every vocabulary entry decodes to a string,
and JSON validity is a property of strings. So we precompute each token's
string once (:func:`token_strings`), put them in a trie, and for the current
parser state walk the trie: a token is allowed when every one of its
characters is accepted. The walk prunes whole subtrees at the first rejected
character, and the resulting mask is cached per parser state (inside a string
the state barely changes, so most steps hit the cache).

Termination is part of the contract ("the output parses"): the parser knows
the shortest text that closes the document (:func:`completion`), and near the
end of the token budget only tokens that keep ``len(completion) <= tokens
left`` are allowed. Once the top-level object closes, only EOS is allowed.

The state is an immutable tuple ``(stack, mode, sub)`` so it can key caches:

* ``stack``: open containers, ``"o"`` (object) / ``"a"`` (array), outermost first;
* ``mode``: what the next character may be (constants below);
* ``sub``: mode detail (string escape progress, number part, literal rest,
  whitespace run length).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Sequence

import torch

# Modes.
TOP = 0  # before the top-level object
VALUE = 1  # a value must follow (after ':' or ',' in an array)
OBJ_FIRST = 2  # after '{': a key or '}'
OBJ_KEY = 3  # after ',' in an object: a key
COLON = 4  # after a key: ':'
AFTER = 5  # after a value: ',' or a closer
ARR_FIRST = 6  # after '[': a value or ']'
STR = 7  # inside a value string; sub = (escape_state, is_key)
NUM = 8  # inside a number; sub = part
LIT = 9  # inside true/false/null; sub = the characters still to come
DONE = 10  # the top-level value closed

State = tuple  # (stack: tuple[str, ...], mode: int, sub)
START: State = ((), TOP, 0)

_WS = " \t\n\r"
MAX_WS_RUN = 8  # consecutive whitespace outside strings (stops degenerate loops)
_HEX = set("0123456789abcdefABCDEF")
# Number parts; "terminal" ones may end the number.
_N_MINUS, _N_ZERO, _N_INT, _N_DOT, _N_FRAC, _N_E, _N_ESIGN, _N_EXP = range(8)
_NUM_TERMINAL = {_N_ZERO, _N_INT, _N_FRAC, _N_EXP}
_STRUCTURAL = {TOP, VALUE, OBJ_FIRST, OBJ_KEY, COLON, AFTER, ARR_FIRST}


def _after_value(stack: tuple) -> State:
    return (stack, AFTER, 0) if stack else ((), DONE, 0)


def _start_value(stack: tuple, ch: str) -> State | None:
    """The state after ``ch`` begins a value (in a VALUE/ARR_FIRST slot)."""
    if ch == "{":
        return (stack + ("o",), OBJ_FIRST, 0)
    if ch == "[":
        return (stack + ("a",), ARR_FIRST, 0)
    if ch == '"':
        return (stack, STR, (0, False))
    if ch == "-":
        return (stack, NUM, _N_MINUS)
    if ch == "0":
        return (stack, NUM, _N_ZERO)
    if "1" <= ch <= "9":
        return (stack, NUM, _N_INT)
    for word in ("true", "false", "null"):
        if ch == word[0]:
            return (stack, LIT, word[1:])
    return None


def step(state: State, ch: str) -> State | None:
    """Feed one character; the new state, or None when ``ch`` cannot follow."""
    stack, mode, sub = state
    if mode in _STRUCTURAL and ch in _WS:
        if mode == TOP:
            return None  # the reply starts with '{'
        return (stack, mode, sub + 1) if sub < MAX_WS_RUN else None
    if mode == STR:
        esc, is_key = sub
        if esc == 0:
            if ch == '"':
                return (stack, COLON, 0) if is_key else _after_value(stack)
            if ch == "\\":
                return (stack, STR, (1, is_key))
            return None if ord(ch) < 0x20 else state
        if esc == 1:
            if ch in '"\\/bfnrt':
                return (stack, STR, (0, is_key))
            return (stack, STR, (2, is_key)) if ch == "u" else None
        # esc 2..5: inside \uXXXX, (esc - 2) hex digits seen
        if ch not in _HEX:
            return None
        return (stack, STR, (0 if esc == 5 else esc + 1, is_key))
    if mode == NUM:
        nxt = _num_step(sub, ch)
        if nxt is not None:
            return (stack, NUM, nxt)
        if sub not in _NUM_TERMINAL:
            return None
        return step(_after_value(stack), ch)  # the number ended; ch follows it
    if mode == LIT:
        if ch != sub[0]:
            return None
        return (stack, LIT, sub[1:]) if len(sub) > 1 else _after_value(stack)
    if mode == TOP:
        return (("o",), OBJ_FIRST, 0) if ch == "{" else None
    if mode in (VALUE, ARR_FIRST):
        if mode == ARR_FIRST and ch == "]":
            return _after_value(stack[:-1])
        return _start_value(stack, ch)
    if mode in (OBJ_FIRST, OBJ_KEY):
        if ch == '"':
            return (stack, STR, (0, True))
        if mode == OBJ_FIRST and ch == "}":
            return _after_value(stack[:-1])
        return None
    if mode == COLON:
        return (stack, VALUE, 0) if ch == ":" else None
    if mode == AFTER:
        top = stack[-1]
        if ch == ",":
            return (stack, OBJ_KEY if top == "o" else VALUE, 0)
        if (ch == "}" and top == "o") or (ch == "]" and top == "a"):
            return _after_value(stack[:-1])
        return None
    return None  # DONE: nothing more


def _num_step(part: int, ch: str) -> int | None:
    digit = "0" <= ch <= "9"
    if part == _N_MINUS:
        return _N_ZERO if ch == "0" else (_N_INT if digit else None)
    if part in (_N_ZERO, _N_INT):
        if ch == ".":
            return _N_DOT
        if ch in "eE":
            return _N_E
        return _N_INT if (digit and part == _N_INT) else None
    if part in (_N_DOT, _N_FRAC):
        if digit:
            return _N_FRAC
        return _N_E if (ch in "eE" and part == _N_FRAC) else None
    if part == _N_E:
        return _N_ESIGN if ch in "+-" else (_N_EXP if digit else None)
    if part in (_N_ESIGN, _N_EXP):
        return _N_EXP if digit else None
    return None


def feed(state: State | None, text: str) -> State | None:
    for ch in text:
        if state is None:
            return None
        state = step(state, ch)
    return state


def _closers(stack: tuple) -> str:
    return "".join("}" if c == "o" else "]" for c in reversed(stack))


def completion(state: State) -> str:
    """The shortest text that closes the document from ``state``."""
    stack, mode, sub = state
    if mode == DONE:
        return ""
    if mode == TOP:
        return "{}"
    if mode == STR:
        esc, is_key = sub
        head = "n" if esc == 1 else ("0" * (6 - esc) if esc >= 2 else "")
        return head + '"' + (":0" if is_key else "") + _closers(stack)
    if mode == NUM:
        return ("" if sub in _NUM_TERMINAL else "0") + _closers(stack)
    if mode == LIT:
        return sub + _closers(stack)
    if mode == VALUE:
        return "0" + _closers(stack)
    if mode == OBJ_KEY:
        return '"":0' + _closers(stack)
    if mode == COLON:
        return ":0" + _closers(stack)
    return _closers(stack)  # OBJ_FIRST, ARR_FIRST, AFTER


# ---------------------------------------------------------------------------
# Vocabulary: token strings and a trie over them.
# ---------------------------------------------------------------------------


def token_strings(tokenizer) -> list[str | None]:
    """Each token id's text as it appears mid-sequence; None for tokens that
    JSON mode must never pick (special tokens, lone bytes of a multi-byte
    character, tokens that decode to nothing).

    A token's text is ``decode([anchor, id]) - decode([anchor])``: decoding a
    token alone would drop a SentencePiece leading space.
    """
    special = set(tokenizer.all_special_ids)
    anchor_ids = tokenizer.encode("a", add_special_tokens=False)
    anchor = anchor_ids[-1:] if anchor_ids else []
    base = tokenizer.decode(anchor, skip_special_tokens=False)
    out: list[str | None] = []
    for i in range(tokenizer.vocab_size):
        if i in special:
            out.append(None)
            continue
        s = tokenizer.decode(anchor + [i], skip_special_tokens=False)
        if not s.startswith(base):
            out.append(None)
            continue
        s = s[len(base):]
        out.append(s if s and "\ufffd" not in s else None)
    return out


@dataclass
class _Node:
    children: dict[str, "_Node"] = field(default_factory=dict)
    ids: list[int] = field(default_factory=list)  # tokens whose string ends here


class JsonVocab:
    """Per-model, shared by every JSON-mode request: the token trie and a
    cache ``state -> allowed mask``. Thread-safe (the cache has a lock)."""

    MAX_CACHE = 4096

    def __init__(self, strings: Sequence[str | None], eos_token_ids: Sequence[int], vocab_size: int):
        self.strings = list(strings)
        self.vocab_size = vocab_size
        self.eos = [t for t in eos_token_ids if t < vocab_size]
        self.root = _Node()
        for tid, s in enumerate(self.strings):
            if s is None or tid >= vocab_size:
                continue
            node = self.root
            for ch in s:
                node = node.children.setdefault(ch, _Node())
            node.ids.append(tid)
        self._cache: dict[State, torch.Tensor] = {}
        self._lock = threading.Lock()

    def walk(self, state: State) -> list[tuple[int, State]]:
        """Every (token id, state after it) the parser accepts from ``state``."""
        found: list[tuple[int, State]] = []
        todo = [(self.root, state)]
        while todo:
            node, st = todo.pop()
            for ch, child in node.children.items():
                nxt = step(st, ch)
                if nxt is None:
                    continue
                found.extend((tid, nxt) for tid in child.ids)
                if child.children:
                    todo.append((child, nxt))
        return found

    def mask(self, state: State) -> torch.Tensor:
        """Allowed tokens from ``state`` [vocab_size] bool (cached)."""
        with self._lock:
            hit = self._cache.get(state)
        if hit is not None:
            return hit
        m = torch.zeros(self.vocab_size, dtype=torch.bool)
        ids = [tid for tid, _ in self.walk(state)]
        if ids:
            m[torch.tensor(ids)] = True
        with self._lock:
            if len(self._cache) >= self.MAX_CACHE:
                self._cache.clear()
            self._cache[state] = m
        return m


class JsonConstraint:
    """One request's JSON-mode state: the engine core calls ``allowed`` before
    sampling a token for this request and ``advance`` with the token picked.

    ``budget`` is how many tokens the request may generate at most; near it,
    only tokens that leave room to close the document are allowed.
    """

    def __init__(self, vocab: JsonVocab, budget: int):
        self.vocab = vocab
        self.budget = budget
        self.state: State | None = START
        self.generated = 0

    @property
    def done(self) -> bool:
        return self.state is not None and self.state[1] == DONE

    def _eos_only(self, v: int) -> torch.Tensor:
        m = torch.zeros(v, dtype=torch.bool)
        m[self.vocab.eos or [0]] = True
        return m

    def allowed(self, v: int) -> torch.Tensor:
        """Token mask [v] bool for the next token."""
        if self.state is None or self.done:
            return self._eos_only(v)
        left = self.budget - self.generated  # tokens still allowed, this one included
        # A token adds at most ~5 characters of closing text per character it
        # has; far from the budget no single token can break the invariant.
        if left > len(completion(self.state)) + 64:
            m = self.vocab.mask(self.state)
        else:
            ok = [t for t, st in self.vocab.walk(self.state) if len(completion(st)) <= left - 1]
            m = torch.zeros(self.vocab.vocab_size, dtype=torch.bool)
            if ok:
                m[torch.tensor(ok)] = True
        if not bool(m.any()):
            return self._eos_only(v)
        if m.shape[0] != v:  # logits padded beyond the tokenizer's vocabulary
            full = torch.zeros(v, dtype=torch.bool)
            n = min(v, m.shape[0])
            full[:n] = m[:n]
            m = full
        return m

    def advance(self, token_id: int) -> None:
        self.generated += 1
        if self.state is None or self.done:
            return
        s = self.vocab.strings[token_id] if token_id < len(self.vocab.strings) else None
        self.state = feed(self.state, s) if s is not None else None
