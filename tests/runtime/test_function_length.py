"""Issue 15 #7: no function on the request path runs over 80 lines.

Every function (nested ones and methods included) of the modules a request goes through is measured
with ``ast`` (``end_lineno - lineno + 1``: decorators excluded, docstring and body included). The
modules are listed explicitly; every other module of runtime/serve and runtime/share must be listed
as off the request path, with the reason, so a new module cannot slip past the check unnoticed.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "runtime"
LIMIT = 80

REQUEST_PATH = [
    "serve/server.py",  # create_app
    "serve/routes.py",  # handlers, streaming, auth, error shaping
    "serve/openai_schema.py",  # request parsing, field checks
    "serve/openai_shapes.py",  # response and chunk JSON, log probabilities
    "serve/engine.py",  # the engine loop every request runs in
    "serve/model_runner.py",  # every step's cache object and forward
    "serve/assembly.py",  # POST /v1/variants registers a variant while serving
    "serve/scheduler.py",
    "serve/delta_cache.py",  # tiers, slot writes
    "serve/delta_loader.py",  # background loads
    "serve/delta_linear.py",  # the forward
    "serve/delta_norms.py",  # decoupled norms in the forward
    "serve/model.py",  # forward, load_host, write_slot
    "serve/kv_cache.py",  # the paged KV cache every step writes
    "serve/recurrent_state.py",  # recurrent layers' states, read and written by every step of a hybrid model
    "serve/attention.py",  # the paged attention of every forward
    "serve/masks.py",  # the contiguous cache's masks (ALiBi models), every step
    "serve/sampling.py",  # every step's tokens
    "serve/grammar.py",  # constrained requests' grammars and every step's token masks
    "serve/tool_calls.py",  # tools in chat requests, calls read from answers
    "serve/chat_content.py",  # chat messages in the form the template reads
    "serve/images.py",  # images in chat requests, read and processed
    "serve/prompt_media.py",  # what a prompt's images make of it, read by its steps
    "serve/cross_attention.py",  # images read by cross-attention layers: their keys per sequence, a step's view
    "serve/vision_params.py",  # a variant's vision tensors put in place while its images are read
    "serve/cuda_graphs.py",  # decode steps on CUDA
    "serve/graph_capture.py",  # every decode graph captured while serving
    "serve/projections.py",  # merged q/k/v and gate/up in the forward
    "serve/delta_embedding.py",  # decoupled embeddings in the forward
    "serve/delta_experts.py",  # decoupled MoE experts and routers in the forward
    "serve/delta_sinks.py",  # per-row attention sinks, read by the attention in the forward
    "serve/delta_scale.py",  # per-row output scales in the forward
    "serve/slot_vectors.py",  # the per-slot vectors of sinks and scales, read per row
    "serve/delta_activation.py",  # per-row learned activation parameters in the forward
    "serve/delta_mixer.py",  # recurrent layers run per group of rows in the forward
    "serve/kernel_warmup.py",  # kernels warmed when a variant is added while serving
    "serve/kernel_tuner.py",  # a variant added while serving queues its keys; the thread measures between steps
    "serve/kernel_tuning.py",  # what the tuner's thread runs for a key of a variant added while serving
    "serve/lora_variant.py",  # LoRA loads while serving
    "serve/lora_experts.py",  # LoRA on experts weights, read with the adapter
    "serve/lora_tokens.py",  # an adapter's token rows, read with the adapter
    "serve/variant_sources.py",  # POST /v1/variants
    "serve/variant_catalog.py",  # listing and routing by name; a variant's first request reads it
    "serve/startup_report.py",  # a variant read on first use or added logs its line
    "cluster/workers.py",  # the front (proxy, routing)
    "cluster/failover.py",  # the front's proxying and its requests in flight
    "cluster/progress.py",  # the engine's progress reports, the rules for a dead worker's requests
    "share/dedup_registry.py",  # every load goes through the registry
    "share/dedup_serving.py",
    "cluster/ray_app.py",  # the Ray Serve ingress and replicas
    "cluster/tensor_parallel.py",  # sharded forward, all-reduce hooks
    "cluster/tp_shards.py",  # what each rank keeps of a tensor, at load time
    "cluster/tp_norms.py",  # q/k norms over every head, all-reduced in the forward
    "cluster/tp_mixers.py",  # what each rank keeps of a recurrent mixer, at load time and variant loads
    "cluster/tp_alibi.py",  # ALiBi biases cut to the rank's heads, a pre-hook set at load time
    "cluster/tp_group.py",  # per-step broadcast to the worker ranks
]
OFF_PATH = {
    "serve/listen.py": "binds the port before start-up",
    "serve/kv_meter.py": "counts KV bytes copied for bench/step.py and the tests, never while serving",
    "serve/tune_ahead.py": "deltazip tune, a command run before any server starts",
    "serve/lora_summary.py": "deltazip inspect of an adapter, never while serving",
    "share/dedup_loader.py": "loads whole models for start-up and eval, never per request",
    "share/weight_share.py": "the weight owner process and a worker's attach at start-up",
}


def _lengths(path: Path) -> list[tuple[str, int, int]]:
    tree = ast.parse(path.read_text(), str(path))
    return [(n.name, n.lineno, n.end_lineno - n.lineno + 1) for n in ast.walk(tree)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def test_every_runtime_module_is_classified():
    found = {str(f.relative_to(ROOT)) for d in ("serve", "share", "cluster") for f in (ROOT / d).glob("*.py")
             if f.name != "__init__.py"}
    assert found == set(REQUEST_PATH) | set(OFF_PATH), "classify new modules as on or off the request path"


def test_no_request_path_function_exceeds_80_lines():
    long = [f"{mod}:{line} {name} ({n} lines)" for mod in REQUEST_PATH
            for name, line, n in _lengths(ROOT / mod) if n > LIMIT]
    assert not long, "functions over 80 lines on the request path:\n" + "\n".join(long)


def test_the_measure_counts_nested_functions(tmp_path):
    """A long nested function is caught even inside a short-looking outer one (the old create_app)."""
    body = "\n".join(f"        x{i} = {i}" for i in range(LIMIT + 1))
    probe = tmp_path / "probe.py"
    probe.write_text(f"def outer():\n    def inner():\n{body}\n    return inner\n")
    got = {name: n for name, _, n in _lengths(probe)}
    assert got["inner"] == LIMIT + 2 and got["outer"] == LIMIT + 4
