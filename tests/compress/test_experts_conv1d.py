"""ΔCompress of GPT-2's Conv1D linears and of mixture-of-experts weights (Mixtral, Qwen2-MoE, GPT-OSS,
whose fused experts are stored ``[E, in, out]`` and applied as ``x @ W``, and Llama 4, stored so too and
run by ``torch.bmm`` over every token scaled by its routing weight).

Two checkpoint layouts of the same transformers 5 MoE models are covered: what ``save_pretrained``
writes (one ``[out, in]`` tensor per expert and projection under the historical names, which the
loader fuses) and the module state dict as it is (fused ``[E, out, in]`` expert tensors).
"""

import hashlib
import json
import re

import pytest
import torch
import torch.nn.functional as F
from _factories import calib_file, make_pair
from transformers import AutoModelForCausalLM, AutoTokenizer

from deltazip.compress.config import CompressConfig
from deltazip.compress.experts import NO_TOKENS
from deltazip.compress.merge import load_merged_model, merge_to_dir, reconstruct_state_dict
from deltazip.compress.obs import rtn_compress
from deltazip.compress.pipeline import compress_delta
from deltazip.formats.artifact import Artifact
from deltazip.formats.errors import ArtifactError, InputError
from deltazip.formats.verify import verify_artifact
from deltazip.kernels.reference import delta_weight
from deltazip.kernels.scheme import DeltaScheme
from deltazip.models.checkpoint import Checkpoint

CFG = dict(scheme=DeltaScheme(group_size=32), nsamples=16, seqlen=48, batch_size=4)
# Only linears and experts change: the logit margin then measures the packed deltas alone.
SKIP = ("norm", "ln_", "embed", "wte", "wpe", "lm_head", "bias")
ROUTER = re.compile(r"\.(gate|router)\.weight$")  # the MoE router (not shared_expert_gate)

# arch, fused (module-name checkpoint), packed entries per layer
CASES = [("gpt2", False, 4), ("mixtral", False, 4 + 4 * 3), ("mixtral", True, 4 + 2),
         ("qwen2_moe", False, 4 + 4 + 4 * 3), ("qwen2_moe", True, 4 + 4 + 2), ("gpt_oss", False, 4 + 2),
         ("llama4", False, 4 + 3 + 2)]


def _heldout_ids(ft_dir, tmp):
    tok = AutoTokenizer.from_pretrained(ft_dir)
    lines = [json.loads(x)["text"] for x in calib_file(tmp / "heldout", n=40, seed=123).read_text().splitlines()]
    ids = tok(" ".join(lines))["input_ids"][:160]
    return torch.tensor(ids).reshape(4, 40)


def _rel(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("arch,fused,per_layer", CASES, ids=[f"{a}-{'fused' if f else 'ckpt'}" for a, f, _ in CASES])
def test_linears_and_experts_are_packed_and_beat_the_base(tmp_path, arch, fused, per_layer):
    base, ft = make_pair(tmp_path, arch, module_names=fused, skip=SKIP)
    art_dir = tmp_path / "art"
    compress_delta(base, ft, str(calib_file(tmp_path)), art_dir, CompressConfig(method="deltazip", **CFG))
    art = Artifact(art_dir)
    assert verify_artifact(art_dir)["ok"]
    bck = Checkpoint(base)
    packed = {n: e for n, e in art.tensors.items() if e["kind"] == "packed"}
    assert len(packed) == 2 * per_layer
    for n, e in art.tensors.items():
        weight = (bck.shape(n) and len(bck.shape(n)) >= 2 and (".h." in n or ".layers." in n)
                  and not n.endswith("bias"))  # GPT-OSS's expert biases are [E, out]
        if weight and not ROUTER.search(n):
            assert e["kind"] == "packed", f"{n} is {e['kind']}"
        elif ROUTER.search(n):
            assert e["kind"] != "packed", "routers are stored exactly"
    for n, e in packed.items():
        b = bck.get(n)
        rec = art.reconstruct(n, b)
        assert rec.shape == b.shape and rec.dtype == b.dtype
        d = delta_weight(art.packed(n))
        if arch == "gpt2":  # Conv1D: stored [in, out], packed [out, in]
            assert e["transposed"] is True and e["shape"] == [b.shape[1], b.shape[0]]
            torch.testing.assert_close(rec - b, d.t(), rtol=0, atol=1e-6)
        elif e.get("experts") and e.get("transposed"):  # GPT-OSS, Llama 4: stored [E, in, out], packed [E, out, in]
            assert b.dim() == 3 and e["experts"] == b.shape[0] and e["shape"] == [b.shape[0], b.shape[2], b.shape[1]]
            torch.testing.assert_close(rec - b, d.reshape(e["shape"]).transpose(1, 2), rtol=0, atol=1e-6)
            stats = next(L["tensors"][n] for L in art.manifest["layers"] if n in L["tensors"])
            assert len(stats["expert_tokens"]) == e["experts"] and sum(stats["expert_tokens"]) > 0
        elif e.get("experts"):  # fused experts: [E, out, in], rows of the E experts stacked
            assert b.dim() == 3 and e["experts"] == b.shape[0] and e["shape"] == list(b.shape)
            torch.testing.assert_close(rec - b, d.reshape(b.shape), rtol=0, atol=1e-6)
            stats = next(L["tensors"][n] for L in art.manifest["layers"] if n in L["tensors"])
            assert len(stats["expert_tokens"]) == e["experts"] and sum(stats["expert_tokens"]) > 0
        else:
            assert "transposed" not in e and "experts" not in e and e["shape"] == list(b.shape)
    if arch != "gpt2":
        stats = {n: t for L in art.manifest["layers"] for n, t in L["tensors"].items()}
        down = [t for n, t in stats.items() if "down_proj" in n or ".w2." in n]
        routed = [x for t in down for x in (t.get("expert_tokens") or [t.get("tokens")]) if x is not None]
        # top-2 of 4 experts: every calibration token reaches two experts of each layer
        assert sum(routed) == 2 * 2 * CFG["nsamples"] * CFG["seqlen"]

    # merge: a plain checkpoint with the fine-tune's tensor names that transformers loads
    out = merge_to_dir(art, bck, tmp_path / "merged")
    merged = Checkpoint(out)
    sd = reconstruct_state_dict(art, bck)
    assert set(merged.names) == set(sd)
    for n, t in sd.items():
        assert torch.equal(merged.get(n), t), n

    ids = _heldout_ids(ft, tmp_path)
    with torch.no_grad():
        lb = AutoModelForCausalLM.from_pretrained(base).eval()(input_ids=ids).logits
        lf = AutoModelForCausalLM.from_pretrained(ft).eval()(input_ids=ids).logits
        lc = load_merged_model(art, bck)(input_ids=ids).logits
    err_c, err_b = _rel(lc, lf), _rel(lb, lf)
    print(f"{arch} fused={fused}: rel logit err compressed {err_c:.4f}, base {err_b:.4f}, ratio {err_c / err_b:.3f}")
    assert err_c < 0.5 * err_b


def _router_without(expert):
    """A Mixtral router forward that never picks ``expert`` (its logit forced to -inf)."""

    def forward(self, hidden_states):
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        logits = F.linear(hidden_states, self.weight)
        logits[:, expert] = float("-inf")
        probs = torch.softmax(logits.float(), dim=-1)
        top, idx = torch.topk(probs, self.top_k, dim=-1)
        return logits, top / top.sum(dim=-1, keepdim=True), idx

    return forward


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "ckpt"])
def test_expert_without_routed_tokens_gets_rtn_flagged(tmp_path, monkeypatch, fused):
    from transformers.models.mixtral import modeling_mixtral

    base, ft = make_pair(tmp_path, "mixtral", module_names=fused, skip=SKIP)
    monkeypatch.setattr(modeling_mixtral.MixtralTopKRouter, "forward", _router_without(3))
    art_dir = tmp_path / "art"
    compress_delta(base, ft, str(calib_file(tmp_path)), art_dir, CompressConfig(method="deltazip", **CFG))
    monkeypatch.undo()
    art = Artifact(art_dir)
    assert verify_artifact(art_dir)["ok"]
    stats = {n: t for L in art.manifest["layers"] for n, t in L["tensors"].items()}
    bck, fck = Checkpoint(base), Checkpoint(ft)
    flagged = 0
    for n, t in stats.items():
        if fused and ".experts." in n:
            assert t["expert_tokens"][3] == 0 and min(t["expert_tokens"][:3]) > 0
            assert t["calibration"] == NO_TOKENS and t["rtn_experts"] == [3]
            delta = (fck.get(n) - bck.get(n))[3]
            got = delta_weight(art.packed(n)).reshape(fck.shape(n))[3]
        elif ".experts.3." in n:
            assert t["tokens"] == 0 and t["calibration"] == NO_TOKENS
            delta = fck.get(n) - bck.get(n)
            got = delta_weight(art.packed(n))
        else:
            assert "calibration" not in t and t.get("tokens", 1) > 0
            continue
        flagged += 1
        want = rtn_compress(delta.float(), DeltaScheme(bits=4, group_size=CFG["scheme"].group_size)).values
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)  # exactly the RTN fallback
    assert flagged == (2 * 2 if fused else 2 * 3)


def _rewrite_manifest(path, edit):
    """Edit manifest.json and keep manifest.sha256 consistent, so only the edit is wrong."""
    m = json.loads((path / "manifest.json").read_text())
    edit(m)
    text = json.dumps(m, indent=1).encode()
    (path / "manifest.json").write_bytes(text)
    (path / "manifest.sha256").write_text(f"sha256:{hashlib.sha256(text).hexdigest()}\n")


@pytest.mark.parametrize("arch,field,bad,why", [
    ("gpt2", "transposed", "yes", "'transposed' must be true or false"),
    ("mixtral", "experts", 3, "'experts' 3 does not match shape"),
    ("mixtral", "experts", None, "expected \\[out, in\\] \\(or \\[E, out, in\\] with 'experts'\\)"),
])
def test_orientation_fields_are_checked(tmp_path, arch, field, bad, why):
    base, ft = make_pair(tmp_path, arch, module_names=arch != "gpt2")  # fused expert tensors
    art_dir = tmp_path / "art"
    compress_delta(base, ft, None, art_dir, CompressConfig(scheme=DeltaScheme(group_size=32), method="rtn"))
    assert verify_artifact(art_dir)["ok"]
    victim = next(n for n, e in Artifact(art_dir).tensors.items() if e.get(field))

    def edit(m):
        if bad is None:
            del m["tensors"][victim][field]
        else:
            m["tensors"][victim][field] = bad

    _rewrite_manifest(art_dir, edit)
    r = verify_artifact(art_dir)
    assert not r["ok"] and any(victim in p and re.search(why, p) for p in r["problems"]), r["problems"]
    with pytest.raises(ArtifactError, match=why):
        Artifact(art_dir)


def test_a_missing_expert_tensor_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    base, ft = make_pair(tmp_path, "mixtral")
    gone = "model.layers.1.block_sparse_moe.experts.2.w3.weight"
    for d in (base, ft):
        sd = load_file(d / "model.safetensors")
        del sd[gone]
        save_file(sd, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(InputError, match=r"model\.layers\.1\.mlp\.experts\.gate_up_proj \[4, 128, 64\].*not"):
        compress_delta(base, ft, str(calib_file(tmp_path)), tmp_path / "art", CompressConfig(**CFG))
    assert not (tmp_path / "art").exists()


# -- per-expert nn.Linear modules (an experts ModuleList) ------------------------------------------
# transformers 5 has no such architecture left (its MoE models fuse their experts), so a tiny one is
# registered here: Mixtral with its MoE block replaced by an nn.Linear router and a ModuleList of
# w1/w3/w2 nn.Linear experts; checkpoint names are module names.


class _ExpertMLP(torch.nn.Module):
    def __init__(self, config):
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.w1 = torch.nn.Linear(h, i, bias=False)
        self.w3 = torch.nn.Linear(h, i, bias=False)
        self.w2 = torch.nn.Linear(i, h, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class _ListMoe(torch.nn.Module):
    never: int | None = None  # tests set it to keep one expert from ever being chosen

    def __init__(self, config):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.gate = torch.nn.Linear(config.hidden_size, config.num_local_experts, bias=False)
        self.experts = torch.nn.ModuleList(_ExpertMLP(config) for _ in range(config.num_local_experts))

    def forward(self, h):
        x = h.reshape(-1, h.shape[-1])
        logits = self.gate(x).float()
        if self.never is not None:
            logits[:, self.never] = float("-inf")
        w, idx = torch.topk(torch.softmax(logits, dim=-1), self.top_k, dim=-1)
        w = (w / w.sum(dim=-1, keepdim=True)).to(x.dtype)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            tok, pos = torch.where(idx == e)
            if tok.numel():
                out.index_add_(0, tok, expert(x[tok]) * w[tok, pos, None])
        return out.reshape(h.shape)


def _list_moe_pair(tmp):
    from transformers import AutoConfig, MixtralConfig, MixtralForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    class ListMoeConfig(MixtralConfig):
        model_type = "deltazip_list_moe"

    class ListMoeForCausalLM(MixtralForCausalLM):
        config_class = ListMoeConfig

        def __init__(self, config):
            super().__init__(config)
            for layer in self.model.layers:
                layer.mlp = _ListMoe(config)
            self.post_init()

    if "deltazip_list_moe" not in CONFIG_MAPPING:
        AutoConfig.register("deltazip_list_moe", ListMoeConfig)
        AutoModelForCausalLM.register(ListMoeConfig, ListMoeForCausalLM)
    from _factories import ARCH_CONFIGS

    ARCH_CONFIGS.setdefault("list_moe", {**ARCH_CONFIGS["mixtral"], "model_type": "deltazip_list_moe"})
    return make_pair(tmp, "list_moe", skip=SKIP)


def test_per_expert_linear_modules(tmp_path, monkeypatch):
    base, ft = _list_moe_pair(tmp_path)
    assert "model.layers.0.mlp.experts.2.w3.weight" in Checkpoint(ft).names  # module names on disk
    monkeypatch.setattr(_ListMoe, "never", 1)
    art_dir = tmp_path / "art"
    compress_delta(base, ft, str(calib_file(tmp_path)), art_dir, CompressConfig(method="deltazip", **CFG))
    monkeypatch.undo()
    art = Artifact(art_dir)
    assert verify_artifact(art_dir)["ok"]
    packed = {n for n, e in art.tensors.items() if e["kind"] == "packed"}
    assert len(packed) == 2 * (4 + 4 * 3)  # attention + every expert's w1/w3/w2; the router is not packed
    assert art.tensors["model.layers.0.mlp.gate.weight"]["kind"] != "packed"
    stats = {n: t for L in art.manifest["layers"] for n, t in L["tensors"].items()}
    for n, t in stats.items():
        if ".experts.1." in n:
            assert t["tokens"] == 0 and t["calibration"] == NO_TOKENS
        elif ".experts." in n:
            assert t["tokens"] > 0 and "calibration" not in t
    assert sum(t["tokens"] for n, t in stats.items() if ".w2." in n) == 2 * 2 * CFG["nsamples"] * CFG["seqlen"]
    ids = _heldout_ids(ft, tmp_path)
    with torch.no_grad():
        lb = AutoModelForCausalLM.from_pretrained(base).eval()(input_ids=ids).logits
        lf = AutoModelForCausalLM.from_pretrained(ft).eval()(input_ids=ids).logits
        lc = load_merged_model(art, Checkpoint(base))(input_ids=ids).logits
    err_c, err_b = _rel(lc, lf), _rel(lb, lf)
    print(f"per-expert nn.Linear: rel logit err compressed {err_c:.4f}, base {err_b:.4f}, ratio {err_c / err_b:.3f}")
    assert err_c < 0.5 * err_b
