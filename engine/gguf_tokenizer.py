"""A ``tokenizers.Tokenizer`` rebuilt from a GGUF file's ``tokenizer.ggml.*`` metadata.

A GGUF has no ``tokenizer.json``, only flattened arrays (pieces, scores, types, merges) and a few keys;
this rebuilds the ``tokenizer.json``-shaped tokenizer and the ``tokenizer_config.json`` mapping, so
:mod:`llmsys.engine.tokenizer` runs a ``.gguf`` through exactly the code it runs a directory through.
``llama`` (SentencePiece BPE, byte fallback) stores no merges: every split ``a + b`` of a piece is a merge
ranked by the piece's score, which reproduces a converted ``tokenizer.json``'s merges exactly (llama.cpp
and :mod:`llmsys.engine.bench.gguf_export` files alike). ``gpt2`` (byte-level BPE): pieces and merges as
stored, the split regex named by ``tokenizer.ggml.pre`` (:data:`_PRE_TOKENIZERS`). The header is parsed
by ``engine.loader.gguf_header`` (no tensor data read).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import numpy as np

from llmsys.kernels.common.errors import TokenizerError

if TYPE_CHECKING:  # imported where used: loading a directory needs neither
    import tokenizers

    from llmsys.engine.loader.gguf_header import GGUFHeader

# gguf.TokenType values, spelled out so this module imports without gguf.
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6
# Types that never come out of a merge (nor go into one): matched whole before
# BPE runs (control, unknown), reached only by byte fallback, or padding.
_NOT_MERGED = frozenset({_UNKNOWN, _CONTROL, _UNUSED, _BYTE})
_SPM_SPACE = "\u2581"  # "▁", SentencePiece's visible space

# The split regexes llama.cpp applies (src/llama-vocab.cpp, llm_tokenizer_bpe), one Split each, in order:
# its adapted forms, not the tokenizer.json originals (contractions spelled [sS] instead of (?i:...), which
# also folds 'ſ'; GPT-4o/Tekken's upper/lower letter classes as lookaheads over \p{L}).
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3_SPLIT = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_UPPER, _LOWER = r"((?=[\p{L}])([^a-z]))", r"((?=[\p{L}])([^A-Z]))"  # a letter not a-z / not A-Z
_TEKKEN_SPLIT = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
                 r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O_SPLIT = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTIONS}?"
                rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTIONS}?"
                r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")


@dataclass(frozen=True)
class _PreTokenizer:
    """How llama.cpp splits text for one ``tokenizer.ggml.pre`` before byte-level BPE (and its flags)."""

    splits: tuple[str, ...]  # regexes applied in turn, each with "isolated" behaviour
    ignore_merges: bool = False  # a whole pre-token found in the vocabulary skips BPE
    add_bos: bool = False  # llama.cpp's default when the file has no add_bos_token key


_GPT2 = _PreTokenizer((_GPT2_SPLIT,))
# What llama.cpp runs for "default" (and a file without the key): not GPT-2's single regex.
_DEFAULT = _PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", _GPT2_SPLIT, r"\p{N}+", r"[0-9][0-9][0-9]"))
_LLAMA3 = _PreTokenizer((_LLAMA3_SPLIT,), ignore_merges=True, add_bos=True)
_QWEN2 = _PreTokenizer((_QWEN2_SPLIT,))
_SMOLLM = _PreTokenizer((r"\p{N}", _GPT2_SPLIT))
_TEKKEN = _PreTokenizer((_TEKKEN_SPLIT,), ignore_merges=True, add_bos=True)
_GPT4O = _PreTokenizer((_GPT4O_SPLIT,))
# tokenizer.ggml.pre -> its pre-tokenizer, with llama.cpp's aliases.
_PRE_TOKENIZERS: Mapping[str, _PreTokenizer] = MappingProxyType({
    "default": _DEFAULT, "gpt2": _GPT2, "gpt-2": _GPT2, "phi-2": _GPT2,
    "llama-bpe": _LLAMA3, "llama3": _LLAMA3, "llama-v3": _LLAMA3, "falcon3": _LLAMA3, "pixtral": _LLAMA3,
    "qwen2": _QWEN2, "deepseek-r1-qwen": _QWEN2, "megrez": _QWEN2,
    "smollm": _SMOLLM, "starcoder": _SMOLLM,
    "tekken": _TEKKEN,
    "gpt-4o": _GPT4O, "llama4": _GPT4O,
})
_VOCAB_KINDS = ("llama (SentencePiece BPE)", "gpt2 (byte-level BPE)")
_FIX = "run the model's Hugging Face directory (config.json + tokenizer.json) instead"
# Token texts llama.cpp ends generation on whatever the keys say (llama-vocab.cpp's EOG list).
_EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<end_of_turn>",
    "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>",
    "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>", "<\uff5cend\u2581of\u2581sentence\uff5c>",
})
# FIM tokens llama.cpp finds by text where the keys are absent; their pad, repo and file-separator ones end
# generation too.
_FIM_TEXTS = MappingProxyType({
    "fim_pad_token_id": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep_token_id": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep_token_id": ("<|file_sep|>",),
})
# gpt-oss (harmony): llama.cpp turns these control tokens into user-defined ones, so they are split out of
# any text and survive decoding for the harmony parser.
_HARMONY_SHOWN = frozenset({"<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"})


@dataclass(frozen=True)
class GGUFTokenizer:
    """What a GGUF says about its tokenizer, in Hugging Face terms.

    ``tokenizer`` follows the file (for a ``llama`` vocabulary: the
    ``Prepend("▁")`` normalizer a converted ``tokenizer.json`` has, which is
    also what llama.cpp does); ``config`` is the ``tokenizer_config.json``
    equivalent, whose ``tokenizer_class`` lets the loader apply transformers'
    own Llama pipeline on top, exactly as for a directory.
    """

    path: Path
    vocab_kind: str  # "llama" or "gpt2"
    pre: str | None  # tokenizer.ggml.pre of a gpt2 vocabulary
    tokenizer: tokenizers.Tokenizer
    config: Mapping[str, Any]
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]  # eos, then eot / eom where the file has them
    unk_token_id: int | None
    pad_token_id: int | None
    chat_templates: Mapping[str, str] = field(default_factory=dict)  # "default" and named ones


def read_gguf_tokenizer(path: str | Path, header: GGUFHeader | None = None) -> GGUFTokenizer:
    """Build the tokenizer a GGUF file describes, or raise one-line :class:`TokenizerError`.

    ``header``: the file's :func:`~llmsys.engine.loader.gguf_header.read_header`, where the caller
    has parsed it already (the model load does), so the header is read once per load.
    """
    path = Path(path)
    meta = _read_metadata(path, header)
    kind = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if kind is None or tokens is None:
        raise TokenizerError(
            f"{path} has no tokenizer metadata (tokenizer.ggml.model / tokenizer.ggml.tokens); "
            f"re-convert it with llama.cpp's convert_hf_to_gguf.py, or {_FIX}"
        )
    # llama.cpp renames an empty piece (it could not be looked up) and keeps the last id of a repeated one.
    tokens = [t or f"[EMPTY_{i}]" for i, t in enumerate(_str_list(path, "tokenizer.ggml.tokens", tokens))]
    n = len(tokens)
    types = meta.get("tokenizer.ggml.token_type")
    types = [_NORMAL] * n if types is None else list(map(int, _array(path, "tokenizer.ggml.token_type", types)))
    _check_len(path, "tokenizer.ggml.token_type", types, n)

    spm = kind == "llama"
    defaults = {"bos_token_id": 1, "eos_token_id": 2, "unknown_token_id": 0} if spm else {}
    ids = {key: _token_id(path, meta, key, n, defaults.get(key)) for key in
           ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id", "eot_token_id", "eom_token_id",
            "fim_pad_token_id", "fim_rep_token_id", "fim_sep_token_id")}
    pre_name: str | None = None
    if spm:
        add_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
        tok = _build_spm(path, meta, tokens, types, ids["unknown_token_id"], add_prefix)
        default_add_bos = True  # llama.cpp's default for a SentencePiece vocabulary
    elif kind == "gpt2":
        raw_pre = meta.get("tokenizer.ggml.pre")
        pre_name = "default" if raw_pre is None else str(raw_pre)
        spec = _PRE_TOKENIZERS.get(pre_name)
        if spec is None:
            raise TokenizerError(
                f"{path}: tokenizer.ggml.pre {pre_name!r} is not a pre-tokenizer llmsys knows "
                f"(supported: {', '.join(sorted(_PRE_TOKENIZERS))}); {_FIX}"
            )
        tok = _build_byte_level(path, meta, tokens, types, spec)
        default_add_bos = spec.add_bos
    else:
        raise TokenizerError(
            f"{path}: tokenizer.ggml.model {kind!r} is not supported (llmsys reads "
            f"{' and '.join(_VOCAB_KINDS)} vocabularies); {_FIX}"
        )

    eog = _end_of_generation(tokens, ids)
    attrs = _token_attrs(tokens, types, eog)
    rstrip = _phi3_rstrip(meta, tokens, attrs)
    _add_special_tokens(tok, tokens, attrs, rstrip)
    config: dict[str, Any] = {"add_prefix_space": bool(meta.get("tokenizer.ggml.add_space_prefix", spm))}
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                      ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
        if ids[key] is not None:
            config[name] = tokens[ids[key]]
    config["add_bos_token"] = bool(meta.get("tokenizer.ggml.add_bos_token", default_add_bos))
    config["add_eos_token"] = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    templates = _chat_templates(meta)
    if "default" in templates:
        config["chat_template"] = templates["default"]
    return GGUFTokenizer(
        path=path, vocab_kind=str(kind), pre=pre_name, tokenizer=tok, config=config,
        bos_token_id=ids["bos_token_id"], eos_token_ids=eog, unk_token_id=ids["unknown_token_id"],
        pad_token_id=ids["padding_token_id"], chat_templates=templates,
    )


def _end_of_generation(tokens: Sequence[str], ids: Mapping[str, int | None]) -> tuple[int, ...]:
    """The ids llama.cpp stops generating at: eos, eot, eom and the FIM pad/repo/separator ids from the
    keys, plus every token whose text is on its list (Gemma's ``<end_of_turn>``, ChatML's ``<|im_end|>``...
    which files often do not name). Why its list and not only the keys: a Gemma GGUF names ``<eos>``,
    but the chat model ends its turns with ``<end_of_turn>``."""
    named = [ids[k] for k in ("eos_token_id", "eot_token_id", "eom_token_id")]
    for key, texts in _FIM_TEXTS.items():
        named.append(ids[key] if ids[key] is not None else next((i for i, t in enumerate(tokens) if t in texts), None))
    found = [i for i, t in enumerate(tokens) if t in _EOG_TEXTS]
    eog = dict.fromkeys(i for i in (*named, *found) if i is not None)
    texts = {tokens[i]: i for i in eog}
    # harmony: <|end|> ends a message, not the generation, where <|return|> and <|call|> exist.
    if "<|end|>" in texts and (("<|return|>" in texts and ("<|call|>" in texts or "<|calls|>" in texts))
                               or ("<|calls|>" in texts and "<|flush|>" in texts)):
        eog.pop(texts["<|end|>"])
    if "</s>" in texts and ("<|tool_response>" in texts or "<|plamo:eos|>" in texts):
        eog.pop(texts["</s>"])
    return tuple(eog)


def _token_attrs(tokens: Sequence[str], types: Sequence[int], eog: Sequence[int]) -> list[int]:
    """Token types as llama.cpp uses them: its harmony override (see :data:`_HARMONY_SHOWN`, and
    ``<|end|>`` where it is not an end of generation) made user-defined."""
    attrs = list(types)
    for i, t in enumerate(tokens):
        if t in _HARMONY_SHOWN:
            attrs[i] = _USER_DEFINED
    ends = {tokens[i] for i in eog}
    if "<|end|>" not in ends and "<|return|>" in ends:
        for i, t in enumerate(tokens):
            if t == "<|end|>":
                attrs[i] = _USER_DEFINED
    return attrs


def _phi3_rstrip(meta: Mapping[str, Any], tokens: Sequence[str], attrs: Sequence[int]) -> frozenset[int]:
    """Ids whose following whitespace llama.cpp drops: for a model named Phi-3, every special token but
    ``<unk>``, ``<s>`` and ``<|endoftext|>`` (llama-vocab.cpp sets this by ``general.name``)."""
    name = str(meta.get("general.name", "")).lower()
    if "phi-3" not in name and "phi3" not in name:
        return frozenset()
    keep = {"<unk>", "<s>", "<|endoftext|>"}
    return frozenset(i for i, t in enumerate(tokens)
                     if attrs[i] in (_CONTROL, _USER_DEFINED, _UNKNOWN) and t not in keep)


# ------------------------------------------------------------------ reading


def _read_metadata(path: Path, header: GGUFHeader | None) -> dict[str, Any]:
    """Every ``tokenizer.*`` key (and the architecture and name) as Python values (``engine.loader.gguf_header``:
    strings as str, string arrays as lists, numeric arrays as numpy arrays)."""
    from llmsys.engine.loader.gguf_header import read_header
    from llmsys.kernels.common.errors import CheckpointError

    if header is None:
        try:
            header = read_header(path)
        except CheckpointError as e:
            raise TokenizerError(f"cannot read the tokenizer: {e}") from None
    return {name: v for name, v in header.fields.items()
            if name.startswith("tokenizer.") or name in ("general.architecture", "general.name")}


def _array(path: Path, name: str, value: Any) -> list[Any]:
    """A numeric array field as a list (one element per entry, as gguf stores them)."""
    if not isinstance(value, np.ndarray):
        raise TokenizerError(f"{path}: metadata key {name} is not a numeric array; re-convert the file")
    return value.tolist()


def _str_list(path: Path, name: str, value: Any) -> list[str]:
    if not isinstance(value, list) or not set(map(type, value)) <= {str}:
        raise TokenizerError(f"{path}: metadata key {name} is not an array of strings; re-convert the file")
    return value


def _check_len(path: Path, name: str, values: Sequence[Any], n: int) -> None:
    if len(values) != n:
        raise TokenizerError(
            f"{path}: {name} has {len(values)} entries but tokenizer.ggml.tokens has {n}; "
            "the vocabulary arrays disagree, re-convert or re-download the file"
        )


def _token_id(path: Path, meta: Mapping[str, Any], key: str, n: int, default: int | None) -> int | None:
    """``tokenizer.ggml.<key>``, else llama.cpp's default for the vocabulary kind (where in range)."""
    value = meta.get(f"tokenizer.ggml.{key}")
    if value is None:
        return default if default is not None and default < n else None
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < n:
        raise TokenizerError(
            f"{path}: tokenizer.ggml.{key} = {value!r} is not a token id (the vocabulary has {n} tokens); "
            "the file is damaged, re-convert or re-download it"
        )
    return value


def _chat_templates(meta: Mapping[str, Any]) -> dict[str, str]:
    """``tokenizer.chat_template`` as "default", plus ``tokenizer.chat_template.<name>`` ones."""
    templates: dict[str, str] = {}
    if isinstance(meta.get("tokenizer.chat_template"), str):
        templates["default"] = meta["tokenizer.chat_template"]
    prefix = "tokenizer.chat_template."
    for key, value in meta.items():
        if key.startswith(prefix) and isinstance(value, str):
            templates[key[len(prefix):]] = value
    return templates


# ----------------------------------------------------------------- building


def _vocab(tokens: Sequence[str]) -> dict[str, int]:
    """piece -> id; a piece listed twice keeps its last id, as llama.cpp's lookup does."""
    return dict(zip(tokens, range(len(tokens))))


def _file_merges(path: Path, meta: Mapping[str, Any]) -> list[tuple[str, str]] | None:
    """The stored merges as pairs. Split and checked in whole-list steps (a Python loop per merge was a third
    of a 50k-merge vocabulary's build); the first bad entry is looked for only when there is one."""
    fld = meta.get("tokenizer.ggml.merges")
    if fld is None:
        return None
    text = _str_list(path, "tokenizer.ggml.merges", fld)
    merges = list(map(tuple, map(str.split, text, itertools.repeat(" "))))
    if set(map(len, merges)) - {2} or "" in itertools.chain.from_iterable(merges):
        m = next(m for m, parts in zip(text, merges) if len(parts) != 2 or not all(parts))
        raise TokenizerError(
            f"{path}: tokenizer.ggml.merges entry {m!r} is not two pieces separated by a space; re-convert the file"
        )
    return merges


def spm_merges_from_scores(
    tokens: Sequence[str], scores: Sequence[float], types: Sequence[int]
) -> list[tuple[str, str]]:
    """BPE merges implied by SentencePiece scores.

    Why this order: SentencePiece's BPE merges the adjacent pair whose joined
    piece scores highest, so each split ``(a, b)`` of a piece is a merge with
    that piece's score; merges are sorted by score, highest first, ties kept in
    piece-id order (longer pieces first among equal scores, see below), and a
    piece's own splits ordered by the ids of ``a`` then ``b``. Where scores
    differ per piece this is the HF SentencePiece conversion's order, so a
    converted ``tokenizer.json``'s merge list comes back exactly. Control, unknown, byte
    and unused pieces are left out: they are matched whole or reached by byte
    fallback, never merged.
    """
    vocab = {t: i for i, t in reversed(list(enumerate(tokens))) if types[i] not in _NOT_MERGED}
    ranked: list[tuple[float, str, str]] = []
    for i, piece in enumerate(tokens):
        if types[i] in _NOT_MERGED or len(piece) < 2 or vocab.get(piece) != i:
            continue
        local = [(piece[:k], piece[k:]) for k in range(1, len(piece)) if piece[:k] in vocab and piece[k:] in vocab]
        local.sort(key=lambda ab: (vocab[ab[0]], vocab[ab[1]]))
        ranked.extend((float(scores[i]), a, b) for a, b in local)
    # Stable: equal scores go longer piece first, then in piece order. llama.cpp breaks a tie between
    # different pieces by position (leftmost first), which no fixed order reproduces in general; longer
    # first reproduces it for the case that occurs, runs such as Gemma's "▁▁", "▁▁▁"... (all scored 0),
    # which llama.cpp grows from the left.
    ranked.sort(key=lambda m: (-m[0], -len(m[1]) - len(m[2])))
    return [(a, b) for _, a, b in ranked]


def _bpe(path: Path, vocab: dict[str, int], merges: list[tuple[str, str]], **kwargs: Any) -> tokenizers.Tokenizer:
    from tokenizers import Tokenizer
    from tokenizers.models import BPE

    try:
        return Tokenizer(BPE(vocab=vocab, merges=merges, **kwargs))
    except Exception as e:  # the Rust side raises plain Exception (e.g. a merge of unknown pieces)
        raise TokenizerError(f"{path}: the vocabulary does not form a BPE model ({e}); re-convert the file") from e


def _build_spm(path: Path, meta: Mapping[str, Any], tokens: list[str], types: list[int],
               unk_id: int | None, add_prefix: bool) -> tokenizers.Tokenizer:
    """SentencePiece-style BPE run as llama.cpp runs it.

    Why a normalizer and no pre-tokenizer: llama.cpp replaces spaces by "▁" and, with
    ``add_space_prefix``, puts one before *every* stretch of text between special tokens (not only the
    first, as transformers does), then merges over the whole stretch; ``Prepend`` in a normalizer does
    the same, since normalizers run per stretch between added tokens.
    """
    from tokenizers import decoders, normalizers

    merges = _file_merges(path, meta)
    if merges is None:
        fld = meta.get("tokenizer.ggml.scores")
        if fld is None:
            raise TokenizerError(
                f"{path}: a llama (SentencePiece) vocabulary needs tokenizer.ggml.scores or "
                f"tokenizer.ggml.merges and the file has neither; {_FIX}"
            )
        scores = [float(s) for s in _array(path, "tokenizer.ggml.scores", fld)]
        _check_len(path, "tokenizer.ggml.scores", scores, len(tokens))
        merges = spm_merges_from_scores(tokens, scores, types)
    vocab = _vocab(tokens)
    unk = tokens[unk_id] if unk_id is not None else None
    tok = _bpe(path, vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True)
    steps = [normalizers.Prepend(_SPM_SPACE)] if add_prefix else []
    tok.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", _SPM_SPACE)])
    dec = [decoders.Replace(_SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix:
        dec.append(decoders.Strip(content=" ", left=1, right=0))
    tok.decoder = decoders.Sequence(dec)
    return tok


def _build_byte_level(path: Path, meta: Mapping[str, Any], tokens: list[str], types: list[int],
                      spec: _PreTokenizer) -> tokenizers.Tokenizer:
    """Byte-level BPE split as llama.cpp splits for ``tokenizer.ggml.pre`` (no normalizer: llama.cpp
    applies none, so e.g. Qwen2's NFC is not applied to a GGUF's input either)."""
    from tokenizers import Regex, decoders, pre_tokenizers

    merges = _file_merges(path, meta)
    if merges is None:
        raise TokenizerError(f"{path}: a gpt2 (byte-level BPE) vocabulary needs tokenizer.ggml.merges; {_FIX}")
    tok = _bpe(path, _vocab(tokens), merges, ignore_merges=spec.ignore_merges)
    steps: list[Any] = [pre_tokenizers.Split(Regex(r), behavior="isolated", invert=False) for r in spec.splits]
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tok.decoder = decoders.ByteLevel()
    return tok


def _add_special_tokens(tok: tokenizers.Tokenizer, tokens: Sequence[str], attrs: Sequence[int],
                        rstrip: frozenset[int]) -> None:
    """Control/unknown pieces as special added tokens, user-defined ones as plain added tokens.

    Why: llama.cpp splits both out of the raw text before the model's own splitting (user-defined ones
    always, control ones when special tokens are parsed); only the control ones are dropped when
    decoding without special tokens. Each is already in the BPE vocabulary, so it keeps its file id.
    """
    from tokenizers import AddedToken

    vocab = _vocab(tokens)
    special = [AddedToken(t, special=True, normalized=False, rstrip=i in rstrip)
               for i, t in enumerate(tokens) if attrs[i] in (_CONTROL, _UNKNOWN) and vocab[t] == i]
    plain = [AddedToken(t, special=False, normalized=False, rstrip=i in rstrip)
             for i, t in enumerate(tokens) if attrs[i] == _USER_DEFINED and vocab[t] == i]
    if special:
        tok.add_special_tokens(special)
    if plain:
        tok.add_tokens(plain)
