"""Engine: owns the model, the KV pool, the device page table, the decode CUDA graphs and the
sampler. `forward(batch)` turns a scheduled `Batch` into device tensors, runs the model and samples;
it never calls back into the scheduler.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from pdlab.runtime.config import ConfigError, EngineConfig
from pdlab.runtime.context import ForwardContext
from pdlab.runtime.core import Batch
from pdlab.kernels.env import ENV
from pdlab.runtime.engine.sample import SampleOutput, SamplingTensors, greedy, sample
from pdlab.runtime.memory.pool import MLAKVPool
from pdlab.runtime.memory.table import PageTable

log = logging.getLogger("pdlab.runtime")

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass
class PendingStep:
    """A launched, not yet collected step (device results + the copy/event that brings them home)."""

    batch: Batch
    t0: float = 0.0
    sampled: list = field(default_factory=list)
    sreqs: list = field(default_factory=list)
    out: SampleOutput | None = None
    host_ids: torch.Tensor | None = None
    done: object = None
    ev0: object = None
    ev1: object = None


@dataclass
class ForwardOutput:
    """Host results of one step for the requests that sampled (batch order, others skipped).

    sampled: indices into batch.reqs that got a token; next_ids: their tokens, or a negative code for a request whose
    logits could not be sampled (`pdlab.runtime.core.bad_logits_error`); logprobs: per sampled request None or
    (chosen_logprob, [(token_id, logprob), ...])."""

    sampled: list[int]
    next_ids: list[int]
    logprobs: list
    gpu_ms: float = 0.0


class Engine:
    """Runs forward steps for the scheduler.

    model: object with `forward(input_ids [T] int64, positions [T] int64, ctx) -> logits [B, V] fp32`;
    None loads `pdlab.runtime.model.load_model(cfg.model_path, device, dtype)`.
    num_layers / vocab_size / max_context_len: taken from `model_config` (HF names) unless given.
    """

    def __init__(self, cfg: EngineConfig, model=None, tokenizer=None, model_config=None, *,
                 max_running_requests: int = 256, graph_capture: bool | None = None):
        self.cfg = cfg
        self.device = torch.device(cfg.resolved_device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.dtype = TORCH_DTYPES[cfg.resolved_dtype]
        use_graph = cfg.use_cuda_graph if graph_capture is None else graph_capture
        context_len = None  # set by preflight where the engine loads the model itself
        if model is None:
            from pdlab.runtime.engine.synthetic import is_synthetic, load_synthetic
            # settings that conflict with the model are refused before any weight is read
            context_len = preflight(cfg)
            from pdlab.runtime.model import LoadOptions
            layout = {"weights_layout": None if cfg.moe_weights_layout == "auto" else cfg.moe_weights_layout}
            options = LoadOptions(moe_kwargs=layout)
            if use_graph and self.device.type == "cuda":
                # Decode steps must not sync with the host to be captured: MoE layers dispatch decode
                # tokens in low-latency mode (masked layout, no host sync), one slot per running request.
                options = LoadOptions(moe_decode_mode="low_latency",
                                      moe_kwargs={"num_max_dispatch_tokens_per_rank": max_running_requests, **layout})
            if is_synthetic(cfg.model_path):
                model, tokenizer, model_config = load_synthetic(cfg.model_path, self.device, self.dtype, cfg.seed,
                                                                options)
            else:
                from pdlab.runtime.model import load_model  # the model package is optional for the engine
                model, tokenizer, model_config = load_model(cfg.model_path, self.device, self.dtype, options=options)
        self.model, self.tokenizer, self.model_config = model, tokenizer, model_config
        self.num_layers = int(_attr(model_config, "num_hidden_layers"))
        self.vocab_size = int(_attr(model_config, "vocab_size"))
        if context_len is None:  # a model handed in: its config is checked here
            context_len = _checked_context_len(cfg, model_config)
        self.max_context_len = context_len
        self.page_size = cfg.page_size
        self.max_running_requests = max_running_requests
        num_pages = self._num_pages()
        max_pages = self._check_pool_holds_a_request(num_pages)
        self._check_kv_memory(num_pages, max_pages)
        self.pool = MLAKVPool(self.num_layers, num_pages, cfg.page_size, cfg.resolved_kv_dtype,
                              self.device, kv_scale=cfg.kv_scale,
                              allocator=None if cfg.allocator == "auto" else cfg.allocator,
                              copy_chunk_pages=cfg.kv_backup_chunk_pages)
        self.page_table = PageTable(max_running_requests, max_pages, self.device)
        self.graphs = None
        self.graph_error: str | None = None
        self.prefill_graphs = None
        self.prefill_graph_error: str | None = None
        self.profile = ENV.step_profile and self.device.type == "cuda"
        self.last_gpu_ms = 0.0
        if use_graph:
            from pdlab.runtime.engine.graph import GraphRunner

            self.ensure_current_device()
            try:
                self.graphs = GraphRunner(self, cfg.cuda_graph_bs)
            except Exception as exc:  # e.g. an op that syncs with the host: serve eagerly, and say so
                self.graph_error = f"{type(exc).__name__}: {exc}"
                log.warning("CUDA graph capture failed (%s); decode runs eagerly", self.graph_error)
                try:
                    torch.cuda.synchronize(self.device)
                except RuntimeError as sync_exc:  # a sticky error: nothing will run, say it at start
                    raise RuntimeError(f"CUDA graph capture failed ({self.graph_error}) and left the device "
                                       f"unusable ({sync_exc}); start with --disable-cuda-graph") from exc
        n = self._prefill_graph_tokens(graph_capture)
        if n:
            from pdlab.runtime.engine.graph import PrefillGraphRunner, default_prefill_token_sizes

            self.ensure_current_device()
            try:
                self.prefill_graphs = PrefillGraphRunner(self, default_prefill_token_sizes(n))
            except Exception as exc:  # e.g. a dispatcher that syncs with the host: prefill eagerly, and say so
                self.prefill_graph_error = f"{type(exc).__name__}: {exc}"
                log.warning("prefill CUDA graph capture failed (%s); prefill runs eagerly", self.prefill_graph_error)
                try:
                    torch.cuda.synchronize(self.device)
                except RuntimeError as sync_exc:
                    raise RuntimeError(f"prefill CUDA graph capture failed ({self.prefill_graph_error}) and left the "
                                       f"device unusable ({sync_exc}); start with --cuda-graph-max-prefill-tokens 0"
                                       ) from exc

    def _prefill_graph_tokens(self, graph_capture: bool | None) -> int:
        """The largest prefill step (tokens) to capture graphs for: 0 off CUDA, with graphs disabled, on a decode
        server (it runs no prefill), and at most the context."""
        cfg = self.cfg
        if self.device.type != "cuda" or cfg.disable_cuda_graph or graph_capture is False \
                or getattr(cfg, "role", "colocated") == "decode":
            return 0
        return min(cfg.cuda_graph_max_prefill_tokens, self.page_table.max_pages * self.page_size)

    @contextlib.contextmanager
    def eager_prefill(self):
        """Prefill steps inside run eagerly (the start-up warm-up: it compiles the kernels of the steps that do not
        fit a prefill graph)."""
        saved, self.prefill_graphs = self.prefill_graphs, None
        try:
            yield
        finally:
            self.prefill_graphs = saved

    # ---- sizes -------------------------------------------------------------------------------
    def _num_pages(self) -> int:
        cfg = self.cfg
        if cfg.max_total_tokens is not None:
            return -(-cfg.max_total_tokens // cfg.page_size) + 1  # + the dummy page
        per_page = MLAKVPool.bytes_per_token(self.num_layers, cfg.resolved_kv_dtype) * cfg.page_size
        from pdlab.runtime.memory.budget import available_bytes

        shared = cfg.device_servers > 1
        if shared and self.device.type == "cuda":  # the load's transients, cached here, are the next server's
            torch.cuda.empty_cache()
        free = available_bytes(self.device)
        budget = kv_budget(8 << 30 if free is None else free, cfg.mem_fraction_static, cfg.device_servers,
                           cfg.device_server_index, load_bytes(self._weight_bytes(), self.device) if shared else 0)
        if self.device.type != "cuda":
            budget = min(budget, 4 << 30)  # CPU: at most 4 GiB
        return max(2, int(budget // per_page))

    def _weight_bytes(self) -> int:
        """Bytes of this engine's model parameters and buffers (each storage once); 0 for a model that is not a
        torch module."""
        seen, total = set(), 0
        tensors = [*getattr(self.model, "parameters", lambda: [])(), *getattr(self.model, "buffers", lambda: [])()]
        for t in tensors:
            key = (t.untyped_storage().data_ptr(), t.device)
            if key not in seen:
                seen.add(key)
                total += t.untyped_storage().nbytes()
        return total

    def _check_pool_holds_a_request(self, num_pages: int) -> int:
        """ConfigError unless a pool of `num_pages` (the dummy page included) holds one request of
        max_context_len tokens; returns the pages that request needs."""
        return _require_pool_holds(self.cfg, self.max_context_len, num_pages)

    def _check_kv_memory(self, num_pages: int, max_pages: int) -> None:
        """Refuse a KV pool + page table that cannot fit the device's available memory before allocating them
        (MemoryBudgetError naming the settings that size them)."""
        from pdlab.runtime.memory.budget import check_fits

        cfg = self.cfg
        pool = num_pages * cfg.page_size * MLAKVPool.bytes_per_token(self.num_layers, cfg.resolved_kv_dtype)
        table = (self.max_running_requests + 1) * max_pages * 4
        what = (f"the KV pool ({num_pages} pages of {cfg.page_size} tokens over {self.num_layers} layers, "
                f"{cfg.resolved_kv_dtype}) and the page table ({self.max_running_requests + 1} rows of {max_pages} "
                "pages)")
        if pool >= table:
            fix = (f"lower --max-total-tokens {cfg.max_total_tokens}" if cfg.max_total_tokens is not None
                   else f"lower --mem-fraction-static {cfg.mem_fraction_static}")
        else:  # one row per running request, one column per page of the longest request
            fix = (f"lower --max-running-requests {self.max_running_requests} or --max-context-len "
                   f"{self.max_context_len}")
        check_fits(what, pool + table, self.device, fix)

    def ensure_current_device(self) -> None:
        """Make this engine's GPU the calling thread's current device (Triton launches on the current
        device; an engine on cuda:1 driven from a thread whose current device is cuda:0 would fail)."""
        if self.device.type == "cuda" and torch.cuda.current_device() != self.device.index:
            torch.cuda.set_device(self.device)

    # ---- one step ----------------------------------------------------------------------------
    def forward(self, batch: Batch) -> ForwardOutput:
        """Run one step. Every request must already hold pages for cached_len + extend_len tokens."""
        return self.collect(self.launch(batch))

    def launch(self, batch: Batch, input_ids: torch.Tensor | None = None) -> "PendingStep":
        """Enqueue a step's forward + sampling on the device and return without waiting for it.
        input_ids: [B] int64 device tensor of a decode step's input tokens (the previous step's
        sampled tokens, not yet on the host); None = read them from the requests."""
        reqs = batch.reqs
        self.ensure_current_device()
        for r, n in zip(reqs, batch.extend_lens):
            if len(r.pages) * self.page_size < r.cached_len + n:
                raise RuntimeError(f"request {r.rid}: {len(r.pages)} pages cannot hold {r.cached_len + n} tokens; "
                                   "the scheduler must allocate before the step")
        self.page_table.sync(reqs)
        p = PendingStep(batch, t0=time.perf_counter())
        if self.profile:
            p.ev0, p.ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            p.ev0.record()
        if batch.is_decode and self.graphs is not None and self.graphs.can_run(len(reqs)):
            logits = self.graphs.replay(reqs, input_ids)
        elif not batch.is_decode and self.prefill_graphs is not None and self.prefill_graphs.can_run(batch):
            logits = self.prefill_graphs.replay(batch)
        else:
            ids, positions, ctx = self.prepare(batch, input_ids)
            logits = self.model.forward(ids, positions, ctx)
        # a decode step samples every request (with overlap, seq_len on the host lags by the token in flight)
        p.sampled = list(range(len(reqs))) if batch.is_decode else [i for i in range(len(reqs)) if batch.samples(i)]
        if not p.sampled:
            return p
        if len(p.sampled) != len(reqs):
            logits = logits[torch.tensor(p.sampled, device=logits.device)]
        p.sreqs = [reqs[i] for i in p.sampled]
        if all(r.params.temperature == 0.0 and r.params.logprobs is None for r in p.sreqs):
            p.out = greedy(logits)  # fast path: no per-row settings
        else:
            # the output index each row samples, from cached_len: with overlap, output_ids lags by the token in flight
            steps = [reqs[i].cached_len + batch.extend_lens[i] - reqs[i].prompt_len for i in p.sampled]
            p.out = sample(logits, SamplingTensors.from_reqs(p.sreqs, self.vocab_size, logits.device, steps))
        if self.profile:
            p.ev1.record()
        if self.device.type == "cuda" and p.out.chosen_logprobs is None:
            p.host_ids = torch.empty(len(p.sampled), dtype=torch.int64, pin_memory=True)
            p.host_ids.copy_(p.out.checked_ids, non_blocking=True)
            p.done = torch.cuda.Event()
            p.done.record()
        return p

    def collect(self, p: "PendingStep") -> ForwardOutput:
        """Wait for a launched step and return its host results."""
        if p.out is None:
            return ForwardOutput([], [], [])
        if p.done is not None:
            p.done.synchronize()
            next_ids, lps = p.host_ids.tolist(), [None] * len(p.sampled)
        else:
            next_ids, lps = _to_host(p.out, p.sreqs)
        gpu_ms = p.ev0.elapsed_time(p.ev1) if p.ev0 is not None else (time.perf_counter() - p.t0) * 1e3
        self.last_gpu_ms = gpu_ms
        return ForwardOutput(p.sampled, next_ids, lps, gpu_ms=gpu_ms)

    def prepare(self, batch: Batch, input_ids: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, ForwardContext]:
        """Device tensors of a step: input_ids [T] int64, positions [T] int64, and its ForwardContext.
        input_ids: optional [B] int64 device tensor overriding a decode step's input tokens."""
        reqs, ext = batch.reqs, batch.extend_lens
        ps = self.page_size
        if batch.is_decode:
            toks = [0] * len(reqs) if input_ids is not None else [r.token_at(r.cached_len) for r in reqs]
            host = torch.tensor([toks, [r.cached_len for r in reqs], [r.table_row for r in reqs]], dtype=torch.int64)
            host = host.pin_memory() if self.device.type == "cuda" else host
            dev = host.to(self.device, non_blocking=True)
            return self.decode_tensors(dev[0] if input_ids is None else input_ids, dev[1], dev[2], len(reqs))
        ids, pos, slots = [], [], []
        for r, n in zip(reqs, ext):
            ids.extend(r.tokens(r.cached_len, r.cached_len + n))
            p = np.arange(r.cached_len, r.cached_len + n, dtype=np.int64)
            pos.append(p)
            slots.append(np.asarray(r.pages, dtype=np.int64)[p // ps] * ps + p % ps)
        lens = np.asarray(ext, dtype=np.int64)
        seqlens = np.asarray([r.cached_len + n for r, n in zip(reqs, ext)], dtype=np.int32)
        qo = np.zeros(len(reqs) + 1, dtype=np.int32)
        qo[1:] = np.cumsum(lens)
        d = self.device
        max_pages = int(max(-(-s // ps) for s in seqlens))
        rows = torch.tensor([r.table_row for r in reqs], dtype=torch.int64, device=d)
        ctx = ForwardContext(
            is_decode=False, block_table=self.page_table.table[rows, :max_pages],
            seqlens=torch.from_numpy(seqlens).to(d), qo_indptr=torch.from_numpy(qo).to(d),
            slots=torch.from_numpy(np.concatenate(slots)).to(d),
            logits_indices=torch.from_numpy(qo[1:].astype(np.int64) - 1).to(d),
            kv_caches=self.pool.kv_caches, kv_scale=self.pool.kv_scale, max_q_len=int(lens.max()))
        return (torch.tensor(ids, dtype=torch.int64).to(d), torch.from_numpy(np.concatenate(pos)).to(d), ctx)

    def decode_tensors(self, input_ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor,
                       bs: int) -> tuple[torch.Tensor, torch.Tensor, ForwardContext]:
        """Decode-step tensors from device input_ids/positions/rows [bs] int64 (graph-safe: no host sync).
        Padded rows use the dummy table row: they read and write only the reserved page 0."""
        ps = self.page_size
        block_table = self.page_table.table.index_select(0, rows)
        page = block_table.gather(1, (positions // ps)[:, None])[:, 0].to(torch.int64)
        ctx = ForwardContext(
            is_decode=True, block_table=block_table, seqlens=(positions + 1).to(torch.int32),
            qo_indptr=torch.arange(bs + 1, dtype=torch.int32, device=self.device), slots=page * ps + positions % ps,
            logits_indices=torch.arange(bs, dtype=torch.int64, device=self.device),
            kv_caches=self.pool.kv_caches, kv_scale=self.pool.kv_scale, max_q_len=1)
        return input_ids, positions, ctx

    def warmup_token_counts(self, max_tokens: int) -> list[int]:
        """Prefill step sizes (tokens, 1..max_tokens) at which the model's MoE experts first launch each of their
        kernel variants (`MoELayer.warmup_token_counts` of its first MoE layer: all have the same shapes), for the
        start-up warm-up; [] for a model without one."""
        moe = _first_moe(self.model)
        return moe.warmup_token_counts(max_tokens, "normal") if moe is not None else []

    # ---- start-up report ----------------------------------------------------------------------
    def describe(self) -> list[str]:
        """Lines for the start-up log: KV pool, graphs, and which backend + config each op uses."""
        p = self.pool
        lines = [f"device {self.device}, dtype {self.cfg.resolved_dtype}, KV {p.kv_dtype} page {p.page_size}: "
                 f"{p.allocator.capacity} pages = {p.max_tokens} tokens over {p.num_layers} layers "
                 f"({type(p.allocator).__name__}), max context {self.max_context_len}",
                 "cuda graphs: " + (f"batch sizes {self.graphs.batch_sizes}" if self.graphs else
                                    f"off (capture failed: {self.graph_error})" if self.graph_error else
                                    "off (prefill server: no decode steps)" if getattr(self.cfg, "role", "") == "prefill"
                                    else "off (eager)"),
                 "prefill cuda graphs: " + self._prefill_graph_line()]
        lines += _with_model_choices(describe_ops(self.device), self.model)
        return lines

    def _prefill_graph_line(self) -> str:
        g = self.prefill_graphs
        if g is not None:
            return f"{g.token_sizes} tokens, at most {g.max_seqs} sequences of {g.positions} tokens"
        return f"off (capture failed: {self.prefill_graph_error})" if self.prefill_graph_error else "off (eager)"


def _first_moe(model):
    """The first MoELayer of the model (a module's `moe` attribute with runners), or None."""
    for m in (model.modules() if hasattr(model, "modules") else []):
        moe = getattr(m, "moe", None)
        if moe is not None and hasattr(moe, "runners"):
            return moe
    return None


def _with_model_choices(lines: list[str], model) -> list[str]:
    """Replace the MoE ops' generic lines by what the model's MoE layers were built with (runner and
    dispatcher per dispatch mode, payload), which is what is served."""
    moe = _first_moe(model)
    if moe is None:
        return lines
    runners = ", ".join(f"{mode}: {name}" for mode, name in moe.runners.items())
    dispatchers = ", ".join(f"{mode}: {d.name}" for mode, d in moe.dispatchers.items())
    cfg = f" config {moe.runner_config}" if getattr(moe, "runner_config", None) else " config by shape (tuned or default)"
    out = [ln for ln in lines if not ln.startswith(("op moe_experts:", "op moe_dispatch:"))]
    layout = {"modelopt": "as loaded", "tiled": "tiled", "fragment": "in fragment order"}.get(
        getattr(moe.weights, "nvfp4_layout", "modelopt"), "as loaded")
    out += [f"op moe_experts (model): runner {runners}, payload {moe.payload},{cfg}, NVFP4 weights {layout}",
            f"op moe_dispatch (model): {dispatchers}"]
    return out


def describe_ops(device: torch.device) -> list[str]:
    """One line per registered op: the backend selected on `device` and where its config comes from."""
    import importlib

    from pdlab.kernels import registry
    for pkg in ("pdlab.attention", "pdlab.moe"):  # registering backends happens at import
        try:
            importlib.import_module(pkg)
        except Exception as exc:  # an op package that fails to import is reported, not fatal
            log.warning("cannot import %s: %s", pkg, exc)
    try:
        from pdlab.kernels.tuned import tuned_summary
    except ImportError:
        tuned_summary = None
    lines = []
    for op in registry.ops():
        try:
            b = registry.select(op, device=device)
        except Exception as exc:
            lines.append(f"op {op}: no usable backend ({exc})")
            continue
        # configs are looked up per call shape; here only whether a tuned file covers the op
        cfg = b.config()
        source = f"default {dict(cfg)}" if cfg else "default"
        if tuned_summary is not None:
            try:
                source = (tuned_summary(op, b.name, device) or "no tuned file for this device") + f", else {source}"
            except Exception as exc:
                source = f"{source} (tuned lookup failed: {exc})"
        plan = ""
        if b.options.get("host_plan") and op == "mla_decode":
            plan = ("; plans on the host: CUDA-graph decode re-plans it before each replay" if b.options.get(
                "graph_replan") else "; not in CUDA-graph decode (plans on the host): graphs take the next backend")
        lines.append(f"op {op}: backend {b.name}, config {source}{plan}")
    return lines


def context_limit(model_config) -> tuple[int | None, str]:
    """The longest context `model_config` was trained or RoPE-scaled for, and where that number comes from:
    max_position_embeddings, raised to YaRN's original_max_position_embeddings × factor where that is larger.
    (None, "") for a config that states neither."""
    mpe = int(getattr(model_config, "max_position_embeddings", 0) or 0)
    limit, source = (mpe, f"max_position_embeddings {mpe}") if mpe > 0 else (None, "")
    rope = getattr(model_config, "rope", None)
    if rope is not None and getattr(rope, "kind", "default") == "yarn":
        orig, factor = int(rope.original_max_position_embeddings), float(rope.factor)
        scaled = int(orig * factor)
        if limit is None or scaled > limit:
            limit, source = scaled, f"YaRN original_max_position_embeddings {orig} × factor {factor:g} = {scaled}"
    return limit, source


def preflight(cfg: EngineConfig) -> int:
    """The settings of `cfg` checked against the model `cfg.model_path` names, from its config alone (no weight is
    read): a max_context_len beyond the model's context (ConfigError unless allow_long_context) and a
    max_total_tokens too small for one maximal request (ConfigError). Returns the context length that would be
    served. The engine runs it before loading; launchers run it before starting any process, so a bad setting is
    one line, not a child's traceback."""
    ctx = _checked_context_len(cfg, _model_config_of(cfg.model_path))
    if cfg.max_total_tokens is not None:
        _require_pool_holds(cfg, ctx, -(-cfg.max_total_tokens // cfg.page_size) + 1)
    return ctx


def load_bytes(weight_bytes: int, device: torch.device) -> int:
    """Bytes a server of this model needs free to load it: its weights, or on a CUDA device the peak this process
    reserved while loading them where higher (expert weights are built in bf16 chunks before they are quantized)."""
    if device.type != "cuda":
        return weight_bytes
    return max(weight_bytes, int(torch.cuda.max_memory_reserved(device)))


def kv_budget(free: int, fraction: float, servers: int = 1, index: int = 0, weight_bytes: int = 0) -> float:
    """Bytes of KV pool for a server that sees `free` bytes of its device free, its model loaded.

    Alone (servers 1): `fraction` of `free`. Shared: `servers` servers of one model (`weight_bytes` each: what
    one needs free to load it, `load_bytes`) are
    started one after another on the device, and each takes an equal share P of `fraction` of the memory left
    once every server's weights are loaded. The server at `index` sees free = F0 - (index + 1)·W - index·P (F0:
    free before any server loaded), so with G = F0 - servers·W and P = fraction·G / servers:
    P = fraction · (free - (servers - index - 1)·W) / (servers - fraction·index)."""
    if servers <= 1:
        return free * fraction
    left = max(0, free - (servers - index - 1) * weight_bytes)  # the later servers' weights still to come
    return fraction * left / (servers - fraction * index)


def _require_pool_holds(cfg: EngineConfig, max_context_len: int, num_pages: int) -> int:
    """ConfigError unless a pool of `num_pages` pages (the dummy page 0 included) holds one request of
    max_context_len tokens; returns the pages that request needs."""
    ps = cfg.page_size
    max_pages = -(-max_context_len // ps)
    if num_pages - 1 < max_pages:
        more = (f"raise --max-total-tokens to at least {max_pages * ps}" if cfg.max_total_tokens is not None else
                f"raise --mem-fraction-static {cfg.mem_fraction_static:g}, give --max-total-tokens {max_pages * ps}")
        raise ConfigError(
            f"the KV pool holds {num_pages - 1} pages of {ps} tokens, fewer than one maximal request needs "
            f"({max_pages} pages for max_context_len {max_context_len}); {more} or lower --max-context-len")
    return max_pages


def _checked_context_len(cfg: EngineConfig, model_config) -> int:
    """The served context: `cfg.max_context_len`, else the model's (4096 for a config that states none). A
    max_context_len beyond the model's `context_limit` is refused (ConfigError naming both and the opt-in)
    unless `allow_long_context` is set: positions past it are outside what RoPE was trained or scaled for, and
    the model's outputs there are untested at best."""
    limit, source = context_limit(model_config)
    want = cfg.max_context_len
    if want is None:
        return int(getattr(model_config, "max_position_embeddings", 0) or 0) or 4096
    if limit is not None and want > limit:
        if not cfg.allow_long_context:
            raise ConfigError(f"max_context_len {want} exceeds the model's context of {limit} tokens ({source}); "
                              f"lower --max-context-len to at most {limit}, or pass --allow-long-context to serve "
                              "positions the model was not trained for (outputs there may be garbage)")
        log.warning("max_context_len %d exceeds the model's context of %d tokens (%s); serving it because "
                    "allow_long_context is set: outputs past %d tokens may be garbage", want, limit, source, limit)
    return want


def _model_config_of(model_path: str | None):
    """The config of the model `model_path` names (synthetic spec, checkpoint directory, or None: the embedded
    tiny one) without loading any weight, so settings that conflict with it fail before the load."""
    from pdlab.runtime.engine.synthetic import is_synthetic, synthetic_config
    if is_synthetic(model_path):
        return synthetic_config(model_path)
    if model_path is None:
        from pdlab.runtime.model.tiny import TINY_CONFIG
        return TINY_CONFIG
    from pdlab.runtime.model.loader import read_model_config
    return read_model_config(model_path)


def _attr(cfg, name: str):
    if cfg is None or getattr(cfg, name, None) is None:
        raise ConfigError(f"model config lacks {name!r}; the model loader must return a config with it")
    return getattr(cfg, name)


def _to_host(out: SampleOutput, reqs) -> tuple[list[int], list]:
    """One device→host transfer for tokens (`checked_ids`: negative codes flag unsampleable logits) and logprobs."""
    parts = [out.checked_ids.to(torch.float64)[:, None]]
    if out.chosen_logprobs is not None:
        parts.append(out.chosen_logprobs.to(torch.float64)[:, None])
        if out.top_ids is not None:
            parts += [out.top_ids.to(torch.float64), out.top_logprobs.to(torch.float64)]
    host = torch.cat(parts, dim=1).cpu().numpy() if len(parts) > 1 else None
    if host is None:
        return out.checked_ids.tolist(), [None] * len(reqs)
    ids = host[:, 0].astype(np.int64).tolist()
    lps = []
    n = out.top_ids.shape[1] if out.top_ids is not None else 0
    for i, r in enumerate(reqs):
        want = r.params.logprobs
        if want is None:
            lps.append(None)
            continue
        top = [(int(host[i, 2 + j]), float(host[i, 2 + n + j])) for j in range(min(want, n))]
        lps.append((float(host[i, 1]), top))
    return ids, lps
