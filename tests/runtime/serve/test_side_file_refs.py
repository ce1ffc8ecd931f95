"""serve and eval find side files an artifact keeps by reference to its base (and refuse a base
whose copy differs), through the same ``VariantInfo.side_dir`` / ``tokenizer_dir``."""

import json
import shutil

import pytest
from _factories import edit_json, make_pair
from transformers import AutoConfig

from deltazip.compress.config import CompressConfig
from deltazip.compress.pipeline import compress_delta
from deltazip.formats.artifact import Artifact
from deltazip.formats.errors import InputError
from deltazip.kernels.scheme import DeltaScheme
from deltazip.runtime.eval.targets import EvalBank, parse_targets
from deltazip.runtime.serve.assembly import _served_entry, _TokenizerPool
from deltazip.runtime.serve.variant_sources import inspect_variant

RTN = CompressConfig(scheme=DeltaScheme(bits=4, group_size=32), method="rtn")


@pytest.fixture(scope="module")
def arts(tmp_path_factory):
    """(base, ft2, artifact referencing every side file, artifact storing a changed generation config)."""
    tmp = tmp_path_factory.mktemp("siderefs")
    base, ft = make_pair(tmp)
    compress_delta(base, ft, None, tmp / "same", RTN)
    ft2 = tmp / "ft2"
    shutil.copytree(ft, ft2)
    edit_json(ft2 / "generation_config.json", eos_token_id=[2, 3])
    edit_json(ft2 / "tokenizer_config.json", model_max_length=64)
    compress_delta(base, ft2, None, tmp / "changed", RTN)
    return base, ft2, tmp / "same", tmp / "changed"


def test_serve_entry_reads_referenced_and_stored_side_files(arts):
    base, ft2, same, changed = arts
    config = AutoConfig.from_pretrained(base)
    pool = _TokenizerPool()
    v = inspect_variant(same)
    assert all(i["source"] == "base" for i in Artifact(same).side_files.values())
    d = v.tokenizer_dir(base)
    assert d != base and (d / "tokenizer.json").read_bytes() == (base / "tokenizer.json").read_bytes()
    sv = _served_entry(pool, v, base, config, "base")
    assert sv.tokenizer("abc")["input_ids"] and sv.eos_ids == [2]
    v2 = inspect_variant(changed)
    sv2 = _served_entry(pool, v2, base, config, "base")
    assert sv2.eos_ids == [2, 3]  # the fine-tune's generation_config.json, stored in hf/
    assert sv2.tokenizer.model_max_length == 64  # its tokenizer_config.json + the base's tokenizer.json
    assert (v2.side_dir(base) / "tokenizer.json").read_bytes() == (base / "tokenizer.json").read_bytes()


def test_serve_and_eval_refuse_a_base_whose_copy_differs(arts, tmp_path):
    base, _, same, _ = arts
    other = tmp_path / "other"
    shutil.copytree(base, other)
    tok = json.loads((other / "tokenizer.json").read_text())
    tok["added_tokens"][0]["content"] = "<PAD>"
    (other / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(InputError) as e:
        _served_entry(_TokenizerPool(), inspect_variant(same), other, AutoConfig.from_pretrained(base), "base")
    assert "\n" not in str(e.value) and "tokenizer.json" in str(e.value) and "pass the right --base" in str(e.value)
    targets = parse_targets([str(same)])
    bank = EvalBank(targets, str(other), device="cpu")  # same weights: the fingerprint matches
    with pytest.raises(InputError, match="tokenizer.json.*pass the right --base"):
        bank.tokenizer_for(targets[0])


def test_eval_tokenizer_comes_from_the_side_files(arts):
    base, _, _, changed = arts
    targets = parse_targets([str(changed)])
    bank = EvalBank(targets, str(base), device="cpu")
    tok = bank.tokenizer_for(targets[0])
    assert tok.model_max_length == 64 and tok("abc")["input_ids"]
