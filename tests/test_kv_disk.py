"""The prefix cache's disk tier (engine/kv_disk.py): blocks written by one engine are read back by a new
one (a new process sees only the folder) with the same tokens and logprobs as computing them; another model
or KV format never reuses a block; a corrupt file, a full disk, a read-only folder and a tiny size limit
each fall back to computing, with the same tokens."""

from __future__ import annotations

import errno
import logging
import os
import time
from pathlib import Path

import pytest
import torch

from conftest import SHARED, STORIES_HF, need_shared

from llmsys import LLM, SamplingParams
from llmsys.engine.config import EngineConfig
from llmsys.engine.kv_cache import BlockAllocator
from llmsys.engine.kv_disk import SUFFIX, KVDisk, content_fingerprint, kv_namespace
from llmsys.engine.prefix_cache import extend_keys
from llmsys.kernels.common.errors import InvalidParameterError

SMOLLM2 = SHARED / "models" / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"
STORY = ("Once upon a time there was a little girl who loved to play in the park with her dog and her cat. "
         "One day she found a big red ball under a tree and she wanted to show it to her mom. ")
SP = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)


def _sig(o) -> tuple[list[int], list[float]]:
    return o.token_ids, [lp.logprob for lp in o.logprobs]


# -- the store alone ------------------------------------------------------------------------
def _parts(num_blocks: int = 8, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn((num_blocks, 4, 2, 8), generator=g).to(torch.bfloat16) for _ in range(4)]


def _keys(n: int, first: int = 0) -> list[bytes]:
    keys: list[bytes] = []
    extend_keys(keys, list(range(first, first + 4 * n)), 4, n)
    return keys


def _store(folder: Path, parts: list[torch.Tensor], limit: int = 1 << 20, ns: bytes = b"n" * 16) -> KVDisk:
    return KVDisk(folder, limit, ns, parts)


def test_blocks_come_back_bit_for_bit_into_other_block_ids(tmp_path):
    src = _parts()
    disk = _store(tmp_path, src)
    keys = _keys(3)
    disk.submit([1, 2, 3], keys)
    assert disk.flush() and disk.stats.written == 3
    disk.close()
    dst = [torch.zeros_like(p) for p in src]
    fresh = _store(tmp_path, dst)
    al = BlockAllocator(8)
    al.allocate(2)  # ids 1, 2 taken: the blocks land elsewhere
    got = fresh.restore(keys + _keys(1, first=99), al, max_blocks=10)
    assert len(got) == 3 and fresh.stats.hits == 3
    for p, q in zip(src, dst):
        assert torch.equal(q[got], p[[1, 2, 3]])
    assert al.lookup(keys) == got  # registered under their keys
    assert fresh.restore(_keys(2, first=50), al, max_blocks=10) == [] and fresh.stats.misses == 1
    fresh.close()


def test_another_namespace_never_sees_the_blocks(tmp_path):
    disk = _store(tmp_path, _parts())
    keys = _keys(2)
    disk.submit([1, 2], keys)
    disk.flush()
    other = _store(tmp_path, _parts(), ns=b"m" * 16)
    assert other.restore(keys, BlockAllocator(8), 10) == []
    # A namespace changes with any part of the format or the model's content.
    fp = b"f" * 16
    assert kv_namespace(fp, dtype="bfloat16", block_size=16) != kv_namespace(fp, dtype="float32", block_size=16)
    assert kv_namespace(fp, dtype="bfloat16", block_size=16) != kv_namespace(fp, dtype="bfloat16", block_size=32)
    assert kv_namespace(fp, kv_dtype="auto") != kv_namespace(b"g" * 16, kv_dtype="auto")


def test_content_fingerprint_follows_content_not_mtime(tmp_path):
    a = tmp_path / "a.gguf"
    a.write_bytes(os.urandom(3 << 20))
    fp = content_fingerprint(a)
    os.utime(a, (1, 1))
    assert content_fingerprint(a) == fp
    assert content_fingerprint(a.rename(tmp_path / "copy.gguf")) == fp  # the path is not the content
    b = tmp_path / "copy.gguf"
    for where in (100, (3 << 20) * 8 // 17 + 100):  # the header; inside the 8th of the evenly spaced samples
        data = bytearray(b.read_bytes())
        data[where] ^= 1
        b.write_bytes(bytes(data))
        assert content_fingerprint(b) != fp
        data[where] ^= 1
        b.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["flip", "truncate", "header"])
def test_a_corrupt_file_is_deleted_and_never_trusted(tmp_path, damage):
    src = _parts()
    disk = _store(tmp_path, src)
    keys = _keys(3)
    disk.submit([1, 2, 3], keys)
    disk.flush()
    bad = disk.path_of(keys[1])
    data = bytearray(bad.read_bytes())
    if damage == "flip":
        data[-10] ^= 0x40
    elif damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data[20] ^= 1  # the namespace in the header
    bad.write_bytes(bytes(data))
    fresh = _store(tmp_path, [torch.zeros_like(p) for p in src])
    got = fresh.restore(keys, BlockAllocator(8), 10)
    assert len(got) == 1 and fresh.stats.corrupt == 1 and not bad.exists()


def test_lru_stays_within_the_size_and_keeps_pins(tmp_path):
    src = _parts(num_blocks=16)
    probe = _store(tmp_path / "probe", src)
    per_file = probe.file_bytes
    disk = _store(tmp_path, src, limit=3 * per_file + 10)
    keys = _keys(6)
    disk.submit([1], keys[:1])
    disk.flush()
    assert disk.pin("conversation.json", keys[:1]) == 1
    disk.submit(list(range(2, 7)), keys[1:])
    disk.flush()
    files = sorted(p.name for p in disk.dir.glob("*" + SUFFIX))
    assert disk.report().stats.bytes_on_disk <= disk.limit and len(files) == 3
    assert disk.path_of(keys[0]).exists()  # pinned: kept though oldest
    assert disk.path_of(keys[5]).exists() and disk.path_of(keys[4]).exists()  # the newest
    assert disk.stats.evicted == 3
    assert disk.pin("all.json", keys[4:6] + keys[:1]) == 3  # pins now fill the folder: new blocks are dropped
    disk.submit([7], _keys(1, first=80))
    disk.flush()
    assert disk.stats.dropped == 1 and disk.report().stats.bytes_on_disk <= disk.limit
    tiny = _store(tmp_path / "tiny", src, limit=per_file - 1)  # not even one block fits
    tiny.submit([1], keys[:1])
    tiny.flush()
    assert not list(tiny.dir.glob("*" + SUFFIX)) and tiny.stats.dropped == 1 and tiny.enabled


def test_a_full_write_queue_drops_blocks_instead_of_waiting(tmp_path):
    src = _parts()
    probe = _store(tmp_path / "probe", src)
    disk = KVDisk(tmp_path, 1 << 20, b"n" * 16, src, queue_bytes=2 * probe.block_bytes)
    keys = _keys(5)
    disk.submit([1, 2, 3, 4, 5], keys)  # room for two: three are dropped at once
    disk.flush()
    assert disk.stats.dropped == 3 and disk.stats.written == 2
    assert [disk.path_of(k).exists() for k in keys] == [True, True, False, False, False]


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EIO, errno.EROFS])
def test_a_failing_disk_turns_the_tier_off_with_one_line(tmp_path, monkeypatch, caplog, err):
    disk = _store(tmp_path, _parts())
    real = os.write

    def failing(fd, data):
        raise OSError(err, os.strerror(err))

    monkeypatch.setattr(os, "write", failing)
    with caplog.at_level(logging.WARNING, logger="llmsys.engine.kv_disk"):
        disk.submit([1, 2], _keys(2))
        disk.flush()
        disk.submit([3], _keys(1, first=40))  # off: nothing more is queued or logged
        disk.flush()
    monkeypatch.setattr(os, "write", real)
    assert not disk.enabled and errno.errorcode[err] in disk.failure
    lines = [r for r in caplog.records if r.name == "llmsys.engine.kv_disk"]
    assert len(lines) == 1 and "KV disk tier off" in lines[0].getMessage()
    assert not list(disk.dir.glob("*" + SUFFIX)) and not list(disk.dir.glob("*.tmp"))
    assert disk.restore(_keys(2), BlockAllocator(8), 10) == []


def test_kv_disk_size_flag():
    assert EngineConfig("m", kv_disk="1GiB").kv_disk == 1 << 30
    assert EngineConfig("m", kv_disk=None).kv_disk == 0 and EngineConfig("m").kv_disk == 0
    with pytest.raises(InvalidParameterError, match="--kv-disk"):
        EngineConfig("m", kv_disk="lots")


# -- the engine ----------------------------------------------------------------------------------
def _restart_pair(path: Path, folder: Path, prompt, dtype: str = "auto", **kw):
    """One engine computes ``prompt`` (writing its blocks), a second one, new, reads them back."""
    args = dict(dtype=dtype, progress=False, kv_cache_tokens=2048, kv_disk="256MiB", kv_disk_dir=str(folder), **kw)
    first = LLM(str(path), **args)
    a = first.generate([prompt], SP)[0]
    assert first.core.kv_disk.flush()
    second = LLM(str(path), **args)
    b = second.generate([prompt], SP)[0]
    return first, a, second, b


@pytest.mark.parametrize("dtype", ["auto", "float32"])
def test_a_new_engine_reads_the_prompt_back_with_identical_tokens_and_logprobs(tmp_path, dtype):
    path = need_shared(STORIES_HF)
    prompt = STORY * 2
    first, a, second, b = _restart_pair(path, tmp_path, prompt, dtype, block_size=4)
    n = len(second.encode(prompt))
    assert a.usage.cached_tokens == 0 and b.usage.cached_tokens == (n - 1) // 4 * 4
    assert _sig(a) == _sig(b)
    rep = second.core.memory_report().kv_disk
    assert rep.enabled and rep.stats.hits == (n - 1) // 4 and rep.stats.bytes_on_disk > 0
    # The prompt plus its answer plus a new turn: the answer's blocks were written too.
    follow = second.encode(prompt) + b.token_ids + second.encode(" The end.")
    second.core.kv_disk.flush()
    third = LLM(str(path), dtype=dtype, progress=False, kv_cache_tokens=2048, kv_disk="256MiB",
                kv_disk_dir=str(tmp_path), block_size=4)
    c = third.generate([follow], SP)[0]
    plain = LLM(str(path), dtype=dtype, progress=False, kv_cache_tokens=2048, block_size=4, prefix_caching=False)
    assert c.usage.cached_tokens >= len(second.encode(prompt)) + len(b.token_ids) - 4
    assert _sig(c) == _sig(plain.generate([follow], SP)[0])


def test_another_format_or_dtype_never_reuses_a_block(tmp_path):
    path = need_shared(STORIES_HF)
    _, a, _, _ = _restart_pair(path, tmp_path, STORY, "float32", block_size=4)
    for kw in (dict(dtype="bfloat16", block_size=4), dict(dtype="float32", block_size=8),
               dict(dtype="float32", block_size=4, kv_dtype="int8")):
        llm = LLM(str(path), progress=False, kv_cache_tokens=2048, kv_disk="256MiB", kv_disk_dir=str(tmp_path), **kw)
        assert llm.generate([STORY], SP)[0].usage.cached_tokens == 0, kw


def test_a_corrupt_block_and_a_full_disk_fall_back_to_computing(tmp_path, monkeypatch):
    path = need_shared(STORIES_HF)
    first, a, second, b = _restart_pair(path, tmp_path, STORY, block_size=4)
    keys: list[bytes] = []
    ids = second.encode(STORY)
    extend_keys(keys, ids, 4, (len(ids) - 1) // 4)
    victim = second.core.kv_disk.path_of(keys[3])
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x10
    victim.write_bytes(bytes(data))
    args = dict(progress=False, kv_cache_tokens=2048, kv_disk="256MiB", kv_disk_dir=str(tmp_path), block_size=4)
    third = LLM(str(path), **args)
    c = third.generate([STORY], SP)[0]
    assert c.usage.cached_tokens == 3 * 4 and _sig(c) == _sig(a)
    assert third.core.kv_disk.stats.corrupt == 1
    third.core.kv_disk.flush()  # the corrupt file was deleted; its block, computed again, written afresh
    assert victim.read_bytes() != bytes(data)
    assert LLM(str(path), **args).generate([STORY], SP)[0].usage.cached_tokens == b.usage.cached_tokens

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", full)
    fourth = LLM(str(path), **{**args, "kv_disk_dir": str(tmp_path / "other")})
    d = fourth.generate([STORY], SP)[0]
    fourth.core.kv_disk.flush()
    assert _sig(d) == _sig(a) and not fourth.core.kv_disk.enabled and "ENOSPC" in fourth.core.kv_disk.failure
    assert _sig(fourth.generate([STORY], SP)[0]) == _sig(a)  # the pool's prefix cache still serves


def test_a_read_only_folder_leaves_the_engine_as_it_was(tmp_path, monkeypatch):
    path = need_shared(STORIES_HF)
    ro = tmp_path / "ro"
    ro.mkdir()
    os.chmod(ro, 0o555)
    if os.access(ro, os.W_OK):  # root writes anywhere: make mkdir fail the way a read-only mount does
        real = Path.mkdir

        def read_only(self, *a, **k):
            if str(self).startswith(str(ro)):
                raise OSError(errno.EROFS, "Read-only file system")
            return real(self, *a, **k)

        monkeypatch.setattr(Path, "mkdir", read_only)
    llm = LLM(str(path), progress=False, kv_cache_tokens=2048, kv_disk="1GiB", kv_disk_dir=str(ro / "kv"), block_size=4)
    plain = LLM(str(path), progress=False, kv_cache_tokens=2048, block_size=4)
    assert not llm.core.kv_disk.enabled
    assert _sig(llm.generate([STORY], SP)[0]) == _sig(plain.generate([STORY], SP)[0])


def test_smollm2_gguf_restart_gives_the_same_tokens_and_logprobs(tmp_path):
    path = need_shared(SMOLLM2)
    prompt = "Write a short story about a cat who learns to sail. " * 12
    first, a, second, b = _restart_pair(path, tmp_path, prompt)
    n = len(second.encode(prompt))
    bs = second.core.kv.spec.block_size
    assert a.usage.cached_tokens == 0 and b.usage.cached_tokens == (n - 1) // bs * bs
    assert _sig(a) == _sig(b)


def test_a_restarted_server_reports_cached_tokens_and_disk_metrics(tmp_path):
    """Two servers one after the other on one folder: the second answers the same prompt plus a turn with
    the first one's blocks (``usage.prompt_tokens_details.cached_tokens``) and the same text; ``/metrics``
    counts the disk tier's bytes and hits."""
    import httpx

    from llmsys.engine.server.metrics import parse_metrics
    from llmsys.engine.server.serve import start_server_thread
    from llmsys.engine.server.state import ServerSettings, ServerState

    path = need_shared(STORIES_HF)
    body = {"model": "m", "prompt": STORY * 2, "max_tokens": 10, "temperature": 0}

    def serve_once(body: dict) -> tuple[dict, dict[str, float]]:
        llm = LLM(str(path), dtype="float32", progress=False, kv_disk="64MiB", kv_disk_dir=str(tmp_path))
        state = ServerState(ServerSettings())
        state.attach(llm, "m")
        srv = start_server_thread(state)
        try:
            r = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            llm.core.kv_disk.flush()
            time.sleep(0.2)  # the gauges follow the engine's step after the request's last
            return r.json(), parse_metrics(httpx.get(srv.url + "/metrics").text)
        finally:
            srv.stop()

    first, _ = serve_once(body)
    turn = dict(body, prompt=body["prompt"] + first["choices"][0]["text"] + " And then")
    again, m = serve_once(turn)
    plain = LLM(str(path), dtype="float32", progress=False, prefix_caching=False)
    ref = plain.generate([turn["prompt"]], SamplingParams(temperature=0, max_tokens=10))[0]
    cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert cached >= first["usage"]["prompt_tokens"] - 16  # the first exchange's blocks, read back
    assert again["choices"][0]["text"] == ref.text
    assert m["llmsys_kv_disk_bytes"] > 0 and m["llmsys_kv_disk_enabled"] == 1
    assert m["llmsys_kv_disk_hit_blocks_total"] == cached // 16


def test_chat_save_keeps_the_conversations_kv_and_load_reads_it_back(tmp_path):
    """/save pins the conversation's blocks (LRU keeps them); /load in a new process (a new engine here)
    continues from them: its next turn reads the saved turns' blocks back instead of computing them."""
    import io

    from llmsys.tui.repl import run_repl

    path = need_shared(SMOLLM2)
    kw = dict(progress=False, kv_cache_tokens=2048, kv_disk="256MiB", kv_disk_dir=str(tmp_path / "kv"))
    sp = SamplingParams(temperature=0, max_tokens=24)
    conv = tmp_path / "talk.json"
    llm = LLM(str(path), **kw)
    out = io.StringIO()
    run_repl(llm, sp, stdin=io.StringIO(f"{STORY} Tell me what happened next.\n/save {conv}\n"), stdout=out)
    note = next(line for line in out.getvalue().splitlines() if "its KV" in line)
    kept, total = (int(w) for w in note.split("its KV: ")[1].split(" blocks")[0].split(" of "))
    assert total > 3 and kept == total
    pins = list((tmp_path / "kv" / "pins").glob("*.json"))
    assert len(pins) == 1 and str(conv) in pins[0].read_text()
    again = LLM(str(path), **kw)
    run_repl(again, sp, stdin=io.StringIO(f"/load {conv}\nAnd then?\n"), stdout=io.StringIO())
    assert again.core.kv_disk.stats.hits >= total - 1


def test_an_int8_pool_round_trips_and_int4_or_quest_keep_the_tier_off(tmp_path):
    path = need_shared(STORIES_HF)
    _, a, second, b = _restart_pair(path, tmp_path, STORY, "float32", block_size=4, kv_dtype="int8")
    assert b.usage.cached_tokens == (len(second.encode(STORY)) - 1) // 4 * 4 and _sig(a) == _sig(b)
    for kw in (dict(kv_dtype="int4"), dict(kv_policy="quest:4")):
        llm = LLM(str(path), progress=False, kv_disk="64MiB", kv_disk_dir=str(tmp_path), **kw)
        assert llm.core.kv_disk is None, kw
