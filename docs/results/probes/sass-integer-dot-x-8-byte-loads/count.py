import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from edgeinfer.backends.torch import triton_decode
from edgeinfer.testing.triton_compile import disassembled, loops, opcodes, resources

def binary(bits, bn, bk, warps, glu, prologue, idot, arch=90, has_z=False, vecx=False):
    fn = triton_decode._packed_gemv_kernel
    types = {**{n: "*bf16" for n in ("X", "S", "Z", "BIAS", "RES", "NORM_W", "Y")}, "W": "*i32", "PARTS": "*fp32",
             "ARRIVALS": "*i32", **dict.fromkeys(("N", "K", "G", "per_split", "splits"), "i32"), "eps": "fp32"}
    given = dict(PROLOGUE=prologue, HAS_BIAS=False, HAS_RES=prologue == 0, BN=bn, BK=bk, BITS=bits, GS=128,
                 HAS_Z=has_z, SPLIT_K=False, EXACT=True, EVEN=True, ONE_GROUP=False, POW2_GROUPS=True,
                 XB=2048 if prologue == 1 else 16, GLU=glu, ASM=True, PDL=arch >= 90, WIDE=bits == 8, IDOT=idot, VECX=vecx)
    names = fn.arg_names
    source = ASTSource(fn, {n: types.get(n, "constexpr") for n in names}, {(names.index(k),): v for k, v in given.items()})
    options = {"num_warps": warps, "launch_pdl": arch >= 90}
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options).asm["cubin"]

import sys
for name, cfg in {"gate_up 32x256/4w": (4, 32, 256, 4, True, 1), "gate_up 16x512/2w": (4, 16, 512, 2, True, 1),
                  "qkv 16x2048/4w": (4, 16, 2048, 4, False, 1), "o 8x2048/4w": (4, 8, 2048, 4, False, 0),
                  "down 16x1024/4w": (4, 16, 1024, 4, False, 0), "down 8x2048/4w": (4, 8, 2048, 4, False, 0)}.items():
    for vecx in (False, True):
        b = binary(*cfg, True, vecx=vecx)
        body = max(loops(disassembled(b)), key=len)
        bits, bn, bk, warps = cfg[:4]
        words = bn * bk * bits // 32 // (32 * warps)
        ops = opcodes(body)
        top = ", ".join(f"{k} {v}" for k, v in sorted(ops.items(), key=lambda kv: -kv[1])[:12])
        r = resources(b)
        print(f"{name} vecx={vecx}: step {len(body)} for {words} words/thread = {len(body)/words:.1f}/word; regs {r.get('REG')} spill {r.get('STACK')}; {top}", flush=True)
