"""The search on CPU over the toy op: a real study end to end, failed trials, resume after a kill."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import optuna
import torch
from optuna.trial import TrialState

from pdlab.kernels import tuned
from pdlab.tuning.models import DEEPSEEK_R1
from pdlab.tuning.search import FAIL_REASON, study_name, tune_op

HERE = Path(__file__).resolve().parent
BUCKET = {"m": 16, "k": 64, "dtype": "fp32"}


def _trials(storage, backend="blocked", bucket=BUCKET):
    s = optuna.load_study(study_name=study_name("cpu", "toy_matmul", backend, bucket), storage=storage)
    return s.get_trials(deepcopy=False)


def test_small_study_writes_store_that_lookup_returns(toy, isolated):
    storage = optuna.storages.InMemoryStorage()
    root = isolated / "configs"
    buckets = [{"m": 16, "k": 64, "dtype": "fp32"}, {"m": 64, "k": 64, "dtype": "fp32"}]
    rep = tune_op(toy.register(), buckets, DEEPSEEK_R1, toy.settings(storage, 12, backends=["blocked", "wide"]),
                  device=torch.device("cpu"), store_root=root, metadata=toy.metadata(), plot_dir=isolated / "plots")
    # grid (8 configs) on blocked, TPE on wide (84 configs, capped at 12 trials)
    blocked = [s for s in rep.studies if s.backend == "blocked"]
    assert all(s.trials == 8 for s in blocked)
    assert all(s.trials == 12 for s in rep.studies if s.backend == "wide")
    for s in blocked:
        assert s.config["skip_last"] is False and s.config["BLOCK_K"] > 0
        assert s.time_ms > 0 and s.default_time_ms > 0
    data = json.loads(rep.store_file.read_text())
    assert rep.store_file == root / "cpu" / "toy_matmul.json"
    assert set(data["entries"]) == {tuned.bucket_label(b) for b in buckets}
    for b in buckets:
        e = data["entries"][tuned.bucket_label(b)]
        assert set(e["backends"]) == {"blocked", "wide"}
        assert e["backend"] in ("blocked", "wide")
        assert e["backends"]["wide"]["config"]["flip"] is False  # flip=True is a wrong result
        r = e["backends"]["blocked"]
        assert r["speedup"] == r["default_time_ms"] / r["time_ms"]
        cfg, src = tuned.resolve_config("toy_matmul", "blocked", b, device="cpu")
        assert cfg == r["config"] and src == f"tuned:{rep.store_file}"
    assert data["metadata"]["device"] == "cpu" and data["format"] == tuned.FORMAT_VERSION
    assert rep.geomean_speedup() > 0
    assert rep.notes == []  # the toy op asks the store for the keys it was written with
    assert (isolated / "plots" / "toy_matmul" / "speedup.png").stat().st_size > 1000
    assert len(list((isolated / "plots" / "toy_matmul" / "history").glob("*.png"))) == 4


def test_failed_trials_recorded_with_reason(toy, isolated):
    storage = f"sqlite:///{isolated / 'tuning.db'}"
    toy.run(storage, str(isolated / "configs"), 50)
    trials = _trials(storage)
    failed = [t for t in trials if t.state == TrialState.FAIL]
    reasons = {(t.params["BLOCK_K"], t.params["skip_last"]): t.user_attrs[FAIL_REASON] for t in failed}
    # BLOCK_K=0 "fails to compile" (2 configs); skip_last=True is a wrong result (3 more)
    assert len(failed) == 5
    assert all("compile error" in r for (bk, _), r in reasons.items() if bk == 0)
    assert all(r.startswith("wrong result") for (bk, sl), r in reasons.items() if bk and sl)
    assert sum(t.state == TrialState.COMPLETE for t in trials) == 3


def test_budget_stops_search(toy, isolated, monkeypatch):
    monkeypatch.setenv("TOY_DELAY", "0.2")  # a full grid would sleep >= 8 s (5 calls per trial)
    storage = f"sqlite:///{isolated / 'tuning.db'}"
    rep = tune_op(toy.register(), [BUCKET], DEEPSEEK_R1, toy.settings(storage, budget_s=0.3),
                  device=torch.device("cpu"), store_root=None, metadata=toy.metadata())
    trials = rep.studies[0].trials
    assert trials >= 1  # a started study runs at least one trial
    assert trials <= 3  # of the grid's 8: the 0.3 s budget stopped the search


def test_resume_after_kill(toy, isolated):
    storage = f"sqlite:///{isolated / 'tuning.db'}"
    env = {**os.environ, "TOY_DELAY": "0.4", "PYTHONUNBUFFERED": "1"}  # slow enough to kill mid-grid on a busy machine
    cmd = [sys.executable, str(HERE / "toy.py"), storage, str(isolated / "configs"), "50"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.time() + 60
        done = 0
        while time.time() < deadline:
            time.sleep(0.1)
            try:
                done = sum(t.state.is_finished() for t in _trials(storage))
            except KeyError:  # study not created yet
                continue
            if done >= 3:
                break
        assert done >= 3, proc.stderr.read().decode() if proc.poll() is not None else "no progress"
    finally:
        proc.kill()
        proc.wait()
    before = _trials(storage)
    assert len(before) < 8  # interrupted before the grid's end
    assert not (isolated / "configs" / "cpu" / "toy_matmul.json").exists()  # nothing stored yet
    env["TOY_DELAY"] = "0"
    subprocess.run(cmd, env=env, check=True, timeout=120, capture_output=True)
    after = _trials(storage)
    assert [t.number for t in after[:len(before)]] == [t.number for t in before]  # continued, not restarted
    assert len(after) >= 8 and all(t.state.is_finished() for t in after)
    finished_first = {t.number for t in before if t.state.is_finished()}
    assert all(after[n].datetime_start == before[n].datetime_start for n in finished_first)
    interrupted = [t for t in after if t.user_attrs.get(FAIL_REASON, "").startswith("interrupted")]
    assert len(interrupted) == sum(not t.state.is_finished() for t in before)
    assert (isolated / "configs" / "cpu" / "toy_matmul.json").exists()


def _rank(rank, world, port, root, q):
    import importlib.util

    import torch.distributed as dist

    from pdlab.tuning.search import Lockstep, follow

    spec = importlib.util.spec_from_file_location("pdlab_tuning_toy_rank", HERE / "toy.py")
    toy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(toy)
    target = toy.register_collective()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        lock = Lockstep(torch.device("cpu"))
        settings = toy.settings(None, 20, backends=["chunked"])
        if rank == 0:
            rep = tune_op(target, [{"n": 4096}], DEEPSEEK_R1, settings, device=torch.device("cpu"),
                          store_root=root, metadata=toy.metadata(), lockstep=lock)
            s = rep.studies[0]
            q.put((s.trials, s.failed, s.config, str(rep.store_file)))
        else:
            follow(target, DEEPSEEK_R1, settings, torch.device("cpu"), lock)
            q.put("followed")
    finally:
        dist.destroy_process_group()


def test_multi_rank_lockstep_search(isolated):
    import multiprocessing as mp
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, 2, port, str(isolated / "configs"), q)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(90)
    assert [p.exitcode for p in procs] == [0, 0]
    got = [q.get(timeout=5) for _ in range(2)]
    assert "followed" in got
    trials, failed, config, store_file = next(g for g in got if g != "followed")
    assert (trials, failed) == (4, 1) and config["chunks"] in (1, 2, 4)  # grid of 4, chunks=0 failed
    assert json.loads(Path(store_file).read_text())["entries"]["n=4096"]["backend"] == "chunked"


def test_tpe_warm_start_tries_default_then_earlier_winners(toy, isolated):
    storage = optuna.storages.InMemoryStorage()
    buckets = [{"m": 16, "k": 64, "dtype": "fp32"}, {"m": 64, "k": 64, "dtype": "fp32"}]
    rep = tune_op(toy.register(), buckets, DEEPSEEK_R1, toy.settings(storage, 6, backends=["wide"]),
                  device=torch.device("cpu"), store_root=None, metadata=toy.metadata())
    first, second = (optuna.load_study(study_name=study_name("cpu", "toy_matmul", "wide", b), storage=storage)
                     for b in buckets)
    assert first.trials[0].params == {"rows": 1, "cols": 1, "flip": False}  # the default first
    enc = {k: rep.studies[0].best_config[k] for k in ("rows", "cols", "flip")}
    assert second.trials[0].params == {"rows": 1, "cols": 1, "flip": False}
    if enc != second.trials[0].params:
        assert second.trials[1].params == enc  # then the previous bucket's winner


def test_a_rerun_tries_the_config_already_stored_for_the_bucket_right_after_the_default(toy, isolated, monkeypatch):
    # re-tuning under a changed timing (e.g. eager → CUDA graphs) must measure what is shipped, not hope that the
    # sampler finds it again; a config stored for another bucket is not a seed
    from pdlab.tuning import store
    from pdlab.tuning.search import stored_configs, stored_entries

    root = isolated / "configs"
    shipped = {"rows": 4, "cols": 2, "flip": False}
    other = {"m": 64, "k": 64, "dtype": "fp32"}
    metadata = toy.metadata()
    store.write_results(root, "cpu", "toy_matmul", metadata, store.merge_bucket(
        BUCKET, {"wide": store.backend_result(shipped, 1.0, 2.0, 5, 0, "old")}))
    store.write_results(root, "cpu", "toy_matmul", metadata, store.merge_bucket(
        other, {"wide": store.backend_result({"rows": 2, "cols": 4, "flip": False}, 1.0, 2.0, 5, 0, "old")}))
    monkeypatch.setenv(tuned.CONFIG_DIR_ENV, str(root))
    files = stored_entries("cpu", "toy_matmul")
    assert [{k: c[k] for k in shipped} for c in stored_configs(files, "toy_matmul", "wide", BUCKET)] == [shipped]
    assert stored_configs(files, "toy_matmul", "blocked", BUCKET) == []
    storage = optuna.storages.InMemoryStorage()
    tune_op(toy.register(), [BUCKET], DEEPSEEK_R1, toy.settings(storage, 4, backends=["wide"]),
            device=torch.device("cpu"), store_root=isolated / "new", metadata=metadata)
    trials = optuna.load_study(study_name=study_name("cpu", "toy_matmul", "wide", BUCKET), storage=storage).trials
    assert trials[0].params == {"rows": 1, "cols": 1, "flip": False}  # the default
    assert trials[1].params == shipped  # then what is stored for this bucket
    assert {"rows": 2, "cols": 4, "flip": False} not in [t.params for t in trials[:3]]


def test_op_asking_other_bucket_keys_is_reported(toy, isolated, monkeypatch):
    monkeypatch.setitem(toy.LOOKUP, "keys", ("m", "k"))  # an op that forgot the dtype key
    rep = toy.run(None, str(isolated / "configs"), 8)
    assert len(rep.notes) == 1
    assert "looks up buckets with keys ['k', 'm']" in rep.notes[0] and "'dtype'" in rep.notes[0]


def test_broken_cuda_context_stops_the_run():
    import pytest

    from pdlab.tuning.search import DeviceBroken, _check_broken

    err = RuntimeError("CUDA error: an illegal memory access was encountered")
    with pytest.raises(DeviceBroken, match="rerun the same command to resume"):
        _check_broken(err, torch.device("cuda", 0), "triton", {"BLOCK_N": 64})
    _check_broken(err, torch.device("cpu"), "triton", {})  # only a CUDA context can break
    _check_broken(RuntimeError("triton.CompilationError: out of resources"), torch.device("cuda", 0), "triton", {})


def test_a_config_that_broke_the_context_is_skipped_on_every_bucket(toy, isolated, monkeypatch):
    # a seeded sampler proposes the same configs on every bucket: a config that broke the CUDA
    # context on one bucket must not run (and crash the run again) on the next
    storage = f"sqlite:///{isolated / 'tuning.db'}"
    a, b = {"m": 16, "k": 64, "dtype": "fp32"}, {"m": 64, "k": 64, "dtype": "fp32"}
    monkeypatch.setenv("TOY_BREAK_BK", "64")
    tune_op(toy.register(), [a], DEEPSEEK_R1, toy.settings(storage, 8, backends=["blocked"]),
            device=torch.device("cpu"), store_root=isolated / "configs", metadata=toy.metadata())
    monkeypatch.delenv("TOY_BREAK_BK")
    rep = tune_op(toy.register(), [b], DEEPSEEK_R1, toy.settings(storage, 8, backends=["blocked"]),
                  device=torch.device("cpu"), store_root=isolated / "configs", metadata=toy.metadata())
    skipped = [t for t in _trials(storage, bucket=b) if t.params.get("BLOCK_K") == 64]
    assert skipped and all(t.state == TrialState.FAIL for t in skipped)
    assert all("broke the CUDA context on dtype=fp32,k=64,m=16" in t.user_attrs[FAIL_REASON] for t in skipped)
    assert rep.studies[0].config["BLOCK_K"] != 64


def test_neighbours_vary_one_knob_of_the_resolved_default():
    from pdlab.tuning.search import neighbours

    space = {"a": [1, 2, 3], "b": ["x", "y"], "c": [0, 8, 16]}
    base = {"a": 2, "b": "x", "c": 7}  # c = 7: not a choice of the space, left to the sampler
    out = neighbours(base, space, limit=10, seed=3)
    assert len(out) == 3 and all("c" not in n for n in out)  # a: 1, 3; b: y
    assert {(n["a"], n["b"]) for n in out} == {(1, "x"), (3, "x"), (2, "y")}
    assert neighbours(base, space, limit=2, seed=3) == out[:2]
    assert {n["a"] != 2 for n in out[:2]} == {True, False}  # round-robin: both knobs before a second a


def test_tpe_study_starts_from_the_resolved_default_and_its_neighbours(toy, isolated):
    storage = optuna.storages.InMemoryStorage()
    target = toy.register()
    target.resolve = lambda backend, cfg, bucket: {**cfg, "rows": 4} if backend == "wide" else dict(cfg)
    tune_op(target, [BUCKET], DEEPSEEK_R1, toy.settings(storage, 8, backends=["wide"]),
            device=torch.device("cpu"), store_root=None, metadata=toy.metadata())
    trials = optuna.load_study(study_name=study_name("cpu", "toy_matmul", "wide", BUCKET), storage=storage).trials
    assert trials[0].params == {"rows": 4, "cols": 1, "flip": False}  # resolved default
    assert trials[1].params == {"rows": 1, "cols": 1, "flip": False}  # as declared
    one_knob = [t.params for t in trials[2:8]]
    assert all(sum(p[k] != v for k, v in {"rows": 4, "cols": 1, "flip": False}.items()) == 1 for p in one_knob)


def _edge_target(wrong_modes):
    """Op "toy_edge" (y = 2x): modes 0, 1, 2 take 0, 2 and 4 ms; the modes in wrong_modes are wrong for a
    single row only — which the bucket's inputs (8 rows) never show and its edge inputs (1 row) do."""
    from pdlab.kernels import registry
    from pdlab.kernels.registry import register_backend
    from pdlab.tuning.target import TuneTarget

    op = "toy_edge"

    @register_backend(op, "ref", archs=("cpu",), reference=True)
    def ref(x, *, config=None):
        return x * 2

    @register_backend(op, "fast", archs=("cpu",), config_space={"mode": [0, 1, 2]}, default_config={"mode": 2})
    def fast(x, *, config):
        time.sleep((0.0, 0.002, 0.004)[config["mode"]])
        return x * 3 if config["mode"] in wrong_modes and x.shape[0] == 1 else x * 2

    def call(backend, cfg, x):
        b = registry.get_backend(op, backend)
        return b.impl(x, config=cfg if cfg is not None else b.config())

    return TuneTarget(op=op, description="toy edge", buckets=lambda model: [{"n": 8}],
                      build=lambda bucket, model, device: torch.ones(bucket["n"], 4), call=call,
                      error=lambda out, ref: float((out - ref).abs().max()), tolerance=lambda bucket: 1e-6,
                      edge_inputs=lambda bucket, model, device: [torch.ones(1, 4)])


def test_a_winner_wrong_at_the_edge_shapes_is_passed_over(toy, isolated):
    # the store hands a bucket's config to other shapes too (nearest bucket): the fastest config, right on
    # the bucket's own inputs but wrong on a single row, must not be stored; the next-best right one is
    from pdlab.kernels import registry

    try:
        rep = tune_op(_edge_target({0}), [{"n": 8}], DEEPSEEK_R1, toy.settings(None, 3, backends=["fast"]),
                      device=torch.device("cpu"), store_root=isolated / "configs", metadata=toy.metadata())
        s = rep.studies[0]
        assert s.best_config == {"mode": 1}, (s.best_config, s.passed_over)
        assert len(s.passed_over) == 1 and "'mode': 0" in s.passed_over[0] and "edge case 0" in s.passed_over[0]
        entry = json.loads(rep.store_file.read_text())["entries"]["n=8"]["backends"]["fast"]
        assert entry["config"]["mode"] in (1, 2)  # the winner, or the default if it re-measured faster
        # every config wrong at the edge: nothing stored for the bucket, and the reason says why
        registry._REGISTRY.pop("toy_edge", None)
        rep = tune_op(_edge_target({0, 1, 2}), [{"n": 8}], DEEPSEEK_R1, toy.settings(None, 3, backends=["fast"]),
                      device=torch.device("cpu"), store_root=isolated / "configs2", metadata=toy.metadata())
        s = rep.studies[0]
        assert s.config is None and "wrong at the served shapes" in s.reason and len(s.passed_over) == 3
    finally:
        registry._REGISTRY.pop("toy_edge", None)
        registry._PROBE_CACHE.clear()


def test_target_narrows_the_space_per_bucket(toy, isolated):
    # a target that says which knobs matter for a bucket on this device: only those are searched (grid of 2),
    # the others keep their defaults in the stored config
    import dataclasses

    storage = optuna.storages.InMemoryStorage()
    seen = []

    def space(backend, bucket, arch):
        seen.append((backend.name, bucket["m"], arch))
        return {"BLOCK_K": [16, 64]} if backend.name == "blocked" else None

    target = dataclasses.replace(toy.register(), space=space)
    rep = tune_op(target, [BUCKET], DEEPSEEK_R1, toy.settings(storage, 12, backends=["blocked"]),
                  device=torch.device("cpu"), store_root=None, metadata=toy.metadata())
    (study,) = rep.studies
    assert seen == [("blocked", 16, "cpu")]
    trials = [t for t in _trials(storage) if t.state == TrialState.COMPLETE]
    assert len(trials) == 2 and all(set(t.params) == {"BLOCK_K"} for t in trials)
    # the best of the narrowed grid, or the default where it re-measured faster (timing noise on a busy CPU)
    assert study.config["BLOCK_K"] in (16, 64, toy.BLOCKED_DEFAULT["BLOCK_K"]) and study.config["skip_last"] is False


def test_a_study_resumed_after_its_space_changed_searches_the_new_space(toy, isolated):
    # a knob that gained a value (a newer pdlab, another narrowing) under the same study name: optuna refused the
    # resumed study ("CategoricalDistribution does not support dynamic value space") and the whole op ended there
    import dataclasses

    storage = f"sqlite:///{isolated / 'tuning.db'}"
    spaces = [{"BLOCK_K": [16, 64]}, {"BLOCK_K": [4, 16, 64]}]
    reps = []
    for space in spaces:
        target = dataclasses.replace(toy.register(), space=lambda backend, bucket, arch, sp=space: sp)
        reps.append(tune_op(target, [BUCKET], DEEPSEEK_R1, toy.settings(storage, 12, backends=["blocked"]),
                            device=torch.device("cpu"), store_root=isolated / "configs", metadata=toy.metadata()))
    old, new = reps[0].studies[0], reps[1].studies[0]
    assert new.reason == "" and new.config is not None and new.trials == 3  # the whole new grid, measured
    assert old.study_name == study_name("cpu", "toy_matmul", "blocked", BUCKET) != new.study_name
    assert len(_trials(storage)) == 2  # the first study is kept as it was: a run at its space resumes it
    rerun = tune_op(dataclasses.replace(toy.register(), space=lambda *a: spaces[0]), [BUCKET], DEEPSEEK_R1,
                    toy.settings(storage, 12, backends=["blocked"]), device=torch.device("cpu"),
                    store_root=isolated / "configs", metadata=toy.metadata())
    assert rerun.studies[0].study_name == old.study_name and len(_trials(storage)) == 2
