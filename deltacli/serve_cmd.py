"""``deltazip serve``: an OpenAI-compatible server for a base model plus many compressed deltas."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Annotated

import typer

from deltazip.deltacli.common import BaseOpt, DeviceOpt, DtypeOpt, JsonOpt, err_console, print_json


def serve(
    artifacts: Annotated[Path, typer.Argument(help="Directory holding the variants to serve: deltazip artifacts, "
                                                   "full HF checkpoints, PEFT LoRA adapters (one per directory; the "
                                                   "variant name is the directory name).",
                                              show_default=False)],
    base: BaseOpt = None,
    host: Annotated[str, typer.Option(help="Address to bind (loopback by default; 0.0.0.0 exposes it).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port.")] = 8000,
    api_key: Annotated[str | None, typer.Option("--api-key", envvar="DELTAZIP_API_KEY", show_envvar=True,
                                                help="Require 'Authorization: Bearer KEY' on /v1/*.")] = None,
    mode: Annotated[str, typer.Option(help="delta: base + compressed deltas batched together; swap: whole merged "
                                           "models swapped in, one model per batch (baseline).")] = "delta",
    max_deltas: Annotated[int, typer.Option(help="Device slots: variants resident at once (swap: whole models).")] = 4,
    max_cpu_deltas: Annotated[int, typer.Option(help="Variants kept decoded in host memory (LRU).")] = 16,
    max_batch_tokens: Annotated[int, typer.Option(help="Tokens per engine step (prompts + one per sequence).")] = 2048,
    max_num_seqs: Annotated[int, typer.Option(help="Sequences per engine step.")] = 32,
    max_queue: Annotated[int, typer.Option(help="Waiting requests before new ones get 429.")] = 256,
    max_request_bytes: Annotated[int, typer.Option(help="Largest request body accepted (larger ones get 413); "
                                                        "prompts longer than the model's context get 400.")] = 4 * 2**20,
    chat_template: Annotated[Path | None, typer.Option(help="A Jinja chat template that renders every model's chat "
                                                            "requests, in place of their own (for checkpoints that "
                                                            "ship none).", show_default=False)] = None,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    delta_compute: Annotated[str, typer.Option(help="auto, packed (SBMM on stacked low-bit deltas) or dequantized "
                                                    "(dense deltas per slot; auto picks it on CPU).")] = "auto",
    cpu_threads: Annotated[int | None, typer.Option(help="torch intra-op threads (default: torch's choice).")] = None,
    no_preemption: Annotated[bool, typer.Option("--no-preemption", help="Never preempt line-skipping requests "
                                                                        "(for experiments; can starve requests).")] = False,
    workers: Annotated[int, typer.Option(help="Engine processes behind one HTTP front, sharing one copy of the "
                                              "base weights (1: a single process, no front).")] = 1,
    ray: Annotated[bool, typer.Option("--ray", help="Serve as a Ray Serve application: engine replicas behind one "
                                                     "endpoint, requests routed to the replica holding their variant "
                                                     "(needs deltazip\\[cluster]).")] = False,
    replicas: Annotated[int | None, typer.Option(help="--ray: a fixed number of engine replicas (default 1).")] = None,
    min_replicas: Annotated[int | None, typer.Option(help="--ray: autoscale from this many replicas...")] = None,
    max_replicas: Annotated[int | None, typer.Option(help="...up to this many.")] = None,
    ray_address: Annotated[str | None, typer.Option(help="--ray: join this cluster (head host:port, or auto) "
                                                         "instead of starting a local one.")] = None,
    tensor_parallel: Annotated[int, typer.Option("--tensor-parallel", help="Shard every layer over N processes "
                                                 "(N GPUs; gloo on CPU).")] = 1,
    json_out: JsonOpt = False,
) -> None:
    """Serve the base model and every variant under ARTIFACTS (artifacts, full checkpoints, LoRA adapters) with an OpenAI-compatible API."""
    from deltazip.runtime.serve.assembly import ServeConfig
    from deltazip.runtime.serve.listen import bind_listen_socket

    cfg = ServeConfig(artifacts=artifacts, base=base, host=host, port=port, api_key=api_key, mode=mode,
                      max_deltas=max_deltas, max_cpu_deltas=max_cpu_deltas, max_batch_tokens=max_batch_tokens,
                      max_num_seqs=max_num_seqs, max_queue=max_queue, device=device, dtype=dtype,
                      delta_compute=delta_compute, cpu_threads=cpu_threads, preemption=not no_preemption,
                      workers=workers, tensor_parallel=tensor_parallel, max_request_bytes=max_request_bytes,
                      chat_template=chat_template)
    if ray or replicas is not None or min_replicas is not None or max_replicas is not None or ray_address:
        if tensor_parallel != 1:
            from deltazip.formats.errors import InputError

            raise InputError("--tensor-parallel does not combine with --ray yet: serve with one or the other")
        return _serve_ray(cfg, ray, replicas, min_replicas, max_replicas, ray_address, json_out)
    # The port before any model: a busy one is one line now, not a traceback once every model has loaded.
    sock = bind_listen_socket(host, port)
    cfg.port = sock.getsockname()[1]  # --port 0: the one the system picked
    try:
        _serve(cfg, sock, json_out)
    finally:
        sock.close()


def _serve(cfg, sock, json_out: bool) -> None:
    from deltazip.runtime.serve.assembly import build_runtime
    from deltazip.runtime.serve.server import Metrics, serve_forever

    url, mode = f"http://{cfg.host}:{cfg.port}", cfg.mode
    if not json_out:
        # The library logs one line per variant at start-up, and one per request; show them on stderr.
        logging.basicConfig(level=os.environ.get("DELTAZIP_LOG_LEVEL", "INFO").upper(),
                            format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if cfg.workers > 1:
        from deltazip.runtime.cluster.workers import serve_workers

        def ready(pool) -> None:
            if json_out:
                print_json({"serving": url, "mode": mode, "workers": pool.health()["workers"],
                            "shared_bytes": pool.owner_report.get("nbytes")})
            else:
                err_console.print(f"serving with {cfg.workers} workers sharing one copy of the base weights "
                                  f"({pool.owner_report.get('nbytes', 0) / 2**20:.1f} MiB) on {url} (mode {mode})")

        serve_workers(cfg, on_ready=ready, sock=sock)
        return
    metrics = Metrics()
    parallel = None
    if cfg.tensor_parallel > 1:  # the server does not import cluster/: the sharded model is handed in
        from deltazip.runtime.cluster.tp_group import start_tensor_parallel as parallel
    rt = build_runtime(cfg, observer=metrics, parallel=parallel)
    if json_out:
        print_json({"serving": url, "mode": mode, "models": rt.report, "capacity": rt.capacity,
                    "kernel_warmup": rt.warmup, "images": rt.images})
    else:  # the per-model, warm-up and capacity lines were logged by build_runtime
        err_console.print(f"serving {len(rt.catalog)} variant{'' if len(rt.catalog) == 1 else 's'} of {rt.base_name} on {url} (mode {mode})", markup=False)
    serve_forever(cfg, runtime=rt, metrics=metrics, sock=sock)


def _serve_ray(cfg, ray, replicas, min_replicas, max_replicas, address, json_out: bool) -> None:
    from deltazip.formats.errors import InputError
    from deltazip.runtime.cluster.ray_app import RayOptions, serve_forever

    if not ray:
        raise InputError("--replicas, --min-replicas, --max-replicas and --ray-address go with --ray; add --ray")
    if cfg.workers > 1:
        raise InputError("--workers is for a single machine; with --ray use --replicas (or drop --ray)")
    opts = RayOptions(address=address, replicas=replicas, min_replicas=min_replicas, max_replicas=max_replicas)

    def ready(c) -> None:
        url = f"http://{c.host}:{c.port}"
        if json_out:
            print_json({"serving": url, "mode": c.mode, "ray": {"address": address or "local", **opts.scaling(c)}})
        else:
            err_console.print(f"serving on {url} with Ray Serve: {opts.describe()}, cluster {address or 'local'}")

    if not json_out:
        logging.basicConfig(level=os.environ.get("DELTAZIP_LOG_LEVEL", "INFO").upper(),
                            format="%(asctime)s %(name)s %(levelname)s %(message)s")
    serve_forever(cfg, opts, on_ready=ready)


def register(app: typer.Typer) -> None:
    app.command("serve", no_args_is_help=True)(serve)
