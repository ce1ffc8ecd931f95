"""TensorDedupRegistry and the dedup loader: shared storage, blocked writes, identical outputs."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from deltazip.formats.dedup_scan import ScanConfig, scan_checkpoints
from deltazip.formats.errors import InputError
from deltazip.runtime.share import dedup_registry as dr
from deltazip.runtime.share.dedup_loader import load_model
from deltazip.runtime.share.dedup_registry import (
    ReadOnlyTensor,
    SharedTensorWriteError,
    TensorDedupRegistry,
    get_registry,
)

CHANGED = ("model.layers.1.mlp.down_proj.weight", "model.layers.1.self_attn.o_proj.weight")


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """base (tied embeddings, bf16 like real checkpoints) and ft: base with CHANGED perturbed."""
    root = tmp_path_factory.mktemp("reg")
    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=True)
    torch.manual_seed(0)
    m = LlamaForCausalLM(cfg).to(torch.bfloat16)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "norm" in n:  # all-ones norms would be identical to each other; make them distinct
                p.copy_(1 + 0.1 * torch.randn_like(p))
    base = root / "base"
    m.save_pretrained(base)
    ft = root / "ft"
    m.save_pretrained(ft)
    sd = load_file(ft / "model.safetensors")
    for k in CHANGED:
        sd[k] = sd[k] + 0.25
    save_file(sd, ft / "model.safetensors", metadata={"format": "pt"})
    return {"base": base, "ft": ft}


# --------------------------------------------------------------------------------- the registry

def test_identical_tensors_share_storage():
    reg = TensorDedupRegistry()
    a = torch.randn(64, 64)
    x = reg.register(a)
    y = reg.register(a.clone())
    z = reg.register(a + 1)
    assert x.data_ptr() == y.data_ptr() != z.data_ptr()
    assert isinstance(x, ReadOnlyTensor) and torch.equal(x, a)
    s = reg.stats
    assert (s.registered, s.reused, s.bytes_saved, s.bytes_registered) == (2, 1, a.nbytes, 2 * a.nbytes)
    assert len(reg) == 2


def test_dtype_or_shape_never_shared():
    reg = TensorDedupRegistry()
    a = torch.randn(16, 16)
    ptrs = {reg.register(t).data_ptr() for t in (a, a.view(torch.int32), a.reshape(256), a.reshape(8, 32))}
    assert len(ptrs) == 4 and reg.stats.reused == 0
    h = a.half()
    assert reg.register(h).data_ptr() != reg.register(h.view(torch.bfloat16)).data_ptr()


@pytest.mark.parametrize("write", [
    lambda t: t.add_(1), lambda t: t.copy_(torch.zeros_like(t)), lambda t: t.mul_(2), lambda t: t.zero_(),
    lambda t: t.__setitem__(0, 1.0), lambda t: t.__iadd__(1), lambda t: t[0].add_(1), lambda t: t.view(-1).fill_(0),
    lambda t: t.data.add_(1), lambda t: t.detach().sub_(1), lambda t: t.T.mul_(2), lambda t: t.split(2)[0].zero_(),
    lambda t: torch.add(t, 1, out=t), lambda t: F.relu(t, inplace=True), lambda t: F.relu(t, True),
    lambda t: torch.nn.init.normal_(t), lambda t: t.index_fill_(0, torch.tensor([0]), 0.0),
    lambda t: torch._foreach_add_([t], 1.0),
], ids=["add_", "copy_", "mul_", "zero_", "setitem", "iadd", "view[0].add_", "view.fill_", "data.add_",
        "detach.sub_", "T.mul_", "split.zero_", "out=", "relu_inplace_kw", "relu_inplace_pos", "init.normal_",
        "index_fill_", "foreach_add_"])
def test_in_place_writes_raise(write):
    reg = TensorDedupRegistry()
    src = torch.randn(4, 4)
    t = reg.register(src)
    before = t.clone()
    for grad_mode in (torch.enable_grad, torch.no_grad):
        with grad_mode(), pytest.raises(SharedTensorWriteError, match="read-only"):
            write(t)
    assert torch.equal(t, before)


def test_computations_and_clones_stay_writable():
    reg = TensorDedupRegistry()
    t = reg.register(torch.randn(8, 8))
    for out in (t * 2, t @ t, F.linear(torch.randn(2, 8), t), t.clone(), t.float().exp(), t.sum(0)):
        assert type(out) is torch.Tensor
        out.add_(1)  # private memory: fine
    assert t.numpy().flags.writeable is False
    p = torch.nn.Parameter(t, requires_grad=False)
    assert isinstance(p, torch.nn.Parameter) and p.data_ptr() == t.data_ptr()
    with pytest.raises(SharedTensorWriteError):
        p.mul_(0)


def test_min_tensor_bytes_and_verify_bytes(monkeypatch):
    reg = TensorDedupRegistry(min_tensor_bytes=1024)
    small = torch.randn(8)  # 32 bytes
    x, y = reg.register(small), reg.register(small.clone())  # equal, but below the floor: not shared
    assert x.data_ptr() != y.data_ptr() and type(x) is torch.Tensor and len(reg) == 0
    assert reg.stats.skipped_small == 2 and reg.stats.registered == 0
    x.add_(1)  # private, writable

    # A hash that collides for everything of one shape: only verify_bytes keeps tensors apart.
    monkeypatch.setattr(dr, "hash_bytes", lambda data, algo="xxh3": "0" * 32)
    a, b = torch.randn(16, 16), torch.randn(16, 16)
    blind = TensorDedupRegistry()
    assert blind.register(a).data_ptr() == blind.register(b).data_ptr()  # wrong, as documented
    careful = TensorDedupRegistry(verify_bytes=True)
    ra, rb, ra2 = careful.register(a), careful.register(b), careful.register(a.clone())
    assert torch.equal(ra, a) and torch.equal(rb, b) and ra.data_ptr() == ra2.data_ptr() != rb.data_ptr()
    assert (careful.stats.collisions, careful.stats.registered, careful.stats.reused) == (1, 2, 1)


def test_thread_safe_concurrent_registration():
    reg = TensorDedupRegistry()
    srcs = [torch.randn(256, 256) for _ in range(4)]
    out: list[list[int]] = [[] for _ in range(8)]

    def worker(k):
        for s in srcs * 3:
            out[k].append(reg.register(s.clone()).data_ptr())

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert all(o == out[0] for o in out) and len(set(out[0])) == 4
    s = reg.stats
    assert s.registered == 4 and s.reused == 8 * 12 - 4 and len(reg) == 4


def test_process_wide_registry_is_one_object():
    assert get_registry() is get_registry()


# ------------------------------------------------------------------------------------ the loader

def test_two_models_share_memory_and_match_independent_loads(models):
    reg = TensorDedupRegistry()
    a = load_model(models["base"], registry=reg)
    b = load_model(models["ft"], registry=reg)
    n = len(load_file(models["base"] / "model.safetensors"))
    assert (a.report.tensors, a.report.reused) == (n, 0)
    assert (b.report.tensors, b.report.reused) == (n, n - len(CHANGED))
    assert reg.stats.registered == n + len(CHANGED) and reg.stats.bytes_saved == b.report.reused_bytes

    pa, pb = dict(a.model.named_parameters()), dict(b.model.named_parameters())
    for name in pa:
        same = pa[name].data_ptr() == pb[name].data_ptr()
        assert same == (name not in CHANGED), name
        assert isinstance(pa[name], torch.nn.Parameter) and not pa[name].requires_grad
        assert pa[name].dtype == torch.bfloat16
    assert a.model.lm_head.weight is a.model.model.embed_tokens.weight  # tied, as from_pretrained ties

    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(0))
    for loaded, path in ((a, models["base"]), (b, models["ft"])):
        ref = AutoModelForCausalLM.from_pretrained(path).eval()
        assert ref.dtype == torch.bfloat16
        with torch.no_grad():
            assert torch.equal(loaded.model(ids).logits, ref(ids).logits)
    with pytest.raises(SharedTensorWriteError):
        a.model.model.layers[0].mlp.up_proj.weight.add_(1)
    with pytest.raises(SharedTensorWriteError), torch.no_grad():
        b.model.model.embed_tokens.weight.copy_(torch.zeros(96, 32))


def test_registry_fingerprints_equal_scan_fingerprints(models):
    """Hashes of the loaded tensors' bytes == hashes the scan took from the file bytes."""
    scan = scan_checkpoints([models["base"]], ScanConfig(diff_stats=False))
    ref = AutoModelForCausalLM.from_pretrained(models["base"])
    sd = ref.state_dict()
    reg = TensorDedupRegistry()
    for r in scan.refs:
        assert reg.fingerprint(sd[r.name]) == r.fingerprint


def test_loader_without_dedup_is_private(models):
    reg = TensorDedupRegistry()
    a = load_model(models["base"], registry=reg, dedup=False)
    b = load_model(models["base"], registry=reg, dedup=False)
    assert len(reg) == 0
    wa, wb = a.model.model.layers[0].mlp.up_proj.weight, b.model.model.layers[0].mlp.up_proj.weight
    assert wa.data_ptr() != wb.data_ptr() and torch.equal(wa, wb)
    with torch.no_grad():
        wa.add_(1)  # private copies are ordinary writable parameters


def test_loader_rejects_non_hf_input(tmp_path, models):
    with pytest.raises(InputError, match="no such file"):
        load_model(tmp_path / "nope")
    save_file({"w": torch.ones(2)}, tmp_path / "x.safetensors")
    with pytest.raises(InputError, match="needs a Hugging Face model directory"):
        load_model(tmp_path / "x.safetensors")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((models["base"] / "config.json").read_text())
    save_file({"model.embed_tokens.weight": torch.ones(3, 3, dtype=torch.bfloat16)}, bad / "model.safetensors")
    with pytest.raises(InputError, match=r"shape \[3, 3\].*expects \[96, 32\]"):
        load_model(bad, registry=TensorDedupRegistry())


@pytest.mark.gpu
def test_gpu_dedup_before_device_copy(models):
    reg = TensorDedupRegistry()
    torch.cuda.synchronize()
    a = load_model(models["base"], registry=reg, device="cuda")
    before = torch.cuda.memory_allocated()
    b = load_model(models["base"], registry=reg, device="cuda")
    torch.cuda.synchronize()
    grown = torch.cuda.memory_allocated() - before
    pa, pb = dict(a.model.named_parameters()), dict(b.model.named_parameters())
    assert all(pa[n].is_cuda and pa[n].data_ptr() == pb[n].data_ptr() for n in pa)
    weights = sum(p.numel() * p.element_size() for p in pa.values())
    assert grown < weights / 4  # only the rotary buffers are new; no weight was copied again
    with pytest.raises(SharedTensorWriteError):
        pb["model.layers.0.mlp.up_proj.weight"].mul_(2)
    ids = torch.randint(0, 96, (1, 8), device="cuda")
    with torch.no_grad():
        assert torch.equal(a.model(ids).logits, b.model(ids).logits)
