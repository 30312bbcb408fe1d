"""Child-process targets for the supervisor tests (imported by spawned children via sys.path)."""

import os
import socket
import time


def ok(ack, value=1):
    ack({"value": value, "pid": os.getpid()})
    time.sleep(60)  # serve until stopped


def raises_before_ack(ack, delay=0.0):
    time.sleep(delay)
    raise RuntimeError("model path /nonexistent/model does not exist (pretend loader)")


def hard_exit(ack, code=3):
    os._exit(code)


def import_error(ack):
    import pdlab_no_such_module_xyz  # noqa: F401


def bind_port(ack, port):
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", port))  # raises OSError: address already in use
    s.listen()
    ack({"port": port})
    time.sleep(60)


def never_acks(ack):
    time.sleep(60)


def dies_after_ack(ack, delay=0.5):
    ack({})
    time.sleep(delay)
    raise ValueError("worker lost its engine after start-up")


def exits_cleanly_after_ack(ack):
    ack({})
    time.sleep(0.3)


def prefill_child(meta, name, q):
    import torch

    try:
        src_pool = [torch.full((4, 8, 576), float(l + 1)) for l in range(3)]
        src = _ct("local", name)
        src.register(src_pool, None)
        h = src.send_pages(src.add_peer(meta), "x", [1, 2], [3, 0], 12, notify={"first_token": 5})
        src.wait(h, timeout=10)
        q.put("ok")
    except BaseException as e:  # report to the parent instead of hanging it
        q.put(repr(e))


def cuda_prefill_child(meta, name, q):
    import torch

    try:
        src_pool = [torch.full((8, 64, 576), float(l + 1), dtype=torch.bfloat16, device="cuda:0") for l in range(3)]
        src = _ct("local", name)
        src.register(src_pool, None)
        h = src.send_pages(src.add_peer(meta), "g", [2], [5], 64, notify={"first_token": 3})
        src.wait(h, timeout=30)
        q.put("ok")
    except BaseException as e:
        q.put(repr(e))


def _ct(*a, **k):
    from pdlab.runtime.disagg.transfer import create_transfer

    return create_transfer(*a, **k)


def load_slow_decode_toy(**kw):
    """load_sensitive_toy whose decode steps take 20 ms each: a long answer stays in flight for seconds."""
    return load_sensitive_toy(decode_delay=0.02, **kw)


def load_sensitive_toy(slow_token=None, decode_delay=0.0, **kw):
    """(model, tokenizer, config) of the toy model with attention over every stored row, so a single
    missing, misplaced or corrupted KV row changes the logits (the toy's own attention is dominated by
    each token's own row)."""
    import torch

    from pdlab.runtime.engine.testing import LATENT, ToyModel, _load, _store, load_toy

    class KVSensitiveToy(ToyModel):
        def forward(self, input_ids, positions, ctx):
            if slow_token is not None and not ctx.is_decode and int(input_ids[0]) == slow_token:
                time.sleep(30)  # a prompt starting with slow_token "computes" for a long time
            if decode_delay and ctx.is_decode:
                time.sleep(decode_delay)
            ps = ctx.page_size
            for layer, cache in enumerate(ctx.kv_caches):
                _store(cache, ctx.slots, self.latent(input_ids, positions, layer), ctx.kv_scale)
            out = []
            for b in range(ctx.seqlens.shape[0]):
                n = int(ctx.seqlens[b])
                pages = ctx.block_table[b, : -(-n // ps)].long()
                h = 0
                for cache in ctx.kv_caches:
                    rows = _load(cache[pages].reshape(-1, LATENT)[:n], ctx.kv_scale)
                    w = torch.linspace(1.0, 2.0, n, device=rows.device)  # position-weighted: order matters
                    h = h + rows[-1] + 3.0 * (w[:, None] * rows).sum(0) / w.sum()
                out.append(h @ self.out * 4.0)
            return torch.stack(out).float()

    _, tok, cfg = load_toy(**kw)
    return KVSensitiveToy(cfg, seed=0), tok, cfg


def failing_factory(**kw):
    raise FileNotFoundError("model path /nonexistent/ckpt has no config.json (pretend loader)")
