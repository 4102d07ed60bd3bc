"""Hugging Face checkpoints turned into GGUF files by llama.cpp's own tools.

Why: a GGUF loader tested only on files llmsys wrote itself tests the loader against itself. The
files people hold come from llama.cpp's ``convert_hf_to_gguf.py`` (and its quantizer), which
permutes q/k rows, adds 1 to Gemma's norm weights, fuses Phi-3's projections, stacks experts and
writes its own tokenizer metadata. This module runs that converter, from the llama.cpp sources the
installed llama-cpp-python was built from (its source distribution, fetched once with pip and kept
under ``$LLMSYS_HOME/llama.cpp-src-VERSION``, or ``LLMSYS_LLAMA_CPP_SRC``), and quantizes with
``llama_cpp.llama_model_quantize`` (``gguf_export.quantize``).

The converter names a byte-level BPE tokenizer's pre-tokenizer by hashing how it splits a fixed
text; a tokenizer trained for a test has no known hash, so ``pre`` names the family's
(``qwen2``, ``llama-bpe``, ``gpt-4o`` ...), as the real model's hash would. Nothing else is changed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from importlib import metadata
from pathlib import Path

from llmsys.kernels.common.errors import LLMSysError
from llmsys.kernels.common.paths import llmsys_home

SOURCE_ENV = "LLMSYS_LLAMA_CPP_SRC"  # a llama.cpp checkout (the folder holding convert_hf_to_gguf.py)
_PARTS = ("convert_hf_to_gguf.py", "conversion", "gguf-py")  # what the converter needs of the source tree

# Runs the converter with the pre-tokenizer named (argv: script, pre or "", converter arguments...).
_RUNNER = """
import runpy, sys
script, pre = sys.argv[1], sys.argv[2]
sys.argv = [script] + sys.argv[3:]
sys.path.insert(0, str(__import__("pathlib").Path(script).parent))
sys.path.insert(1, str(__import__("pathlib").Path(script).parent / "gguf-py"))
import conversion.base as base
if pre:
    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: pre
runpy.run_path(script, run_name="__main__")
"""


def llama_cpp_version() -> str:
    """The installed llama-cpp-python's version, or the one-line error saying what to install."""
    try:
        return metadata.version("llama-cpp-python")
    except metadata.PackageNotFoundError:
        raise LLMSysError('llama-cpp-python is not installed: pip install -e ".[llamacpp]" (builds llama.cpp, '
                          "~15 min)") from None


def converter_source() -> Path:
    """The llama.cpp folder holding ``convert_hf_to_gguf.py``: ``$LLMSYS_LLAMA_CPP_SRC``, or the installed
    llama-cpp-python's own source distribution (downloaded once by pip, its converter parts kept)."""
    given = os.environ.get(SOURCE_ENV)
    if given:
        path = Path(given)
        if not (path / "convert_hf_to_gguf.py").is_file():
            raise LLMSysError(f"{SOURCE_ENV}={given}: no convert_hf_to_gguf.py there; point it at a llama.cpp checkout")
        return path
    version = llama_cpp_version()
    dest = llmsys_home() / f"llama.cpp-src-{version}"
    if all((dest / p).exists() for p in _PARTS):
        return dest
    with tempfile.TemporaryDirectory(dir=llmsys_home() if llmsys_home().exists() else None) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
               f"llama-cpp-python=={version}", "-d", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True)
        sdist = next(Path(tmp).glob("llama_cpp_python-*.tar.gz"), None)
        if done.returncode != 0 or sdist is None:
            last = (done.stderr.strip().splitlines() or [""])[-1]
            raise LLMSysError(f"could not download llama-cpp-python=={version}'s sources for its converter: {last}; "
                              f"set {SOURCE_ENV} to a llama.cpp checkout")
        part = Path(tmp) / "src"
        with tarfile.open(sdist) as tar:
            prefix = f"{tar.getnames()[0].split('/')[0]}/vendor/llama.cpp/"
            members = [m for m in tar.getmembers() if m.name.startswith(prefix)
                       and m.name[len(prefix):].split("/")[0] in _PARTS]
            safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}  # Python >= 3.10.12 / 3.11.4
            tar.extractall(part, members=members, **safe)
        staged = part / prefix
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(dest, ignore_errors=True)
        shutil.move(str(staged), dest)
    return dest


def convert(folder: Path, out: Path, outtype: str = "f16", pre: str | None = None) -> Path:
    """``out`` = llama.cpp's ``convert_hf_to_gguf.py`` of the HF ``folder`` at ``outtype`` (f32, f16, bf16,
    q8_0), its BPE pre-tokenizer named ``pre`` where the converter cannot recognise it."""
    script = converter_source() / "convert_hf_to_gguf.py"
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    cmd = [sys.executable, "-c", _RUNNER, str(script), pre or "", str(folder), "--outfile", str(tmp),
           "--outtype", outtype]
    env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}  # the converter's own gguf-py, not ours
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0 or not tmp.exists():
        tmp.unlink(missing_ok=True)
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise LLMSysError(f"{folder}: llama.cpp's converter failed: {last}")
    tmp.replace(out)
    return out
