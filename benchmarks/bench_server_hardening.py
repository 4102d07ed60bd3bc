"""Issue #23's event-loop figures and issue #48's connection limits: what bad clients cost the rest.

``--part events`` (issue #23):

1. The tokenizer alone: `tokenizers`' plain ``encode`` of 4 MB on a worker thread vs the
   ``encode_batch`` the engine uses for long text (same tokens), timed with an asyncio loop
   ticking every 1 ms beside it: the loop's worst gap is how long every stream would freeze.
2. The server: four concurrent ~4 MB prompts (refused: they cannot fit the context) while a
   stream runs past the context under ``sink:4,window:200``: the stream's worst inter-token gap and
   /health's worst latency, and the process's peak RSS.

Median of ``--rounds``; needs ../shared (stories260k-hf, tinyshakespeare).

``--part limits`` (issue #48), each against ``llmsys serve`` in a child process (its log measured):

3. one slow POST (one byte every 2 s: never stalls for the 30 s stall limit): when the server cuts it;
4. 1,000 slow POSTs from one address: how many it holds, how many get 503 at once, /health meanwhile;
5. the accept storm: the server under ``ulimit -n 256`` with 300 slow connections while a stream runs
   and /health is polled (fresh connections), at the default cap and with ``--max-connections 1000``
   (a cap past the open-file limit, so accept() fails): /health's worst latency and failures, the
   stream's worst gap, the log's size;
6. four streams running while four multi-MB requests arrive (1.3M token ids; 108k messages; a 3.9 MB
   prompt under a sliding kv_policy): the streams' worst gap and /health's worst latency;
7. a stream whose client stops reading: the tokens decoded and the seconds until its slot is free.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
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
    ap.add_argument("--part", choices=["events", "limits", "all"], default="all")
    ap.add_argument("--body-deadline", type=float, default=60.0, help="the served --body-deadline (part limits)")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    if args.part in ("limits", "all"):
        limits(args)
    if args.part in ("events", "all"):
        events(args)


def events(args: argparse.Namespace) -> None:
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


# -- issue #48: connection limits, large bodies, backpressure -------------------------------------


class Served:
    """``llmsys serve`` in a child process (optionally under a lower open-file limit), its log in a file."""

    def __init__(self, tag: str, flags: list[str], nofile: int | None = None):
        import socket
        import subprocess
        import tempfile

        from llmsys.engine.server.serve import wait_until_healthy

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = Path(tempfile.mkdtemp()) / f"{tag}.log"

        def limit() -> None:
            if nofile is not None:
                resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))

        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "llmsys.engine.cli.main", "serve", str(MODEL), "--port", str(self.port),
                 "--dtype", "float32", "--threads", "1", "--no-pull", *flags],
                stdout=out, stderr=subprocess.STDOUT, preexec_fn=limit, cwd=ROOT)
        if not wait_until_healthy(self.url, self.proc, timeout_s=120):
            raise RuntimeError(f"the server did not start: {self.log.read_text()[-2000:]}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except Exception:  # noqa: BLE001 -- a benchmark: make sure it is gone
            self.proc.kill()

    def log_stats(self) -> tuple[int, int, int]:
        """(log bytes, lines, tracebacks)."""
        text = self.log.read_text(errors="replace")
        return len(text.encode()), text.count("\n"), text.count("Traceback")


def _head(port: int, path: str, length: int) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\ncontent-type: application/json\r\n"
            f"content-length: {length}\r\n\r\n").encode()


async def slow_client(port: int, interval: float, until: float, source: str = "127.0.0.1") -> tuple[str, float]:
    """A POST that sends one byte every ``interval`` s: (what ended it, seconds it was open)."""
    t0 = time.monotonic()
    try:
        r, w = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
    except OSError as e:
        return f"connect failed ({e.strerror})", time.monotonic() - t0
    try:
        w.write(_head(port, "/v1/completions", 1000))
        await w.drain()
        while time.monotonic() - t0 < until:
            try:
                got = await asyncio.wait_for(r.read(4096), interval)
            except asyncio.TimeoutError:
                w.write(b" ")
                await w.drain()
                continue
            status = got.split(b"\r\n", 1)[0].decode(errors="replace")[9:12] if got else "closed"
            return status or "closed", time.monotonic() - t0
        return "still open", time.monotonic() - t0
    except (ConnectionError, OSError):
        return "reset", time.monotonic() - t0
    finally:
        w.close()


class Watch:
    """/health polled on fresh connections (from 127.0.0.2) and ``streams`` streams read, in threads,
    until ``stop``; the samples taken between ``mark()`` and ``stop()`` are the busy ones."""

    def __init__(self, url: str, streams: int = 0, kv_policy: str = "sink:4,window:200"):
        import httpx

        self.url, self.health, self.gaps, self.health_fail = url, [], [], 0
        self.busy_from = float("inf")
        self.done = threading.Event()
        self.started = threading.Semaphore(0)
        body = {"prompt": "Once upon a time", "max_tokens": 100000, "ignore_eos": True, "temperature": 0,
                "stream": True, "kv_policy": kv_policy}

        def stream() -> None:
            tr = httpx.HTTPTransport(local_address="127.0.0.3")
            with httpx.Client(transport=tr, timeout=120) as c, c.stream("POST", url + "/v1/completions", json=body) as r:
                last, first = None, True
                for line in r.iter_lines():
                    now = time.monotonic()
                    if line.startswith("data: {"):
                        if first:
                            self.started.release()
                            first = False
                        if last is not None and now >= self.busy_from:
                            self.gaps.append(now - last)
                        last = now
                    if self.done.is_set():
                        break

        def poll() -> None:
            tr = httpx.HTTPTransport(local_address="127.0.0.2")
            with httpx.Client(transport=tr, timeout=5, limits=httpx.Limits(max_keepalive_connections=0)) as c:
                while not self.done.is_set():
                    t0 = time.monotonic()
                    try:
                        ok = c.get(url + "/health").status_code == 200
                    except httpx.HTTPError:
                        ok = False
                    if t0 >= self.busy_from:
                        self.health.append(time.monotonic() - t0)
                        self.health_fail += not ok
                    time.sleep(0.05)

        self.threads = [threading.Thread(target=stream) for _ in range(streams)] + [threading.Thread(target=poll)]
        for t in self.threads:
            t.start()
        for _ in range(streams):
            self.started.acquire(timeout=60)

    def mark(self) -> None:
        time.sleep(0.5)
        self.busy_from = time.monotonic()

    def stop(self) -> tuple[float, float, int]:
        """(worst stream gap ms, worst /health ms, /health failures) over the busy time."""
        self.done.set()
        for t in self.threads:
            t.join(60)
        return (max(self.gaps, default=0.0) * 1000, max(self.health, default=0.0) * 1000, self.health_fail)


def _raise_nofile(want: int) -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def limits(args: argparse.Namespace) -> None:
    import collections

    import httpx

    nofile = _raise_nofile(8192)  # the clients' own descriptors
    deadline = args.body_deadline
    rows: list[str] = []

    # 3 + 4: one slow POST, then 1,000 from one address
    srv = Served("slow", ["--body-deadline", f"{deadline:g}"])
    try:
        end, took = asyncio.run(slow_client(srv.port, 2.0, deadline + 60))
        rows.append(f"| one slow POST (1 byte / 2 s) | ended by {end} after {took:.1f} s (--body-deadline {deadline:g}) |")
        w = Watch(srv.url)
        w.mark()

        async def thousand():
            return await asyncio.gather(*[slow_client(srv.port, 2.0, deadline + 60) for _ in range(1000)])

        t0 = time.monotonic()
        res = asyncio.run(thousand())
        took = time.monotonic() - t0
        _, health, fails = w.stop()
        kinds = collections.Counter(e for e, _ in res)
        quick = sum(1 for e, t in res if e == "503" and t < 1.0)
        held = [t for e, t in res if e in ("408", "closed", "reset") and t >= 1.0]
        rows.append(f"| 1,000 slow POSTs, one address | {dict(kinds)}; {quick} got 503 within 1 s; {len(held)} held, "
                    f"the last closed at {max(held, default=0):.1f} s; all done in {took:.1f} s; /health worst "
                    f"{health:.0f} ms, {fails} failed |")
        size, lines, tb = srv.log_stats()
        rows.append(f"| server log after both | {size} bytes, {lines} lines, {tb} tracebacks |")
    finally:
        srv.stop()

    # 5: the accept storm under ulimit -n 256
    for label, flags in (("default cap", []), ("--max-connections 1000 (past the fd limit)", ["--max-connections", "1000"])):
        srv = Served("storm", ["--body-deadline", f"{deadline:g}", *flags], nofile=256)
        try:
            w = Watch(srv.url, streams=1)
            w.mark()

            async def storm():
                return await asyncio.gather(*[slow_client(srv.port, 2.0, 20.0) for _ in range(300)])

            res = asyncio.run(storm())
            gap, health, fails = w.stop()
            kinds = collections.Counter(e for e, _ in res)
            size, lines, tb = srv.log_stats()
            rows.append(f"| ulimit -n 256, 300 slow connections, {label} | {dict(kinds)}; /health worst {health:.0f} ms, "
                        f"{fails} of {len(w.health)} failed; stream worst gap {gap:.0f} ms; log {size} bytes, "
                        f"{lines} lines, {tb} tracebacks |")
        finally:
            srv.stop()

    # 6: four streams while four multi-MB requests arrive; 7: a client that stops reading
    srv = Served("bodies", ["--max-body", "8MiB", "--max-num-seqs", "8"])
    try:
        text = big_text(3_900_000)
        bodies = {
            "1.3M token ids": json.dumps({"prompt": [7] * 1_300_000, "max_tokens": 2}).encode(),
            "108k messages": json.dumps({"messages": [{"role": "user", "content": f"hello {i}"}
                                                      for i in range(108_000)], "max_tokens": 2}).encode(),
            "3.9 MB prompt, kv_policy sink:4,window:200": json.dumps(
                {"prompt": text, "max_tokens": 2, "kv_policy": "sink:4,window:200"}).encode(),
        }
        for label, payload in bodies.items():
            path = "/v1/chat/completions" if "messages" in label else "/v1/completions"
            w = Watch(srv.url, streams=4)
            w.mark()

            async def bigs():
                async with httpx.AsyncClient(timeout=120, headers={"content-type": "application/json"}) as c:
                    return await asyncio.gather(*[c.post(srv.url + path, content=payload) for _ in range(4)])

            t0 = time.monotonic()
            rs = asyncio.run(bigs())
            took = time.monotonic() - t0
            time.sleep(0.5)
            gap, health, fails = w.stop()
            codes = collections.Counter(r.status_code for r in rs)
            rows.append(f"| 4 streams + 4 x {label} ({len(payload) / 1e6:.1f} MB) | answered {dict(codes)} in {took:.2f} s; "
                        f"streams' worst gap {gap:.0f} ms; /health worst {health:.0f} ms ({fails} failed) |")

        import socket

        def generated() -> float:
            from llmsys.engine.server.metrics import parse_metrics

            return parse_metrics(httpx.get(srv.url + "/metrics").text).get("llmsys_generation_tokens_total", 0)

        before = generated()
        body = json.dumps({"prompt": "Once upon a time", "max_tokens": 100000, "ignore_eos": True, "stream": True,
                           "kv_policy": "sink:4,window:200"}).encode()
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect(("127.0.0.1", srv.port))
        s.sendall(_head(srv.port, "/v1/completions", len(body)) + body)
        t0 = time.monotonic()
        time.sleep(1.0)
        while httpx.get(srv.url + "/health").json()["running"] and time.monotonic() - t0 < 300:
            time.sleep(0.2)
        took = time.monotonic() - t0
        s.close()
        rows.append(f"| a stream whose client never reads (SO_RCVBUF 4 KiB) | slot free after {took:.1f} s, "
                    f"{generated() - before:.0f} tokens decoded (max_tokens 100000; --send-timeout 30) |")
    finally:
        srv.stop()

    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    print(f"Machine: {cpu}, {os.cpu_count()} CPUs; llmsys serve stories260k-hf float32 --threads 1; "
          f"the clients' open-file limit {nofile}.\n")
    print("| issue #48 scenario | result |")
    print("|---|---|")
    for r in rows:
        print(r)


if __name__ == "__main__":
    main()
