"""resolve_config: explicit > tuned (nearest bucket, user folder over shipped) > default; metadata rule."""

import functools
import json
import logging
import math

import pytest

from pdlab.kernels import tuned
from pdlab.tuning import store

resolve = functools.partial(tuned.resolve_config, device="cpu")  # files here are written for the CPU


def _write(root, buckets_cfgs, device="cpu", versions=None, op="toy_matmul", backend="blocked"):
    meta = {"device": device, "device_key": "cpu", "arch": "cpu",
            "versions": versions if versions is not None else tuned.running_versions(["torch"])}
    results = {}
    for bucket, cfg in buckets_cfgs:
        results.update(store.merge_bucket(bucket, {backend: store.backend_result(cfg, 1.0, 2.0)}))
    return store.write_results(root, "cpu", op, meta, results)


def test_space_declared_in_registry(toy):
    from pdlab.kernels import registry
    from pdlab.tuning.target import space_size

    b = registry.get_backend("toy_matmul", "blocked")
    assert space_size(b.config_space) == 8 and b.default_config == {"BLOCK_K": 4, "skip_last": False}
    assert space_size(registry.get_backend("toy_matmul", "wide").config_space) == 84
    assert space_size({}) == 1
    target = toy.register()
    assert [b.name for b in target.backends("cpu")] == ["blocked", "wide", "torch"]
    assert [b.name for b in target.backends("sm100")] == ["blocked", "torch", "sm100only"]  # cuda runs on sm100
    assert target.reference_backend().name == "torch"


def test_explicit_wins_and_unknown_keys_rejected(toy, isolated):
    _write(isolated / "configs", [({"m": 16, "k": 256, "dtype": "fp32"}, {"BLOCK_K": 128, "skip_last": False})])
    cfg, src = resolve("toy_matmul", "blocked", {"m": 16, "k": 256, "dtype": "fp32"},
                                    explicit={"BLOCK_K": 32})
    assert (cfg, src) == ({"BLOCK_K": 32, "skip_last": False}, "explicit")
    with pytest.raises(ValueError, match="unknown config keys"):
        resolve("toy_matmul", "blocked", {"m": 16}, explicit={"BLOCK_Q": 1})


def test_nearest_bucket_and_out_of_range(toy, isolated):
    root = isolated / "configs"
    _write(root, [({"m": 16, "k": 256, "dtype": "fp32"}, {"BLOCK_K": 8, "skip_last": False}),
                  ({"m": 256, "k": 256, "dtype": "fp32"}, {"BLOCK_K": 32, "skip_last": False}),
                  ({"m": 16, "k": 256, "dtype": "bf16"}, {"BLOCK_K": 128, "skip_last": False})])

    def look(m, dtype="fp32", k=256):
        cfg, src = resolve("toy_matmul", "blocked", {"m": m, "k": k, "dtype": dtype})
        return cfg["BLOCK_K"], src

    assert look(16) == (8, "tuned:" + str(root / "cpu" / "toy_matmul.json"))
    assert look(32)[0] == 8  # log2 distance 1 vs 3
    assert look(128)[0] == 32  # 3 vs 1
    assert look(64)[0] == 32  # 2 vs 2: tie goes to the larger bucket
    assert look(1)[0] == 8  # below the range: nearest edge
    assert look(1 << 20)[0] == 32  # above the range: nearest edge
    assert look(4096, dtype="bf16")[0] == 128  # non-numeric keys must match exactly
    assert look(16, dtype="fp8") == (4, "default")  # no comparable bucket: backend default
    cfg, src = resolve("toy_matmul", "blocked", {"m": 16, "k": 256})  # other key set
    assert src == "default"
    assert tuned.bucket_distance({"a": 4, "b": "x"}, {"a": 16, "b": "x"}) == 2
    assert math.isinf(tuned.bucket_distance({"a": 4, "b": "x"}, {"a": 4, "b": "y"}))
    assert tuned.resolve_backend("toy_matmul", {"m": 20, "k": 256, "dtype": "fp32"}, device="cpu") == "blocked"


def test_user_folder_overrides_shipped(toy, isolated, monkeypatch):
    shipped = isolated / "shipped"
    _write(shipped, [({"m": 16, "k": 256, "dtype": "fp32"}, {"BLOCK_K": 32, "skip_last": False})])
    monkeypatch.setattr(tuned, "SHIPPED_DIR", shipped)
    bucket = {"m": 16, "k": 256, "dtype": "fp32"}
    assert resolve("toy_matmul", "blocked", bucket) == (
        {"BLOCK_K": 32, "skip_last": False}, "tuned:cpu/toy_matmul.json")
    _write(isolated / "configs", [({"m": 16, "k": 256, "dtype": "fp32"}, {"BLOCK_K": 128, "skip_last": False})])
    tuned.clear_cache()
    cfg, src = resolve("toy_matmul", "blocked", bucket)
    assert cfg["BLOCK_K"] == 128 and src.startswith("tuned:" + str(isolated / "configs"))


def test_no_entry_default_logged_once(toy, isolated, caplog):
    caplog.set_level(logging.INFO, logger="pdlab.tuned")
    for m in (1, 2, 3):
        cfg, src = resolve("toy_matmul", "blocked", {"m": m, "k": 256, "dtype": "fp32"})
        assert (cfg, src) == ({"BLOCK_K": 4, "skip_last": False}, "default")
    msgs = [r for r in caplog.records if "no tuned config for toy_matmul[blocked]" in r.getMessage()]
    assert len(msgs) == 1


def test_summary_names_the_file_and_leaves_the_once_log_alone(toy, isolated, caplog):
    # the start-up report says whether a tuned file covers the op without a shape-less lookup, so the first
    # real miss is still logged
    assert tuned.tuned_summary("toy_matmul", "blocked", "cpu") is None
    _write(isolated / "configs", [({"m": 16, "k": 256, "dtype": "fp32"}, {"BLOCK_K": 8, "skip_last": False}),
                                  ({"m": 64, "k": 256, "dtype": "fp32"}, {"BLOCK_K": 32, "skip_last": False})])
    tuned.clear_cache()
    caplog.set_level(logging.INFO, logger="pdlab.tuned")
    summary = tuned.tuned_summary("toy_matmul", "blocked", "cpu")
    assert summary == f"tuned by shape: 2 buckets in {isolated / 'configs' / 'cpu' / 'toy_matmul.json'}"
    assert tuned.tuned_summary("toy_matmul", "wide", "cpu") is None  # no entry for this backend
    assert resolve("toy_matmul", "blocked", {"m": 16, "k": 256, "dtype": "bf16"})[1] == "default"
    assert [r for r in caplog.records if "no tuned config for toy_matmul[blocked]" in r.getMessage()]


def test_metadata_other_device_skipped(toy, isolated, caplog):
    bucket = {"m": 16, "k": 256, "dtype": "fp32"}
    _write(isolated / "configs", [(bucket, {"BLOCK_K": 128, "skip_last": False})], device="NVIDIA H200")
    caplog.set_level(logging.WARNING, logger="pdlab.tuned")
    assert resolve("toy_matmul", "blocked", bucket)[1] == "default"
    assert resolve("toy_matmul", "blocked", {**bucket, "m": 17})[1] == "default"
    skips = [r for r in caplog.records if "tuned on 'NVIDIA H200'" in r.getMessage()]
    assert len(skips) == 1  # warned once per file


def test_metadata_other_versions_used_with_one_warning(toy, isolated, caplog):
    bucket = {"m": 16, "k": 256, "dtype": "fp32"}
    _write(isolated / "configs", [(bucket, {"BLOCK_K": 128, "skip_last": False})],
           versions={"torch": "0.0.1", "triton": "0.0.2"})
    caplog.set_level(logging.WARNING, logger="pdlab.tuned")
    for m in (16, 17, 18):
        cfg, src = resolve("toy_matmul", "blocked", {**bucket, "m": m})
        assert cfg["BLOCK_K"] == 128 and src.startswith("tuned:")
    warns = [r.getMessage() for r in caplog.records if "other versions" in r.getMessage()]
    assert len(warns) == 1 and "torch 0.0.1 (tuned)" in warns[0] and "triton 0.0.2" in warns[0]


def test_vendor_package_on_one_side_only_is_no_version_difference(monkeypatch):
    """A store tuned with flashinfer read where it is missing (or the other way round) warns of nothing: those
    entries are unused here, or the backend was not searched; installed on both sides in other versions, or torch /
    triton differing, still warns."""
    from pdlab.kernels import tuned

    here = {"torch": "2.1", "triton": "3.6", "flashinfer-python": None, "deep_ep": "1.2"}
    monkeypatch.setattr(tuned, "running_versions", lambda names=None: {k: here.get(k) for k in names})
    assert tuned.version_differences({"torch": "2.1", "triton": "3.6", "flashinfer-python": "0.7.2"}) == {}
    assert tuned.version_differences({"torch": "2.1", "deep_ep": None}) == {}
    assert tuned.version_differences({"deep_ep": "1.1", "triton": None}) == {"deep_ep": ("1.1", "1.2"),
                                                                            "triton": (None, "3.6")}


def test_stale_or_broken_files_fall_back(toy, isolated, caplog):
    bucket = {"m": 16, "k": 256, "dtype": "fp32"}
    path = _write(isolated / "configs", [(bucket, {"BLOCK_K": 128, "skip_last": False})])
    data = json.loads(path.read_text())
    data["entries"][tuned.bucket_label(bucket)]["backends"]["blocked"]["config"]["GONE"] = 1
    path.write_text(json.dumps(data))
    caplog.set_level(logging.WARNING, logger="pdlab.tuned")
    assert resolve("toy_matmul", "blocked", bucket)[1] == "default"
    assert any("unknown config keys" in r.getMessage() for r in caplog.records)
    path.write_text("{not json")
    tuned.clear_cache()
    assert resolve("toy_matmul", "blocked", bucket)[1] == "default"
    data["format"] = 99
    path.write_text(json.dumps(data))
    tuned.clear_cache()
    assert resolve("toy_matmul", "blocked", bucket)[1] == "default"
    assert any("format 99" in r.getMessage() for r in caplog.records)


def test_decode_split_count_carried_to_the_calls_batch(isolated):
    # mla_decode[triton]'s adapter: an explicit num_splits tuned at batch 128 keeps the program count at other
    # batches (64 → 4 splits, 32 → 8, 256 → 1), automatic splits (0) stay automatic; the tuned bucket itself as stored
    import pdlab.attention  # noqa: F401  (registers the backend and its adapter)

    root = isolated / "configs"
    key = {"heads": 16, "kv_dtype": "bf16", "q_len": 1, "seqlen": 8192}
    _write(root, [({"batch": 128, **key}, {"num_splits": 2}), ({"batch": 8, **key, "seqlen": 1024}, {"num_splits": 0})],
           op="mla_decode", backend="triton")

    def splits(batch, seqlen=8192):
        cfg, src = resolve("mla_decode", "triton", {"batch": batch, **key, "seqlen": seqlen})
        assert src.startswith("tuned:")
        return cfg["num_splits"]

    assert [splits(b) for b in (128, 64, 32, 256, 512, 96)] == [2, 4, 8, 1, 1, 2]
    assert splits(4, 1024) == 0 and splits(128, 16384) == 2


def _experts_bucket(experts, tpe=1, layout="contiguous", active=None):
    b = {"experts": experts, "hidden": 128, "intermediate": 64, "layout": layout, "payload": "bf16",
         "tokens_per_expert": tpe}
    return b if active is None else {**b, "active_experts": active}


def test_experts_buckets_tell_one_token_on_few_experts_from_one_on_each(isolated):
    # a file written before active_experts was a key (every expert full) still serves those shapes, and is
    # relabelled when new entries are merged in; one token on 8 of 256 experts finds the sparse entry, not the
    # dense one (nor EP4's 64 experts with one token each, which the old key could not tell apart)
    from types import SimpleNamespace

    import torch

    import pdlab.moe  # noqa: F401  (registers the runners and the bucket upgrade)
    from pdlab.moe.experts import resolved_config
    from pdlab.moe.layouts import Contiguous, Masked

    root = isolated / "configs"
    old = _write(root, [], op="moe_experts", backend="triton")  # an older file, written as it was then
    data = json.loads(old.read_text())
    for b, cfg in ((_experts_bucket(256), {"FRAG_BM": 64}), (_experts_bucket(64), {"FRAG_BM": 16})):
        data["entries"][tuned.bucket_label(b)] = {"bucket": b, "backend": "triton",
                                                  "backends": {"triton": store.backend_result(cfg, 1.0, 2.0)}}
    old.write_text(json.dumps(data))
    w = SimpleNamespace(intermediate_size=64)

    def rows(n, experts=256, **kw):
        counts = torch.zeros(experts, dtype=torch.int32)
        counts[:n] = 1
        offsets = torch.cat([torch.zeros(1, dtype=torch.int32), counts.cumsum(0, dtype=torch.int32)])
        cfg, src = resolved_config(Contiguous(torch.randn(n, 128), counts, offsets), w, "triton", **kw)
        assert src.startswith("tuned:"), src
        return cfg["FRAG_BM"]

    assert rows(256) == 64 and rows(64, experts=64) == 16  # old entries, read as every expert full
    assert rows(8) == 64  # nothing sparse tuned yet: the nearest is EP1's dense entry (distance 5)
    _write(root, [(_experts_bucket(256, active=8), {"FRAG_BM": 32}),
                  (_experts_bucket(256, layout="masked", active=256), {"FRAG_BM": 64}),
                  (_experts_bucket(256, layout="masked", active=8), {"FRAG_BM": 32})], op="moe_experts",
           backend="triton")
    tuned.clear_cache()
    entries = json.loads(old.read_text())["entries"]
    assert sorted(entries) == sorted(tuned.bucket_label(_experts_bucket(e, layout=lay, active=a)) for e, a, lay in
                                     ((256, 256, "contiguous"), (256, 8, "contiguous"), (64, 64, "contiguous"),
                                      (256, 256, "masked"), (256, 8, "masked")))
    assert entries[tuned.bucket_label(_experts_bucket(256, active=256))]["bucket"]["active_experts"] == 256
    assert rows(8) == 32 and rows(16) == 32 and rows(256) == 64 and rows(64, experts=64) == 16
    assert rows(256, active_experts=8) == 32  # the caller's expectation wins over the rows it sees
    slab = Masked(torch.randn(256, 1, 128), torch.zeros(256, dtype=torch.int32))
    assert resolved_config(slab, w, "triton")[0]["FRAG_BM"] == 64  # a slab: every expert, unless told
    assert resolved_config(slab, w, "triton", active_experts=8)[0]["FRAG_BM"] == 32
