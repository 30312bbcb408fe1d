"""Registers, spills and shared memory of pdlab's Triton kernels for given configs, compiled for an NVIDIA arch on
any machine (Triton's compiler and the ptxas it ships; no GPU), and how many programs fit on one SM.

    python3 -m pdlab.bench.kernel_resources --heads 16 --kv-dtype fp8 --config default --config '{"BLOCK_N": 16}'
    python3 -m pdlab.bench.kernel_resources --op moe_experts --tokens 1 --config default --config '{"num_stages": 4}'
    python3 -m pdlab.bench.kernel_resources --op moe_experts --config default --sass 12   # + SASS opcode counts

What it compiles is what the op would launch: the op's launcher runs on CPU tensors (sized only as far as
shapes and strides matter) with the kernel replaced by a recorder, and the recorded arguments and constexprs are
compiled for `--arch` (default sm90). mla_decode: the triton decode kernel at [batch, seqlen]; the launcher's
facts about the GPU (its SM count, whether the PTX e4m3 conversion exists: sm89+) are the target's. moe_experts:
the in-loop NVFP4 expert GEMM of each stage (gate_up with SiLU, down) at EP shapes, masked layout, bf16 activations,
config resolved from the tokens per expert as the runner does (the kernel that experts stored tiled run, i.e. on GPUs
other than sm90; on sm90 the runner runs the fragment-order Gluon GEMMs of moe/triton/nvfp4_frag.py for both layouts,
which this tool does not record: tests/moe/test_frag.py compiles them for sm90). mla_decode records the Gluon decode
kernels where the op runs them (sm90: the fp8 kernel at heads × S_q ≤ 32, for programs of 64 rows the two-warpgroup
kernel over 16-bit pools and the wide kernel over fp8).
Occupancy uses the Hopper/Blackwell per-SM limits of `pdlab.kernels.arch.SM90` (65536 registers, 228 KB of shared memory with 1 KB more per resident program, at most 227 KB
for one, 64 warps, 32 programs); the compiler version decides the figures, so compare
configs with the same Triton as the GPU runs.

--sass N disassembles the compiled kernel (the nvdisasm Triton ships) and adds its instruction count, the N most
frequent opcodes and the tensor-core instructions (HGMMA = wgmma, HMMA = mma.sync) to each row: enough to see
where a kernel's issue slots go (e.g. byte permutes around a dequantisation) without a GPU.
"""

from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import sys
import tempfile

import torch

from pdlab.kernels.arch import SM90
from pdlab._subcommands import arg_parser

_TYPES = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", torch.uint8: "*u8",
          torch.int32: "*i32", torch.int64: "*i64"}


class _Recorder:
    """Stands in for a `@triton.jit` kernel: `kernel[grid](*args, **kwargs)` records instead of launching."""

    def __init__(self):
        self.seen: dict = {}

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.seen.update(args=args, kwargs=dict(kwargs), grid=grid)
        return launch


class _Skip:
    """Stands in for a kernel launched around the one compiled: does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def _split_launch(fn, seen: dict) -> dict:
    kw = dict(seen["kwargs"])
    return {"fn": fn, "args": seen["args"], "num_warps": kw.pop("num_warps"), "num_stages": kw.pop("num_stages", 1),
            "constexprs": kw}


def record_launch(heads: int, kv_dtype: str, config: dict, arch: int, q_len: int = 1, page: int = 64,
                  batch: int = 128, seqlen: int = 8192, sm_count: int = 132) -> list[tuple[str, dict]]:
    """The `_mla_fwd` launch `mla_decode` makes for this config at [batch, seqlen] on a GPU of `sm_count` SMs,
    as [("decode", {"fn", "args": positional, "constexprs", "num_warps", "num_stages", "splits", "config"})].
    Tensors here are CPU stand-ins (q [batch, q_len, heads, 576] bf16, a one-page pool [1, page, 576] uint8 or
    bf16, block table [batch, pages] int32, seqlens [batch] int32). Runs the launcher on CPU
    with the kernel replaced by a recorder; the pool is one page (only its page size and strides matter), the
    block table has the full width (the split count follows it)."""
    from pdlab.attention import triton_kernels as tk
    from pdlab.attention.backends.triton_mla import resolve_decode_config

    fp8 = kv_dtype == "fp8"
    cfg = resolve_decode_config(config, heads, q_len, fp8)
    pages = -(-seqlen // page)
    q = torch.zeros(batch, q_len, heads, 576, dtype=torch.bfloat16)
    kv = torch.zeros(1, page, 576, dtype=torch.uint8 if fp8 else torch.bfloat16)
    table = torch.zeros(batch, pages, dtype=torch.int32)
    lens = torch.full((batch,), seqlen, dtype=torch.int32)
    from pdlab.attention import gluon_mla as gm
    from pdlab.attention import gluon_mla_seesaw as gs
    from pdlab.attention import gluon_mla_seesaw_fp8 as gs8
    from pdlab.attention import gluon_mla_wide as gw

    rec, grec, wrec, srec, s8rec = _Recorder(), _Recorder(), _Recorder(), _Recorder(), _Recorder()
    real = tk._mla_fwd, tk._mla_combine, tk._q_prescale, tk._sm_count, tk._ptx_e4m3
    greal = getattr(gm, "_mla_fp8_decode", None), gm.available
    wreal = getattr(gw, "_mla_wide_decode", None), gw.available
    sreal, s8real = getattr(gs, "_mla_seesaw_decode", None), getattr(gs8, "_mla_seesaw_fp8_decode", None)
    # the target's facts in place of this machine's: its SM count, the PTX e4m3 conversion from sm89, and the Gluon
    # decode kernels on sm90 (where this Triton has Gluon)
    tk._mla_fwd, tk._mla_combine, tk._q_prescale = rec, _Skip(), _Skip()
    tk._sm_count, tk._ptx_e4m3 = (lambda device: sm_count), (lambda device: arch >= 89)
    gm._mla_fp8_decode, gw._mla_wide_decode, gs._mla_seesaw_decode, gs8._mla_seesaw_fp8_decode = grec, wrec, srec, s8rec
    gm.available = lambda device, q_dtype=None: None if arch == 90 and gm.HAVE_GLUON else f"not sm90 (sm{arch})"
    gw.available = lambda device, q_dtype=None: None if arch == 90 and gw.HAVE_GLUON else f"not sm90 (sm{arch})"
    try:
        out = torch.empty(batch * q_len, heads, 512, dtype=q.dtype)
        lse = torch.empty(batch, heads, q_len, dtype=torch.float32)
        tk.mla_attention(q.reshape(batch * q_len, heads, 576), kv, table, lens, None, out, lse, (heads, 1, q_len),
                         576 ** -0.5, 0.05 if fp8 else None, q_per_seq=q_len, q_blocks=1, config=cfg)
    finally:
        tk._mla_fwd, tk._mla_combine, tk._q_prescale, tk._sm_count, tk._ptx_e4m3 = real
        gm._mla_fp8_decode, gm.available = greal
        gw._mla_wide_decode, gw.available = wreal
        gs._mla_seesaw_decode, gs8._mla_seesaw_fp8_decode = sreal, s8real
    fn, seen = ((greal[0], grec.seen) if grec.seen else (wreal[0], wrec.seen) if wrec.seen
                else (sreal, srec.seen) if srec.seen else (s8real, s8rec.seen) if s8rec.seen else (real[0], rec.seen))
    launch = _split_launch(fn, seen)
    if launch["constexprs"].get("BALANCED"):  # the fp8 Gluon kernel's balanced schedule: the programs of a sequence
        args, names = launch["args"], fn.arg_names
        splits = max(gm.balanced_schedule([seqlen] * batch, args[names.index("slots")],
                                          args[names.index("num_splits")]))
    else:
        splits = launch["args"][fn.arg_names.index("num_splits")]
    launch.update(config=cfg, splits=splits)
    return [("decode", launch)]


def record_moe_launches(config: dict, tokens: int, experts: int = 64, hidden: int = 7168,
                        inter: int = 2048) -> list[tuple[str, dict]]:
    """The two `_moe_nvfp4_gemm` launches (gate_up + SiLU, down) the triton runner makes for `tokens` per expert
    over `experts` local experts, masked layout, bf16 activations [E, tokens, K], as [(stage, launch)]. Weight
    tensors are broadcast views of one expert ([E, N, K/2] uint8, scales [E, N, K/16] uint8): only their dtype
    and strides matter."""
    from pdlab.moe.runners.triton_nvfp4 import gemm_dtypes, resolve_config
    from pdlab.moe.triton import nvfp4_moe as nm

    cfg = resolve_config(dict(config), tokens, False)
    kind, mma_gate_up, _, mma_down = gemm_dtypes("bf16", torch.bfloat16, cfg)
    E, H, I = experts, hidden, inter
    counts = torch.full((E,), tokens, dtype=torch.int32)

    def weights(n, k):
        return (torch.zeros(1, n, k // 2, dtype=torch.uint8).expand(E, n, k // 2),
                torch.zeros(1, n, k // 16, dtype=torch.uint8).expand(E, n, k // 16), torch.ones(E))

    out = []
    real = nm._moe_nvfp4_gemm
    stages = {"gate_up": (H, I, H, 2 * I, True, kind, mma_gate_up),  # the down GEMM reads the float intermediate
              "down": (I, H, I, H, False, nm.A_FLOAT, mma_down)}
    for stage, (a_cols, n, k, w_rows, silu, a_kind, mma) in stages.items():
        rec = _Recorder()
        nm._moe_nvfp4_gemm = rec
        try:
            w, w_sf, w_s2 = weights(w_rows, k)
            a = torch.zeros(E, tokens, a_cols, dtype=torch.bfloat16)
            o = torch.zeros(E, tokens, n, dtype=torch.bfloat16)
            nm.moe_nvfp4_gemm(a, a_kind, None, None, w, w_sf, w_s2, o, counts, None, masked=True, n=n, k=k,
                              fuse_silu=silu, mma_dtype=mma, cfg=cfg)
        finally:
            nm._moe_nvfp4_gemm = real
        launch = _split_launch(real, rec.seen)
        launch.update(config=cfg, splits=launch["constexprs"].get("SPLIT_K", 1))
        out.append((stage, launch))
    return out


def _source_class(fn):
    """Triton's compile source for a kernel: Gluon kernels (the fp8 MLA decode kernel, the fragment GEMMs) have
    their own."""
    from triton.compiler import ASTSource

    from pdlab.attention.gluon_mla import HAVE_GLUON

    if HAVE_GLUON:
        from triton.experimental.gluon._runtime import GluonASTSource, GluonJITFunction

        if isinstance(fn, GluonJITFunction):
            return GluonASTSource
    return ASTSource


def compile_launch(launch: dict, arch: int, sass: int = 0) -> dict:
    """Compile the recorded launch for sm`arch`; returns registers, spill bytes, shared bytes and programs/SM, and
    with `sass` > 0 the SASS figures of `sass_summary` (its `sass` most frequent opcodes)."""
    import triton
    from triton.backends.compiler import GPUTarget

    fn = launch["fn"]
    names = fn.arg_names
    free = {q.name for q in getattr(fn, "params", []) if getattr(q, "do_not_specialize", False)}
    sig, consts, attrs = {}, dict(launch["constexprs"]), {}
    for i, (name, value) in enumerate(zip(names, launch["args"])):
        # what Triton's JIT specialises on at launch: 16-byte aligned pointers (true of real allocations),
        # integers equal to 1 (made constants) and integers divisible by 16 (marked so), unless do_not_specialize
        if _is_descriptor(value):
            sig[name] = _descriptor_type(value)
        elif torch.is_tensor(value):
            sig[name] = _TYPES[value.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, bool) or value is None:
            consts[name] = value
        elif isinstance(value, int):
            if value == 1 and name not in free:
                consts[name] = 1
            else:
                sig[name] = "i32"
                if value % 16 == 0 and name not in free:
                    attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            sig[name] = "fp32"
        else:
            consts[name] = value
    for name in names:
        if name in consts:
            sig[name] = "constexpr"
        sig.setdefault(name, "constexpr")
    consts = {k: v for k, v in consts.items() if k in names}
    src = _source_class(fn)(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                       options={"num_warps": launch["num_warps"], "num_stages": launch["num_stages"]})
    regs, spill = _ptxas_usage(k.asm["ptx"], arch)
    shared = int(k.metadata.shared)
    warps = int(getattr(k.metadata, "num_warps", launch["num_warps"]))  # with warp-specialized partitions added
    row = {"registers": regs, "spill_bytes": spill, "shared_bytes": shared, "warps": warps,
           "stages": launch["num_stages"], **SM90.programs_per_sm(registers=regs, shared=shared, warps=warps)}
    if sass > 0:
        try:
            row.update(sass_summary(_disassemble(k.asm["cubin"]), sass))
        except (OSError, KeyError, subprocess.SubprocessError) as exc:
            row["sass_error"] = f"{type(exc).__name__}: {exc}"
    return row


def _is_descriptor(value) -> bool:
    """Whether a recorded argument is a Gluon TMA descriptor (the 64-row MLA decode kernels' cache)."""
    return type(value).__name__ == "TensorDescriptor" and hasattr(value, "block_shape")


def _descriptor_type(desc) -> str:
    """The signature type the JIT gives a Gluon TMA descriptor: tensordesc<dtype[block],layout>."""
    elem = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.uint8: "u8",
            torch.float8_e4m3fn: "fp8e4nv"}[desc.base.dtype]
    return f"tensordesc<{elem}[{', '.join(str(d) for d in desc.block_shape)}],{desc.layout!r}>"


_SASS_LINE = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[0-9T]\s+)?([A-Z][A-Z0-9_]*)")


def sass_opcodes(text: str) -> collections.Counter:
    """Opcode counts of a SASS listing (nvdisasm / cuobjdump -sass text): one per instruction line, the opcode
    without its modifiers (`LDGSTS.E.BYPASS.128` counts as LDGSTS), predicates ignored."""
    return collections.Counter(m.group(1) for m in map(_SASS_LINE.match, text.splitlines()) if m)


def sass_summary(text: str, top: int) -> dict:
    """{sass_instructions, sass_top: "OP:n OP:n …" (the `top` most frequent), sass_mma: HGMMA / HMMA counts}."""
    ops = sass_opcodes(text)
    return {"sass_instructions": sum(ops.values()),
            "sass_top": " ".join(f"{op}:{n}" for op, n in ops.most_common(top)),
            "sass_mma": {op: ops[op] for op in ("HGMMA", "HMMA") if ops[op]}}


def _nvidia_tool(name: str) -> str:
    """Path of one of the NVIDIA tools (ptxas, nvdisasm, …) the installed Triton ships."""
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def _disassemble(cubin: bytes) -> str:
    """SASS text of a cubin with the nvdisasm Triton ships."""
    tool = _nvidia_tool("nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        return subprocess.run([tool, "-c", f.name], capture_output=True, text=True, check=True, timeout=300).stdout
    finally:
        os.unlink(f.name)


def _ptxas_usage(ptx: str, arch: int) -> tuple[int | None, int]:
    """(registers, spill store bytes) that ptxas reports for the kernel."""
    suffix = "a" if arch in (90, 100) else ""
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        # the newer ptxas first: a Triton that emits a newer PTX version needs it
        for name in ("ptxas-blackwell", "ptxas"):
            path = _nvidia_tool(name)
            if not os.path.exists(path):
                continue
            r = subprocess.run([path, f"-arch=sm_{arch}{suffix}", "-v", f.name, "-o", os.devnull],
                               capture_output=True, text=True, check=False)
            text = r.stdout + r.stderr
            regs = re.search(r"Used (\d+) registers", text)
            if regs:
                spill = re.search(r"(\d+) bytes spill stores", text)
                return int(regs.group(1)), (int(spill.group(1)) if spill else 0)
    finally:
        os.unlink(f.name)
    return None, 0


def store_rows(path: str, arch: int = 90) -> list[dict]:
    """Compile every entry of a tuned-config store file (mla_decode or moe_experts) at its own bucket: one row
    per launch with the bucket, the stage and the figures of `compile_launch` (or the error)."""
    from pdlab.kernels import registry, tuned

    data = tuned.read_store(path)
    op = data.get("op") or os.path.splitext(os.path.basename(path))[0]
    backend = registry.get_backend(op, "triton")
    rows = []
    for label, entry in sorted(data["entries"].items()):
        cfg = (entry.get("backends", {}).get("triton") or {}).get("config")
        if cfg is None:
            continue
        b = entry["bucket"]
        try:
            if op == "mla_decode":
                launches = record_launch(int(b["heads"]), b["kv_dtype"], backend.config(cfg), arch, int(b["q_len"]),
                                         batch=int(b["batch"]), seqlen=int(b["seqlen"]))
            elif op == "moe_experts" and b.get("layout") == "masked" and b.get("payload") == "bf16":
                launches = record_moe_launches(backend.config(cfg), int(b["tokens_per_expert"]), int(b["experts"]))
            else:
                continue  # other layouts / payloads: not recorded by this tool
            for stage, launch in launches:
                rows.append({"bucket": label, "stage": stage, **compile_launch(launch, arch)})
        except Exception as exc:  # noqa: BLE001  (reported per entry)
            rows.append({"bucket": label, "error": f"{type(exc).__name__}: {exc}"})
    return rows


def main(argv=None) -> int:
    from pdlab._subcommands import int_arg

    first = " ".join(__doc__.split("\n\n")[0].split())  # the first paragraph, whole
    ap = arg_parser(prog="pdlab.bench.kernel_resources", description=first)
    ap.add_argument("--op", choices=("mla_decode", "moe_experts"), default="mla_decode")
    ap.add_argument("--heads", type=int_arg(1), default=16, help="mla_decode")
    ap.add_argument("--kv-dtype", choices=("bf16", "fp8"), default="fp8", help="mla_decode")
    ap.add_argument("--s-q", type=int, default=1, choices=(1, 2, 4), help="mla_decode")
    ap.add_argument("--batch", type=int_arg(1), default=128, help="mla_decode")
    ap.add_argument("--seqlen", type=int_arg(1), default=8192, help="mla_decode")
    ap.add_argument("--sm-count", type=int_arg(1), default=132, help="SMs of the target GPU (decode splits follow it)")
    ap.add_argument("--tokens", type=int_arg(1), default=1, help="moe_experts: tokens per expert")
    ap.add_argument("--experts", type=int_arg(1), default=64,
                    help="moe_experts: local experts (EP4 of DeepSeek-R1: 64)")
    ap.add_argument("--arch", type=int, default=90, help="compute capability as a number (90 = sm90)")
    ap.add_argument("--config", action="append", default=[],
                    help="'default' or a JSON object merged over the default (repeatable; default: default)")
    ap.add_argument("--sass", type=int, default=0, metavar="N",
                    help="also disassemble: instruction count, the N most frequent opcodes, tensor-core instructions")
    ap.add_argument("--store", default=None, metavar="FILE",
                    help="instead: compile every entry of a tuned-config file at its bucket; exit 1 if one does "
                         "not fit an SM (e.g. tuning/configs/NVIDIA_H200/mla_decode.json)")
    args = ap.parse_args(argv)
    if args.sass < 0:
        ap.error(f"--sass {args.sass}: give a number of opcodes >= 0 (0: no disassembly)")
    from pdlab.attention import ops  # noqa: F401  (registers the attention backends)
    from pdlab.kernels import registry
    from pdlab.moe.runners import triton_nvfp4  # noqa: F401  (registers the experts runner)

    configs = []  # checked before anything compiles: a usage error comes first
    backend = registry.get_backend(args.op, "triton")
    for text in args.config or ["default"]:
        try:
            raw = {} if text == "default" else json.loads(text)
            if not isinstance(raw, dict):
                raise ValueError("not a JSON object")
            configs.append((text, backend.config(raw)))  # ValueError naming a knob the backend does not declare
        except ValueError as exc:
            print(f"kernel_resources: --config {text!r}: {exc}; give 'default' or a JSON object", file=sys.stderr)
            return 2
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("kernel_resources: TRITON_INTERPRET=1 makes the kernels interpreter functions, which do not "
              "compile; run it without that variable", file=sys.stderr)
        return 2
    if args.store:
        bad = 0
        for row in store_rows(args.store, args.arch):
            bad += "error" in row or row["programs_per_sm"] < 1
            print(json.dumps(row), flush=True)
        return 1 if bad else 0
    for text, config in configs:
        if args.op == "mla_decode":
            launches = record_launch(args.heads, args.kv_dtype, config, args.arch, args.s_q,
                                     batch=args.batch, seqlen=args.seqlen, sm_count=args.sm_count)
        else:
            launches = record_moe_launches(config, args.tokens, args.experts)
        for stage, launch in launches:
            row = {"config": text, "stage": stage, "splits": launch["splits"],
                   **compile_launch(launch, args.arch, args.sass)}
            print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
