"""KV that survives a restart (``--kv-disk``): a long prompt, the engine process restarted, the same prompt
plus one turn, read back from disk instead of computed.

Each step is a new process (``--child``), so nothing but the disk tier's folder carries over:

1. ``first``: a ~4,000-token chat prompt (a long document and a question) on an empty folder: computed,
   its blocks and its answer's written to disk.
2. ``restored``: a new process, the same prompt plus the answer plus one more user turn: the prefix is read
   back from disk (``cached_tokens``); once with the files in the page cache, once with them dropped from
   it (``posix_fadvise`` DONTNEED on the tier's files only: a restart after a reboot).
3. ``recomputed``: the same turn with ``--kv-disk 0``: the reference tokens and time to first token.
4. ``corrupt``: one block file in the middle of the chain damaged: the run stops reading there, computes
   the rest, gives the same tokens and deletes the file.
5. ``full disk``: the folder on an 8 MiB tmpfs (when this process may mount one; else ENOSPC injected into
   ``os.write``, said in the output): the tier turns itself off, the tokens are the same.

Time to first token is the engine's (request arrival to first sampled token); the model load is measured
apart. Run timings alone on the machine: ``flock /tmp/bench46.lock python benchmarks/kv_disk_restart.py``.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SMOLLM2 = "/work/shared/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf"
QUESTION = "Which island's lighthouse was painted last, and in what colour?"
NEXT_TURN = "Thank you. Now list three other lighthouses from the report and their years."


def _document(n_facts: int) -> str:
    colours = ["red", "white", "blue", "green", "yellow", "black", "grey", "orange"]
    lines = []
    for i in range(n_facts):
        lines.append(f"Entry {i + 1}: the {colours[i % 8]} lighthouse on island {(i * 37) % 211 + 1} was "
                     f"painted in {1800 + (i * 13) % 200}, and its keeper counted {(i * 7) % 90 + 10} ships "
                     f"that winter.")
    return "Here is a report about lighthouses.\n\n" + "\n".join(lines)


def _messages(llm, tokens: int) -> list[dict]:
    """A first user message whose rendered prompt is ``tokens`` long (give or take one entry)."""
    lo, hi = 1, 2000
    while lo < hi:  # the most entries that keep the prompt within `tokens`
        mid = (lo + hi + 1) // 2
        msgs = [{"role": "user", "content": _document(mid) + "\n\n" + QUESTION}]
        if len(llm.chat_prompt_ids(msgs)) <= tokens:
            lo = mid
        else:
            hi = mid - 1
    return [{"role": "user", "content": _document(lo) + "\n\n" + QUESTION}]


def child(args: argparse.Namespace) -> None:
    if args.inject_enospc:
        def full(fd, data):  # a disk with no space left: every write fails
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        os.write = full
    from llmsys import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(args.model, progress=False, kv_disk=args.kv_disk, kv_disk_dir=args.dir, max_model_len=8192)
    load_s = time.perf_counter() - t0
    msgs = _messages(llm, args.tokens)
    if args.answer is not None:
        msgs += [{"role": "assistant", "content": args.answer}, {"role": "user", "content": NEXT_TURN}]
    ids = llm.chat_prompt_ids(msgs)
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=args.max_tokens))[0]
    disk = llm.core.kv_disk
    if disk is not None:
        disk.flush(120)
    rep = disk.report().to_dict() if disk is not None else None
    print(json.dumps({"load_s": load_s, "ttft_s": out.timings.ttft_s, "prompt_tokens": len(ids),
                      "cached_tokens": out.usage.cached_tokens, "token_ids": out.token_ids, "text": out.text,
                      "kv_disk": rep}))


def run_child(model: str, folder: str, kv_disk: str, tokens: int, max_tokens: int, answer: str | None = None,
              inject_enospc: bool = False) -> dict:
    cmd = [sys.executable, __file__, "--child", "--model", model, "--dir", folder, "--kv-disk", kv_disk,
           "--tokens", str(tokens), "--max-tokens", str(max_tokens)]
    if answer is not None:
        cmd += ["--answer", answer]
    if inject_enospc:
        cmd.append("--inject-enospc")
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"child failed ({' '.join(cmd[2:])}):\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def drop_page_cache(folder: str) -> int:
    """Drop the tier's files (only those) from the page cache: the next read comes from the disk."""
    n = 0
    for f in Path(folder).rglob("*.kvb"):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            n += 1
        finally:
            os.close(fd)
    return n


def _mount_small_fs(path: Path, size: str) -> bool:
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=SMOLLM2)
    ap.add_argument("--tokens", type=int, default=4000, help="the first prompt's length")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2, help="restored / recomputed runs, interleaved")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--dir", help=argparse.SUPPRESS)
    ap.add_argument("--kv-disk", default="4GiB", help=argparse.SUPPRESS)
    ap.add_argument("--answer", help=argparse.SUPPRESS)
    ap.add_argument("--inject-enospc", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)

    work = Path(tempfile.mkdtemp(prefix="kv-disk-restart-"))
    kv = str(work / "kv")
    res: dict = {"model": args.model, "machine": os.uname().nodename, "date": time.strftime("%Y-%m-%d %H:%M UTC",
                                                                                             time.gmtime())}
    try:
        first = run_child(args.model, kv, "4GiB", args.tokens, args.max_tokens)
        res["first"] = {k: first[k] for k in ("load_s", "ttft_s", "prompt_tokens", "cached_tokens")}
        res["first"]["written"] = first["kv_disk"]["written"]
        res["first"]["bytes_on_disk"] = first["kv_disk"]["bytes_on_disk"]
        answer = first["text"]
        restored, recomputed, cold = [], [], []
        for _ in range(args.rounds):
            restored.append(run_child(args.model, kv, "4GiB", args.tokens, args.max_tokens, answer))
            recomputed.append(run_child(args.model, kv, "0", args.tokens, args.max_tokens, answer))
        drop_page_cache(kv)
        cold.append(run_child(args.model, kv, "4GiB", args.tokens, args.max_tokens, answer))
        ref = recomputed[0]
        for r in restored + recomputed + cold:
            assert r["token_ids"] == ref["token_ids"], "a run's tokens differ from the recomputed run's"
        med = lambda runs, k: statistics.median(r[k] for r in runs)  # noqa: E731
        res["turn"] = {
            "prompt_tokens": ref["prompt_tokens"], "cached_tokens": restored[0]["cached_tokens"],
            "cached_fraction": restored[0]["cached_tokens"] / ref["prompt_tokens"],
            "ttft_restored_s": med(restored, "ttft_s"), "ttft_restored_cold_cache_s": cold[0]["ttft_s"],
            "ttft_recomputed_s": med(recomputed, "ttft_s"),
            "load_s": med(restored + recomputed, "load_s"), "identical_tokens": True,
            "ttft_each": {"restored": [r["ttft_s"] for r in restored], "recomputed": [r["ttft_s"] for r in recomputed]},
            # inside the restored runs' TTFT: reading, checking and copying the blocks into the pool
            "read_s": [r["kv_disk"]["read_s"] for r in restored], "read_cold_cache_s": cold[0]["kv_disk"]["read_s"],
        }
        res["turn"]["ttft_ratio"] = res["turn"]["ttft_restored_s"] / res["turn"]["ttft_recomputed_s"]
        res["turn"]["ttft_ratio_cold_cache"] = cold[0]["ttft_s"] / res["turn"]["ttft_recomputed_s"]

        # A corrupt block file in the middle of the chain.
        files = sorted(Path(kv).rglob("*.kvb"), key=lambda f: f.stat().st_mtime)
        victim = files[len(files) // 3]
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0xFF
        victim.write_bytes(bytes(data))
        c = run_child(args.model, kv, "4GiB", args.tokens, args.max_tokens, answer)
        res["corrupt"] = {"cached_tokens": c["cached_tokens"], "corrupt": c["kv_disk"]["corrupt"],
                          "identical_tokens": c["token_ids"] == ref["token_ids"], "ttft_s": c["ttft_s"]}

        # A full disk.
        small = work / "small"
        small.mkdir()
        mounted = _mount_small_fs(small, "8m")
        f = run_child(args.model, str(small / "kv"), "4GiB", args.tokens, args.max_tokens, answer,
                      inject_enospc=not mounted)
        res["full_disk"] = {"how": "8 MiB tmpfs" if mounted else "ENOSPC injected into os.write",
                            "enabled_after": f["kv_disk"]["enabled"], "failure": f["kv_disk"]["failure"],
                            "identical_tokens": f["token_ids"] == ref["token_ids"], "ttft_s": f["ttft_s"]}
        if mounted:
            subprocess.run(["umount", str(small)], check=False)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(res, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
    t = res["turn"]
    print(f"\nprompt {t['prompt_tokens']} tokens, cached {t['cached_tokens']} ({t['cached_fraction']:.1%}); "
          f"TTFT restored {t['ttft_restored_s'] * 1000:.0f} ms (page cache dropped: "
          f"{t['ttft_restored_cold_cache_s'] * 1000:.0f} ms) vs recomputed {t['ttft_recomputed_s'] * 1000:.0f} ms "
          f"= {t['ttft_ratio']:.3f}x ({t['ttft_ratio_cold_cache']:.3f}x); model load {t['load_s']:.2f} s apart; "
          f"corrupt block: same tokens {res['corrupt']['identical_tokens']}; full disk ({res['full_disk']['how']}): "
          f"same tokens {res['full_disk']['identical_tokens']}, tier off: {not res['full_disk']['enabled_after']}")


if __name__ == "__main__":
    main()
