"""Random-weight checkpoints of standard shapes, so a bare machine can be benchmarked.

Speed depends on shape and dtype, not on the weights, so ``llmsys bench --synthetic llama-8b`` needs no
download. Our decoder on the meta device names every tensor as an HF checkpoint does; each is drawn from
a seeded generator into safetensors shards with the shape's config.json and a word-level tokenizer of
the same vocabulary size. A real folder (not an in-memory model) keeps quantization, offload and the
transformers baseline on their ordinary load path. Cached under ``$LLMSYS_HOME/synthetic/<name>-seed<seed>``;
the same name and seed give the same bytes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from llmsys.kernels.common.errors import InvalidParameterError

SHARD_BYTES = 1 << 30  # 1 GiB per safetensors shard: bounds peak RAM while writing
_DONE = ".llmsys-synthetic.json"


def synthetic_names() -> list[str]:
    from llmsys.engine.catalog import synthetic_configs

    return list(synthetic_configs())


def synthetic_config(name: str) -> dict[str, Any]:
    from llmsys.engine.catalog import synthetic_configs

    shapes = synthetic_configs()
    if name not in shapes:
        folded = {k.lower(): k for k in shapes}
        if name.lower() not in folded:
            raise InvalidParameterError(
                f"unknown synthetic shape {name!r}; choose one of {', '.join(shapes)} (models.toml [synthetic.*])"
            )
        name = folded[name.lower()]
    return dict(shapes[name])


def cut_layers(cfg: dict[str, Any], layers: int, name: str = "the shape") -> dict[str, Any]:
    """``cfg`` with only its first ``layers`` decoder layers, every width kept.

    Why: a full-width model with fewer layers benches a big shape's per-layer
    cost (kernels, expert reads, KV per token) in this machine's RAM; tok/s
    scales by layers/total for a layer-equivalent figure. Per-layer lists
    (``layer_types``, ``mlp_only_layers``) are cut to match.
    """
    total = int(cfg["num_hidden_layers"])
    if not 1 <= layers <= total:
        raise InvalidParameterError(f"--layers {layers}: {name} has {total} layers; choose 1..{total}")
    out = dict(cfg, num_hidden_layers=layers)
    if isinstance(out.get("layer_types"), list):
        out["layer_types"] = out["layer_types"][:layers]
    if isinstance(out.get("mlp_only_layers"), list):
        out["mlp_only_layers"] = [i for i in out["mlp_only_layers"] if i < layers]
    return out


def synthetic_dir(name: str, seed: int = 0, root: Path | None = None) -> Path:
    from llmsys.kernels.common.paths import llmsys_home

    return (root or llmsys_home() / "synthetic") / f"{name}-seed{seed}"


def _fill(name: str, shape: tuple[int, ...], gen: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """Scale like a trained model: unit norms, N(0, 0.02) matrices, small biases."""
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=dtype)
    std = 0.02 if len(shape) == 2 else 0.01
    return (torch.randn(shape, generator=gen, dtype=torch.float32) * std).to(dtype)


def param_count(cfg: dict[str, Any]) -> int:
    """Parameters of a config's architecture (tied embeddings counted once)."""
    return sum(int(torch.Size(shape).numel()) for _, shape in _param_shapes(cfg))


def _param_shapes(cfg: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor a checkpoint of this config holds, with HF names (meta device)."""
    from llmsys.engine.models import family_for, text_config

    cfg = text_config(cfg, "synthetic config")  # a multimodal shape counts its text model (the one loaded)
    family = family_for(cfg, "synthetic config")
    args = family.ModelArgs.from_hf_config(cfg)
    with torch.device("meta"):
        model = family.Model(args)
    out = []
    for n, p in model.named_parameters():  # shared (tied) tensors are listed once
        if args.tie_word_embeddings and n == "lm_head.weight":
            continue
        out.append((n, tuple(p.shape)))
    return out


def write_wordlevel_tokenizer(out: Path, vocab_size: int, bos_id: int | None, eos_id: int | None) -> None:
    """A tokenizer with exactly ``vocab_size`` ids: token ``i`` is the word ``t<i>``.

    Text made by decoding random ids re-encodes to the same ids, so the
    end-to-end figures tokenize prompts of the intended length.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(vocab_size)}
    specials = {"<unk>": 0}
    if bos_id is not None:
        specials["<s>"] = bos_id
    if eos_id is not None:
        specials["</s>"] = eos_id
    for tok, i in specials.items():
        vocab.pop(f"t{i}", None)
        vocab[tok] = i
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.save(str(out / "tokenizer.json"))
    cfg: dict[str, Any] = {"unk_token": "<unk>", "add_bos_token": False}
    if bos_id is not None:
        cfg["bos_token"] = "<s>"
    if eos_id is not None:
        cfg["eos_token"] = "</s>"
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))


def make_synthetic(
    name: str, seed: int = 0, root: Path | None = None, progress: bool = False, config: dict[str, Any] | None = None
) -> Path:
    """Create (or reuse) the random-weight checkpoint folder of shape ``name``.

    ``config`` overrides the models.toml shape (an HF config dict), e.g. a
    cut-down copy for tests.
    """
    from safetensors.torch import save_file

    cfg = dict(config) if config is not None else synthetic_config(name)
    out = synthetic_dir(name, seed, root)
    if (out / _DONE).exists():
        return out
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    dtype = getattr(torch, cfg.get("torch_dtype", "bfloat16"))
    gen = torch.Generator().manual_seed(seed)
    shapes = _param_shapes(cfg)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    total = 0
    names_files: dict[str, int] = {}
    files: list[str] = []

    def flush() -> None:
        idx = len(files)
        fname = f"model-{idx + 1:05d}.safetensors"
        save_file(shards[-1], str(tmp / fname), metadata={"format": "pt"})
        files.append(fname)
        shards[-1] = {}

    for i, (n, shape) in enumerate(shapes):
        t = _fill(n, shape, gen, dtype)
        nb = t.numel() * t.element_size()
        if size and size + nb > SHARD_BYTES:
            flush()
            size = 0
        shards[-1][n] = t
        names_files[n] = len(files)
        size += nb
        total += nb
        if progress:
            print(f"\rsynthetic {name}: {i + 1}/{len(shapes)} tensors", end="", flush=True)
    flush()
    if progress:
        print()
    if len(files) == 1:
        (tmp / files[0]).rename(tmp / "model.safetensors")
    else:
        # Renumber as HF does ("-of-N") and write the index.
        final = [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))]
        for a, b in zip(files, final):
            (tmp / a).rename(tmp / b)
        index = {"metadata": {"total_size": total}, "weight_map": {n: final[j] for n, j in names_files.items()}}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    bos, eos = cfg.get("bos_token_id"), cfg.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) else eos
    write_wordlevel_tokenizer(tmp, cfg["vocab_size"], bos, eos)
    gen_cfg = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in cfg}
    (tmp / "generation_config.json").write_text(json.dumps(gen_cfg))
    (tmp / _DONE).write_text(json.dumps({"name": name, "seed": seed, "weight_bytes": total}))
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out
