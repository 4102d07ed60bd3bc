"""Text <-> token ids for every checkpoint kind llmsys loads, behind one :class:`Tokenizer`.

* Hugging Face directories: ``tokenizer.json`` run by the Rust ``tokenizers`` library plus
  ``tokenizer_config.json`` / ``generation_config.json`` metadata; ids equal
  ``transformers.AutoTokenizer``'s (the one deliberate departure: :func:`_transformers_llama_pipeline`).
* llama2.c ``tok*.bin``: llama2.c ``run.c``'s greedy highest-score merge loop, exactly.
* GGUF: ``tokenizer.ggml.*`` rebuilt into a ``tokenizers.Tokenizer`` (:mod:`llmsys.engine.gguf_tokenizer`)
  and run by the same HF backend, so a ``.gguf`` encodes like the directory it came from.
"""

from __future__ import annotations

import heapq
import json
import re
import struct
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from llmsys.engine.chat_template import ChatTemplate
from llmsys.kernels.common.errors import InvalidParameterError, TokenizerError

_BYTE_TOKEN_RE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
_LLAMA_CLASSES = ("LlamaTokenizer", "LlamaTokenizerFast")


class _Backend(Protocol):
    """What :class:`Tokenizer` needs from a concrete vocabulary."""

    vocab_size: int
    special_ids: frozenset[int]
    byte_token_ids: frozenset[int]

    def encode(self, text: str, add_special_tokens: bool) -> list[int]: ...
    def decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str: ...
    def id_to_token(self, token_id: int) -> str | None: ...
    def token_to_id(self, token: str) -> int | None: ...
    def vocabulary(self) -> str | list[bytes]: ...


# --------------------------------------------------------------------------- HF


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TokenizerError(f"cannot read {path}: {e}; re-download the model") from e
    if not isinstance(data, dict):
        raise TokenizerError(f"{path} is not a JSON object; re-download the model")
    return data


def _token_str(value: Any) -> str | None:
    """``bos_token`` is either ``"<s>"`` or an AddedToken dict ``{"content": "<s>", ...}``."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _transformers_llama_pipeline(tok: Any, config: Mapping[str, Any]) -> None:
    """Rebuild the pre-tokenizer/decoder the way transformers v5 ``LlamaTokenizer`` does.

    Why: for ``tokenizer_class: LlamaTokenizer(Fast)`` transformers ignores the
    normalizer in ``tokenizer.json`` (``Prepend("▁")`` on every segment) and uses
    ``Metaspace(prepend_scheme="first")`` instead (``"always"`` with
    ``legacy: true``): a leading space is not doubled and text right after a
    special token gets no dummy ``▁``. Mirroring it keeps our ids identical to
    the reference for chat prompts and space-led prompts.
    """
    from tokenizers import decoders, pre_tokenizers

    add_prefix_space = config.get("add_prefix_space")
    add_prefix_space = True if add_prefix_space is None else bool(add_prefix_space)
    if add_prefix_space:
        scheme = "always" if config.get("legacy", False) else "first"
    else:
        scheme = "never"
    tok.normalizer = None
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme, split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix_space:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tok.decoder = decoders.Sequence(steps)


class _HFBackend:
    """``tokenizers.Tokenizer`` plus the transformers-side metadata fix-ups."""

    @classmethod
    def from_directory(cls, directory: Path, config: Mapping[str, Any]) -> _HFBackend:
        """``directory/tokenizer.json`` with ``config`` (its ``tokenizer_config.json``)."""
        from tokenizers import Tokenizer as RustTokenizer

        path = directory / "tokenizer.json"
        try:
            tok = RustTokenizer.from_file(str(path))
        except Exception as e:  # the Rust side raises plain Exception on bad JSON
            raise TokenizerError(f"cannot parse {path}: {e}; re-download the model") from e
        return cls(tok, _read_json(path), config, str(directory / "tokenizer_config.json"), "tokenizer.json")

    @classmethod
    def from_tokenizer(cls, tok: Any, config: Mapping[str, Any], source: str) -> _HFBackend:
        """Wrap an in-memory ``tokenizers.Tokenizer`` (e.g. rebuilt from GGUF metadata).

        ``config`` plays ``tokenizer_config.json``'s part, so the same fix-ups
        apply as for a directory; ``source`` names the file in error messages.
        ``tok`` is taken over (its pipeline may be replaced), not copied. The parts of ``tokenizer.json``
        the fix-ups read are taken from ``tok`` itself: serializing a whole vocabulary and parsing it back
        took as long as building it.
        """
        raw = {"model": {"type": type(tok.model).__name__},
               "added_tokens": [{"content": t.content} for t in tok.get_added_tokens_decoder().values()],
               "decoder": None if tok.decoder is None else json.loads(tok.decoder.__getstate__())}
        return cls(tok, raw, config, source, source)

    def __init__(self, tok: Any, raw: Mapping[str, Any], config: Mapping[str, Any],
                 config_name: str, vocab_name: str) -> None:
        """``raw``: the tokenizer as ``tokenizer.json`` spells it; the names only word errors."""
        from tokenizers import AddedToken, processors

        model = raw.get("model") or {}

        if config.get("tokenizer_class") in _LLAMA_CLASSES and model.get("type") == "BPE":
            _transformers_llama_pipeline(tok, config)

        # Tokens declared only in tokenizer_config.json (transformers adds them too).
        known = {t.get("content") for t in raw.get("added_tokens") or []}
        extra: list[tuple[int, Any]] = []
        declared = config.get("added_tokens_decoder") or {}
        for tid, spec in sorted(declared.items(), key=lambda kv: int(kv[0])):
            content = _token_str(spec)
            if content is None or content in known or tok.token_to_id(content) is not None:
                continue
            flags = {k: bool(spec.get(k, False)) for k in ("single_word", "lstrip", "rstrip", "normalized")}
            extra.append((int(tid), AddedToken(content, special=bool(spec.get("special", True)), **flags)))
        if extra:
            tok.add_tokens([token for _, token in extra])
            for want, token in extra:
                got = tok.token_to_id(token.content)
                if got != want:
                    raise TokenizerError(
                        f"{config_name} declares {token.content!r} as id {want} but "
                        f"{vocab_name} puts it at {got}; the tokenizer files disagree, re-download them"
                    )

        # transformers rebuilds the post-processor when add_bos/eos_token is explicit.
        if "add_bos_token" in config or "add_eos_token" in config or tok.post_processor is None:
            bos = _token_str(config.get("bos_token"))
            eos = _token_str(config.get("eos_token"))
            add_bos = bool(config.get("add_bos_token", False)) and bos is not None
            add_eos = bool(config.get("add_eos_token", False)) and eos is not None
            single = f"{bos + ':0 ' if add_bos else ''}$A:0{' ' + eos + ':0' if add_eos else ''}"
            pair = f"{single}{' ' + bos + ':1' if add_bos else ''} $B:1{' ' + eos + ':1' if add_eos else ''}"
            specials = []
            for flag, name in ((add_bos, bos), (add_eos, eos)):
                if flag:
                    tid = tok.token_to_id(name)
                    if tid is None:
                        raise TokenizerError(f"{config_name} names {name!r} "
                                             f"as a special token but {vocab_name} has no such token")
                    specials.append((name, tid))
            tok.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)

        self._tok = tok
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self.special_ids = frozenset(
            tid for tid, added in tok.get_added_tokens_decoder().items() if added.special
        )
        has_byte_fallback = "ByteFallback" in json.dumps(raw.get("decoder"))
        self.byte_token_ids = frozenset(
            tid for t, tid in tok.get_vocab(with_added_tokens=False).items() if _BYTE_TOKEN_RE.match(t)
        ) if has_byte_fallback else frozenset()

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        if len(text) > _GIL_FREE_CHARS:  # the same tokens; encode_batch lets other threads run meanwhile
            return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def vocabulary(self) -> str:
        """The whole tokenizer as ``tokenizer.json`` text (fix-ups included)."""
        return self._tok.to_str()


# `tokenizers`' encode holds the GIL for its whole run (2.8 s for 4 MB: a server's event loop
# freezes that long); encode_batch releases it. Below this many characters encode is quicker.
_GIL_FREE_CHARS = 16384


def _check_unicode(text: str) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidParameterError(
            f"the text has a lone surrogate U+{ord(text[e.start]):04X} at character {e.start}, which is not "
            "valid Unicode; send UTF-8 text (a \\uD800-\\uDFFF escape only as half of a valid pair)"
        ) from None


# --------------------------------------------------------------------- llama2.c


class _Llama2cBackend:
    """llama2.c ``tok*.bin``: ``int32 max_token_length`` then per token
    ``float32 score, int32 len, bytes``. Ids 0/1/2 are <unk>/<s>/</s>, ids 3..258
    the byte-fallback tokens ``<0x00>``..``<0xFF>``."""

    BOS, EOS = 1, 2
    _SPECIAL_NAMES = {0: "<unk>", 1: "<s>", 2: "</s>"}

    def __init__(self, path: Path):
        try:
            data = path.read_bytes()
            offset = 4
            pieces: list[bytes] = []
            scores: list[float] = []
            while offset < len(data):
                score, n = struct.unpack_from("<fi", data, offset)
                offset += 8
                if n < 0 or offset + n > len(data):
                    raise struct.error("token length runs past the end of the file")
                pieces.append(data[offset : offset + n])
                scores.append(score)
                offset += n
        except (OSError, struct.error) as e:
            raise TokenizerError(
                f"{path} is not a llama2.c tokenizer ({e}); re-export it with llama2.c's tokenizer.py"
            ) from e
        if len(pieces) < 259:
            raise TokenizerError(f"{path} has only {len(pieces)} tokens; a llama2.c tokenizer has >= 259")
        self._pieces = pieces
        self._scores = scores
        self._lookup: dict[bytes, int] = {}
        for i, p in enumerate(pieces):
            self._lookup.setdefault(p, i)
        self.vocab_size = len(pieces)
        self.special_ids = frozenset(self._SPECIAL_NAMES)
        self.byte_token_ids = frozenset(range(3, 259))

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """run.c ``encode``: dummy-prefix space, per-char lookup with byte
        fallback, then merge the highest-scoring adjacent pair (leftmost on
        ties) until no pair is in the vocabulary. A heap with lazy deletion
        makes it O(n log n) but picks exactly the pair run.c's scan picks."""
        ids: list[int] = [self.BOS] if add_special_tokens else []
        if not text:
            return ids
        syms: list[int] = []
        space = self._lookup.get(b" ")
        if space is not None:
            syms.append(space)
        for ch in text:
            b = ch.encode("utf-8")
            tid = self._lookup.get(b)
            if tid is not None:
                syms.append(tid)
            else:
                syms.extend(byte + 3 for byte in b)
        n = len(syms)
        nxt = list(range(1, n + 1))  # linked list over symbol slots; n = end
        prv = list(range(-1, n - 1))
        alive = [True] * n
        heap: list[tuple[float, int, int, int]] = []  # (-score, left slot, left id, right id)

        def push(i: int) -> None:
            j = nxt[i]
            if j < n:
                merged = self._lookup.get(self._pieces[syms[i]] + self._pieces[syms[j]])
                if merged is not None:
                    heapq.heappush(heap, (-self._scores[merged], i, syms[i], syms[j]))

        for i in range(n - 1):
            push(i)
        while heap:
            _, i, left, right = heapq.heappop(heap)
            j = nxt[i] if alive[i] else n
            if j >= n or syms[i] != left or syms[j] != right:
                continue  # stale entry: a neighbour merged since it was pushed
            syms[i] = self._lookup[self._pieces[left] + self._pieces[right]]
            alive[j] = False
            nxt[i] = nxt[j]
            if nxt[j] < n:
                prv[nxt[j]] = i
            if prv[i] >= 0:
                push(prv[i])
            push(i)
        i = 0
        while i < n:
            ids.append(syms[i])
            i = nxt[i]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str:
        """Pieces joined, ``<0xXX>`` runs turned into bytes (a run that is not
        valid UTF-8 becomes one U+FFFD per byte, like the HF ByteFallback
        decoder) and the dummy-prefix space of the first piece stripped, which
        is run.c's "strip the space after BOS" for a whole sequence."""
        parts: list[str] = []
        run = bytearray()

        def close_run() -> None:
            if run:
                try:
                    parts.append(run.decode("utf-8"))
                except UnicodeDecodeError:
                    parts.append("\ufffd" * len(run))
                run.clear()

        for tid in ids:
            if tid in self._SPECIAL_NAMES:
                if not skip_special_tokens:
                    close_run()
                    parts.append(self._SPECIAL_NAMES[tid])
                continue
            if 3 <= tid < 259:
                run.append(tid - 3)
                continue
            close_run()
            parts.append(self._pieces[tid].decode("utf-8", errors="replace"))
        close_run()
        text = "".join(parts)
        return text[1:] if text.startswith(" ") else text

    def id_to_token(self, token_id: int) -> str | None:
        if not 0 <= token_id < self.vocab_size:
            return None
        if token_id in self._SPECIAL_NAMES:
            return self._SPECIAL_NAMES[token_id]
        return self._pieces[token_id].decode("utf-8", errors="replace").replace(" ", "▁")

    def token_to_id(self, token: str) -> int | None:
        for tid, name in self._SPECIAL_NAMES.items():
            if token == name:
                return tid
        return self._lookup.get(token.replace("▁", " ").encode("utf-8"))

    def vocabulary(self) -> list[bytes]:
        """Each token's bytes as it appears mid-sequence (byte-fallback tokens: their byte)."""
        out = [p for p in self._pieces]
        for tid, name in self._SPECIAL_NAMES.items():
            out[tid] = name.encode()
        for tid in range(3, 259):
            out[tid] = bytes([tid - 3])
        return out


# ----------------------------------------------------------------------- facade


def _find_llama2c_tokenizer(path: Path) -> Path | None:
    """A ``tok*.bin`` next to a llama2.c checkpoint (or the file itself)."""
    if path.is_file() and path.name.startswith("tok") and path.suffix == ".bin":
        return path
    directory = path if path.is_dir() else path.parent
    candidates = sorted(p for p in directory.glob("tok*.bin") if p.is_file())
    return candidates[0] if candidates else None


class Tokenizer:
    """One interface over an HF or llama2.c vocabulary (see module docstring)."""

    def __init__(
        self,
        backend: _Backend,
        *,
        bos_token_id: int | None,
        eos_token_ids: Iterable[int],
        pad_token_id: int | None = None,
        special_tokens: Mapping[str, str] | None = None,
        chat_templates: Mapping[str, ChatTemplate] | None = None,
        source: str = "",
    ):
        self._backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids: frozenset[int] = frozenset(eos_token_ids)
        self.pad_token_id = pad_token_id
        self.special_tokens: dict[str, str] = dict(special_tokens or {})
        self._chat_templates: dict[str, ChatTemplate] = dict(chat_templates or {})
        self.source = source
        # Does encode(add_special_tokens=True) prepend BOS? Probed once, so we
        # can drop a duplicate when the text itself starts with the BOS string.
        probe_on = backend.encode("a", True)
        probe_off = backend.encode("a", False)
        self._adds_bos = (
            bos_token_id is not None and len(probe_on) > len(probe_off) and probe_on[0] == bos_token_id
        )

    # ------------------------------------------------------------- loading
    @classmethod
    def load(cls, path: str | Path, gguf_header: Any = None, chat_template: ChatTemplate | None = None) -> Tokenizer:
        """Load from an HF model directory, a llama2.c checkpoint dir/``.bin``, or a GGUF file.

        ``gguf_header``: the GGUF's parsed header (``gguf_header.read_header``) where the model load has
        it already, so the file's header is parsed once per load; None reads it here.
        ``chat_template``: ``--chat-template``'s, used instead of the model's own (:meth:`use_chat_template`)."""
        tok = cls._load(path, gguf_header)
        if chat_template is not None:
            tok.use_chat_template(chat_template)
        return tok

    def use_chat_template(self, template: ChatTemplate) -> None:
        """Render every conversation with ``template`` (the model's own, tool_use included, are set aside).

        Its end-of-turn text, where the vocabulary holds it as one token, also ends generation: a family
        template given to a model that was not tuned with it must still stop where its turns end."""
        self._chat_templates = {"default": template}
        if template.end_of_turn:
            tid = self._backend.token_to_id(template.end_of_turn)
            if tid is not None:
                self.eos_token_ids = self.eos_token_ids | {tid}

    @classmethod
    def _load(cls, path: str | Path, gguf_header: Any = None) -> Tokenizer:
        from llmsys.engine.loader.gguf_io import is_gguf

        path = Path(path).expanduser()
        if not path.exists():
            raise TokenizerError(f"tokenizer path {path} does not exist; pass a model directory")
        if path.is_file() and (path.suffix.lower() == ".gguf" or is_gguf(path)):
            return cls._load_gguf(path, gguf_header)
        directory = path if path.is_dir() else path.parent
        if (directory / "tokenizer.json").is_file():
            return cls._load_hf(directory)
        tok_bin = _find_llama2c_tokenizer(path)
        if tok_bin is not None:
            backend = _Llama2cBackend(tok_bin)
            return cls(backend, bos_token_id=1, eos_token_ids=[2],
                       special_tokens={"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"},
                       source=str(tok_bin))
        if (directory / "tokenizer.model").is_file():
            raise TokenizerError(
                f"{directory} has tokenizer.model but no tokenizer.json; create it with "
                "transformers: AutoTokenizer.from_pretrained(dir).save_pretrained(dir)"
            )
        raise TokenizerError(
            f"no tokenizer in {directory}: expected tokenizer.json (Hugging Face) "
            "or tok*.bin (llama2.c) there"
        )

    @classmethod
    def _load_gguf(cls, path: Path, header: Any = None) -> Tokenizer:
        """A GGUF's own vocabulary, through the HF backend (the file plays both JSON files' part)."""
        from llmsys.engine.gguf_tokenizer import read_gguf_tokenizer

        if header is not None and Path(header.path) != path:
            header = None  # another file's (a draft model's, say): read this one's
        g = read_gguf_tokenizer(path, header)
        backend = _HFBackend.from_tokenizer(g.tokenizer, g.config, str(path))
        special_tokens = {key: value for key in ("bos_token", "eos_token", "unk_token", "pad_token")
                          if (value := _token_str(g.config.get(key))) is not None}
        templates = {name: ChatTemplate(text, str(path)) for name, text in g.chat_templates.items()}
        return cls(backend, bos_token_id=g.bos_token_id, eos_token_ids=g.eos_token_ids,
                   pad_token_id=g.pad_token_id, special_tokens=special_tokens, chat_templates=templates,
                   source=str(path))

    @classmethod
    def _load_hf(cls, directory: Path) -> Tokenizer:
        config_path = directory / "tokenizer_config.json"
        config = _read_json(config_path) if config_path.is_file() else {}
        backend = _HFBackend.from_directory(directory, config)

        special_tokens: dict[str, str] = {}
        for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
            value = _token_str(config.get(key))
            if value is not None:
                special_tokens[key] = value

        def tid(name: str) -> int | None:
            value = special_tokens.get(name)
            return None if value is None else backend.token_to_id(value)

        eos_ids = {i for i in [tid("eos_token")] if i is not None}
        pad_id = tid("pad_token")
        gen_path = directory / "generation_config.json"
        if gen_path.is_file():
            gen = _read_json(gen_path)
            extra = gen.get("eos_token_id")
            extra = [extra] if isinstance(extra, int) else (extra or [])
            eos_ids.update(int(i) for i in extra if isinstance(i, int))
            if pad_id is None and isinstance(gen.get("pad_token_id"), int):
                pad_id = gen["pad_token_id"]

        templates: dict[str, ChatTemplate] = {}
        raw_template = config.get("chat_template")
        if isinstance(raw_template, str):
            templates["default"] = ChatTemplate(raw_template, str(config_path))
        elif isinstance(raw_template, list):
            for entry in raw_template:
                if isinstance(entry, Mapping) and isinstance(entry.get("template"), str):
                    templates[str(entry.get("name", "default"))] = ChatTemplate(entry["template"], str(config_path))
        jinja_path = directory / "chat_template.jinja"
        if jinja_path.is_file():  # newer transformers save the template here; it wins
            templates["default"] = ChatTemplate(jinja_path.read_text(encoding="utf-8"), str(jinja_path))

        return cls(backend, bos_token_id=tid("bos_token"), eos_token_ids=eos_ids, pad_token_id=pad_id,
                   special_tokens=special_tokens, chat_templates=templates, source=str(directory))

    # ------------------------------------------------------------ vocabulary
    @property
    def vocab_size(self) -> int:
        return self._backend.vocab_size

    @property
    def all_special_ids(self) -> list[int]:
        ids = set(self._backend.special_ids) | set(self.eos_token_ids)
        ids |= {i for i in (self.bos_token_id, self.pad_token_id) if i is not None}
        return sorted(ids)

    @property
    def byte_token_ids(self) -> frozenset[int]:
        """Ids of ``<0xXX>`` byte-fallback tokens whose text depends on their
        neighbours (the incremental detokenizer holds them back)."""
        return self._backend.byte_token_ids

    def vocabulary(self) -> str | list[bytes]:
        """The vocabulary for a grammar engine (llmsys.engine.grammar): a Hugging Face
        ``tokenizer.json`` text, or for a llama2.c tokenizer each token's raw bytes."""
        return self._backend.vocabulary()

    def convert_ids_to_tokens(self, ids: int | Sequence[int]) -> str | list[str]:
        if isinstance(ids, int):
            return self._backend.id_to_token(ids) or ""
        return [self._backend.id_to_token(i) or "" for i in ids]

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> int | None | list[int | None]:
        if isinstance(tokens, str):
            return self._backend.token_to_id(tokens)
        return [self._backend.token_to_id(t) for t in tokens]

    # ------------------------------------------------------- encode / decode
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids; BOS is added exactly when the model's tokenizer adds it,
        and a BOS typed at the start of ``text`` is not doubled.

        Raises :class:`InvalidParameterError` for text that is not valid Unicode
        (a lone surrogate, which JSON's ``\\ud800`` can carry): the Rust tokenizer
        would fail with a TypeError that names nothing."""
        _check_unicode(text)
        ids = self._backend.encode(text, add_special_tokens)
        if add_special_tokens and self._adds_bos and len(ids) >= 2 and ids[1] == self.bos_token_id:
            ids = ids[1:]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(ids, skip_special_tokens)

    # ---------------------------------------------------------------- chat
    @property
    def chat_template(self) -> str | None:
        template = self._chat_templates.get("default")
        return None if template is None else template.source

    @property
    def default_chat_template(self) -> ChatTemplate | None:
        """The template a conversation without tools is rendered with (None: a base model)."""
        return self._chat_templates.get("default")

    def chat_template_source(self, tools: bool = False) -> str | None:
        """The template :meth:`apply_chat_template` renders with (``tools``: the ``tool_use`` one when
        the tokenizer has it), as text; None for a base model."""
        template = (self._chat_templates.get("tool_use") if tools else None) or self._chat_templates.get("default")
        return None if template is None else template.source

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> str:
        """Render a conversation to the prompt text the model was tuned on."""
        template = None
        if tools is not None:
            template = self._chat_templates.get("tool_use")
        template = template or self._chat_templates.get("default")
        if template is None and self._chat_templates:
            raise TokenizerError(
                f"the tokenizer in {self.source} has several chat templates "
                f"({', '.join(sorted(self._chat_templates))}) but none named 'default'"
            )
        if template is None:
            raise TokenizerError(
                f"the model in {self.source} has no chat template (it is a base model); "
                "drop --chat and pass a plain prompt"
            )
        return template.render(messages, add_generation_prompt=add_generation_prompt, tools=tools,
                               special_tokens=self.special_tokens, **template_kwargs)

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> list[int]:
        """Render then encode without adding special tokens: the template
        emits BOS itself, exactly as transformers' ``apply_chat_template(tokenize=True)``."""
        text = self.apply_chat_template(messages, add_generation_prompt, tools, **template_kwargs)
        return self.encode(text, add_special_tokens=False)

    def __repr__(self) -> str:
        return f"Tokenizer(source={self.source!r}, vocab_size={self.vocab_size})"
