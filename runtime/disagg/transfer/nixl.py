"""KV transfer through NIXL agents (UCX underneath: RDMA, TCP, shared memory or cuda_ipc, whichever
the two ends share), for servers on any machines. Feature-detected: `nixl_cu13` (pip `nixl-cu13`,
also runs on CPU-only machines) or `nixl` (its meta-package); `available()` says which, or why not.

Each side registers its per-layer pools with its agent and prepares one descriptor per (layer,
page). Agent metadata and the pool's base addresses travel in the dict `register` returns (served
over the bootstrap HTTP endpoint). A send is one WRITE request per layer group, each carrying the
notification "<transfer_id>|<group>|<groups>|<json>"; the receiver completes a transfer once it
holds all of that transfer's group notifications, so no data is read before it has landed.
NIXL moves bytes: peers must share page size and KV dtype (no conversion).
"""

from __future__ import annotations

import base64
import importlib
import json
import time

import numpy as np

from pdlab.runtime.disagg.transfer.base import (
    KVLayout,
    KVTransferBackend,
    KVTransferError,
    TransferHandle,
    TransferStatus,
    check_compatible,
    layer_groups,
)


def _import_nixl():
    errors = []
    for mod in ("nixl_cu13", "nixl._api", "nixl"):
        try:
            m = importlib.import_module(mod)
            if hasattr(m, "nixl_agent"):
                return m
        except ImportError as e:  # the .so may fail to load for reasons other than absence
            errors.append(f"{mod}: {e}")
    raise ImportError("NIXL is not installed (pip install 'pdlab[nixl]', i.e. nixl-cu13): " + "; ".join(errors))


def available() -> tuple[bool, str]:
    """(True, module name) when a NIXL Python API can be imported, else (False, reason)."""
    try:
        return True, _import_nixl().__name__
    except ImportError as e:
        return False, str(e)


class _Peer:
    def __init__(self, name, layout, remote_dlist):
        self.name, self.layout, self.remote_dlist = name, layout, remote_dlist


class NixlTransfer(KVTransferBackend):
    name = "nixl"
    supports_convert = False

    def __init__(self, agent_name: str, *, backends: tuple[str, ...] = ("UCX",), progress_thread: bool = False,
                 **kwargs):
        super().__init__(agent_name, **kwargs)
        self._nixl = _import_nixl()
        # no progress thread: it busy-polls a core for the agent's whole life (and outlives close());
        # our waits poll check_xfer_state / get_new_notifs, which progress the transfers themselves
        cfg = self._nixl.nixl_agent_config(enable_prog_thread=progress_thread, backends=list(backends))
        self.agent = self._nixl.nixl_agent(agent_name, cfg)
        if not self.agent.backends:
            raise KVTransferError(f"NIXL agent {agent_name} has none of the backends {backends}; "
                                  f"available plugins: {self.agent.get_plugin_list()}")
        self._reg = None
        self._local_dlist = None
        self._peers: dict[str, _Peer] = {}
        self._known: set[str] = set()  # remote agents whose metadata was loaded
        self._partial: dict[str, dict] = {}  # transfer_id -> {"groups": set, "n": int, "msg": dict}

    def register(self, kv_caches, kv_scale):
        self.layout = KVLayout.from_caches(kv_caches, kv_scale)
        self._caches = list(kv_caches)
        self._reg = self.agent.register_memory(self._caches)
        mem = "DRAM" if kv_caches[0].device.type == "cpu" else "VRAM"
        dev_id = max(0, kv_caches[0].get_device())
        self._mem, self._dev_id = mem, dev_id
        bases = [t.data_ptr() for t in kv_caches]
        self._local_dlist = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", self._descs(self.layout, bases, dev_id),
                                                       mem)
        return {"backend": self.name, "agent": self.agent_name, "layout": self.layout.to_json(),
                "agent_metadata": base64.b64encode(self.agent.get_agent_metadata()).decode(),
                "bases": bases, "mem": mem, "device_id": dev_id}

    @staticmethod
    def _descs(layout: KVLayout, bases: list[int], dev_id: int) -> np.ndarray:
        """[num_layers * num_pages, 3] (address, bytes, device): descriptor l * num_pages + p = page p of layer l."""
        pb = layout.page_bytes
        pages = np.arange(layout.num_pages, dtype=np.uint64) * np.uint64(pb)
        addrs = (np.asarray(bases, dtype=np.uint64)[:, None] + pages[None, :]).reshape(-1)
        out = np.empty((addrs.shape[0], 3), dtype=np.uint64)
        out[:, 0] = addrs
        out[:, 1] = pb
        out[:, 2] = dev_id
        return out

    def add_peer(self, meta):
        if meta.get("agent") in self._peers and meta.get("backend") == self.name:
            return meta["agent"]
        name, dst = self._peer_layout(meta)
        if name not in self._known:  # known before the layout check, so failure notices still reach it
            remote = self.agent.add_remote_agent(base64.b64decode(meta["agent_metadata"]))
            remote = remote.decode() if isinstance(remote, bytes) else remote
            if remote != name:
                raise KVTransferError(f"peer metadata names agent {remote!r} but claims {name!r}")
            self._known.add(name)
        check_compatible(self.layout, dst, convert=False)
        dl = self.agent.prep_xfer_dlist(name, self._descs(dst, meta["bases"], meta["device_id"]), meta["mem"])
        self._peers[name] = _Peer(name, dst, dl)
        return name

    def send_pages(self, peer, transfer_id, src_pages, dst_pages, num_tokens, *, notify=None):
        p = self._peers.get(peer)
        if p is None:
            raise KVTransferError(f"unknown peer {peer!r}; add_peer(meta) first")
        if "|" in transfer_id:
            raise ValueError(f"transfer id {transfer_id!r} must not contain '|'")
        n = -(-num_tokens // self.layout.page_size)
        if len(src_pages) < n or len(dst_pages) < n:
            raise ValueError(f"{num_tokens} tokens need {n} pages on each side, got {len(src_pages)} "
                             f"source and {len(dst_pages)} destination pages")
        src = np.asarray(src_pages[:n], dtype=np.int64)
        dst = np.asarray(dst_pages[:n], dtype=np.int64)
        groups = layer_groups(self.layout.num_layers, self.layer_group_size)
        payload = json.dumps(notify or {}, separators=(",", ":"))
        xfers = []
        t0 = time.perf_counter()
        try:
            for g, group in enumerate(groups):
                layers = np.asarray(list(group), dtype=np.int64)[:, None]
                li = (layers * self.layout.num_pages + src[None, :]).reshape(-1).astype(np.int32)
                ri = (layers * p.layout.num_pages + dst[None, :]).reshape(-1).astype(np.int32)
                msg = f"{transfer_id}|{g}|{len(groups)}|{payload}".encode()
                x = self.agent.make_prepped_xfer("WRITE", self._local_dlist, li, p.remote_dlist, ri, msg)
                if self.agent.transfer(x) == "ERR":
                    raise KVTransferError(f"NIXL refused WRITE of layer group {g} to {peer}")
                xfers.append(x)
        except Exception as e:  # noqa: BLE001 - NIXL raises its own types
            for x in xfers:
                self._release_one(x)
            return TransferHandle(transfer_id, peer, len(groups), 0, t0, status=TransferStatus.ERR, error=str(e))
        nbytes = n * self.layout.page_bytes * self.layout.num_layers
        return TransferHandle(transfer_id, peer, len(groups), nbytes, t0, state=xfers)

    def poll(self, handle):
        if handle.status is not TransferStatus.PROC:
            return handle.status
        states = [self.agent.check_xfer_state(x) for x in handle.state]
        if "ERR" in states:
            handle.status, handle.error = TransferStatus.ERR, "NIXL reported a failed WRITE (peer gone?)"
        elif all(s == "DONE" for s in states):
            handle.status = TransferStatus.DONE
        return handle.status

    def release(self, handle):
        for x in handle.state or []:
            self._release_one(x)
        handle.state = []

    def _release_one(self, x):
        try:
            self.agent.release_xfer_handle(x)
        except Exception:  # noqa: BLE001 - releasing a handle of a dead peer may fail; nothing to do
            pass

    def notify(self, peer, msg):
        tid = msg.get("transfer_id", "")
        try:
            self.agent.send_notif(peer, f"{tid}|0|1|{json.dumps(msg, separators=(',', ':'))}".encode())
        except Exception as e:  # noqa: BLE001
            raise KVTransferError(f"notifying {peer} failed: {e}") from e

    def _recv_notifications(self):
        out = []
        for _agent, msgs in self.agent.get_new_notifs().items():
            for raw in msgs:
                tid, g, n, payload = raw.decode().split("|", 3)
                st = self._partial.setdefault(tid, {"groups": set(), "n": int(n), "msg": {}})
                st["groups"].add(int(g))
                if payload and payload != "{}":
                    st["msg"] = json.loads(payload)
                if len(st["groups"]) >= st["n"]:
                    del self._partial[tid]
                    out.append({**st["msg"], "transfer_id": tid})
        return out

    def remove_peer(self, peer: str) -> None:
        p = self._peers.pop(peer, None)
        if p is not None or peer in self._known:
            self._known.discard(peer)
            try:
                self.agent.remove_remote_agent(peer)
            except Exception:  # noqa: BLE001
                pass

    def close(self):
        for name in list(self._peers):
            self.remove_peer(name)
        if self._reg is not None:
            try:
                self.agent.deregister_memory(self._reg)
            except Exception:  # noqa: BLE001
                pass
            self._reg = None
