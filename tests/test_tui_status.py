"""The chat's status line names the weights as stored (a GGUF's block format in words), not
``quant none``; and the app's text and panel posts stay at their low rates while decoding."""

from __future__ import annotations

import asyncio

import pytest
from conftest import SHARED, STORIES_HF, need_shared

from llmsys.engine.sampling import SamplingParams
from llmsys.tui.app import ChatApp
from llmsys.tui.messages import ModelInfo, SnapshotUpdated, TokensReceived
from llmsys.tui.status_line import info_variants, stored_weights

SMOLLM2 = SHARED / "models" / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.mark.parametrize("formats, quant, want", [
    ({"F32 (61)": "bfloat16", "Q4_1 (210)": "int4:g32, codes as stored", "Q8_0 (1)": "int8:g32, codes as stored"},
     "none", "Q4_1 (int4 + offset)"),
    # norms outnumber the matrices: still the matrices' format
    ({"F32 (130)": "float32", "Q4_K (96)": "int4:g32, codes as stored", "Q6_K (17)": "dequantized to bfloat16"},
     "none", "Q4_K (int4 + offset, k-quant)"),
    ({"Q5_K (168)": "dequantized to bfloat16", "F32 (65)": "bfloat16"}, "none", "Q5_K (dequantized to bfloat16)"),
    ({"Q8_0 (169)": "int8:g32, codes as stored"}, "none", "Q8_0 (int8)"),
    ({"IQ4_NL (100)": "dequantized to bfloat16"}, "none", "IQ4_NL (dequantized to bfloat16)"),
    ({"F16 (200)": "float16", "F32 (40)": "float32"}, "none", "F16 (float16)"),
    ({}, "int8:g64", "int8:g64 (quantized at load)"),
    (None, "none", "bfloat16"),
])
def test_stored_weights_in_words(formats, quant, want):
    assert stored_weights(formats, quant, "bfloat16") == want


def test_status_variants_name_the_stored_format_not_quant_none():
    info = ModelInfo("m.gguf", "bfloat16", "none", "cpu", "GGUF", 30, 8192, True, stored_as="Q4_1 (int4 + offset)")
    full = info_variants(info, "all 30 layers resident on CPU", "ready")
    assert "weights Q4_1 (int4 + offset)" in full[0] and "quant none" not in " ".join(full)
    assert "weights Q4_1 (int4 + offset)" in full[1] and len(full[1]) < len(full[0])


def test_status_bar_on_the_q4_1_gguf_says_q4_1_int4_offset():
    need_shared(SMOLLM2)
    from llmsys import LLM

    llm = LLM(str(SMOLLM2), threads=1, progress=False)

    async def go():
        app = ChatApp(lambda: llm)
        async with app.run_test(size=(200, 40)) as pilot:
            for _ in range(600):
                if app.info is not None or app.load_error is not None:
                    break
                await pilot.pause(0.05)
            await pilot.pause(0.1)
            text = app.status.text
            assert "weights Q4_1 (int4 + offset)" in text and "quant none" not in text, text
            await pilot.resize_terminal(100, 30)  # narrower: a shorter variant, the key hints kept
            await pilot.pause(0.2)
            narrow = app.status.text
            assert narrow.endswith("Ctrl+Q quit") and len(narrow) <= 100

    asyncio.run(go())


def test_text_and_panel_posts_are_coalesced_while_decoding():
    """Each post wakes the UI thread, which then holds the GIL the decode loop needs: text goes
    out at most ``text_hz`` times a second (plus the first and last), each panel snapshot takes
    the waiting text with it, and no text is lost."""
    need_shared(STORIES_HF)
    from llmsys import LLM
    from llmsys.tui.worker import EngineWorker, Generate

    llm = LLM(str(STORIES_HF), dtype="float32", threads=1, progress=False)
    posts: list[tuple[float, object]] = []
    import time

    worker = EngineWorker(lambda: llm, lambda m: posts.append((time.perf_counter(), m)), refresh_hz=4.0, text_hz=8.0)
    worker.start()
    try:
        deadline = time.monotonic() + 60
        while worker.llm is None or worker.core is None:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        params = SamplingParams(max_tokens=480, temperature=0.0, ignore_eos=True)
        ids = llm.encode("Once upon a time")
        # slow each step down so the reply spans several text and panel intervals
        step = worker.core.step

        def slow_step():
            time.sleep(0.004)
            return step()

        worker.core.step = slow_step
        worker.ask(Generate(1, params, text="Once upon a time"))
        while not any(type(m).__name__ == "GenerationDone" for _, m in posts):
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        worker.stop()
    texts = [(t, m) for t, m in posts if isinstance(m, TokensReceived)]
    snaps = [(t, m) for t, m in posts if isinstance(m, SnapshotUpdated) and m.snapshot.generating]
    assert sum(m.n_tokens for _, m in texts) == 480 and len(snaps) >= 2
    assert "".join(m.text for _, m in texts) == llm.generate([ids], params)[0].text
    span = texts[-1][0] - texts[0][0]
    assert len(texts) <= span * 8.0 + len(snaps) + 2, (len(texts), span)  # 8 Hz plus those sent with a snapshot
    # every snapshot while generating comes right after a text post (same moment: one frame)
    for t, _ in snaps:
        i = next(i for i, (tp, m) in enumerate(posts) if tp == t and isinstance(m, SnapshotUpdated))
        assert isinstance(posts[i - 1][1], TokensReceived)
