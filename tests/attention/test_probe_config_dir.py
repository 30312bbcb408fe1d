"""The attention ops' cached tuned lookups follow PDLAB_CONFIG_DIR: a process that points it at another store
gets that store's config and winning backend (as kernels.tuned's own cache does), without clear_config_cache()."""

import json

import torch

from pdlab.attention import mla_decode, ops
from pdlab.attention.workloads import decode_problem
from pdlab.kernels import registry, tuned

BUCKET = {"batch": 2, "heads": 4, "kv_dtype": "fp32", "q_len": 1, "seqlen": 32}


def _store(root, winner, block_n):
    """A tuned mla_decode store for this machine (device "cpu"): triton's BLOCK_N and the bucket's winner."""
    entry = {"bucket": BUCKET, "backend": winner,
             "backends": {"triton": {"config": {"BLOCK_N": block_n, "num_stages": 1}, "time_ms": 1.0}}}
    (root / "cpu").mkdir(parents=True)
    (root / "cpu" / "mla_decode.json").write_text(json.dumps(
        {"format": tuned.FORMAT_VERSION, "metadata": {"device": "cpu", "versions": {}},
         "entries": {tuned.bucket_label(BUCKET): entry}}))
    return root


def test_a_changed_config_dir_is_followed_within_one_process(tmp_path, monkeypatch):
    first, second = _store(tmp_path / "a", "torch", 16), _store(tmp_path / "b", "triton", 32)
    tri = registry.get_backend("mla_decode", "triton")
    cpu = torch.device("cpu")
    p = decode_problem([10, 30], heads=4, page=16, dtype=torch.float32, poison=False, seed=4)
    chosen_under = []  # the store each automatic backend choice was made under (triton is not usable on a CPU)
    real_auto_select = ops._auto_select

    def auto_select(*args):
        chosen_under.append(tuned.config_roots()[0])
        return real_auto_select(*args)

    monkeypatch.setattr(ops, "_auto_select", auto_select)
    tuned.clear_cache()
    ops.clear_config_cache()
    try:
        monkeypatch.setenv(tuned.CONFIG_DIR_ENV, str(first))
        cfg, src = ops.resolve_config("mla_decode", tri, BUCKET, cpu)
        assert cfg["BLOCK_N"] == 16 and str(first) in src
        assert ops._tuned_backend("mla_decode", BUCKET, cpu) == "torch"
        assert ops._select(ops.MLA_DECODE, None, p.q, p.kv_cache, 1, BUCKET).name == "torch"
        ops._select(ops.MLA_DECODE, None, p.q, p.kv_cache, 1, BUCKET)
        assert chosen_under == [first]  # chosen once under this store

        monkeypatch.setenv(tuned.CONFIG_DIR_ENV, str(second))
        cfg, src = ops.resolve_config("mla_decode", tri, BUCKET, cpu)
        assert cfg["BLOCK_N"] == 32 and str(second) in src, src
        assert ops._tuned_backend("mla_decode", BUCKET, cpu) == "triton"
        # the triton winner does not run on CPU tensors: the fallback, but chosen again
        assert ops._select(ops.MLA_DECODE, None, p.q, p.kv_cache, 1, BUCKET).name == "torch"
        assert chosen_under == [first, second]  # chosen again under the new one
        out, _ = mla_decode(p.q, p.kv_cache, p.block_table, p.seqlens, 0.1)  # the call itself runs
        assert out.shape == (2, 1, 4, 512)

        monkeypatch.delenv(tuned.CONFIG_DIR_ENV)  # back to the shipped store only: no tuned cpu entry
        cfg, src = ops.resolve_config("mla_decode", tri, BUCKET, cpu)
        assert src == "default" and cfg == tri.config()
    finally:
        tuned.clear_cache()
        ops.clear_config_cache()


def test_tuned_clear_cache_also_forgets_the_attention_ops_lookups(tmp_path, monkeypatch):
    # a store file rewritten in place (same folder): kernels.tuned.clear_cache() is the documented way to pick it up
    root = _store(tmp_path / "a", "torch", 16)
    tri = registry.get_backend("mla_decode", "triton")
    cpu = torch.device("cpu")
    monkeypatch.setenv(tuned.CONFIG_DIR_ENV, str(root))
    tuned.clear_cache()
    try:
        assert ops.resolve_config("mla_decode", tri, BUCKET, cpu)[0]["BLOCK_N"] == 16
        (root / "cpu" / "mla_decode.json").unlink()
        (root / "cpu").rmdir()
        _store(root, "triton", 32)
        tuned.clear_cache()
        assert ops.resolve_config("mla_decode", tri, BUCKET, cpu)[0]["BLOCK_N"] == 32
        assert ops._tuned_backend("mla_decode", BUCKET, cpu) == "triton"
    finally:
        tuned.clear_cache()
