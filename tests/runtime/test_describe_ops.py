"""The start-up log names each op's backend; for one that plans on the host it says what the decode CUDA graphs do
with it: flashinfer is re-planned before each replay; one that cannot re-plan stays out of the graphs (they take
another), so the log never claims a backend the graphs do not run."""

import dataclasses

import torch

from pdlab.kernels import registry
from pdlab.runtime.engine import engine


def _decode_line(monkeypatch, backend) -> str:
    real = registry.select
    monkeypatch.setattr(registry, "select", lambda op, name=None, device=None, accept=None:
                        backend if op == "mla_decode" else real(op, name, device=device, accept=accept))
    lines = engine.describe_ops(torch.device("cpu"))
    monkeypatch.setattr(registry, "select", real)
    assert not any("CUDA-graph" in x for x in lines if not x.startswith("op mla_decode:"))
    decode = [x for x in lines if x.startswith("op mla_decode:")]
    assert len(decode) == 1
    return decode[0]


def test_startup_log_says_what_the_decode_graphs_do_with_a_host_planned_backend(monkeypatch):
    import pdlab.attention  # noqa: F401  (registers the attention backends)

    flash = registry.get_backend("mla_decode", "flashinfer")
    line = _decode_line(monkeypatch, flash)
    assert "backend flashinfer" in line and "CUDA-graph decode re-plans it before each replay" in line
    frozen = dataclasses.replace(flash, options={k: v for k, v in flash.options.items() if k != "graph_replan"})
    line = _decode_line(monkeypatch, frozen)
    assert "not in CUDA-graph decode" in line and "graphs take the next backend" in line
    plain = [x for x in engine.describe_ops(torch.device("cpu")) if x.startswith("op mla_decode:")]
    assert "CUDA-graph" not in plain[0]  # the torch reference here: nothing to say
