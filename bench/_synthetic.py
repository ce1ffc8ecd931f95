"""Synthetic Llama models for the GPU benches, made from a seed on the device they run on.

- :func:`build_base`: a Llama with Llama-2-7B layer shapes (``shape="7b"``: hidden 4096, MLP 11008, 32
  heads, vocab 32000; ``"2b"``: hidden 2048, MLP 5632, the compression-memory bench's; ``"toy"`` for a
  CPU dry run), ``layers`` decoder layers, transformers' own initialisation from ``seed`` on the device,
  saved in bf16 with a character tokenizer.
- :func:`random_variant`: one variant's packed deltas, written straight from random codes and scales
  in the served 4-bit 2:4 group-128 layout (``deltazip.kernels.packed``) on the device: codes drawn from
  a rounded Gaussian (the spread RTN of a Gaussian delta gives, so the lossless stage sees realistic
  bytes), 2:4 positions drawn uniformly from the six pairs, fp16 scales. Variant ``i`` is its own
  seed: every variant differs from every other in every linear (the server deduplicates
  bit-identical tensors, so copies would measure nothing).
- :func:`write_variants`: real artifacts (``ArtifactWriter``: safetensors containers, checksums,
  manifest with the base's fingerprint), written by a pool of threads while the device draws the
  next variant; the server loads them through its normal path. No solver, no host packing loop.
- :func:`write_swap_checkpoint`: one whole fine-tuned checkpoint (every linear of the base moved),
  hard-linked under every variant name: swap mode then holds one pinned host copy for all of them
  (its registry deduplicates the identical tensors), the best case for swapping, and a copy to the
  device costs the same whatever the values (bench/serve.py says so beside every swap figure).
- :func:`write_pair`: a base and a fine-tune (base + low-rank + noise on every linear) for the
  compression benches.

Layer counts follow the machine: :func:`fit_layers` gives the most layers whose bytes fit a budget
(disk, host or device memory), at most the model's 32; every bench prints the count it used.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

SHAPES = {
    "7b": dict(hidden_size=4096, intermediate_size=11008, num_attention_heads=32, num_key_value_heads=32,
               vocab_size=32000),
    "2b": dict(hidden_size=2048, intermediate_size=5632, num_attention_heads=16, num_key_value_heads=16,
               vocab_size=32000),
    "toy": dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=4,
                vocab_size=512),
}
FULL_LAYERS = 32  # Llama-2-7B's depth
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")
_PAIRS = torch.tensor([[0, 1], [0, 2], [0, 3], [1, 2], [1, 3], [2, 3]])  # a 2:4 group's kept positions, ascending
_DONE = "synthetic.json"


def scheme():
    """The served scheme of every synthetic variant: 4-bit, 2:4, group 128, symmetric (the default)."""
    from deltazip.kernels.scheme import DeltaScheme

    return DeltaScheme(bits=4, group_size=128, sparsity="2:4")


def llama_config(shape: str, layers: int):
    from transformers import AutoConfig

    if shape not in SHAPES:
        raise SystemExit(f"bench: unknown shape {shape!r}; use one of {', '.join(SHAPES)}")
    return AutoConfig.for_model("llama", num_hidden_layers=layers, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                                max_position_embeddings=4096, **SHAPES[shape])


def linear_shapes(cfg) -> dict[str, tuple[int, int]]:
    """``checkpoint name -> (out, in)`` of every decoder-layer linear of a Llama config."""
    h, m = cfg.hidden_size, cfg.intermediate_size
    kv = cfg.num_key_value_heads * (h // cfg.num_attention_heads)
    dims = {"self_attn.q_proj": (h, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
            "self_attn.o_proj": (h, h), "mlp.gate_proj": (m, h), "mlp.up_proj": (m, h), "mlp.down_proj": (h, m)}
    return {f"model.layers.{i}.{lin}.weight": dims[lin] for i in range(cfg.num_hidden_layers) for lin in LINEARS}


def packed_bytes(out_f: int, in_f: int) -> int:
    """Bytes of one 4-bit 2:4 group-128 packed delta: codes, positions, fp16 scales."""
    kept = in_f // 2
    return out_f * (kept // 8 * 4 + kept // 16 * 4 + in_f // 128 * 2)


def slot_bytes(out_f: int, in_f: int) -> int:
    """Device bytes of one GPU stack slot holding a 4-bit 2:4 group-128 delta: the ``mma`` layout a CUDA
    server allocates (2:4 expanded to 4 bits per weight, or compact under the ``sparse-mma`` preview),
    about a third more than :func:`packed_bytes`. Allocated on the meta device: no memory."""
    from deltazip.kernels.scheme import DeltaScheme
    from deltazip.kernels.stacked import StackedDeltas

    scheme = DeltaScheme(bits=4, group_size=128, sparsity="2:4")
    return StackedDeltas.allocate(1, scheme, in_features=in_f, out_features=out_f, device="meta",
                                  layout="mma").nbytes()


def sizes(shape: str) -> dict[str, int]:
    """Bytes per decoder layer and outside the layers: the bf16 model, one packed variant (on disk and in
    host memory) and one variant's stack slots (in device memory)."""
    one = llama_config(shape, 1)
    lin = linear_shapes(one)
    layer_params = sum(o * i for o, i in lin.values()) + 2 * one.hidden_size
    return {"model_layer": 2 * layer_params,
            "model_fixed": 2 * (2 * one.vocab_size * one.hidden_size + one.hidden_size),
            "variant_layer": sum(packed_bytes(o, i) for o, i in lin.values()),
            "slot_layer": sum(slot_bytes(o, i) for o, i in lin.values())}


def fit_layers(budget: float, per_layer: float, fixed: float = 0, most: int = FULL_LAYERS) -> int:
    """The most layers (1..``most``) whose ``fixed + layers * per_layer`` bytes fit ``budget``."""
    return max(1, min(most, int((budget - fixed) // per_layer)))


def _tokenizer():
    from deltazip.demo.pair import build_char_tokenizer

    return build_char_tokenizer()


def _recipe_done(d: Path, recipe: dict) -> dict | None:
    f = d / _DONE
    if f.is_file():
        info = json.loads(f.read_text())
        if info.get("recipe") == recipe:
            return info
    return None


def seeded_model(shape: str, layers: int, device: str | torch.device, seed: int = 0):
    """The synthetic Llama built on ``device`` in bf16 (transformers' initialisation, seeded)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(llama_config(shape, layers), dtype=torch.bfloat16).eval()


def build_base(d: Path, shape: str, layers: int, device: str | torch.device, seed: int = 0,
               log: Callable[[str], None] = print) -> dict:
    """The base checkpoint at ``d`` (cached by recipe): ``{"path", "fingerprint", "seconds", ...}``."""
    from deltazip.models.checkpoint import Checkpoint

    recipe = {"kind": "base", "shape": shape, "layers": layers, "seed": seed}
    info = _recipe_done(d, recipe)
    if info:
        return info
    t0 = time.perf_counter()
    m = seeded_model(shape, layers, device, seed)
    made = time.perf_counter() - t0
    m.save_pretrained(d)
    _tokenizer().save_pretrained(d)
    del m
    info = {"recipe": recipe, "path": str(d), "fingerprint": Checkpoint(d).fingerprint(),
            "bytes": sum(p.stat().st_size for p in d.glob("*.safetensors")),
            "seconds": round(time.perf_counter() - t0, 2), "made_on_device_s": round(made, 2), "device": str(device)}
    (d / _DONE).write_text(json.dumps(info))
    log(f"synthetic {shape} base, {layers} layers: {info['bytes'] / 1e9:.2f} GB made on {device} and written in "
        f"{info['seconds']:.1f} s")
    return info


def random_packed(out_f: int, in_f: int, g: torch.Generator, device: str | torch.device):
    """One random 4-bit 2:4 group-128 PackedDelta ``[out_f, in_f]`` drawn on ``device`` (module docstring)."""
    from deltazip.formats.packing import pack_int32
    from deltazip.kernels.packed import PackedDelta

    kept = in_f // 2
    codes = (torch.randn(out_f, kept, generator=g, device=device) * 2.5).round_().add_(8).clamp_(0, 15)
    pairs = torch.randint(0, 6, (out_f, in_f // 4), generator=g, device=device)
    positions = _PAIRS.to(device)[pairs].reshape(out_f, kept)
    scales = (torch.rand(out_f, in_f // 128, generator=g, device=device) * 2e-4 + 1e-4).to(torch.float16)
    d = PackedDelta(qweight=pack_int32(codes.to(torch.int32), 4), scales=scales, zeros=None,
                    positions=pack_int32(positions, 2), scheme=scheme(), in_features=in_f, out_features=out_f)
    d.validate()
    return d


def random_variant(cfg, index: int, device: str | torch.device, seed: int = 0) -> dict:
    """``checkpoint name -> PackedDelta`` of variant ``index``: every decoder-layer linear, on ``device``."""
    g = torch.Generator(device).manual_seed(1_000_003 * (seed + 1) + index)
    return {name: random_packed(o, i, g, device) for name, (o, i) in linear_shapes(cfg).items()}


def write_variant(out: Path, base: dict, cfg, deltas: dict) -> int:
    """One artifact at ``out`` holding ``deltas`` (additive, over the bf16 base ``base``); every other
    tensor of the base ``same``; side files by reference to the base. Returns its bytes."""
    from deltazip.compress.config import CompressConfig
    from deltazip.formats.artifact import ArtifactWriter
    from deltazip.models.checkpoint import Checkpoint

    ck = Checkpoint(base["path"])
    with ArtifactWriter(out, overwrite=True, lossless="none") as w:
        for name, d in deltas.items():
            w.add_packed(name, d, torch.bfloat16, additive=True)
        for name in ck.names:
            if name not in deltas:
                w.add_same(name, tuple(ck.table[name].shape), ck.dtype(name))
        for f in ck.side_files():
            w.add_file(f, f.name, base_dir=ck.path)
        lineage = {"base": base["path"], "finetuned": f"synthetic variant {out.name}",
                   "base_fingerprint": base["fingerprint"], "finetuned_fingerprint": f"synthetic:{out.name}",
                   "architectures": cfg.architectures, "model_type": "llama", "finetuned_bytes": ck.nbytes(),
                   "layers_path": "model.layers", "num_layers": cfg.num_hidden_layers}
        ccfg = CompressConfig(scheme=scheme(), method="rtn", device="cpu")
        w.finalize(lineage=lineage, config=ccfg.to_dict(), calibration=None,
                   stats={"synthetic": "random codes and scales (bench/_synthetic.py)"})
    return sum(p.stat().st_size for p in out.iterdir() if p.is_file())


def write_variants(arts: Path, base: dict, shape: str, layers: int, count: int, device: str | torch.device,
                   threads: int | None = None, log: Callable[[str], None] = print) -> dict:
    """``count`` distinct random variants ``v00, v01, ...`` under ``arts`` (cached by recipe).

    The device draws each variant (milliseconds on a GPU) and copies it to host memory; a pool of
    ``threads`` writers (default: the CPUs, at most 16) checksums and writes the artifacts meanwhile.
    Returns ``{"seconds", "bytes", "variants", "GBps"}``.
    """
    recipe = {"kind": "variants", "shape": shape, "layers": layers, "count": count,
              "base": base["fingerprint"]}
    info = _recipe_done(arts, recipe)
    if info:
        return info
    cfg = llama_config(shape, layers)
    threads = threads or max(1, min(16, os.cpu_count() or 1))
    t0 = time.perf_counter()
    arts.mkdir(parents=True, exist_ok=True)
    sizes_: list[int] = []
    with ThreadPoolExecutor(threads) as pool:
        futures = []
        for i in range(count):
            deltas = {k: d.to("cpu") for k, d in random_variant(cfg, i, device).items()}
            futures.append(pool.submit(write_variant, arts / f"v{i:02d}", base, cfg, deltas))
            del deltas
            while sum(not f.done() for f in futures) > threads:  # bound the host copies waiting
                time.sleep(0.01)
        for f in futures:
            sizes_.append(f.result())
    sec = time.perf_counter() - t0
    info = {"recipe": recipe, "seconds": round(sec, 2), "bytes": sum(sizes_), "variants": count,
            "GBps": round(sum(sizes_) / sec / 1e9, 3), "threads": threads}
    (arts / _DONE).write_text(json.dumps(info))
    log(f"{count} synthetic variants ({layers} layers, {sum(sizes_) / 1e9:.2f} GB) drawn on {device} and written "
        f"in {sec:.1f} s ({info['GBps']} GB/s, {threads} writer threads)")
    return info


def hard_link_names(src: Path, dst_root: Path, names: list[str]) -> None:
    """``dst_root/NAME`` for every name: a tree of hard links to ``src`` (one copy of the bytes on disk)."""
    for name in names:
        dst = dst_root / name
        for f in src.rglob("*"):
            target = dst / f.relative_to(src)
            if f.is_dir():
                target.mkdir(parents=True, exist_ok=True)
            elif f.name != _DONE and not target.exists():
                target.parent.mkdir(parents=True, exist_ok=True)
                os.link(f, target)


def _move_linears(model, g: torch.Generator, scale: float, rank: int = 0) -> None:
    """Every decoder-layer linear of ``model`` += a delta of ``scale`` times its weights' std: Gaussian
    noise, plus (``rank`` > 0) a rank-``rank`` product of the same size (a fine-tune's low-rank part)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".layers." not in name or not name.endswith("proj.weight"):
                continue
            w = p.float()
            std = float(w.std())
            delta = torch.randn(w.shape, generator=g, device=w.device)
            if rank:
                a = torch.randn(w.shape[0], rank, generator=g, device=w.device)
                b = torch.randn(rank, w.shape[1], generator=g, device=w.device)
                delta = 0.5 * delta + (a @ b) * (0.5 / rank ** 0.5)
            p.copy_((w + scale * std * delta).to(p.dtype))


def write_swap_checkpoint(d: Path, base: dict, shape: str, layers: int, names: list[str],
                          device: str | torch.device, seed: int = 0, log: Callable[[str], None] = print) -> Path:
    """One whole fine-tune (the base with every linear moved) under ``d/one``, hard-linked as
    ``d/named/NAME`` for every name; returns ``d/named`` (the directory the swap server serves)."""
    recipe = {"kind": "swap", "shape": shape, "layers": layers, "base": base["fingerprint"], "seed": seed}
    if not _recipe_done(d / "one", recipe):
        t0 = time.perf_counter()
        m = seeded_model(shape, layers, device, seed)
        _move_linears(m, torch.Generator(device).manual_seed(seed + 7), 0.05)
        m.save_pretrained(d / "one")
        _tokenizer().save_pretrained(d / "one")
        del m
        (d / "one" / _DONE).write_text(json.dumps({"recipe": recipe}))
        log(f"swap checkpoint ({layers} layers) made on {device} and written in {time.perf_counter() - t0:.1f} s")
    hard_link_names(d / "one", d / "named", names)
    return d / "named"


def calib_file(path: Path, tokens: int, seed: int = 0) -> Path:
    """A .jsonl of random word 'sentences' holding at least ``tokens`` characters (the character
    tokenizer's tokens): enough distinct calibration windows for ``nsamples * seqlen``."""
    import random

    rnd = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "zip", "model", "base", "tune", "12", "345", "=", "+", "serve",
             "variant", "layer", "matrix", "token", "batch"]
    path.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with open(path, "w") as f:
        while n < tokens:
            text = " ".join(rnd.choice(words) for _ in range(rnd.randint(40, 120)))
            f.write(json.dumps({"text": text}) + "\n")
            n += len(text) + 1
    return path


def write_pair(d: Path, shape: str, layers: int, device: str | torch.device, calib_tokens: int, seed: int = 0,
               rank: int = 16, log: Callable[[str], None] = print) -> dict:
    """A base and a fine-tune (every linear += low-rank + noise, 2% of its std) at ``d/base``,
    ``d/finetuned``, and a calibration file of ``calib_tokens`` tokens (cached by recipe):
    ``{"base", "finetuned", "calib", "seconds", "bytes"}``."""
    recipe = {"kind": "pair", "shape": shape, "layers": layers, "seed": seed, "rank": rank,
              "calib_tokens": calib_tokens}
    info = _recipe_done(d, recipe)
    if info:
        return info
    t0 = time.perf_counter()
    m = seeded_model(shape, layers, device, seed)
    tok = _tokenizer()
    m.save_pretrained(d / "base")
    tok.save_pretrained(d / "base")
    _move_linears(m, torch.Generator(device).manual_seed(seed + 1), 0.02, rank)
    m.save_pretrained(d / "finetuned")
    tok.save_pretrained(d / "finetuned")
    del m
    calib = calib_file(d / "calib.jsonl", calib_tokens, seed)
    info = {"recipe": recipe, "base": str(d / "base"), "finetuned": str(d / "finetuned"), "calib": str(calib),
            "bytes": sum(p.stat().st_size for p in (d / "finetuned").glob("*.safetensors")),
            "seconds": round(time.perf_counter() - t0, 2), "device": str(device)}
    (d / _DONE).write_text(json.dumps(info))
    log(f"synthetic {shape} pair, {layers} layers: made on {device} and written in {info['seconds']:.1f} s")
    free_device_cache()
    return info


def _memory_available() -> int:
    """Host memory the system could give (MemAvailable, page cache included), in bytes."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def serving_layers(shape: str, count: int, root: Path, device: str | torch.device, most: int = FULL_LAYERS) -> dict:
    """The most layers (at most ``most``) a serving run of ``count`` variants fits on this machine:
    on disk (the base, the swap checkpoint and ``count`` variants under ``root``), in host memory
    (both servers' host tiers: every variant, and one pinned whole model for swap) and in device
    memory (the base and ``count`` resident variants). ``{"layers", "limits": {resource: layers}}``."""
    import shutil

    sz = sizes(shape)
    model, variant = sz["model_layer"], sz["variant_layer"]
    probe = root
    while not probe.exists():
        probe = probe.parent
    limits = {"requested": most,
              "disk": fit_layers(0.85 * shutil.disk_usage(probe).free, 2 * model + count * variant,
                                 2 * sz["model_fixed"], FULL_LAYERS),
              "host": fit_layers(0.6 * _memory_available(), model + count * variant, sz["model_fixed"], FULL_LAYERS)}
    if torch.device(device).type == "cuda":
        limits["device"] = fit_layers(0.8 * torch.cuda.get_device_properties(0).total_memory,
                                      model + count * sz["slot_layer"], sz["model_fixed"], FULL_LAYERS)
    return {"layers": min(limits.values()), "limits": limits}


def serving_set(root: Path, shape: str, layers: int, count: int, device: str | torch.device,
                log: Callable[[str], None] = print) -> dict:
    """Everything a serving run needs under ``root/l{layers}``: the base, ``count`` distinct variants
    (artifacts ``v00, v01, ...``) and the swap checkpoint hard-linked under the same names. Returns
    ``{"base", "arts", "swap", "base_info", "variants_info"}`` (paths as strings)."""
    d = root / f"{shape}-l{layers}"
    base = build_base(d / "base", shape, layers, device, log=log)
    variants = write_variants(d / "arts", base, shape, layers, count, device, log=log)
    names = [f"v{i:02d}" for i in range(count)]
    swap = write_swap_checkpoint(d / "swap", base, shape, layers, names, device, log=log)
    free_device_cache()  # the servers, in their own processes, get the memory the drawing used
    return {"base": base["path"], "arts": str(d / "arts"), "swap": str(swap), "base_info": base,
            "variants_info": variants}


def free_device_cache() -> None:
    """Hand the CUDA caching allocator's free blocks back, so that other processes (a server, the CLI)
    can use the device memory this process drew models with."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
