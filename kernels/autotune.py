"""Per-GPU tuning of the fast SBMM kernel's launch options, cached on disk.

What is tuned: for one stack configuration (layout, bits, group, 2:4, zero points, ``in x out``), one
activation dtype and one batch bucket (the row count rounded up to a power of two), the launch
options of ``deltazip.kernels.triton_fast.sbmm_fast`` that do not change its result beyond fp32
summation order: ``num_stages`` (software pipeline depth), ``unroll`` (K steps per loop iteration),
``split_k`` (K splits summed with atomics) and ``num_warps``. The row tile (``BLOCK_M``) is not
tuned: one row plan is shared by every linear of a step.

Where the results live: one JSON file per GPU model and Triton version,
``$DELTAZIP_AUTOTUNE_DIR`` or ``$XDG_CACHE_HOME/deltazip/autotune`` (default
``~/.cache/deltazip/autotune``) ``/<gpu-name>-triton-<version>.json``::

    {"version": 1, "entries": {"<key>": {"num_warps": 4, "num_stages": 3, "unroll": 2, "split_k": 1}}}

A missing file is an empty cache; an unreadable or malformed one is ignored with one warning (and
replaced on the next save), malformed entries are dropped one by one. Writes go to a temporary file
renamed over the old one, so a crash never leaves half a file.

The lookup (:func:`lookup`) is a dict access on the host, done per launch; tuning (:func:`tune`) runs
at server start (``deltazip.kernels.warmup``), never on the request path.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from deltazip.kernels.stacked import StackedDeltas

FORMAT_VERSION = 1
_DIR_ENV = "DELTAZIP_AUTOTUNE_DIR"
_FIELDS = {"num_warps": (4, 8), "num_stages": (1, 2, 3, 4, 5), "unroll": (1, 2, 4), "split_k": (1, 2, 4, 8)}

# Candidates: one warpgroup (the layout's 64-row tiles assume 4 warps), pipeline depth 2-4, one or two
# K steps per iteration, every split-K the warm-up compiles.
CANDIDATES: tuple[dict[str, int], ...] = tuple(
    {"num_warps": 4, "num_stages": st, "unroll": un, "split_k": sk}
    for st in (2, 3, 4) for un in (1, 2) for sk in (1, 2, 4, 8)
)


def rows_bucket(rows: int) -> int:
    """The batch bucket of ``rows`` token rows: the next power of two (1 for 0 or 1)."""
    return 1 if rows <= 1 else 1 << (rows - 1).bit_length()


def tune_key(stack: StackedDeltas, dtype: torch.dtype, rows: int) -> str:
    """The cache key of a launch: ``layout/bits/group/sparsity/zero points/in x out/dtype/rows bucket``."""
    return (f"{stack.layout}/b{stack.bits}/g{stack.effective_group}/{'24' if stack.sparse else 'dense'}/"
            f"{'asym' if stack.asymmetric else 'sym'}/{stack.in_features}x{stack.out_features}/"
            f"{str(dtype).removeprefix('torch.')}/n{rows_bucket(rows)}")


def device_tag(device: torch.device | str) -> str:
    """``<gpu-name>-triton-<version>`` with the name reduced to file-safe characters."""
    device = torch.device(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = f"{device.type}-interpreter"
    try:
        import triton

        version = triton.__version__
    except Exception:  # noqa: BLE001 - no Triton: nothing is tuned, the tag only names a file
        version = "none"
    return re.sub(r"[^A-Za-z0-9._-]+", "-", f"{name}-triton-{version}").strip("-")


def cache_dir() -> Path:
    env = os.environ.get(_DIR_ENV, "").strip()
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME", "").strip() or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "deltazip" / "autotune"


def cache_path(device: torch.device | str) -> Path:
    return cache_dir() / f"{device_tag(device)}.json"


def valid_config(cfg: object) -> bool:
    """True for a dict with exactly the tuned fields, each one of its allowed values."""
    return (isinstance(cfg, dict) and set(cfg) == set(_FIELDS)
            and all(type(cfg[k]) is int and cfg[k] in allowed for k, allowed in _FIELDS.items()))


class TuneCache:
    """The tuning results of one GPU model and Triton version (one JSON file, module docstring)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.entries: dict[str, dict[str, int]] = {}
        self.dropped = 0  # malformed entries skipped by the last load

    def load(self) -> TuneCache:
        """Read the file; a missing file is an empty cache, a corrupt one is ignored with a warning."""
        self.entries, self.dropped = {}, 0
        try:
            raw = json.loads(self.path.read_text())
        except FileNotFoundError:
            return self
        except (OSError, ValueError) as e:  # unreadable, or not JSON (ValueError covers JSONDecodeError)
            warnings.warn(f"autotune cache {self.path} is unreadable ({e}); ignoring it, it will be rewritten",
                          stacklevel=2)
            return self
        if not isinstance(raw, dict) or raw.get("version") != FORMAT_VERSION or not isinstance(raw.get("entries"), dict):
            warnings.warn(f"autotune cache {self.path} is not a version-{FORMAT_VERSION} cache; ignoring it",
                          stacklevel=2)
            return self
        for key, cfg in raw["entries"].items():
            if isinstance(key, str) and valid_config(cfg):
                self.entries[key] = dict(cfg)
            else:
                self.dropped += 1
        return self

    def get(self, key: str) -> dict[str, int] | None:
        return self.entries.get(key)

    def put(self, key: str, cfg: dict[str, int]) -> None:
        if not valid_config(cfg):
            raise ValueError(f"autotune config {cfg!r} is not one of the tunable settings {_FIELDS}")
        self.entries[key] = dict(cfg)

    def save(self) -> None:
        """Write atomically (temporary file, then rename)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"version": FORMAT_VERSION, "entries": dict(sorted(self.entries.items()))},
                                  indent=1))
        os.replace(tmp, self.path)


_caches: dict[Path, TuneCache] = {}
_by_device: dict[tuple[str, str], TuneCache] = {}  # (device, cache dir setting) -> cache: no lookups per launch


def cache_for(device: torch.device | str) -> TuneCache:
    """The process-wide cache of ``device``'s GPU model, loaded from disk on first use."""
    memo = (str(device), os.environ.get(_DIR_ENV, ""))
    c = _by_device.get(memo)
    if c is not None:
        return c
    path = cache_path(device)
    c = _caches.get(path)
    if c is None:
        c = _caches[path] = TuneCache(path).load()
    _by_device[memo] = c
    return c


def forget_loaded() -> None:
    """Drop the in-memory caches (the next :func:`cache_for` reads the files again)."""
    _caches.clear()
    _by_device.clear()


def enabled() -> bool:
    """``DELTAZIP_AUTOTUNE=0`` turns tuned launch options (and tuning) off."""
    return os.environ.get("DELTAZIP_AUTOTUNE", "1").strip().lower() not in ("0", "false", "no", "off")


def lookup(stack: StackedDeltas, dtype: torch.dtype, rows: int) -> dict[str, int] | None:
    """The tuned launch options for this launch, or None (untuned: the kernel's defaults)."""
    if stack.layout != "mma" or stack.device.type != "cuda" or not enabled():
        return None
    return cache_for(stack.device).get(tune_key(stack, dtype, rows))


def cuda_timer(fn: Callable[[], object], repeats: int = 5) -> float:
    """Median milliseconds of ``fn`` on the current CUDA stream (after one untimed call: the compile)."""
    fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def candidates_for(stack: StackedDeltas) -> list[dict[str, int]]:
    """:data:`CANDIDATES` whose split-K fits the stack's K steps."""
    from deltazip.kernels.triton_fast import fast_config

    bk, _ = fast_config(stack)
    k_tiles = stack.in_features // bk
    return [c for c in CANDIDATES if c["split_k"] <= k_tiles]


# Candidates skipped while tuning in this process (key -> "config: reason"), for the start-up log.
SKIPPED: dict[str, list[str]] = {}


def tune(stack: StackedDeltas, dtype: torch.dtype, rows: int, *, cache: TuneCache | None = None,
         timer: Callable[[Callable[[], object]], float] | None = None,
         candidates: list[dict[str, int]] | None = None, save: bool = True) -> dict[str, int]:
    """Time every candidate on ``rows`` dummy rows spread over the stack's slots; cache the fastest.

    An entry already in the cache is returned without timing. ``timer`` (default :func:`cuda_timer`)
    takes a zero-argument launch and returns its time; the tests pass a fake one.

    A candidate whose launch raises (``OutOfResources``: more shared memory than the device allows; a
    compile error) is skipped and recorded in :data:`SKIPPED`; when none runs, the defaults (``{}``)
    are returned and nothing is cached.

    Returns:
        The chosen launch options.
    """
    from deltazip.kernels.triton_fast import sbmm_fast
    from deltazip.kernels.triton_sbmm import default_block_m, group_rows

    cache = cache_for(stack.device) if cache is None else cache
    key = tune_key(stack, dtype, rows)
    have = cache.get(key)
    if have is not None:
        return have
    n = rows_bucket(rows)
    x = torch.zeros(n, stack.in_features, dtype=dtype, device=stack.device)
    index = torch.arange(n, device=stack.device) % stack.num_deltas  # rows over every slot: the costly case
    plan = group_rows(index, stack.num_deltas, default_block_m(n))
    timer = cuda_timer if timer is None else timer
    best, best_t = None, float("inf")
    for cfg in candidates_for(stack) if candidates is None else candidates:
        try:
            t = timer(lambda cfg=cfg: sbmm_fast(x, index, stack, plan=plan, config=cfg))
        except Exception as e:  # noqa: BLE001 - OutOfResources (a config needing more shared memory than
            # the device has), a compile error: that config is skipped, never raised into a server start
            SKIPPED.setdefault(key, []).append(f"{cfg}: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}")
            continue
        if t < best_t:
            best, best_t = cfg, t
    if best is None:
        warnings.warn(f"no autotune candidate of {key} ran ({SKIPPED.get(key, [])[:2]}); using the defaults",
                      stacklevel=2)
        return {}
    cache.put(key, best)
    if save:
        cache.save()
    return best
