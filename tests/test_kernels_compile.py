"""The Triton kernels of the GPU decode path compile for Hopper (sm_90) and Jetson Orin (sm_87), on any machine.

Triton's own compiler runs on the CPU down to the GPU binary (its wheel carries ``ptxas``), so
what the CPU interpreter cannot see is checked here without a GPU: the kernels' code generation
(a construct the interpreter runs but the compiler rejects) and their fit on Orin's
architecture. Each kernel is compiled with the arguments its Python wrapper passes, for every
branch its constexprs select. Where Triton is not installed (CPU builds of torch) the module
is skipped and says so.
"""

from __future__ import annotations

import collections
import itertools

import pytest
import torch

triton = pytest.importorskip("triton", reason="Triton is not installed (CPU builds of torch come without it)")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from edgeinfer.backends.torch import decode_attention, triton_decode  # noqa: E402
from edgeinfer.quant import kernels, launching  # noqa: E402
from edgeinfer.quant.launching import PackedGeometry  # noqa: E402
from edgeinfer.testing.triton_compile import disassembled, instructions, loops, opcodes, resources  # noqa: E402

TARGETS = {"sm_90 (Hopper)": GPUTarget("cuda", 90, 32), "sm_87 (Orin)": GPUTarget("cuda", 87, 32)}


def compiled(fn, types: dict[str, str], constexprs: dict, warps: int = 4, stages: int = 3,
             targets: dict[str, GPUTarget] = TARGETS) -> dict[str, int]:
    """Cubin bytes per target of ``fn`` with pointer/scalar ``types`` and ``constexprs``; a kernel that
    can launch as a programmatic dependent (``PDL``) does so where its wrapper would (sm_90 and later)."""
    names = fn.arg_names
    sizes = {}
    for label, target in targets.items():
        given = {**constexprs, **({"PDL": target.arch >= 90} if "PDL" in names else {})}
        missing = set(names) - set(types) - set(given)
        assert not missing, f"no type given for {sorted(missing)}"
        signature = {name: types.get(name, "constexpr") for name in names}
        source = ASTSource(fn, signature, {(names.index(k),): v for k, v in given.items()})
        options = {"num_warps": warps, "num_stages": stages, "launch_pdl": bool(given.get("PDL"))}
        sizes[label] = len(triton.compile(source, target=target, options=options).asm["cubin"])
    return sizes


def test_dependent_launch_waits_in_the_binary():
    """On Hopper a kernel launched as a dependent carries the wait for the kernels before it; on Orin
    (no such launch) it does not."""
    types = {**pointers("bf16", "X", "W", "BIAS", "RES", "NORM_W", "Y"),
             **dict.fromkeys(("N", "K", "stride_x", "stride_r", "stride_y"), "i32"), "eps": "fp32"}
    names = triton_decode._gemv_kernel.arg_names
    for target, pdl in ((TARGETS["sm_90 (Hopper)"], True), (TARGETS["sm_87 (Orin)"], False)):
        given = dict(MP=1, PROLOGUE=0, HAS_BIAS=False, HAS_RES=True, BN=8, BK=512, USE_DOT=False, IEEE=False, XB=16,
                     GLU=False, PDL=pdl)
        source = ASTSource(triton_decode._gemv_kernel, {n: types.get(n, "constexpr") for n in names},
                           {(names.index(k),): v for k, v in given.items()})
        ptx = triton.compile(source, target=target, options={"launch_pdl": pdl}).asm["ptx"]
        assert ("griddepcontrol.wait" in ptx) == pdl
        assert ("griddepcontrol.launch_dependents" in ptx) == pdl


def pointers(dt: str, *names: str) -> dict[str, str]:
    return {name: f"*{dt}" for name in names}


def packed_gemv_types(dt: str) -> dict[str, str]:
    """``_packed_gemv_kernel``'s argument types with activations of ``dt``."""
    return {**pointers(dt, "X", "S", "Z", "BIAS", "RES", "NORM_W", "Y"), "W": "*i32", "PARTS": "*fp32",
            "ARRIVALS": "*i32", **dict.fromkeys(("N", "K", "G", "per_split", "splits"), "i32"), "eps": "fp32"}


# (prologue, glu) as the fused step runs them: o and down (a residual), q|k|v (RMSNorm and a bias),
# gate|up (RMSNorm, a bias, SiLU(gate)·up)
EPILOGUES = ((0, False), (1, False), (1, True))


@pytest.mark.parametrize("bits,dtype,wide,idot", [(4, "bf16", False, False), (8, "bf16", True, False),
                                                  (8, "fp16", False, False), (4, "fp32", False, False),
                                                  (4, "bf16", False, True), (8, "fp16", False, True)])
def test_packed_gemv_compiles_for_every_prologue_and_split(bits, dtype, wide, idot):
    types = packed_gemv_types(dtype)
    # groups of 128 (4 a step) and one group a row, for every prologue and epilogue (the residual,
    # or SiLU(gate)·up); whole tiles and cut ones; a step within a group of 1024, and groups of 96
    # (a scale a word), with the RMSNorm prologue
    cases = [(prologue, glu, split_k, gs, has_z, even) for prologue, glu in EPILOGUES for split_k, gs, has_z, even in
             ((False, 128, False, True), (True, 2048, True, False))]
    cases += [(1, False, True, 1024, True, False), (1, False, False, 96, True, False)]
    for prologue, glu, split_k, gs, has_z, even in cases:
        sizes = compiled(triton_decode._packed_gemv_kernel, types, dict(
            PROLOGUE=prologue, HAS_BIAS=prologue == 1, HAS_RES=prologue == 0, BN=16, BK=512, BITS=bits, GS=gs,
            HAS_Z=has_z, SPLIT_K=split_k, EXACT=dtype != "fp32", EVEN=even, ONE_GROUP=gs == 2048,
            POW2_GROUPS=gs in (128, 1024), XB=2048 if prologue == 1 else 16, GLU=glu, ASM=True, WIDE=wide,
            IDOT=idot))
        assert all(sizes.values())


@pytest.mark.parametrize("bits", [4, 8])
def test_an_integer_dot_word_takes_its_dp2a_and_fewer_instructions(bits):
    """An integer-dot tile's K step multiplies a 4-bit word by four ``dp2a`` (``IDP.2A``) and an 8-bit one by two,
    with no float multiply-add a code; for 4-bit codes the step is at least a fifth shorter than the float
    tile's (sm_90, the ``down`` tile 16x1024 of 4 warps: 16 words a thread a step)."""
    types = packed_gemv_types("bf16")
    steps = {}
    for idot in (False, True):
        given = dict(PROLOGUE=0, HAS_BIAS=False, HAS_RES=True, BN=16, BK=1024 if bits == 4 else 512, BITS=bits,
                     GS=128, HAS_Z=False, SPLIT_K=False, EXACT=True, EVEN=True, ONE_GROUP=False, POW2_GROUPS=True,
                     XB=16, GLU=False, ASM=True, WIDE=bits == 8 and not idot, IDOT=idot)
        steps[idot] = k_step(cubin(triton_decode._packed_gemv_kernel, types, given, TARGETS["sm_90 (Hopper)"]))
    words = 16  # a thread's words a step
    assert steps[True]["IDP"] == words * (4 if bits == 4 else 2), steps[True]
    assert steps[False]["IDP"] == 0 and steps[True]["FFMA"] < steps[False]["FFMA"] // 2, steps
    if bits == 4:
        assert sum(steps[True].values()) < 0.8 * sum(steps[False].values()), steps


@pytest.mark.parametrize("idot", [False, True])
@pytest.mark.parametrize("prologue", [0, 1])
def test_a_row_cut_short_checks_x_once_a_word(idot, prologue):
    """A row that is not a whole number of K steps (Qwen2-VL-2B's ``down``: 8,960 columns in steps of 1,024) is
    compiled with bounds checks; a word's columns of x are all inside the row or none, so x's loads share one
    compare a word: the K step holds 4 compares (sm_90, the ``down`` tile 16x1024 of 4 warps, split; with and
    without the RMSNorm), where a compare a column made it 11."""
    types = packed_gemv_types("bf16")
    given = dict(PROLOGUE=prologue, HAS_BIAS=False, HAS_RES=prologue == 0, BN=16, BK=1024, BITS=4, GS=128,
                 HAS_Z=False, SPLIT_K=True, EXACT=True, EVEN=False, ONE_GROUP=False, POW2_GROUPS=True,
                 XB=2048 if prologue else 16, GLU=False, ASM=True, WIDE=False, IDOT=idot)
    step = k_step(cubin(triton_decode._packed_gemv_kernel, types, given, TARGETS["sm_90 (Hopper)"]))
    assert step["ISETP"] <= 4, step


def test_8_bit_codes_with_bf16_activations_take_one_byte_permute_each():
    """With bf16 activations an 8-bit code is one ``prmt`` (``WIDE``) rather than a shift and an
    and-or: in the sm_90 binary of the 8-bit ``down`` tile the K step holds a permute per code, next
    to no and-or, and fewer instructions than the same tile without it. The exponent's bits are kept
    in one register (a constant would be moved into one before each permute: no fewer instructions)."""
    types = packed_gemv_types("bf16")
    steps = {}
    for wide in (False, True):  # the H200's 8-bit down tile: 8 rows by 2048 columns, 4 warps
        given = dict(PROLOGUE=0, HAS_BIAS=False, HAS_RES=True, BN=8, BK=2048, BITS=8, GS=128, HAS_Z=False,
                     SPLIT_K=False, EXACT=True, EVEN=True, ONE_GROUP=False, POW2_GROUPS=True, XB=16, GLU=False,
                     ASM=True, WIDE=wide)
        steps[wide] = k_step(cubin(triton_decode._packed_gemv_kernel, types, given, TARGETS["sm_90 (Hopper)"]))
    codes = 8 * 2048 // 4 // 128 * 4  # a thread's words a step, four codes each
    assert steps[True]["PRMT"] >= codes and steps[True]["LOP3"] <= 2 and steps[False]["LOP3"] >= codes
    assert sum(steps[True].values()) < 0.9 * sum(steps[False].values()), steps


def cubin(fn, types: dict[str, str], constexprs: dict, target: GPUTarget, warps: int = 4) -> bytes:
    """``fn``'s binary for ``target`` as a launch specializes it (pointers and ints multiples of 16)."""
    names = fn.arg_names
    source = ASTSource(fn, {n: types.get(n, "constexpr") for n in names},
                       {(names.index(k),): v for k, v in {**constexprs, "PDL": target.arch >= 90}.items()},
                       {(names.index(a),): [["tt.divisibility", 16]] for a in types if types[a] != "fp32"})
    return triton.compile(source, target=target, options={"num_warps": warps, "launch_pdl": target.arch >= 90}
                          ).asm["cubin"]


def k_step(binary: bytes) -> collections.Counter:
    """Instructions by opcode in the longest loop of ``binary``: the K step."""
    return opcodes(max(loops(disassembled(binary)), key=len))


@pytest.mark.parametrize("bits,dtype", [(4, "bf16"), (8, "bf16"), (4, "fp32")])
def test_packed_mm_compiles_whole_and_split(bits, dtype):
    types = {**pointers(dtype, "X", "S", "Z", "Y"), "Q": "*i32", "PARTS": "*fp32", "ARRIVALS": "*i32",
             **dict.fromkeys(("M", "N", "K", "G", "stride_x", "stride_y", "splits"), "i32")}
    # K tiles in one group of 128 (the scale after the dot) and across groups of 32; either operand order
    for split_k, has_z, (bk, gs), w_a in itertools.product((False, True), (False, True), ((128, 128), (128, 32)),
                                                          (False, True)):
        sizes = compiled(kernels._packed_mm_kernel, types, dict(
            BM=16, BN=64, BK=bk, SPLIT_K=split_k, BITS=bits, GS=gs, HAS_Z=has_z, IEEE=dtype == "fp32", W_A=w_a,
            ASM=True))
        assert all(sizes.values())


@pytest.mark.parametrize("bits", [4, 8])
def test_dequantize_compiles(bits):
    types = {**pointers("bf16", "S", "Z", "W"), "Q": "*i32", **dict.fromkeys(("N", "K", "G"), "i32")}
    for has_z in (False, True):
        assert all(compiled(kernels._dequantize_kernel, types, dict(
            BN=32, BK=kernels._tile_k(PackedGeometry(64, 1536, bits, 12, 128), 128), BITS=bits, GS=128,
            HAS_Z=has_z, ASM=True)).values())


# The fused batch-1 decode step's dense kernels, at the shapes of a Qwen2-VL-2B layer (12 query
# heads over 2 KV heads of 128) and as Qwen3 runs them (per-head norms).


def test_dense_gemv_compiles_for_every_prologue():
    types = {**pointers("bf16", "X", "W", "BIAS", "RES", "NORM_W", "Y"),
             **dict.fromkeys(("N", "K", "stride_x", "stride_r", "stride_y"), "i32"), "eps": "fp32"}
    for prologue, glu in EPILOGUES:
        assert all(compiled(triton_decode._gemv_kernel, types, dict(
            MP=1, PROLOGUE=prologue, HAS_BIAS=prologue == 1, HAS_RES=prologue == 0, BN=8, BK=512, USE_DOT=False,
            IEEE=False, XB=2048 if prologue == 1 else 16, GLU=glu), stages=2).values())


ATTENTION_TYPES = {**pointers("bf16", "QKV", "COS", "SIN", "KP", "VP", "KOUT", "VOUT", "QW", "KW", "OUT"),
                   **pointers("i64", "TABLES", "CTX", "VALID"), **pointers("fp32", "OPART", "MPART", "LPART"),
                   "ARRIVALS": "*i32", "scale": "fp32", "eps": "fp32",
                   **dict.fromkeys(("stride_qkv", "stride_cs", "stride_tab", "stride_kb", "stride_ks", "stride_out"),
                                   "i32")}
# A Qwen2-VL-2B layer's attention (12 heads over 2 KV heads of 128) as the step launches it
QWEN2_VL_ATTENTION = dict(KVH=2, G=6, GP=16, HD=128, HDP=128, BS=16, GM=8, MC=16, IEEE=False)


def test_paged_attention_compiles_split_and_whole():
    """Split (the last split merges: atomics, a loop over the partials in chunks) and unsplit."""
    tiling = decode_attention.TILING
    for write_pool, qk_norm, splits in ((False, False, 32), (True, True, 1)):
        assert all(compiled(decode_attention._attention_kernel, ATTENTION_TYPES, dict(
            QWEN2_VL_ATTENTION, CHUNK=tiling.chunk, TILE=tiling.tile, SPLITS=splits, WRITE_POOL=write_pool,
            QK_NORM=qk_norm), warps=tiling.warps, stages=2).values())


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_tensor_core_product_compiles_with_the_weight_in_the_mma_registers(dtype):
    """The 4-bit tensor-core product (Gluon) compiles for Hopper and Orin, whole and split, with and
    without zero points, for 8 and 16 rows; each compile asserts that the words' layout, taken
    apart in place, is the MMA's A operand, and no tile goes through shared memory. With x in shared
    memory (``X_SHARED``) the kernel takes exactly x's buffer (:func:`kernels.x_shared_bytes`) and
    fewer registers a thread than the kernel that holds x's steps in registers."""
    from edgeinfer.quant import tensor_core

    if tensor_core.gluon is None:
        pytest.skip("this Triton has no Gluon (triton.experimental.gluon)")
    registers = {}
    for (bn, bk, warps, ahead), split_k, has_z, bm, x_shared in itertools.product(
            ((64, 64, 4, 1), (128, 128, 4, 2), (256, 64, 8, 3)), (False, True), (False, True), (8, 16), (False, True)):
        k = 1536  # Qwen2-VL-2B's q|k|v, o and gate|up: 24 steps of 64 columns, 12 of 128
        per_split = k // 2 if split_k else k
        x_bytes = kernels.x_shared_bytes(k, bk, 2 if split_k else 1, bm) if x_shared else 0
        given = dict(BN=bn, BM=bm, BK=bk, GS=128, HAS_Z=has_z, SPLIT_K=split_k, WARPS=warps,
                     LW=tensor_core.word_layout(bn, bk, warps), BF16=dtype == "bf16",
                     MAGIC=128.0 if dtype == "bf16" else 1024.0, AHEAD=ahead, X_SHARED=x_shared,
                     X_STEPS=launching.pow2(per_split // bk) if x_shared else 1)
        for label, target in TARGETS.items():
            kernel = compiled_gluon(tensor_core._mma_mm_kernel, dtype, given, target, warps)
            # whole: no shared memory but x's; split: the arrival count handed to every thread, nothing else
            assert kernel.asm["cubin"] and x_bytes <= kernel.metadata.shared <= x_bytes + (16 if split_k else 0)
            registers[label, bn, bk, ahead, split_k, has_z, bm, x_shared] = resources(kernel.asm["cubin"])["REG"]
            # x's copies are cp.async (LDGSTS), all in flight at once, not a load and a store a step
            assert ("cp.async" in kernel.asm["ptx"]) == x_shared
    for (label, bn, bk, ahead, *rest, bm, x_shared), used in registers.items():
        held = registers[label, bn, bk, ahead, *rest, bm, False]
        if x_shared and bm == 16:  # x's steps held ahead are most of a thread's registers at 16 rows
            assert used < held if ahead >= 2 else used <= held, (label, bn, bk, ahead, *rest, used, held)


def test_a_lanes_words_side_by_side_load_sixteen_bytes_at_once():
    """With ``WIDE`` a lane's words of a K step of 128 columns are four side by side, read by one
    16-byte load (``LDG.E.128``) where the kernel otherwise reads one word a load (``LDG.E``): the
    operand's columns are permuted by renaming registers, so no value moves between threads or
    through shared memory. x's loads, or with ``X_SHARED`` its copies into shared memory, stay 16
    bytes each, as many as before. For Hopper and Orin, whole and split, 8 and 16 rows."""
    from edgeinfer.quant import tensor_core

    if tensor_core.gluon is None:
        pytest.skip("this Triton has no Gluon (triton.experimental.gluon)")
    for split_k, bm, x_shared, (label, target) in itertools.product((False, True), (8, 16), (False, True),
                                                                    TARGETS.items()):
        loads, moves = {}, {}
        x_bytes = kernels.x_shared_bytes(1536, 128, 2 if split_k else 1, bm) if x_shared else 0
        for wide in (False, True):
            given = dict(BN=128, BM=bm, BK=128, GS=128, HAS_Z=False, SPLIT_K=split_k, WARPS=4,
                         LW=tensor_core.word_layout(128, 128, 4, wide), BF16=True, MAGIC=128.0, AHEAD=2,
                         X_SHARED=x_shared, X_STEPS=launching.pow2((768 if split_k else 1536) // 128) if x_shared else 1,
                         WIDE=wide)
            kernel = compiled_gluon(tensor_core._mma_mm_kernel, "bf16", given, target, 4)
            assert x_bytes <= kernel.metadata.shared <= x_bytes + (16 if split_k else 0), (label, wide)
            body = instructions(disassembled(kernel.asm["cubin"]))
            loads[wide] = {op: n for op, n in opcodes(body, modifiers=True).items() if op.startswith("LDG")}  # LDGSTS too
            moves[wide] = {op: n for op, n in opcodes(body).items() if op in ("SHFL", "STS", "LDS")}
        case = (label, split_k, bm, x_shared, loads, moves)
        # three steps (two ahead) of a thread's four rows: 48 one-word loads, or 12 of four words
        assert loads[False]["LDG.E"] == 48 and "LDG.E" not in loads[True], case
        assert loads[True]["LDG.E.128"] == loads[False].get("LDG.E.128", 0) + 12, case
        copies = {w: {op: n for op, n in loads[w].items() if op.startswith("LDGSTS")} for w in loads}
        assert copies[True] == copies[False] and all(op.endswith(".128") for op in copies[True]), case
        assert bool(copies[True]) == x_shared, case
        assert moves[True] == moves[False], case  # the permutation moves no value between threads


def test_the_staged_tensor_core_product_asks_for_every_step_s_words_first():
    """The tensor-core kernel's ``STAGED`` tiles (as ``kernels.staged_mma_candidates`` gives them for
    gate|up and down at 8 and 16 rows, whole and split, with and without zero points) copy every step's
    words into shared memory in 16-byte copies, all before the first wait, then wait once a step; they
    take the shared memory ``kernels.staged_bytes`` counts. For Hopper and Orin."""
    from edgeinfer.quant import tensor_core

    if tensor_core.gluon is None:
        pytest.skip("this Triton has no Gluon (triton.experimental.gluon)")
    for (n, k), rows, has_z, (label, target) in itertools.product(((17920, 1536), (1536, 8960)), (8, 16),
                                                                  (False, True), TARGETS.items()):
        layout = PackedGeometry(n, k, 4, k // 128, 128)
        tiles = kernels.staged_mma_candidates(layout, rows)
        assert tiles, (n, k, rows)
        for c in tiles[::2]:  # 64 and 128 outputs, each at its fewest splits
            steps = k // c.bk // c.split
            given = dict(BN=c.bn, BM=rows, BK=c.bk, GS=128, HAS_Z=has_z, SPLIT_K=c.split > 1, WARPS=4,
                         LW=tensor_core.word_layout(c.bn, c.bk, 4, True), BF16=True, MAGIC=128.0, AHEAD=1,
                         X_SHARED=True, X_STEPS=launching.pow2(steps), WIDE=True, STAGED=True, STEPS=steps)
            kernel = compiled_gluon(tensor_core._mma_mm_kernel, "bf16", given, target, 4)
            body = instructions(disassembled(kernel.asm["cubin"]))
            copies = [i for i, op in enumerate(body) if "LDGSTS" in op]
            waits = [i for i, op in enumerate(body) if "DEPBAR.LE" in op]
            case = (label, n, k, rows, has_z, c)
            assert copies and all(".128 " in body[i] for i in copies), case  # (predicated or not)
            assert max(copies) < min(waits) and len(waits) == steps, case
            assert kernel.metadata.shared == kernels.staged_bytes(k, c.bn, c.bk, c.split, rows), case


def compiled_gluon(fn, dtype: str, constexprs: dict, target: GPUTarget, warps: int):
    """``fn`` (Gluon) compiled for ``target`` as its wrapper launches it: pointers, N, K, strides and
    ``per_split`` specialized as multiples of 16, as Triton specializes them at a launch."""
    from triton.experimental.gluon._runtime import GluonASTSource

    names = fn.arg_names
    types = {**pointers(dtype, "X", "S", "Z", "Y"), "Q": "*i32", "PARTS": "*fp32", "ARRIVALS": "*i32",
             **dict.fromkeys(("M", "N", "K", "G", "stride_x", "stride_y", "per_split", "splits"), "i32")}
    aligned = ("X", "Q", "S", "Z", "Y", "PARTS", "ARRIVALS", "N", "K", "stride_x", "stride_y", "per_split")
    source = GluonASTSource(fn, {n: types.get(n, "constexpr") for n in names},
                            {(names.index(k),): v for k, v in constexprs.items()},
                            {(names.index(a),): [["tt.divisibility", 16]] for a in aligned})
    return triton.compile(source, target=target, options={"num_warps": warps})


def test_tiles_compiled_ahead_are_the_ones_their_launches_look_up(monkeypatch):
    """``compile_ahead`` compiles a tuner's candidate tiles on threads, through the wrappers' own
    arguments (``warmup=True``), and leaves each where its launch looks it up: the same calls made
    again compile nothing. Batch-1 products (packed and dense) and few-row packed products (the
    dot kernel, and the tensor-core kernel where this Triton has Gluon), and the staged batch-1
    product (Gluon too), compiled for Orin."""
    from edgeinfer.quant import staged, tensor_core
    from edgeinfer.quant.packed import PackedMatrix
    from edgeinfer.testing.triton_compile import binaries, compile_only

    n, k = 256, 1536
    packed = PackedMatrix(torch.randint(-2**31, 2**31 - 1, (n, k // 8), dtype=torch.int32),
                          torch.rand(n, k // 128, dtype=torch.bfloat16), None, 4, 128, (n, k))
    dense = torch.randn(n, k, dtype=torch.bfloat16)
    one, rows = torch.randn(1, k, dtype=torch.bfloat16), torch.randn(4, k, dtype=torch.bfloat16)
    layout = packed.layout
    calls = [lambda c=c: triton_decode.packed_gemv(one, packed, c, norm_weight=one[0], eps=1e-6, warmup=True)
             for c in triton_decode.PACKED_GEMV_CANDIDATES[:3]]
    calls += [lambda c=c: triton_decode.gemv(one, dense, residual=one[:, :n], config=c, warmup=True)
              for c in triton_decode.GEMV_CANDIDATES[:2]]
    # a tensor-core tile with x in registers (8 rows) and one with x in shared memory (16 rows)
    tensor_cores = [kernels.mma_candidates(layout, 8)[0], kernels.mma_candidates(layout, 16)[0]]
    mm = kernels.mm_candidates(layout)[:2] + (tensor_cores if tensor_core.gluon else [])
    calls += [lambda c=c: kernels.packed_mm(rows, packed.codes, packed.scales, None, layout, c, warmup=True)
              for c in mm]
    if staged.gluon:  # whole with RMSNorm and SiLU·up, and split with the residual
        calls += [lambda: staged.staged_gemv(one, packed, staged.StagedGemvConfig(1), norm_weight=one[0], eps=1e-6,
                                             glu=True, warmup=True),
                  lambda: staged.staged_gemv(one, packed, staged.StagedGemvConfig(2, 3), residual=one[:, :n],
                                             warmup=True)]
    jitted = [triton_decode._packed_gemv_kernel, triton_decode._gemv_kernel, kernels._packed_mm_kernel]
    jitted += [tensor_core._mma_mm_kernel] if tensor_core.gluon else []
    jitted += [staged._staged_gemv_kernel] if staged.gluon else []
    with compile_only(TARGETS["sm_87 (Orin)"], jitted):
        report = kernels.compile_ahead(calls, workers=2)
        ahead = binaries(jitted)
        for call in calls:  # each finds its kernel compiled; nothing is launched
            call()
        assert binaries(jitted) == ahead, "a launch after compile_ahead compiled its kernel again"
        if tensor_core.gluon:  # the tile with x in shared memory compiled as such, the other without
            shared = sorted(b.metadata.shared for b in tensor_core._mma_mm_kernel.device_caches[0][0].values())
            x_tile = mm[-1]
            assert shared[0] == 0 and shared[-1] >= kernels.x_shared_bytes(k, x_tile.bk, x_tile.split, 8)
    assert ahead == len(calls) and report.compiles == len(calls) and report.workers == 2
    monkeypatch.setenv(kernels.COMPILE_AHEAD_ENV, "0")  # each compiles at its first launch, as before
    assert kernels.compile_ahead(calls) is None


def test_a_gpu_this_triton_cannot_build_for_is_named_quietly(capsys):
    """``cannot_build`` gives ptxas's verdict in a line for a GPU this Triton's ``ptxas`` does not
    know (an sm_999 here) and None for one it does; Triton's PTX dump stays off stdout."""
    from edgeinfer.testing.triton_compile import compile_only

    with compile_only(GPUTarget("cuda", 999, 32), [kernels._copy_one]):
        verdict = kernels._cannot_build_for((99, 9))
    with compile_only(TARGETS["sm_87 (Orin)"], [kernels._copy_one]):
        assert kernels._cannot_build_for((8, 7)) is None
    assert verdict and "sm_999" in verdict and "\n" not in verdict
    assert capsys.readouterr().out == ""


def test_the_decode_kernels_build_for_jetson_thor():
    """Jetson Thor is sm_110 from CUDA 13 on: the batch-1 products (packed, with float and integer-dot
    tiles, and dense), the batched packed product and the attention build for it, where this Triton's
    ``ptxas`` knows it."""
    from edgeinfer.testing.triton_compile import compile_only

    thor = {"sm_110 (Thor)": GPUTarget("cuda", 110, 32)}
    with compile_only(thor["sm_110 (Thor)"], [kernels._copy_one]):
        verdict = kernels._cannot_build_for((11, 0))
    if verdict:
        pytest.skip(f"Triton {triton.__version__} cannot build for sm_110: {verdict}")
    packed = packed_gemv_types("bf16")
    for (prologue, glu), idot in itertools.product(EPILOGUES, (False, True)):
        assert all(compiled(triton_decode._packed_gemv_kernel, packed, dict(
            PROLOGUE=prologue, HAS_BIAS=prologue == 1, HAS_RES=prologue == 0, BN=16, BK=512, BITS=4, GS=128,
            HAS_Z=False, SPLIT_K=True, EXACT=True, EVEN=True, ONE_GROUP=False, POW2_GROUPS=True,
            XB=2048 if prologue == 1 else 16, GLU=glu, ASM=True, WIDE=False, IDOT=idot), targets=thor).values())
    dense = {**pointers("bf16", "X", "W", "BIAS", "RES", "NORM_W", "Y"),
             **dict.fromkeys(("N", "K", "stride_x", "stride_r", "stride_y"), "i32"), "eps": "fp32"}
    assert all(compiled(triton_decode._gemv_kernel, dense, dict(
        MP=1, PROLOGUE=1, HAS_BIAS=True, HAS_RES=False, BN=8, BK=512, USE_DOT=False, IEEE=False, XB=2048,
        GLU=True), stages=2, targets=thor).values())
    mm = {**pointers("bf16", "X", "S", "Z", "Y"), "Q": "*i32", "PARTS": "*fp32", "ARRIVALS": "*i32",
          **dict.fromkeys(("M", "N", "K", "G", "stride_x", "stride_y", "splits"), "i32")}
    for w_a in (False, True):
        assert all(compiled(kernels._packed_mm_kernel, mm, dict(
            BM=16, BN=64, BK=128, SPLIT_K=True, BITS=4, GS=128, HAS_Z=True, IEEE=False, W_A=w_a, ASM=True),
            targets=thor).values())
    assert all(compiled(decode_attention._attention_kernel, ATTENTION_TYPES, dict(
        QWEN2_VL_ATTENTION, CHUNK=decode_attention.TILING.chunk, TILE=decode_attention.TILING.tile, SPLITS=32,
        WRITE_POOL=True, QK_NORM=False), stages=2, targets=thor).values())
    from edgeinfer.quant import tensor_core

    if tensor_core.gluon is not None:  # the 4-bit tensor-core product (Gluon's mma_v2: mma.sync, which Thor has)
        for x_shared in (False, True):
            given = dict(BN=128, BM=16, BK=128, GS=128, HAS_Z=True, SPLIT_K=True, WARPS=4,
                         LW=tensor_core.word_layout(128, 128, 4), BF16=True, MAGIC=128.0, AHEAD=2,
                         X_SHARED=x_shared, X_STEPS=8)
            kernel = compiled_gluon(tensor_core._mma_mm_kernel, "bf16", given, thor["sm_110 (Thor)"], 4)
            assert kernel.asm["cubin"]


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_the_step_s_ends_compile_for_every_branch(dtype):
    """The step's inputs (lookup and RoPE, or RoPE alone; scaled embeddings or not), the final norm at
    several rows, and its greedy choice (ids alone, or plain and M-RoPE positions moved on), as their
    wrappers launch them."""
    from edgeinfer.backends.torch import step_ends

    inputs = {**pointers(dtype, "EMBED", "X", "COS", "SIN"), "TOKENS": "*i64", "POS": "*i64", "INV_FREQ": "*fp32",
              "AXIS": "*i32", **dict.fromkeys(("stride_axis", "stride_pos", "stride_embed", "stride_column", "stride_x",
                                               "stride_cs", "H"), "i32"), "scaling": "fp32", "embed_scale": "fp32"}
    for embed_rows, scaled in ((True, False), (True, True), (False, False)):
        assert all(compiled(step_ends._inputs_kernel, inputs, dict(
            HALF=64, HALF_P=64, BH=step_ends.EMBED_BLOCK, EMBED_ROWS=embed_rows, SCALED=scaled)).values())
    norm = {**pointers(dtype, "X", "W", "Y"), **dict.fromkeys(("stride_x", "stride_y", "H"), "i32"), "eps": "fp32"}
    for bh, warps in ((2048, 4), (8192, 8)):  # Qwen2-VL-2B's 1,536 columns, and up to 8,192
        assert all(compiled(step_ends._norm_kernel, norm, dict(BH=bh), warps=warps).values())
    choose = {"LOGITS": f"*{dtype}", "PARTS": "*fp32", "ARRIVALS": "*i32", "IDS": "*i64", "POS": "*i64",
              "CTX": "*i64", "VALID": "*i64", **dict.fromkeys(("V", "stride_l", "stride_axis", "stride_pos"), "i32")}
    for advance, axes in ((False, 1), (True, 1), (True, 3)):
        assert all(compiled(step_ends._choose_kernel, choose, dict(
            AXES=axes, BV=step_ends.ARGMAX_BLOCK, P=128, ADVANCE=advance)).values())


def test_a_compile_that_fails_as_it_finishes_leaves_the_launches_to_compile(monkeypatch):
    """A compile hook that raises as a compile finishes does not fail the tuner: compile_ahead
    returns, and leaves Triton's launches compiling as usual (no asynchronous mode left on)."""
    from edgeinfer.testing.triton_compile import compile_only

    def failing(**_):
        raise RuntimeError("a hook that fails")

    monkeypatch.setattr(triton.knobs.runtime, "jit_post_compile_hook", failing)
    with compile_only(TARGETS["sm_87 (Orin)"], [kernels._copy_one]):
        report = kernels.compile_ahead([lambda: kernels._copy_one.warmup(torch.empty(1), torch.empty(1), grid=(1,))],
                                       workers=1)
    assert report.compiles == 1 and kernels._async_compile_mode.get() is None


def staged_binary(given: dict, target: GPUTarget, warps: int):
    """The staged kernel (``staged._staged_gemv_kernel``) compiled for ``target`` with the constexprs
    ``given`` (``PDL`` from the target), bf16, as a launch specializes its pointers and sizes."""
    from triton.experimental.gluon._runtime import GluonASTSource

    from edgeinfer.quant import staged

    fn = staged._staged_gemv_kernel
    names = fn.arg_names
    types = {**pointers("bf16", "X", "S", "Z", "BIAS", "RES", "NORM_W", "Y"), "W": "*i32", "PARTS": "*fp32",
             "ARRIVALS": "*i32", **dict.fromkeys(("N", "K", "KW", "G", "M"), "i32"), "eps": "fp32"}
    aligned = ("X", "W", "S", "Z", "BIAS", "RES", "NORM_W", "Y", "PARTS", "ARRIVALS", "N", "K", "KW")
    given = {**given, "PDL": target.arch >= 90}
    source = GluonASTSource(fn, {a: types.get(a, "constexpr") for a in names},
                            {(names.index(a),): v for a, v in given.items()},
                            {(names.index(a),): [["tt.divisibility", 16]] for a in aligned})
    return triton.compile(source, target=target, options={"num_warps": warps, "launch_pdl": target.arch >= 90})


@pytest.mark.parametrize("product", ["gate_up", "down", "qkv"])
def test_the_staged_product_asks_for_every_word_before_its_first_wait(product):
    """The staged batch-1 product (Gluon, ``edgeinfer.quant.staged``) compiles for Hopper and Orin
    with the prologue and epilogues the step fuses, whole and split, with and without zero points.
    Each thread's words go to shared memory in 16-byte copies (``LDGSTS.128``, two a chunk: rows g and
    g + 8), all of them issued before the first wait, and on Hopper before the wait for the kernels
    before it; then one wait a chunk, so chunk i waits for the copies up to its own only. With
    ``early`` copies, only the first chunks' go out before that wait, and the rest after x's loads (4 bytes
    a load or more, where a scale takes 2).
    x's chunks, all asked for at once, reach shared memory with no barrier between them. The program
    takes the shared memory :func:`staged.shared_bytes` counts. (Some one-warp tiles
    spill up to about a hundred bytes a thread: docs/results/probes/sass-staged-gemv.txt.)"""
    from edgeinfer.quant import staged

    if staged.gluon is None:
        pytest.skip("this Triton has no Gluon (triton.experimental.gluon)")

    n, k, fused = {"gate_up": (17920, 1536, dict(PROLOGUE=True, GLU=True, HAS_BIAS=False, HAS_RES=False)),
                   "down": (1536, 8960, dict(PROLOGUE=False, GLU=False, HAS_BIAS=False, HAS_RES=True)),
                   "qkv": (2048, 1536, dict(PROLOGUE=True, GLU=False, HAS_BIAS=True, HAS_RES=False))}[product]
    tiles = [(c.warps, c.split) for c in (staged.StagedGemvConfig(nw, s) for nw in (1, 4) for s in range(1, 11))
             if (k // staged.CHUNK) % c.split == 0 and k // staged.CHUNK // c.split <= staged.MAX_CHUNKS
             and staged.shared_bytes(k, c.warps, c.split) <= staged.MAX_SHARED][:4]
    assert tiles and any(split > 1 for _, split in tiles), tiles
    for (label, target), (warps, split), (zeros, half) in itertools.product(
            TARGETS.items(), tiles, ((False, False), (True, False), (False, True))):
        chunks = k // staged.CHUNK // split
        early = max(1, chunks // 2) if half else chunks
        given = dict(GPS=chunks, NW=warps, SPLIT=split, EARLY=early, GS=128,
                     XB=min(launching.pow2(k), 2048), HAS_Z=zeros, BF16=True, M=1, MP=1, **fused)  # a launch takes 1 as a constant
        kernel = staged_binary(given, target, warps)
        case = (label, product, warps, split, zeros, early)
        body = instructions(disassembled(kernel.asm["cubin"]))
        copies = [i for i, op in enumerate(body) if "LDGSTS" in op]
        waits = [i for i, op in enumerate(body) if "DEPBAR.LE" in op]
        assert len(copies) == 2 * chunks and all(body[i].split()[0].endswith(".128") for i in copies), case
        assert max(copies) < min(waits) and len(waits) == chunks, case
        ptx = kernel.asm["ptx"]
        if target.arch >= 90:  # the (early) copies go out while the kernels before this one finish
            before = ptx[:ptx.index("griddepcontrol.wait")].count("cp.async.cg.shared.global")
            assert before == 2 * early, (case, before)
        if early < chunks:  # the rest after x's loads
            x_loads = [i for i, op in enumerate(body) if op.startswith("LDG.E") and ".U16" not in op]  # not the scales
            assert x_loads and min(x_loads) < copies[2 * early], case
        # x's chunks go to shared memory without a barrier between them: before the first wait only the
        # RMSNorm's sum across warps meets any (three), none without a norm or with one warp
        bars = sum(op.startswith("BAR.SYNC") for op in body[:min(waits)])
        assert bars == (3 if fused["PROLOGUE"] and warps > 1 else 0), (case, bars)
        assert kernel.metadata.shared == staged.shared_bytes(k, warps, split), case


@pytest.mark.parametrize("product", ["gate_up", "down", "qkv"])
def test_the_staged_product_of_several_rows_takes_each_chunk_s_words_apart_once(product):
    """``staged.staged_mm`` (the staged kernel with M rows of x, up to ``MP``) compiles for Hopper and Orin,
    whole and split, with and without zero points, plain and with what the few-row layers fuse
    (each row's RMSNorm, bias, SiLU·up, residual). Every copy of the words goes
    out before the first wait (on Hopper before the wait for the kernels before it too), one wait a
    chunk. Up to 8 rows a chunk takes one MMA of 8 columns for the codes and one for the bias (or
    -Σx with zero points; 16·warps rows by 128 columns: 8 ``HMMA`` each a warp); 16 rows take twice as many, on the same
    words, taken apart once. It stays within the shared memory :func:`staged.shared_bytes` counts
    (x does not go through shared memory here)."""
    from edgeinfer.quant import staged

    if staged.gluon is None:
        pytest.skip("this Triton has no Gluon (triton.experimental.gluon)")

    n, k = {"gate_up": (17920, 1536), "down": (1536, 8960), "qkv": (2048, 1536)}[product]
    chunks_whole = k // staged.CHUNK
    split = next(s for s in range(1, 11) if chunks_whole % s == 0 and chunks_whole // s <= staged.MAX_CHUNKS)
    fused = {"gate_up": dict(PROLOGUE=True, GLU=True, HAS_BIAS=False, HAS_RES=False),
             "down": dict(PROLOGUE=False, GLU=False, HAS_BIAS=False, HAS_RES=True),
             "qkv": dict(PROLOGUE=True, GLU=False, HAS_BIAS=True, HAS_RES=False)}[product]
    plain = dict.fromkeys(fused, False)
    for (label, target), warps, (zeros, fuses) in itertools.product(
            TARGETS.items(), (1, 2), ((False, plain), (True, plain), (False, fused))):
        chunks = chunks_whole // split
        mmas = {}
        for rows in (8, 16):  # any count of rows up to MP, an argument
            given = dict(GPS=chunks, NW=warps, SPLIT=split, EARLY=chunks, GS=128, XB=2048,
                         HAS_Z=zeros, BF16=True, MP=rows, KC=chunks_whole if fuses["PROLOGUE"] else 0, **fuses)
            kernel = staged_binary(given, target, warps)
            case = (label, product, warps, split, zeros, rows, fuses)
            body = instructions(disassembled(kernel.asm["cubin"]))
            copies = [i for i, op in enumerate(body) if "LDGSTS" in op]
            waits = [i for i, op in enumerate(body) if "DEPBAR.LE" in op]
            assert len(copies) == 2 * chunks and max(copies) < min(waits) and len(waits) == chunks, case
            ptx = kernel.asm["ptx"]
            if target.arch >= 90:
                assert ptx[:ptx.index("griddepcontrol.wait")].count("cp.async.cg.shared.global") == 2 * chunks, case
            mmas[rows] = sum("HMMA" in op for op in body)
            assert kernel.metadata.shared <= staged.shared_bytes(k, warps, split), case
        per_chunk = 8 * 2  # the codes, and the bias (or -Σx with zero points): 8 k-steps of 16 each
        assert mmas[8] == per_chunk * chunks and mmas[16] == 2 * mmas[8], (label, product, warps, zeros, mmas)
