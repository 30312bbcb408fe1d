"""Attention tests: on a machine without CUDA, Triton kernels run under the interpreter.

TRITON_INTERPRET is read when a kernel is decorated (pdlab.attention.triton_kernels is imported
lazily, on the first triton call), so setting it here works whether or not triton itself was
imported earlier in the process."""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
