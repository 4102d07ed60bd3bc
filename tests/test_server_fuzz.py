"""Schema-based fuzzing of ``llmsys serve``: whatever schemathesis generates
from the published OpenAPI schema, the server never answers 5xx.

Needs ``schemathesis`` (a test dependency); the server serves stories260k-hf
with a 128-token context so generated requests stay cheap.
"""

from __future__ import annotations

import pytest

from conftest import STORIES_HF, SHARED

schemathesis = pytest.importorskip("schemathesis", reason="pip install schemathesis (test dependency)")
from hypothesis import HealthCheck, settings  # noqa: E402


@pytest.fixture(scope="module")
def server():
    if not STORIES_HF.exists():
        pytest.skip(f"{SHARED} is absent: the stories260k model lives in ../shared beside the checkout")
    from llmsys import LLM
    from llmsys.engine.server.serve import start_server_thread
    from llmsys.engine.server.state import ServerSettings, ServerState

    state = ServerState(ServerSettings(max_queue=64))
    state.attach(LLM(str(STORIES_HF), dtype="float32", max_model_len=128), "stories")
    srv = start_server_thread(state)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def api_schema(server):
    return schemathesis.openapi.from_url(server.url + "/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_server_errors(case, server):
    response = case.call(base_url=server.url, timeout=60)
    assert response.status_code < 500, (case.method, case.path, case.body, response.text[:500])
    if response.status_code >= 400:
        assert "error" in response.json() and "message" in response.json()["error"]


def test_kv_blocks_back_to_zero_after_fuzzing(server):
    import time

    import httpx

    from llmsys.engine.server.metrics import parse_metrics

    deadline = time.monotonic() + 10
    while True:
        m = parse_metrics(httpx.get(server.url + "/metrics").text)
        if m['llmsys_kv_blocks_used{tier="cpu"}'] == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert m['llmsys_kv_blocks_used{tier="cpu"}'] == 0 and m["llmsys_requests_running"] == 0
