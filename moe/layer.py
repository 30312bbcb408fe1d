"""MoELayer: route → (quantize) → dispatch → experts → combine, plus shared experts.

One layer serves prefill (normal dispatch → Contiguous layout) and decode (low-latency dispatch →
Masked layout); which modes it serves is fixed at construction, where every pairing that cannot
work (dispatcher mode vs the runner's layouts, payload vs runner, token budget vs the low-latency
buffer) is rejected with the reason and the fix. Under expert parallelism each rank holds
E / ep_size experts (the slice [rank·E_l, (rank+1)·E_l) of the full ExpertWeights) and its own tokens.

Stage timing: set `layer.stage_hook` to a callable `name -> context manager`; forward wraps each of
route / quantize / dispatch / experts / combine / shared in it (bench uses CUDA events there). The
stage methods are public too, so a benchmark can time each one on its own.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Mapping

import torch

from pdlab.kernels.contracts import ShapeError, describe_tensor
from pdlab.moe.config import MoEConfig
from pdlab.moe.dispatch import BaseDispatcher, DispatchHandle, TokenPayload, create_dispatcher
from pdlab.moe.dispatch.base import LAYOUT_OF_MODE, MODES
from pdlab.moe.layouts import PAYLOADS, Layout
from pdlab.moe.weights import ExpertWeights

STAGES = ("route", "quantize", "dispatch", "experts", "combine", "shared")


class MoELayer:
    """A DeepSeek-style MoE layer over pdlab's ops.

    Args:
        cfg: MoEConfig (global expert count, top_k, H, I, groups, scaling).
        weights: ExpertWeights of all cfg.num_experts experts (sliced to this rank's) or of this
            rank's E/ep_size experts already.
        gate_weight: [E, H] router weight (fp32 as DeepSeek keeps it; any float dtype).
        correction_bias: [E] fp32 e_score_correction_bias, or None (which cfg.topk_method "noaux_tc" reads as
            zeros; the other methods take none).
        shared_experts: nn.Module or callable [T, H] → [T, H] added to the routed output, or None.
        dispatcher: "local" | "nccl" | "deepep" | None (local on one rank, else the best usable) or
            a BaseDispatcher (then used for its own mode only).
        runner: expert runner name ("triton", "torch_grouped", "cutedsl", "torch") or None (the
            best usable one that accepts the layouts and the payload).
        mode: the default dispatch mode, "normal" (prefill) or "low_latency" (decode).
        modes: every mode this layer will be asked to serve (default: (mode,)); "both" = both.
        payload: what travels in dispatch: "bf16" | "fp8" | "nvfp4" (quantized before sending with
            the layer's static activation global scale).
        ep_rank / ep_size / group: expert parallelism (default: torch.distributed's, else 1 rank).
        num_max_dispatch_tokens_per_rank: the low-latency buffer's tokens per rank.
        max_num_tokens: the most tokens one forward on this rank will carry (e.g. the server's
            max batch / chunk); checked against the low-latency buffer at construction.
        input_global_scale: NVFP4 activation scale (448·6/amax); default from the weights' input scales.
        route_backend / runner_config / dispatcher_config / dispatcher_kwargs: passed through.
    """

    def __init__(self, cfg: MoEConfig, weights: ExpertWeights, gate_weight: torch.Tensor,
                 correction_bias: torch.Tensor | None, shared_experts: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 dispatcher: str | BaseDispatcher | None = "local", runner: str | None = None, mode: str = "normal",
                 *, modes: tuple[str, ...] | str | None = None, payload: str = "bf16", ep_rank: int | None = None,
                 ep_size: int | None = None, group: Any = None, num_max_dispatch_tokens_per_rank: int = 128,
                 max_num_tokens: int | None = None, input_global_scale: torch.Tensor | float | None = None,
                 route_backend: str | None = None, runner_config: Mapping[str, Any] | None = None,
                 dispatcher_config: Mapping[str, Any] | None = None,
                 dispatcher_kwargs: Mapping[str, Any] | None = None):
        if mode not in MODES:
            raise ValueError(f"MoELayer: unknown mode {mode!r}; choose one of {', '.join(MODES)}")
        if modes is None:
            modes = (mode,)
        elif modes == "both":
            modes = MODES
        elif isinstance(modes, str):
            modes = (modes,)
        bad = [m for m in modes if m not in MODES]
        if bad or mode not in modes:
            raise ValueError(f"MoELayer: modes {tuple(modes)} must be a subset of {MODES} containing mode={mode!r}")
        if payload not in PAYLOADS:
            raise ValueError(f"MoELayer: unknown payload {payload!r}; choose one of {', '.join(PAYLOADS)}")
        self.cfg, self.mode, self.modes, self.payload = cfg, mode, tuple(modes), payload
        self.rank, self.world_size = BaseDispatcher._rank_and_size(group, ep_rank, ep_size)
        self.group = group
        self.num_local_experts = cfg.local(self.world_size)
        self.expert_start = self.rank * self.num_local_experts
        self.weights = self._local_weights(weights)
        if tuple(gate_weight.shape) != (cfg.num_experts, cfg.hidden_size):
            raise ShapeError("moe_layer", None, "gate_weight", "has the wrong shape",
                             f"[E={cfg.num_experts}, H={cfg.hidden_size}]", describe_tensor(gate_weight),
                             "the router weight is [num_experts, hidden_size] (checkpoint name gate.weight)")
        if correction_bias is not None and tuple(correction_bias.shape) != (cfg.num_experts,):
            raise ShapeError("moe_layer", None, "correction_bias", "has the wrong shape", f"[E={cfg.num_experts}]",
                             describe_tensor(correction_bias), "e_score_correction_bias has one value per expert")
        if correction_bias is not None and cfg.topk_method != "noaux_tc":
            raise ValueError(f"MoELayer: correction_bias (e_score_correction_bias) steers noaux_tc routing only, but "
                             f"the config routes by topk_method={cfg.topk_method!r}: pass correction_bias=None")
        self.gate_weight, self.correction_bias = gate_weight, correction_bias
        self.shared_experts = shared_experts
        self.route_backend, self.runner_config = route_backend, dict(runner_config or {})
        self.num_max_dispatch_tokens_per_rank = int(num_max_dispatch_tokens_per_rank)
        self.max_num_tokens = max_num_tokens
        self.stage_hook: Callable[[str], ContextManager] | None = None

        self.input_global_scale = None
        if payload == "nvfp4":
            gs = input_global_scale if input_global_scale is not None else self.weights.activation_global_scale
            self.input_global_scale = torch.as_tensor(gs, dtype=torch.float32, device=self.weights.device).reshape(())

        # dispatchers: one per served mode (DeepEP buffers serve one mode each)
        self.dispatchers: dict[str, BaseDispatcher] = {}
        for m in self.modes:
            if isinstance(dispatcher, BaseDispatcher):
                if dispatcher.mode != m and len(self.modes) > 1:
                    raise ValueError(f"MoELayer: a prebuilt {dispatcher.name} dispatcher serves mode "
                                     f"{dispatcher.mode!r} only; pass a dispatcher name to serve {self.modes}")
                d = dispatcher
            else:
                d = create_dispatcher(dispatcher, cfg.num_experts, cfg.hidden_size, mode=m, group=group,
                                      rank=self.rank, world_size=self.world_size,
                                      num_max_dispatch_tokens_per_rank=self.num_max_dispatch_tokens_per_rank,
                                      config=dispatcher_config, **dict(dispatcher_kwargs or {}))
            if d.world_size != self.world_size and d.name != "local":
                raise ValueError(f"MoELayer: dispatcher {d.name} spans {d.world_size} ranks but ep_size={self.world_size}")
            if d.name == "local" and self.world_size > 1:
                raise ValueError(f"MoELayer: dispatcher 'local' moves no tokens between ranks but ep_size="
                                 f"{self.world_size}; use dispatcher='nccl' (or 'deepep') for expert parallelism")
            self.dispatchers[m] = d
        self.runners = {m: self._pair(m, runner) for m in self.modes}

    # --- construction checks ------------------------------------------------------------------

    def _local_weights(self, weights: ExpertWeights) -> ExpertWeights:
        cfg, E_l = self.cfg, self.num_local_experts
        if weights.hidden_size != cfg.hidden_size or weights.intermediate_size != cfg.intermediate_size:
            raise ValueError(f"MoELayer: weights are H={weights.hidden_size}, I={weights.intermediate_size} but the "
                             f"config says H={cfg.hidden_size}, I={cfg.intermediate_size}")
        if weights.num_experts == E_l:
            return weights
        if weights.num_experts == cfg.num_experts:
            return slice_experts(weights, self.expert_start, self.expert_start + E_l)
        raise ValueError(f"MoELayer: weights hold {weights.num_experts} experts; expected all {cfg.num_experts} or "
                         f"this rank's {E_l} (ep_size={self.world_size})")

    def _pair(self, mode: str, runner: str | None) -> str:
        """Pick / check the runner for `mode`: raises ValueError naming dispatcher, runner and fix."""
        d = self.dispatchers[mode]
        layout = LAYOUT_OF_MODE[mode]
        reason = d.supports(self.payload, mode)
        if reason:
            raise ValueError(f"MoELayer: dispatcher '{d.name}' cannot serve payload {self.payload!r} in {mode} mode: "
                             f"{reason}")
        if mode == "low_latency" and self.max_num_tokens is not None and \
                self.max_num_tokens > self.num_max_dispatch_tokens_per_rank:
            raise ValueError(
                f"MoELayer: low-latency dispatch ('{d.name}') holds num_max_dispatch_tokens_per_rank="
                f"{self.num_max_dispatch_tokens_per_rank} tokens per rank, but this layer may get max_num_tokens="
                f"{self.max_num_tokens}. Fix: raise num_max_dispatch_tokens_per_rank to >= {self.max_num_tokens}, "
                f"cap the decode batch at {self.num_max_dispatch_tokens_per_rank}, or serve such batches (prefill, "
                "chunked prefill) in normal mode")
        return _check_runner_pairing(runner, d.name, mode, layout, self.payload, self.weights)

    # --- stages -------------------------------------------------------------------------------

    def _stage(self, name: str) -> ContextManager:
        return self.stage_hook(name) if self.stage_hook is not None else contextlib.nullcontext()

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] → (topk_ids [T, k] int32, topk_weights [T, k] fp32); gate GEMM in fp32."""
        from pdlab.moe.routing import route

        logits = torch.nn.functional.linear(x.float(), self.gate_weight.float())
        c = self.cfg
        return route(logits, self.correction_bias, top_k=c.top_k, n_group=c.n_group, topk_group=c.topk_group,
                     routed_scaling_factor=c.routed_scaling_factor, renormalize=c.norm_topk_prob,
                     scoring_func=c.scoring_func, topk_method=c.topk_method, backend=self.route_backend)

    def quantize(self, x: torch.Tensor, mode: str | None = None) -> TokenPayload:
        """x [T, H] → the dispatch payload (sender side; bf16 passes through)."""
        return self.dispatchers[mode or self.mode].quantize(x, self.payload, self.input_global_scale)

    def dispatch(self, tokens: TokenPayload, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 mode: str | None = None) -> tuple[Layout, DispatchHandle]:
        """tokens (from `quantize`, [T, ..]) + topk_ids [T, k] int32 + topk_weights [T, k] fp32 →
        (Contiguous [N, K(/2)] in normal mode | Masked [E_local, M_max, K(/2)] in low-latency, handle)."""
        mode = mode or self.mode
        return self.dispatchers[mode].dispatch(tokens, topk_ids, topk_weights, self.payload, mode=mode)

    def experts(self, layout: Layout, mode: str | None = None, num_tokens: int | None = None) -> Layout:
        """Run this rank's experts on a dispatched layout → same layout, bf16 hidden.
        num_tokens: tokens of this step on this rank (host int), for the expected rows per expert and experts
        holding tokens that pick the tuned config of a masked layout without a host sync.
        A layout of the wrong kind raises ShapeError (the runner's contract)."""
        from pdlab.moe.experts import run_experts

        mode = mode or self.mode
        want = LAYOUT_OF_MODE[mode]
        if getattr(layout, "kind", None) != want:
            hidden = getattr(layout, "hidden", layout)
            raise ShapeError("moe_experts", self.runners[mode], "layout",
                             f"is {getattr(layout, 'kind', type(layout).__name__)}", f"the {want} layout of {mode} mode",
                             describe_tensor(hidden),
                             "normal dispatch gives Contiguous [N, K], low-latency dispatch gives Masked [E, M, K]; "
                             "hand the runner the layout of the mode it was paired with")
        expected_m, active = self._expected(num_tokens) if num_tokens is not None else (None, None)
        return run_experts(layout, self.weights, runner=self.runners[mode], config=self.runner_config or None,
                           expected_m=expected_m, active_experts=active)

    def _expected(self, num_tokens: int) -> tuple[int, int]:
        """(tokens per expert, experts holding tokens) this rank expects for a step of `num_tokens` tokens: balanced
        routing spreads T·world·k (token, expert) pairs over E experts, T·k of them on this rank, so at most T·k of
        its experts hold tokens (one token on 8 of 256 experts is not one on each)."""
        expected_m = max(1, -(-num_tokens * self.world_size * self.cfg.top_k // self.cfg.num_experts))
        return expected_m, max(1, num_tokens * self.cfg.top_k)

    def warmup_token_counts(self, max_tokens: int, mode: str = "normal") -> list[int]:
        """The smallest step size T in 1..max_tokens of each distinct expert launch (`pdlab.moe.experts.launch_key`:
        the config, tuned or default, and the kernels it picks) that steps of T tokens in `mode` reach, ascending.
        A start-up warm-up that runs a step of each compiles every kernel these steps launch: tuned configs change
        at bucket boundaries that need not be powers of two. Host work only (no kernel, no sync)."""
        from pdlab.moe.experts import launch_key
        from pdlab.moe.layouts import Contiguous, Masked

        w = self.weights
        dev = w.device
        width = self.cfg.hidden_size // 2 if self.payload == "nvfp4" else self.cfg.hidden_size
        dtype = {"nvfp4": torch.uint8, "fp8": torch.float8_e4m3fn}.get(self.payload, torch.bfloat16)
        E = self.num_local_experts
        counts = torch.zeros(E, dtype=torch.int32, device=dev)
        if LAYOUT_OF_MODE[mode] == "masked":
            stub = Masked(torch.empty((E, 0, width), dtype=dtype, device=dev), counts, self.payload)
        else:
            stub = Contiguous(torch.empty((0, width), dtype=dtype, device=dev), counts,
                              torch.zeros(E + 1, dtype=torch.int32, device=dev), self.payload)
        seen, out = set(), []
        for t in range(1, max_tokens + 1):
            expected_m, active = self._expected(t)
            key = launch_key(stub, w, self.runners[mode], self.runner_config or None, expected_m, active)
            if key not in seen:
                seen.add(key)
                out.append(t)
        return out

    def combine(self, y: Layout, handle: DispatchHandle) -> torch.Tensor:
        """The experts' output (same layout as dispatched, bf16 hidden) → [T, H] weighted sum per token
        (fp32 accumulation, x's dtype)."""
        return self.dispatchers[handle.mode].combine(y, handle)

    # --- forward ------------------------------------------------------------------------------

    def forward(self, x: torch.Tensor, mode: str | None = None) -> torch.Tensor:
        """x [T, H] (bf16; fp16/fp32 on CPU) → [T, H] same dtype: routed experts + shared experts.

        mode: "normal" | "low_latency" (default: the layer's mode); must be one of `modes`."""
        mode = mode or self.mode
        if mode not in MODES:
            raise ValueError(f"MoELayer: unknown mode {mode!r}; choose one of {', '.join(MODES)}")
        if mode not in self.modes:
            raise ValueError(f"MoELayer was built to serve {self.modes}, not {mode!r}: pass modes='both' "
                             "(or the mode) at construction so the pairing is checked then")
        if x.dim() != 2 or x.shape[1] != self.cfg.hidden_size:
            raise ShapeError("moe_layer", None, "x", "has the wrong shape", f"[T, H={self.cfg.hidden_size}]",
                             describe_tensor(x), "the MoE layer takes flattened tokens [num_tokens, hidden_size]")
        if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ShapeError("moe_layer", None, "x", "has the wrong dtype", f"[T, H={self.cfg.hidden_size}] "
                             "bf16|fp16|fp32", describe_tensor(x),
                             "the MoE layer takes the hidden states in the model's activation dtype; the layer "
                             "quantizes them itself for an fp8 / nvfp4 payload")
        with self._stage("route"):
            ids, w = self.route(x)
        with self._stage("quantize"):
            tokens = self.quantize(x, mode)
        with self._stage("dispatch"):
            layout, handle = self.dispatch(tokens, ids, w, mode)
        with self._stage("experts"):
            y = self.experts(layout, mode, num_tokens=x.shape[0])
        with self._stage("combine"):
            out = self.combine(y, handle)
        if self.shared_experts is not None:
            with self._stage("shared"):
                out = out + self.shared_experts(x).to(out.dtype)
        return out.to(x.dtype)

    __call__ = forward

    def describe(self) -> str:
        d = ", ".join(f"{m}: {self.dispatchers[m].name}+{self.runners[m]}" for m in self.modes)
        return (f"MoELayer(E={self.cfg.num_experts}, rank {self.rank}/{self.world_size}, "
                f"{self.num_local_experts} local experts, payload={self.payload}, {d})")


# ---------------------------------------------------------------------------------------------
# helpers


def slice_experts(weights: ExpertWeights, start: int, end: int) -> ExpertWeights:
    """ExpertWeights of experts [start, end) (views; per-expert tensors sliced along dim 0)."""
    E = weights.num_experts
    kw = {}
    for k, v in weights.__dict__.items():
        if k == "prepared":
            continue
        if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == E:
            v = v[start:end]
        kw[k] = v
    kw["num_experts"] = end - start
    return ExpertWeights(**kw)


def _check_runner_pairing(runner: str | None, dispatcher: str, mode: str, layout: str, payload: str,
                          weights: ExpertWeights) -> str:
    """The runner to use for (mode, payload): `runner` checked, or the best usable one that fits.
    Raises ValueError naming the dispatcher, the runner and the fix."""
    from pdlab.kernels import registry
    from pdlab.moe import experts as _experts  # registers the runners

    def fits(name: str) -> str | None:
        try:
            _experts.check_pairing(layout, payload, name)
        except ValueError as exc:
            return f"MoELayer: dispatcher '{dispatcher}' in {mode} mode with runner '{name}': {exc}"
        backend = registry.get_backend("moe_experts", name)
        forms = backend.options.get("weights", ("bf16", "nvfp4"))
        if not ((weights.has_nvfp4 and "nvfp4" in forms) or (weights.has_bf16 and "bf16" in forms)):
            return (f"MoELayer: runner '{name}' needs {'/'.join(forms)} expert weights but these carry "
                    f"{'nvfp4' if weights.has_nvfp4 else 'bf16'} only. Fix: build ExpertWeights with "
                    f"from_bf16(..., quantize={'nvfp4' in forms}) or pick another runner")
        why = _experts.size_problem(backend, weights)
        if why:
            return f"MoELayer: runner '{name}' cannot run these experts: {why}. Fix: pick runner 'torch_grouped'"
        return None

    if runner is not None:
        registry.get_backend("moe_experts", runner)  # KeyError naming the registered runners
        reason = fits(runner)
        if reason:
            raise ValueError(reason)
        return runner
    reasons = []
    for b in registry.available("moe_experts", _arch_of(weights.device)):
        reason = fits(b.name)
        if reason is None:
            return b.name
        reasons.append(reason)
    raise ValueError(f"MoELayer: no usable expert runner accepts the {layout} layout with {payload} payload "
                     f"({mode} mode, dispatcher '{dispatcher}'): " + " | ".join(reasons))


def _arch_of(device: torch.device) -> str:
    from pdlab.kernels.arch import detect_arch

    return detect_arch(device)


def moe_reference(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, weights: ExpertWeights,
                  expert_offset: int = 0, weight_form: str = "auto") -> torch.Tensor:
    """Plain torch MoE in fp32: Σ_j w[t, j] · down(silu(gate·x) · up·x) over each token's experts,
    with the weights' real values: weight_form "nvfp4" (dequantised per expert), "bf16", or "auto"
    (NVFP4 when present, else bf16).

    x: [T, H]; topk_ids: [T, k] global ids (experts outside [expert_offset, expert_offset + E) are
    skipped); topk_weights: [T, k] fp32. Returns [T, H] fp32."""
    from pdlab.kernels import nvfp4

    T, H = x.shape
    out = torch.zeros((T, H), dtype=torch.float32, device=x.device)
    xf = x.float()
    I = weights.intermediate_size
    local = topk_ids.long() - expert_offset
    plain = weights.plain_nvfp4() if weights.has_nvfp4 and weight_form != "bf16" else None
    for e in torch.unique(local).tolist():
        if not 0 <= e < weights.num_experts:
            continue
        if plain is not None:
            w13 = nvfp4.dequantize_nvfp4(plain["w13_weight"][e], plain["w13_weight_scale"][e],
                                         1.0 / weights.w13_weight_scale_2[e])
            w2 = nvfp4.dequantize_nvfp4(plain["w2_weight"][e], plain["w2_weight_scale"][e],
                                        1.0 / weights.w2_weight_scale_2[e])
        else:
            w13, w2 = weights.w13[e].float(), weights.w2[e].float()
        tok, slot = (local == e).nonzero(as_tuple=True)
        h = xf[tok] @ w13.t()
        act = torch.nn.functional.silu(h[:, :I]) * h[:, I:]
        out.index_add_(0, tok, (act @ w2.t()) * topk_weights[tok, slot].float()[:, None])
    return out
