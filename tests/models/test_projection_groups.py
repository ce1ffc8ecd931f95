"""The owner's layout order (``deltazip.models.projection_groups.layout_runs``): each q/k/v and
gate/up group of one module is one run in the order the runtime stacks it; nothing else moves."""

from __future__ import annotations

from deltazip.models.projection_groups import layout_runs


def test_groups_become_runs_in_stacking_order_and_other_names_keep_their_place():
    attn, mlp = "model.layers.0.self_attn", "model.layers.0.mlp"
    names = ["model.embed_tokens.weight", f"{mlp}.down_proj.weight", f"{mlp}.up_proj.weight",
             f"{attn}.k_proj.bias", f"{attn}.k_proj.weight", f"{attn}.o_proj.weight", f"{attn}.q_proj.bias",
             f"{attn}.q_proj.weight", f"{mlp}.gate_proj.weight", f"{attn}.v_proj.bias", f"{attn}.v_proj.weight",
             "model.layers.1.self_attn.q_proj.weight", "model.norm.weight"]
    assert layout_runs(names) == [
        ["model.embed_tokens.weight"], [f"{mlp}.down_proj.weight"],
        [f"{mlp}.gate_proj.weight", f"{mlp}.up_proj.weight"],
        [f"{attn}.q_proj.bias", f"{attn}.k_proj.bias", f"{attn}.v_proj.bias"],
        [f"{attn}.q_proj.weight", f"{attn}.k_proj.weight", f"{attn}.v_proj.weight"],
        [f"{attn}.o_proj.weight"], ["model.layers.1.self_attn.q_proj.weight"], ["model.norm.weight"]]
    assert sorted(n for run in layout_runs(names) for n in run) == sorted(names)
