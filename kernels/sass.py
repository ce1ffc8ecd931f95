"""Offline SASS analysis of the SBMM kernels: no GPU needed, only Triton's own compiler and binaries.

Each kernel variant is compiled for a ``GPUTarget("cuda", arch, 32)`` with ``triton.compile`` (Triton
ships ptxas), the cubin is disassembled with the ``cuobjdump`` Triton ships
(``triton/backends/nvidia/bin``), and the main K loop is found in the SASS: the backward branch whose
body (from the branch target to the branch) holds the most tensor-core instructions. The loop body's
instruction count divided by the weights one thread processes per iteration is the kernel's
*instructions per weight*; ``cuobjdump -res-usage`` gives the registers, Triton's metadata the
shared memory.

The bound this implies (:func:`hbm_bound`): an SM issues at most one instruction per cycle on each
of its 4 schedulers, i.e. ``4 * 32`` thread-instructions per cycle. A kernel that issues ``I``
instructions per weight cannot process weights faster than ``SMs * 128 * clock / I`` per second,
and a kernel that reads ``B`` bytes per weight not faster than ``HBM / B``. The *HBM floor* is the
time to read the compressed delta once (the canonical bytes per weight: codes, 2:4 positions,
scales, zero points); the bound is ``max(instruction time, own-bytes time) / floor time``. It ignores
latency, occupancy and the tensor-core pipe (at decode batch sizes the MMA work is small), so it is
a lower bound on the real ratio, and the only one available without a GPU.

Compile arguments mimic what the JIT would specialize at 7B shapes (``4096 x 4096``, group 128):
every pointer and every integer argument divisible by 16 gets ``tt.divisibility=16``.
"""

from __future__ import annotations

import collections
import glob
import os
import re
import subprocess
import tempfile
from dataclasses import asdict, dataclass

# GPUs of the bound model: SMs, sustained SM clock (Hz), HBM bandwidth (bytes/s), SASS arch.
GPUS = {
    "A100-SXM4-80GB": {"sms": 108, "clock_hz": 1.41e9, "hbm_Bps": 2.039e12, "arch": 80},
    "H100-SXM5": {"sms": 132, "clock_hz": 1.755e9, "hbm_Bps": 3.35e12, "arch": 90},
    "H200-SXM": {"sms": 132, "clock_hz": 1.755e9, "hbm_Bps": 4.8e12, "arch": 90},
}
ISSUE_PER_SM_CYCLE = 4 * 32  # 4 schedulers, one warp instruction (32 lanes) each per cycle
GOAL_INSTR_PER_WEIGHT = 3.0  # issue 14: fast kernel at 4 bits, sm_90

_SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")
_MMA_OPS = ("HMMA", "HGMMA", "IMMA", "HFMA2.MMA")


def triton_bin_dir() -> str | None:
    """Triton's bundled NVIDIA binaries (ptxas, cuobjdump), or None."""
    try:
        import triton
    except Exception:
        return None
    hits = glob.glob(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin"))
    return hits[0] if hits else None


def tools_available() -> str | None:
    """None when the offline compile can run, else the reason it cannot."""
    d = triton_bin_dir()
    if d is None:
        return "triton (with its NVIDIA backend) is not installed"
    for tool in ("ptxas", "cuobjdump"):
        if not os.access(os.path.join(d, tool), os.X_OK):
            return f"triton's bundled {tool} is missing from {d}"
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
    except Exception as exc:  # pragma: no cover - very old triton
        return f"triton.backends.compiler.GPUTarget unavailable: {exc}"
    return None


@dataclass(frozen=True)
class Variant:
    """One compiled configuration of an SBMM kernel.

    ``kernel``: ``"transposed"`` (``triton_sbmm.sbmm_kernel``, transposed layout) or ``"fast"``
    (``triton_fast`` kernel, mma layout; 2:4 deltas run the dense kernel there, so ``sparse`` only
    changes the bytes). ``dtype``: activations, ``"fp16"`` or ``"bf16"``. ``acc``: the fast kernel's
    epilogue adds onto the base output (``ACC``, what ``DeltaLinear`` launches); the main loop is the same.
    """

    kernel: str
    bits: int
    sparse: bool
    asym: bool
    dtype: str
    out_features: int = 4096
    in_features: int = 4096
    group: int = 128
    block_m: int = 16
    acc: bool = True


def variants(quick: bool = False) -> list[Variant]:
    """The grid of the bench: transposed and fast, bits 2/3/4/8, 2:4 or dense, sym/asym, fp16/bf16
    (the fast kernel has no 3-bit variant; ``quick``: 4 bits only)."""
    out = []
    for bits in ((4,) if quick else (2, 3, 4, 8)):
        for sparse in (True, False):
            for asym in (False, True):
                for dtype in ("fp16", "bf16"):
                    out.append(Variant("transposed", bits, sparse, asym, dtype))
                    if bits != 3:
                        out.append(Variant("fast", bits, sparse, asym, dtype))
    return out


def _div16(v: int) -> bool:
    return v % 16 == 0


def _build(v: Variant) -> tuple[object, dict, dict, list[str], dict]:
    """(jit function, signature, constexprs, names of args with divisibility 16, launch options)."""
    import triton  # noqa: F401

    dt = "*bf16" if v.dtype == "bf16" else "*fp16"
    out_f, in_f, group = v.out_features, v.in_features, v.group
    if v.kernel == "transposed":
        from deltazip.kernels import _triton_sbmm_kernels as mod
        from deltazip.kernels.packed import packed_words
        from deltazip.kernels.triton_sbmm import choose_block_k

        kept = in_f // 2 if v.sparse else in_f
        kw, kp = packed_words(kept, v.bits), packed_words(kept, 2)
        per = 32 // v.bits
        bk, tile_scale = choose_block_k(in_f, group, v.bits, v.sparse)
        ints = {"IN": in_f, "OUT": out_f, "GROUP": group, "KW": kw, "KP": kp, "stride_xm": in_f,
                "stride_ym": out_f, "qw_slot_stride": kw * out_f, "pos_slot_stride": kp * out_f,
                "sc_slot_stride": (in_f // group) * out_f}
        sig = {"x_ptr": dt, "y_ptr": dt, "perm_ptr": "*i32", "tile_slot_ptr": "*i32", "tile_start_ptr": "*i32",
               "tile_end_ptr": "*i32", "qw_ptr": "*i32", "pos_ptr": "*i32", "sc_ptr": "*fp16",
               "zr_ptr": "*u8" if v.asym else "*fp16", **{k: "i32" for k in ints}}
        const = {"BITS": v.bits, "PER": per, "POW2": per & (per - 1) == 0, "SPARSE": v.sparse, "ASYM": v.asym,
                 "TILE_SCALE": tile_scale, "SPLIT_K": 1, "IEEE": False, "BLOCK_M": v.block_m, "BLOCK_N": 64,
                 "BLOCK_K": bk}
        return mod.sbmm_kernel, sig, const, ints, {"num_warps": 4, "block_n": 64, "block_k": bk, "unroll": 1}
    from deltazip.kernels import _triton_fast_kernels as mod
    from deltazip.kernels import fast_layout

    bk = fast_layout.block_k_for(in_f, group, v.bits)
    steps = group // bk
    ints = {"IN": in_f, "OUT": out_f, "OUTP": fast_layout.padded_rows(out_f), "GROUP": group, "stride_xm": in_f,
            "stride_ym": out_f, "qw_slot_stride": fast_layout.slot_words(out_f, in_f, v.bits),
            "sc_slot_stride": (in_f // group) * fast_layout.padded_rows(out_f),
            "FIELD": ((1 << v.bits) - 1) * 0x10001}
    sig = {"x_ptr": dt, "y_ptr": dt, "perm_ptr": "*i32", "tile_slot_ptr": "*i32", "tile_start_ptr": "*i32",
           "tile_end_ptr": "*i32", "qw_ptr": "*i32", "sc_ptr": "*fp16", "zr_ptr": "*fp16",
           **{k: "i32" for k in ints}}
    const = {"BITS": v.bits, "ASYM": v.asym, "BF16": v.dtype == "bf16", "IEEE": False, "SPLIT_K": 1, "BLOCK_M": v.block_m,
             "BLOCK_K": bk, "G_SHIFT": steps.bit_length() - 1, "USE_ASM": True, "UNROLL": 2, "ACC": v.acc}
    return mod.sbmm_fast_kernel, sig, const, ints, {"num_warps": 4, "block_n": 64, "block_k": bk, "unroll": 2}


def compile_variant(v: Variant, arch: int) -> dict:
    """Compile ``v`` for ``sm_<arch>`` and analyze its SASS (see :func:`analyze`)."""
    import triton
    from triton.backends.compiler import GPUTarget

    fn, sig, const, ints, launch = _build(v)
    sig = dict(sig)
    for k in const:
        sig[k] = "constexpr"
    names = fn.arg_names
    attrs = {}
    for i, name in enumerate(names):
        if name in const:
            continue
        if sig[name].startswith("*") or (name in ints and _div16(ints[name])):
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs)
    ck = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": launch["num_warps"]})
    result = analyze(ck.asm["cubin"])
    result["shared_bytes"] = int(ck.metadata.shared)
    threads = 32 * launch["num_warps"]
    per_step = launch["block_n"] * launch["block_k"] // threads  # weights per thread per K step
    mma_step = _mma_per_step(v, arch, launch)
    steps = result["loop_mma"] / mma_step if mma_step else 0
    if steps < 1 or steps != int(steps):
        raise RuntimeError(f"{v} sm_{arch}: {result['loop_mma']} MMA instructions in the loop, expected a multiple "
                           f"of {mma_step} per K step")
    result["k_steps_per_iteration"] = int(steps)
    result["weights_per_thread_iteration"] = per_step * int(steps)
    result["instr_per_weight"] = round(result["loop_instructions"] / result["weights_per_thread_iteration"], 3)
    result["block"] = {"m": v.block_m, "n": launch["block_n"], "k": launch["block_k"], "warps": launch["num_warps"]}
    return result


def _mma_per_step(v: Variant, arch: int, launch: dict) -> int:
    """Tensor-core instructions per warp and K step. The fast kernel's tile is ``[64 x BLOCK_K]``
    (A) times ``[BLOCK_K x BLOCK_M]``: one wgmma m64nMk16 per 16 columns on sm_90, or per warp
    (16 rows) ``BLOCK_M / 8`` mma m16n8k16 per 16 columns on sm_80. The transposed tile is ``[BLOCK_M x
    BLOCK_K]`` times ``[BLOCK_K x 64]`` on mma.sync (M=16 is too small for wgmma), the 4 warps
    splitting the 64 columns."""
    k16 = launch["block_k"] // 16
    if v.kernel == "fast":
        return k16 if arch >= 90 else k16 * v.block_m // 8
    return k16 * (launch["block_n"] // launch["num_warps"]) // 8


def _disassemble(cubin: bytes, function: str | None) -> tuple[list[tuple[int, str, str]], str]:
    """``([(address, opcode with modifiers, operands)], resource usage text)`` of a cubin's function
    (predicates dropped from the opcode)."""
    bindir = triton_bin_dir()
    if bindir is None:
        raise RuntimeError(tools_available() or "triton's NVIDIA binaries not found")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        only = ["-fun", function] if function else []
        sass = subprocess.run([os.path.join(bindir, "cuobjdump"), "-sass", *only, path], capture_output=True,
                              text=True, check=True).stdout
        res = subprocess.run([os.path.join(bindir, "cuobjdump"), "-res-usage", path], capture_output=True, text=True,
                             check=True).stdout
    if function:  # the resource line of that function: "Function <name>:\n  REG:..."
        res = res[res.find(f"Function {function}:"):]
    return [(int(m.group(1), 16), m.group(2), m.group(3)) for m in map(_SASS_LINE.search, sass.splitlines()) if m], res


def opcodes(cubin: bytes, function: str | None = None) -> list[str]:
    """Every instruction's opcode (with modifiers, without predicate) in program order."""
    return [op for _, op, _ in _disassemble(cubin, function)[0]]


def analyze(cubin: bytes, function: str | None = None) -> dict:
    """Disassemble a cubin (or one ``function`` of it) and describe its main K loop.

    Returns a dict: ``loop_instructions`` (SASS instructions in the loop body), ``loop_mma``,
    ``loop_opcodes`` (histogram, opcode without modifiers), ``loop_full_opcodes`` (with modifiers:
    ``LDGSTS.E.BYPASS.128`` is a 16-byte copy), ``loop_smem_stores`` (``STS``: the round trip of a
    dequantized tile would show here), ``registers``, ``loops`` (bodies of every backward branch: bounds, instruction and MMA
    counts, ``full_opcodes``),
    ``all_opcodes`` (every instruction's opcode with modifiers), ``total_instructions``.
    """
    ins, res = _disassemble(cubin, function)
    regs = re.search(r"REG:(\d+)", res)
    loops = []
    for addr, op, args in ins:
        if op.startswith("BRA"):
            target = re.search(r"0x([0-9a-f]+)", args)
            if target and int(target.group(1), 16) < addr:
                lo = int(target.group(1), 16)
                body = [o for a, o, _ in ins if lo <= a <= addr]
                hist = collections.Counter(o.split(".")[0] for o in body)
                mma = sum(n for o, n in hist.items() if o in _MMA_OPS)
                loops.append({"start": lo, "end": addr, "instructions": len(body), "mma": mma, "opcodes": hist,
                              "full": collections.Counter(body)})
    if not loops:
        raise RuntimeError("no backward branch (loop) found in the SASS")
    main = max(loops, key=lambda lp: (lp["mma"], -lp["instructions"]))
    return {
        "loop_instructions": main["instructions"],
        "loop_mma": main["mma"],
        "loop_smem_stores": main["opcodes"].get("STS", 0),
        "loop_opcodes": dict(main["opcodes"].most_common()),
        "loop_full_opcodes": dict(main["full"].most_common()),
        "all_opcodes": sorted({o for _, o, _ in ins}),
        "registers": int(regs.group(1)) if regs else None,
        "loops": [{**{k: lp[k] for k in ("start", "end", "instructions", "mma")}, "full_opcodes": dict(lp["full"])}
                  for lp in loops],
        "total_instructions": len(ins),
    }


def bytes_per_weight(v: Variant, layout: str) -> float:
    """Bytes read per (dense) weight: ``"canonical"`` (the compressed delta: codes, 2:4 positions,
    fp16 scales, uint8 zero points), ``"transposed"`` (the same bytes) or ``"mma"`` (2:4 expanded to
    dense codes, fp16 zero points)."""
    g = v.group
    if layout in ("canonical", "transposed"):
        codes = v.bits / 8 / (2 if v.sparse else 1)
        pos = 2 / 8 / 2 if v.sparse else 0.0
        return codes + pos + 2 / g + (1 / g if v.asym else 0.0)
    if layout == "mma":
        return v.bits / 8 + 2 / g + (2 / g if v.asym else 0.0)
    raise ValueError(f"unknown layout {layout!r}")


def hbm_bound(instr_per_weight: float, own_bytes: float, floor_bytes: float, gpu: str) -> dict:
    """The bound model (module docstring) for one GPU: times per weight and the ratio to the floor."""
    spec = GPUS[gpu]
    issue = spec["sms"] * ISSUE_PER_SM_CYCLE * spec["clock_hz"]
    t_instr = instr_per_weight / issue
    t_own = own_bytes / spec["hbm_Bps"]
    t_floor = floor_bytes / spec["hbm_Bps"]
    return {
        "gpu": gpu,
        "instr_limited_Gweights_per_s": round(1e-9 / t_instr, 1),
        "hbm_limited_Gweights_per_s": round(1e-9 / t_own, 1),
        "floor_Gweights_per_s": round(1e-9 / t_floor, 1),
        "bound_x_floor": round(max(t_instr, t_own) / t_floor, 2),
        "limited_by": "instructions" if t_instr > t_own else "HBM",
        "break_even_instr_per_weight": round(t_own * issue, 2),
    }


def describe(v: Variant, arch: int) -> dict:
    """Compile, analyze and bound one variant for one arch: the bench's result row."""
    r = compile_variant(v, arch)
    layout = "transposed" if v.kernel == "transposed" else "mma"
    own, floor = bytes_per_weight(v, layout), bytes_per_weight(v, "canonical")
    row = {**asdict(v), "arch": f"sm_{arch}", "instr_per_weight": r["instr_per_weight"],
           "loop_instructions": r["loop_instructions"], "weights_per_thread_iteration": r["weights_per_thread_iteration"],
           "k_steps_per_iteration": r["k_steps_per_iteration"], "registers": r["registers"],
           "shared_bytes": r["shared_bytes"], "loop_smem_stores": r["loop_smem_stores"], "block": r["block"],
           "bytes_per_weight_read": round(own, 4), "bytes_per_weight_canonical": round(floor, 4),
           "loop_opcodes_top": dict(list(r["loop_opcodes"].items())[:10])}
    row["bound"] = [hbm_bound(r["instr_per_weight"], own, floor, gpu) for gpu, spec in GPUS.items()
                    if spec["arch"] == arch]
    row["loop_full_opcodes"] = r["loop_full_opcodes"]
    # a 2-bit thread-row holds 2 words: its run is 8 bytes by layout, not by compiler choice
    row["screens"] = screens(r, min_copy_bytes=8 if (v.kernel == "fast" and v.bits == 2) else 16)
    try:
        import triton

        row["triton"] = triton.__version__
    except Exception:  # noqa: BLE001
        row["triton"] = None
    return row


def screens(r: dict, min_copy_bytes: int = 16) -> dict[str, bool]:
    """Version-independent checks of a streaming kernel's main loop (what the H200 run showed matters,
    kernel-diagnosis.md in shared/measurements/h200-2026-11): every global->shared copy as wide as the
    layout's run (16 bytes; 8 for the 2-bit fast layout),
    no shared-memory store (no staging of the dequantized tile through shared memory), at most one
    barrier per K step. Instruction counts are not screened: they barely differed between a fast and a
    slow build."""
    full = r["loop_full_opcodes"]
    steps = max(1, r.get("k_steps_per_iteration", 1))
    copies = [op for op in full if op.startswith("LDGSTS")]
    wide = (".128",) if min_copy_bytes >= 16 else (".128", ".64")
    return {"wide_copies": all(op.endswith(wide) for op in copies),
            "no_shared_stores": r["loop_smem_stores"] == 0,
            "one_barrier_per_k_step": sum(n for op, n in full.items() if op.startswith("BAR.SYNC")) <= steps}


def _parse_variant(text: str) -> Variant:
    """``KERNEL:BITS:24|dense:sym|asym:fp16|bf16`` -> :class:`Variant`."""
    kernel, bits, sparse, sym, dtype = text.split(":")
    if sparse not in ("24", "dense") or sym not in ("sym", "asym") or dtype not in ("fp16", "bf16"):
        raise ValueError(f"variant {text!r}: want KERNEL:BITS:24|dense:sym|asym:fp16|bf16")
    return Variant(kernel, int(bits), sparse == "24", sym == "asym", dtype)


def main(argv: list[str] | None = None) -> int:
    """``python -m deltazip.kernels.sass --variant fast:4:24:sym:fp16 [--variant ...] [--arch 80,90]``:
    print the :func:`describe` rows as one JSON list (what tests/kernels/test_sass.py runs in a
    process of its own, since the interpreter replaces ``@triton.jit`` functions)."""
    import argparse
    import json
    import sys

    ap = argparse.ArgumentParser(prog="python -m deltazip.kernels.sass", description=main.__doc__.splitlines()[0])
    ap.add_argument("--variant", action="append", required=True, help="KERNEL:BITS:24|dense:sym|asym:fp16|bf16")
    ap.add_argument("--arch", default="90", help="comma-separated SM versions")
    args = ap.parse_args(argv)
    why = tools_available()
    if why is not None:
        print(why, file=sys.stderr)
        return 1
    rows = [describe(_parse_variant(v), int(a)) for a in args.arch.split(",") for v in args.variant]
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
