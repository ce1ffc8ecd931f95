"""--target-ratio on mixture-of-experts models: expert weights get measured curves and their own
settings like any linear, in both checkpoint layouts (one tensor per expert, and fused ``[E, out, in]``
tensors), and the artifact keeps the budget, verifies and merges to its own reconstruction."""

import pytest
import torch
from _factories import calib_file, make_pair

from deltazip.compress.config import CompressConfig
from deltazip.compress.merge import merge_to_dir
from deltazip.compress.pipeline import compress_delta
from deltazip.formats.artifact import Artifact
from deltazip.formats.verify import verify_artifact
from deltazip.kernels.scheme import DeltaScheme
from deltazip.models.checkpoint import Checkpoint

FAST = dict(nsamples=16, seqlen=48, batch_size=4, device="cpu", group_auto=True)
SKIP = ("norm", "embed", "lm_head")  # linears and experts change: they carry the budget


@pytest.mark.parametrize("arch,fused", [("mixtral", False), ("mixtral", True), ("qwen2_moe", False)],
                         ids=["mixtral-ckpt", "mixtral-fused", "qwen2_moe-ckpt"])
def test_experts_are_allocated_within_the_budget(tmp_path, arch, fused):
    base, ft = make_pair(tmp_path, arch, module_names=fused, skip=SKIP, scale=0.2)
    calib = str(calib_file(tmp_path))
    probe = tmp_path / "uniform"
    compress_delta(base, ft, calib, probe, CompressConfig(scheme=DeltaScheme(), report=True, **FAST))
    uniform = {p["setting"]: p for p in Artifact(probe).manifest["sensitivity"]["uniform"]}
    lo, hi = uniform["4-bit 2:4"]["ratio"], uniform["2-bit 2:4"]["ratio"]
    target = round((lo * hi) ** 0.5, 2)  # between the uniform 4- and 2-bit sizes: settings must mix
    out = tmp_path / "mixed"
    compress_delta(base, ft, calib, out, CompressConfig(scheme=DeltaScheme(), target_ratio=target, **FAST))
    art = Artifact(out)
    rec = art.manifest["allocation"]
    budget = int(art.lineage["finetuned_bytes"] / target)
    assert rec["planned_bytes"] <= budget and 0.99 * budget <= art.nbytes() <= 1.01 * budget, (art.nbytes(), budget)

    experts = {n: t for n, t in rec["tensors"].items() if "experts" in n}
    assert experts, sorted(rec["tensors"])  # every expert weight has a measured curve and a choice
    for name, t in experts.items():
        # drop first: the fewest bytes (its manifest entry) and the most error (the whole delta)
        assert len(t["bytes"]) == len(t["err"]) == 9 and min(t["err"]) >= 0, name
        assert t["bytes"][0] == min(t["bytes"]) and t["err"][0] == max(t["err"]), name
        e = art.entry(name)
        got = "drop" if e.kind == "drop" else f"{e.scheme.bits}-bit {'2:4' if e.scheme.sparse else 'dense'}"
        assert got == t["choice"], name
        if fused:
            assert e.kind == "drop" or e.get("experts") == Checkpoint(base).shape(name)[0], name
    assert len({t["choice"] for t in rec["tensors"].values()}) >= 2

    assert verify_artifact(out, Checkpoint(base).fingerprint(), base_dir=base)["ok"]
    merged = merge_to_dir(art, Checkpoint(base), tmp_path / "merged")
    b, m = Checkpoint(base), Checkpoint(merged)
    for name in experts:
        torch.testing.assert_close(m.get(name), art.reconstruct(name, b.get(name)), rtol=0, atol=0)
