"""Qwen3-Next: hybrid decoders whose layers run either gated softmax attention (q_proj gives each head's query
and a sigmoid gate on the attention output; per-head QK-norm, partial RoPE) or Gated DeltaNet linear attention
(in-projections, causal conv + SiLU, the gated delta rule, a gated RMSNorm), with (1 + w) RMSNorms and a sparse
MoE whose shared expert is sigmoid-gated.

What is verified per framework:
- HF (`Qwen3NextForCausalLM`, transformers 5.24, its pure-torch conv and delta-rule paths): every point of both
  layer kinds mapped, replayed exactly in float64 (the recurrence in its sequential form) with the clean
  variants of its own ops, faults planted in its computation found at their point and layer, cached decode
  steps against one forward (tests/test_archs_qwen3next.py, tests/test_supported_archs.py).
- Megatron: not verified; megatron-core's gated attention and Gated DeltaNet switches are refused
  (adapters/megatron_features.py).
- SGLang: not verified; its linear attention's kernels are Triton only (`names.SGLANG_REFUSED`).

Folder: spec.py (config facts, shapes, feeds and op names; no torch), ops.py (float64 ops), variants.py (clean
variants and the gated norm's known fault), names.py (HF rows, SGLang's refusal).
"""
from __future__ import annotations

from ..base import Family, lazy
from . import points
from .spec import WHOLE_SAMPLE_OPS, facts, inputs_of, op_of, shapes


FAMILY = Family(
    name="qwen3_next",
    title="Qwen3-Next",
    model_types=("qwen3_next",),
    description="hybrid layers of gated softmax attention or Gated DeltaNet linear attention, (1 + w) RMSNorms, "
                "a MoE with a sigmoid-gated shared expert",
    verified={"hf": "every point of both layer kinds (gated attention, linear attention), replayed; cached decode"},
    points=points.POINTS,
    remarks=points.REMARKS,
    facts=facts,
    shapes=shapes,
    ops=lazy(__name__, ".ops", "ops"),
    inputs_of=inputs_of,
    op_of=op_of,
    variants=lazy(__name__, ".variants", "variants", cache=True),
    whole_sample_ops=WHOLE_SAMPLE_OPS,
    names=lazy(__name__, ".names", "names"),
)
