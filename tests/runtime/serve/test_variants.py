"""Serving beyond artifacts: full checkpoints and LoRA adapters as variants, tensor dedup in the
runtime, and live variant management over HTTP (a real server on a loopback port)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import shutil
import threading

import httpx
import pytest
import torch
from _factories import lora_adapter, perturb, tiny_model
from _serving import PROMPTS, served_set, single_thread

from deltazip.formats.errors import InputError
from deltazip.runtime.serve.assembly import ServeConfig, build_runtime
from deltazip.runtime.serve.server import Metrics, ServerThread, create_app

peft = pytest.importorskip("peft")
openai = pytest.importorskip("openai")

KEY = "sk-variants"
BASE = "tiny-base"
IDS = dict(vocab_size=128, bos_token_id=0, eos_token_id=1, pad_token_id=2)
LORA_TARGETS = ["q_proj", "v_proj", "o_proj", "down_proj"]


# --------------------------------------------------------------------------------------------------
# Fixtures: the variants, and their reference models
# --------------------------------------------------------------------------------------------------


def save_full(model, tok_src, out):
    model.save_pretrained(out, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tok_src / f).is_file():
            shutil.copy(tok_src / f, out / f)
    return out


def make_adapter(base_dir, out, seed, **cfg):
    """A PEFT LoRA adapter on the tiny base with random (non-zero) factors, saved as safetensors."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    lora_adapter(model, out, seed, **{"target_modules": LORA_TARGETS, **cfg})
    return out


class Fleet:
    """Base + artifact ``alpha`` + full checkpoints ``copy`` (bit-identical to the base), ``frozen``
    (a full fine-tune with frozen embeddings and norms), ``frozen-ab`` (an A/B copy of it) + a LoRA
    adapter ``lora`` (with a rank/alpha pattern), under one served directory."""

    def __init__(self, root, served):
        self.served, self.root = served, root
        self.arts = root / "fleet"
        self.spare = root / "spare"  # variants copied into the served directory during tests
        self.arts.mkdir(parents=True)
        self.spare.mkdir()
        shutil.copytree(served.artifacts / "alpha", self.arts / "alpha")
        shutil.copytree(served.base_dir, self.arts / "copy")
        ft = perturb(tiny_model("llama", **IDS), scale=0.3, seed=21, skip=("norm", "embed_tokens"))
        save_full(ft, served.base_dir, self.arts / "frozen")
        shutil.copytree(self.arts / "frozen", self.arts / "frozen-ab")
        make_adapter(served.base_dir, self.arts / "lora", seed=5, rank_pattern={"o_proj": 2},
                     alpha_pattern={"o_proj": 3})
        make_adapter(served.base_dir, self.spare / "lora-live", seed=6, r=8, lora_alpha=16, use_rslora=True)
        self._models = {}

    def model(self, name):
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        if name not in self._models:
            if name in ("base", BASE, "copy"):
                m = self.served.model("base")
            elif name == "alpha":
                m = self.served.model("alpha")
            elif name in ("frozen", "frozen-ab"):
                m = AutoModelForCausalLM.from_pretrained(self.arts / name, dtype=torch.float32).eval()
            else:
                src = self.arts / name if (self.arts / name).is_dir() else self.spare / name
                b = AutoModelForCausalLM.from_pretrained(self.served.base_dir, dtype=torch.float32)
                m = PeftModel.from_pretrained(b, src).merge_and_unload().eval()
            self._models[name] = m
        return self._models[name]

    def expected(self, name, prompt, n):
        tok = self.served.tokenizer()
        ids = torch.tensor([tok(prompt)["input_ids"]])
        with torch.no_grad():
            out = self.model(name).generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                            do_sample=False, pad_token_id=tok.pad_token_id)
        return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    with single_thread():
        served = served_set(tmp_path_factory.getbasetemp() / "serving")
        yield Fleet(tmp_path_factory.mktemp("variants"), served)


def start(arts, base_dir, **cfg):
    metrics = Metrics()
    rt = build_runtime(ServeConfig(artifacts=arts, base=str(base_dir), **cfg), observer=metrics)
    return ServerThread(create_app(rt, metrics)), rt


def metric(url, name):
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"metric {name} not exported")


def nbytes(t):
    return t.numel() * t.element_size()


# --------------------------------------------------------------------------------------------------
# Outputs
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(fleet):
    with single_thread():
        srv, rt = start(fleet.arts, fleet.served.base_dir, api_key=KEY, max_deltas=3, max_cpu_deltas=8,
                        max_num_seqs=32)
        with srv:
            yield srv, rt


def test_every_kind_serves_its_merged_models_greedy_output(fleet, server):
    """Artifact, full checkpoints (identical, frozen-embedding fine-tune, A/B copy) and LoRA adapter
    (PEFT merge_and_unload as the reference) through the official client."""
    srv, _ = server
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    models = {m.id: m for m in client.models.list().data}
    assert sorted(models) == sorted([BASE, "alpha", "copy", "frozen", "frozen-ab", "lora"])
    assert all(models[m].model_extra["parent"] == BASE for m in models if m != BASE)
    with single_thread():
        for m in ("lora", "frozen", "frozen-ab", "copy", "alpha", BASE):
            for p in PROMPTS[:3]:
                r = client.completions.create(model=m, prompt=p, max_tokens=10, temperature=0)
                assert r.choices[0].text == fleet.expected(m, p, 10), (m, p)
        # the variants really differ from the base (otherwise the test proves little)
        assert fleet.expected("lora", PROMPTS[0], 10) != fleet.expected("base", PROMPTS[0], 10)
        assert fleet.expected("frozen", PROMPTS[0], 10) != fleet.expected("base", PROMPTS[0], 10)


def test_lora_and_delta_rows_in_one_forward_equal_each_alone(fleet, server):
    """One forward over rows of the LoRA adapter, the compressed artifact, a full checkpoint and
    the base: every row's logits equal a forward of that row alone (and its reference model)."""
    from deltazip.runtime.serve.model_runner import prefill_logits

    _, rt = server
    backend = rt.backend
    tok = fleet.served.tokenizer()
    names = ["lora", "alpha", "frozen", "base"]
    ids = [tok(p)["input_ids"] for p in PROMPTS[:2]]
    rows = [(n, i) for n in names for i in ids]

    def forward(rows, slot_of):
        return prefill_logits(backend, [slot_of[n] for n, _ in rows], [i for _, i in rows], pad_id=2)

    def in_slots():
        return rt.engine.cache.ensure(["lora", "alpha", "frozen"]) | {"base": -1}

    with single_thread():
        together = rt.engine.run_on_engine(lambda: forward(rows, in_slots())).result(timeout=120)
        for r, row in enumerate(rows):
            alone = rt.engine.run_on_engine(lambda row=row: forward([row], in_slots())).result(timeout=120)
            torch.testing.assert_close(together[r], alone[0], rtol=1e-5, atol=1e-5)
            ref = fleet.model(row[0])(torch.tensor([row[1]])).logits[0, -1]
            torch.testing.assert_close(together[r], ref, rtol=1e-4, atol=1e-4)
    lin = backend.modules["model.layers.0.self_attn.q_proj"]
    assert lin._lora_rank and lin._dense  # LoRA and a dense replacement side by side in one linear


def test_a_lora_key_met_by_a_request_is_measured_off_the_engine_thread(fleet, monkeypatch):
    """A request's forward measures nothing: the first request of the adapter runs its unmeasured keys on
    the default path (the loop, on a CPU) and hands them to the tuner, whose thread measures each once
    while the engine is idle; the same request again runs the measured paths, queues nothing, and answers
    the same (the merged model's greedy output)."""
    from deltazip.kernels import dispatch, grouped_lora

    for name, empty in (("CHOICES", {}), ("MEASURED", {}), ("QUEUED", set())):  # this test's keys only
        monkeypatch.setattr(grouped_lora, name, empty)
    threads = []
    real = grouped_lora.measure

    def counted(*a, **kw):
        threads.append(threading.current_thread().name)
        return real(*a, **kw)

    monkeypatch.setattr(grouped_lora, "measure", counted)

    def complete(url):
        r = httpx.post(url + "/v1/completions", json={"model": "lora", "prompt": PROMPTS[0], "max_tokens": 6,
                                                      "temperature": 0}, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    with single_thread():
        srv, rt = start(fleet.arts, fleet.served.base_dir, max_deltas=2)
        with srv:
            dispatch.CALLS.clear()
            first = complete(srv.url)
            lora_paths = {k for k, n in dispatch.CALLS.items() if k.startswith("lora_") and n}
            # nothing measured inside the request (the tuner's thread may already have started, the engine idle)
            assert lora_paths == {"lora_loop"} and set(threads) <= {"deltazip-tuner"}, threads
            queued = set(grouped_lora.QUEUED)
            assert queued and rt.backend.tuner.wait(120)
            assert set(threads) == {"deltazip-tuner"} and len(threads) == len(queued)
            assert set(grouped_lora.CHOICES) == queued
            dispatch.CALLS.clear()
            again = complete(srv.url)
            assert set(grouped_lora.QUEUED) == queued and len(threads) == len(queued)
            assert {k for k, n in dispatch.CALLS.items() if k.startswith("lora_") and n} <= \
                {f"lora_{p}" for p in grouped_lora.CHOICES.values()}
    assert first == again == fleet.expected("lora", PROMPTS[0], 6)


def test_lora_and_delta_requests_batched_over_http_equal_sequential(fleet, server):
    srv, _ = server
    jobs = [(m, p, 8) for p in PROMPTS[:4] for m in ("lora", "alpha", BASE, "frozen-ab")]
    headers = {"Authorization": f"Bearer {KEY}"}

    async def all_at_once():
        async with httpx.AsyncClient(base_url=srv.url, headers=headers, timeout=300) as http:
            rs = await asyncio.gather(*(http.post("/v1/completions", json={"model": m, "prompt": p, "max_tokens": n,
                                                                            "temperature": 0}) for m, p, n in jobs))
        return [r.json()["choices"][0]["text"] for r in rs]

    with single_thread():
        got = asyncio.run(all_at_once())
        assert got == [fleet.expected(m, p, n) for m, p, n in jobs]


# --------------------------------------------------------------------------------------------------
# Dedup
# --------------------------------------------------------------------------------------------------


def _base_internal_duplicates(base_dir) -> int:
    """Bytes of base tensors that are bit-identical to an earlier base tensor (e.g. all-ones norms)."""
    from safetensors.torch import load_file

    seen, dup = set(), 0
    for _name, t in sorted(load_file(base_dir / "model.safetensors").items()):
        key = (str(t.dtype), tuple(t.shape), hashlib.sha256(t.numpy().tobytes()).hexdigest())
        dup += nbytes(t) if key in seen else 0
        seen.add(key)
    return dup


def test_dedup_saves_exactly_the_identical_bytes(fleet, server):
    """bytes saved = base's internal duplicates + the identical copy (all of it) + the frozen
    embeddings/norms of both frozen variants + every changed tensor of the A/B copy (held once)."""
    from safetensors.torch import load_file

    srv, rt = server
    base_sd = load_file(fleet.served.base_dir / "model.safetensors")
    frozen_sd = load_file(fleet.arts / "frozen" / "model.safetensors")
    total = sum(nbytes(t) for t in base_sd.values())
    frozen_same = sum(nbytes(t) for n, t in frozen_sd.items() if torch.equal(t, base_sd[n]))
    assert frozen_same == nbytes(base_sd["model.embed_tokens.weight"]) + 5 * 64 * 4  # embeddings + 5 norms
    with single_thread():
        for m in ("copy", "frozen", "frozen-ab"):  # both frozen copies loaded into the host tier
            rt.engine.cache.host_get(m)
        want = _base_internal_duplicates(fleet.served.base_dir) + total + 2 * frozen_same + (total - frozen_same)
        assert metric(srv.url, "deltazip_dedup_bytes_saved") == want
        assert metric(srv.url, "deltazip_dedup_same_as_base_bytes") == total + 2 * frozen_same
        assert metric(srv.url, 'deltazip_variant_dedup_bytes_saved{variant="copy"}') == total
        # the A/B copies hold the very same host tensors (no second copy), and the copy holds none
        a, b = (rt.engine.cache.host_object(m) for m in ("frozen", "frozen-ab"))
        for mname, kw in a.modules.items():
            assert kw["dense"].data_ptr() == b.modules[mname]["dense"].data_ptr()
        assert rt.engine.cache.host_object("copy").nbytes() == 0
        assert rt.report[0]["role"] == "base"
        by_model = {r["model"]: r for r in rt.report}
        assert by_model["copy"]["dedup_same_as_base_bytes"] == total and by_model["copy"]["bytes_resident"] == 0
        assert by_model["frozen-ab"]["dedup_shared_bytes"] == total - frozen_same


def test_startup_log_reports_dedup(fleet, caplog):
    with single_thread(), caplog.at_level(logging.INFO, logger="deltazip.serve"):
        _, rt = start(fleet.arts, fleet.served.base_dir, max_deltas=1)
        rt.engine.cache.shutdown()
    lines = [r.getMessage() for r in caplog.records]
    full = [ln for ln in lines if ln.startswith("variant copy (full checkpoint)")]
    assert full and "equal the base's" in full[0] and "dedup saves" in full[0]
    assert any(ln.startswith("variant lora (LoRA adapter)") for ln in lines)
    assert any(ln.startswith("dedup: ") and "not stored" in ln for ln in lines)


# --------------------------------------------------------------------------------------------------
# Swap mode and refusals
# --------------------------------------------------------------------------------------------------


def test_swap_mode_serves_full_checkpoints_and_lora(fleet):
    with single_thread():
        srv, _ = start(fleet.arts, fleet.served.base_dir, mode="swap", max_deltas=2, max_cpu_deltas=2)
        with srv:
            client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=120)
            for m in ("lora", "frozen", "copy"):
                r = client.completions.create(model=m, prompt=PROMPTS[1], max_tokens=8, temperature=0)
                assert r.choices[0].text == fleet.expected(m, PROMPTS[1], 8), m


def _one_variant_dir(fleet, tmp_path, name, build):
    arts = tmp_path / "arts"
    arts.mkdir()
    build(arts / name)
    return arts


@pytest.mark.parametrize("case,match", [
    ("dora", r"has a DoRA magnitude \(lora_magnitude_vector\) but use_dora is False"),
    ("resized", r"saves lm_head\.weight \[\d+, \d+\] \(modules_to_save\), the base's is .*a resized vocabulary"),
    ("bias", r"has a LoRA bias \(lora_bias\) \[\d+\], but the base linear has no bias of that size"),
    ("other_base", "not on the served base"),
    ("targets", "target_modules .* does not name"),
])
def test_unservable_adapters_are_refused_in_one_line(fleet, tmp_path, case, match):
    def build(out):
        if case == "dora":  # a DoRA adapter whose config lost use_dora
            make_adapter(fleet.served.base_dir, out, seed=1, use_dora=True)
            cfg = json.loads((out / "adapter_config.json").read_text())
            (out / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": False}))
        elif case == "resized":  # a saved lm_head with rows for tokens the base does not have
            from safetensors.torch import load_file, save_file

            make_adapter(fleet.served.base_dir, out, seed=1, modules_to_save=["lm_head"])
            tensors = load_file(out / "adapter_model.safetensors")
            head = tensors["base_model.model.lm_head.weight"]
            tensors["base_model.model.lm_head.weight"] = torch.cat([head, head[:2]])
            save_file(tensors, str(out / "adapter_model.safetensors"))
        elif case == "bias":  # a bias on lora_B of a linear that has none
            make_adapter(fleet.served.base_dir, out, seed=1, lora_bias=True)
        else:
            make_adapter(fleet.served.base_dir, out, seed=1)
            cfg = json.loads((out / "adapter_config.json").read_text())
            if case == "targets":  # config and weights that do not belong together
                cfg["target_modules"] = ["v_proj"]
            else:
                cfg["base_model_name_or_path"] = "someorg/another-model"
            (out / "adapter_config.json").write_text(json.dumps(cfg))

    with single_thread():
        arts = _one_variant_dir(fleet, tmp_path, "bad", build)
        with pytest.raises(InputError, match=match) as e:
            build_runtime(ServeConfig(artifacts=arts, base=str(fleet.served.base_dir)))
    assert "\n" not in str(e.value)


def test_checkpoint_of_another_architecture_is_refused(fleet, tmp_path):
    with single_thread():
        arts = _one_variant_dir(fleet, tmp_path, "wide", lambda out: save_full(
            tiny_model("llama", hidden_size=32, intermediate_size=64, **IDS), fleet.served.base_dir, out))
        with pytest.raises(InputError, match="wide .*hidden_size=32.*not a fine-tune") as e:
            build_runtime(ServeConfig(artifacts=arts, base=str(fleet.served.base_dir)))
        assert "\n" not in str(e.value)
        arts2 = tmp_path / "arts2"
        arts2.mkdir()
        make_adapter(fleet.served.base_dir, arts2 / "foreign", seed=1)
        from safetensors.torch import load_file, save_file

        f = arts2 / "foreign" / "adapter_model.safetensors"
        sd = load_file(f)
        save_file({k.replace("q_proj", "qkv_proj"): v for k, v in sd.items()}, f)
        with pytest.raises(InputError, match="qkv_proj, which is not a linear layer"):
            build_runtime(ServeConfig(artifacts=arts2, base=str(fleet.served.base_dir)))


# --------------------------------------------------------------------------------------------------
# Live variant management
# --------------------------------------------------------------------------------------------------


@pytest.fixture()
def live(fleet, tmp_path):
    """A server started with only the identical copy: no module is decoupled at start."""
    arts = tmp_path / "live"
    arts.mkdir()
    shutil.copytree(fleet.arts / "copy", arts / "copy")
    with single_thread():
        srv, rt = start(arts, fleet.served.base_dir, api_key=KEY, max_deltas=2, max_cpu_deltas=4, max_num_seqs=32)
        with srv:
            yield srv, rt, arts


def test_variant_paths_must_stay_inside_the_served_directory(fleet, live, tmp_path):
    srv, rt, arts = live
    h = {"Authorization": f"Bearer {KEY}"}
    outside = tmp_path / "outside"
    shutil.copytree(fleet.spare / "lora-live", outside)
    os.symlink(outside, arts / "sneaky")
    (arts / "half").mkdir()
    shutil.copy(fleet.spare / "lora-live" / "adapter_config.json", arts / "half")
    os.symlink(outside / "adapter_model.safetensors", arts / "half" / "adapter_model.safetensors")
    for body in ({"path": "../outside"}, {"path": str(outside)}, {"path": "sneaky"}, {"path": "copy/../../outside"},
                 {"path": "half"}, {"path": "nothing-here"}, {"path": ""}, {"path": 3}, {"nope": 1},
                 {"path": "copy", "name": "../x"}):
        r = httpx.post(srv.url + "/v1/variants", json=body, headers=h)
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["message"] and err["param"] in ("path", "name")
    assert httpx.post(srv.url + "/v1/variants", json={"path": "copy"}, headers=h).status_code == 409
    for method, url in (("POST", "/v1/variants"), ("GET", "/v1/variants"), ("DELETE", "/v1/variants/copy")):
        r = httpx.request(method, srv.url + url, json={"path": "copy"} if method == "POST" else None)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.delete(srv.url + "/v1/variants/" + BASE, headers=h)
    assert r.status_code == 404
    assert [v.name for v in rt.variants] == ["copy"]


def test_add_and_remove_variants_under_load_loses_no_request(fleet, live):
    """Requests for the base and the copy run all along; a LoRA adapter and an artifact are added
    (their modules decoupled on demand), used, and removed while their own requests are in flight."""
    srv, rt, arts = live
    h = {"Authorization": f"Bearer {KEY}"}
    shutil.copytree(fleet.spare / "lora-live", arts / "lora-live")
    shutil.copytree(fleet.arts / "alpha", arts / "nested" / "alpha")
    assert not rt.backend.modules  # nothing decoupled yet
    held_before = None

    async def ask(http, m, p, n=6):
        r = await http.post("/v1/completions", json={"model": m, "prompt": p, "max_tokens": n, "temperature": 0})
        assert r.status_code == 200, (m, r.text)
        return m, p, n, r.json()["choices"][0]["text"]

    async def scenario():
        nonlocal held_before
        submitted = rt.engine.counters["requests"]
        async with httpx.AsyncClient(base_url=srv.url, headers=h, timeout=300) as http:
            background = [asyncio.create_task(ask(http, m, p)) for p in PROMPTS for m in (BASE, "copy")]
            held_before = metric(srv.url, "deltazip_dedup_held_bytes")
            r = await http.post("/v1/variants", json={"path": "lora-live"})
            assert r.status_code == 201, r.text
            assert r.json()["kind"] == "lora"
            r = await http.post("/v1/variants", json={"path": "nested/alpha", "name": "alpha-live"})
            assert r.status_code == 201, r.text
            background += [asyncio.create_task(ask(http, m, p)) for p in PROMPTS for m in (BASE, "copy")]
            mine = [asyncio.create_task(ask(http, m, p, 12)) for p in PROMPTS for m in ("lora-live", "alpha-live")]
            while rt.engine.counters["requests"] < submitted + len(background) + len(mine):
                await asyncio.sleep(0.01)  # every request accepted: the deletes must drain, not refuse, them
            listing = (await http.get("/v1/variants")).json()["data"]
            deleted = await asyncio.gather(http.delete("/v1/variants/lora-live"), http.delete("/v1/variants/alpha-live"))
            assert [d.status_code for d in deleted] == [200, 200], [d.text for d in deleted]
            assert deleted[0].json() == {"id": "lora-live", "object": "model", "deleted": True}
            after = await http.post("/v1/completions", json={"model": "lora-live", "prompt": "a", "max_tokens": 2})
            done = await asyncio.gather(*background, *mine)
            return listing, after, done

    with single_thread():
        listing, after, done = asyncio.run(scenario())
        assert after.status_code == 404
        assert len(done) == 4 * len(PROMPTS) + 2 * len(PROMPTS)
        for m, p, n, text in done:
            ref = {"lora-live": "lora-live", "alpha-live": "alpha"}.get(m, "base")
            assert text == fleet.expected(ref, p, n), (m, p)
    rows = {r["id"]: r for r in listing}
    assert rows["lora-live"]["kind"] == "lora" and rows["alpha-live"]["kind"] == "artifact"
    assert rows["alpha-live"]["path"] == "nested/alpha" and rows["copy"]["kind"] == "full"
    assert rows["copy"]["bytes_dedup_saved"] == rows["copy"]["bytes_on_disk"] - _header_bytes(arts / "copy")
    for r in rows.values():
        assert r["state"] in ("device", "host", "loading", "disk", "draining")
        assert set(r) >= {"bytes_on_disk", "bytes_host", "bytes_device", "last_used", "load_seconds"}
    # modules were decoupled on demand, and everything of the removed variants is gone from every tier
    assert "model.layers.0.self_attn.q_proj" in rt.backend.modules and "model.embed_tokens" in rt.backend.modules
    left = httpx.get(srv.url + "/v1/variants", headers=h).json()["data"]
    assert [r["id"] for r in left] == ["copy"]
    assert "lora-live" not in rt.engine.cache.slots and rt.engine.cache.host_object("lora-live") is None
    assert metric(srv.url, "deltazip_dedup_held_bytes") == held_before
    assert sorted(m.id for m in openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY).models.list().data) == \
        sorted([BASE, "copy"])


def _header_bytes(ckpt_dir) -> int:
    """safetensors header bytes (8-byte length + JSON) of a checkpoint: on disk, not tensor data."""
    total = 0
    for f in ckpt_dir.glob("*.safetensors"):
        with open(f, "rb") as fh:
            total += 8 + int.from_bytes(fh.read(8), "little")
    return total


@pytest.mark.gpu
def test_identical_checkpoints_share_device_memory_on_cuda(fleet):
    """Two slots holding A/B copies of a full fine-tune reference one device copy of each tensor."""
    from deltazip.models.checkpoint import Checkpoint
    from deltazip.runtime.serve.model import DeltaModel
    from deltazip.runtime.serve.variant_sources import (
        BaseTensorIndex,
        compare_full_checkpoint,
        discover_variants,
    )

    base = Checkpoint(fleet.served.base_dir)
    dm = DeltaModel(base, [], 2, torch.device("cuda"), torch.float32)
    index = BaseTensorIndex(base, dm.registry.fingerprint_bytes)
    for v in discover_variants(fleet.arts):
        if v.name in ("frozen", "frozen-ab"):
            compare_full_checkpoint(v, index, 4)
            dm.commit_variant(v, dm.prepare_variant(v))
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    dm.write_slot(0, "frozen", dm.load_host("frozen"))
    one = torch.cuda.memory_allocated() - start
    dm.write_slot(1, "frozen-ab", dm.load_host("frozen-ab"))
    two = torch.cuda.memory_allocated() - start
    assert one > 0 and two == one
    lm_head = dm.modules["lm_head"]
    assert lm_head._dense[0].data_ptr() == lm_head._dense[1].data_ptr()


def test_base_directory_among_the_variants_is_the_base_not_a_copy(fleet, tmp_path):
    arts = tmp_path / "models"
    shutil.copytree(fleet.served.base_dir, arts / BASE)
    shutil.copytree(fleet.arts / "copy", arts / "copy")
    with single_thread():
        srv, rt = start(arts, arts / BASE, api_key=KEY)
        with srv:
            assert [v.name for v in rt.variants] == ["copy"]
            r = httpx.post(srv.url + "/v1/variants", json={"path": BASE, "name": "again"},
                           headers={"Authorization": f"Bearer {KEY}"})
            assert r.status_code == 400 and "served base itself" in r.json()["error"]["message"]


def test_delta_linear_lora_slots_of_different_ranks():
    """Per-row LoRA on a decoupled linear, adapters of rank 2 and 4 in one zero-padded stack (the
    rank-4 one loaded second, which grows the stack), beside a dense replacement and base rows."""
    from torch import nn

    from deltazip.runtime.serve.delta_linear import DeltaContext, DeltaLinear

    g = torch.Generator().manual_seed(0)
    base = nn.Linear(32, 24, bias=True)
    with torch.no_grad():
        base.weight.copy_(torch.randn(24, 32, generator=g))
        base.bias.copy_(torch.randn(24, generator=g))
    ctx = DeltaContext(3)
    lin = DeltaLinear(base, ctx)
    a1, b1 = torch.randn(2, 32, generator=g), torch.randn(24, 2, generator=g)
    a2, b2 = torch.randn(4, 32, generator=g), torch.randn(24, 4, generator=g)
    dense = torch.randn(24, 32, generator=g)
    lin.load_slot(0, lora_a=a1, lora_b=b1, lora_scale=0.5)
    lin.load_slot(2, lora_a=a2, lora_b=b2, lora_scale=2.0)
    lin.load_slot(1, dense=dense)
    slots = [-1, 0, 2, 1, 0, 2, -1]
    x = torch.randn(len(slots), 1, 32, generator=g)
    ctx.bind(slots, "cpu")
    with torch.no_grad():
        y = lin(x)[:, 0]
    ctx.unbind()
    w, b = base.weight.double(), base.bias.double()
    for r, s in enumerate(slots):
        xr = x[r, 0].double()
        want = {-1: xr @ w.T + b, 0: xr @ w.T + b + 0.5 * (xr @ a1.double().T) @ b1.double().T,
                2: xr @ w.T + b + 2.0 * (xr @ a2.double().T) @ b2.double().T, 1: xr @ dense.double().T + b}[s]
        torch.testing.assert_close(y[r].double(), want, rtol=1e-4, atol=1e-4)
    assert lin.resident_bytes(0) == lin.resident_bytes(2) == (4 * 32 + 24 * 4) * 4  # padded to rank 4
    lin.clear_slot(2)
    assert lin.resident_bytes(2) == 0 and 2 not in lin._lora_rank
