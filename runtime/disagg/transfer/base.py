"""KV transfer interface: the decode side registers its KV pool and publishes how to reach it; the
prefill side registers its own pool, adds the decode side as a peer, and writes pages into it by
index, then notifies. Every wait takes a timeout. Pages move in batches: one descriptor list (one
copy / one NIXL request) per layer group, never one call per page.

Layout of a pool (the runtime's `MLAKVPool.kv_caches`): per layer one tensor [num_pages, page_size,
576], dtype bf16 | fp16 | fp32, or uint8 holding fp8_e4m3 bytes (value = e4m3(byte) * kv_scale).

    dst = create_transfer("local", "decode-0")       # decode process
    meta = dst.register(pool.kv_caches, pool.kv_scale)          # JSON-able dict, served over HTTP
    src = create_transfer("local", "prefill-0")      # prefill process
    src.register(pool.kv_caches, pool.kv_scale)
    peer = src.add_peer(meta)                         # rejects page-size / dtype mismatch
    h = src.send_pages(peer, "tid-1", src_pages, dst_pages, num_tokens, notify={"first_token": 7})
    src.wait(h, timeout=30)
    msg = dst.wait_notification("tid-1", timeout=30)  # {"transfer_id": "tid-1", "first_token": 7, ...}
"""

from __future__ import annotations

import enum
import json
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass
from typing import Any

import torch

LATENT_DIM = 576
_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.uint8: "fp8"}
_TORCH = {v: k for k, v in _DTYPES.items()}


class KVTransferError(RuntimeError):
    """A transfer failed (peer gone, backend error); the request it belonged to must be failed."""


class TransferTimeout(KVTransferError, TimeoutError):
    """A wait ran past its timeout."""


class KVLayoutMismatch(ValueError):
    """The two pools cannot exchange pages (page size, dtype, width or layer count differ)."""


class TransferStatus(str, enum.Enum):
    PROC = "proc"  # in flight
    DONE = "done"
    ERR = "err"


@dataclass(frozen=True)
class KVLayout:
    """Shape facts of one registered pool (what a peer needs to address its pages)."""

    num_layers: int
    num_pages: int
    page_size: int
    dtype: str  # "bf16" | "fp16" | "fp32" | "fp8"
    kv_scale: float | None
    device: str  # "cpu" | "cuda:N"
    row_width: int = LATENT_DIM

    @property
    def page_bytes(self) -> int:
        return self.page_size * self.row_width * _TORCH[self.dtype].itemsize

    @classmethod
    def from_caches(cls, kv_caches: list[torch.Tensor], kv_scale: float | None) -> "KVLayout":
        """kv_caches: per layer [num_pages, page_size, 576], one dtype and device, contiguous."""
        if not kv_caches:
            raise ValueError("register needs at least one layer's KV pool, got an empty list")
        first = kv_caches[0]
        for i, t in enumerate(kv_caches):
            if t.dim() != 3 or t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
                raise ValueError(f"kv_caches[{i}] is {tuple(t.shape)} {t.dtype} on {t.device}; every layer "
                                 f"must be [num_pages, page_size, 576] like layer 0 {tuple(first.shape)} "
                                 f"{first.dtype} on {first.device}")
            if not t.is_contiguous():
                raise ValueError(f"kv_caches[{i}] is not contiguous; register the pool tensors themselves")
        if first.dtype not in _DTYPES:
            raise ValueError(f"KV pool dtype {first.dtype} is not one of bf16, fp16, fp32, uint8 (fp8)")
        if first.dtype == torch.uint8 and kv_scale is None:
            raise ValueError("an fp8 (uint8) KV pool needs its kv_scale at registration")
        return cls(len(kv_caches), first.shape[0], first.shape[1], _DTYPES[first.dtype],
                   float(kv_scale) if first.dtype == torch.uint8 else None, str(first.device), first.shape[2])

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "KVLayout":
        return cls(**d)


def check_compatible(src: KVLayout, dst: KVLayout, *, convert: bool) -> bool:
    """Return True when pages can be copied byte for byte, False when they need conversion (only
    allowed with `convert`); raise KVLayoutMismatch naming the difference and the fix otherwise."""
    if src.num_layers != dst.num_layers or src.row_width != dst.row_width:
        raise KVLayoutMismatch(f"prefill pool has {src.num_layers} layers x {src.row_width} values per row, "
                               f"decode pool {dst.num_layers} x {dst.row_width}: both sides must serve the "
                               f"same model")
    same = src.page_size == dst.page_size and src.dtype == dst.dtype and (
        src.dtype != "fp8" or src.kv_scale == dst.kv_scale)
    if same:
        return True
    if not convert:
        raise KVLayoutMismatch(
            f"KV layouts differ: prefill page_size {src.page_size} / {src.dtype}"
            f"{'' if src.kv_scale is None else f' (scale {src.kv_scale})'}, decode page_size "
            f"{dst.page_size} / {dst.dtype}{'' if dst.kv_scale is None else f' (scale {dst.kv_scale})'}. "
            f"Use the same --page-size and --kv-cache-dtype on both roles, or enable conversion "
            f"(--kv-transfer-convert, local backend only)")
    return False


def convert_rows(rows: torch.Tensor, src: KVLayout, dst: KVLayout) -> torch.Tensor:
    """rows: [..., 576] in src's storage dtype -> same shape in dst's storage dtype (fp8 = e4m3 bytes
    with the layout's kv_scale)."""
    if src.dtype == dst.dtype and src.kv_scale == dst.kv_scale:
        return rows
    if src.dtype == "fp8":
        x = rows.view(torch.float8_e4m3fn).to(torch.float32) * src.kv_scale
    else:
        x = rows.to(torch.float32)
    if dst.dtype == "fp8":
        return (x / dst.kv_scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)
    return x.to(_TORCH[dst.dtype])


def page_slots(pages: list[int], num_tokens: int, page_size: int) -> torch.Tensor:
    """[num_tokens] int64 slots (page * page_size + offset) of the first num_tokens positions."""
    need = -(-num_tokens // page_size)
    if len(pages) < need:
        raise ValueError(f"{num_tokens} tokens need {need} pages of {page_size}, got {len(pages)}")
    pos = torch.arange(num_tokens, dtype=torch.int64)
    return torch.tensor(pages, dtype=torch.int64)[pos // page_size] * page_size + pos % page_size


def layer_groups(num_layers: int, group_size: int) -> list[range]:
    g = max(1, int(group_size))
    return [range(s, min(num_layers, s + g)) for s in range(0, num_layers, g)]


@dataclass
class TransferHandle:
    """One in-flight page transfer (all its layer groups). Backends keep their own state in `state`."""

    transfer_id: str
    peer: str
    num_groups: int
    nbytes: int
    started: float
    state: Any = None
    status: TransferStatus = TransferStatus.PROC
    error: str = ""


class KVTransferBackend(ABC):
    """One side of KV transfer. Thread-safe for one sender thread plus one notification poller.

    agent_name: unique per server process (it names notification endpoints / NIXL agents).
    layer_group_size: layers per batched copy / descriptor list.
    convert: allow page-size / dtype conversion between peers (backends that move raw bytes refuse).
    """

    name = "base"
    supports_convert = False

    def __init__(self, agent_name: str, *, layer_group_size: int = 8, convert: bool = False):
        if convert and not self.supports_convert:
            raise ValueError(f"the {self.name} transfer backend moves raw bytes and cannot convert page "
                             f"size or KV dtype; use the same layout on both roles or the local backend")
        self.agent_name = agent_name
        self.layer_group_size = layer_group_size
        self.convert = convert
        self.layout: KVLayout | None = None
        self._notifs: dict[str, dict] = {}
        self._notif_lock = threading.Lock()

    # -- registration ---------------------------------------------------------------------------
    @abstractmethod
    def register(self, kv_caches: list[torch.Tensor], kv_scale: float | None) -> dict:
        """Register this side's pool (per layer [num_pages, page_size, 576]). Returns JSON-able
        metadata that a peer passes to `add_peer` (it carries the layout and the memory handles)."""

    @abstractmethod
    def add_peer(self, meta: dict) -> str:
        """Import a peer's metadata (from its `register`); check layouts (KVLayoutMismatch unless
        convertible); return the peer's name for `send_pages`. Idempotent per peer."""

    def _peer_layout(self, meta: dict) -> tuple[str, "KVLayout"]:
        """(peer name, peer layout) from a peer's `register` metadata, after the checks every backend
        makes: same backend on both sides, this side registered first."""
        if meta.get("backend") != self.name:
            raise KVTransferError(f"peer {meta.get('agent')} uses the {meta.get('backend')} transfer backend, "
                                  f"this side {self.name}; start both roles with the same --kv-transfer")
        if self.layout is None:
            raise KVTransferError("register this side's KV pool before adding peers")
        return meta["agent"], KVLayout.from_json(meta["layout"])

    # -- data movement --------------------------------------------------------------------------
    @abstractmethod
    def send_pages(self, peer: str, transfer_id: str, src_pages: list[int], dst_pages: list[int],
                   num_tokens: int, *, notify: dict | None = None) -> TransferHandle:
        """Start writing the KV of the first `num_tokens` positions held in local `src_pages` into
        the peer's `dst_pages` (all layers, one batch per layer group). When every group has landed,
        the peer receives the notification {"transfer_id": transfer_id, **notify}."""

    @abstractmethod
    def poll(self, handle: TransferHandle) -> TransferStatus:
        """Non-blocking progress check."""

    def wait(self, handle: TransferHandle, timeout: float) -> None:
        """Block until DONE; raise KVTransferError on ERR, TransferTimeout after `timeout` s."""
        deadline = time.monotonic() + timeout
        delay = 1e-4
        while True:
            st = self.poll(handle)
            if st is TransferStatus.DONE:
                return
            if st is TransferStatus.ERR:
                raise KVTransferError(f"transfer {handle.transfer_id} to {handle.peer} failed: {handle.error}")
            if time.monotonic() >= deadline:
                raise TransferTimeout(f"transfer {handle.transfer_id} to {handle.peer} not done after {timeout} s")
            time.sleep(delay)
            delay = min(delay * 2, 0.01)

    def release(self, handle: TransferHandle) -> None:
        """Free backend resources of a finished (or abandoned) transfer."""

    # -- notifications --------------------------------------------------------------------------
    @abstractmethod
    def notify(self, peer: str, msg: dict) -> None:
        """Send a small JSON message to a peer outside any transfer (e.g. a failure notice)."""

    @abstractmethod
    def _recv_notifications(self) -> list[dict]:
        """Drain notifications that arrived (each a dict with "transfer_id")."""

    def poll_notifications(self) -> list[dict]:
        """Non-blocking: every complete notification received since the last call."""
        with self._notif_lock:
            out = list(self._notifs.values()) + self._recv_notifications()
            self._notifs.clear()
        return out

    def wait_notification(self, transfer_id: str, timeout: float) -> dict:
        """Block until the notification for `transfer_id` arrives (others are kept for their
        waiters); raise TransferTimeout after `timeout` s."""
        deadline = time.monotonic() + timeout
        delay = 1e-4
        while True:
            with self._notif_lock:
                for m in self._recv_notifications():
                    self._notifs[m.get("transfer_id", "")] = m
                if transfer_id in self._notifs:
                    return self._notifs.pop(transfer_id)
            if time.monotonic() >= deadline:
                raise TransferTimeout(f"no completion notice for transfer {transfer_id} after {timeout} s")
            time.sleep(delay)
            delay = min(delay * 2, 0.01)

    def close(self) -> None:
        """Release every registration and endpoint."""


def encode_msg(msg: dict) -> bytes:
    return json.dumps(msg, separators=(",", ":")).encode()


def decode_msg(raw: bytes) -> dict:
    return json.loads(raw.decode())


def create_transfer(kind: str, agent_name: str, **kwargs) -> KVTransferBackend:
    """kind: "local" (one machine: shared memory on CPU, CUDA IPC on GPU) or "nixl" (any machines)."""
    if kind == "local":
        from pdlab.runtime.disagg.transfer.local import LocalTransfer

        return LocalTransfer(agent_name, **kwargs)
    if kind == "nixl":
        from pdlab.runtime.disagg.transfer.nixl import NixlTransfer

        return NixlTransfer(agent_name, **kwargs)
    raise ValueError(f"unknown KV transfer backend {kind!r}; choose 'local' or 'nixl'")
