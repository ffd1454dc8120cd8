"""SGLang version differences planted into the 0.5.23 model code we run. TEST SUPPORT ONLY.

slime ships SGLang 0.5.15.post1 (its Dockerfile at 624b824a8). Its model code cannot run beside our pins
(it is written against its own sgl-kernel / layer-communicator APIs), so the one difference that matters to
the adapter is reproduced in 0.5.23's computation instead: in 0.5.15.post1 every MoE block all-reduces its
own output (``python/sglang/srt/models/qwen3_moe.py`` ``Qwen3MoeSparseMoeBlock.forward_normal``, around lines
329-344: ``if self.tp_size > 1 and not use_reduce_scatter: final_hidden_states =
tensor_model_parallel_all_reduce(final_hidden_states)``; the same in qwen2_moe, glm4_moe, deepseek_v2), so the
module ``model.layers.N.mlp`` returns the full sum on every rank, while 0.5.23 returns each rank's partial
and defers the reduction to the layer boundary.
"""
from __future__ import annotations

import torch


#: Whether each release's MoE blocks all-reduce their own output (tests/test_sglang_versions.py checks both in
#: the releases' source).
BLOCK_REDUCES_ITSELF = {"0.5.15.post1": True, "0.5.23": False}


def moe_block_reduces_itself() -> bool:
    """Whether the installed SGLang's MoE blocks all-reduce their own output (0.5.15.post1, slime's pin)."""
    from importlib.metadata import version
    return BLOCK_REDUCES_ITSELF[version("sglang")]


def reduce_moe_output_in_block(model: torch.nn.Module) -> int:
    """Make every MoE block of an SGLang 0.5.23 model return its TP-reduced output, as 0.5.15.post1's do (on
    0.5.15.post1 itself, the slime-stack lane, nothing is changed: its blocks do so).

    The block's forward all-reduces its result (the recorded ``mlp`` output is the full sum, equal on every
    rank); the layer's FFN boundary, which in 0.5.23 still performs the deferred all-reduce, gets that sum
    divided by the TP size, so the model computes exactly what it did before (division by a power of two and
    adding the equal halves back are exact). Returns the number of blocks changed."""
    if moe_block_reduces_itself():     # the installed release is 0.5.15's kind: its own blocks do it already
        return sum(hasattr(getattr(layer, "mlp", None), "experts")
                   for layer in getattr(getattr(model, "model", None), "layers", []))
    from sglang.srt.distributed import tensor_model_parallel_all_reduce
    from sglang.srt.runtime_context import get_parallel

    tp = int(get_parallel().tp_size)
    if tp & (tp - 1):
        raise ValueError(f"tp={tp}: the exact rescaling needs a power-of-two TP size")
    changed = 0
    for layer in getattr(getattr(model, "model", None), "layers", []):
        mlp = getattr(layer, "mlp", None)
        if mlp is None or not hasattr(mlp, "experts"):
            continue
        block_forward = mlp.forward

        def forward(*a, _f=block_forward, **kw):
            return tensor_model_parallel_all_reduce(_f(*a, **kw))
        mlp.forward = forward
        boundary_finish = layer.ffn_boundary.finish

        def finish(hidden_states, *a, _f=boundary_finish, **kw):
            return _f(hidden_states / tp, *a, **kw)
        layer.ffn_boundary.finish = finish
        changed += 1
    return changed
