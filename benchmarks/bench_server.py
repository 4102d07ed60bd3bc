"""Load test of ``llmsys serve``: concurrent streaming clients, cancellations, /metrics.

Makes the random-weight SmolLM2-135M-shaped checkpoint (``make_synthetic``)
in a temp dir, starts ``llmsys serve`` on it in a subprocess on a free
loopback port, then:

1. single client: each distinct request once, one after another (streaming,
   greedy) -> reference texts and the single-client generated tok/s;
2. load: ``--clients`` concurrent streaming clients work through
   ``--requests`` requests drawn from the same set; ``--cancel`` of them are
   closed mid-stream (the server must abort them and free their KV blocks);
3. checks: zero 5xx (client side and /metrics), KV blocks used back to 0,
   every completed load output identical to its sequential reference, and
   aggregate generated tok/s / single-client tok/s.

``--client openai`` (default) drives the server with the official AsyncOpenAI client;
``--client raw`` with a minimal asyncio HTTP/1.1 + SSE reader. Why
both: the load generator shares this machine's two cores with the server, and
the openai client's per-chunk pydantic parsing costs CPU the engine then loses
(its OpenMP threads stall while the client runs). The raw client speaks the
same wire protocol (the tests cover the real openai client); the report states
which client ran and the CPU seconds each side used.

Prints a Markdown block (for docs/benchmarks.md). Usage:

    python benchmarks/bench_server.py [--requests 200] [--clients 16] [--cancel 0.1] [--client raw|openai]
                                      [--no-prefix-caching]

The load phase sends each distinct prompt about ``requests / distinct`` times,
so with prefix caching on (the server's default) most prompts' KV is reused;
the report gives the reused share, and ``--no-prefix-caching`` measures the
same load with every prompt computed in full.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import resource
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import psutil

from llmsys.engine.server.serve import wait_until_healthy


@dataclass
class Spec:
    prompt: str
    max_tokens: int


@dataclass
class Result:
    spec_idx: int
    text: str = ""
    tokens: int = 0  # content chunks received (one token each, give or take held-back text)
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    cancelled: bool = False
    error: str | None = None
    completion_tokens: int | None = None
    t0: float = field(default_factory=time.perf_counter)  # request sent
    last: float | None = None  # last content chunk received

    def add_text(self, text: str, cancel_after: int | None) -> bool:
        """Record one content chunk (TTFT / inter-token gap); True when the client should cancel now."""
        now = time.perf_counter()
        if self.last is None:
            self.ttft = now - self.t0
        else:
            self.itls.append(now - self.last)
        self.last = now
        self.text += text
        self.tokens += 1
        self.cancelled = cancel_after is not None and self.tokens >= cancel_after
        return self.cancelled


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_WORDS = "once upon a time there was a little girl who loved to play in the park with her dog".split()


def _specs(n: int, vocab: int | None, seed: int) -> list[Spec]:
    """Prompts of mixed lengths: ``t<id>`` words (one token each with the
    synthetic word-level tokenizer) or, for a real model, plain words."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        plen = rng.choice([8, 16, 32, 64, 128] if vocab else [4, 8, 16, 32, 64])
        pick = (lambda: f"t{rng.randrange(3, vocab)}") if vocab else (lambda: rng.choice(_WORDS))
        words = " ".join(pick() for _ in range(plen))
        out.append(Spec(words, rng.choice([16, 32, 48, 64, 96])))
    return out


class RawClient:
    """Streaming ``POST /v1/completions`` over a bare asyncio connection.

    One connection per request (``Connection: close``), so closing it is the
    client going away mid-stream, as with the openai client's ``stream.close()``.
    Handles the chunked transfer encoding uvicorn uses for SSE.
    """

    def __init__(self, url: str):
        u = httpx.URL(url)
        self.host, self.port = u.host, u.port

    async def stream(self, body: dict):
        """Yield each SSE event's parsed JSON (until ``[DONE]``); raise on non-200."""
        reader, writer = await asyncio.open_connection(self.host, self.port)
        try:
            data = json.dumps(body).encode()
            writer.write(
                b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                b"Connection: close\r\nContent-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data
            )
            status = int((await reader.readline()).split()[1])
            chunked = False
            while (line := await reader.readline()) not in (b"\r\n", b""):
                if line.lower().startswith(b"transfer-encoding:") and b"chunked" in line.lower():
                    chunked = True
            if status != 200:
                raise RuntimeError(f"{status}: {(await reader.read()).decode(errors='replace')[:200]}")
            buf = b""
            while True:
                if chunked:
                    size = int((await reader.readline()).strip() or b"0", 16)
                    if size == 0:
                        return
                    buf += await reader.readexactly(size + 2)
                    buf = buf[:-2] if buf.endswith(b"\r\n") else buf
                else:
                    more = await reader.read(65536)
                    if not more:
                        return
                    buf += more
                while b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    payload = event.removeprefix(b"data: ")
                    if payload == b"[DONE]":
                        return
                    yield json.loads(payload)
        finally:
            writer.close()


async def _one_raw(client: RawClient, spec: Spec, idx: int, cancel_after: int | None) -> Result:
    r = Result(idx)
    body = {"model": "m", "prompt": spec.prompt, "max_tokens": spec.max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}
    gen = client.stream(body)
    try:
        async for ch in gen:
            if ch.get("usage"):
                r.completion_tokens = ch["usage"]["completion_tokens"]
            if not ch.get("choices") or not ch["choices"][0].get("text"):
                continue
            if r.add_text(ch["choices"][0]["text"], cancel_after):
                break
    except RuntimeError as e:
        r.error = str(e)
    finally:
        await gen.aclose()  # closes the connection: the server sees the client go away
    return r


async def _one(client: openai.AsyncOpenAI, spec: Spec, idx: int, cancel_after: int | None) -> Result:
    r = Result(idx)
    try:
        stream = await client.completions.create(
            model="m", prompt=spec.prompt, max_tokens=spec.max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )
        async for ch in stream:
            if ch.usage is not None:
                r.completion_tokens = ch.usage.completion_tokens
            if not ch.choices or not ch.choices[0].text:
                continue
            if r.add_text(ch.choices[0].text, cancel_after):
                await stream.close()  # client goes away mid-stream
                break
    except openai.APIStatusError as e:
        r.error = f"{e.status_code}: {e.message}"
    return r


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def _metrics(url: str) -> dict[str, float]:
    from llmsys.engine.server.metrics import parse_metrics

    return parse_metrics(httpx.get(url + "/metrics").text)


async def run(args: argparse.Namespace, url: str, vocab: int) -> str:
    specs = _specs(args.distinct, vocab, args.seed)
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=600)
    if args.client == "raw":
        raw = RawClient(url)

        async def one(_c, spec, idx, cancel):  # noqa: ANN001
            return await _one_raw(raw, spec, idx, cancel)
    else:
        one = _one
    server = psutil.Process(args.server_pid)
    async with client:
        await one(client, specs[0], 0, None)  # warm-up
        # 1. one client, sequential
        t0 = time.perf_counter()
        ref = [await one(client, s, i, None) for i, s in enumerate(specs)]
        seq_wall = time.perf_counter() - t0
        seq_tokens = sum(r.completion_tokens or 0 for r in ref)
        single_tps = seq_tokens / seq_wall
        if not seq_tokens:  # nothing came back: say why rather than divide by zero
            raise SystemExit(f"the sequential requests generated nothing: {[r.error for r in ref][:3]}")
        # 2. load
        rng = random.Random(args.seed + 1)
        jobs = []
        for k in range(args.requests):
            i = k % len(specs)
            cancel = rng.randrange(2, specs[i].max_tokens // 2) if rng.random() < args.cancel else None
            jobs.append((i, cancel))
        queue: asyncio.Queue = asyncio.Queue()
        for j in jobs:
            queue.put_nowait(j)
        results: list[Result] = []

        async def worker() -> None:
            while not queue.empty():
                i, cancel = queue.get_nowait()
                results.append(await one(client, specs[i], i, cancel))

        m0 = _metrics(url)
        cpu0 = resource.getrusage(resource.RUSAGE_SELF)
        scpu0 = server.cpu_times()
        t0 = time.perf_counter()
        await asyncio.gather(*[worker() for _ in range(args.clients)])
        load_wall = time.perf_counter() - t0
        cpu1 = resource.getrusage(resource.RUSAGE_SELF)
        scpu1 = server.cpu_times()
    client_cpu = (cpu1.ru_utime + cpu1.ru_stime) - (cpu0.ru_utime + cpu0.ru_stime)
    server_cpu = (scpu1.user + scpu1.system) - (scpu0.user + scpu0.system)
    # 3. checks
    await asyncio.sleep(0.5)
    m = _metrics(url)
    hit_tokens = m.get("llmsys_prefix_cache_hit_tokens_total", 0) - m0.get("llmsys_prefix_cache_hit_tokens_total", 0)
    prompt_tokens = m.get("llmsys_prompt_tokens_total", 0) - m0.get("llmsys_prompt_tokens_total", 0)
    kv_used = m.get('llmsys_kv_blocks_used{tier="cpu"}', m.get('llmsys_kv_blocks_used{tier="gpu"}', -1))
    # /health answers 503 by design while the model loads; count the API's 5xx only.
    server_5xx = sum(v for k, v in m.items()
                     if k.startswith('llmsys_requests_total{endpoint="/v1') and 'status="5' in k)
    errors = [r for r in results if r.error]
    client_5xx = [r for r in errors if r.error.startswith("5")]
    done = [r for r in results if not r.cancelled and not r.error]
    mismatched = [r for r in done if r.text != ref[r.spec_idx].text]
    cancelled = [r for r in results if r.cancelled]
    load_tokens = sum(r.completion_tokens or 0 for r in done) + sum(r.tokens for r in cancelled)
    agg_tps = load_tokens / load_wall
    ttfts = [r.ttft for r in results if r.ttft is not None]
    itls = [x for r in results for x in r.itls]
    seq_ttft = [r.ttft for r in ref if r.ttft is not None]
    seq_itl = [x for r in ref for x in r.itls]
    ok = not client_5xx and server_5xx == 0 and kv_used == 0 and not mismatched and agg_tps >= 6 * single_tps
    lines = [
        f"### `llmsys serve` load test ({args.model_desc})",
        "",
        f"{args.clients} concurrent streaming clients ({'AsyncOpenAI' if args.client == 'openai' else 'raw asyncio SSE'}),"
        f" {args.requests} greedy requests over "
        f"{len(specs)} distinct prompts (8-128 tokens, 16-96 new), {len(cancelled)} cancelled mid-stream.",
        "",
        "| metric | value |",
        "|---|---|",
        f"| single client, sequential: generated tok/s | {single_tps:.1f} |",
        f"| {args.clients} clients: aggregate generated tok/s | {agg_tps:.1f} ({agg_tps / single_tps:.1f}x) |",
        f"| load wall time | {load_wall:.1f} s |",
        f"| prefix cache ({'on' if args.prefix_caching else 'off'}): prompt tokens reused / prompt tokens (load) | "
        f"{hit_tokens:.0f} / {prompt_tokens:.0f} |",
        f"| CPU seconds during the load: server / load generator | {server_cpu:.1f} / {client_cpu:.1f} |",
        f"| TTFT p50 / p99 (load) | {_pct(ttfts, .5) * 1e3:.0f} / {_pct(ttfts, .99) * 1e3:.0f} ms |",
        f"| inter-token latency p50 / p99 (load) | {_pct(itls, .5) * 1e3:.1f} / {_pct(itls, .99) * 1e3:.1f} ms |",
        f"| TTFT p50 / ITL p50 (single client) | {_pct(seq_ttft, .5) * 1e3:.0f} / {_pct(seq_itl, .5) * 1e3:.1f} ms |",
        f"| 5xx (client / server metrics) | {len(client_5xx)} / {server_5xx:.0f} |",
        f"| other errors | {len(errors) - len(client_5xx)} |",
        f"| KV blocks in use after the run | {kv_used:.0f} |",
        f"| greedy outputs identical to sequential | {len(done) - len(mismatched)}/{len(done)} |",
        f"| verdict (zero 5xx, KV 0, identical, >= 6x) | {'PASS' if ok else 'FAIL'} |",
    ]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--cancel", type=float, default=0.1, help="fraction cancelled mid-stream")
    ap.add_argument("--distinct", type=int, default=20, help="distinct requests (sequential references)")
    ap.add_argument("--shape", default="smollm2-135m")
    ap.add_argument("--model", default=None, help="serve this model dir instead of the synthetic shape (smoke runs)")
    ap.add_argument("--dtype", default="auto", help="the server's --dtype (auto: its default, bfloat16 where the CPU has it)")
    ap.add_argument("--quant", default="none", help="weight format the server quantizes to (llmsys serve --quant)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--client", choices=["raw", "openai"], default="openai", help="load generator (see module doc)")
    ap.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                    help="serve with --no-prefix-caching (every prompt computed in full)")
    args = ap.parse_args()

    from llmsys.engine.bench.synthetic import make_synthetic, synthetic_config

    with tempfile.TemporaryDirectory(prefix="llmsys-bench-server-") as tmp:
        if args.model:
            model, vocab = Path(args.model), None
            args.model_desc = f"{model.name}, {args.dtype}, CPU"
        else:
            model = make_synthetic(args.shape, seed=args.seed, root=Path(tmp))
            vocab = synthetic_config(args.shape)["vocab_size"]
            args.model_desc = f"random {args.shape}-shaped model, {args.dtype}, CPU"
        if args.quant != "none":
            args.model_desc += f", {args.quant} weights"
        port = _free_port()
        cmd = [sys.executable, "-m", "llmsys.engine.cli.main", "serve", str(model), "--port", str(port),
               "--model-alias", "m",  # the name the load generator asks for
               "--dtype", args.dtype, "--device", "cpu", "--max-num-seqs", str(max(16, args.clients)),
               "--max-model-len", "512", "--log-level", "warning"]
        if args.threads:
            cmd += ["--threads", str(args.threads)]
        if not args.prefix_caching:
            cmd += ["--no-prefix-caching"]
        if args.quant != "none":
            cmd += ["--quant", args.quant]
        proc = subprocess.Popen(cmd)
        url = f"http://127.0.0.1:{port}"
        try:
            if not wait_until_healthy(url, proc, timeout_s=300):
                print("server did not start", file=sys.stderr)
                return 1
            args.server_pid = proc.pid
            report = asyncio.run(run(args, url, vocab))
        finally:
            proc.terminate()
            rc = proc.wait(60)
    print(report)
    print(f"\n(server exited with {rc} after SIGTERM)")
    return 0 if "PASS" in report and rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
