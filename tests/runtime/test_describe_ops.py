"""The start-up log names each op's backend; for one that plans on the host (flashinfer) it says that the decode
CUDA graphs take another, so the log does not claim a backend the graphs never run."""

import torch

from pdlab.kernels import registry
from pdlab.runtime.engine import engine


def test_startup_log_says_a_host_planned_decode_backend_stays_out_of_the_graphs(monkeypatch):
    import pdlab.attention  # noqa: F401  (registers the attention backends)

    flash = registry.get_backend("mla_decode", "flashinfer")
    real = registry.select
    monkeypatch.setattr(registry, "select", lambda op, name=None, device=None, accept=None:
                        flash if op == "mla_decode" else real(op, name, device=device, accept=accept))
    lines = engine.describe_ops(torch.device("cpu"))
    decode = [x for x in lines if x.startswith("op mla_decode:")]
    assert len(decode) == 1 and "backend flashinfer" in decode[0] and "not in CUDA-graph decode" in decode[0]
    assert not any("CUDA-graph" in x for x in lines if not x.startswith("op mla_decode:"))
    monkeypatch.setattr(registry, "select", real)
    plain = [x for x in engine.describe_ops(torch.device("cpu")) if x.startswith("op mla_decode:")]
    assert "CUDA-graph" not in plain[0]  # the torch reference here: nothing to say
