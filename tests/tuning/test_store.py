"""Store files: atomic merge-on-write under concurrent writer processes."""

import json
import multiprocessing as mp

from pdlab.kernels import tuned
from pdlab.tuning import store

META = {"device": "cpu", "device_key": "cpu", "arch": "cpu", "versions": {}}


def _writer(root: str, wid: int, n: int) -> None:
    for i in range(n):
        bucket = {"m": 1000 * wid + i, "dtype": "fp32"}
        store.write_results(root, "cpu", "toy_matmul", META,
                            store.merge_bucket(bucket, {"blocked": store.backend_result({"BLOCK_K": wid}, 1.0, 2.0)}))
    # every writer also updates one shared bucket with its own backend: all must survive
    store.write_results(root, "cpu", "toy_matmul", META, store.merge_bucket(
        {"m": 999999, "dtype": "fp32"}, {f"b{wid}": store.backend_result({"BLOCK_K": wid}, 1.0 + wid, 2.0)}))


def test_concurrent_writers_lose_nothing(tmp_path):
    writers, n = 4, 12
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_writer, args=(str(tmp_path), w, n)) for w in range(writers)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    path = store.store_path(tmp_path, "cpu", "toy_matmul")
    data = json.loads(path.read_text())
    assert len(data["entries"]) == writers * n + 1
    for w in range(writers):
        for i in range(n):
            e = data["entries"][tuned.bucket_label({"m": 1000 * w + i, "dtype": "fp32"})]
            assert e["backends"]["blocked"]["config"] == {"BLOCK_K": w}
    shared = data["entries"][tuned.bucket_label({"m": 999999, "dtype": "fp32"})]
    assert set(shared["backends"]) == {f"b{w}" for w in range(writers)}
    assert shared["backend"] == "b0" and shared["time_ms"] == 1.0  # the fastest backend wins the bucket
    assert not [p for p in path.parent.iterdir() if p.suffix == ".tmp"]  # no temp files left behind


def test_entry_fields_and_replace(tmp_path):
    bucket = {"m": 8, "dtype": "fp32"}
    store.write_results(tmp_path, "cpu", "op", META, store.merge_bucket(
        bucket, {"a": store.backend_result({"X": 1}, 2.0, 4.0, trials=5, failed=1)}))
    path = store.write_results(tmp_path, "cpu", "op", META, store.merge_bucket(
        bucket, {"a": store.backend_result({"X": 2}, 1.0, 4.0, trials=9, failed=0)}))
    e = json.loads(path.read_text())["entries"]["dtype=fp32,m=8"]
    assert e["bucket"] == bucket and e["backend"] == "a" and e["config"] == {"X": 2}
    assert (e["time_ms"], e["default_time_ms"], e["speedup"]) == (1.0, 4.0, 4.0)
    assert e["backends"]["a"]["trials"] == 9


def test_other_device_in_same_file_refused(tmp_path):
    import pytest

    store.write_results(tmp_path, "cpu", "op", META, {})
    with pytest.raises(ValueError, match="use a folder per device"):
        store.write_results(tmp_path, "cpu", "op", {**META, "device": "NVIDIA H200"}, {})


def test_a_malformed_store_file_is_set_aside_not_fatal(tmp_path, caplog):
    """A truncated store file (a crash mid-edit, a bad hand edit): the run's results are written to a new file
    instead of failing after the search, and the old one is kept beside it."""
    path = store.store_path(tmp_path, "cpu", "op")
    path.parent.mkdir(parents=True)
    path.write_text('{"format": 1, "entries": {')
    with caplog.at_level("WARNING", logger="pdlab.tuning"):
        store.write_results(tmp_path, "cpu", "op", META, store.merge_bucket(
            {"m": 8}, {"a": store.backend_result({"X": 1}, 1.0, 2.0)}))
    data = tuned.read_store(path)
    assert list(data["entries"]) == ["m=8"]
    (aside,) = [p for p in path.parent.iterdir() if p.name.startswith("op.json.malformed-")]
    assert aside.read_text() == '{"format": 1, "entries": {'
    assert "not valid JSON" in caplog.text and aside.name in caplog.text
