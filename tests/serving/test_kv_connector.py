"""The KV connector tier under the device prefix cache (``kv_transfer_config``), on the local
connector: units and images round-trip byte for byte, a prefix evicted from the device comes
back from the tier with the tokens of a run that never lost it, and a missing, corrupt or
foreign entry falls back to recomputation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from v41plan.geometry.resolve import resolve_spec
from v41plan.runtime.kv_connector import ConnectorError, LocalConnector, checksum
from v41plan.serving.admission import ConfigError
from v41plan.serving.block_manager import chain_hashes
from v41plan.serving.engine import LLM
from v41plan.serving.sampling import SamplingParams

TINY = resolve_spec("tiny")
GEOM = TINY.geometry("bf16", "fp8")
GREEDY = SamplingParams(max_tokens=4, temperature=0.0)


def _opts(transfer: str, **kw) -> dict:
    o = {
        "num_pages": 24,
        "max_num_seqs": 2,
        "max_model_len": 512,
        "dtype": "float64",
        "max_num_batched_tokens": 64,  # chunked: the copy transfer keeps images at chunk ends
        "encoder_swa_bounded_replay": transfer == "replay",
    }
    o.update(kw)
    return o


def _prompts(n_other: int, page: int):
    g = torch.Generator().manual_seed(0)
    shared = torch.randint(0, 250, (page * 6,), generator=g).tolist() + [1, 2, 3]
    others = [torch.randint(0, 250, (page * 6 + 1,), generator=g).tolist() for _ in range(n_other)]
    return shared, others


def _local(**kw) -> LocalConnector:
    return LocalConnector(GEOM.layout_id, GEOM.page_unit_bytes, GEOM.units_per_image, **kw)


# --- the local tier alone --------------------------------------------------------------------


def test_local_tier_round_trip_and_lookup(tmp_path):
    c = _local(path=str(tmp_path))
    keys = [bytes([i]) * 32 for i in range(4)]
    data = np.random.default_rng(0).integers(0, 256, (4, GEOM.page_unit_bytes), dtype=np.uint8)
    c.save_units(keys[:3], [], data[:3])
    assert c.lookup([], keys) == 3
    assert c.lookup([], keys, 1) == 2
    h = c.prefetch([], keys, 1, 2, None)
    assert h.done and h.failed is None and np.array_equal(h.units, data[1:3])
    img = data[:2] if GEOM.units_per_image == 2 else data[: GEOM.units_per_image]
    c.save_image(keys[2], [], img)
    assert c.has_image([], keys[2]) and not c.has_image([], keys[1])
    assert np.array_equal(c.prefetch([], keys, 0, 0, 2).image, img)
    # the disk copy serves a fresh process (another instance on the same directory)
    d = _local(path=str(tmp_path))
    assert d.lookup([], keys) == 3 and np.array_equal(
        d.prefetch([], keys, 0, 3, None).units, data[:3]
    )


def test_local_tier_refuses_corrupt_foreign_and_missing_entries(tmp_path):
    c = _local(path=str(tmp_path))
    keys = [bytes([i]) * 32 for i in range(2)]
    data = np.arange(2 * GEOM.page_unit_bytes, dtype=np.int64).astype(np.uint8).reshape(2, -1)
    c.save_units(keys, [], data)
    key = c._key("unit", keys[1])
    layout, digest, stored = c._mem[key]
    bad = stored.copy()
    bad[0, 5] ^= 1
    c._mem[key] = (layout, digest, bad)
    h = c.prefetch([], keys, 0, 2, None)
    assert h.failed == "checksum or size mismatch" and h.units is None
    c._mem[key] = ("another-layout", checksum(stored), stored)
    assert "foreign layout another-layout" in c.prefetch([], keys, 0, 2, None).failed
    assert c.prefetch([], keys + [b"x" * 32], 2, 1, None).failed == "missing"
    assert c.stats.failed_retrieves == 3


def test_local_tier_memory_bound_evicts_oldest():
    c = _local(bytes=3 * GEOM.page_unit_bytes)
    keys = [bytes([i]) * 32 for i in range(5)]
    c.save_units(keys, [], np.zeros((5, GEOM.page_unit_bytes), np.uint8))
    assert c.stats.evicted == 2 and c.lookup([], keys) == 0 and c.lookup([], keys, 2) == 3


def test_bad_connector_options_are_refused_before_load(tmp_path):
    cases = [
        ({"kv_connector": "nixl"}, "accepted kv_connector: lmcache_mp, local"),
        ({"kv_connector": "local", "size": 3}, "local takes kv_connector, bytes, path"),
        ({"kv_connector": "local", "bytes": "1G"}, "expects int"),
        ({"kv_connector": "local", "bytes": 0}, "must be positive"),
        ({"kv_connector": "lmcache_mp", "port": True}, "expects int"),
    ]
    for config, message in cases:
        with pytest.raises(ConfigError, match=message):
            LLM(TINY, runner_factory=lambda *a: pytest.fail("loaded"), kv_transfer_config=config)
    with pytest.raises(ConfigError, match="lmcache_mp serves world size 1"):
        LLM(TINY, runner_factory=lambda *a: pytest.fail("loaded"), world_size=2,
            kv_transfer_config={"kv_connector": "lmcache_mp"})  # fmt: skip
    with pytest.raises(ConnectorError):
        _local(bytes=-1)


# --- the engine with the tier ----------------------------------------------------------------


@pytest.mark.parametrize("transfer", ["copy", "replay"])
def test_prefix_evicted_from_the_device_comes_back_from_the_tier(transfer):
    """Store -> evict from the device -> hit in the tier -> the tokens of a run whose device
    cache still held the prefix (copy: also the cold run's, exactly), and the retrieved units
    hold the bytes that were saved."""
    opts = _opts(transfer)
    ref = LLM(TINY, **opts)
    page = ref.page_tokens
    shared, others = _prompts(3, page)
    cold = ref.generate([shared], GREEDY)[0]
    warm = ref.generate([shared], GREEDY)[0]  # resumes from the device hit
    assert warm.stats["hits"][-1] == 6 * page

    llm = LLM(TINY, kv_transfer_config={"kv_connector": "local", "bytes": 1 << 28}, **opts)
    first = llm.generate([shared], GREEDY)[0]
    saved = {}
    pools = llm.runner.model.pools
    for o in others:  # turn the device pool over
        llm.generate([o], GREEDY)
    bm = llm.block_manager
    keys = chain_hashes(shared, page, 6)
    assert len(bm.lookup(keys)) < 6, "the scenario must evict part of the prefix"
    for k in keys:
        entry = llm.connector._get(llm.connector._key("unit", k))
        saved[k] = entry[2]
    again = llm.generate([shared], GREEDY)[0]
    assert again.stats["hits"][-1] == 6 * page
    assert llm.runner.stats["kv_loaded_units"] > 0
    table = [bm.hash_to_page[k] for k in keys]
    got = pools.read_units(table)
    for i, k in enumerate(keys):
        assert np.array_equal(got[i], saved[k][0]), f"block {i} differs from what was saved"
    assert first.outputs[0].token_ids == cold.outputs[0].token_ids
    assert again.outputs[0].token_ids == warm.outputs[0].token_ids
    if transfer == "copy":
        assert again.outputs[0].token_ids == cold.outputs[0].token_ids
        assert llm.connector.stats.loaded_images >= 1


@pytest.mark.parametrize("transfer", ["copy"])  # the recompute path is the transfer's own
def test_a_corrupt_tier_entry_recomputes(transfer):
    opts = _opts(transfer)
    page = LLM(TINY, runner_factory=lambda *a: None, **opts).page_tokens
    shared, others = _prompts(3, page)
    cold = LLM(TINY, **opts).generate([shared], GREEDY)[0]
    llm = LLM(TINY, kv_transfer_config={"kv_connector": "local"}, **opts)
    llm.generate([shared], GREEDY)
    for o in others:
        llm.generate([o], GREEDY)
    conn = llm.connector
    for key, (layout, digest, data) in list(conn._mem.items()):
        bad = data.copy()
        bad[..., 0] ^= 0xFF
        conn._mem[key] = (layout, digest, bad)
    loaded_before = llm.runner.stats["kv_loaded_units"]
    again = llm.generate([shared], GREEDY)[0]
    assert conn.stats.failed_retrieves >= 1
    assert llm.runner.stats["kv_loaded_units"] == loaded_before
    if transfer == "copy":  # recomputed from the device hit's image or from 0: exact
        assert again.outputs[0].token_ids == cold.outputs[0].token_ids
    assert again.finished and again.error is None


# --- a real LMCache MP server ----------------------------------------------------------------


def _has_lmcache() -> bool:
    import importlib.util

    return importlib.util.find_spec("lmcache") is not None


needs_lmcache = pytest.mark.skipif(
    not _has_lmcache(), reason="the optional lmcache client is not installed (pip install lmcache)"
)


@pytest.fixture(scope="module")
def lmcache_server():
    from v41plan.runtime.kv_lmcache import lmcache_server

    with lmcache_server(GEOM.page_tokens, l1_gb=0.25) as server:
        yield server


@needs_lmcache
@pytest.mark.parametrize("transfer", ["copy"])  # replay over a tier: the local-tier test
def test_lmcache_tier_gives_back_the_evicted_prefix(lmcache_server, transfer):
    """The local-tier scenario on a real LMCache MP server: every retrieved plane byte-equal to
    what was saved, tokens as from a device hit (copy: the cold run's)."""
    host, port, _proc = lmcache_server
    opts = _opts(transfer)
    ref = LLM(TINY, **opts)
    page = ref.page_tokens
    shared, others = _prompts(3, page)
    shared = shared[:-3] + [9, 8, 7 + (transfer == "copy")]  # each case its own suffix
    cold = ref.generate([shared], GREEDY)[0]
    warm = ref.generate([shared], GREEDY)[0]
    # staging for 8 units: every store and retrieve of the 6-block prefix runs in pieces
    staging = 8 * (GEOM.page_unit_bytes + 32)
    tier = {"kv_connector": "lmcache_mp", "host": host, "port": port, "staging_bytes": staging}
    llm = LLM(TINY, kv_transfer_config=tier, **opts)
    try:
        llm.generate([shared], GREEDY)
        keys = chain_hashes(shared, page, 6)
        bm, pools = llm.block_manager, llm.runner.model.pools
        saved = pools.read_units([bm.hash_to_page[k] for k in keys])
        for o in others:
            llm.generate([o], GREEDY)
        assert len(bm.lookup(keys)) < 6
        again = llm.generate([shared], GREEDY)[0]
        assert again.stats["hits"][-1] == 6 * page, again.stats
        got = pools.read_units([bm.hash_to_page[k] for k in keys])
        assert np.array_equal(got, saved), "a retrieved plane differs from what was saved"
        assert llm.connector.stats.loaded_units > 0 and llm.connector.max_retrieve < 6
        assert again.outputs[0].token_ids == warm.outputs[0].token_ids
        if transfer == "copy":
            assert llm.connector.stats.loaded_images >= 1
            assert again.outputs[0].token_ids == cold.outputs[0].token_ids
    finally:
        llm.connector.close()


@needs_lmcache
def test_lmcache_server_down_at_start_and_killed_mid_run(tmp_path):
    from v41plan.runtime.kv_lmcache import lmcache_server

    opts = _opts("copy")
    dead = {"kv_connector": "lmcache_mp", "port": 1, "timeout_s": 1.0}
    with pytest.raises(ConfigError, match="no LMCache server answered"):
        LLM(TINY, runner_factory=lambda *a: pytest.fail("loaded"), kv_transfer_config=dead,
            **opts)  # fmt: skip
    llm = LLM(TINY, kv_transfer_config=dict(dead, required=False), **opts)
    assert llm.connector is None  # ran without offload, and said so
    page = llm.page_tokens
    shared, others = _prompts(3, page)
    cold = llm.generate([shared], GREEDY)[0]
    with lmcache_server(page, l1_gb=0.25) as (host, port, proc):
        tier = {"kv_connector": "lmcache_mp", "host": host, "port": port, "timeout_s": 1.0}
        llm = LLM(TINY, kv_transfer_config=tier, **opts)
        llm.generate([shared], GREEDY)
        for o in others:
            llm.generate([o], GREEDY)
        proc.kill()
        proc.wait(10)
        again = llm.generate([shared], GREEDY)[0]  # recomputes: nothing hangs
        after = llm.generate([others[0]], GREEDY)[0]  # saves while the server is gone
        llm.connector.close()
    assert again.outputs[0].token_ids == cold.outputs[0].token_ids
    assert after.finished and after.error is None
    assert llm.connector.stats.loaded_units == 0
