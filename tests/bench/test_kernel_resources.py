"""`python -m pdlab.bench.kernel_resources`: the MLA decode kernel and the NVFP4 expert GEMMs compiled for sm90
on this CPU machine (Triton's compiler and the ptxas it ships), with registers, shared memory and programs per SM."""

import json
import os
import subprocess
import sys


def _run(*argv):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compiled, not interpreted
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    return subprocess.run([sys.executable, "-m", "pdlab.bench.kernel_resources", *argv], capture_output=True,
                          text=True, env=env, timeout=600)


def test_resources_of_the_fp8_decode_kernel_for_sm90():
    from pdlab.attention import gluon_mla

    t = '{"kernel": "triton"'
    configs = ["default", t + "}", t + ', "BLOCK_N": 16}', t + ', "BLOCK_N": 16, "num_stages": 4}']
    r = _run("--heads", "16", "--kv-dtype", "fp8", *[arg for c in configs for arg in ("--config", c)])
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert [x["config"] for x in rows] == configs
    default, triton, bn16, bn16_s4 = rows
    for x in rows:
        assert isinstance(x["registers"], int) and 32 <= x["registers"] <= 255
        assert x["shared_bytes"] > 0 and x["programs_per_sm"] == min(x["by_registers"], x["by_shared"], 16, 32)
    # B=128, 8k on 132 SMs, the launchers' own rules (recorded, not recomputed). The default on sm90 is the Gluon
    # kernel where this Triton has Gluon: every row of a sequence in one program, 2 splits, two programs per SM
    if gluon_mla.HAVE_GLUON:
        assert default["splits"] == 2 and default["warps"] == 4 and default["programs_per_sm"] == 2
        assert gluon_mla.shared_bytes(16) <= default["shared_bytes"] <= \
            gluon_mla.shared_bytes(16) + 1024
    else:
        assert default == {**triton, "config": "default"}
    # the Triton kernel: 16-head programs, ~8 splits, 3 stages
    assert triton["splits"] == 8 and triton["warps"] == 4 and triton["stages"] == 3
    # a 16-token tile needs less shared memory than a 32-token one; one more stage needs more
    assert bn16["shared_bytes"] < triton["shared_bytes"] and bn16_s4["shared_bytes"] > bn16["shared_bytes"]


def test_bad_config_and_interpreter_are_refused():
    r = _run("--config", "[1, 2]")
    assert r.returncode == 2 and "give 'default' or a JSON object" in r.stderr
    r = _run("--sass", "-3")
    assert r.returncode == 2 and "--sass -3: give a number of opcodes >= 0" in r.stderr
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-m", "pdlab.bench.kernel_resources"], capture_output=True, text=True,
                       env=env, timeout=300)
    assert r.returncode == 2 and "run it without that variable" in r.stderr


def test_128_head_fp8_launch_on_sm90_and_elsewhere():
    # sm90 (a Triton with Gluon): the two-warpgroup fp8 kernel (splits of 128 tiles), one split at B=128 (256
    # programs, ~2 waves), one 8-warp program per SM holding q's e4m3 parts, the fp8 ring and the two fp16 V halves.
    # sm89: `_mla_fwd`, which above 32 rows over an fp8 pool rescales q in its own launch first (q_prescale):
    # recorded past it, compiled, 2 splits
    from pdlab.attention import gluon_mla_seesaw_fp8, gluon_mla_wide

    for arch in ("90", "89"):
        r = _run("--heads", "128", "--kv-dtype", "fp8", "--config", "default", "--arch", arch)
        assert r.returncode == 0, r.stderr[-2000:]
        row = json.loads([line for line in r.stdout.splitlines() if line.startswith("{")][0])
        assert row["warps"] == 8 and isinstance(row["registers"], int) and row["programs_per_sm"] >= 1
        if arch == "90" and gluon_mla_wide.HAVE_GLUON:
            assert row["splits"] == 1 and row["programs_per_sm"] == 1, row
            assert gluon_mla_seesaw_fp8.shared_bytes() <= row["shared_bytes"] <= 232448, row
            assert row["spill_bytes"] == 0, row
        else:
            assert row["splits"] == 2 and row["shared_bytes"] > 64 * 576, row  # at least one fp8 KV tile


def test_moe_expert_gemms_at_ep4_decode():
    # the two NVFP4 GEMMs the triton runner launches at 1 token/expert: gate_up holds two weight tiles per
    # stage (gate and up), down one, so gate_up needs more shared memory
    r = _run("--op", "moe_experts", "--tokens", "1", "--config", "default", "--sass", "6")
    assert r.returncode == 0, r.stderr[-2000:]
    rows = {x["stage"]: x for x in (json.loads(line) for line in r.stdout.splitlines() if line.startswith("{"))}
    assert set(rows) == {"gate_up", "down"}
    assert rows["gate_up"]["shared_bytes"] > rows["down"]["shared_bytes"] > 0
    assert all(isinstance(x["registers"], int) and x["programs_per_sm"] >= 1 for x in rows.values())
    # --sass: the disassembly of each GEMM. gate_up (two weight tiles, SiLU) is the longer kernel and issues
    # twice the tensor-core instructions of down; both dequantise in the main loop, so integer logic is among
    # the most frequent opcodes
    for x in rows.values():
        top = dict(item.split(":") for item in x["sass_top"].split())
        assert len(top) == 6 and sum(map(int, top.values())) <= x["sass_instructions"]
        assert "LOP3" in top, x["sass_top"]
    assert rows["gate_up"]["sass_instructions"] > rows["down"]["sass_instructions"]
    mma = {stage: x["sass_mma"] for stage, x in rows.items()}
    op = "HGMMA" if "HGMMA" in mma["down"] else "HMMA"
    assert mma["gate_up"][op] == 2 * mma["down"][op] > 0, mma


def test_sass_opcode_counts_of_a_listing():
    from pdlab.bench.kernel_resources import sass_opcodes, sass_summary

    listing = """
        .section .text._moe_nvfp4_gemm,"ax",@progbits
        /*0cf0*/                   LDGSTS.E.BYPASS.128 [R41+0x8000], desc[UR12][R12.64], P3 ;
        /*0d60*/                   LDGDEPBAR ;
        /*14e0*/              @!P2 BRA 0x1610 ;
        /*1f20*/                   PRMT R108, R68.reuse, 0x5140, R69.reuse ;
        /*1f50*/               @P0 PRMT R69, R68, 0x7362, R69 ;
        /*37d0*/                   HGMMA.64x16x16.F32 R32, R56, gdesc[UR4], R32 ;
        /*5500*/             @!UPT LDGSTS.E.BYPASS.128 [R153+0x8000], desc[UR12][R146.64], P2 ;
                                                                                     /* 0x0800000092997fae */
    .L_x_12:
    """
    ops = sass_opcodes(listing)
    assert ops == {"LDGSTS": 2, "LDGDEPBAR": 1, "BRA": 1, "PRMT": 2, "HGMMA": 1}
    assert sass_summary(listing, 2) == {"sass_instructions": 7, "sass_top": "LDGSTS:2 PRMT:2",
                                        "sass_mma": {"HGMMA": 1}}
