"""Same-machine KV transfer. The decode side exports its pool: CPU pools are moved into named shared
memory (torch's file_system sharing) and CUDA pools are exported as CUDA IPC handles. The prefill
side maps that pool into its own process and copies pages straight into it (for CUDA, a peer-to-peer
copy between the two GPUs), one gather + copy + scatter per layer group. Completion notices travel
over a Unix datagram socket named after the receiving agent (Linux abstract namespace).

Because the sender writes the peer's memory itself, it can convert page size and KV dtype on the
way (opt-in with convert=True). Metadata holds no pickles: only file names / IPC handle bytes.
"""

from __future__ import annotations

import base64
import errno
import os
import socket
import time

import torch
import torch.multiprocessing as tmp

from pdlab.runtime.disagg.transfer.base import (
    KVLayout,
    KVTransferBackend,
    KVTransferError,
    TransferHandle,
    TransferStatus,
    check_compatible,
    convert_rows,
    decode_msg,
    encode_msg,
    layer_groups,
    page_slots,
)


def _b64(b: bytes) -> str:
    return base64.b64encode(b).decode()


def _unb64(s: str) -> bytes:
    return base64.b64decode(s.encode())


_IN_PROCESS: dict[str, list[torch.Tensor]] = {}  # agent -> pool, for peers living in this process


class _Peer:
    def __init__(self, name: str, layout: KVLayout, caches: list[torch.Tensor], raw: bool):
        self.name, self.layout, self.caches, self.raw = name, layout, caches, raw


class LocalTransfer(KVTransferBackend):
    name = "local"
    supports_convert = True

    def __init__(self, agent_name: str, **kwargs):
        super().__init__(agent_name, **kwargs)
        self._caches: list[torch.Tensor] = []
        self._peers: dict[str, _Peer] = {}
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._addr = f"\0pdlab-kv-{agent_name}"
        try:
            self._sock.bind(self._addr)
        except OSError as e:
            self._sock.close()
            raise KVTransferError(f"local transfer agent name {agent_name!r} is already in use on this "
                                  f"machine ({e}); give each server a unique agent name") from e
        self._sock.setblocking(False)
        self._send_sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)

    # -- registration ---------------------------------------------------------------------------
    def register(self, kv_caches, kv_scale):
        self.layout = KVLayout.from_caches(kv_caches, kv_scale)
        self._caches = list(kv_caches)
        handles = []
        if kv_caches[0].device.type == "cpu":
            if tmp.get_sharing_strategy() != "file_system":
                tmp.set_sharing_strategy("file_system")  # names, not fds, so they can travel over HTTP
            for t in kv_caches:
                if not t.is_shared():
                    t.share_memory_()  # in place: the pool's tensors and their views now live in shm
                try:
                    mgr, handle, size = t.untyped_storage()._share_filename_cpu_()
                except RuntimeError as e:
                    raise KVTransferError(
                        f"KV pool layer is shared by file descriptor, not by name ({e}); call "
                        f"torch.multiprocessing.set_sharing_strategy('file_system') before the pool is "
                        f"allocated, or register before sharing it") from e
                handles.append({"kind": "shm", "manager": _b64(mgr), "handle": _b64(handle), "size": size,
                                "offset": t.storage_offset()})
        else:
            for t in kv_caches:
                st = t.untyped_storage()
                (dev, h, size, off, rc_h, rc_off, ev_h, ev_sync) = st._share_cuda_()
                handles.append({"kind": "cuda_ipc", "device": dev, "handle": _b64(h), "size": size,
                                "storage_offset_bytes": off, "ref_handle": _b64(rc_h), "ref_offset": rc_off,
                                "event_handle": _b64(ev_h) if ev_h else "", "event_sync": bool(ev_sync),
                                "offset": t.storage_offset()})
        _IN_PROCESS[self.agent_name] = self._caches
        return {"backend": self.name, "agent": self.agent_name, "layout": self.layout.to_json(),
                "handles": handles, "pid": os.getpid()}

    def add_peer(self, meta):
        if meta.get("agent") in self._peers and meta.get("backend") == self.name:
            return meta["agent"]
        name, dst = self._peer_layout(meta)
        raw = check_compatible(self.layout, dst, convert=self.convert)
        shape = (dst.num_pages, dst.page_size, dst.row_width)
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp8": torch.uint8}[dst.dtype]
        caches = []
        if meta.get("pid") == os.getpid() and name in _IN_PROCESS:  # same process: no IPC (CUDA refuses it)
            self._peers[name] = _Peer(name, dst, _IN_PROCESS[name], raw)
            return name
        for h in meta["handles"]:
            if h["kind"] == "shm":
                st = torch.UntypedStorage._new_shared_filename_cpu(_unb64(h["manager"]), _unb64(h["handle"]),
                                                                  h["size"])
            else:
                torch.cuda._lazy_init()
                with torch.cuda.device(h["device"]):
                    st = torch.UntypedStorage._new_shared_cuda(
                        h["device"], _unb64(h["handle"]), h["size"], h["storage_offset_bytes"],
                        _unb64(h["ref_handle"]), h["ref_offset"],
                        _unb64(h["event_handle"]) if h["event_handle"] else b"", h["event_sync"])
            t = torch.empty(0, dtype=dtype, device=st.device)
            t.set_(st, h["offset"], shape, (shape[1] * shape[2], shape[2], 1))
            caches.append(t)
        self._peers[name] = _Peer(name, dst, caches, raw)
        return name

    # -- data movement --------------------------------------------------------------------------
    def send_pages(self, peer, transfer_id, src_pages, dst_pages, num_tokens, *, notify=None):
        p = self._peers.get(peer)
        if p is None:
            raise KVTransferError(f"unknown peer {peer!r}; add_peer(meta) first")
        src_l, dst_l = self.layout, p.layout
        t0 = time.perf_counter()
        nbytes = 0
        dev = self._caches[0].device
        try:
            if p.raw:  # same layout: whole pages
                n = -(-num_tokens // src_l.page_size)
                src_idx = torch.tensor(src_pages[:n], dtype=torch.int64, device=dev)
                dst_idx = torch.tensor(dst_pages[:n], dtype=torch.int64, device=p.caches[0].device)
                if len(src_pages) < n or len(dst_pages) < n:
                    raise ValueError(f"{num_tokens} tokens need {n} pages on each side, got "
                                     f"{len(src_pages)} source and {len(dst_pages)} destination pages")
            else:  # convert: token rows, since pages do not line up
                src_idx = page_slots(src_pages, num_tokens, src_l.page_size).to(dev)
                dst_idx = page_slots(dst_pages, num_tokens, dst_l.page_size).to(p.caches[0].device)
            for group in layer_groups(src_l.num_layers, self.layer_group_size):
                # gather the group's pages (or rows) into one staging buffer, then one copy across
                srcs = [self._caches[i] if p.raw else self._caches[i].view(-1, src_l.row_width) for i in group]
                staged = torch.empty((len(srcs), src_idx.numel(), *srcs[0].shape[1:]), dtype=srcs[0].dtype,
                                     device=dev)
                for j, t in enumerate(srcs):
                    torch.index_select(t, 0, src_idx, out=staged[j])
                if not p.raw:
                    staged = convert_rows(staged, src_l, dst_l)
                staged = staged.to(p.caches[0].device, non_blocking=True)  # one copy per layer group
                nbytes += staged.numel() * staged.element_size()
                for j, i in enumerate(group):
                    dst = p.caches[i] if p.raw else p.caches[i].view(-1, dst_l.row_width)
                    dst.index_copy_(0, dst_idx, staged[j])
        except (RuntimeError, ValueError) as e:
            h = TransferHandle(transfer_id, peer, 0, nbytes, t0, status=TransferStatus.ERR, error=str(e))
            return h
        event = None
        if p.caches[0].device.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(p.caches[0].device))
        h = TransferHandle(transfer_id, peer, len(layer_groups(src_l.num_layers, self.layer_group_size)),
                           nbytes, t0, state={"event": event, "notify": notify})
        self.poll(h)
        return h

    def poll(self, handle):
        if handle.status is not TransferStatus.PROC:
            return handle.status
        ev = handle.state["event"]
        if ev is not None and not ev.query():
            return TransferStatus.PROC
        if handle.state["notify"] is not None:
            try:
                self.notify(handle.peer, {**handle.state["notify"], "transfer_id": handle.transfer_id})
            except KVTransferError as e:
                handle.status, handle.error = TransferStatus.ERR, str(e)
                return handle.status
        handle.status = TransferStatus.DONE
        return handle.status

    # -- notifications --------------------------------------------------------------------------
    def notify(self, peer, msg):
        try:
            self._send_sock.sendto(encode_msg(msg), f"\0pdlab-kv-{peer}")
        except OSError as e:
            if e.errno in (errno.ECONNREFUSED, errno.ENOENT):
                raise KVTransferError(f"peer {peer} is gone (no notification endpoint): {e}") from e
            raise KVTransferError(f"notifying {peer} failed: {e}") from e

    def _recv_notifications(self):
        out = []
        for _ in range(4096):  # bounded drain
            try:
                raw = self._sock.recv(1 << 16)
            except BlockingIOError:
                break
            out.append(decode_msg(raw))
        return out

    def remove_peer(self, peer: str) -> None:
        self._peers.pop(peer, None)

    def close(self):
        self._peers.clear()
        _IN_PROCESS.pop(self.agent_name, None)
        for s in (self._sock, self._send_sock):
            try:
                s.close()
            except OSError:
                pass
