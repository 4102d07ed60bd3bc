"""The ISA test matrix: the kernel, quant and model-answer checks as other x86-64 CPUs, under qemu-user.

Whatever CPU the suite lands on, every ISA level its CPU supports runs
natively (the kernel tests build each level, ``conftest.other_isa_build``), and
``qemu-x86_64 -cpu MODEL`` runs the lower ones as another CPU would:

* ``Haswell`` (AVX2, FMA, F16C: level x86-64-v3), unless that is the native
  level already (then it ran natively and is not emulated again);
* ``Nehalem`` (SSSE3, SSE4.2, no AVX: level x86-64-v2, torch's DEFAULT kernels). The
  plain x86-64 build (SSE2) runs natively only (the kernel tests build every level):
  numpy 2.4's own baseline is x86-64-v2, so nothing here starts on an SSE2-only CPU.

qemu 7.2 emulates no AVX-512, so x86-64-v4 and -v4-bf16 run only natively, on
a CPU that has them. Each emulated CPU runs, with the kernel cache
(``LLMSYS_HOME``) the native run filled first (a cache moved to an older CPU
must not SIGILL):

* :data:`SUBSET`, the kernel and quant tests, minus the ones that start fresh
  interpreters of their own (the torch fallbacks; covered natively);
* ``tests/isa_probe.py`` on stories260k and a 512-wide random Llama (every
  fast path engages: bf16 C kernels, int8/int4 GEMV and GEMM, int8 KV): each
  setting's greedy tokens and log-probabilities, compared with the native
  run's. Bit-identity is reported, not required (torch's own float32/bf16 GEMMs
  differ per ISA); closeness is required.

The terminal summary prints which levels ran natively, emulated, or not at all.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ISA_RUNS, STORIES_HF

from llmsys.kernels import _cbuild

ROOT = Path(__file__).resolve().parents[1]
QEMU = shutil.which("qemu-x86_64")
CPUS = {"Haswell": "x86-64-v3", "Nehalem": "x86-64-v2"}  # qemu CPU model -> the level the kernels must pick
SUBSET = ["tests/test_cpu_decode.py", "tests/test_cpu_int4.py", "tests/test_cpu_qgemv.py", "tests/test_cpu_moe.py",
          "tests/test_quant_layers.py", "tests/test_quant_nf4.py", "-k", "not fallback and not cached and not without_the_kernel and not 4864"]
# Why "not 4864": the Qwen2.5-0.5B MLP shape (4864 x 896) ran past pytest's 300 s under qemu Haswell on a
# Sapphire Rapids host (the whole emulated run took 809 s; 168 s without it). Its bits are checked natively
# on every level the host has; emulated, the smaller shapes reach the same code paths and tails.
# A setting's answers on an emulated CPU, against the same setting natively: float32 within float32
# noise; the others within their own error against float32 (their reduced-precision roundings may
# land differently when torch's bf16 ops differ per ISA), never more than 1.5x it.
FLOAT32_TOL = 1e-3

pytestmark = [
    # the first test sets up every emulated run at once (the ``emulated`` fixture): minutes, not the default 300 s
    pytest.mark.timeout(1200),
    pytest.mark.skipif(_cbuild.machine_arch() != "x86_64", reason="the qemu matrix emulates x86-64 CPUs"),
    pytest.mark.skipif(QEMU is None, reason="qemu-x86_64 not installed (apt-get install qemu-user): "
                                            "no ISA level emulated"),
]


def _native_level() -> str | None:
    level, _ = _cbuild.selected_level()
    return level.name if level else None


def _emulate(cpu: str, args: list[str], home: Path, timeout: int) -> subprocess.CompletedProcess:
    """``python ARGS`` as ``cpu``. Unbuffered, with faulthandler: a SIGILL prints the Python stack that
    reached the instruction (which module, which call), and the output up to it is not lost."""
    # OPENBLAS_CORETYPE: numpy's bundled OpenBLAS picked its Haswell (AVX2) kernels under qemu -cpu Nehalem
    # on a Zen 5 host (OPENBLAS_VERBOSE=2: "Core: Haswell", then SIGILL on vxorps in numpy's import-time
    # sanity check), though qemu's CPUID reports no AVX: name the emulated CPU's kernels outright.
    env = {**os.environ, "LLMSYS_HOME": str(home), "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1",
           "OPENBLAS_CORETYPE": cpu}
    env.pop("LLMSYS_CPU_ISA", None)
    return subprocess.run([QEMU, "-cpu", cpu, sys.executable, *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    """The shared kernel cache, the probe's models, and their answers natively (which fills the cache)."""
    base = tmp_path_factory.mktemp("isa")
    from tiny_models import make_hf_model

    models = [str(make_hf_model("llama", base / "wide512", hidden_size=512, intermediate_size=1024,
                                num_attention_heads=8, num_key_value_heads=4))]
    if STORIES_HF.exists():
        models.insert(0, str(STORIES_HF))
    home = base / "home"
    env = {**os.environ, "LLMSYS_HOME": str(home)}
    res = subprocess.run([sys.executable, "tests/isa_probe.py", *models], capture_output=True, text=True,
                         timeout=600, env=env, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    native = json.loads(res.stdout.strip().splitlines()[-1])
    assert native["level"] == _native_level() and "C kernels 3/3" in native["summary"], native["summary"]
    hf = _transformers_logprobs(models[-1])
    _check_against_transformers(native, models[-1], hf, "native")
    return home, models, native, hf


def _transformers_logprobs(path: str) -> dict[str, list[float]]:
    """transformers' float32 and bf16 log-probabilities of the probe's scored sequence (the oracle)."""
    import torch
    from transformers import AutoModelForCausalLM

    from isa_probe import scored_sequence

    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
        seq = scored_sequence(model.config.vocab_size)
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.tensor([seq])).logits[0, :-1].float(), dim=-1)
        out[str(dtype).split(".")[1]] = lp.gather(1, torch.tensor(seq[1:])[:, None])[:, 0].tolist()
    return out


def _check_against_transformers(run: dict, model: str, hf: dict, where: str) -> None:
    """On the 512-wide model (every fast path engaged): float32 equals transformers' float32 within 1e-3, and
    bf16 errs from it no more than transformers' own bf16 does (x1.5 + 1e-3, tests/test_models.py's bound)."""
    ours = run["models"][model]
    ref = hf["float32"]
    hf_err = max(abs(a - b) for a, b in zip(hf["bfloat16"], ref))
    f32_err = max(abs(a - b) for a, b in zip(ours["float32/none/kv-auto"]["logprobs"], ref))
    bf_err = max(abs(a - b) for a, b in zip(ours["bfloat16/none/kv-auto"]["logprobs"], ref))
    assert f32_err <= FLOAT32_TOL, f"{where}: float32 vs transformers {f32_err:.3g}"
    assert bf_err <= 1.5 * hf_err + 1e-3, f"{where}: bf16 vs transformers float32 {bf_err:.3g} (transformers bf16 {hf_err:.3g})"


def _skip_native(cpu: str) -> None:
    if CPUS[cpu] == _native_level():
        pytest.skip(f"{CPUS[cpu]} is this CPU's own level: it ran natively, not emulated as {cpu}")


@pytest.fixture(scope="module")
def emulated(matrix, tmp_path_factory) -> dict[tuple[str, str], subprocess.CompletedProcess]:
    """Every emulated run, ``(cpu, "kernels" | "answers") -> result``, as many at once as there are CPUs.

    Why at once: run one after another the four took ~4 of the suite's ~15 minutes on 2 cores; two at
    a time each takes ~2x as long (they do use both cores), and the suite went from 895 to 843 s (Zen 4).
    They share the kernel cache, whose builds take a file lock
    (``kernels/_cbuild.find_or_build``), so this also runs two processes filling one cache together.
    """
    from concurrent.futures import ThreadPoolExecutor

    home, models, _, _ = matrix
    cpus = [cpu for cpu in CPUS if CPUS[cpu] != _native_level()]
    jobs = {}
    for cpu in cpus:
        basetemp = tmp_path_factory.mktemp(f"pytest-{cpu}")
        jobs[(cpu, "kernels")] = ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                                  f"--basetemp={basetemp}", *SUBSET]
    for cpu in cpus:
        jobs[(cpu, "answers")] = ["tests/isa_probe.py", *models]
    with ThreadPoolExecutor(max_workers=max(1, min(len(os.sched_getaffinity(0)), len(jobs)))) as pool:
        futures = {key: pool.submit(_emulate, key[0], args, home, 900) for key, args in jobs.items()}
        return {key: f.result() for key, f in futures.items()}


@pytest.mark.parametrize("cpu", list(CPUS))
def test_kernel_and_quant_tests_as(cpu, emulated, request):
    _skip_native(cpu)
    res = emulated[(cpu, "kernels")]
    tail = res.stdout.strip().splitlines()[-1] if res.stdout.strip() else res.stderr[-2000:]
    assert res.returncode == 0 and "Illegal instruction" not in res.stderr, res.stdout[-4000:] + res.stderr[-2000:]
    request.config.stash[ISA_RUNS].setdefault(CPUS[cpu], []).append(f"qemu {cpu}: kernel+quant tests {tail}")


@pytest.mark.parametrize("cpu", list(CPUS))
def test_model_answers_as(cpu, matrix, emulated, request):
    """The same checkpoints under every setting give the native run's answers within bounds, and the
    512-wide model's float32 and bf16 answers are within the transformers bounds on this level too."""
    _skip_native(cpu)
    _, models, native, hf = matrix
    res = emulated[(cpu, "answers")]
    assert res.returncode == 0 and "Illegal instruction" not in res.stderr, res.stdout[-1000:] + res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    _check_against_transformers(got, models[-1], hf, f"qemu {cpu}")
    assert got["level"] == CPUS[cpu], got["summary"]  # the level the emulated CPU supports, from the same cache
    assert "C kernels 3/3" in got["summary"], got["summary"]
    same, lines = 0, []
    for model, settings in got["models"].items():
        ref32 = native["models"][model]["float32/none/kv-auto"]["logprobs"]
        for name, ans in settings.items():
            nat = native["models"][model][name]
            diff = max(abs(a - b) for a, b in zip(ans["logprobs"], nat["logprobs"]))
            own_err = max(abs(a - b) for a, b in zip(nat["logprobs"], ref32))  # the format's own error, natively
            bound = FLOAT32_TOL if name.startswith("float32/none/kv-auto") else max(1.5 * own_err, FLOAT32_TOL)
            assert diff <= bound, f"{cpu} {Path(model).name} {name}: max |logprob diff| {diff:.3g} > {bound:.3g}"
            same += ans["tokens"] == nat["tokens"]
            lines.append(name)
    request.config.stash[ISA_RUNS].setdefault(CPUS[cpu], []).append(
        f"qemu {cpu}: model answers within bounds, greedy tokens equal to the native level's in {same}/{len(lines)}")
