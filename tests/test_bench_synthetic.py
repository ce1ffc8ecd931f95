"""The GPU window's inputs, built and checked on CPU at toy size (bench/_synthetic.py and the helpers
of bench/step.py, bench/serve.py and bench/compress_memory.py): the random variants are valid packed
deltas, distinct in every tensor, written as real artifacts that verify and that the serving model
loads to the same bytes it gets when the variants are drawn in memory; the swap checkpoint's names
share one host copy; the floors and the memory poll compute what they say."""

from __future__ import annotations

import asyncio
import http.server
import sys
import threading
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))
import _synthetic as syn  # noqa: E402

from deltazip.formats.codecs.packed import packed_problems  # noqa: E402
from deltazip.kernels.reference import delta_weight  # noqa: E402

LAYERS = 2


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("synthetic")
    return syn.serving_set(root, "toy", LAYERS, 3, "cpu", log=lambda m: None)


def test_a_random_delta_is_a_valid_24_packed_delta_of_its_seed():
    g = torch.Generator().manual_seed(5)
    d = syn.random_packed(64, 256, g, "cpu")
    assert packed_problems(d) == []
    w = delta_weight(d)
    assert w.shape == (64, 256)
    assert bool(((w.reshape(64, 64, 4) != 0).sum(-1) <= 2).all())  # 2:4: at most two kept per group of four
    assert float((w != 0).float().mean()) > 0.4  # rounded-Gaussian codes: most kept values are nonzero
    assert bool((d.scales.float() > 0).all())
    again = syn.random_packed(64, 256, torch.Generator().manual_seed(5), "cpu")
    assert all(torch.equal(a, b) for a, b in zip(d.parts().values(), again.parts().values()))


def test_every_variant_differs_from_every_other_in_every_linear():
    cfg = syn.llama_config("toy", LAYERS)
    vs = [syn.random_variant(cfg, i, "cpu") for i in range(3)]
    assert set(vs[0]) == set(syn.linear_shapes(cfg)) and len(vs[0]) == 7 * LAYERS
    for name in vs[0]:
        for i in range(3):
            for j in range(i + 1, 3):
                assert not torch.equal(vs[i][name].qweight, vs[j][name].qweight), (name, i, j)
                assert not torch.equal(vs[i][name].scales, vs[j][name].scales), (name, i, j)


def test_sizes_are_the_7b_arithmetic():
    sz = syn.sizes("7b")
    # q, k, v, o 4096x4096 and gate, up, down 4096x11008: 202.4 M weights, bf16; the norms' 8192.
    assert sz["model_layer"] == 2 * (4 * 4096 * 4096 + 3 * 4096 * 11008 + 2 * 4096)
    # 4-bit codes of the kept half (1/4 byte per weight), their 2-bit positions (1/8), fp16 scales per 128.
    w = 4 * 4096 * 4096 + 3 * 4096 * 11008
    assert sz["variant_layer"] == w // 4 + w // 8 + w // 128 * 2
    assert 80e9 < 32 * 32 * sz["variant_layer"] < 82e9  # "32 distinct variants need about 80 GB"
    # On a GPU a slot holds the mma layout: 2:4 expanded to 4-bit codes of every weight (1/2 byte; no
    # padding at these shapes) and the fp16 scales, a third more than the packed bytes. The device limits
    # count these: with the packed bytes, a 32-slot decode step on an H100 asked for 86.6 GB.
    assert sz["slot_layer"] == w // 2 + w // 128 * 2
    assert 1.3 < sz["slot_layer"] / sz["variant_layer"] < 1.34
    assert syn.fit_layers(64e9, 3.3e9, 1e9) == 19 and syn.fit_layers(500e9, 1e9) == 32 and syn.fit_layers(1, 9) == 1


def test_written_variants_verify_and_load_to_the_bytes_drawn_in_memory(served):
    from deltazip.formats.verify import verify_artifact
    from deltazip.models.checkpoint import Checkpoint
    from deltazip.runtime.serve.model import DeltaModel
    from deltazip.runtime.serve.variant_sources import find_variants, inspect_variant

    arts, base = Path(served["arts"]), Checkpoint(served["base"])
    names = [v.name for v in find_variants(arts)]
    assert names == ["v00", "v01", "v02"]
    for n in names:
        rep = verify_artifact(arts / n, base.fingerprint(), base_dir=base.path)
        assert rep["ok"], rep["problems"]
    variants = [inspect_variant(arts / n) for n in names]
    dm = DeltaModel(base, variants, 3, torch.device("cpu"), torch.float32, delta_compute="packed")
    cfg = syn.llama_config("toy", LAYERS)
    for i, n in enumerate(names):
        from_disk = dm.load_host(n)
        drawn = dm.host_from_packed(n, syn.random_variant(cfg, i, "cpu"))
        assert from_disk.modules.keys() == drawn.modules.keys() and from_disk.modules
        for m, kw in from_disk.modules.items():
            a, b = kw["packed"], drawn.modules[m]["packed"]
            assert all(torch.equal(x, y) for x, y in zip(a.parts().values(), b.parts().values())), (n, m)
    with pytest.raises(KeyError, match="no delta given"):
        dm.host_from_packed("v00", {})


def test_the_swap_checkpoints_names_share_one_host_copy(served):
    from deltazip.models.checkpoint import Checkpoint
    from deltazip.runtime.serve.model import SwapModels
    from deltazip.runtime.serve.variant_sources import (
        BaseTensorIndex,
        compare_full_checkpoint,
        inspect_variant,
    )
    from deltazip.runtime.share.dedup_serving import new_serving_registry

    swap, base = Path(served["swap"]), Checkpoint(served["base"])
    variants = [inspect_variant(swap / n) for n in ("v00", "v01", "v02")]
    registry = new_serving_registry()
    index = BaseTensorIndex(base, registry.fingerprint_bytes)
    for v in variants:
        compare_full_checkpoint(v, index, 4)
    moved = [n for n, e in variants[0].tensors.items() if e["kind"] == "full"]
    assert len(moved) == 7 * LAYERS and all(".layers." in n and n.endswith("proj.weight") for n in moved)
    sw = SwapModels(base, variants, 1, torch.device("cpu"), torch.bfloat16, "base", registry=registry)
    a, b = sw.load_host("v00"), sw.load_host("v02")
    assert a.keys() == b.keys()
    assert all(a[k].data_ptr() == b[k].data_ptr() for k in a)  # one copy held for every name


def test_the_pair_is_base_plus_a_low_rank_and_noise_delta(tmp_path):
    from deltazip.models.checkpoint import Checkpoint

    pair = syn.write_pair(tmp_path, "toy", 1, "cpu", calib_tokens=5000, rank=4, log=lambda m: None)
    base, ft = Checkpoint(pair["base"]), Checkpoint(pair["finetuned"])
    name = "model.layers.0.mlp.up_proj.weight"
    d = ft.get(name).float() - base.get(name).float()
    s = torch.linalg.svdvals(d)
    assert float(s[:4].square().sum() / s.square().sum()) > 0.3  # a rank-4 part well above the noise floor
    assert float(s[4].square() / s[:4].square().mean()) < 0.2
    assert torch.equal(ft.get("model.norm.weight"), base.get("model.norm.weight"))
    assert torch.equal(ft.get("model.embed_tokens.weight"), base.get("model.embed_tokens.weight"))
    assert sum(len(x) for x in Path(pair["calib"]).read_text().splitlines()) >= 5000


def test_step_floors_are_bytes_over_bandwidth():
    import step

    cfg = syn.llama_config("toy", 3)
    # K and V of 3 layers x 4 heads x 64 dims, bf16, for 8 rows of 10 past + 1 new tokens
    assert step.kv_bytes(cfg, 8, 10, torch.bfloat16) == 8 * 11 * 2 * 3 * 4 * 64 * 2
    row = {"variants": 4, "base_ms": {"p50": 2.0}, "delta_ms": {"p50": 6.0}}
    f = step.floors(row, bw=1e9, base_bytes=1_000_000, variant_bytes=250_000, kv=0)
    assert f["base_floor_ms"] == 1.0 and f["delta_floor_ms"] == 2.0
    assert f["base_bytes_efficiency"] == 0.5 and f["delta_bytes_efficiency"] == round(2 / 6, 3)
    assert f["delta_over_scaled_base"] == 1.5  # 6 ms against 2x the bytes of a 2 ms step


def test_replay_counts_requests_past_the_drain_limit_as_unfinished():
    import serve

    class Slow(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            threading.Event().wait(3)
            self.send_response(200)
            self.end_headers()

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Slow)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        trace = [{"at": 0.0, "model": "v00", "prompt": "a"}, {"at": 0.1, "model": "v01", "prompt": "b"}]
        res, _ = asyncio.run(serve.replay(f"http://127.0.0.1:{srv.server_address[1]}", trace, 4, limit=0.5))
    finally:
        srv.shutdown()
    assert [r["status"] for r in res] == [-2, -2]
    s = serve.summarize(res, 0.0, {"ttft": 1.0, "e2e": 1.0})
    assert s["completed"] == 0 and s["unfinished_at_drain_limit"] == 2 and s["refused_or_failed"] == 2


def test_the_memory_poll_sees_a_child_allocation():
    import compress_memory

    got = compress_memory.run_polled([sys.executable, "-c", "import time; b = bytearray(300 * 2**20); time.sleep(0.5)"],
                                     {})
    assert got["rc"] == 0 and got["peak_rss_anon_kib"] >= 300 * 1024
    rows = [{"candidate": "a", "layers": 4, "peak_rss_anon_mib": 100.0, "artifact_bytes": 0, "wall_s": 1.0},
            {"candidate": "a", "layers": 16, "peak_rss_anon_mib": 125.0, "artifact_bytes": 20 * 2**20, "wall_s": 3.0},
            {"candidate": "a", "layers": 32, "extrapolated": "x", "wall_s": 6.0}]
    (f,) = compress_memory.flatness(rows)
    assert f["deep_over_shallow_plus_artifact"] == round(125 / 120, 3) and f["flat"]
    rows += [{"candidate": "a", "layers": 4, "peak_rss_anon_mib": 90.0, "artifact_bytes": 0, "wall_s": 5.0},
             {"candidate": "a", "layers": 4, "peak_rss_anon_mib": 95.0, "artifact_bytes": 0, "wall_s": 2.0}]
    by = {(m["candidate"], m["layers"]): m for m in compress_memory.medians(rows)}
    assert by[("a", 4)] == {"candidate": "a", "layers": 4, "runs": 3, "wall_s": 2.0, "peak_rss_anon_mib": 95.0}
    assert ("a", 32) not in by  # the extrapolated row is not a run
