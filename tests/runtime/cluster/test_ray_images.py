"""Images in chat requests through ``deltazip serve --ray``: the ingress hands the whole body (base64
images in it) to an engine replica, which reads them as the single server does; a body over
``--max-request-bytes`` is a 413 at the ingress. One replica on a local cluster of its own."""

from __future__ import annotations

import socket

import httpx
import pytest
from _images import N, build_variant, generate, llava_processor, picture, png, prompt, tokenizer
from _serving import single_thread

pytest.importorskip("ray")
openai = pytest.importorskip("openai")

from deltazip.compress.merge import load_merged_model  # noqa: E402
from deltazip.formats.artifact import Artifact  # noqa: E402
from deltazip.models.checkpoint import Checkpoint  # noqa: E402
from deltazip.runtime.cluster import ray_app  # noqa: E402
from deltazip.runtime.serve.assembly import ServeConfig  # noqa: E402

pytestmark = pytest.mark.slow


def test_a_replica_reads_the_images_of_a_chat_request(tmp_path):
    processor = llava_processor(tokenizer())
    with single_thread():
        base_dir, arts = build_variant(tmp_path, "llava", processor, vision_scale=0.5)
        pics = [picture(0), picture(3, (30, 30))]
        one = prompt(processor, "which?", pics)
        want = generate(load_merged_model(Artifact(arts / "ft"), Checkpoint(base_dir)), *one)
    content = [*({"type": "image_url", "image_url": {"url": png(p)}} for p in pics), {"type": "text", "text": "which?"}]
    body = {"model": "ft", "messages": [{"role": "user", "content": content}], "max_tokens": N, "temperature": 0}
    limit = len(str(body)) + 4096  # room for this request, not for one with a large photo
    cfg = ServeConfig(artifacts=arts, base=str(base_dir), max_deltas=2, max_cpu_deltas=2, cpu_threads=1,
                      max_request_bytes=limit)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        cfg.port = s.getsockname()[1]
    opts = ray_app.RayOptions(replicas=1)
    started = ray_app.connect(opts)
    try:
        ray_app.deploy(cfg, opts)
        url = f"http://127.0.0.1:{cfg.port}"
        got = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120).chat.completions.create(
            **body)
        big = [{"type": "image_url", "image_url": {"url": png(picture(9, (200, 200)))}}, *content]
        r = httpx.post(url + "/v1/chat/completions", timeout=60,
                       json={**body, "messages": [{"role": "user", "content": big}]})
    finally:
        ray_app.shutdown(started)
    assert got.choices[0].message.content == want[0] and got.usage.prompt_tokens == len(one[0])
    assert r.status_code == 413, r.text
