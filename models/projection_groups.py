"""Sibling projections that read the same input, in the order the serving engine stacks them.

A Llama-family attention block projects one hidden state with ``q_proj``, ``k_proj`` and
``v_proj``, its MLP with ``gate_proj`` and ``up_proj``. The decoupled runtime computes each group
as one GEMM over the members' weights stacked along the output rows
(``deltazip.runtime.serve.projections``). The weight owner of ``serve --workers K`` lays every
group out back to back in this order (:func:`layout_runs`), so that a worker's stacked weight is a
view of the shared buffer rather than a private copy of it. No torch here: the owner never imports
it.
"""

from __future__ import annotations

from collections.abc import Iterable

PROJECTION_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))

_MEMBER = {m: (g, i) for g, names in enumerate(PROJECTION_GROUPS) for i, m in enumerate(names)}


def layout_runs(names: Iterable[str]) -> list[list[str]]:
    """Checkpoint tensor names cut into runs to lay out back to back, in the order given except that
    the members of one group (same parent module, same ``weight``/``bias``) form one run in group
    order, at the position of the first of them; every other name is a run of its own.

    Example: ``[a.k_proj.weight, a.o_proj.weight, a.q_proj.weight, a.v_proj.weight]`` ->
    ``[[a.q_proj.weight, a.k_proj.weight, a.v_proj.weight], [a.o_proj.weight]]``.
    """
    runs: list[list[str]] = []
    groups: dict[tuple[str, int, str], list[str]] = {}
    for name in names:
        parent, member, suffix = _split(name)
        hit = _MEMBER.get(member)
        if hit is None:
            runs.append([name])
            continue
        key = (parent, hit[0], suffix)
        if key not in groups:
            groups[key] = []
            runs.append(groups[key])
        groups[key].append(name)
    order = {name: _MEMBER.get(_split(name)[1], (0, 0))[1] for run in runs for name in run}
    return [sorted(run, key=order.__getitem__) for run in runs]


def _split(name: str) -> tuple[str, str, str]:
    """``a.b.q_proj.weight`` -> (``a.b``, ``q_proj``, ``weight``)."""
    head, _, suffix = name.rpartition(".")
    parent, _, member = head.rpartition(".")
    return parent, member, suffix
