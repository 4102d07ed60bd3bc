"""The Hugging Face baselines (``--vs transformers`` / ``--vs accelerate``).

(``--vs llama.cpp``, registered in ``BASELINES`` too, lives in
:mod:`llmsys.engine.bench.llamacpp`.)

The baseline loads the *same folder* (same weights, dtype and torch threads)
with ``AutoModelForCausalLM`` and runs the same tests the same way: a
``[B, n_prompt]`` prompt forward, then ``n_gen`` one-token forwards with a
``DynamicCache``, greedy argmax outside the timer, only the last position's
logits computed (``logits_to_keep=1``, as ``generate`` does). With
``accelerate`` the model is dispatched by ``device_map="auto"`` under the
row's ``--gpu-mem`` / ``--cpu-mem`` budgets (offloading the rest to disk),
the reference for our offload engine.
"""

from __future__ import annotations

import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from llmsys.engine.bench.measure import RunTimes, TestResult, TestSpec, _random_ids, _sync, summarize
from llmsys.kernels.common.errors import UnsupportedModelError

BASELINES = ("transformers", "accelerate", "llama.cpp")  # llama.cpp also as llama.cpp:FORMAT


class HFBaseline:
    """A transformers model plus the timing loop llama-bench would use."""

    def __init__(
        self,
        path: Path,
        dtype: torch.dtype,
        device: torch.device,
        kind: str = "transformers",
        gpu_mem: int | None = None,
        cpu_mem: int | None = None,
    ):
        from transformers import AutoModelForCausalLM

        if not (Path(path) / "config.json").exists():
            raise UnsupportedModelError(f"{path}: --vs {kind} needs a Hugging Face model folder (config.json)")
        self.kind = kind
        self._tmp = None
        kw: dict[str, Any] = {"dtype": dtype}
        if kind == "accelerate":
            self._tmp = tempfile.TemporaryDirectory(prefix="llmsys-accel-")
            mem: dict[Any, Any] = {"cpu": cpu_mem or "1000GiB"}
            if device.type == "cuda":
                mem[device.index or 0] = gpu_mem or torch.cuda.mem_get_info(device)[0]
            kw.update(device_map="auto", max_memory=mem, offload_folder=self._tmp.name)
        self.model = AutoModelForCausalLM.from_pretrained(str(path), **kw).eval()
        if kind == "transformers":
            self.model.to(device)
        self.device = device if kind == "transformers" else next(self.model.parameters()).device
        if self.device.type == "meta":
            self.device = torch.device("cpu")
        self.vocab = self.model.config.vocab_size

    def close(self) -> None:
        self.model = None
        if self._tmp is not None:
            self._tmp.cleanup()

    @torch.inference_mode()
    def _forward(self, ids: torch.Tensor, cache) -> torch.Tensor:
        with warnings.catch_warnings():  # transformers 5 renames past_key_values; both still work
            warnings.simplefilter("ignore", FutureWarning)
            try:
                out = self.model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
            except TypeError:  # older transformers
                out = self.model(input_ids=ids, past_key_values=cache, use_cache=True)
        return out.logits[:, -1]

    def run(self, test: TestSpec, batch: int, gen: torch.Generator) -> RunTimes:
        from transformers import DynamicCache

        cache = DynamicCache()
        times = RunTimes()

        def ids(n: int) -> torch.Tensor:
            rows = [_random_ids(n, self.vocab, gen) for _ in range(batch)]
            return torch.tensor(rows, dtype=torch.long, device=self.device)  # [B, n]

        nxt = None
        if test.depth:
            nxt = self._forward(ids(test.depth), cache).argmax(-1, keepdim=True)  # [B, 1]
        if test.n_prompt:
            x = ids(test.n_prompt)
            _sync(self.device)
            t0 = time.perf_counter()
            logits = self._forward(x, cache)
            _sync(self.device)
            times.prefill_s = time.perf_counter() - t0
            nxt = logits.argmax(-1, keepdim=True)
        elif nxt is None:
            nxt = ids(1)
        for _ in range(test.n_gen):
            _sync(self.device)
            t0 = time.perf_counter()
            logits = self._forward(nxt, cache)
            _sync(self.device)
            times.decode_steps.append(time.perf_counter() - t0)
            nxt = logits.argmax(-1, keepdim=True)
        return times

    def measure(self, test: TestSpec, batch: int, reps: int, seed: int = 0, warmup: bool = True) -> TestResult:
        gen = torch.Generator().manual_seed(seed)
        if warmup:
            self.run(test, batch, gen)
        return summarize(test, batch, [self.run(test, batch, gen) for _ in range(reps)])
