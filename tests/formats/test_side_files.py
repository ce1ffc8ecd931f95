"""Side files by reference: a fine-tune's config/tokenizer file identical to the base's is not stored;
merge, verify and pack/unpack find it in the base (checked), and an artifact without ``side_files``
reads as before."""

import json
import shutil
from pathlib import Path

import pytest
from _factories import edit_json, make_pair
from transformers import AutoTokenizer

from deltazip.compress.config import CompressConfig
from deltazip.compress.merge import merge_to_dir
from deltazip.compress.pipeline import compress_delta
from deltazip.formats.artifact import MANIFEST, Artifact, repack
from deltazip.formats.checksum import sha256_file
from deltazip.formats.errors import ArtifactError, InputError
from deltazip.formats.side_files import materialize_side_files
from deltazip.formats.verify import verify_artifact
from deltazip.kernels.scheme import DeltaScheme
from deltazip.models.checkpoint import Checkpoint

RTN = CompressConfig(scheme=DeltaScheme(bits=4, group_size=32), method="rtn")
FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "v1"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(tmp, base, ft with the base's tokenizer and config, artifact of it)."""
    tmp = tmp_path_factory.mktemp("side")
    base, ft = make_pair(tmp)
    art = compress_delta(base, ft, None, tmp / "art", RTN)["artifact"]
    return tmp, base, ft, Path(art)


@pytest.fixture(scope="module")
def changed(pair):
    """An artifact of a fine-tune whose config and tokenizer_config differ from the base's."""
    tmp, base, ft, _ = pair
    ft2 = tmp / "ft2"
    shutil.copytree(ft, ft2)
    edit_json(ft2 / "config.json", finetuning_task="tiny")
    edit_json(ft2 / "tokenizer_config.json", model_max_length=64)
    compress_delta(base, ft2, None, tmp / "art2", RTN)
    return ft2, tmp / "art2"


def _other_base(pair, tmp_path):
    """A copy of the base whose tokenizer.json differs (same weights, so the fingerprint matches)."""
    _, base, _, _ = pair
    other = tmp_path / "other-base"
    shutil.copytree(base, other)
    tok = json.loads((other / "tokenizer.json").read_text())
    tok["added_tokens"][0]["content"] = "<PAD>"
    (other / "tokenizer.json").write_text(json.dumps(tok))
    return other


def test_identical_side_files_are_referenced_not_stored(pair):
    tmp, base, ft, art = pair
    a = Artifact(art)
    m = json.loads((art / MANIFEST).read_text())
    names = sorted(p.name for p in Checkpoint(ft).side_files())
    assert "tokenizer.json" in names and "config.json" in names
    assert sorted(m["side_files"]) == names
    for n in names:
        assert m["side_files"][n] == {"sha256": sha256_file(base / n), "bytes": (base / n).stat().st_size,
                                      "source": "base"}
    assert not (art / "hf").exists() and not any(f.startswith("hf/") for f in m["files"])
    assert a.side_files == m["side_files"]
    # The ratio counts the artifact directory: no tokenizer bytes in it.
    assert a.nbytes() == sum(p.stat().st_size for p in art.rglob("*") if p.is_file())
    assert not any(p.name == "tokenizer.json" for p in art.rglob("*"))


def test_merge_takes_referenced_files_from_the_base(pair, tmp_path):
    _, base, ft, art = pair
    out = merge_to_dir(Artifact(art), Checkpoint(base), tmp_path / "merged")
    for n in ("tokenizer.json", "tokenizer_config.json", "config.json", "generation_config.json"):
        assert (out / n).read_bytes() == (base / n).read_bytes() == (ft / n).read_bytes(), n
    tok = AutoTokenizer.from_pretrained(out)
    assert tok("abc")["input_ids"] == AutoTokenizer.from_pretrained(ft)("abc")["input_ids"]


def test_side_file_dir_holds_every_side_file(pair):
    _, base, ft, art = pair
    d = Artifact(art).side_file_dir(base)
    assert d != base and not d.is_relative_to(art)
    assert sorted(p.name for p in d.iterdir()) == sorted(p.name for p in Checkpoint(ft).side_files())
    assert (d / "tokenizer.json").read_bytes() == (base / "tokenizer.json").read_bytes()
    assert Artifact(art).side_file_dir(base) == d  # the same side files share one directory


def test_changed_side_files_are_copied(pair, changed, tmp_path):
    _, base, _, _ = pair
    ft2, art2 = changed
    a = Artifact(art2)
    src = {n: i["source"] for n, i in a.side_files.items()}
    assert src["config.json"] == src["tokenizer_config.json"] == "artifact"
    assert src["tokenizer.json"] == src["generation_config.json"] == "base"
    assert sorted(p.name for p in (art2 / "hf").iterdir()) == ["config.json", "tokenizer_config.json"]
    for n in ("config.json", "tokenizer_config.json"):
        assert a.manifest["files"][f"hf/{n}"]["sha256"] == a.side_files[n]["sha256"] == sha256_file(ft2 / n)
    out = merge_to_dir(a, Checkpoint(base), tmp_path / "merged")
    for n in ("config.json", "tokenizer_config.json", "tokenizer.json", "generation_config.json"):
        assert (out / n).read_bytes() == (ft2 / n).read_bytes(), n
    assert AutoTokenizer.from_pretrained(out).model_max_length == 64
    d = a.side_file_dir(base)
    assert (d / "config.json").read_bytes() == (ft2 / "config.json").read_bytes()
    assert (d / "tokenizer.json").read_bytes() == (base / "tokenizer.json").read_bytes()


def test_referenced_file_that_differs_in_the_base_is_one_line_error(pair, tmp_path):
    _, _, _, art = pair
    other = _other_base(pair, tmp_path)
    a = Artifact(art)
    for call in (lambda: merge_to_dir(a, Checkpoint(other), tmp_path / "m"),
                 lambda: a.side_file_dir(other),
                 lambda: materialize_side_files(a, other, tmp_path / "x")):
        with pytest.raises(InputError) as e:
            call()
        msg = str(e.value)
        assert "\n" not in msg and str(other / "tokenizer.json") in msg and "pass the right --base" in msg, msg
    assert not (tmp_path / "m").exists()
    (other / "tokenizer.json").unlink()
    with pytest.raises(InputError, match="tokenizer.json.*is missing; pass the right --base"):
        a.side_file_dir(other)
    with pytest.raises(InputError, match="kept by reference to the base model; pass --base"):
        a.side_file_dir(None)


def test_verify_checks_references_against_a_base(pair, tmp_path):
    _, base, _, art = pair
    r = verify_artifact(art, base_dir=base)
    assert r["ok"] and r["checked"]["side_files_referenced"] == len(Artifact(art).side_files), r
    r = verify_artifact(art)
    assert r["ok"] and any("not checked; pass --base" in w for w in r["warnings"]), r
    r = verify_artifact(art, base_dir=_other_base(pair, tmp_path))
    assert not r["ok"] and len(r["problems"]) == 1
    assert "tokenizer.json" in r["problems"][0] and "pass the right --base" in r["problems"][0]


@pytest.mark.parametrize("which", ["pair", "changed"])
def test_pack_unpack_keep_references(pair, changed, tmp_path, which):
    _, base, _, art = pair
    if which == "changed":
        art = changed[1]
    before = Artifact(art).side_files
    packed, unpacked = tmp_path / "packed", tmp_path / "unpacked"
    repack(art, packed, lossless="gdeflate", level=1)
    repack(packed, unpacked, lossless="none")
    for p in (packed, unpacked):
        a = Artifact(p)
        assert a.side_files == before
        assert sorted(f for f in a.manifest["files"] if f.startswith("hf/")) == \
            sorted(f"hf/{n}" for n, i in before.items() if i["source"] == "artifact")
        r = verify_artifact(p, base_dir=base)
        assert r["ok"], r["problems"]
        assert r["checked"]["side_files_referenced"] == sum(i["source"] == "base" for i in before.values())
    for n in before:
        assert (a.side_file_dir(base) / n).read_bytes() == (Artifact(art).side_file_dir(base) / n).read_bytes()


def test_inconsistent_side_files_are_refused(pair, tmp_path):
    import hashlib

    _, base, _, art = pair
    a = tmp_path / "a"
    shutil.copytree(art, a)
    m = json.loads((a / MANIFEST).read_text())
    m["side_files"]["tokenizer.json"]["source"] = "artifact"  # claims to be stored, but hf/ lacks it
    m["side_files"]["config.json"] = {"sha256": "sha256:00", "bytes": 1, "source": "elsewhere"}
    m["side_files"]["../escape.json"] = {"sha256": "sha256:00", "bytes": 1, "source": "base"}
    text = json.dumps(m).encode()
    (a / MANIFEST).write_bytes(text)
    (a / "manifest.sha256").write_text(f"sha256:{hashlib.sha256(text).hexdigest()}\n")
    with pytest.raises(ArtifactError, match="side file"):
        Artifact(a)
    probs = "\n".join(verify_artifact(a, base_dir=base)["problems"])
    assert "'tokenizer.json' is stored in the artifact" in probs and "'config.json': needs" in probs
    assert "'../escape.json': not a relative file name" in probs


def test_artifact_without_side_files_reads_as_before(tmp_path):
    """The format-v1 fixture predates ``side_files``: its hf/ holds every side file."""
    src = FIXTURE / "art-deltazip"
    a = Artifact(src)
    assert "side_files" not in a.manifest
    assert set(a.side_files) == {p.name for p in (src / "hf").iterdir()}
    assert all(i["source"] == "artifact" for i in a.side_files.values())
    assert a.side_file_dir(None) == src / "hf"
    out = merge_to_dir(a, Checkpoint(FIXTURE / "base"), tmp_path / "merged")
    for p in (src / "hf").iterdir():
        assert (out / p.name).read_bytes() == p.read_bytes()
    # Repacked, the artifact still stores them all (now listed in side_files as "artifact").
    shutil.copytree(src, tmp_path / "copy")
    repack(tmp_path / "copy", tmp_path / "re", lossless="gdeflate", level=1)
    r = Artifact(tmp_path / "re")
    assert r.side_files == a.side_files and r.side_file_dir(None) == tmp_path / "re" / "hf"
