"""One validated configuration per role. `RoleConfig` extends the server's `ServerConfig` with the
KV transfer and MoE dispatch settings of a prefill or decode server; settings that cannot work
together are rejected when it is built (before any model loads), each with the reason and the fix.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from pdlab.runtime.config import ServerConfig, field_default


class RoleConfig(ServerConfig):
    kv_transfer: Literal["local", "nixl"] = Field("local", description="KV transfer backend: local (one machine: shared memory / CUDA IPC) or nixl (any machines)")
    kv_transfer_convert: bool = Field(False, description="let the transfer convert page size / KV dtype between roles (local backend only)")
    transfer_timeout: float = Field(60.0, gt=0, description="seconds a request may wait for its KV (decode) or its page ids and transfer (prefill)")
    transfer_layer_group: int = Field(8, ge=1, description="layers per batched KV copy / NIXL descriptor list")
    agent_name: str | None = Field(None, description="transfer agent name (default: role-host-port-pid)")
    moe_dispatch_mode: Literal["normal", "low_latency"] = Field("normal", description="MoE dispatch mode of this role's steps")
    moe_runner: str | None = Field(None, description="MoE expert runner (None: the registry's choice for the layout)")
    moe_dispatcher: str = Field("local", description="MoE token dispatcher (local | nccl | deepep)")
    dispatch_max_tokens_per_rank: int = Field(128, ge=1, description="tokens per rank the low-latency dispatch buffer holds")

    @model_validator(mode="after")
    def _check_role(self):
        if self.kv_transfer_convert and self.kv_transfer != "local":
            raise ValueError("kv_transfer_convert needs the local transfer backend (NIXL moves raw bytes); use the "
                             "same --page-size and --kv-dtype on both roles, or --kv-transfer local")
        if self.moe_dispatch_mode == "low_latency" and self.role == "prefill":
            if self.chunked_prefill_size > self.dispatch_max_tokens_per_rank:
                raise ValueError(
                    f"low-latency dispatch on a prefill server: a prefill chunk of {self.chunked_prefill_size} "
                    f"tokens exceeds the dispatch buffer's {self.dispatch_max_tokens_per_rank} tokens per rank; "
                    f"use --moe-dispatch-mode normal for prefill (the usual choice), or lower "
                    f"--chunked-prefill-size to <= {self.dispatch_max_tokens_per_rank}")
            raise ValueError("low-latency dispatch on a prefill server: pdlab's model runs prefill steps with normal "
                             "dispatch only; use --moe-dispatch-mode normal on prefill servers")
        if self.moe_dispatch_mode == "normal" and self.dispatch_max_tokens_per_rank != field_default(
                self, "dispatch_max_tokens_per_rank"):
            raise ValueError(f"--dispatch-max-tokens-per-rank {self.dispatch_max_tokens_per_rank} sizes the "
                             "low-latency dispatch buffer, but --moe-dispatch-mode is normal (a decode server's "
                             "captured steps size theirs by --max-running-requests); add --moe-dispatch-mode "
                             "low_latency (decode servers), or drop --dispatch-max-tokens-per-rank")
        if self.moe_runner is not None:
            _check_runner(self.moe_runner, self.moe_dispatch_mode)
        if self.role == "decode" and self.max_total_tokens is not None and self.max_context_len is not None:
            pages = self.max_total_tokens // self.page_size
            need = -(-self.max_context_len // self.page_size)
            if pages < need:
                raise ValueError(
                    f"decode server KV pool of {self.max_total_tokens} tokens = {pages} pages of {self.page_size} "
                    f"is smaller than one maximal request ({self.max_context_len} tokens = {need} pages); raise "
                    f"--max-total-tokens to >= {need * self.page_size} or lower --max-context-len")
        return self


def _check_runner(runner: str, mode: str) -> None:
    from pdlab.kernels import registry
    from pdlab.moe import experts

    names = [b.name for b in registry.backends(experts.OP)]
    if runner not in names:
        raise ValueError(f"unknown MoE runner {runner!r}; registered runners: {', '.join(names)}")
    layouts = tuple(experts.runner_options(runner).get("layouts", ()))
    layout = "masked" if mode == "low_latency" else "contiguous"
    if layout not in layouts:
        fits = [n for n in names if layout in experts.runner_options(n).get("layouts", ())]
        other = "low_latency" if layout == "contiguous" else "normal"
        raise ValueError(f"MoE runner {runner!r} accepts only the {'/'.join(layouts)} layout, but "
                         f"--moe-dispatch-mode {mode} produces the {layout} layout; use --moe-dispatch-mode {other} "
                         f"with this runner, or a runner that accepts {layout}: {', '.join(fits) or 'none'}")
