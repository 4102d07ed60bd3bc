"""One format detection (``engine.loader.detect``) and one GGUF header parse per load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import SHARED, STORIES_C, STORIES_HF, need_shared

from llmsys.engine.loader import gguf_header, gguf_io
from llmsys.engine.sampling import SamplingParams
from llmsys.engine.loader.detect import ModelFormat, ModelSource, detect_model
from llmsys.kernels.common.errors import CheckpointError, ModelNotFoundError

SMOLLM2_GGUF = SHARED / "models" / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture
def count_parses(monkeypatch):
    """Every call of the GGUF header parser (gguf_io holds its own reference to it), by path."""
    calls: list[Path] = []
    real = gguf_header.read_header

    def spy(path):
        calls.append(Path(path))
        return real(path)

    monkeypatch.setattr(gguf_header, "read_header", spy)
    monkeypatch.setattr(gguf_io, "read_header", spy)
    return calls


def test_each_format_is_told_apart(tmp_path):
    need_shared(STORIES_HF)
    assert detect_model(STORIES_HF) == ModelSource(STORIES_HF, ModelFormat.HF)
    assert detect_model(STORIES_C / "stories260K.bin").format is ModelFormat.LLAMA2C
    assert detect_model(SMOLLM2_GGUF).format is ModelFormat.GGUF
    blob = tmp_path / "sha256-0123"  # an Ollama blob: a GGUF without the suffix
    blob.symlink_to(SMOLLM2_GGUF)
    assert detect_model(blob).format is ModelFormat.GGUF
    assert detect_model(STORIES_HF).gguf_header is None
    with pytest.raises(ModelNotFoundError, match="no such file or directory"):
        detect_model(tmp_path / "missing")
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(CheckpointError, match="expected a model directory .* a GGUF file or a llama2.c"):
        detect_model(tmp_path / "notes.txt")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no config.json"):
        detect_model(tmp_path / "empty")


def test_a_gguf_load_parses_its_header_once(count_parses):
    need_shared(SMOLLM2_GGUF)
    from llmsys import LLM

    llm = LLM(str(SMOLLM2_GGUF), kv_cache_tokens=64, progress=False)
    assert count_parses == [SMOLLM2_GGUF]  # the config, the tensor index and the tokenizer share it
    assert len(llm.generate("Hi", SamplingParams(max_tokens=2, temperature=0))[0].token_ids) == 2  # and it runs


def test_the_planner_parses_a_gguf_header_once(count_parses, monkeypatch, capsys):
    need_shared(SMOLLM2_GGUF)
    from llmsys.engine.cli.main import main
    from llmsys.offload import bandwidth

    fixed = bandwidth.Bandwidths(mem_gbps=10.0, disk_read_gbps=1.0, cpu_gflops={"float32": 50.0})
    monkeypatch.setattr(bandwidth, "measure_bandwidths", lambda **kw: fixed)  # no machine probe
    assert main(["plan", str(SMOLLM2_GGUF), "--json", "--dtype", "float32"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert len(plan["layers"]) == 30 and count_parses == [SMOLLM2_GGUF]  # config and the weight mix from one parse
