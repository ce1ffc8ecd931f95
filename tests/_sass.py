"""The SASS of the CUDA kernel's cubins, read offline: ``cuobjdump`` on a cubin NVRTC compiled, no GPU (a
helper of the tests: nothing that serves reads SASS).

The offline checks (tests/kernels/test_cuda_sbmm.py and its neighbours, CI) compile every launch config the tuner can time
for sm_80 and sm_90 and read the result here: the main K loop (the backward branch whose body holds the
most tensor-core instructions), its opcodes (``LDGSTS...128``: 16-byte copies; ``STS``: shared-memory
stores; ``LDL``/``STL``: spills) and the registers per thread (``cuobjdump -res-usage``).

``cuobjdump`` and the ``nvdisasm`` it runs come from the ``nvidia-cuda-cuobjdump`` and
``nvidia-cuda-nvdisasm`` wheels (the ``dev`` extra), or from ``PATH``.
"""

from __future__ import annotations

import collections
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

_SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")
_MMA_OPS = ("HMMA", "HGMMA", "IMMA", "HFMA2.MMA")


def _tool(name: str) -> str | None:
    """Path of a CUDA binary: a pip wheel's (``nvidia/cu13/bin``), else the one on ``PATH``, else None."""
    for site in sys.path:
        for hit in sorted(glob.glob(os.path.join(site, "nvidia", "cu1*", "bin", name))):
            if os.access(hit, os.X_OK):
                return hit
    return shutil.which(name)


def tools_available() -> str | None:
    """None when cubins can be disassembled here, else the reason they cannot."""
    missing = [n for n in ("cuobjdump", "nvdisasm") if _tool(n) is None]
    if missing:
        return (f"{' and '.join(missing)} not installed: pip install "
                f"{' '.join('nvidia-cuda-' + n for n in missing)} (the dev extra)")
    return None


def _disassemble(cubin: bytes, function: str | None) -> tuple[list[tuple[int, str, str]], str]:
    """``([(address, opcode with modifiers, operands)], resource usage text)`` of a cubin's function
    (predicates dropped from the opcode)."""
    why = tools_available()
    if why:
        raise RuntimeError(why)
    tool, env = _tool("cuobjdump"), {**os.environ, "NVDISASM_PATH": os.path.dirname(_tool("nvdisasm"))}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        only = ["-fun", function] if function else []
        sass = subprocess.run([tool, "-sass", *only, path], capture_output=True, text=True, check=True,
                              env=env).stdout
        res = subprocess.run([tool, "-res-usage", path], capture_output=True, text=True, check=True,
                              env=env).stdout
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
