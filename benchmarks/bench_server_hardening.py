"""Issue #23's event-loop figures: what a 4 MB prompt costs the other requests.

1. The tokenizer alone: `tokenizers`' plain ``encode`` of 4 MB on a worker thread vs the
   ``encode_batch`` the engine uses for long text (same tokens), timed with an asyncio loop
   ticking every 1 ms beside it: the loop's worst gap is how long every stream would freeze.
2. The server: four concurrent ~4 MB prompts (refused: they cannot fit the context) while a
   stream runs past the context under ``sink:4,window:200``: the stream's worst inter-token gap and
   /health's worst latency, and the process's peak RSS.

Median of ``--rounds``; needs ../shared (stories260k-hf, tinyshakespeare).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
MODEL = SHARED / "models" / "stories260k-hf"
TEXT = SHARED / "corpus" / "tinyshakespeare.txt"


def big_text(n: int = 4_000_000) -> str:
    t = TEXT.read_text()
    return (t * (n // len(t) + 1))[:n]


def loop_gap(fn) -> tuple[float, float]:
    """(seconds ``fn`` took on a worker thread, the event loop's worst gap meanwhile)."""
    pool = ThreadPoolExecutor(1)

    async def main():
        loop = asyncio.get_running_loop()
        gaps, stop = [], asyncio.Event()

        async def ticker():
            last = time.perf_counter()
            while not stop.is_set():
                await asyncio.sleep(0.001)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        t = asyncio.create_task(ticker())
        await asyncio.sleep(0.05)  # the ticker runs before the work starts, so a freeze shows as one gap
        t0 = time.perf_counter()
        await loop.run_in_executor(pool, fn)
        took = time.perf_counter() - t0
        stop.set()
        await t
        return took, max(gaps)

    return asyncio.run(main())


def server_round(srv, big: str) -> tuple[float, float, float]:
    import httpx

    gaps, health, started, done = [], [], threading.Event(), threading.Event()

    def stream():
        body = {"prompt": "Once upon a time", "max_tokens": 100000, "ignore_eos": True, "temperature": 0,
                "stream": True, "kv_policy": "sink:4,window:200"}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
            last = None
            for line in r.iter_lines():
                now = time.monotonic()
                if line.startswith("data: {"):
                    if last is not None and started.is_set():
                        gaps.append(now - last)
                    last = now
                    started.set()
                if done.is_set():
                    break

    def poll():
        with httpx.Client(timeout=30) as c:
            while not done.is_set():
                t0 = time.monotonic()
                c.get(srv.url + "/health")
                health.append(time.monotonic() - t0)
                time.sleep(0.05)

    payload = json.dumps({"prompt": big, "max_tokens": 2}).encode()

    async def bigs():
        async with httpx.AsyncClient(timeout=120, headers={"content-type": "application/json"}) as c:
            rs = await asyncio.gather(*[c.post(srv.url + "/v1/completions", content=payload) for _ in range(4)])
        assert all(r.status_code == 400 for r in rs), [r.status_code for r in rs]

    ts = [threading.Thread(target=stream), threading.Thread(target=poll)]
    ts[0].start()
    started.wait(30)
    ts[1].start()
    t0 = time.monotonic()
    asyncio.run(bigs())
    took = time.monotonic() - t0
    time.sleep(1.0)
    done.set()
    for t in ts:
        t.join(30)
    return took, max(gaps), max(health)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from llmsys import LLM
    from llmsys.engine.server.serve import start_server_thread
    from llmsys.engine.server.state import ServerSettings, ServerState
    from llmsys.engine.tokenizer import Tokenizer
    from llmsys.kernels.cpu_report import cpu_kernels

    big = big_text()
    tok = Tokenizer.load(MODEL)
    raw = tok._backend._tok
    rows = []
    for label, fn in (("tokenizers encode (holds the GIL)", lambda: raw.encode(big)),
                      ("Tokenizer.encode (encode_batch, releases it)", lambda: tok.encode(big))):
        runs = [loop_gap(fn) for _ in range(args.rounds)]
        rows.append((label, statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)))

    state = ServerState(ServerSettings(max_body_bytes=8 * 2**20))
    state.attach(LLM(str(MODEL), dtype="float32", progress=False), "stories")
    srv = start_server_thread(state)
    try:
        rounds = [server_round(srv, big) for _ in range(args.rounds)]
    finally:
        srv.stop()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    print(f"Machine: {cpu}, {cpu_kernels().summary()}; stories260k-hf float32; 4,000,000 characters of "
          f"tinyshakespeare; median of {args.rounds}.\n")
    print("| 4 MB text on a worker thread | wall s | event loop's worst gap ms |")
    print("|---|---|---|")
    for label, took, gap in rows:
        print(f"| {label} | {took:.2f} | {gap * 1000:.0f} |")
    print("\n| server: 4 x 4 MB prompts during a stream | answered in s | stream's worst gap ms | /health worst ms |")
    print("|---|---|---|---|")
    print(f"| median | {statistics.median(r[0] for r in rounds):.2f} | "
          f"{statistics.median(r[1] for r in rounds) * 1000:.0f} | {statistics.median(r[2] for r in rounds) * 1000:.0f} |")
    print(f"| worst of {args.rounds} | {max(r[0] for r in rounds):.2f} | {max(r[1] for r in rounds) * 1000:.0f} | "
          f"{max(r[2] for r in rounds) * 1000:.0f} |")
    print(f"\nPeak RSS of the process (server, model, 4 bodies, the tokenizer runs): {peak:.0f} MiB.")


if __name__ == "__main__":
    main()
