"""AWQ calibration (`llmsys quantize --method awq`): the scale and clip searches, the
layer's input scale, the folds into the model, and the quantize -> run round trip."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from llmsys import LLM, SamplingParams
from llmsys.kernels.common.errors import InvalidParameterError
from llmsys.engine.scoring import score_sequences
from llmsys.quant import awq, parse_quant
from llmsys.quant.awq import fake_quant, output_error, quantize_int4_clipped, search_clip, search_scale
from llmsys.quant.int4 import Int4Linear, dequantize_int4, quantize_int4
from conftest import A8_REL_ERR, C_KERNEL, CORPUS, need_shared
from tiny_models import make_hf_model

GREEDY = SamplingParams(max_tokens=24, temperature=0)


def _outlier_inputs(samples: int = 2048, k: int = 128, seed: int = 0) -> torch.Tensor:
    """Activations with a few large channels, as in real LLMs (what AWQ exploits)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, k, generator=gen)
    x[:, :4] *= 20.0
    return x


def test_clipped_quantizer_is_rtn_without_clipping():
    torch.manual_seed(0)
    w = torch.randn(48, 172)  # ragged K: padded to 192
    t = quantize_int4_clipped(w, 64)
    for a, b in zip((t["qweight"], t["scales"], t["zeros"]), quantize_int4(w, 64)):
        assert torch.equal(a, b)
    assert torch.equal(fake_quant(w, 64), dequantize_int4(t["qweight"], t["scales"], t["zeros"], 172))
    ratio = torch.full((48, 3), 0.8)
    t = quantize_int4_clipped(w, 64, ratio)
    assert torch.equal(fake_quant(w, 64, ratio), dequantize_int4(t["qweight"], t["scales"], t["zeros"], 172))
    with pytest.raises(InvalidParameterError, match="group size"):
        quantize_int4_clipped(w, 48)


def test_output_error_is_the_mean_squared_output_error():
    x = _outlier_inputs(256, 32)
    d = torch.randn(8, 32)
    assert output_error(d, x.t() @ x / 256) == pytest.approx(((x @ d.t()) ** 2).sum().item() / 256, rel=1e-4)


def test_scale_search_beats_rtn_on_outlier_channels():
    x = _outlier_inputs()
    h = x.t() @ x / x.shape[0]
    gen = torch.Generator().manual_seed(1)
    ws = [torch.randn(96, 128, generator=gen) * 0.05, torch.randn(64, 128, generator=gen) * 0.05]
    s, errors = search_scale(ws, x.abs().mean(0), h, 64)
    assert len(errors) == awq.ALPHA_GRID and s.shape == (128,)
    rtn = sum(output_error(w - fake_quant(w, 64), h) for w in ws)
    assert errors[0] == pytest.approx(rtn, rel=1e-5)  # alpha = 0 is round-to-nearest
    best = sum(output_error(w - fake_quant(w * s, 64) / s, h) for w in ws)
    assert best == pytest.approx(min(errors), rel=1e-5) and best < 0.7 * rtn, (best, rtn)
    assert s[:4].min() > s[4:].max()  # the loud channels get the finer grid


def test_clip_search_never_loses_to_plain_rounding():
    x = _outlier_inputs(seed=2)
    h = x.t() @ x / x.shape[0]
    w = torch.randn(80, 128, generator=torch.Generator().manual_seed(3)) * 0.05
    ratio = search_clip(w, h, 32)
    assert ratio.shape == (80, 4) and ratio.max() <= 1.0 and ratio.min() >= 1.0 - awq.CLIP_MAX_SHRINK
    clipped = output_error(w - fake_quant(w, 32, ratio), h)
    assert clipped < output_error(w - fake_quant(w, 32), h)


def test_input_scale_is_part_of_the_layer():
    """A scale with nowhere to fold stays in the layer: forward, dequantize, rows and state_dict agree."""
    torch.manual_seed(4)
    w = torch.randn(96, 128) * 0.05
    s = torch.rand(128) + 0.5
    t = quantize_int4_clipped(w * s, 64)
    lin = Int4Linear.from_quantized({**t, "input_scale": 1.0 / s}, in_features=128)
    plain = Int4Linear.from_quantized(t, in_features=128)
    assert lin.nbytes() == plain.nbytes() + 128 * 4
    wq = lin.dequantize()
    assert torch.allclose(wq, plain.dequantize() / s, rtol=1e-6, atol=0)
    for m in (3, 40):  # decode- and prompt-sized: a8 with the C kernel, else dequantize + GEMM
        x = torch.randn(m, 128)
        y = lin(x)
        assert torch.equal(y, plain(x / s)) or (y - plain(x / s)).abs().max() < 1e-6
        assert ((y - x @ wq.t()).norm() / (x @ wq.t()).norm()) < (A8_REL_ERR if C_KERNEL else 3e-3)
    ids = torch.tensor([0, 5, 95])
    assert torch.allclose(lin.rows(ids), wq[ids])
    sd = lin.state_dict()
    assert torch.equal(sd["input_scale"], 1.0 / s)
    again = Int4Linear.from_quantized(dict(sd), in_features=128)
    x = torch.randn(5, 128)
    assert torch.equal(again(x), lin(x))


# ------------------------------------------------------------------ in the engine


def _llm(path, **kw) -> LLM:
    kw.setdefault("dtype", "float32")
    return LLM(str(path), kv_cache_tokens=2048, max_num_seqs=4, progress=False, prepack=False, **kw)


def _seqs() -> list[list[int]]:
    return [[(7 * i + 13 * j) % 500 + 3 for i in range(96)] for j in range(6)]


def _logprobs(llm) -> torch.Tensor:
    return torch.cat(score_sequences(llm.core, _seqs()))


@pytest.fixture(scope="module")
def gqa_model(tmp_path_factory) -> Path:
    return make_hf_model("llama", tmp_path_factory.mktemp("awq-llama"), seed=5)  # untied head, 4/2 heads


@pytest.fixture(scope="module")
def mha_model(tmp_path_factory) -> Path:  # q/k/v biases, tied head, no grouped-query attention
    return make_hf_model("qwen2", tmp_path_factory.mktemp("awq-qwen2"), seed=6, num_key_value_heads=4)


def test_unit_scales_without_clipping_are_rtn(gqa_model, monkeypatch):
    from llmsys.engine.quantize import awq_calibrate

    monkeypatch.setattr(awq, "search_scale", lambda ws, xm, h, g: (torch.ones(ws[0].shape[1]), [0.0]))
    llm = _llm(gqa_model)
    awq_calibrate(llm.loaded.model, _seqs(), parse_quant("int4"), clip=False)
    assert torch.equal(_logprobs(llm), _logprobs(_llm(gqa_model, quant="int4")))


@pytest.mark.parametrize("which", ["gqa", "mha"])
def test_folds_keep_the_function(which, gqa_model, mha_model, monkeypatch):
    """Random scales folded into norms / v_proj / up_proj / the final norm, or kept as o_proj's
    input_scale: the model still computes the float function up to int4 rounding."""
    from llmsys.engine.quantize import awq_calibrate

    path = gqa_model if which == "gqa" else mha_model
    gen = torch.Generator().manual_seed(7)
    monkeypatch.setattr(awq, "search_scale", lambda ws, xm, h, g: (
        torch.exp(0.7 * torch.randn(ws[0].shape[1], generator=gen)), [0.0]))
    ref = _logprobs(_llm(path))
    rtn = (_logprobs(_llm(path, quant="int4")) - ref).abs().mean()
    llm = _llm(path)
    awq_calibrate(llm.loaded.model, _seqs(), parse_quant("int4"), clip=False)
    o_proj = llm.loaded.model.model.layers[0].self_attn.o_proj
    assert (o_proj.input_scale is not None) == (which == "gqa")
    assert isinstance(llm.loaded.model.lm_head, Int4Linear)
    err = (_logprobs(llm) - ref).abs().mean()
    assert err < 3 * rtn, (err, rtn)  # a wrong fold scrambles the model (error >> rtn)


def test_awq_quantize_then_run_matches_in_process(gqa_model, tmp_path):
    """`llmsys quantize --method awq` -> `run DIR` gives the tokens of AWQ-quantizing in process."""
    from llmsys.engine.cli.main import main
    from llmsys.engine.quantize import awq_calibrate, file_calibration

    calib = tmp_path / "calib.txt"
    calib.write_text("Once upon a time a small robot found a red ball in the garden. " * 60)
    out = tmp_path / "awq"
    assert main(["quantize", str(gqa_model), "--quant", "int4", "--method", "awq", "--calib", str(calib),
                 "--calib-samples", "8", "--calib-len", "64", "--tune-steps", "0", "-o", str(out),
                 "--threads", "2"]) == 0
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert cfg["method"] == "awq" and cfg["format"] == "int4:g64" and cfg["calibration"] == "calib.txt"
    llm = LLM(str(gqa_model), dtype="float32", kv_cache_tokens=8192, progress=False, prepack=False)
    awq_calibrate(llm.loaded.model, file_calibration(llm, str(calib), 8, 64), parse_quant("int4"))
    a = _llm(out).generate("hello world", GREEDY)[0].token_ids
    b = llm.generate("hello world", GREEDY)[0].token_ids
    assert a == b
    loaded = _llm(out).loaded.model
    assert loaded.model.layers[1].self_attn.o_proj.input_scale is not None  # kept through the file


def test_refinement_runs_on_awq_layers(gqa_model):
    """`--tune-steps` after AWQ: the distillation trains through the layers' input scales and keeps them."""
    from llmsys.engine.quantize import awq_calibrate, refine_quantized

    llm = _llm(gqa_model)
    model = llm.loaded.model
    teacher = {k: v.detach().clone() for k, v in model.state_dict().items()}
    awq_calibrate(model, _seqs(), parse_quant("int4"))
    scale = model.model.layers[0].self_attn.o_proj.input_scale.clone()
    rep = refine_quantized(model, teacher, _seqs(), steps=20, batch=4)
    assert rep.kl_after < rep.kl_before
    assert torch.equal(model.model.layers[0].self_attn.o_proj.input_scale, scale)


def test_bad_method_names_the_valid_ones(gqa_model, tmp_path, capsys):
    from llmsys.engine.cli.main import main
    from llmsys.engine.quantize import awq_calibrate

    assert main(["quantize", str(gqa_model), "--quant", "int4", "--method", "awk", "-o", str(tmp_path / "y")]) == 2
    assert "unknown --method 'awk'; valid: rtn, gptq, awq" in capsys.readouterr().err
    with pytest.raises(InvalidParameterError, match="--method awq quantizes int4"):
        awq_calibrate(_llm(gqa_model).loaded.model, _seqs(), parse_quant("int8"))


def test_awq_beats_rtn_on_stories260k(stories_hf):
    """On the real model AWQ's scales + clipping lower perplexity below round-to-nearest."""
    from llmsys.engine.quantize import awq_calibrate, self_generated_calibration
    from llmsys.engine.scoring import perplexity_windows

    text = need_shared(CORPUS / "tinystories-valid.txt").read_text(encoding="utf-8")[:20000]
    torch.set_num_threads(1)  # many small ops (conftest resets)
    llms = {q: LLM(str(stories_hf), dtype="float32", kv_cache_tokens=8192, progress=False, quant=q,
                   prepack=False) for q in ("int4", "none")}
    ids = llms["none"].tokenizer.encode(text, add_special_tokens=False)[:3000]
    bos = llms["none"].tokenizer.bos_token_id
    rtn, base = (perplexity_windows(llms[q].core, ids, 256, bos).perplexity for q in ("int4", "none"))
    llm = llms["none"]
    awq_calibrate(llm.loaded.model, self_generated_calibration(llm, 64, 256, seed=0), parse_quant("int4"))
    got = perplexity_windows(llm.core, ids, 256, bos).perplexity
    assert base < got < rtn, (base, got, rtn)
    assert got - base < 0.85 * (rtn - base), (base, got, rtn)


def test_refinement_without_the_teacher_cache_gives_the_same_model(gqa_model):
    """A vocabulary too large to keep the teacher's log-probabilities runs the teacher per batch instead:
    the same numbers, so the same refined weights and KL."""
    from llmsys.engine.quantize import awq_calibrate, refine_quantized

    def refined(cache_bytes: int, chunk_bytes: int):
        model = _llm(gqa_model).loaded.model
        teacher = {k: v.detach().clone() for k, v in model.state_dict().items()}
        awq_calibrate(model, _seqs(), parse_quant("int4"))
        rep = refine_quantized(model, teacher, _seqs(), steps=6, batch=4, teacher_cache_bytes=cache_bytes,
                               logit_chunk_bytes=chunk_bytes)
        return rep, {k: v.clone() for k, v in model.state_dict().items()}

    (rep_a, w_a), (rep_b, w_b) = refined(2 << 30, 256 << 20), refined(0, 256 << 20)
    assert (rep_a.kl_before, rep_a.kl_after) == (rep_b.kl_before, rep_b.kl_after)
    assert w_a.keys() == w_b.keys() and all(torch.equal(w_a[k], w_b[k]) for k in w_a)
    # The loss a few tokens at a time through the head (as a large vocabulary goes): the same refinement
    # within float summation order.
    rep_c, _ = refined(0, 512 * 4 * 37)  # gqa_model's 512-token vocab: 37 rows per chunk
    assert rep_c.kl_before == pytest.approx(rep_a.kl_before, rel=1e-5)
    assert rep_c.kl_after == pytest.approx(rep_a.kl_after, rel=1e-3)


@pytest.mark.parametrize("permuted", [False, True])
def test_tunable_rows_are_the_weights_rows(permuted):
    """A tied embedding's lookup builds only its rows (``TunableInt4.weight_rows``): the same values and the
    same gradients as indexing the whole differentiable weight, with GPTQ's column order too."""
    from llmsys.quant import quantize_linear
    from llmsys.quant.calibrate import TunableInt4

    torch.manual_seed(0)
    lin = quantize_linear(torch.randn(96, 128), None, parse_quant("int4"))
    if permuted:
        lin = Int4Linear.from_quantized({**lin.canonical_tensors(), "perm": torch.randperm(128).int()}, in_features=128)
    rows = torch.tensor([5, 0, 95, 5, 17])
    grads = []
    for build in (lambda t: t.weight()[rows], lambda t: t.weight_rows(rows)):
        t = TunableInt4(lin)
        with torch.no_grad():
            torch.manual_seed(1)  # the same offsets for both
            t.v.uniform_(-0.6, 0.6)
            t.log_s.uniform_(-0.1, 0.1)
        w = build(t)
        (w * torch.arange(w.numel()).view_as(w).sin()).sum().backward()
        grads.append((w.detach(), t.v.grad.clone(), t.log_s.grad.clone()))
    (w_a, gv_a, gs_a), (w_b, gv_b, gs_b) = grads
    assert torch.equal(w_a, w_b)
    # row 5 twice: its two gradients meet before the formula in one, after it in the other (rounding only)
    torch.testing.assert_close(gv_a, gv_b, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gs_a, gs_b, rtol=1e-6, atol=1e-6)
    assert gv_b[5].abs().sum() > 0 and gv_b[1].abs().sum() == 0  # only the looked-up rows get gradients
