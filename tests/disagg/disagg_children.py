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
