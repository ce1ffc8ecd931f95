"""Format version 2 as main wrote it at 76f9b76 (tests/fixtures/v2/README.md): the artifacts still
rebuild bit for bit, and compressing the same inputs with the same seed writes the same bytes, apart
from the manifest's ``scheme`` field of each entry."""

import hashlib
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from deltazip.compress.config import CompressConfig
from deltazip.compress.merge import merge_to_dir, reconstruct_state_dict
from deltazip.compress.pipeline import compress_delta
from deltazip.formats.artifact import Artifact
from deltazip.formats.verify import verify_artifact
from deltazip.models.checkpoint import Checkpoint

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "v2"
TAGS = ("llama", "gpt2")
# Fields that name the machine, the clock or the paths the inputs were given by, not the output.
_VOLATILE = {"created", "tool_version"}
_VOLATILE_STATS = {"seconds", "peak_rss_mib"}


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


@pytest.mark.parametrize("tag", TAGS)
def test_a_v2_artifact_merges_bit_for_bit(tmp_path, tag):
    art = Artifact(FIXTURE / f"art-{tag}")
    assert art.manifest["format_version"] == 2
    expected = json.loads((FIXTURE / f"art-{tag}.expected.json").read_text())
    assert {n: e["kind"] for n, e in art.tensors.items()} == expected["kinds"]
    base = Checkpoint(FIXTURE / f"{tag}-base")
    sd = reconstruct_state_dict(art, base)
    assert {n: _sha(t) for n, t in sd.items()} == expected["sha256"]
    assert verify_artifact(art.path, base.fingerprint(), base_dir=base.path)["ok"]
    out = merge_to_dir(art, base, tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(out).state_dict()
    for n, t in sd.items():
        if n in merged:  # a tied name transformers does not keep twice is checked through its twin
            assert torch.equal(merged[n], t), n


def _comparable(manifest: dict) -> dict:
    """The manifest without what names the run rather than the output, and without ``scheme``."""
    m = {k: v for k, v in manifest.items() if k not in _VOLATILE}
    m["lineage"] = {k: v for k, v in m["lineage"].items() if k not in ("base", "finetuned")}
    if m.get("calibration"):
        m["calibration"] = {k: v for k, v in m["calibration"].items() if k != "source"}
    m["stats"] = {k: v for k, v in m["stats"].items() if k not in _VOLATILE_STATS}
    m["tensors"] = {n: {k: v for k, v in e.items() if k != "scheme"} for n, e in m["tensors"].items()}
    return m


@pytest.mark.parametrize("tag", TAGS)
def test_compress_writes_the_bytes_76f9b76_wrote(tmp_path, tag):
    args = json.loads((FIXTURE / f"art-{tag}.args.json").read_text())
    out = tmp_path / "art"
    compress_delta(FIXTURE / f"{tag}-base", FIXTURE / f"{tag}-ft", str(FIXTURE / "calib.jsonl"), out,
                   CompressConfig.from_dict(args["config"]), lossless=args["lossless"])
    got = json.loads((out / "manifest.json").read_text())
    want = json.loads((FIXTURE / f"art-{tag}" / "manifest.json").read_text())
    for m in (got, want):  # compared below, after the header's key order (see _container)
        m["files"] = {rel: info["bytes"] for rel, info in m["files"].items()}
    # the per-layer error figures are diagnostics from fp32 matmuls whose last digits follow the BLAS
    # build's summation order; everything else (and every stored byte, below) must match exactly
    assert _comparable(got) | {"layers": None} == _comparable(want) | {"layers": None}
    g, w = _floats(got["layers"]), _floats(want["layers"])
    assert [x for x in g if not isinstance(x, float)] == [x for x in w if not isinstance(x, float)]
    assert [x for x in g if isinstance(x, float)] == pytest.approx([x for x in w if isinstance(x, float)],
                                                                    rel=1e-5, abs=1e-9)
    for rel in want["files"]:
        assert _container(out / rel) == _container(FIXTURE / f"art-{tag}" / rel), rel


def _floats(tree) -> list:
    """The leaves of a JSON tree in order (numbers as floats; the keys and strings kept)."""
    if isinstance(tree, dict):
        return [x for k in sorted(tree) for x in (k, *_floats(tree[k]))]
    if isinstance(tree, list):
        return [x for v in tree for x in _floats(v)]
    return [float(tree) if isinstance(tree, (int, float)) and not isinstance(tree, bool) else tree]


def _container(path: Path) -> tuple[dict, bytes]:
    """A safetensors file as (header, data bytes): safetensors writes the header's metadata from a
    hash map, so its key order changes from one process to the next; nothing else may."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8:8 + n]), raw[8 + n:]

