"""The tensor-parallel process group: rank 0 serves, ranks ``1..n-1`` mirror every forward.

Process model (``deltazip serve --tensor-parallel N``): rank 0 is the usual server process (HTTP,
scheduler, engine); it spawns ``N - 1`` worker processes (``torch.multiprocessing``, spawn) that
join a ``torch.distributed`` group on ``127.0.0.1``. Every rank holds a
:class:`~deltazip.runtime.cluster.tensor_parallel.ShardedDeltaModel`. The engine talks to
:class:`TPLeader`, which has the backend interface of a ``DeltaModel``: each call that changes
what the model computes (slot writes and clears, variants added or removed, forwards) is first
broadcast to the workers as one small command, then run locally; the workers run the same call
on their shard, in the same order, so the all-reduces of the row-parallel layers pair up.

A forward command carries the step's token ids, positions, attention mask and slot per row (CPU
tensors), plus one key per row naming the sequence whose KV cache the row extends. Workers keep
their own KV caches (their heads only) keyed that way, in the engine's own pool classes; rank 0
names the sequences whose caches it freed since the last step so that workers free them too
(a preempted sequence keeps its worker-side cache until it resumes or ends). Logits come from
rank 0 (``lm_head`` is replicated; workers compute and drop theirs).

Commands travel over a gloo group (pickled Python objects between our own processes); the
all-reduces over NCCL on GPUs (rank ``r`` on ``cuda:r``), gloo on CPU.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import sys
import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from deltazip.formats.errors import InputError

log = logging.getLogger(__name__)

# Workers wait for the next command as long as the server runs (an idle server sends none).
_CONTROL_TIMEOUT = datetime.timedelta(days=365)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TPGroup:
    """This process's place in the group: ``rank`` of ``world``, the device it computes on.

    ``all_reduce`` sums a tensor over ranks in place (NCCL on CUDA, gloo on CPU); ``broadcast``
    sends a Python object from rank 0 to every rank over the gloo control group.
    """

    def __init__(self, rank: int, world: int, port: int, device: torch.device):
        self.rank, self.world, self.device = rank, world, device
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        # Commands on their own gloo group (host objects, and a long timeout for an idle server).
        self.control = dist.new_group(backend="gloo", timeout=_CONTROL_TIMEOUT)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t)
        return t

    def broadcast(self, obj: Any = None) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def gather_errors(self, error: str | None) -> list[str]:
        """Every rank's error (None for success) after a collective step; the non-None ones."""
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, error, group=self.control)
        return [e for e in out if e]

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank ``rank``'s device: ``cuda:rank`` when serving on CUDA, else the CPU."""
    return torch.device("cuda", rank) if device.type == "cuda" else torch.device("cpu")


@dataclass
class WorkerSpec:
    """What a worker needs to build its shard of the served model (picklable)."""

    base: str
    variants: list
    num_slots: int
    device: str
    dtype: torch.dtype
    delta_compute: str
    max_cpu: int
    threads: int
    parent_pid: int


def _build(spec: WorkerSpec, group: TPGroup):
    from deltazip.models.checkpoint import Checkpoint
    from deltazip.runtime.cluster.tensor_parallel import ShardedDeltaModel

    return ShardedDeltaModel(Checkpoint(spec.base, "base"), spec.variants, spec.num_slots, group.device, spec.dtype,
                             group, delta_compute=spec.delta_compute)


def _watch_parent(pid: int) -> None:
    """Exit when the serving process is gone (killed without telling us), instead of waiting forever."""
    while True:
        time.sleep(1.0)
        if os.getppid() != pid:
            os._exit(0)


def worker_main(index: int, world: int, port: int, spec: WorkerSpec) -> None:
    """Entry point of rank ``index + 1`` (``torch.multiprocessing`` passes the process index)."""
    threading.Thread(target=_watch_parent, args=(spec.parent_pid,), daemon=True).start()
    torch.set_num_threads(spec.threads)
    rank = index + 1
    group = TPGroup(rank, world, port, rank_device(torch.device(spec.device), rank))
    try:
        model, error = _build(spec, group), None
    except Exception as e:  # reported to rank 0, which fails the start-up with it
        model, error = None, f"rank {rank}: {type(e).__name__}: {e}"
    if group.gather_errors(error) or model is None:
        group.close()
        return
    try:
        TPWorker(model, group, spec.max_cpu).run()
    finally:
        group.close()
    # Stopped cleanly: leave without the interpreter's teardown, in which a gloo thread still joinable
    # when its C++ object is destroyed aborts the process (SIGABRT, "terminate called without an
    # active exception"), and rank 0 would take that for a crash.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class TPWorker:
    """A worker's command loop: mirror rank 0's slot changes and forwards on its own shard."""

    def __init__(self, model, group: TPGroup, max_cpu: int):
        from deltazip.runtime.serve.model_runner import new_kv_pool

        self.model, self.group = model, group
        self.hosts: OrderedDict[str, Any] = OrderedDict()  # variant -> sharded host copy (LRU)
        self.max_hosts = max(1, max_cpu + model.num_slots)
        self.pool = new_kv_pool(model)  # the engine's kind of pool: paged, or contiguous (ALiBi models)
        self.kv: dict[int, Any] = {}  # rank 0's sequence key -> this rank's SeqKV / SeqBlocks
        self.cross: dict[int, Any] = {}  # sequence key -> its images' CrossInputs, this rank's heads (Mllama)

    def run(self) -> None:
        while True:
            cmd = self.group.broadcast()
            op = cmd[0]
            if op == "stop":
                return
            if op == "forward":  # an error here ends the worker: rank 0's all-reduce then fails too
                self.forward(*cmd[1:])
            elif op == "fork":
                self.kv[cmd[2]] = self.kv[cmd[1]].fork()
                if cmd[1] in self.cross:  # the samples of a prompt share its images' keys
                    self.cross[cmd[2]] = self.cross[cmd[1]]
            elif op == "write":
                self.write(*cmd[1:])
            else:
                try:
                    self.apply(op, cmd[1])
                except Exception:  # rank 0 ran the same call and reports its own failure
                    log.exception("rank %d: %s %s failed", self.group.rank, op, cmd[1])

    def apply(self, op: str, arg) -> None:
        if op == "clear":
            self.model.clear_slot(arg)
        elif op == "commit":
            wanted: dict[str, str] = {}
            self.model.commit_variant(arg, self.model.prepare_variant(arg, wanted), wanted)
        elif op == "remove":
            self.model.remove_variant(arg)
            self.hosts.pop(arg, None)

    def write(self, slot: int, name: str) -> None:
        error = None
        try:
            host = self.hosts.pop(name, None) or self.model.load_host(name)
            self.hosts[name] = host
            while len(self.hosts) > self.max_hosts:
                self.hosts.popitem(last=False)
            self.model.write_slot(slot, name, host)
        except Exception as e:  # the leader fails the load for every rank
            error = f"rank {self.group.rank}: {type(e).__name__}: {e}"
            self.model.clear_slot(slot)
        self.group.gather_errors(error)

    def forward(self, row_slots, ids, pos, mask, keys, past, new, freed, images=None) -> None:
        """Rank 0's step on this rank's shard; ``images``: the step's image rows and widened query
        views (:func:`_image_args`), which every rank puts in place as rank 0 does."""
        from deltazip.runtime.serve.model_runner import new_seq_kv, step_cache

        for k in freed:
            c = self.kv.pop(k, None)
            if c is not None:
                c.free()
            self.cross.pop(k, None)
        caches = [self.kv.setdefault(k, new_seq_kv(self.pool)) for k in keys]
        dev = self.group.device
        images = dict(images or {})
        cross = images.pop("cross", None)
        with torch.inference_mode():
            kv = step_cache(self.pool, caches, past, new, dev)
            for name, value in images.items():
                setattr(kv, name, value.to(dev))
            if cross is not None:
                self._cross_step(kv, cross, keys, past, new, ids.shape[1])
            self.model.forward(row_slots, ids.to(dev), pos.to(dev), _mask_to(mask, dev), kv)
        for c, n in zip(caches, new):
            c.length += n


    def _cross_step(self, kv, new_rows: dict, keys: list[int], past: list[int], new: list[int], tm: int) -> None:
        """Images read by cross-attention (Mllama): the keys of sequences seen for the first time, made
        by this rank's own heads from the vision states rank 0 sent (``new_rows``: key -> ``(slot,
        states, layers, views, view_of)``, the request's variant bound), then the step's view of its
        rows' keys, as ``model_runner.forward_step`` makes rank 0's."""
        from types import SimpleNamespace

        from deltazip.runtime.serve.cross_attention import CrossInputs, cross_keys, cross_step

        dev = self.group.device
        for key, (slot, states, layers, views, view_of) in new_rows.items():
            self.model.ctx.bind([slot], dev)
            try:
                ks, vs = cross_keys(self.model.model, states.to(device=dev, dtype=self.model.dtype))
            finally:
                self.model.ctx.unbind()
            self.cross[key] = CrossInputs(layers, ks, vs, views, view_of)
        rows = [SimpleNamespace(cross=self.cross.get(k)) for k in keys]
        kv.cross = cross_step(rows, past, new, tm)
        if kv.cross is not None:
            kv.layers = kv.cross.layers


def _mask_to(mask, device: torch.device):
    """A step's attention mask argument on ``device``: a tensor, or per layer type one (a hybrid
    model's: its recurrent layers take a 2-D padding mask, its attention layers a 4-D one)."""
    if isinstance(mask, dict):
        return {k: _mask_to(m, device) for k, m in mask.items()}
    return mask.to(device) if isinstance(mask, torch.Tensor) else mask


def _image_args(kv) -> dict:
    """What a step of rows with images sets on its cache object beyond the layout
    (``model_runner.forward_step``): the image rows (``prompt_embeds``) and the widened query views
    (``see``), on the CPU for the broadcast; empty for a text step."""
    out = {}
    if getattr(kv, "prompt_embeds", None) is not None:
        out["prompt_embeds"] = kv.prompt_embeds.to("cpu")
    if getattr(kv, "see", None) is not None:
        out["see"] = kv.see.to("cpu")
    return out


def _in_pool(c) -> bool:
    """Whether a sequence's KV cache holds pool memory (a ``SeqKV`` row or ``SeqBlocks`` blocks)."""
    return getattr(c, "row", None) is not None or bool(getattr(c, "blocks", None))


class TPLeader:
    """Rank 0's backend for the engine: a ``ShardedDeltaModel`` whose state changes are mirrored.

    Everything the engine or the server reads (``config``, ``variants``, ``slot_bytes``...) comes
    from the local model; the calls listed in the module docstring are broadcast first.
    """

    def __init__(self, model, group: TPGroup, processes):
        self._model, self._group, self._processes = model, group, processes
        self._keys: dict[int, tuple[weakref.ref, int]] = {}  # id(SeqKV) -> (ref, key)
        self._next_key = 0
        self._freed_early: list[int] = []  # keys found freed outside a forward, sent with the next one
        self._cross_sent: set[int] = set()  # sequence keys whose images' vision states the workers hold
        self._closed = False

    def __getattr__(self, name: str):
        return getattr(self._model, name)

    @property
    def tensor_parallel(self) -> int:
        return self._group.world

    def write_slot(self, slot: int, name: str, host) -> None:
        self._group.broadcast(("write", slot, name))
        error = None
        try:
            self._model.write_slot(slot, name, host)
        except Exception as e:
            error = f"rank 0: {type(e).__name__}: {e}"
            self._model.clear_slot(slot)
        errors = self._group.gather_errors(error)
        if errors:
            raise RuntimeError(f"loading {name} into slot {slot} failed on {len(errors)} rank(s): {errors[0]}")

    def clear_slot(self, slot: int) -> None:
        self._group.broadcast(("clear", slot))
        self._model.clear_slot(slot)

    def commit_variant(self, v, plan, wanted=None) -> None:
        self._group.broadcast(("commit", v))
        self._model.commit_variant(v, plan, wanted)

    def remove_variant(self, name: str) -> None:
        self._group.broadcast(("remove", name))
        self._model.remove_variant(name)

    def fork_kv(self, parent, child) -> None:
        """Sequence ``child`` was forked from ``parent`` (a sample of ``n > 1``): the workers fork theirs."""
        freed: list[int] = []
        keys = [self._key_of(c, freed) for c in (parent, child)]
        self._group.broadcast(("fork", keys[0], keys[1]))
        self._freed_early += freed
        if keys[0] in self._cross_sent:  # the workers copy the parent's images' keys with its cache
            self._cross_sent.add(keys[1])

    def _key_of(self, c, freed: list[int]) -> int:
        held = self._keys.get(id(c))
        if held is not None and held[0]() is not c:  # the id of a collected cache, reused
            freed.append(held[1])
            held = None
        if held is None:
            held = (weakref.ref(c), self._next_key)
            self._next_key += 1
            self._keys[id(c)] = held
        return held[1]

    def _sequence_keys(self, caches) -> tuple[list[int], list[int]]:
        """A stable key per row's KV cache, and the keys of caches freed since the last step."""
        freed, self._freed_early = self._freed_early, []
        keys = [self._key_of(c, freed) for c in caches]
        here = {id(c) for c in caches}
        for ident, (ref, key) in list(self._keys.items()):
            c = ref()
            # Gone, or given back (no pool row, no host copy): a finished sequence. A preempted
            # one keeps a host copy, and so keeps its worker-side cache.
            if ident not in here and (c is None or (not _in_pool(c) and c.host is None)):
                freed.append(key)
                del self._keys[ident]
        return keys, freed

    def forward(self, row_slots: list[int], input_ids, position_ids, attention_mask, kv) -> torch.Tensor:
        keys, freed = self._sequence_keys(kv.caches)
        cpu = torch.device("cpu")
        images = _image_args(kv)
        cross = self._cross_args(kv, keys, row_slots, freed)
        if cross is not None:
            images["cross"] = cross
        self._group.broadcast(("forward", list(row_slots), input_ids.to(cpu), position_ids.to(cpu),
                               _mask_to(attention_mask, cpu), keys, list(kv.past), list(kv.new), freed, images))
        return self._model.forward(row_slots, input_ids, position_ids, attention_mask, kv)

    def _cross_args(self, kv, keys: list[int], row_slots: list[int], freed: list[int]) -> dict | None:
        """For a step with images read by cross-attention (Mllama): the vision states, slot and views
        of each sequence the workers have not seen yet (key -> tuple, on the CPU; rank 0 drops its
        copy of the states once sent), else None. Each worker makes its own heads' keys from them."""
        for k in freed:
            self._cross_sent.discard(k)
        step = getattr(kv, "cross", None)
        if step is None:
            return None
        out = {}
        for key, slot, c in zip(keys, row_slots, step.rows):
            if c is None or key in self._cross_sent:
                continue
            if c.states is None:
                raise RuntimeError("a sequence's images were read without their vision states for the workers")
            out[key] = (slot, c.states.to("cpu"), c.layers, c.views, c.view_of)
            self._cross_sent.add(key)
            c.states = None  # rank 0's own keys are made; the workers now hold theirs
        return out

    def prompt_inputs(self, slot: int, prompt_ids: list[int], media):
        """What the model's forward makes of a prompt with images, on rank 0 alone: that forward
        stops before the first decoder layer, and the vision tower, projector and embeddings are
        whole on every rank (``tensor_parallel.shard_kind``), so no rank has a part to add. Images
        read by cross-attention keep their vision states: each rank makes its own heads' keys."""
        return self._model.prompt_inputs(slot, prompt_ids, media, keep_states=True)

    def close(self) -> None:
        """Stop the workers and leave the group (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._group.broadcast(("stop",))
        except Exception as e:  # a worker already gone: terminate the rest below
            log.warning("stopping tensor-parallel workers: %s", e)
        finally:
            try:
                self._processes.join(timeout=60)
            except Exception as e:  # a worker that died on its way out: still leave the group below
                log.warning("a tensor-parallel worker did not stop cleanly: %s", e)
            for p in self._processes.processes:
                if p.is_alive():
                    p.terminate()
                    p.join(5)
            self._group.close()


def start_tensor_parallel(base, variants: list, num_slots: int, device: torch.device, dtype: torch.dtype,
                          world: int, delta_compute: str = "auto", max_cpu: int = 16, registry=None,
                          ledger=None) -> TPLeader:
    """Spawn ranks ``1..world-1``, join the group as rank 0 and build every rank's shard.

    Raises:
        InputError: a model or variant the group cannot shard (checked before any process starts),
            too few GPUs, or a rank that failed to build its shard (its message).
    """
    import torch.multiprocessing as mp

    from deltazip.runtime.cluster.tensor_parallel import (
        ShardedDeltaModel,
        check_config,
        check_variants,
        checkpoint_layers,
    )

    config = _base_config(base)
    check_config(config, world)
    check_variants(variants, world, checkpoint_layers(base.path))
    if device.type == "cuda" and torch.cuda.device_count() < world:
        raise InputError(f"--tensor-parallel {world} needs {world} GPUs, {torch.cuda.device_count()} visible; lower "
                         f"the degree or make more GPUs visible (CUDA_VISIBLE_DEVICES)")
    port = free_port()
    spec = WorkerSpec(str(base.path), variants, num_slots, device.type, dtype, delta_compute, max_cpu,
                      torch.get_num_threads(), os.getpid())
    procs = mp.start_processes(worker_main, args=(world, port, spec), nprocs=world - 1, join=False, daemon=True,
                               start_method="spawn")
    group = TPGroup(0, world, port, rank_device(device, 0))
    try:
        model, error = ShardedDeltaModel(base, variants, num_slots, group.device, dtype, group,
                                         delta_compute=delta_compute, registry=registry, ledger=ledger), None
    except Exception as e:
        model, error = None, f"rank 0: {type(e).__name__}: {e}"
    errors = group.gather_errors(error)
    if errors:
        procs.join(timeout=60)
        group.close()
        raise InputError(f"tensor-parallel start-up failed on {len(errors)} rank(s): {errors[0]}")
    return TPLeader(model, group, procs)


def _base_config(base):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(base.path))

