"""Diagnostic probe (not a benchmark), no GPU needed: the sm_90 machine code of the batch-1 packed
product's K-step loop, instruction by instruction kind, for the tiles the H200 chose.

    python scripts/probe_sass_loops.py > OUT.txt
    python scripts/probe_sass_loops.py --tensor-core > OUT.txt
    python scripts/probe_sass_loops.py --registers > OUT.txt
    python scripts/probe_sass_loops.py --tensor-core --wide > OUT.txt

``--tensor-core``: the 4-bit tensor-core kernel (Gluon) instead, for sm_90 and sm_87, at 8 and 16
rows, with x read from memory each step or put in shared memory once a CTA (``X_SHARED``): its
K step's instructions by kind, registers a thread, spilled bytes and shared memory, compiled as a
launch specializes it (pointers, N, K and strides multiples of 16). Output of the run the docs
cite: docs/results/probes/sass-tensor-core-x-shared.txt. With ``--wide``, also with
a lane's words of a step one word a block or side by side (``WIDE``), each way of reading x, and
the K step's loads by width: docs/results/probes/sass-tensor-core-wide.txt.

``--x-ways``: the K step of the integer-dot tiles an H100's step keeps for gate|up and down, in the three ways of
``scripts/probe_x_ready.py``: as built; with x's values the same at every step, so that x's loads, norm and
conversion leave the loop; and with x's integer form read ready-made. What x's work costs in the step, and what
reading it ready-made would leave. Outputs of the runs the docs cite: with the kernel of ``920444a``,
docs/results/probes/sass-integer-dot-x-ways.txt; of ``44188b3`` (x's bounds once a word),
docs/results/probes/sass-integer-dot-x-ways-word-checks.txt; of ``5cc4582`` (whole steps unchecked, taken out),
docs/results/probes/sass-integer-dot-x-ways-whole-steps.txt.

``--registers``: the fastest 4-bit tiles of gate|up and down compiled with and without the register
cap tried on the H200 (not kept), and where in the K step ptxas put the next step's words. Output of the run the docs cite: docs/results/probes/sass-packed-gemv-register-caps.txt.

Triton compiles the kernel on the CPU down to the binary (its wheel carries ``ptxas`` and
``nvdisasm``); each backward branch is a loop, and its body's instructions are counted. A tile of
``bn`` rows by ``bk`` columns over ``warps`` warps gives each thread ``bn · bk · bits / 32 /
(32 · warps)`` words a step. Output of the run the docs cite:
docs/results/probes/sm90-packed-gemv-loops.txt."""
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from edgeinfer.backends.torch import triton_decode
from edgeinfer.testing.triton_compile import disassembled, loops, opcodes, resources


def pointers(dt, *names):
    return {n: f"*{dt}" for n in names}


def packed_gemv_binary(cfg, registers=None, divisible=None, **more) -> bytes:
    """The batch-1 packed product's sm_90 binary with tile ``cfg``, its registers a thread capped at
    ``registers`` (``maxnreg``) where given; ``more``: constexprs set otherwise (``IDOT``, ``SPLIT_K``, ``WIDE``).
    ``divisible``: the integer arguments that are multiples of 16 at the shape compiled for, which a launch
    specializes on as it does on its pointers (16-byte aligned); without it, nothing is."""
    bits, bn, bk, warps, glu, prologue = cfg
    fn = triton_decode._packed_gemv_kernel
    types = {**pointers("bf16", "X", "S", "Z", "BIAS", "RES", "NORM_W", "Y"), "W": "*i32", "PARTS": "*fp32",
             "ARRIVALS": "*i32", **dict.fromkeys(("N", "K", "G", "per_split", "splits"), "i32"), "eps": "fp32"}
    given = dict(PROLOGUE=prologue, HAS_BIAS=False, HAS_RES=prologue == 0, BN=bn, BK=bk, BITS=bits, GS=128,
                 HAS_Z=False, SPLIT_K=False, EXACT=True, EVEN=True, ONE_GROUP=False, POW2_GROUPS=True,
                 XB=2048 if prologue == 1 else 16, GLU=glu, ASM=True, PDL=True,
                 WIDE=bits == 8)  # bf16 activations: 8-bit codes by one byte permute, as the wrapper passes
    given.update(more)
    names = fn.arg_names
    aligned = () if divisible is None else [n for n, t in types.items() if t.startswith("*")] + list(divisible)
    source = ASTSource(fn, {n: types.get(n, "constexpr") for n in names},
                       {(names.index(k),): v for k, v in given.items()},
                       {(names.index(a),): [["tt.divisibility", 16]] for a in aligned})
    options = {"num_warps": warps, "launch_pdl": True, **({"maxnreg": registers} if registers else {})}
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm["cubin"]


def loop_ops(binary: bytes):
    """Each loop of ``binary``: (its instructions, their count by opcode, where in it the 32-bit
    global loads are: the words and 32-bit scales, not x's 16-bit values)."""
    return [(len(body), opcodes(body), [j for j, x in enumerate(body) if "LDG" in x and ".U16" not in x])
            for body in loops(disassembled(binary))]


def tensor_core_kernel(arch: int, bn: int, bk: int, ahead: int, rows: int, split: int, k: int, x_shared: bool,
                       wide: bool = False):
    """The tensor-core kernel compiled for sm_``arch`` as :func:`tensor_core.mma_mm` launches it."""
    from triton.experimental.gluon._runtime import GluonASTSource

    from edgeinfer.quant import launching, tensor_core

    fn = tensor_core._mma_mm_kernel
    names = fn.arg_names
    types = {**pointers("bf16", "X", "S", "Z", "Y"), "Q": "*i32", "PARTS": "*fp32", "ARRIVALS": "*i32",
             **dict.fromkeys(("M", "N", "K", "G", "stride_x", "stride_y", "per_split", "splits"), "i32")}
    per_split = -(-(k // bk) // split) * bk
    given = dict(BN=bn, BM=8 if rows <= 8 else 16, BK=bk, GS=128, HAS_Z=False, SPLIT_K=split > 1, WARPS=4,
                 LW=tensor_core.word_layout(bn, bk, 4, wide), BF16=True, MAGIC=128.0, AHEAD=ahead, X_SHARED=x_shared,
                 X_STEPS=launching.pow2(per_split // bk) if x_shared else 1, WIDE=wide)
    aligned = ("X", "Q", "S", "Z", "Y", "PARTS", "ARRIVALS", "N", "K", "stride_x", "stride_y", "per_split")
    source = GluonASTSource(fn, {n: types.get(n, "constexpr") for n in names},
                            {(names.index(a),): v for a, v in given.items()},
                            {(names.index(a),): [["tt.divisibility", 16]] for a in aligned})
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": 4})


def tensor_core_report(wide: bool = False) -> None:
    """Print, per product, tile and row count, the K step of both ways of reading x; with ``wide``,
    of both ways of laying out a lane's words (x read from memory), and the step's loads by width."""
    print(f"triton {triton.__version__}; 4 warps; bf16; groups of 128; the K step = the loop with the MMAs")
    # (product, K, tile outputs, K step, steps ahead, split) as the H200's tuner met them
    cases = (("gate|up", 1536, 128, 64, 2, 2), ("gate|up", 1536, 64, 64, 1, 2), ("gate|up", 1536, 128, 128, 3, 4),
             ("down", 8960, 128, 64, 2, 8), ("q|k|v", 1536, 64, 64, 3, 4))
    if wide:
        cases += (("gate|up", 1536, 128, 128, 1, 2), ("down", 8960, 128, 128, 2, 10), ("q|k|v", 1536, 64, 128, 2, 4))
    ways = ((False, False, "x loaded"), (False, True, "x loaded, words side by side"), (True, False, "x shared"),
            (True, True, "x shared, words side by side")) if wide else ((False, False, "x loaded"), (True, False, "x shared"))
    for arch in (90, 87):
        for product, k, bn, bk, ahead, split in cases:
            for rows in (8, 16):
                for x_shared, side_by_side, way in ways:
                    kernel = tensor_core_kernel(arch, bn, bk, ahead, rows, split, k, x_shared, side_by_side)
                    regs = resources(kernel.asm["cubin"])
                    # the K step: the loop with the MMAs (the split's sum and x's copy have none)
                    loop = max(loops(disassembled(kernel.asm["cubin"])), key=lambda body: (opcodes(body)["HMMA"], len(body)))
                    n, ops = len(loop), opcodes(loop)
                    kinds = ", ".join(f"{op} {ops.get(op, 0)}" for op in ("HMMA", "LDG", "LDS", "LDSM", "PRMT", "LOP3"))
                    if wide:  # the loads by width: LDG.E is 4 bytes, .64 8, .128 16, .U16 2 (scales)
                        widths = {op: c for op, c in opcodes(loop, modifiers=True).items() if op.startswith("LDG")}
                        kinds += "; loads " + ", ".join(f"{w} {c}" for w, c in sorted(widths.items()))
                    print(f"sm_{arch} {product} K={k} {bn}x{bk} ahead {ahead} split {split}, {rows:2d} rows, "
                          f"{way}: K step {n} instructions ({kinds}); "
                          f"{regs.get('REG')} registers, {regs.get('STACK')} bytes spilled, "
                          f"{kernel.metadata.shared} bytes shared")


def register_caps_report() -> None:
    """Print, for the fastest 4-bit tiles of gate|up and down, where in the K step ptxas asks for the
    next step's words, without a register cap and with the one tried on the H200 (not kept:
    docs/results/probes/h200-register-caps-same-call)."""
    print(f"triton {triton.__version__}; sm_90; 4-bit, bf16, groups of 128; the K step's 32-bit loads "
          "(the next step's words) by position in the step")
    cases = {"gate|up 32x256/4w": ((4, 32, 256, 4, True, 1), 128), "gate|up 16x512/2w": ((4, 16, 512, 2, True, 1), 168),
             "gate|up 32x512/4w": ((4, 32, 512, 4, True, 1), 168), "down 16x1024/4w": ((4, 16, 1024, 4, False, 0), 168),
             "down 8x2048/4w": ((4, 8, 2048, 4, False, 0), 168)}
    for name, (cfg, cap) in cases.items():
        for registers in (None, cap):
            binary = packed_gemv_binary(cfg, registers)
            n, _, wide = max(loop_ops(binary), key=lambda loop: loop[0])
            regs = resources(binary)
            print(f"{name}, cap {registers or 'none'}: {regs.get('REG')} registers, {regs.get('STACK')} bytes "
                  f"spilled; K step of {n}, words asked for at {wide[0]}-{wide[-1]}")


# The integer-dot tiles an H100's step keeps for gate|up and down (docs/results/probes/h100-4-bit-head), compiled as
# Qwen2-VL-2B's launch specializes them: N, K and the columns a split reads are multiples of 16 (gate|up: 17,920,
# 1,536, 1,536; down: 1,536, 8,960, 2,048), its groups a row are not (12, 70), nor are down's 5 splits. down's 8,960
# columns are not a whole number of its 1,024-column steps, so it is launched with ``EVEN`` off: counted that way
# and, for comparison, as if its steps were whole (``EVEN``).
LAUNCHED = ("N", "K", "per_split")
X_CASES = {"gate|up 32x256/4w": ((4, 32, 256, 4, True, 1), {"SPLIT_K": False, "EVEN": True}),
           "down 16x1024/4w split, 8,960 columns (as launched)": (
               (4, 16, 1024, 4, False, 0), {"SPLIT_K": True, "EVEN": False}),
           "down 16x1024/4w split, whole steps": ((4, 16, 1024, 4, False, 0), {"SPLIT_K": True, "EVEN": True})}


def x_way_report(way: str) -> None:
    """Print the K step of the integer-dot tiles of ``X_CASES`` compiled the ``way`` way of
    ``scripts/probe_x_ready.py``: as built, with x's values the same at every step (its loads, norm and rounding
    out of the loop), or with x's integer form read ready-made. Triton keys a compile by the functions it calls,
    memoized a process, so each way is compiled in a process of its own (``--x-way WAY``)."""
    from probe_x_ready import patch  # scripts/ is on the path of a script run from it

    patch(way)
    # the integer-dot tiles, then (built only) down's float tile beside them, compiled the same way
    cases = [(f"{name}, {way}", cfg, more, True) for name, (cfg, more) in X_CASES.items()]
    if way == "built":
        cases += [(f"{name}, float tile, built", cfg, more, False) for name, (cfg, more) in X_CASES.items()
                  if name.startswith("down")]
    for label, cfg, more, idot in cases:
        binary = packed_gemv_binary(cfg, divisible=LAUNCHED, IDOT=idot, WIDE=False, **more)
        body = max(loops(disassembled(binary)), key=len)
        print(f"{label}: K step of {len(body)} ({dict(opcodes(body).most_common(10))}); "
              f"{resources(binary).get('REG')} registers", flush=True)


if __name__ == "__main__" and "--x-way" in sys.argv:
    x_way_report(sys.argv[sys.argv.index("--x-way") + 1])
elif __name__ == "__main__" and "--x-ways" in sys.argv:
    import subprocess

    from probe_x_ready import WAYS

    here = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    changed = subprocess.run(["git", "status", "--porcelain", "edgeinfer"], capture_output=True, text=True).stdout
    print(f"triton {triton.__version__}; sm_90; kernel at {here}{' with changes' if changed else ''}; 4-bit, bf16, "
          "groups of 128, integer-dot tiles as Qwen2-VL-2B's launch specializes them; the K step built, with x the "
          "same at every step (hoisted), and with x's integer form read ready-made (ready)")
    for way in WAYS:
        subprocess.run([sys.executable, __file__, "--x-way", way], check=True)
elif __name__ == "__main__" and "--tensor-core" in sys.argv and "--wide" in sys.argv:
    tensor_core_report(wide=True)
elif __name__ == "__main__" and "--tensor-core" in sys.argv:
    tensor_core_report()
elif __name__ == "__main__" and "--registers" in sys.argv:
    register_caps_report()
elif __name__ == "__main__":
    # (bits, rows, columns, warps, SiLU·up epilogue, RMSNorm prologue): the H200's gate|up and down tiles
    cases = {"8-bit gate|up": (8, 8, 512, 2, True, 1), "8-bit down": (8, 8, 2048, 4, False, 0),
             "4-bit gate|up": (4, 16, 512, 2, True, 1), "4-bit down": (4, 8, 1024, 4, False, 0)}
    for name, cfg in cases.items():
        bits, bn, bk, warps = cfg[:4]
        words = bn * bk * bits // 32 // (32 * warps)
        found = [(n, ops, wide) for n, ops, wide in loop_ops(packed_gemv_binary(cfg)) if n > 1]
        n, ops, wide = max(found, key=lambda f: f[0])  # the K steps; a smaller one is the RMSNorm prologue's sum
        print(f"{name} {cfg}: K-step loop of {n} instructions, {words} words a thread a step "
              f"({n / words:.1f} a word): {dict(ops.most_common(12))}")
        # where ptxas put the 32-bit loads (the next step's words; scales where they are 32-bit)
        print(f"    32-bit loads at instructions {wide} of the {n}")
        for m, other, _ in found:
            if m != n:
                print(f"    another loop (the prologue's sum of squares over x) of {m}: {dict(other.most_common(6))}")
