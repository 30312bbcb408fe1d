"""The search: one optuna study per (device, op, backend, bucket), persisted in an RDB (sqlite) file.

Per bucket: build the inputs once, run the reference backend once, then for every backend that
runs on this device and accepts the bucket, ask/tell trials until the bucket's time share, the
trial cap or the grid is used up. A trial = backend default config updated with the sampled knobs,
called through the op's public function, compared with the reference output, then timed with
`pdlab.bench.harness.bench`. A trial that fails to compile, runs out of memory/resources or gives
a wrong result is told as TrialState.FAIL with the reason in `user_attrs["fail_reason"]`.
After the search the fastest trial must also match the reference at the target's edge inputs (other shapes
the stored config will meet in service; else the next-best is checked), then it is re-measured against the
backend's default config (alternating A/B, best of the medians) and the faster of the two is stored with both
times.
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

from pdlab.bench.harness import bench
from pdlab.bench.report import ProgressBar
from pdlab.kernels import tuned
from pdlab.kernels.registry import Backend
from pdlab.tuning import store
from pdlab.tuning.models import ModelShape
from pdlab.tuning.target import TuneTarget, space_size

GRID_MAX = 64  # spaces with at most this many configs are searched exhaustively
FAIL_REASON = "fail_reason"

log = logging.getLogger("pdlab.tuning")


def default_storage() -> str:
    """`sqlite:///<cache>/tuning.db` with <cache> = $PDLAB_CACHE_DIR or ~/.cache/pdlab."""
    root = Path(os.environ.get("PDLAB_CACHE_DIR") or Path.home() / ".cache" / "pdlab")
    root.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{root / 'tuning.db'}"


def storage_url(text: str | None) -> str:
    """An optuna storage URL from a CLI value: a URL as is, a file path as sqlite, None → default."""
    if not text:
        return default_storage()
    if "://" in text:
        return text
    path = Path(text).expanduser().resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{path}"


@dataclass
class SearchSettings:
    """Knobs of one `tune` run. Times in seconds; budget is for the whole op, bucket_budget per
    bucket (all backends of it); None = no limit."""

    storage: Any  # optuna storage URL (sqlite:///file.db) or storage object
    budget_s: float | None = 600.0
    bucket_budget_s: float | None = None
    max_trials: int = 200
    neighbours: int = 12  # one-knob variations of the resolved default tried first in a TPE study
    sampler: str = "auto"  # auto | tpe | grid | random
    seed: int = 0
    warmup: int = 5
    repeats: int = 30
    max_seconds: float = 2.0  # per timing call
    remeasure_rounds: int = 3
    backends: Sequence[str] | None = None
    show_progress: bool = True


@dataclass
class StudyResult:
    backend: str
    bucket: dict
    study_name: str
    trials: int
    failed: int
    best_config: dict | None
    time_ms: float | None  # re-measured time of the stored config
    default_time_ms: float | None
    config: dict | None  # what is stored: best_config, or the default if it re-measured faster
    history: list[tuple[int, float | None, str]] = field(default_factory=list)  # (number, value, state)
    reason: str = ""  # why nothing was stored
    passed_over: list[str] = field(default_factory=list)  # faster trials wrong at the target's edge inputs


@dataclass
class OpReport:
    op: str
    device: str
    studies: list[StudyResult]
    store_file: Path | None
    seconds: float
    skipped: list[tuple[dict, str, str]]  # (bucket, backend, reason)
    notes: list[str] = field(default_factory=list)  # integration problems (op not reading the store, ...)

    def winners(self) -> list[tuple[dict, StudyResult]]:
        """Per bucket the fastest stored backend result."""
        best: dict[str, StudyResult] = {}
        for s in self.studies:
            if s.time_ms is None:
                continue
            key = tuned.bucket_label(s.bucket)
            if key not in best or s.time_ms < best[key].time_ms:
                best[key] = s
        return [(s.bucket, s) for s in best.values()]

    def geomean_speedup(self) -> float | None:
        """Geometric mean over buckets of default_time / time of the winner's backend."""
        return geomean([s.default_time_ms / s.time_ms for _, s in self.winners() if s.default_time_ms and s.time_ms])


def geomean(xs) -> float | None:
    """Geometric mean of positive numbers (None for none)."""
    xs = list(xs)
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def study_name(device_key: str, op: str, backend: str, bucket: Mapping) -> str:
    return f"{device_key}|{op}|{backend}|{tuned.bucket_label(bucket)}"


def tune_op(target: TuneTarget, buckets: list[dict], model: ModelShape, settings: SearchSettings, *,
            device: torch.device, store_root: str | os.PathLike | None, metadata: Mapping,
            plot_dir: str | os.PathLike | None = None, lockstep: "Lockstep | None" = None) -> OpReport:
    """Tune every (bucket, backend) of `target` on `device`; write winners to `store_root` (merge).

    lockstep: set on rank 0 of a multi-rank run (collective ops such as dispatch): every bucket and
    measurement is announced to the other ranks, which run `follow` and measure in step."""
    try:
        return _tune_op(target, buckets, model, settings, device=device, store_root=store_root,
                        metadata=metadata, plot_dir=plot_dir, lockstep=lockstep)
    finally:
        if lockstep is not None:
            lockstep.send(("done",))


def _tune_op(target, buckets, model, settings, *, device, store_root, metadata, plot_dir, lockstep) -> OpReport:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    name, key, arch = tuned.device_identity(device)
    backends = registered = target.backends(arch)
    if settings.backends:
        unknown = set(settings.backends) - {b.name for b in backends}
        if unknown:
            raise ValueError(f"--backends {','.join(sorted(unknown))}: not a backend of {target.op} that runs on "
                             f"{arch}; choose from {', '.join(b.name for b in backends) or 'none'}")
        backends = [b for b in backends if b.name in settings.backends]
    elif target.reference_output is None:  # the reference checks results; it is searched only when named
        backends = [b for b in backends if not b.reference]
    usable = [b for b in backends if b.unavailable_reason(arch) is None]
    skipped = [({}, b.name, b.unavailable_reason(arch) or "") for b in backends if b not in usable]
    if not usable:
        why = "; ".join(f"{b}: {r}" for _, b, r in skipped)
        refs = [b.name for b in registered if b.reference and b not in backends and b.unavailable_reason(arch) is None]
        if refs:  # only the reference runs here, and it is searched only when named
            why = (why + "; " if why else "") + (f"the reference ({', '.join(refs)}) is searched only when named: "
                                                 f"--backends {refs[0]}")
        raise RuntimeError(f"no backend of {target.op} can run on this {arch} device: "
                           + (why or f"none of its backends is built for {arch}"))
    ref_backend = target.reference_backend() if target.reference_output is None else None
    t_start = time.perf_counter()
    deadline = t_start + settings.budget_s if settings.budget_s else math.inf
    results: list[StudyResult] = []
    store_file = None
    plan = [(bucket, [b for b in usable if target.accepts(b, bucket)]) for bucket in buckets]
    for bucket, bs in plan:
        skipped += [(bucket, b.name, "does not accept this bucket") for b in usable if b not in bs]
    total = sum(len(bs) for _, bs in plan)
    if not total:  # every bucket left is one no usable backend takes (e.g. nvfp4 activations on a CPU)
        raise RuntimeError(f"none of the backends that run on this {arch} device ({', '.join(b.name for b in usable)}) "
                           f"accepts any of the {len(buckets)} buckets to tune; `--dry-run --arch {arch}` shows how "
                           "many buckets each backend takes (change --only or --backends)")
    winners: dict[str, list[dict]] = {}
    broken: dict[str, dict[str, str]] = {}  # backend → configs that broke the CUDA context in any bucket
    notes: list[str] = []
    checked = False
    prior = stored_entries(key, target.op, store_root)  # what is stored before this run writes (seeds, `run_study`)
    with ProgressBar(total, f"tune {target.op} on {name}", settings.show_progress) as bar:
        for i, (bucket, bs) in enumerate(plan):
            now = time.perf_counter()
            if now >= deadline:
                skipped += [(bucket, b.name, "op budget used up") for b in bs]
                bar.advance(len(bs))
                continue
            if not bs:
                continue
            if lockstep is not None:
                lockstep.send(("bucket", bucket))
            try:
                inputs, ref = _inputs_and_reference(target, ref_backend, bucket, model, device)
                edge = [] if lockstep is not None else _edge_cases(target, ref_backend, bucket, model, device)
            except Exception as exc:
                reason = f"inputs/reference failed: {_describe(exc)}"
                log.warning("%s %s: %s", target.op, tuned.bucket_label(bucket), reason)
                skipped += [(bucket, b.name, reason) for b in bs]
                bar.advance(len(bs))
                _free(device)
                continue
            # the bucket's share is taken after building its inputs (weights, reference), so a slow
            # build is paid by all remaining buckets, not by this one alone
            now = time.perf_counter()
            share = (deadline - now) / (len(plan) - i) if math.isfinite(deadline) else math.inf
            bucket_deadline = now + min(share, settings.bucket_budget_s or math.inf)
            per_backend = {}
            for j, backend in enumerate(bs):
                now = time.perf_counter()
                backend_deadline = now + (bucket_deadline - now) / (len(bs) - j)
                if backend.name not in broken:
                    broken[backend.name] = context_breakers(settings.storage, key, target.op, backend.name)
                res = run_study(target, backend, bucket, inputs, ref, settings, device=device,
                                device_key=key, deadline=backend_deadline, bar=bar, lockstep=lockstep,
                                warm_start=winners.get(backend.name), broken=broken[backend.name], edge=edge,
                                stored=stored_configs(prior, target.op, backend.name, bucket))
                for why in res.passed_over:
                    log.warning("%s %s [%s]: passed over %s", target.op, tuned.bucket_label(bucket), backend.name,
                                why)
                results.append(res)
                if res.best_config is not None:
                    winners.setdefault(backend.name, []).append(res.best_config)
                if res.config is not None:
                    per_backend[backend.name] = store.backend_result(
                        res.config, res.time_ms, res.default_time_ms, res.trials, res.failed, res.study_name)
                bar.advance(1)
            if per_backend and store_root is not None:
                store_file = store.write_results(store_root, key, target.op, metadata,
                                                 store.merge_bucket(bucket, per_backend))
                tunable = [b for b in per_backend if any(x.name == b and x.config_space for x in bs)]
                if lockstep is None and tunable and not checked:  # once per op: does the op read the store?
                    checked = True
                    notes += _check_lookup(target, tunable[0], bucket, inputs, device)
            del inputs, ref, edge
            _free(device)
    report = OpReport(target.op, name, results, store_file, time.perf_counter() - t_start, skipped, notes)
    if plot_dir is not None and results:
        from pdlab.tuning import plots

        plots.plot_report(report, plot_dir)
    return report


def stored_entries(device_key: str, op: str, store_root: str | os.PathLike | None = None) -> list[Mapping]:
    """The entries (bucket label → entry) of `op`'s store file in the store being written (`store_root`) and in every
    lookup root ($PDLAB_CONFIG_DIR, the shipped folder), first root first; read once per op. Unreadable files are
    skipped (the lookup reports them)."""
    roots = ([Path(store_root)] if store_root is not None else []) + tuned.config_roots()
    out = []
    for path in (store.store_path(root, device_key, op) for root in roots):
        if path.is_file():
            try:
                out.append(tuned.read_store(path)["entries"])
            except ValueError:
                continue
    return out


def stored_configs(files: Sequence[Mapping], op: str, backend: str, bucket: Mapping) -> list[dict]:
    """The configs of `backend` stored for exactly `bucket` in `files` (`stored_entries`; older files' buckets read
    through the op's upgrade), first file first, without repeats."""
    out: list[dict] = []
    for entries in files:
        entry = tuned.nearest_entry(entries, backend, bucket, op=op)
        if entry is None or tuned.bucket_distance(bucket, tuned.upgrade_bucket(op, entry["bucket"])) > 0:
            continue
        cfg = entry["backends"][backend]["config"]
        if cfg not in out:
            out.append(dict(cfg))
    return out


def run_study(target: TuneTarget, backend: Backend, bucket: Mapping, inputs: Any, ref: Any,
              settings: SearchSettings, *, device: torch.device, device_key: str, deadline: float,
              bar: "ProgressBar | None" = None, lockstep: "Lockstep | None" = None,
              warm_start: Sequence[dict] | None = None, broken: Mapping[str, str] | None = None,
              edge: Sequence[tuple[Any, Any]] = (), stored: Sequence[dict] = ()) -> StudyResult:
    """Search `backend`'s config space on one bucket until `deadline` (perf_counter), the trial
    cap or the grid's end; then re-measure best vs default. Resumes a study of the same name.
    warm_start: configs to try first (after the default) in a new TPE/random study.
    stored: the configs already stored for this very bucket (`stored_configs`), tried right after the default in a
    new TPE/random study, so that a re-run measures what is shipped under today's timing and keeps it only if it
    still wins.
    broken: config key → reason, configs that broke the CUDA context on some bucket of this backend
    (`context_breakers`): never run again, here or on any other bucket (a seeded sampler proposes
    the same configs in the same order on every bucket, so each bucket would crash the run again).
    edge: (inputs, reference output) pairs at the target's edge shapes (`TuneTarget.edge_inputs`): the best
    trial must match the reference on each too, else the next-best is checked (up to EDGE_CANDIDATES)."""
    import optuna
    from optuna.trial import TrialState

    from pdlab.kernels.arch import detect_arch

    space = {k: list(v) for k, v in target.search_space(backend, bucket, detect_arch(device)).items()}
    name = _study_for_space(settings.storage, study_name(device_key, target.op, backend.name, bucket), space)
    sampler = _sampler(space, settings)
    study = optuna.create_study(study_name=name, storage=_storage(settings.storage), direction="minimize",
                                sampler=sampler, load_if_exists=True)
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        # left RUNNING by an interrupted run (killed, or the config crashed the process)
        study._storage.set_trial_user_attr(t._trial_id, FAIL_REASON, "interrupted (run killed mid-trial)")
        study.tell(t.number, state=TrialState.FAIL)
    if not study.trials and space and not isinstance(sampler, optuna.samplers.GridSampler):
        # warm start: the default as the backend resolves it for this bucket, the winners of this
        # backend's buckets tuned earlier in the run, then one-knob variations of the default
        default = backend.config()
        resolved = target.resolve(backend.name, default, bucket)
        # knobs the space cannot express resolved (e.g. waves 7.5) keep their auto value
        base = {k: (v if k not in space or v in space[k] else default.get(k, v)) for k, v in resolved.items()}
        seeds = []
        for cfg in [base, default, *stored] + list(reversed(warm_start or []))[:3]:
            enc = _encode(cfg, space)
            if enc and enc not in seeds:
                seeds.append(enc)
        for enc in neighbours(base, space, settings.neighbours, seed=settings.seed):
            if enc not in seeds:
                seeds.append(enc)
        for enc in seeds[:settings.max_trials]:
            study.enqueue_trial(enc, skip_if_exists=True)
    grid = isinstance(sampler, optuna.samplers.GridSampler)
    seen: dict[str, float] = {_key(t.params): t.value for t in study.trials if t.state == TrialState.COMPLETE}
    failed_before = {_key(t.params): t.user_attrs.get(FAIL_REASON, "") for t in study.trials
                     if t.state == TrialState.FAIL and t.params}
    failed_before = {**(broken or {}), **failed_before}
    limit = min(settings.max_trials, space_size(space)) if grid or not space else settings.max_trials
    tol = target.tolerance(bucket)
    first = True  # a started study runs at least one trial, even past its deadline
    while first or time.perf_counter() < deadline:
        first = False
        done = [t for t in study.get_trials(deepcopy=False) if t.state.is_finished()]
        if len(done) >= limit or (grid and sampler.is_exhausted(study)):
            break
        trial = study.ask()
        params = {k: trial.suggest_categorical(k, _choices(v)) for k, v in space.items()}
        cfg = backend.config(_decode(params, space))
        k = _key(trial.params)
        if k in seen:  # TPE re-proposes configs in small spaces: reuse the measurement
            trial.set_user_attr("repeat_of_config", True)
            study.tell(trial, seen[k])
            continue
        if k in failed_before:  # never rerun a config that failed (it may have broken the context)
            trial.set_user_attr(FAIL_REASON, f"repeat of a failed config: {failed_before[k]}"[:400])
            study.tell(trial, state=TrialState.FAIL)
            continue
        try:
            time_ms, reason = measure(target, backend.name, cfg, inputs, ref, tol, settings, device, lockstep)
        except DeviceBroken as exc:
            trial.set_user_attr(FAIL_REASON, str(exc))
            study.tell(trial, state=TrialState.FAIL)
            raise
        if time_ms is None:
            trial.set_user_attr(FAIL_REASON, reason)
            study.tell(trial, state=TrialState.FAIL)
            failed_before[k] = reason
        else:
            seen[k] = time_ms
            study.tell(trial, time_ms)
        if bar is not None:
            best = _best(study)
            bar.note(f"{backend.name} {tuned.bucket_label(bucket)}  trial {trial.number}  "
                     f"best {best:.4g} ms" if best is not None else f"{backend.name} trial {trial.number}: no valid config yet")
    trials = [t for t in study.get_trials(deepcopy=False) if t.state.is_finished()]  # not the queued seeds
    history = [(t.number, t.value, t.state.name) for t in trials]
    failed = sum(t.state == TrialState.FAIL for t in trials)
    res = StudyResult(backend.name, dict(bucket), name, len(trials), failed, None, None, None, None, history)
    if _best(study) is None:
        reasons = [t.user_attrs.get(FAIL_REASON, "") for t in trials if t.state == TrialState.FAIL]
        res.reason = "no trial produced a correct result" + (f" (last: {reasons[-1]})" if reasons else "")
        return res
    ranked, seen_keys = [], set()
    for t in sorted((t for t in trials if t.state == TrialState.COMPLETE and t.value is not None),
                    key=lambda t: t.value):
        if _key(t.params) not in seen_keys:  # TPE repeats: one check per distinct config
            seen_keys.add(_key(t.params))
            ranked.append(t)
    for t in ranked[:EDGE_CANDIDATES] if edge else ranked[:1]:
        cfg = backend.config(_decode(t.params, space))
        wrong = _edge_failure(target, backend.name, cfg, edge, tol, device)
        if not wrong:
            res.best_config = cfg
            break
        res.passed_over.append(f"{cfg} ({t.value:.4g} ms): {wrong}")
    if res.best_config is None:
        res.reason = (f"the {min(len(ranked), EDGE_CANDIDATES)} fastest configs were all wrong at the served "
                      f"shapes; last: {res.passed_over[-1]}")
        return res
    default = backend.config()
    t_best, t_def = remeasure(target, backend.name, res.best_config, default, inputs, ref, tol, settings, device,
                              lockstep)
    if t_best is None and t_def is None:
        res.reason = "re-measurement failed"
        return res
    res.default_time_ms = t_def
    if t_def is not None and (t_best is None or t_def <= t_best):
        res.config, res.time_ms = default, t_def
    else:
        res.config, res.time_ms = res.best_config, t_best
    return res


def measure(target: TuneTarget, backend: str, cfg: dict, inputs: Any, ref: Any, tol: float,
            settings: SearchSettings, device: torch.device, lockstep: "Lockstep | None" = None
            ) -> tuple[float | None, str]:
    """(median ms, "") for a config that runs and matches the reference, else (None, reason).
    With `lockstep` (rank 0 of a multi-rank run) the other ranks measure the same config in step."""
    if lockstep is not None:
        lockstep.send(("measure", backend, cfg, tol))
    return _measure(target, backend, cfg, inputs, ref, tol, settings, device, lockstep)


def context_breakers(storage: Any, device_key: str, op: str, backend: str) -> dict[str, str]:
    """Config keys (as `_key` of the trial params) → reason, for every trial of this device/op/backend
    in `storage`, any bucket, that broke the CUDA context (see `DeviceBroken`)."""
    import optuna
    from optuna.trial import TrialState

    prefix = f"{device_key}|{op}|{backend}|"
    st = _storage(storage)
    out: dict[str, str] = {}
    for summary in optuna.get_all_study_summaries(st, include_best_trial=False):
        if not summary.study_name.startswith(prefix):
            continue
        study = optuna.load_study(study_name=summary.study_name, storage=st)
        for t in study.get_trials(deepcopy=False, states=(TrialState.FAIL,)):
            reason = t.user_attrs.get(FAIL_REASON, "")
            if t.params and BROKE_CONTEXT in reason:
                out[_key(t.params)] = f"broke the CUDA context on {summary.study_name[len(prefix):]}"
    return out


BROKE_CONTEXT = "broke the CUDA context"


class DeviceBroken(RuntimeError):
    """A config left the CUDA context unusable (illegal address, launch failure, device assert): the
    process must end; rerunning the same command resumes with that trial recorded as failed."""


_BROKEN = ("illegal memory access", "unspecified launch failure", "device-side assert", "misaligned address",
           "illegal instruction", "an illegal", "uncorrectable ecc")


def _check_broken(exc: BaseException, device: torch.device, backend: str, cfg: dict) -> None:
    text = str(exc).lower()
    if device.type == "cuda" and any(k in text for k in _BROKEN):
        raise DeviceBroken(f"{backend} config {cfg} {BROKE_CONTEXT} ({_describe(exc)}); rerun the same "
                           "command to resume (this trial is recorded as failed)") from exc


def _measure(target, backend, cfg, inputs, ref, tol, settings, device, lockstep) -> tuple[float | None, str]:
    reason = ""
    try:
        out = target.call(backend, cfg, inputs)
        _sync(device)
        err = float(target.error(out, ref))
        del out
    except Exception as exc:  # compile errors, out of resources, shape rejections, OOM
        _check_broken(exc, device, backend, cfg)
        _free(device)
        err, reason = math.inf, _describe(exc)
    if not math.isfinite(err):
        err = math.inf
    if lockstep is not None:  # every rank takes the same branch: fail if any rank failed
        worst = lockstep.reduce_max(err)
        if worst > err and not reason:
            reason = f"wrong result or error on another rank (worst error {worst:.3g})"
        err = worst
    if not err <= tol:
        return None, reason or f"wrong result: error {err:.3g} > tolerance {tol:.3g}"
    graph = target.cuda_graph and device.type == "cuda" and lockstep is None
    for use_graph in ((True, False) if graph else (False,)):
        try:
            timing = bench(lambda: target.call(backend, cfg, inputs), device=device, warmup=settings.warmup,
                           repeats=settings.repeats,
                           max_seconds=math.inf if lockstep is not None else settings.max_seconds,
                           cuda_graph=use_graph)
            return timing.median_ms, ""
        except Exception as exc:  # not capturable (host sync in the backend): time it eagerly instead
            _check_broken(exc, device, backend, cfg)
            _free(device)
            reason = _describe(exc)
    return None, reason


def remeasure(target: TuneTarget, backend: str, best: dict, default: dict, inputs: Any, ref: Any, tol: float,
              settings: SearchSettings, device: torch.device, lockstep: "Lockstep | None" = None
              ) -> tuple[float | None, float | None]:
    """Best vs default in the same run, alternating, min of the medians: (best_ms, default_ms)."""
    tb, td = [], []
    for _ in range(max(1, settings.remeasure_rounds)):
        for cfg, acc in ((best, tb), (default, td)):
            t, _ = measure(target, backend, cfg, inputs, ref, tol, settings, device, lockstep)
            if t is not None:
                acc.append(t)
        if best == default:
            td = list(tb)
            break
    return (min(tb) if tb else None), (min(td) if td else None)


class Lockstep:
    """Rank 0 announces each step (bucket, measurement, done) to the other ranks of the default
    process group; all ranks then run the same collective calls in the same order."""

    def __init__(self, device: torch.device) -> None:
        import torch.distributed as dist

        self.dist = dist
        self.rank = dist.get_rank()
        self.device = device if dist.get_backend() == "nccl" else torch.device("cpu")

    def send(self, msg: tuple) -> None:
        self.dist.broadcast_object_list([msg], src=0)

    def recv(self) -> tuple:
        box = [None]
        self.dist.broadcast_object_list(box, src=0)
        return box[0]

    def reduce_max(self, x: float) -> float:
        t = torch.tensor([x], dtype=torch.float64, device=self.device)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX)
        return float(t.item())


def follow(target: TuneTarget, model: ModelShape, settings: SearchSettings, device: torch.device,
           lockstep: Lockstep) -> None:
    """The loop of ranks > 0 in a multi-rank tuning run: build what rank 0 builds, measure what it
    measures, until it says done."""
    ref_backend = target.reference_backend() if target.reference_output is None else None
    inputs = ref = None
    while True:
        msg = lockstep.recv()
        if msg[0] == "done":
            return
        if msg[0] == "bucket":
            inputs = ref = None
            _free(device)
            try:
                inputs, ref = _inputs_and_reference(target, ref_backend, msg[1], model, device)
            except Exception as exc:  # rank 0 fails the same way and skips the bucket
                log.warning("rank %d: inputs for %s failed: %s", lockstep.rank, msg[1], _describe(exc))
        elif msg[0] == "measure":
            _, backend, cfg, tol = msg
            _measure(target, backend, cfg, inputs, ref, tol, settings, device, lockstep)


def _check_lookup(target: TuneTarget, backend: str, bucket: Mapping, inputs: Any, device: torch.device) -> list[str]:
    """Call the op once without a config and check it asks the store for this bucket's key set;
    a mismatch means the op would never find what was just stored."""
    tuned.clear_cache()
    with tuned.observe() as seen:
        try:
            target.call(backend, None, inputs)
            _sync(device)
        except Exception as exc:
            return [f"{target.op}[{backend}] called without a config failed ({_describe(exc)}); "
                    "cannot check that it reads the tuned store"]
    asked = [b for op, name, b in seen if op == target.op and name == backend]
    if not asked:
        return [f"{target.op}[{backend}] did not look up a tuned config when called without one: the stored "
                "configs are not used by the op yet"]
    if any(set(b) == set(bucket) for b in asked):
        return []
    return [f"{target.op}[{backend}] looks up buckets with keys {sorted(asked[0])} but the tuner stores "
            f"{sorted(bucket)}: the op will not find these configs until both use the keys of docs/tuning.md"]


EDGE_CANDIDATES = 5  # the fastest trials checked at the edge shapes before the bucket gives up


def _edge_cases(target: TuneTarget, ref_backend: Backend | None, bucket: Mapping, model: ModelShape,
                device: torch.device) -> list[tuple[Any, Any]]:
    """(inputs, reference output) at the target's edge shapes for this bucket (none without edge_inputs)."""
    if target.edge_inputs is None:
        return []
    out = []
    for inputs in target.edge_inputs(bucket, model, device):
        ref = (target.reference_output(inputs) if target.reference_output is not None
               else target.call(ref_backend.name, ref_backend.config(), inputs))
        out.append((inputs, ref))
    _sync(device)
    return out


def _edge_failure(target: TuneTarget, backend: str, cfg: dict, edge: Sequence[tuple[Any, Any]], tol: float,
                  device: torch.device) -> str:
    """"" when `cfg` matches the reference on every edge case, else what went wrong on the first that does not."""
    for n, (inputs, ref) in enumerate(edge):
        try:
            out = target.call(backend, cfg, inputs)
            _sync(device)
            err = float(target.error(out, ref))
        except Exception as exc:
            _check_broken(exc, device, backend, cfg)
            return f"edge case {n}: {_describe(exc)}"
        if not err <= tol:  # NaN (a row past a sequence was read) fails too
            return f"edge case {n}: error {err:.3g} > tolerance {tol:.3g}"
    return ""


def _inputs_and_reference(target: TuneTarget, ref_backend: Backend | None, bucket: Mapping, model: ModelShape,
                          device: torch.device) -> tuple[Any, Any]:
    inputs = target.build(bucket, model, device)
    if target.reference_output is not None:
        ref = target.reference_output(inputs)
    else:
        ref = target.call(ref_backend.name, ref_backend.config(), inputs)
    _sync(device)
    return inputs, ref


# ---------------------------------------------------------------------------------------------


def _sampler(space: Mapping[str, list], settings: SearchSettings):
    import optuna

    kind = settings.sampler
    if kind == "auto":
        kind = "grid" if space and space_size(space) <= GRID_MAX else "tpe"
    if kind == "grid" and space:
        return _Grid({k: _choices(v) for k, v in space.items()}, seed=settings.seed)
    if kind == "random":
        return optuna.samplers.RandomSampler(seed=settings.seed)
    if kind in ("tpe", "grid"):
        return optuna.samplers.TPESampler(seed=settings.seed, n_startup_trials=min(10, max(2, settings.max_trials // 5)))
    raise ValueError(f"--sampler {settings.sampler!r}: choose auto, tpe, grid or random")


_STORAGES: dict[str, Any] = {}


def _storage(spec):
    """One optuna storage object per URL for the whole run (opening an RDB checks its schema: slow).
    An optuna storage object (e.g. InMemoryStorage) passes through."""
    if not isinstance(spec, str):
        return spec
    if spec not in _STORAGES:
        import optuna

        _STORAGES[spec] = optuna.storages.RDBStorage(spec)
    return _STORAGES[spec]


def _study_for_space(storage, name: str, space: Mapping[str, list]) -> str:
    """`name`, or `name|space=<digest>` where the study of that name searched other values of a knob (a newer pdlab,
    another narrowing): optuna cannot resume a study whose choices changed, and the first run's study stays as it
    is, for a run at its space to resume."""
    import hashlib

    from optuna.distributions import CategoricalDistribution

    st = _storage(storage)
    try:
        study_id = st.get_study_id_from_name(name)
    except KeyError:
        return name
    want = {k: CategoricalDistribution(_choices(v)) for k, v in space.items()}
    trials = st.get_all_trials(study_id, deepcopy=False)
    if all(want.get(k, d) == d for t in trials for k, d in t.distributions.items()):
        return name
    digest = hashlib.sha256(repr(sorted((k, [repr(x) for x in v]) for k, v in space.items())).encode()).hexdigest()
    return f"{name}|space={digest[:8]}"


def _grid_class():
    import optuna

    class Grid(optuna.samplers.GridSampler):
        """GridSampler for ask/tell: the search loop checks `is_exhausted` itself (the stock
        `after_trial` calls `study.stop()`, which only works inside `study.optimize`)."""

        def after_trial(self, study, trial, state, values) -> None:
            pass

    return Grid


def _Grid(space, seed):
    return _grid_class()(space, seed=seed)


def _primitive(v: object) -> bool:
    return v is None or isinstance(v, (bool, int, float, str))


def neighbours(config: Mapping[str, Any], space: Mapping[str, list], limit: int, seed: int = 0) -> list[dict]:
    """Up to `limit` configs that differ from `config` in one knob (encoded as optuna params), spread
    over the knobs: a seeded shuffle of each knob's other values, then round-robin over knobs.
    Knobs whose value in `config` is not among the space's choices are left to the sampler."""
    import random

    rng = random.Random(seed)
    base = _encode(config, space)
    per_knob = []
    for k, values in space.items():
        if k not in base:
            continue
        others = [v for v in values if v != config[k]]
        rng.shuffle(others)
        per_knob.append([(k, v) for v in others])
    rng.shuffle(per_knob)
    out: list[dict] = []
    while len(out) < limit and any(per_knob):
        for options in per_knob:
            if options and len(out) < limit:
                k, v = options.pop(0)
                out.append(_encode({**config, k: v}, space))
    return out


def _choices(values: list) -> list:
    """Values optuna can store: primitives as they are, anything else by its index as text."""
    return list(values) if all(_primitive(v) for v in values) else [f"#{i}" for i in range(len(values))]


def _decode(params: Mapping[str, Any], space: Mapping[str, list]) -> dict:
    out = {}
    for k, v in params.items():
        values = space.get(k, [])
        out[k] = values[int(v[1:])] if not all(_primitive(x) for x in values) else v
    return out


def _encode(cfg: Mapping[str, Any], space: Mapping[str, list]) -> dict:
    """The optuna params of `cfg` (knobs whose value is not among the space's choices are left out)."""
    out = {}
    for k, values in space.items():
        if k in cfg and cfg[k] in values:
            out[k] = cfg[k] if all(_primitive(x) for x in values) else f"#{values.index(cfg[k])}"
    return out


def _key(params: Mapping) -> str:
    return repr(sorted(params.items()))


def _best(study) -> float | None:
    try:
        return study.best_value
    except ValueError:
        return None


def _describe(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    first = text[0] if text else ""
    if isinstance(exc, torch.OutOfMemoryError):
        return f"out of memory: {first[:200]}"
    return f"{type(exc).__name__}: {first[:300]}"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
