"""The two-warpgroup ("seesaw") Gluon MLA decode kernels on CPU: attention/gluon_mla_seesaw.py (16-bit pools) and
attention/gluon_mla_seesaw_fp8.py (fp8 pools) compile for sm90 to the schedule their docstrings describe. Their
results against the fp32 reference are GPU tests in test_gluon_mla_wide.py (the seesaw is the default of the wide
kernel's launcher)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pdlab.attention import gluon_mla_wide as W
from pdlab.kernels.arch import SM90

_COMPILE = r"""
import json, sys, torch, triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from pdlab.bench.kernel_resources import _disassemble, _ptxas_usage
from pdlab.attention import gluon_mla_wide as W, gluon_mla_seesaw as S, gluon_mla_seesaw_fp8 as S8
final, q_per_seq, page, fp8 = sys.argv[1] == "1", int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
fn = S8._mla_seesaw_fp8_decode if fp8 else S._mla_seesaw_decode
names = fn.arg_names
kv = torch.zeros(8, page, 576, dtype=torch.uint8).view(torch.float8_e4m3fn) if fp8 else \
    torch.zeros(8, page, 576, dtype=torch.bfloat16)
elem = "fp8e4nv" if fp8 else "bf16"
desc, lat = W.kv_descriptor(kv), W.latent_descriptor(kv)
ptrs = {"Q": "*bf16", "BT": "*i32", "SEQLENS": "*i32", "O": "*bf16", "LSE": "*fp32", "O_PART": "*fp32",
        "LSE_PART": "*fp32", "KV_SCALE_PTR": "*fp32", "kv_desc": f"tensordesc<{elem}[64, 64],{desc.layout!r}>",
        "lat_desc": f"tensordesc<{elem}[8, 64, 64],{lat.layout!r}>"}
sig = {n: ptrs.get(n, "fp32" if n in ("qk_scale", "kv_scale") else "i32") for n in names}
consts = {"Q_PER_SEQ": q_per_seq, "BLOCK_H": 64 // q_per_seq, "PAGE": page, "FINAL": final}
if fp8:
    consts["SCALE_FROM_PTR"] = False
attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
         if sig[n].startswith("*") or n.startswith("stride")}
sig.update({k: "constexpr" for k in consts})
k = triton.compile(GluonASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                   target=GPUTarget("cuda", 90, 32), options={"num_warps": int(S.WARPS), "num_stages": 1})
regs, spill = _ptxas_usage(k.asm["ptx"], 90)
ops = {}
for line in _disassemble(k.asm["cubin"]).splitlines():
    for name in ("HGMMA.64x64x16.F32", "HGMMA.64x256x16.F32", "QGMMA.64x64x32.F32.E4M3.E4M3", "UTMALDG.2D",
                 "UTMALDG.3D", "USETMAXREG", "F2FP.F16.E4M3.UNPACK_B"):
        if name in line:
            ops[name] = ops.get(name, 0) + 1
print(json.dumps({"shared": k.metadata.shared, "warps": k.metadata.num_warps, "spill": spill, "ops": ops}))
"""


def _compiled(final: bool, q_per_seq: int, page: int, fp8: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", _COMPILE, str(int(final)), str(q_per_seq), str(page), str(int(fp8))],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads([line for line in r.stdout.splitlines() if line.startswith("{")][-1])
    # what both kernels share: two warpgroups (warp_specialize, registers moved between them), each one's half of
    # p·v for both tiles of a pair (2 × 4 wgmma 64×256 each), the tiles by TMA as one latent box and the rope block
    # (the two first tiles, then the right warpgroup's two refills), no spills
    ops = got["ops"]
    assert got["warps"] == 8 and ops.get("USETMAXREG", 0) >= 2, got
    assert ops["HGMMA.64x256x16.F32"] == 2 * 2 * 4, ops
    assert ops["UTMALDG.3D"] == ops["UTMALDG.2D"] == 4, ops
    assert got["spill"] == 0, got
    return got


@pytest.mark.skipif(not W.HAVE_GLUON, reason="this Triton has no Gluon")
@pytest.mark.parametrize("final,q_per_seq,page", [(True, 1, 64), (False, 2, 128)])
def test_compiles_for_sm90_two_warpgroups_one_program_per_sm(final, q_per_seq, page):
    # compiled for sm90 in its own process (`_compiled` checks what both kernels share): each warpgroup with its
    # own q·k over a whole tile (36 wgmma 64×64 each); q, the two tiles and p fit one SM's shared memory
    got = _compiled(final, q_per_seq, page, False)
    assert got["ops"]["HGMMA.64x64x16.F32"] == 2 * 36, got
    assert 64 * 576 * 2 * 3 + 64 * 64 * 2 <= got["shared"] <= SM90.shared_per_program, got


@pytest.mark.skipif(not W.HAVE_GLUON, reason="this Triton has no Gluon")
@pytest.mark.parametrize("final,q_per_seq,page", [(True, 1, 64), (False, 4, 128)])
def test_fp8_kernel_compiles_for_sm90_e4m3_qk_and_each_warpgroup_converting_its_half(final, q_per_seq, page):
    # over fp8: each warpgroup's q·k of its tile as e4m3 × e4m3 wgmma straight from the ring (2 parts × 9 column
    # blocks × 2 instructions of K 32), its half of p·v as the 16-bit kernel's (`_compiled`); the only
    # conversions are V's halves (64 × 256 values a warpgroup and tile: 64 per thread, at 2 + 3 call sites: 320);
    # q's parts, the two fp8 tiles, the two fp16 halves and p fit one SM's shared memory
    from pdlab.attention import gluon_mla_seesaw_fp8 as S8

    got = _compiled(final, q_per_seq, page, True)
    ops = got["ops"]
    assert ops["QGMMA.64x64x32.F32.E4M3.E4M3"] == 2 * 36, ops
    assert "HGMMA.64x64x16.F32" not in ops, ops  # nothing of q·k in 16 bits
    assert ops["F2FP.F16.E4M3.UNPACK_B"] == 5 * 64, ops
    assert S8.shared_bytes() <= got["shared"] <= SM90.shared_per_program, got
