"""Dispatchers read the tuned store when built without a config: the bucket they look up, the ranks agreeing on
it (a chunk count that differs between ranks mismatches the collectives), ranks that see different stores, the
knobs never taken from the store, and the explicit config winning."""

import pytest
import torch

from pdlab.kernels import tuned
from pdlab.moe.dispatch import create_dispatcher
from pdlab.moe.dispatch.selftest import dispatch_cases, global_tokens
from pdlab.moe.dispatch.spawn import run_ranks
from pdlab.tuning import store

H, E, K = 256, 12, 4
META = {"device": "cpu", "device_key": "cpu", "arch": "cpu"}


# the process group of a multi-rank test: gloo on CPU here, NCCL on two GPUs (the ranks read cuda:rank's store)
RANK_BACKENDS = ["gloo", pytest.param("nccl", marks=pytest.mark.multigpu)]


def _write(root, backend: str, entries: list[tuple[dict, dict]], device="cpu") -> None:
    """Store `entries` ((bucket overrides, config) pairs) for moe_dispatch[backend] of `device` under `root`."""
    results = {}
    for over, cfg in entries:
        bucket = {"tokens_per_rank": 16, "ranks": 1, "mode": "normal", "payload": "bf16", "hidden": H, "experts": E,
                  "top_k": K, **over}
        results.update(store.merge_bucket(bucket, {backend: store.backend_result(cfg, 1.0, 2.0)}))
    name, key, arch = tuned.device_identity(device)
    meta = {**META, "device": name, "device_key": key, "arch": arch, "versions": tuned.running_versions(["torch"])}
    store.write_results(root, key, "moe_dispatch", meta, results)


def _store_device(rank_backend: str):
    return torch.device("cuda", 0) if rank_backend == "nccl" else "cpu"


@pytest.fixture
def config_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(tuned.CONFIG_DIR_ENV, str(tmp_path))
    tuned.clear_cache()
    yield tmp_path
    tuned.clear_cache()


def _roundtrip(d, T, mode="normal", payload="bf16", seed=0):
    x, ids, w = global_tokens(seed, 1, T, H, E, K)
    layout, handle = d.dispatch(x, ids, w, payload, mode=mode)
    out = d.combine(layout, handle)
    # identity experts: combine(dispatch(x)) = x · Σ w
    torch.testing.assert_close(out, x * w.sum(1, keepdim=True), rtol=1e-5, atol=1e-5)
    return handle


def test_local_dispatcher_runs_the_nearest_tuned_config_per_call(config_dir):
    _write(config_dir, "local", [({"tokens_per_rank": 16}, {"reduce_impl": "torch", "chunk_rows": 2048}),
                                 ({"tokens_per_rank": 512}, {"reduce_impl": "torch", "chunk_rows": 8192}),
                                 ({"tokens_per_rank": 16, "mode": "low_latency"}, {"chunk_rows": 4096})])
    d = create_dispatcher("local", E, H)
    assert d.reads_store and "tuned per call" in d.describe()
    small, big = _roundtrip(d, 8), _roundtrip(d, 600)
    assert small.config["chunk_rows"] == 2048 and big.config["chunk_rows"] == 8192
    assert small.config_source == big.config_source == "tuned:" + str(config_dir / "cpu" / "moe_dispatch.json")
    # low-latency calls look up their own mode's entries; another payload has no entry: the default
    ll = _roundtrip(d, 4, mode="low_latency")
    assert ll.config_source.startswith("tuned:") and ll.config["reduce_impl"] == "auto"
    x, ids, w = global_tokens(0, 1, 8, H, E, K)
    layout, handle = d.dispatch(x, ids, w, "fp8")
    assert handle.config_source == "default" and handle.config == d.config


def test_an_explicit_config_wins_over_the_store(config_dir):
    _write(config_dir, "local", [({}, {"chunk_rows": 2048})])
    d = create_dispatcher("local", E, H, config={"chunk_rows": 8192})
    assert not d.reads_store
    h = _roundtrip(d, 8)
    assert h.config["chunk_rows"] == 8192 and h.config_source == "explicit"


def test_the_lookup_asks_for_the_keys_tune_dispatch_stores(config_dir):
    import dataclasses

    from pdlab.tuning.dispatch import dispatch_buckets
    from pdlab.tuning.models import load_model_shape

    d = create_dispatcher("local", E, H)
    with tuned.observe() as seen:
        _roundtrip(d, 8)
    (op, backend, bucket), = seen
    model = dataclasses.replace(load_model_shape("deepseek-r1"), hidden_size=H, n_routed_experts=E,
                                num_experts_per_tok=K)
    stored = dispatch_buckets(model)[0]
    assert (op, backend) == ("moe_dispatch", "local") and set(bucket) == set(stored)
    assert bucket == {"tokens_per_rank": 8, "ranks": 1, "mode": "normal", "payload": "bf16", "hidden": H,
                      "experts": E, "top_k": K}


@pytest.mark.parametrize("rank_backend", RANK_BACKENDS)
def test_nccl_ranks_with_different_token_counts_agree_on_the_tuned_chunk_count(config_dir, rank_backend):
    # 8 tokens on rank 0 and 400 on rank 1: keyed by each rank's own count the ranks would pick 1 and 4 chunks and
    # their collectives would not match; both key by the largest count (400 → the 512 entry: 4 chunks)
    _write(config_dir, "nccl", [({"tokens_per_rank": 16, "ranks": 2}, {"num_chunks": 1}),
                                ({"tokens_per_rank": 512, "ranks": 2}, {"num_chunks": 4, "chunk_rows": 2048})],
           device=_store_device(rank_backend))
    cases = [dict(seed=4, mode="normal", payload=p, tokens_per_rank=8, hidden=H, num_experts=E, top_k=K,
                  rank_tokens=[8, 400]) for p in ("bf16", "nvfp4")]
    results = run_ranks(dispatch_cases, 2, kwargs={"cases": cases}, backend=rank_backend, timeout_s=120,
                        env={tuned.CONFIG_DIR_ENV: str(config_dir)})
    x, ids, w = global_tokens(4, 1, 408, H, E, K)
    ref = x * w.sum(1, keepdim=True)
    bf16 = torch.cat([results[r][0]["out"] for r in range(2)]).float()
    torch.testing.assert_close(bf16, ref, rtol=2e-2, atol=2e-2 * float(ref.abs().max()))
    for r in range(2):
        assert results[r][0]["config"]["num_chunks"] == 4 and results[r][0]["config"]["chunk_rows"] == 2048
        assert results[r][0]["config_source"].startswith("tuned:")
        # nvfp4 has no entry at all: the default on both ranks
        assert results[r][1]["config_source"] == "default" and results[r][1]["config"]["num_chunks"] == 1


@pytest.mark.parametrize("rank_backend", RANK_BACKENDS)
def test_an_explicit_chunk_count_above_a_ranks_token_count_still_matches_the_other_rank(rank_backend):
    # rank 0 has 2 tokens, rank 1 has 10, num_chunks=4: chunk counts bounded by each rank's own count (2 vs 4)
    # mismatched the exchanges; both now run 4 chunks (rank 0's empty ones included)
    cases = [dict(seed=3, mode="normal", payload="bf16", tokens_per_rank=5, hidden=H, num_experts=E, top_k=K,
                  rank_tokens=[2, 10], config={"num_chunks": 4})]
    results = run_ranks(dispatch_cases, 2, kwargs={"cases": cases}, backend=rank_backend, timeout_s=120)
    x, ids, w = global_tokens(3, 1, 12, H, E, K)
    ref = x * w.sum(1, keepdim=True)
    out = torch.cat([results[r][0]["out"] for r in range(2)]).float()
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2 * float(ref.abs().max()))
    assert all(results[r][0]["config_source"] == "explicit" for r in range(2))


def test_ranks_that_see_different_stores_all_run_the_default(tmp_path):
    # rank 0 has a tuned file that says 4 chunks, rank 1 has none: neither may use it
    one, other = tmp_path / "a", tmp_path / "b"
    other.mkdir()
    _write(one, "nccl", [({"tokens_per_rank": 16, "ranks": 2}, {"num_chunks": 4})])
    cases = [dict(seed=5, mode="normal", payload="bf16", tokens_per_rank=16, hidden=H, num_experts=E, top_k=K,
                  config_dirs=[str(one), str(other)])]
    results = run_ranks(dispatch_cases, 2, kwargs={"cases": cases}, backend="gloo", timeout_s=120)
    for r in range(2):
        assert results[r][0]["config_source"] == "default" and results[r][0]["config"]["num_chunks"] == 1
    x, ids, w = global_tokens(5, 1, 32, H, E, K)
    ref = x * w.sum(1, keepdim=True)
    out = torch.cat([results[r][0]["out"] for r in range(2)]).float()
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2 * float(ref.abs().max()))


def test_the_low_latency_exchange_is_never_taken_from_the_store(config_dir):
    # a store (an older tune run) saying "counts" would make decode sync the host and break its CUDA graph
    _write(config_dir, "nccl", [({"tokens_per_rank": 6, "ranks": 2, "mode": "low_latency"},
                                 {"ll_exchange": "counts", "chunk_rows": 2048})])
    cases = [dict(seed=6, mode="low_latency", payload="bf16", tokens_per_rank=6, hidden=H, num_experts=E, top_k=K)]
    results = run_ranks(dispatch_cases, 2, kwargs={"cases": cases}, backend="gloo", timeout_s=120,
                        env={tuned.CONFIG_DIR_ENV: str(config_dir)})
    for r in range(2):
        res = results[r][0]
        assert res["config"]["ll_exchange"] == "fixed" and res["config"]["chunk_rows"] == 2048
        row = ((8 * K + 2 * H) + 15) // 16 * 16
        assert res["bytes_sent"] == 6 * row  # the fixed exchange: the whole buffer to the peer


def test_the_store_fingerprint_follows_the_files(config_dir):
    before = tuned.store_fingerprint("moe_dispatch", "cpu")
    assert before == tuned.store_fingerprint("moe_dispatch", "cpu")
    _write(config_dir, "local", [({}, {"chunk_rows": 2048})])
    assert tuned.store_fingerprint("moe_dispatch", "cpu") != before
    assert tuned.store_fingerprint("mla_decode", "cpu") != tuned.store_fingerprint("moe_dispatch", "cpu")
