"""A cold start does only what the command needs.

- ``llmsys --version``, ``--help``, ``models`` and a command's ``--help`` never import torch (nor the
  kernels, quant layers or the engine): checked in a fresh interpreter per command.
- The tokenizer a GGUF's metadata describes is built once per file content and read back from
  ``$LLMSYS_HOME/tokenizers`` afterwards: the same encodings, special tokens and templates; a corrupt or
  truncated entry is rebuilt, never trusted; a read-only home only costs the rebuild.
- The header's metadata digest follows the metadata's bytes, not the file's name or tensor data.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
SMOLLM2 = SHARED / "models" / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"
TEXTS = ["Write a short story about a cat.", "  spaces\tand\ttabs\n\nnewlines", "émoji 🐈 and 汉字 and 1234567",
         "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "def f(x):\n    return x ** 2  # done"]

# Runs one CLI command in this fresh interpreter and reports which heavy modules it imported.
_RUNNER = """
import json, sys
from llmsys.engine.cli.main import main
rc = main(sys.argv[1:])
heavy = sorted(m for m in ("torch", "llmsys.kernels.ops", "llmsys.quant.int4", "llmsys.engine.llm") if m in sys.modules)
print("\\n" + json.dumps({"rc": rc, "heavy": heavy}))
"""


@pytest.mark.parametrize("argv", [["--version"], ["--help"], ["models"], ["run", "--help"], ["serve", "--help"],
                                  ["plan", "--help"], ["chat", "--help"], ["bench", "--help"]])
def test_light_commands_do_not_import_torch(argv: list[str], tmp_path: Path) -> None:
    env = dict(os.environ, LLMSYS_HOME=str(tmp_path), COLUMNS="120")
    out = subprocess.run([sys.executable, "-c", _RUNNER, *argv], capture_output=True, text=True, env=env,
                         timeout=300)
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["rc"] == 0, out.stderr
    assert report["heavy"] == [], f"llmsys {' '.join(argv)} imported {report['heavy']}"
    assert out.stdout.strip(), "the command printed nothing"


def test_kernels_and_quant_names_still_import_on_use() -> None:
    """The packages' names load on first use (PEP 562), so ``from llmsys.kernels import X`` keeps working."""
    code = ("import sys, llmsys.kernels as K, llmsys.quant as Q; assert 'torch' not in sys.modules; "
            "from llmsys.kernels import rms_norm, cpu_fused_applies; from llmsys.quant import Int4Linear, QuantSpec; "
            "assert callable(rms_norm) and callable(cpu_fused_applies) and 'torch' in sys.modules; "
            "assert set(K.__all__) <= set(dir(K)) and set(Q.__all__) <= set(dir(Q)); "
            "import pytest; pytest.raises(AttributeError, getattr, K, 'no_such_kernel')")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
