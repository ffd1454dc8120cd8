"""The DeepSeek family's name tables by framework (`Family.names`): HF's (names_hf.py), Megatron's
(names_megatron.py), SGLang's (names_sglang.py), strings and `graph.adapter` rows only, no framework import; the
refusals of setups the tests did not run (refusals.py). What each table key means to its adapter:

- hf: `describe` (the text config -> MLA's manifest facts), `applies` (row, manifest config -> False where MLA
  decides the row does not apply; None: no say), `router_bias` (the router's selection bias, its attribute path
  under a decoder layer: adapters/router_facts.py; SGLang's module tree names it the same), `taps` (a module
  name's last part -> the functions of its modeling module to tap: MLA's interleaved RoPE).
- megatron: `attention_rows` (the self-attention record prefix regex -> MLA's rows), `applies` (row, those rows,
  manifest config -> False / None as HF's), `describe` (megatron's TransformerConfig -> MLA's manifest facts),
  `refusal` (manifest config -> why its setup is not verified, or None), `attention_weights` (HF -> Megatron
  parameter names of its attention), `router_bias` (the router's selection bias: HF's name -> Megatron's, under
  `mlp.`; both adapters/megatron_weights.py), `attention_switch` (the TransformerConfig switch under which its
  own attention module stands in for SelfAttention: its q_layernorm is the q latent's norm, not a QK-norm, and
  adapters/megatron_weight_map.py maps none of its parameters).
- sglang: `modules` (module lists by key), `arch_of_class` (class -> key), `one_rank` (classes verified at TP=1
  only), `inputs` (class -> module inputs recorded), `describe` (the text config -> MLA's facts, for an MLA
  model), `applies` (row, manifest config -> False / None), `refusal` (manifest config -> why, or None),
  `attention_facts` (a layer's live `self_attn` module, the server arguments, a reader of SGLang's constants ->
  the manifest's attention facts where the attention is MLA: adapters/sglang_facts.py), `constants` (key ->
  (module, name) of the SGLang constants those facts read).
"""
from __future__ import annotations

from ..base import FrameworkNames
from . import names_hf as hf
from . import names_megatron as mg
from . import names_sglang as sgl
from .refusals import latent_refusal, setup_refusal
from .spec import HF_ROUTER_BIAS


def names() -> dict[str, FrameworkNames]:
    return {"hf": FrameworkNames(points=hf.HF_POINTS, architectures=hf.HF_ARCHITECTURES,
                                 tables={"describe": hf.latent_facts, "applies": hf.latent_applies,
                                         "router_bias": HF_ROUTER_BIAS, "taps": {"self_attn": hf.TAPPED}}),
            "megatron": FrameworkNames(architectures=mg.MEGATRON_ARCHITECTURES,
                                       tables={"attention_rows": mg.latent_points, "applies": mg.latent_applies,
                                               "describe": mg.latent_facts, "refusal": latent_refusal,
                                               "attention_weights": mg.MLA_WEIGHTS, "router_bias": mg.ROUTER_BIAS,
                                               "attention_switch": mg.MLA_SWITCH}),
            "sglang": FrameworkNames(points=sgl.ROWS, architectures=sgl.SGLANG_ARCHITECTURES,
                                     refused=sgl.SGLANG_REFUSED,
                                     tables={"modules": sgl.SGLANG_MODULES, "arch_of_class": sgl.SGLANG_ARCH_OF_CLASS,
                                             "one_rank": sgl.SGLANG_ONE_RANK, "inputs": sgl.INPUTS,
                                             "describe": hf.latent_facts, "applies": sgl.row_applies,
                                             "refusal": setup_refusal, "router_bias": HF_ROUTER_BIAS,
                                             "attention_facts": sgl.attention_facts, "constants": sgl.CONSTANTS})}
