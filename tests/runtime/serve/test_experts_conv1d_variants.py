"""Mixture-of-experts artifacts: refused in delta mode with one line naming the tensor and
``--mode swap``; served in swap mode (through merge) with the merged model's logits. (GPT-2's Conv1D
is served in delta mode: tests/runtime/serve/test_arch_params.py.)"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from _factories import make_pair
from _serving import single_thread

from deltazip.compress.checkpoint import Checkpoint
from deltazip.compress.config import CompressConfig
from deltazip.compress.merge import load_merged_model
from deltazip.compress.pipeline import compress_delta
from deltazip.formats.artifact import Artifact
from deltazip.runtime.serve.model import DeltaModel, SwapModels, UnsupportedVariant, discover_artifacts

# the first tensor refused names the reason: a per-expert checkpoint name that
# is no module parameter, the router or a fused expert tensor
CASES = [("mixtral", False, "not a parameter|TopKRouter"), ("mixtral", True, "fused mixture-of-experts|TopKRouter")]


@pytest.mark.parametrize("arch,fused,why", CASES, ids=["mixtral-ckpt", "mixtral-fused"])
def test_refused_in_delta_mode_and_served_in_swap_mode(tmp_path, arch, fused, why):
    cpu = torch.device("cpu")
    with single_thread():
        base, ft = make_pair(tmp_path, arch, module_names=fused)
        cfg = CompressConfig(method="rtn", group_size=32, device="cpu")  # packed entries, no calibration needed
        compress_delta(base, ft, None, tmp_path / "arts" / arch, cfg)
        (v,) = discover_artifacts(tmp_path / "arts")
        ck = Checkpoint(base)
        with pytest.raises(UnsupportedVariant, match="--mode swap") as err:
            DeltaModel(ck, [v], num_slots=1, device=cpu, dtype=torch.float32)
        msg = str(err.value)
        assert "\n" not in msg and re.search(why, msg) and v.name in msg
        # the packed entries themselves, alone, are refused for what they are
        for name, e in v.tensors.items():
            if e.get("experts"):
                alone = dataclasses.replace(v, tensors={name: e})
                what = "fused mixture-of-experts tensor"
                with pytest.raises(UnsupportedVariant, match=f"{re.escape(name)} is a {what}.*--mode swap"):
                    DeltaModel(ck, [alone], num_slots=1, device=cpu, dtype=torch.float32)

        swap = SwapModels(ck, [v], num_slots=1, device=cpu, dtype=torch.float32, base_name="base")
        swap.write_slot(0, v.name, swap.load_host(v.name))
        merged = load_merged_model(Artifact(v.path), ck)
        ids = torch.randint(4, 51, (2, 24), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            got, want = swap.models[0](input_ids=ids).logits, merged(input_ids=ids).logits
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
