"""Which canonical point's op reads each HF checkpoint tensor (the reference's own names, replay/reference.py):
the base transformer's names here, and the names a model family stores otherwise (Gemma's sandwich norms,
Phi-3's fused q/k/v, GPT-OSS's router and sinks), which each family states in its folder (`Family.weight_points`,
tic_trace/families/<name>/) and which are tried first, in the registry's order. Strings only: the finder's
contract check and the view's weight dtypes read it without torch."""
from __future__ import annotations

import re
from functools import cache

from ..families import FAMILIES

_BASE = (
    (re.compile(r"model\.embed_tokens\.weight"), "embed"), (re.compile(r"model\.norm\.weight"), "final_norm"),
    (re.compile(r"lm_head\.weight"), "logits"),
    (re.compile(r"input_layernorm\."), "attn_norm"), (re.compile(r"post_attention_layernorm\."), "mlp_norm"),
    (re.compile(r"self_attn\.q_proj\."), "attn.q"), (re.compile(r"self_attn\.k_proj\."), "attn.k"),
    (re.compile(r"self_attn\.v_proj\."), "attn.v"), (re.compile(r"self_attn\.o_proj\."), "attn.out"),
    (re.compile(r"self_attn\.q_norm\."), "attn.q_norm"), (re.compile(r"self_attn\.k_norm\."), "attn.k_norm"),
    (re.compile(r"mlp\.gate\."), "moe.router_logits"), (re.compile(r"mlp\.experts\."), "moe.experts_out"),
    (re.compile(r"mlp\.shared_experts?\."), "moe.shared_out"), (re.compile(r"mlp\."), "mlp.out"),
)
_MODEL_POINTS = ("embed", "final_norm", "logits")      # read by tensors outside model.layers.N
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")


@cache
def _rows() -> tuple[tuple[re.Pattern, str], ...]:
    """Every family's (regex of a tensor's name under model.layers.N, point) rows, each once, then the base's."""
    rows = dict.fromkeys((rx, point) for fam in FAMILIES for rx, point in fam.weight_points)
    return (*((re.compile(rx), point) for rx, point in rows), *_BASE)


def hf_point_of(name: str) -> tuple[str, int | None] | None:
    """(point, layer) of the op that reads HF checkpoint tensor `name` (None: a tensor the reference does not
    read)."""
    m = _LAYER.fullmatch(name)
    layer, rest = (int(m.group(1)), m.group(2)) if m else (None, name)
    for rx, point in _rows():
        if (m is None) == (point in _MODEL_POINTS) and rx.match(rest):
            return point, layer
    return None
