"""Engine flags checked against the model and the machine before anything is allocated (issue #23, part 1).

Each bad value is one ``error:`` line naming the flag, the size asked, what
is there and the fix, exit 2, no traceback: a thread count past the CPUs is
clamped; a GPU budget on a CPU engine, a RAM budget past the RAM, a context
past the model's positions, a KV pool / cold tier / swap space past what its
RAM or disk has free are refused at start-up (not as an allocator traceback,
a segfault or a full disk mid-run).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from llmsys.engine.builder import model_context
from llmsys.engine.cli.main import main
from llmsys.kernels.common.cpus import usable_cpus
from llmsys.kernels.common.errors import BudgetError, InvalidParameterError
from llmsys.offload import budgets, kv_swap
from llmsys.offload.budgets import SpaceAsk, check_room


def _run(model, *flags: str) -> list[str]:
    return ["run", str(model), "Once upon", "-n", "2", "--temperature", "0", "--dtype", "float32", *flags]


def _one_error_line(rc: int, out: str, err: str, needle: str) -> str:
    assert rc == 2 and out == "" and "Traceback" not in err, (rc, out, err)
    lines = [ln for ln in err.splitlines() if not ln.startswith("notice:")]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert needle in lines[0], lines[0]
    return lines[0]


CASES = [
    (["--max-model-len", "100000"],
     ("--max-model-len 100000 is past this model's 512 positions (max_position_embeddings); "
      "use at most --max-model-len 512")),
    (["--kv-offload-tokens", "500TiB"], "--kv-offload-tokens 500TiB needs 500.0 TiB of disk in "),
    (["--swap-space", "500TiB"], "--swap-space 500.0 TiB needs 500.0 TiB of disk in "),
    (["--cpu-mem", "500TiB"], "--cpu-mem 500.0 TiB is more than the "),
    (["--kv-cache-tokens", "100000000000000"], "--kv-cache-tokens 100000000000000 needs "),
    (["--swap-space", "lots"], "--swap-space: cannot read memory size 'lots'"),
    (["--kv-offload-tokens", "2Q"], "--kv-offload-tokens: cannot read memory size '2Q'"),
    (["--max-model-len", "0"], "--max-model-len must be >= 2, got 0"),
    (["--kv-cache-tokens", "0"], "--kv-cache-tokens must be >= 1, got 0"),
    (["--threads", "0"], "--threads must be >= 1, got 0"),
]


@pytest.mark.parametrize("flags, needle", CASES, ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_a_bad_engine_flag_is_one_error_line(stories_hf, capsys, flags, needle):
    rc = main(_run(stories_hf, *flags))
    out, err = capsys.readouterr()
    line = _one_error_line(rc, out, err, needle)
    if "needs" in needle or "more than" in needle:
        assert ("free there" in line or "available" in line) and ("lower " in line), line  # what is there, the fix


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine has a GPU budget to set")
def test_gpu_mem_on_a_cpu_engine_is_refused(stories_hf, capsys):
    rc = main(_run(stories_hf, "--gpu-mem", "1GiB"))
    out, err = capsys.readouterr()
    _one_error_line(rc, out, err, "--gpu-mem 1.0 GiB: this engine runs on the CPU (no CUDA device is available)")


def test_threads_past_the_cpus_are_clamped(stories_hf, capsys, monkeypatch):
    monkeypatch.setenv("LLMSYS_DEBUG", "1")
    assert main(_run(stories_hf, "--threads", "100000")) == 0
    err = capsys.readouterr().err
    n = len(usable_cpus())
    assert f"debug: threads {n} (--threads 100000 clamped to the {n} CPUs present)" in err
    assert torch.get_num_threads() == n


def test_offload_files_are_checked_against_the_folders_free_space(stories_hf, tmp_path, capsys, monkeypatch):
    """The fuzzer's 16 KiB tmpfs: the cold tier is refused at start-up, not when a write fails mid-run."""
    monkeypatch.setattr(budgets, "disk_free", lambda folder: 16 << 10)
    rc = main(_run(stories_hf, "--kv-cache-tokens", "64", "--kv-offload-tokens", "512", "--offload-dir", str(tmp_path)))
    out, err = capsys.readouterr()
    _one_error_line(rc, out, err, f"--kv-offload-tokens 512 needs 640.0 KiB of disk in {tmp_path} but 16.0 KiB is "
                                  "free there; lower --kv-offload-tokens, or pass --offload-dir on a disk with room")
    # The swap file shares the folder's space with the cold tier.
    monkeypatch.setattr(budgets, "disk_free", lambda folder: 700 << 10)
    rc = main(_run(stories_hf, "--kv-cache-tokens", "64", "--kv-offload-tokens", "512", "--swap-space", "100KiB",
                   "--offload-dir", str(tmp_path)))
    out, err = capsys.readouterr()
    _one_error_line(rc, out, err, "--swap-space 100.0 KiB needs 100.0 KiB of disk in "
                                  f"{tmp_path} but 60.0 KiB is free there once --kv-offload-tokens took 640.0 KiB")


def test_max_model_len_up_to_the_model_is_kept(stories_hf):
    from llmsys import LLM

    assert LLM(str(stories_hf), dtype="float32", progress=False, max_model_len=512).max_model_len == 512
    with pytest.raises(InvalidParameterError, match="past this model's 512 positions"):
        LLM(str(stories_hf), dtype="float32", progress=False, max_model_len=513)


def test_model_context_counts_linear_rope_scaling_and_sliding_windows():
    def args(scaling=None, max_pos=256, **kw):
        return SimpleNamespace(max_position_embeddings=max_pos, rope_scaling=scaling, **kw)

    assert model_context(args()) == (256, "max_position_embeddings")
    limit, what = model_context(args({"rope_type": "linear", "factor": 4.0}))  # an older HF config / a GGUF
    assert limit == 1024 and "linear RoPE factor 4.0" in what
    assert model_context(args({"type": "linear", "factor": 2.0, "original_max_position_embeddings": 256},
                              max_pos=512))[0] == 512  # already the stretched length
    llama3 = {"rope_type": "llama3", "factor": 32.0, "original_max_position_embeddings": 64}
    assert model_context(args(llama3))[0] == 256  # llama3 configs state the stretched length themselves
    assert model_context(args(max_context=128)) == (128, "its sliding window")


def test_room_is_shared_per_filesystem_and_ram(tmp_path, monkeypatch):
    monkeypatch.setattr(budgets, "disk_free", lambda folder: 1000)
    monkeypatch.setattr(budgets, "ram_available", lambda: 500)
    check_room([SpaceAsk("--a 1", 600, "disk", "fix a", tmp_path), SpaceAsk("--b 1", 400, "disk", "fix b", tmp_path),
                SpaceAsk("--c 1", 500, "cpu", "fix c")])
    with pytest.raises(BudgetError, match=r"^--c 1 needs 501 B of RAM but 500 B is available; fix c$"):
        check_room([SpaceAsk("--c 1", 501, "cpu", "fix c")])
    with pytest.raises(BudgetError, match="--b 1 needs 401 B of disk in .* but 400 B is free there once --a took 600 B; fix b"):
        check_room([SpaceAsk("--a 1", 600, "disk", "fix a", tmp_path / "not" / "made"),
                    SpaceAsk("--b 1", 401, "disk", "fix b", tmp_path)])


def test_auto_swap_space_fits_half_the_free_disk(monkeypatch, tmp_path):
    from tiny_models import random_kv_pool

    kv = random_kv_pool()
    chunk = kv_swap.KVSwapSpace(kv, 1).chunk_bytes
    monkeypatch.setattr(kv_swap, "disk_free", lambda folder: 5 * chunk)
    assert kv_swap.make_swap_space(kv, None, str(tmp_path)).num_blocks == 2  # not the pool's 6
    monkeypatch.setattr(kv_swap, "disk_free", lambda folder: chunk)
    assert kv_swap.make_swap_space(kv, None, str(tmp_path)) is None  # no room for one block: recompute


def test_a_batch_too_large_for_the_ram_names_the_batch_flags_not_cpu_mem(stories_hf, capsys):
    """No --cpu-mem: the budget is the RAM free now, and the flags that made the need are the fix."""
    rc = main(_run(stories_hf, "--max-num-seqs", "10000000"))
    out, err = capsys.readouterr()
    line = _one_error_line(rc, out, err, "is too small to run even one layer at a time")
    assert "--cpu-mem" not in line and line.endswith(
        "free memory or shrink the step's activations (--max-num-seqs, --max-num-batched-tokens)"), line
