"""llama2.c checkpoints (``stories260K.bin`` and friends).

Format (legacy version 0): a header of 7 int32 -- dim, hidden_dim, n_layers,
n_heads, n_kv_heads, vocab_size (negative = untied classifier), max_seq_len --
then float32 arrays: token embedding, attention norms, wq, wk, wv, wo, FFN
norms, w1, w2, w3, final norm, the RoPE tables (skipped), and the classifier
when untied. llama2.c applies RoPE to interleaved (even, odd) pairs while our
decoder rotates halves (as Hugging Face does), so wq/wk rows are permuted on
load; the permutation makes both conventions compute the same attention.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import torch

from llmsys.kernels.common.errors import CheckpointError
from llmsys.engine.loader import validate
from llmsys.engine.loader.safetensors_io import TensorInfo
from llmsys.engine.models import llama

HEADER = struct.Struct("<7i")
# HF config field -> the header field it is read from, for messages (validate.Origin).
HEADER_FIELDS = {"hidden_size": "dim", "intermediate_size": "hidden_dim", "num_hidden_layers": "n_layers",
                 "num_attention_heads": "n_heads", "num_key_value_heads": "n_kv_heads", "vocab_size": "vocab_size",
                 "max_position_embeddings": "max_seq_len"}


def find_checkpoint(p: Path) -> Path | None:
    if p.is_file() and p.suffix == ".bin" and not p.name.startswith("tok"):
        return p
    if p.is_dir() and not (p / "config.json").exists():
        bins = [b for b in sorted(p.glob("*.bin")) if not b.name.startswith("tok")]
        if len(bins) == 1:
            return bins[0]
    return None


def is_llama2c(p: Path) -> bool:
    return find_checkpoint(p) is not None


def _permute_rotary(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Interleaved-pair rows -> rotate-half rows, per head. w: [n_heads*hd, dim]."""
    out_dim, in_dim = w.shape
    hd = out_dim // n_heads
    return w.view(n_heads, hd // 2, 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)


def load(p: Path, dtype: torch.dtype, device: torch.device, make_linear, progress: bool, check_finite: bool = True):
    from llmsys.engine.loader.common import LoadedModel, embed_file, materialize

    ckpt = find_checkpoint(p)
    assert ckpt is not None
    size = ckpt.stat().st_size
    if size < HEADER.size:
        raise CheckpointError(f"{ckpt}: too short to be a llama2.c checkpoint")
    with open(ckpt, "rb") as f:
        dim, hidden, n_layers, n_heads, n_kv, vocab, seq_len = HEADER.unpack(f.read(HEADER.size))
    if min(dim, hidden, n_layers, n_heads, n_kv, seq_len) <= 0 or dim % n_heads:
        raise CheckpointError(f"{ckpt}: header does not describe a llama2.c model (dim={dim}, heads={n_heads})")
    shared = vocab > 0
    vocab = abs(vocab)
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": dim,
        "intermediate_size": hidden,
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "vocab_size": vocab,
        "max_position_embeddings": seq_len,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": shared,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    # Before the layout's sizes are computed from the header: the layer count is checked by the file's size below.
    args = validate.model_args(llama, cfg, validate.Origin(ckpt, "re-export the llama2.c checkpoint", HEADER_FIELDS))
    hd = dim // n_heads
    kv_dim = n_kv * hd
    # (name, shape) in file order; RoPE tables are skipped by offset.
    layout: list[tuple[str, tuple[int, ...]]] = [
        ("tok", (vocab, dim)),
        ("rms_att", (n_layers, dim)),
        ("wq", (n_layers, dim, dim)),
        ("wk", (n_layers, kv_dim, dim)),
        ("wv", (n_layers, kv_dim, dim)),
        ("wo", (n_layers, dim, dim)),
        ("rms_ffn", (n_layers, dim)),
        ("w1", (n_layers, hidden, dim)),
        ("w2", (n_layers, dim, hidden)),
        ("w3", (n_layers, hidden, dim)),
        ("rms_final", (dim,)),
        ("rope", (seq_len, hd)),  # freq_cis_real + freq_cis_imag, each [seq, hd/2]
    ]
    if not shared:
        layout.append(("wcls", (vocab, dim)))
    offsets: dict[str, tuple[int, tuple[int, ...]]] = {}
    off = HEADER.size
    for name, shape in layout:
        offsets[name] = (off, shape)
        n = 1
        for s in shape:
            n *= s
        off += 4 * n
    if off > size:
        raise CheckpointError(f"{ckpt}: truncated: expected {off} bytes for this header, the file has {size}")

    fd = os.open(ckpt, os.O_RDONLY)

    def read_slice(key: str, layer: int | None) -> torch.Tensor:
        base, shape = offsets[key]
        if layer is not None:
            shape = shape[1:]
            n = 1
            for s in shape:
                n *= s
            base += 4 * n * layer
        out = torch.empty(shape, dtype=torch.float32)
        os.preadv(fd, [memoryview(out.view(-1).numpy()).cast("B")], base)
        return out

    def read(name: str) -> torch.Tensor:
        parts = name.split(".")
        if name == "model.embed_tokens.weight":
            return read_slice("tok", None)
        if name == "model.norm.weight":
            return read_slice("rms_final", None)
        if name == "lm_head.weight":
            return read_slice("wcls", None)
        i = int(parts[2])
        leaf = ".".join(parts[3:])
        table = {
            "input_layernorm.weight": "rms_att",
            "post_attention_layernorm.weight": "rms_ffn",
            "self_attn.q_proj.weight": "wq",
            "self_attn.k_proj.weight": "wk",
            "self_attn.v_proj.weight": "wv",
            "self_attn.o_proj.weight": "wo",
            "mlp.gate_proj.weight": "w1",
            "mlp.down_proj.weight": "w2",
            "mlp.up_proj.weight": "w3",
        }
        t = read_slice(table[leaf], i)
        if leaf == "self_attn.q_proj.weight":
            t = _permute_rotary(t, n_heads)
        elif leaf == "self_attn.k_proj.weight":
            t = _permute_rotary(t, n_kv)
        return t

    tok_off, tok_shape = offsets["tok"]
    emb = embed_file(args, ckpt, TensorInfo("tok", torch.float32, tok_shape, tok_off, 4 * vocab * dim))
    with torch.device("meta"):
        model = llama.Model(args, embed_file=emb)
    try:
        materialize(model, read, lambda n: not (n == "lm_head.weight" and shared), dtype, device, ckpt, make_linear,
                    progress, check_finite=check_finite)
    finally:
        os.close(fd)
    model.eval()
    return LoadedModel(model, args, "llama", ckpt, ckpt.parent, dtype, device, cfg, {"bos_token_id": 1, "eos_token_id": 2})
