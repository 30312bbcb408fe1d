"""Every shipped tuned config (tuning/configs/NVIDIA_H200) still compiles for sm90 and fits an SM with the
installed Triton: a kernel change that makes a stored config need more shared memory than the GPU has (as
page_ahead at 128 heads with 3 stages once did) fails here, on CPU, instead of in a user's server."""

import json
import os
import subprocess
import sys

import pytest

from pdlab.kernels import tuned


@pytest.mark.parametrize("op", ["mla_decode", "moe_experts"])
def test_shipped_h200_configs_compile_and_fit_an_sm(op):
    path = tuned.SHIPPED_DIR / "NVIDIA_H200" / f"{op}.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compiled, not interpreted
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    r = subprocess.run([sys.executable, "-m", "pdlab.bench.kernel_resources", "--store", str(path)],
                       capture_output=True, text=True, env=env, timeout=900)
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    bad = [x for x in rows if "error" in x or x["programs_per_sm"] < 1]
    assert r.returncode == 0 and not bad, (bad, r.stderr[-2000:])
    entries = json.loads(path.read_text())["entries"]
    if op == "mla_decode":  # one decode launch per bucket
        assert len(rows) == len(entries) == 96  # every decode bucket of `tune attention`
    else:  # masked bf16 buckets: gate_up and down each
        masked = [e for e in entries.values() if e["bucket"]["layout"] == "masked" and e["bucket"]["payload"] == "bf16"]
        assert len(rows) == 2 * len(masked) > 0
    assert all(isinstance(x["registers"], int) and x["shared_bytes"] <= 232448 for x in rows)
