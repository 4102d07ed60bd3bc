"""Schema-based fuzzing of ``llmsys serve``, strict: whatever schemathesis generates
from the published OpenAPI schema, every check holds (``--checks all``): no 5xx,
every status, media type and header as declared, data the schema forbids is
refused and data it allows is accepted -- except a 400 whose code is one of
``SEMANTIC_CODES``, the limits of the loaded model a static schema cannot state
(a prompt over the context, a conversation the model's template rejects).

Needs ``schemathesis`` (a test dependency); the server serves a chat-capable copy
of stories260k-hf with a 128-token context so generated requests stay cheap.
"""

from __future__ import annotations

import os

import pytest

from conftest import STORIES_HF, SHARED

schemathesis = pytest.importorskip("schemathesis", reason="pip install schemathesis (test dependency)")
from hypothesis import HealthCheck, settings  # noqa: E402
from schemathesis.checks import CHECKS  # noqa: E402
from schemathesis.specs.openapi import checks as openapi_checks  # noqa: E402

from llmsys.engine.server.protocol import SEMANTIC_CODES  # noqa: E402

# Checks that need resources to create and delete (this API has none) have nothing to find here.
STATEFUL = {"use_after_free", "ensure_resource_availability", "object_level_authorization"}


def _semantic_400(response) -> bool:
    if response.status_code != 400:
        return False
    try:
        body = response.json()
        err = body["error"]  # OpenAI's shape {"error": {..., "code"}}; Ollama's {"error": "message", "code"}
        return (err["code"] if isinstance(err, dict) else body.get("code")) in SEMANTIC_CODES
    except (ValueError, KeyError, TypeError):
        return False


def positive_data_accepted_or_semantic(ctx, response, case):
    """schemathesis' positive_data_acceptance, except a 400 naming a limit of the model."""
    if _semantic_400(response):
        return None
    return openapi_checks.positive_data_acceptance(ctx, response, case)


ALL_CHECKS = [c for c in CHECKS.get_all() if c.__name__ not in STATEFUL | {"positive_data_acceptance"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    if not STORIES_HF.exists():
        pytest.skip(f"{SHARED} is absent: the stories260k model lives in ../shared beside the checkout")
    from llmsys import LLM
    from llmsys.engine.server.serve import start_server_thread
    from llmsys.engine.server.state import ServerSettings, ServerState

    from test_server import _chat_model

    state = ServerState(ServerSettings(max_queue=64))
    model = _chat_model(tmp_path_factory.mktemp("fuzz"))
    # 64 positions: a fuzzed max_tokens / n costs at most 64 tokens a completion (the checks are the same).
    state.attach(LLM(str(model), dtype="float32", max_model_len=64), "stories")
    srv = start_server_thread(state)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def api_schema(server):
    return schemathesis.openapi.from_url(server.url + "/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=int(os.environ.get("LLMSYS_FUZZ_EXAMPLES", "12")), deadline=None,
          suppress_health_check=list(HealthCheck))  # CI: 12 per operation; the closing note's run: 300
def test_every_check_holds(case, server):
    response = case.call_and_validate(base_url=server.url, timeout=60, checks=ALL_CHECKS,
                                      additional_checks=[positive_data_accepted_or_semantic])
    if response.status_code >= 400:
        err = response.json()["error"]  # OpenAI's error object, or Ollama's error string (/api)
        assert (isinstance(err, str) and err) or "message" in err


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
