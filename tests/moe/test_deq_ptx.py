"""The PTX nibble unpacks of the triton NVFP4 runner (DEQ_ASM 1 and 2), run on CPU by a small interpreter
of the few PTX instructions they use, against the E2M1 table: every code in every nibble position, and
random block scales. The GPU tests check the same kernels end to end; this pins the bit logic itself."""

import os
import random
import re

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before any pdlab Triton kernel is defined (as the runner tests need)

from pdlab.kernels.nvfp4 import E2M1_VALUES  # noqa: E402
from pdlab.moe.triton import nvfp4_moe  # noqa: E402

M32 = 0xFFFFFFFF


def _f16x2(word: int) -> tuple[float, float]:
    pair = np.array([word & 0xFFFF, word >> 16], dtype=np.uint16).view(np.float16)
    return float(pair[0]), float(pair[1])


def _pack_f16x2(lo: float, hi: float) -> int:
    bits = np.array([lo, hi], dtype=np.float16).view(np.uint16)
    return int(bits[0]) | int(bits[1]) << 16


def _e4m3x2_to_f16x2(half: int) -> int:
    out = []
    for byte in (half & 0xFF, half >> 8):
        s, e, m = byte >> 7, (byte >> 3) & 0xF, byte & 7
        v = (m / 8) * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
        out.append(-v if s else v)
    return _pack_f16x2(*out)


def _prmt(a: int, b: int, sel: int) -> int:
    src = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    out = 0
    for i in range(4):
        c = (sel >> (4 * i)) & 0xF
        assert c < 8, "sign-replicate mode is not used"
        out |= src[c] << (8 * i)
    return out


def _run_ptx(text: str, operands: list[int]) -> list[int]:
    """Interpret the unpack's PTX: $0..$3 outputs, $4 packed nibbles, $5 $6 f16x2 scales."""
    regs: dict[str, int] = {f"${i}": v for i, v in enumerate(operands)}

    def val(tok: str) -> int:
        tok = tok.strip()
        return int(tok, 16) if tok.startswith("0x") else int(tok) if tok.isdigit() else regs[tok]

    for line in text.splitlines():
        line = line.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        if op == "mov.b32" and args.strip().startswith("{"):  # split a register into its two 16-bit halves
            parts = re.match(r"\{(\w+),\s*(\w+)\},\s*(\S+)", args)
            w = val(parts.group(3))
            regs[parts.group(1)], regs[parts.group(2)] = w & 0xFFFF, w >> 16
            continue
        d, *src = [a.strip() for a in args.split(",")]
        x = [val(a) for a in src]
        if op == "mov.b32":
            r = x[0]
        elif op == "shl.b32":
            r = (x[0] << x[1]) & M32
        elif op == "shr.b32":
            r = x[0] >> x[1]
        elif op == "and.b32":
            r = x[0] & x[1]
        elif op == "or.b32":
            r = x[0] | x[1]
        elif op == "prmt.b32":
            r = _prmt(x[0], x[1], x[2])
        elif op == "cvt.rn.f16x2.e4m3x2":
            r = _e4m3x2_to_f16x2(x[0])
        elif op == "mul.rn.f16x2":
            (a0, a1), (b0, b1) = _f16x2(x[0]), _f16x2(x[1])
            r = _pack_f16x2(np.float16(a0) * np.float16(b0), np.float16(a1) * np.float16(b1))
        else:
            raise AssertionError(f"instruction {op} not interpreted")
        regs[d] = r
    return [regs[f"${i}"] for i in range(4)]


def _text(asm) -> str:
    return asm.value if hasattr(asm, "value") else str(asm)


def _e2m1(code: int) -> float:
    return -E2M1_VALUES[code & 7] if code & 8 else E2M1_VALUES[code & 7]


@pytest.mark.parametrize("asm,unit", [(nvfp4_moe._DEQ_ASM, 2.0 ** -6), (nvfp4_moe._DEQ_ASM_PRMT, 2.0 ** -14)])
def test_ptx_unpack_gives_every_code_times_its_scale(asm, unit):
    # one word = 4 bytes = 8 nibbles; outputs: $0 = elements (0, 2), $1 = (4, 6) [low nibbles of bytes 0..3],
    # $2 = (1, 3), $3 = (5, 7) [high nibbles]; scale $5 applies to $0/$2, $6 to $1/$3
    text = _text(asm)
    rng = random.Random(0)
    words = [sum(((c + 3 * i) % 16) << (4 * i) for i in range(8)) for c in range(16)]
    words += [rng.getrandbits(32) for _ in range(200)]
    scales = [1.0, 0.5, 448.0, 2.0 ** -6, 0.875, 3.25]
    for w in words:
        s5, s6 = rng.choice(scales), rng.choice(scales)
        out = _run_ptx(text, [0, 0, 0, 0, w, _pack_f16x2(s5, s5), _pack_f16x2(s6, s6)])
        got = [*_f16x2(out[0]), *_f16x2(out[1]), *_f16x2(out[2]), *_f16x2(out[3])]
        codes = [(w >> (4 * i)) & 0xF for i in range(8)]
        want = [_e2m1(codes[0]) * s5, _e2m1(codes[2]) * s5, _e2m1(codes[4]) * s6, _e2m1(codes[6]) * s6,
                _e2m1(codes[1]) * s5, _e2m1(codes[3]) * s5, _e2m1(codes[5]) * s6, _e2m1(codes[7]) * s6]
        assert got == [v * unit for v in want], (hex(w), got, want)


def test_prmt_unpack_has_the_integer_unpacks_bits():
    # DEQ_ASM=2 must equal the interpreter-testable integer unpack (((x << 28) >> 19) & 0x8E00 per byte)
    text = _text(nvfp4_moe._DEQ_ASM_PRMT)
    one = _pack_f16x2(1.0, 1.0)
    for byte in range(256):
        w = byte * 0x01010101
        out = _run_ptx(text, [0, 0, 0, 0, w, one, one])
        lo = int(np.int32(np.uint32((byte << 28) & M32)) >> 19) & 0x8E00
        hi = int(np.int32(np.uint32((byte << 24) & M32)) >> 19) & 0x8E00
        assert out[0] == lo | lo << 16 and out[2] == hi | hi << 16, (byte, hex(out[0]), hex(lo), hex(out[2]), hex(hi))
