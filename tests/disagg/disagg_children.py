"""Child-process targets for the supervisor tests (imported by spawned children via sys.path)."""

import os
import socket
import time

import torch


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
