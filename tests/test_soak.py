"""A short soak: 200 mixed requests (streamed, non-streamed, left mid-stream, invalid)
leave the server as they found it: every KV block back, no open files gained, RSS within
50 MB. The KV pool's pages are taken as blocks are first written (and kept, holding the
prefix cache), so the server's pool here is 32 MiB: what RSS then measures is everything
else the server holds. `tokenworks bench soak` is the long version (10,000 requests by
default), with a record."""

from __future__ import annotations

from conftest import start_server

from tokenworks.bench.soak import soak

MB = 1_000_000


def test_200_mixed_requests_leave_nothing_behind(smol_loaded):
    srv = start_server(
        smol_loaded, dtype="bfloat16", max_num_seqs=16, max_model_len=512, kv_cache_memory=1 / 32
    )
    try:
        engine = srv.engine
        soak(srv.url, "smollm2-135m", requests=60, concurrency=8, seed=1, progress=False)
        free_before = engine.blocks.num_free
        result = soak(
            srv.url, "smollm2-135m", requests=200, concurrency=8, progress=False, engine=engine
        )
    finally:
        srv.stop()
    statuses = result.by_status
    assert set(statuses) <= {"200", "400"}, statuses
    assert statuses["400"] == result.by_kind["invalid"]
    assert engine.blocks.num_free == free_before == engine.blocks.num_blocks
    assert not engine.requests and not engine.scheduler.has_unfinished()
    engine.blocks.check()
    s = result.summary()
    assert s["kv_usage_end"] == 0
    assert s["open_files_end"] <= s["open_files_start"]
    assert s["rss_growth_bytes"] < 50 * MB, s
    assert s["rss_growth_beyond_kv_bytes"] < 50 * MB, s
