"""The engine client every front end shares (``llmsys.engine.client``): admission, streaming to a
sink, aborts, calls on the engine thread and a failed load, on the real stories260k engine."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from conftest import STORIES_HF, need_shared

from llmsys.engine.client import EngineClient, QueueFullError, ServiceUnavailableError, Submission
from llmsys.engine.outputs import StreamChunk
from llmsys.engine.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    need_shared(STORIES_HF)
    from llmsys import LLM

    torch.set_num_threads(1)
    return LLM(str(STORIES_HF), dtype="float32", kv_cache_tokens=512, progress=False)


class Collect:
    """A sink: every outcome per index, and an event per index set by its last one."""

    def __init__(self, n: int):
        self.items: dict[int, list] = {i: [] for i in range(n)}
        self.done = {i: threading.Event() for i in range(n)}

    def __call__(self, index: int, item) -> None:
        self.items[index].append(item)
        if not isinstance(item, StreamChunk) or item.finished:
            self.done[index].set()

    def text(self, index: int) -> str:
        return "".join(c.text for c in self.items[index] if isinstance(c, StreamChunk))

    def wait(self, index: int) -> None:
        assert self.done[index].wait(60), f"request {index} never ended"


def test_streams_what_generate_gives_and_refuses_past_the_queue(llm):
    ids = llm.encode("Once upon a time")
    want = llm.generate([ids], GREEDY)[0].text
    client = EngineClient(llm.core, max_concurrency=1, max_queue=1)
    client.start()
    try:
        sink = Collect(3)
        subs = [Submission(f"r{i}", i, ids, GREEDY, sink) for i in range(3)]
        client.submit(subs[:2])
        with pytest.raises(QueueFullError, match="limit 1 running \\+ 1 queued"):
            client.submit(subs[2:])
        sink.wait(0)
        sink.wait(1)
        assert sink.text(0) == want and sink.text(1) == want  # the queued one ran after the first
        assert sink.items[0][-1].finish_reason == "length" and sink.items[2] == []
    finally:
        client.stop()
    assert not client.is_alive() and client.failure == "exited"
    with pytest.raises(ServiceUnavailableError, match="engine thread stopped"):
        client.submit(subs[2:])


def test_an_abort_ends_running_and_queued_requests_with_an_abort_chunk(llm, monkeypatch):
    ids = llm.encode("Once upon a time")
    step = llm.core.step

    def paced_step():  # stories260k fills its context in ~0.2 s: pace it like a bigger model
        time.sleep(0.01)
        return step()

    monkeypatch.setattr(llm.core, "step", paced_step)
    client = EngineClient(llm.core, max_concurrency=1, max_queue=1)
    long = SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True)
    gate = threading.Event()
    client.start()
    try:
        client.call(gate.wait)  # hold the engine thread so both aborts land before it steps
        sink = Collect(2)
        client.submit([Submission("a", 0, ids, long, sink), Submission("b", 1, ids, long, sink)])
        client.abort("b")  # still queued
        on_thread = []
        client.call(lambda: on_thread.append(threading.current_thread() is client))
        gate.set()
        sink.wait(1)
        assert [c.finish_reason for c in sink.items[1]] == ["abort"]
        deadline = time.monotonic() + 30
        while not any(isinstance(c, StreamChunk) and c.token_ids for c in sink.items[0]):
            assert time.monotonic() < deadline, "no tokens came"
            time.sleep(0.005)
        client.abort("a")  # running
        sink.wait(0)
        assert sink.items[0][-1].finish_reason == "abort" and on_thread == [True]
        assert client.health().running == 0 and client.health().queued == 0
    finally:
        client.stop()


def test_a_failed_load_is_reported_and_refuses_submissions():
    seen = []

    class Client(EngineClient):
        def on_load_failed(self, e: Exception) -> None:
            seen.append(str(e))

    def load():
        raise FileNotFoundError("no such model: /nowhere/model.gguf")

    client = Client(load=load)
    client.start()
    client.join(10)
    assert seen == ["no such model: /nowhere/model.gguf"]
    assert client.failure == "FileNotFoundError: no such model: /nowhere/model.gguf"
    with pytest.raises(ServiceUnavailableError, match="no such model"):
        client.submit([Submission("x", 0, [1], GREEDY, lambda i, item: None)])
