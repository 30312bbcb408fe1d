"""MoE tests: on a machine without CUDA, Triton kernels run under the interpreter.

TRITON_INTERPRET is read when a kernel is decorated, so the kernel modules are imported here, under the
interpreter, before any test runs: a test that lifts the variable for a while (monkeypatch.delenv) must not be the
first to import one, or every later test in the process gets compiled kernels and no driver to run them on."""

import importlib
import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
    for _name in ("nvfp4_moe", "nvfp4_frag", "nvfp4_dequant", "route", "tiled"):
        importlib.import_module(f"pdlab.moe.triton.{_name}")
