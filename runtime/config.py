"""Runtime configuration: one validated, frozen object per layer, each extending the one below:
`EngineConfig` (model, device, KV memory, CUDA graphs) → `SchedulerConfig` (batching, retraction,
role) → `ServerConfig` (HTTP). Built from CLI flags, a YAML/JSON file (`--config`), or both (flags
win). Impossible settings are rejected when the object is built, with the reason and the fix.
"""

from __future__ import annotations

import argparse
import difflib
import json
import types
import typing
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


# settings the disaggregation launcher sets for each server it starts; no flag sets them
LAUNCHER_FIELDS = frozenset({"role", "device_servers", "device_server_index"})


class ConfigError(ValueError):
    """A setting that cannot work; the message names the setting, why, and the fix."""


class EngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model_path: str | None = Field(None, description="local HF directory; none = the embedded tiny default model")
    device: str = Field("auto", description="auto | cpu | cuda | cuda:N")
    dtype: Literal["auto", "bf16", "fp16", "fp32"] = Field("auto", description="activation dtype (auto: bf16 on CUDA, fp32 on CPU)")
    kv_dtype: Literal["auto", "bf16", "fp16", "fp32", "fp8"] = Field("auto", description="KV cache dtype (auto = dtype; fp8 = e4m3 bytes + scale)")
    kv_scale: float = Field(1.0, gt=0, allow_inf_nan=False, description="dequant scale of an fp8 KV cache")
    page_size: int = Field(64, ge=1, le=128, description="tokens per KV page")
    allocator: Literal["auto", "token", "paged"] = Field("auto", description="KV allocator (auto: token for page size 1, else paged)")
    max_total_tokens: int | None = Field(None, ge=1, description="KV capacity in tokens (overrides --mem-fraction-static)")
    mem_fraction_static: float = Field(0.85, gt=0, lt=1, description="share of free device memory for the KV pool")
    max_context_len: int | None = Field(None, ge=2, description="longest prompt+output (default: the model's)")
    allow_long_context: bool = Field(False, description="accept a --max-context-len above the model's context "
                                     "(max_position_embeddings, or YaRN's original × factor where larger); "
                                     "positions past it were never trained, outputs there may be garbage")
    disable_cuda_graph: bool = Field(False, description="run decode and prefill eagerly on CUDA (no CUDA graphs)")
    cuda_graph_bs: list[int] | None = Field(None, description="decode batch sizes to capture (default 1,2,4,8,16,24,32,...)")
    cuda_graph_max_prefill_tokens: int = Field(
        256, ge=0, description="prefill steps of at most this many tokens, over at most 8 sequences each at most "
                               "this long, replay CUDA graphs captured at 16, 32, … tokens; 0 = eager prefill")
    kv_backup_chunk_pages: int = Field(256, ge=1, description="pages per chunk of a KV backup copy")
    moe_weights_layout: Literal["auto", "fragment", "tiled", "modelopt"] = Field(
        "auto", description="how NVFP4 experts are stored, converted in place at load (auto: fragment order where the "
                            "triton runner's Gluon GEMMs run (sm90), tiled on other GPUs, as loaded on CPU)")
    seed: int = Field(0, ge=0, description="seed of the embedded model's random weights and of unseeded requests")
    device_servers: int = Field(1, ge=1, le=16, description="servers of one model on this device, started one after "
                                "another, that size their KV pools from its free memory: each takes an equal share "
                                "(set by --disagg when both roles land on one device; not a flag)")
    device_server_index: int = Field(0, ge=0, description="this server's place in that start order (not a flag)")

    @model_validator(mode="after")
    def _check(self):
        if self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size {self.page_size} is not a power of two: the attention kernels take pages of "
                             "1, 2, 4, ..., 128 tokens (64 is the default, and FlashMLA's only size)")
        if self.allocator == "token" and self.page_size != 1:
            raise ValueError(f"allocator 'token' manages single-token slots but page_size is {self.page_size}; "
                             "use --allocator paged (or auto), or --page-size 1")
        if self.device not in ("auto", "cpu") and not self.device.startswith("cuda"):
            raise ValueError(f"device {self.device!r} is not one of auto, cpu, cuda, cuda:N")
        if self.device.startswith("cuda"):
            import torch
            if not torch.cuda.is_available():
                raise ValueError(f"device {self.device!r} requested but CUDA is not available here; use --device cpu")
        if self.device_server_index >= self.device_servers:
            raise ValueError(f"device_server_index {self.device_server_index} is not a place among device_servers "
                             f"{self.device_servers}; give an index in 0..{self.device_servers - 1}")
        if self.cuda_graph_bs is not None and (not self.cuda_graph_bs or min(self.cuda_graph_bs) < 1):
            raise ValueError(f"cuda_graph_bs must be positive batch sizes, got {self.cuda_graph_bs}")
        # a setting the other one makes meaningless is refused, not ignored (1.0, the default, scales nothing: a
        # dumped config repeats it)
        if self.kv_scale != 1.0 and self.kv_dtype != "fp8":
            kv = self.kv_dtype if self.kv_dtype != "auto" else f"{self.resolved_kv_dtype} (--kv-dtype auto: the dtype)"
            raise ValueError(f"--kv-scale {self.kv_scale:g} only applies to an fp8 KV cache, but the KV cache is "
                             f"{kv}; add --kv-dtype fp8, or drop --kv-scale")
        if self.cuda_graph_bs is not None and self.disable_cuda_graph:
            raise ValueError("--cuda-graph-bs sets the sizes of CUDA graphs that --disable-cuda-graph turns off; "
                             "drop one of the two")
        prefill_graph_default = field_default(self, "cuda_graph_max_prefill_tokens")
        if self.disable_cuda_graph and self.cuda_graph_max_prefill_tokens not in (0, prefill_graph_default):
            raise ValueError(f"--cuda-graph-max-prefill-tokens {self.cuda_graph_max_prefill_tokens} sizes prefill CUDA "
                             "graphs that --disable-cuda-graph turns off; drop one of the two")
        if self.max_total_tokens is not None and self.mem_fraction_static != field_default(self, "mem_fraction_static"):
            raise ValueError(f"--mem-fraction-static {self.mem_fraction_static:g} sizes the KV pool from free memory, "
                             f"but --max-total-tokens {self.max_total_tokens} sets its size; drop one of the two")
        return self

    @property
    def resolved_device(self) -> str:
        if self.device == "auto":
            import torch
            return "cuda" if torch.cuda.is_available() else "cpu"
        return self.device

    @property
    def resolved_dtype(self) -> str:
        if self.dtype != "auto":
            return self.dtype
        return "fp32" if self.resolved_device == "cpu" else "bf16"

    @property
    def resolved_kv_dtype(self) -> str:
        return self.resolved_dtype if self.kv_dtype == "auto" else self.kv_dtype

    @property
    def use_cuda_graph(self) -> bool:
        return self.resolved_device.startswith("cuda") and not self.disable_cuda_graph


def field_default(cfg: BaseModel, name: str) -> Any:
    """The field's declared default: a setting the others make meaningless is refused only when it differs from it
    (a dumped config repeats every default, and must load again)."""
    return type(cfg).model_fields[name].default


class SchedulerConfig(EngineConfig):
    max_running_requests: int = Field(256, ge=1, description="requests decoding at once")
    chunked_prefill_size: int = Field(8192, ge=1, description="most prompt tokens of one request per step (longer prompts are chunked)")
    max_prefill_tokens: int = Field(16384, ge=1, description="token budget of one prefill step over all its requests")
    decode_reserve_tokens: int = Field(16, ge=0, description="tokens of headroom kept per running decode when admitting new requests")
    retract_mode: Literal["backup", "recompute"] = Field("backup", description="retracted KV: copy to CPU, or drop and recompute")
    role: Literal["colocated", "prefill", "decode"] = Field("colocated", description="which phases this server runs")
    overlap_schedule: bool = Field(True, description="launch the next decode step before post-processing the "
                                   "current one (hides host time; a finished request costs one discarded token)")
    enable_prefix_caching: bool = Field(False, description="keep the KV pages requests computed and reuse them for "
                                        "requests that start with the same tokens (whole pages; evicted, least "
                                        "recently used first, when a request needs the pages)")

    @property
    def use_cuda_graph(self) -> bool:
        """A prefill server runs no decode steps (it hands requests off after their first token): no graphs."""
        return super().use_cuda_graph and self.role != "prefill"

    @model_validator(mode="after")
    def _check_sched(self):
        if self.chunked_prefill_size > self.max_prefill_tokens:
            raise ValueError(f"chunked_prefill_size {self.chunked_prefill_size} exceeds max_prefill_tokens "
                             f"{self.max_prefill_tokens}, so a chunk could never be scheduled; raise "
                             "--max-prefill-tokens or lower --chunked-prefill-size")
        chunk_default = field_default(self, "kv_backup_chunk_pages")
        if self.retract_mode == "recompute" and self.kv_backup_chunk_pages != chunk_default:
            raise ValueError(f"--kv-backup-chunk-pages {self.kv_backup_chunk_pages} sizes the copies of KV backups, "
                             "but --retract-mode recompute makes none (it drops a retracted request's KV); drop "
                             "--kv-backup-chunk-pages, or use --retract-mode backup")
        if self.enable_prefix_caching and self.role == "decode":
            raise ValueError("--enable-prefix-caching reuses the KV of prompts this server computes, and a decode "
                             "server computes none (its prompts' KV comes from the prefill server): enable it on the "
                             "prefill server")
        if self.cuda_graph_bs is not None and max(self.cuda_graph_bs) > self.max_running_requests:
            raise ValueError(f"cuda_graph_bs {max(self.cuda_graph_bs)} exceeds max_running_requests "
                             f"{self.max_running_requests}; drop the larger sizes")
        return self


class ServerConfig(SchedulerConfig):
    host: str = Field("127.0.0.1", description="bind address (127.0.0.1 = this machine only)")
    port: int = Field(30000, ge=0, le=65535, description="TCP port (0 = any free port)")
    api_key: str | None = Field(None, description="require 'Authorization: Bearer KEY'")
    served_model_name: str = Field("pdlab", min_length=1, description="model id reported by /v1/models")
    max_queue: int = Field(4096, ge=1, description="requests waiting before new ones get 503")
    shutdown_timeout: float = Field(10.0, ge=0, description="seconds the requests in flight get to finish when the "
                                    "server stops (Ctrl-C, SIGTERM); those still running then end with a 503")
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    warmup: bool = Field(True, description="on CUDA, before serving: prefill batches of 1, 2, 4, … tokens up to "
                         "max_prefill_tokens, so that kernels compile at start-up instead of stalling the first "
                         "requests")

    @field_validator("host")
    @classmethod
    def _check_host(cls, host: str) -> str:
        return check_host(host)

    @model_validator(mode="after")
    def _check_api_key(self):
        key = self.api_key
        if key is not None and not key.strip():  # `--api-key "$KEY"` with KEY unset: the server would be open
            raise ValueError("--api-key is empty, so every request would be served without a key; give a key, or "
                             "leave --api-key out to serve without one")
        if key is not None and key != key.strip():  # clients' bearer tokens are read stripped: it never matched
            raise ValueError("--api-key has whitespace around it, which no 'Authorization: Bearer' header can carry; "
                             "remove it")
        return self


def check_host(host: str) -> str:
    """`host`; ValueError for an empty --host (`--host "$HOST"` with HOST unset), which would listen on every
    interface."""
    if not host.strip():
        raise ValueError(f"--host is empty ({host!r}), which would listen on every interface; give 0.0.0.0 for "
                         "that, an address of this machine, or leave --host out for 127.0.0.1")
    return host


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Read a YAML or JSON mapping of config fields (snake_case or kebab-case keys)."""
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"config file {str(p)!r} is a directory; pass a YAML/JSON file to --config")
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist; pass an existing YAML/JSON file to --config")
    text = p.read_text()
    try:
        if p.suffix in (".yaml", ".yml"):
            import yaml
            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except Exception as exc:
        raise ConfigError(f"config file {p}: cannot parse ({exc}); fix the syntax") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"config file {p}: expected a mapping of settings, got {type(data).__name__}")
    out: dict[str, Any] = {}
    spelt: dict[str, str] = {}
    for k, v in data.items():
        if not isinstance(k, str):
            raise ConfigError(f"config file {p}: key {k!r} is not a setting name; keys are names such as page_size")
        name = k.replace("-", "_")
        if name in spelt:
            raise ConfigError(f"config file {p}: {spelt[name]!r} and {k!r} are the same setting; give it once")
        spelt[name], out[name] = k, v
    return out


def build_config(cls: type[BaseModel], file: str | None = None, **overrides: Any):
    """Build `cls` from an optional file plus overrides (None values ignored); ConfigError on bad settings."""
    data = load_config_file(file) if file else {}
    data.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return cls(**data)
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            loc = ".".join(str(x) for x in err["loc"]) or "config"
            msg = err["msg"].removeprefix("Value error, ")
            if err["type"] == "extra_forbidden":
                near = difflib.get_close_matches(str(err["loc"][-1]), list(cls.model_fields), n=1)
                msg = (f"unknown setting{f' (did you mean {near[0]}?)' if near else ''}; known: "
                       f"{', '.join(sorted(cls.model_fields))}")
            lines.append(f"{loc}: {msg}")
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(lines)) from None


def add_config_arguments(parser: argparse.ArgumentParser, cls: type[BaseModel], exclude: set[str] = frozenset()) -> None:
    """One `--kebab-name` flag per field of `cls` (default None: only given flags override the file)."""
    parser.add_argument("--config", default=None, help="YAML/JSON file of settings (flags override it)")
    for name, field in cls.model_fields.items():
        if name in exclude:
            continue
        flag = "--" + name.replace("_", "-")
        ann = field.annotation
        help_ = f"{field.description or ''} (default: {field.default})"
        if ann is bool:  # --flag / --no-flag
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_)
            continue
        base, choices, nargs = _arg_type(ann)
        parser.add_argument(flag, type=base, choices=choices, nargs=nargs, default=None, help=help_)


def config_from_args(cls: type[BaseModel], args: argparse.Namespace):
    values = {name: getattr(args, name, None) for name in cls.model_fields}
    return build_config(cls, getattr(args, "config", None), **values)


def _arg_type(ann: Any) -> tuple[Any, list | None, str | None]:
    args = typing.get_args(ann)
    if typing.get_origin(ann) in (typing.Union, types.UnionType):
        ann = next(a for a in args if a is not type(None))
        args = typing.get_args(ann)
    if typing.get_origin(ann) is Literal:
        return str, list(args), None
    if typing.get_origin(ann) is list:
        return args[0], None, "+"
    return ann, None, None
