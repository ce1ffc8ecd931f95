"""Variants read on first use (issue 23 item 4): a server reads and checks at start-up only the variants
its host tier is warmed with (``max(--max-deltas, --max-cpu-deltas)`` by name); every other one is
listed and routed from its name, and its manifest is read, checked against the base and planned when
its first request arrives. A variant that fails a check then is refused in one line.

Real servers on loopback ports, real artifact directories (the serving tests' alpha/beta/gamma)."""

from __future__ import annotations

import asyncio
import logging
import shutil

import httpx
import pytest
from _serving import served_set, single_thread

from deltazip.runtime.serve.assembly import ServeConfig, build_runtime
from deltazip.runtime.serve.server import Metrics, ServerThread, create_app

BASE = "tiny-base"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with single_thread():
        yield served_set(tmp_path_factory.getbasetemp() / "serving")


def start(arts, base=None, **cfg):
    metrics = Metrics()
    rt = build_runtime(ServeConfig(artifacts=arts, base=None if base is None else str(base), **cfg), observer=metrics)
    return ServerThread(create_app(rt, metrics)), rt


def complete(url: str, model: str, prompt: str = "zip model tune", n: int = 6) -> httpx.Response:
    return httpx.post(url + "/v1/completions", timeout=120,
                      json={"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0})


def corrupt_copy(src, dst):
    shutil.copytree(src, dst)
    f = sorted(dst.glob("deltas-*.safetensors"))[0]
    raw = bytearray(f.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    f.write_bytes(bytes(raw))
    return dst


def test_variants_beyond_the_host_tier_are_read_on_first_use(served, caplog):
    """max_deltas=1, max_cpu_deltas=1: alpha is read at start-up, beta and gamma when first asked for;
    all three are listed from the start and each answers with its merged model's greedy text."""
    with single_thread(), caplog.at_level(logging.INFO, logger="deltazip.serve"):
        srv, rt = start(served.artifacts, max_deltas=1, max_cpu_deltas=1)
        assert [v.name for v in rt.variants] == ["alpha"]
        assert sorted(rt.catalog.found) == ["beta", "gamma"]
        startup = [r.getMessage() for r in caplog.records]
        assert [m.split(" ")[1] for m in startup if m.startswith("variant ")] == ["alpha"]
        assert any(m.startswith("2 more variants found (beta ... gamma)") for m in startup), startup
        with srv:
            models = [m["id"] for m in httpx.get(srv.url + "/v1/models").json()["data"]]
            assert models == [BASE, "alpha", "beta", "gamma"]
            assert httpx.get(srv.url + "/v1/models/gamma").json()["parent"] == BASE
            assert httpx.get(srv.url + "/health").json()["models"] == 4
            rows = {r["id"]: r for r in httpx.get(srv.url + "/v1/variants").json()["data"]}
            assert rows["gamma"]["checked"] is False and rows["gamma"]["state"] == "disk"
            assert rows["gamma"]["bytes_on_disk"] is None and rows["alpha"]["checked"] is True
            caplog.clear()
            for name in ("gamma", "beta", "alpha"):
                r = complete(srv.url, name)
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["text"] == served.expected(name, "zip model tune", 6), name
            rows = {r["id"]: r for r in httpx.get(srv.url + "/v1/variants").json()["data"]}
    read_now = [r.getMessage().split(" ")[1] for r in caplog.records if r.getMessage().startswith("variant ")]
    assert read_now == ["gamma", "beta"]  # one line each, when first used; alpha was read at start-up
    assert all(rows[n]["checked"] and rows[n]["bytes_on_disk"] > 0 for n in ("alpha", "beta", "gamma"))
    assert not rt.catalog.found and [v.name for v in rt.variants] == ["alpha", "gamma", "beta"]


def test_concurrent_first_requests_share_one_read(served, caplog):
    with single_thread():
        srv, rt = start(served.artifacts, max_deltas=1, max_cpu_deltas=0)
        assert sorted(rt.catalog.found) == ["beta", "gamma"]

        async def burst():
            async with httpx.AsyncClient(base_url=srv.url, timeout=120) as http:
                body = {"model": "beta", "prompt": "alpha beta", "max_tokens": 4, "temperature": 0}
                return await asyncio.gather(*(http.post("/v1/completions", json=body) for _ in range(6)))

        with srv, caplog.at_level(logging.INFO, logger="deltazip.serve"):
            responses = asyncio.run(burst())
    assert [r.status_code for r in responses] == [200] * 6
    want = served.expected("beta", "alpha beta", 4)
    assert {r.json()["choices"][0]["text"] for r in responses} == {want}
    assert sum(r.getMessage().startswith("variant beta ") for r in caplog.records) == 1


def test_a_corrupt_variant_is_refused_in_one_line_on_first_use(served, tmp_path, caplog):
    """The server starts (the corrupt variant is not read yet); its first request gets the one-line
    reason (500: the served directory is at fault, not the request), logged once; it is no longer
    listed; once deleted, a sound copy can be registered under its name."""
    arts = tmp_path / "arts"
    shutil.copytree(served.variant_dir("alpha"), arts / "alpha")
    corrupt_copy(served.variant_dir("beta"), arts / "beta")
    with single_thread():
        srv, rt = start(arts, served.base_dir, max_deltas=1, max_cpu_deltas=1)
        with srv, caplog.at_level(logging.INFO, logger="deltazip.serve"):
            assert "beta" in [m["id"] for m in httpx.get(srv.url + "/v1/models").json()["data"]]
            first, again = complete(srv.url, "beta"), complete(srv.url, "beta")
            assert complete(srv.url, "alpha").status_code == 200
            models = [m["id"] for m in httpx.get(srv.url + "/v1/models").json()["data"]]
            rows = {r["id"]: r for r in httpx.get(srv.url + "/v1/variants").json()["data"]}
            deleted = httpx.delete(srv.url + "/v1/variants/beta", timeout=60)
            shutil.rmtree(arts / "beta")
            shutil.copytree(served.variant_dir("beta"), arts / "beta")
            added = httpx.post(srv.url + "/v1/variants", json={"path": "beta"}, timeout=120)
            after = complete(srv.url, "beta")
    for r in (first, again):
        assert r.status_code == 500, r.text
        err = r.json()["error"]
        assert err["code"] == "invalid_variant" and err["param"] == "model" and "\n" not in err["message"]
        assert err["message"].startswith("variant beta cannot be served: artifact ")
        assert "deltas-00001.safetensors sha256 differs from the manifest" in err["message"]
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [first.json()["error"]["message"]]  # logged once, the same line
    assert models == [BASE, "alpha"]
    assert rows["beta"]["state"] == "refused" and rows["beta"]["error"] == errors[0]
    assert deleted.status_code == 200 and added.status_code == 201, (deleted.text, added.text)
    assert after.status_code == 200
    assert after.json()["choices"][0]["text"] == served.expected("beta", "zip model tune", 6)


def test_a_variant_of_another_base_is_refused_on_first_use(served, tmp_path):
    from _factories import perturb, tiny_model

    from deltazip.compress.config import CompressConfig
    from deltazip.compress.pipeline import compress_delta
    from deltazip.kernels.scheme import DeltaScheme

    ids = dict(vocab_size=128, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    with single_thread():
        tiny_model("llama", seed=5, **ids).save_pretrained(tmp_path / "other-base")
        perturb(tiny_model("llama", seed=5, **ids)).save_pretrained(tmp_path / "other-ft")
        arts = tmp_path / "arts"
        shutil.copytree(served.variant_dir("alpha"), arts / "alpha")
        compress_delta(tmp_path / "other-base", tmp_path / "other-ft", None, arts / "stranger",
                       CompressConfig(scheme=DeltaScheme(group_size=32), method="rtn", device="cpu"))
        srv, rt = start(arts, max_deltas=1, max_cpu_deltas=1)  # the base from alpha's lineage
        with srv:
            r = complete(srv.url, "stranger")
    assert r.status_code == 500
    msg = r.json()["error"]["message"]
    assert msg.startswith("variant stranger cannot be served: artifact stranger ") and "different base" in msg


def test_unread_variants_can_be_deleted_and_their_names_are_taken(served, tmp_path):
    arts = tmp_path / "arts"
    for n in ("alpha", "beta", "gamma"):
        shutil.copytree(served.variant_dir(n), arts / n)
    with single_thread():
        srv, rt = start(arts, served.base_dir, max_deltas=1, max_cpu_deltas=1)
        with srv:
            taken = httpx.post(srv.url + "/v1/variants", json={"path": "alpha", "name": "gamma"}, timeout=60)
            deleted = httpx.delete(srv.url + "/v1/variants/gamma", timeout=60)
            gone = complete(srv.url, "gamma")
            models = [m["id"] for m in httpx.get(srv.url + "/v1/models").json()["data"]]
            again = httpx.delete(srv.url + "/v1/variants/gamma", timeout=60)
    assert taken.status_code == 409 and taken.json()["error"]["code"] == "variant_exists"
    assert deleted.status_code == 200 and deleted.json() == {"id": "gamma", "object": "model", "deleted": True}
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"
    assert models == [BASE, "alpha", "beta"] and again.status_code == 404


def test_without_base_the_first_artifact_names_it(served, tmp_path):
    """No --base and a first variant that is not an artifact: the first artifact is read at start-up too,
    so that its lineage names the base (as when every manifest was read)."""
    arts = tmp_path / "arts"
    shutil.copytree(served.base_dir, arts / "aa-copy")  # a full checkpoint, first by name
    shutil.copytree(served.variant_dir("gamma"), arts / "gamma")
    shutil.copytree(served.variant_dir("beta"), arts / "zz-beta")
    with single_thread():
        srv, rt = start(arts, max_deltas=1, max_cpu_deltas=1)
    assert [v.name for v in rt.variants] == ["aa-copy", "gamma"] and list(rt.catalog.found) == ["zz-beta"]
    assert rt.backend.base.path.resolve() == served.base_dir.resolve()
