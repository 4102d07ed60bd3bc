"""Embeddings (engine/embedding.py, ``LLM.embed``, ``/v1/embeddings``, ``/api/embed``, ``/api/embeddings``).

The reference is transformers: the bare decoder's last hidden state (after the final norm), pooled
the same way (last token or mean) and L2-normalized. The Qwen3-Embedding-style checkpoint is a tiny
random Qwen3 saved as sentence-transformers saves one: the bare decoder (no ``model.`` prefix, no LM
head, untied), ``modules.json`` with last-token Pooling and Normalize.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import httpx
import pytest
import torch

from conftest import STORIES_HF, need_shared
from tiny_models import ARCH_CONFIGS, TINY, spread_weights, write_tiny_tokenizer

from llmsys.engine.embedding import DEFAULT_POOLING, PoolingType, read_pooling
from llmsys.kernels.common.errors import ContextOverflowError, InvalidParameterError

TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog, " * 4, "a",
         "Once upon a time there was a little girl who liked to read books about embeddings."]


def _write_st_config(out: Path, mode: str, normalize: bool = True, extra: list | None = None) -> None:
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    modules += extra or []
    (out / "modules.json").write_text(json.dumps(modules))
    (out / "1_Pooling").mkdir(exist_ok=True)
    cfg = {"word_embedding_dimension": 64, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": False,
           "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False,
           "pooling_mode_weightedmean_tokens": False, "pooling_mode_lasttoken": False, "include_prompt": True}
    cfg[mode] = True
    (out / "1_Pooling" / "config.json").write_text(json.dumps(cfg))


def make_embedding_model(out: Path) -> Path:
    """A tiny random Qwen3-Embedding-style folder (see the module docstring)."""
    from transformers import AutoConfig, AutoModel

    spec = {**TINY, **ARCH_CONFIGS["qwen3"], "tie_word_embeddings": False}
    cfg = AutoConfig.for_model(spec.pop("model_type"), **spec)
    cfg.architectures = ["Qwen3ForCausalLM"]  # as Qwen3-Embedding's config.json says
    torch.manual_seed(0)
    model = AutoModel.from_config(cfg, dtype=torch.float32)
    spread_weights(model)
    model.save_pretrained(out, safe_serialization=True)
    write_tiny_tokenizer(out, spec["vocab_size"])
    _write_st_config(out, "pooling_mode_lasttoken")
    return out


def reference(folder: Path, texts: list[str], kind: PoolingType, normalize: bool = True) -> list[torch.Tensor]:
    """transformers' final hidden states, pooled and normalized (one text at a time: no padding)."""
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
    out = []
    for t in texts:
        with torch.no_grad():
            h = model(**tok(t, return_tensors="pt")).last_hidden_state[0].double()
        v = {PoolingType.LAST: h[-1], PoolingType.MEAN: h.mean(0), PoolingType.CLS: h[0]}[kind]
        out.append(torch.nn.functional.normalize(v, dim=0) if normalize else v)
    return out


def max_cosine_distance(ours: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    return max(1.0 - torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=0).item()
               for a, b in zip(ours, ref))


@pytest.fixture(scope="module")
def emb_dir(tmp_path_factory):
    return make_embedding_model(tmp_path_factory.mktemp("qwen3-embedding"))


@pytest.fixture(scope="module")
def emb_llm(emb_dir):
    from llmsys import LLM

    # a small step budget: the long inputs are prefilled in chunks, beside the short ones
    return LLM(str(emb_dir), dtype="float32", max_num_batched_tokens=16, max_model_len=64, prefix_caching=True)


# -- the pooling a model asks for --------------------------------------------------------------


def test_pooling_read_from_sentence_transformers_and_gguf(tmp_path):
    assert read_pooling(tmp_path) == DEFAULT_POOLING  # no config: mean, normalized
    _write_st_config(tmp_path, "pooling_mode_lasttoken")
    p = read_pooling(tmp_path)
    assert (p.type, p.normalize, p.source, p.unsupported) == (PoolingType.LAST, True, "1_Pooling/config.json", None)
    _write_st_config(tmp_path, "pooling_mode_cls_token", normalize=False)
    p = read_pooling(tmp_path)
    assert (p.type, p.normalize) == (PoolingType.CLS, False)  # modules.json lists no Normalize
    (tmp_path / "modules.json").unlink()
    assert read_pooling(tmp_path).type is PoolingType.CLS  # 1_Pooling alone
    _write_st_config(tmp_path, "pooling_mode_max_tokens")
    with pytest.raises(InvalidParameterError, match="pooling_mode_max_tokens is not computed by llmsys"):
        read_pooling(tmp_path).check()
    _write_st_config(tmp_path, "pooling_mode_mean_tokens", extra=[
        {"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"}])
    with pytest.raises(InvalidParameterError, match="'3_Dense' \\(Dense\\) is not run by llmsys"):
        read_pooling(tmp_path).check()
    gguf = tmp_path / "m.gguf"
    assert read_pooling(gguf, {"general.architecture": "qwen3", "qwen3.pooling_type": 3}).type is PoolingType.LAST
    assert read_pooling(gguf, {"general.architecture": "bert", "bert.pooling_type": 1}).type is PoolingType.MEAN
    assert read_pooling(gguf, {"general.architecture": "qwen3"}) == DEFAULT_POOLING
    with pytest.raises(InvalidParameterError, match="pooling_type = 4 is not a text embedding's pooling"):
        read_pooling(gguf, {"general.architecture": "qwen3", "qwen3.pooling_type": 4}).check()


# -- agreement with transformers ---------------------------------------------------------------


def test_last_token_pooling_matches_transformers(emb_llm, emb_dir):
    assert emb_llm.pooling.type is PoolingType.LAST and emb_llm.pooling.normalize
    outs = emb_llm.embed(TEXTS)
    ref = reference(emb_dir, TEXTS, PoolingType.LAST)
    assert max_cosine_distance([o.embedding for o in outs], ref) < 1e-4
    for o, t in zip(outs, TEXTS):
        assert o.embedding.shape == (64,) and o.embedding.dtype == torch.float32
        assert abs(o.embedding.norm().item() - 1.0) < 1e-5
        assert o.prompt_tokens == len(emb_llm.tokenizer.encode(t)) and not o.truncated
    raw = emb_llm.embed(TEXTS[:2], normalize=False)  # the pooled state itself
    ref_raw = reference(emb_dir, TEXTS[:2], PoolingType.LAST, normalize=False)
    for o, r in zip(raw, ref_raw):
        torch.testing.assert_close(o.embedding.double(), r, atol=1e-4, rtol=1e-4)


def test_mean_pooling_matches_transformers_on_stories():
    need_shared(STORIES_HF)
    from llmsys import LLM

    llm = LLM(str(STORIES_HF), dtype="float32", max_num_batched_tokens=8)  # prompts in chunks of <= 8
    assert llm.pooling == DEFAULT_POOLING  # a plain causal LM folder: mean, normalized
    texts = ["Once upon a time", "Lily and Ben went to the park. They saw a big dog and a little cat playing."]
    outs = llm.embed(texts)
    assert max_cosine_distance([o.embedding for o in outs], reference(STORIES_HF, texts, PoolingType.MEAN)) < 1e-4


def test_batched_equals_alone_and_no_kv_is_kept(emb_llm):
    alone = [emb_llm.embed(t)[0].embedding for t in TEXTS]
    batched = [o.embedding for o in emb_llm.embed(TEXTS)]
    for a, b in zip(alone, batched):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    assert emb_llm.core.allocator.num_used == 0 and not emb_llm.core.requests
    assert not emb_llm.core.scheduler.has_work()


def test_mean_pooling_never_reuses_a_cached_prefix(emb_dir, tmp_path):
    """A prefix-cache hit would skip rows a mean pools: the second, identical input must give the same vector."""
    import shutil

    from llmsys import LLM

    folder = tmp_path / "mean"
    shutil.copytree(emb_dir, folder)
    _write_st_config(folder, "pooling_mode_mean_tokens")
    llm = LLM(str(folder), dtype="float32", prefix_caching=True, block_size=4, max_model_len=64)
    text = TEXTS[1]
    first, second = llm.embed(text)[0].embedding, llm.embed(text)[0].embedding
    torch.testing.assert_close(first, second, atol=1e-6, rtol=0)
    ref = reference(folder, [text], PoolingType.MEAN)
    assert max_cosine_distance([second], ref) < 1e-4


def test_generation_beside_embeddings_is_unchanged(emb_llm):
    """Embedding requests share steps with a generating one; its tokens are those it makes alone."""
    from llmsys import SamplingParams

    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    alone = emb_llm.generate("Once upon a", params)[0].token_ids
    core = emb_llm.core
    rid = core.add_request(emb_llm.encode("Once upon a"), params)
    ids = [core.add_request(emb_llm.encode(t), SamplingParams(max_tokens=1), pooling=emb_llm.pooling) for t in TEXTS]
    tokens, vectors = [], {}
    while core.has_unfinished():
        for ch in core.step():
            if ch.request_id == rid:
                tokens += ch.token_ids
            elif ch.finished:
                assert ch.token_ids == [] and ch.usage.completion_tokens == 0
                vectors[ch.request_id] = ch.embedding
    assert tokens == alone
    ref = [o.embedding for o in emb_llm.embed(TEXTS)]
    for r, v in zip(ref, (vectors[i] for i in ids)):
        torch.testing.assert_close(v, r, atol=1e-6, rtol=0)


def test_input_longer_than_the_context(emb_llm):
    long = "the quick brown fox jumps over the lazy dog, " * 20
    n = len(emb_llm.tokenizer.encode(long))
    assert n > 64
    with pytest.raises(ContextOverflowError, match=f"an input has {n} tokens but the context holds 64"):
        emb_llm.embed(["short", long])
    assert emb_llm.core.allocator.num_used == 0 and not emb_llm.core.requests  # nothing left behind
    cut = emb_llm.embed(long, truncate=True)[0]
    assert cut.truncated and cut.prompt_tokens == 64
    first = emb_llm.tokenizer.encode(long)[:64]
    torch.testing.assert_close(cut.embedding, emb_llm.embed(first)[0].embedding, atol=1e-6, rtol=0)
    exact = emb_llm.embed(first)[0]  # the whole context is prompt: nothing is generated
    assert exact.prompt_tokens == 64 and not exact.truncated


def test_checkpoint_without_lm_head_loads_with_a_notice(emb_llm):
    assert any("no LM head" in line for line in emb_llm.loaded.notices)


# -- the server: openai and ollama clients -----------------------------------------------------


@pytest.fixture(scope="module")
def server(emb_dir):
    from llmsys import LLM
    from llmsys.engine.server.serve import start_server_thread
    from llmsys.engine.server.state import ServerSettings, ServerState

    state = ServerState(ServerSettings(max_queue=2))
    state.attach(LLM(str(emb_dir), dtype="float32", max_model_len=64, max_num_batched_tokens=32), "qwen3-embed")
    srv = start_server_thread(state)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def reference_vectors(emb_dir):
    return reference(emb_dir, TEXTS, PoolingType.LAST)


def test_openai_client_embeddings(server, reference_vectors, emb_llm):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    r = client.embeddings.create(model="qwen3-embed", input=TEXTS)  # the client asks for base64 by default
    got = [torch.tensor(d.embedding) for d in sorted(r.data, key=lambda d: d.index)]
    assert max_cosine_distance(got, reference_vectors) < 1e-4
    n = sum(len(emb_llm.tokenizer.encode(t)) for t in TEXTS)
    assert r.usage.prompt_tokens == n and r.usage.total_tokens == n
    f = client.embeddings.create(model="qwen3-embed", input=TEXTS[0], encoding_format="float")
    torch.testing.assert_close(torch.tensor(f.data[0].embedding), got[0], atol=1e-6, rtol=0)
    ids = emb_llm.tokenizer.encode(TEXTS[0])
    t = client.embeddings.create(model="qwen3-embed", input=[ids, ids])  # token ids
    assert len(t.data) == 2 and t.usage.prompt_tokens == 2 * len(ids)
    torch.testing.assert_close(torch.tensor(t.data[1].embedding), got[0], atol=1e-6, rtol=0)
    d = client.embeddings.create(model="qwen3-embed", input=TEXTS[0], dimensions=16)
    v = torch.tensor(d.data[0].embedding)
    assert v.shape == (16,) and abs(v.norm().item() - 1) < 1e-5
    torch.testing.assert_close(v, torch.nn.functional.normalize(got[0][:16], dim=0), atol=1e-6, rtol=0)


def test_many_inputs_take_one_queue_place(server, emb_llm):
    """A retriever sends hundreds of texts in one call; the server's queue (here 2 places) takes it."""
    texts = [f"document number {i} about cats" for i in range(100)]
    r = httpx.post(server.url + "/v1/embeddings", json={"input": texts, "encoding_format": "base64"}, timeout=120)
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    assert [d["index"] for d in data] == list(range(100))
    v7 = torch.frombuffer(bytearray(base64.b64decode(data[7]["embedding"])), dtype=torch.float32)
    torch.testing.assert_close(v7, emb_llm.embed(texts[7])[0].embedding, atol=1e-6, rtol=0)


@pytest.mark.parametrize("body, status, needle", [
    ({"input": "x " * 100}, 400, "input has 200 tokens but this model's context holds 64"),
    ({"input": "hi", "dimensions": 65}, 400, "dimensions=65 is outside 1..64"),
    ({"input": [[1, 2, 99999]]}, 400, "token id 99999 is outside the vocabulary (0..511)"),
    ({"input": "hi", "model": "nope"}, 404, "model 'nope' not found"),
    ({"input": "hi", "encoding_format": "int8"}, 400, "encoding_format"),
    ({"input": []}, 400, "input"),
])
def test_openai_errors_are_one_line(server, body, status, needle):
    r = httpx.post(server.url + "/v1/embeddings", json=body, timeout=60)
    assert r.status_code == status, r.text
    msg = r.json()["error"]["message"]
    assert needle in msg and "\n" not in msg


def test_ollama_client_embed_and_legacy_embeddings(server, reference_vectors, emb_llm):
    ollama = pytest.importorskip("ollama")
    client = ollama.Client(host=server.url, timeout=60)
    r = client.embed(model="qwen3-embed", input=TEXTS)
    got = [torch.tensor(v) for v in r.embeddings]
    assert max_cosine_distance(got, reference_vectors) < 1e-4
    assert r.prompt_eval_count == sum(len(emb_llm.tokenizer.encode(t)) for t in TEXTS)
    assert r.total_duration > 0 and r.model == "qwen3-embed:latest"
    one = client.embed(model="qwen3-embed", input=TEXTS[0], dimensions=8)
    assert len(one.embeddings) == 1 and len(one.embeddings[0]) == 8
    # truncate (Ollama's default true) cuts an input to the context; false refuses it
    long = "the quick brown fox jumps over the lazy dog, " * 20
    cut = client.embed(model="qwen3-embed", input=long)
    assert cut.prompt_eval_count == 64
    with pytest.raises(ollama.ResponseError, match="context holds 64") as e:
        client.embed(model="qwen3-embed", input=long, truncate=False)
    assert e.value.status_code == 400
    # the legacy route: one vector, not normalized (as Ollama)
    legacy = client.embeddings(model="qwen3-embed", prompt=TEXTS[0])
    v = torch.tensor(legacy.embedding)
    raw = emb_llm.embed(TEXTS[0], normalize=False)[0].embedding
    torch.testing.assert_close(v, raw, atol=1e-5, rtol=1e-5)
    assert abs(v.norm().item() - 1.0) > 1e-3
    assert client.embed(model="qwen3-embed", input="").embeddings == []  # the load ping
    with pytest.raises(ollama.ResponseError, match="not found") as e:
        client.embed(model="other", input="hi")
    assert e.value.status_code == 404



def test_preempted_embeddings_are_recomputed_from_the_start(emb_dir, tmp_path):
    """A KV pool too small for what runs: decoding requests grow into it and the scheduler preempts
    (recompute) the newest running request, a part-prefilled embedding; it pools its prompt again from
    the start and matches the roomy engine's vector."""
    import shutil

    from llmsys import LLM, SamplingParams

    folder = tmp_path / "mean"
    shutil.copytree(emb_dir, folder)
    _write_st_config(folder, "pooling_mode_mean_tokens")
    texts = [f"{i} the quick brown fox jumps over the lazy dog, and the dog sleeps all day long" for i in range(4)]
    roomy = [o.embedding for o in LLM(str(folder), dtype="float32", max_model_len=64).embed(texts)]
    tight = LLM(str(folder), dtype="float32", max_model_len=64, block_size=4, kv_cache_tokens=64,
                max_num_batched_tokens=8, swap_space=0)
    core = tight.core
    preempted = []
    original = core.scheduler._preempt

    def spy(seq, out):
        preempted.append(seq.request_id)
        original(seq, out)

    core.scheduler._preempt = spy
    gen = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    for _ in range(2):
        core.add_request(tight.encode("Once upon a"), gen)
    ids = [core.add_request(tight.encode(t), SamplingParams(max_tokens=1), pooling=tight.pooling) for t in texts]
    vectors = {}
    while core.has_unfinished():
        for ch in core.step():
            if ch.embedding is not None:
                vectors[ch.request_id] = ch.embedding
    assert set(preempted) & set(ids), "the pool was meant to preempt an embedding request"
    for rid, ref in zip(ids, roomy):
        torch.testing.assert_close(vectors[rid], ref, atol=1e-6, rtol=0)
    assert core.allocator.num_used == 0


def test_gguf_pooling_type_decides(tmp_path):
    """A GGUF's ``<arch>.pooling_type`` (3: last token) is what the engine pools by, on the GGUF's weights."""
    gguf = pytest.importorskip("gguf", reason="pip install gguf (test dependency)")
    import numpy as np
    from transformers import AutoModel

    from llmsys import LLM
    from llmsys.engine.bench.gguf_export import export_float
    from test_gguf_loading import _copy_field
    from tiny_models import make_hf_model

    folder = make_hf_model("qwen3", tmp_path / "hf")
    plain = export_float(folder, tmp_path / "plain.gguf", "f32")
    r = gguf.GGUFReader(str(plain))
    out = tmp_path / "last.gguf"
    w = gguf.GGUFWriter(str(out), "qwen3")
    for key, f in r.fields.items():
        if not key.startswith("GGUF.") and key != "general.architecture":
            _copy_field(w, key, f)
    w.add_uint32("qwen3.pooling_type", 3)
    for t in r.tensors:
        w.add_tensor(t.name, np.array(t.data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert LLM(str(plain), dtype="float32").pooling == DEFAULT_POOLING
    llm = LLM(str(out), dtype="float32", max_num_batched_tokens=16)
    assert (llm.pooling.type, llm.pooling.source) == (PoolingType.LAST, "GGUF qwen3.pooling_type")
    ids = [llm.encode(t) for t in TEXTS]
    model = AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = [torch.nn.functional.normalize(model(input_ids=torch.tensor([x])).last_hidden_state[0, -1].double(),
                                             dim=0) for x in ids]
    assert max_cosine_distance([o.embedding for o in llm.embed(ids)], ref) < 1e-4
