"""Issue 26 on the demo pair: at the size of the uniform 2-bit 2:4 artifact, the per-tensor allocation
(--max-bytes of that size) answers at least as accurately as the uniform 4-bit 2:4 artifact, and its
answer loss is no worse than the uniform 2-bit one's."""

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from deltazip.compress.config import CompressConfig
from deltazip.compress.merge import load_merged_model
from deltazip.compress.pipeline import compress_delta
from deltazip.demo.pair import make_demo_pair
from deltazip.demo.run import ALL_WINDOWS, _evaluate
from deltazip.formats.artifact import Artifact
from deltazip.kernels.scheme import DeltaScheme
from deltazip.models.checkpoint import Checkpoint


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: one thread is as fast on a shared 2-core machine
    try:
        yield make_demo_pair(tmp_path_factory.mktemp("demo26"), seed=0)
    finally:
        torch.set_num_threads(threads)


def _score(pair, art: Path, tok, rows) -> dict:
    model = load_merged_model(Artifact(art), Checkpoint(pair.base_dir))
    return _evaluate(model, tok, rows)


def test_allocation_at_the_2bit_size_is_as_accurate_as_4bit(pair, tmp_path):
    tok = AutoTokenizer.from_pretrained(pair.finetuned_dir)
    rows = [json.loads(x) for x in Path(pair.eval_path).read_text().splitlines() if x.strip()]
    common = dict(nsamples=ALL_WINDOWS, seqlen=64, device="cpu", group_auto=True)
    scores, sizes = {}, {}
    for name, cfg in (("4-bit", CompressConfig(scheme=DeltaScheme(bits=4), **common)),
                      ("2-bit", CompressConfig(scheme=DeltaScheme(bits=2), **common))):
        compress_delta(pair.base_dir, pair.finetuned_dir, str(pair.calib_path), tmp_path / name, cfg)
        sizes[name] = Artifact(tmp_path / name).nbytes()
        scores[name] = _score(pair, tmp_path / name, tok, rows)
    cfg = CompressConfig(scheme=DeltaScheme(), max_bytes=sizes["2-bit"], **common)
    compress_delta(pair.base_dir, pair.finetuned_dir, str(pair.calib_path), tmp_path / "alloc", cfg)
    got = _score(pair, tmp_path / "alloc", tok, rows)
    assert Artifact(tmp_path / "alloc").nbytes() <= 1.01 * sizes["2-bit"]
    assert got["accuracy"] >= scores["4-bit"]["accuracy"], (got, scores)
    assert got["answer_loss"] <= scores["2-bit"]["answer_loss"], (got, scores)
