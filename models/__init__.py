"""Model anatomy and checkpoint access shared by compression and the runtime.

``checkpoint`` (lazy, integrity-checked access to a model directory's tensors), ``model_walk``
(decoder layers, linears, Conv1D and fused experts found generically, true-sequential groups),
``layer_map`` (a layer's checkpoint tensors mapped to its parameters), ``expert_tap`` (which
expert a fused parameter's matmul runs) and ``projection_groups`` (the sibling projections the
runtime stacks into one GEMM). It sits between ``formats`` and ``compress``: the runtime
reads models through it without climbing into ΔCompress.
"""
