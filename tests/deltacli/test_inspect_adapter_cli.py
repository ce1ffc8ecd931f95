"""`deltazip inspect` on a PEFT adapter directory: its settings and what it trains from the config and
the safetensors header, and with --base whether the server serves it there (what each part lands on,
the rows a tied lm_head takes) or the server's one-line reason for refusing it."""

from __future__ import annotations

import json

import pytest
import torch
from _cli import run_cli
from _factories import lora_adapter, save_model, tiny_model

from deltazip.models.loader import load_causal_lm

pytest.importorskip("peft")


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    """(tmp, base, adapter): a tied tiny Llama, an adapter of rank 4 on q_proj and v_proj (rank 2 by
    rank_pattern) that trains token rows 5, 7 and 9."""
    tmp = tmp_path_factory.mktemp("inspect_adapter")
    base = save_model(tiny_model("llama", tie_word_embeddings=True), tmp / "base")
    lora_adapter(load_causal_lm(base, torch.float32), tmp / "ad", 3, target_modules=["q_proj", "v_proj"],
                 rank_pattern={"v_proj": 2}, trainable_token_indices=[5, 7, 9])
    return tmp, base, tmp / "ad"


def test_inspect_json_names_what_the_adapter_trains(capsys, monkeypatch, adapter):
    """The JSON counts, ranks and sizes equal the file's by hand; the base check lists where each
    part lands, the tied lm_head taking the embedding's rows."""
    tmp, base, ad = adapter
    code, out, err = run_cli(capsys, monkeypatch, "inspect", ad, "--json", "--base", base)
    assert code == 0, err
    s = json.loads(out)
    layers = 2  # tiny_model's
    assert s["adapted_modules"] == 2 * layers and s["adapted_by_name"] == {"q_proj": layers, "v_proj": layers}
    assert s["ranks_stored"] == [2, 4]
    assert s["factor_weights"] == layers * (4 * 64 + 64 * 4 + 2 * 64 + 32 * 2)  # q: [4, 64] [64, 4]; v: [2, 64] [32, 2]
    assert s["token_rows"] == {"model.embed_tokens": 3} and s["whole_tensors"] == [] and s["refused"] is None
    assert s["bytes_on_disk"] == sum((ad / f).stat().st_size for f in ("adapter_config.json",
                                                                       "adapter_model.safetensors"))
    on = s["on_base"]
    assert on["serves"] and on["architecture"] == "LlamaForCausalLM" and on["linears"] == 2 * layers
    assert on["token_rows"] == {"lm_head": {"rows": 3, "from": "model.embed_tokens"},
                                "model.embed_tokens": {"rows": 3, "from": "model.embed_tokens"}}


def test_inspect_table_and_a_base_the_server_would_refuse(capsys, monkeypatch, adapter):
    """The table names the adapter's parts; on a base of another width the server's reason is shown,
    and the command still succeeds (inspect reports, serve refuses)."""
    tmp, base, ad = adapter
    code, out, _ = run_cli(capsys, monkeypatch, "inspect", ad)
    assert code == 0
    assert "adapted modules: 4 (q_proj x2, v_proj x2)" in out and "token rows: model.embed_tokens: 3" in out
    other = save_model(tiny_model("llama", hidden_size=96), tmp / "wide")
    code, out, _ = run_cli(capsys, monkeypatch, "inspect", ad, "--base", other, "--json")
    on = json.loads(out)["on_base"]
    assert code == 0 and not on["serves"]
    assert "whose weights differ from the served base" in on["why"] and "\n" not in on["why"]


def test_inspect_refuses_a_plot_of_an_adapter_and_an_unreadable_one_in_one_line(capsys, monkeypatch, adapter):
    tmp, _, ad = adapter
    code, _, err = run_cli(capsys, monkeypatch, "inspect", ad, "--plot", tmp / "p.png")
    assert code == 1 and "is a PEFT adapter: drop --plot" in err and not (tmp / "p.png").exists()
    broken = tmp / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text("{not json")
    code, _, err = run_cli(capsys, monkeypatch, "inspect", broken)
    assert code == 1 and "cannot read adapter_config.json" in err and len(err.strip().splitlines()) == 1
