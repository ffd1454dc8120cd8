"""Llama, Qwen2, Phi-3 (dense), Mixtral and Qwen2-MoE (MoE) through megatron-core 0.16.1's plain ``GPTModel``
structures (local spec, one rank) against HF's classes of those families with the same weights: the families the
Megatron table lists beside Qwen3 / Qwen3-MoE. fp32 consistent with every point the exact op; bf16 with
``--reference`` blames no side; faults planted in Megatron's computation (where each family differs from Qwen3:
no QK-norm, q/k/v bias, RoPE base, partial RoPE, fused projections, a renormalised softmax router, a sigmoid-gated
shared expert) found at their point and layer."""
from __future__ import annotations

import megatron.core  # noqa: F401 - a required test dependency: fail loudly if missing
import pytest
import torch
import transformers as T

from tic_trace import find_divergence
from tic_trace.adapters import megatron as mg_adapter
from tic_trace.adapters.megatron_weights import hf_to_megatron_state_dict, load_into
from tic_trace.replay.intrinsic_verdict import intrinsic_walk
from tic_trace.replay.reference import ExactReference
from tic_trace.testing import megatron_cpu as mc
from tic_trace.testing.hf_models import build_hf_model_stable, sample_tokens
from tic_trace.view.align import CanonicalView

from conftest import assert_every_point_is_its_exact_op, assert_planted_fault_found, checkpointed_sides, trace_megatron

IDS = sample_tokens(2, 10)
_COMMON = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               head_dim=16, intermediate_size=128, max_position_embeddings=256, rms_norm_eps=1e-6,
               tie_word_embeddings=False)
CONFIGS = {
    "llama": lambda: T.LlamaConfig(**_COMMON, rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
    "qwen2": lambda: T.Qwen2Config(**_COMMON),
    "mixtral": lambda: T.MixtralConfig(**_COMMON, num_local_experts=4, num_experts_per_tok=2),
    "phi3": lambda: T.Phi3Config(**{k: v for k, v in _COMMON.items() if k != "head_dim"}, pad_token_id=0,
                                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                  "partial_rotary_factor": 0.5}),
    "qwen2_moe": lambda: T.Qwen2MoeConfig(**_COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                          shared_expert_intermediate_size=64),
}
ARCH = {"llama": "GPTModel/TransformerLayer/SelfAttention/MLP", "qwen2": "GPTModel/TransformerLayer/SelfAttention/MLP",
        "mixtral": "GPTModel/TransformerLayer/SelfAttention/MoELayer",
        "qwen2_moe": "GPTModel/TransformerLayer/SelfAttention/MoELayer",
        "phi3": "GPTModel/TransformerLayer/SelfAttention/MLP"}
FAMILY = {"llama": "Llama", "qwen2": "Qwen2", "mixtral": "Mixtral", "qwen2_moe": "Qwen2-MoE", "phi3": "Phi-3"}


def _config(name: str):
    cfg = CONFIGS[name]()
    cfg._attn_implementation = "eager"
    return cfg


def _megatron_view(cfg) -> dict:
    """The HF config under the names megatron_cpu reads (Qwen3's), with what Qwen3 has and these lack off."""
    keys = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "intermediate_size", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
            "rope_parameters")
    out = {k: getattr(cfg, k, None) for k in keys}
    out["head_dim"] = out["head_dim"] or cfg.hidden_size // cfg.num_attention_heads
    out["attention_bias"] = cfg.model_type in ("qwen2", "qwen2_moe") or bool(getattr(cfg, "attention_bias", False))
    if cfg.model_type == "mixtral":     # softmax over all, top-k, always renormalised
        out.update(num_experts=cfg.num_local_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                   moe_intermediate_size=cfg.intermediate_size, norm_topk_prob=True)
    if cfg.model_type == "qwen2_moe":   # softmax over all, top-k, not renormalised (norm_topk_prob False)
        out.update({k: getattr(cfg, k) for k in ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                                                 "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers")})
    return out


def _megatron_overrides(cfg) -> dict:
    """TransformerConfig fields megatron_cpu does not derive: Qwen2-MoE's one sigmoid-gated shared expert."""
    if cfg.model_type == "qwen2_moe":
        return {"moe_shared_expert_intermediate_size": cfg.shared_expert_intermediate_size,
                "moe_shared_expert_gate": True}
    return {}


@pytest.fixture(scope="module")
def hf_side(tmp_path_factory, megatron_rank):
    """hf_side(name, dtype) -> (checkpoint dir, HF trace dir, HF state dict), built once per module."""
    return checkpointed_sides(tmp_path_factory, lambda name, dtype: build_hf_model_stable(_config(name), dtype=dtype),
                              IDS)


def _megatron(out, name: str, sd, dtype, plant=None) -> str:
    cfg = _config(name)
    view = _megatron_view(cfg)
    model = mc.build_gpt_model(view, dtype=dtype, qk_layernorm=False, **_megatron_overrides(cfg))
    load_into(model, hf_to_megatron_state_dict(sd, view))
    if plant is not None:
        with torch.no_grad():
            plant(model)
    return trace_megatron(model, out, cfg.vocab_size, IDS)


def test_the_table_lists_these_families_under_the_structures_they_ran_through():
    for name, arch in ARCH.items():
        assert FAMILY[name] in mg_adapter.ARCHITECTURES[arch].families


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_clean_fp32_pair_is_consistent_and_every_point_is_its_exact_op(tmp_path, hf_side, name):
    ck, hf, sd = hf_side(name, torch.float32)
    mgt = _megatron(tmp_path / "mg", name, sd, torch.float32)
    rep = find_divergence(str(hf), mgt)
    assert rep.verdict == "consistent" and rep.not_comparable == [], (rep.verdict, rep.not_comparable)
    v = CanonicalView(mgt)
    assert (v.config["architecture"], v.config["architecture_verified"], v.config["qk_layernorm"]) == \
        (ARCH[name], True, False)
    points = {p for p, _ in v.points()}
    assert points == set(v.adapter.promised_points(v.config)) | {"logprobs"}
    assert not {"attn.q_norm", "attn.k_norm"} & points
    results = assert_every_point_is_its_exact_op(v, ck)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_clean_bf16_pair_with_reference_blames_no_side(tmp_path, hf_side, name):
    ck, hf, sd = hf_side(name, torch.bfloat16)
    mgt = _megatron(tmp_path / "mg", name, sd, torch.bfloat16)
    rep = find_divergence(str(hf), mgt, reference=str(ck))
    assert [d for d in rep.contract if d["section"] == "config"] == []
    assert not [n for n in rep.notes if n.kind == "not_replayed"]
    if name == "mixtral":
        # a real difference of the defaults: HF's Mixtral keeps the top-k weights in fp32, megatron-core rounds
        # them to bf16 (docs/replay.md "Why precision findings count"): said as precision, Megatron the coarser
        precision = [p for p in rep.points if (p.replay or {}).get("kind") == "precision"]
        assert {p.point for p in precision} == {"moe.topk_weights"} and all(p.replay["side"] == "B" for p in precision)
        rep = find_divergence(str(hf), mgt, reference=str(ck), accept_precision=("moe.topk_weights",))
    assert {f.cause for f in rep.findings if f.divergent} <= {"routing"}, [f.key for f in rep.findings]
    walk = intrinsic_walk(CanonicalView(str(hf)), CanonicalView(mgt), ExactReference(str(ck)))
    blamed = [w for w in walk if w.side and not (name == "mixtral" and
                                                 (w.point, w.kind) == ("moe.topk_weights", "precision"))]
    assert walk and not blamed, blamed


def _scale(path: str, name: str = "weight", factor: float = 1.05):
    def plant(m):
        getattr(m.get_submodule(path), name).mul_(factor)
    return plant


def _rope_base(factor: float):
    """RoPE computed with another base: every angle but position 0's changes, in every layer."""
    def plant(m):
        m.rotary_pos_emb.inv_freq.pow_(factor)
    return plant


_A = "decoder.layers.{}.self_attention."
FAULTS = {
    "llama_rope_base": ("llama", _rope_base(1.1), "attn.q_rope", 0),
    "llama_input_norm": ("llama", _scale("decoder.layers.1.input_layernorm"), "attn_norm", 1),
    "qwen2_qkv_bias": ("qwen2", _scale(_A.format(1) + "linear_qkv", "bias", 1.5), "attn.q", 1),
    "qwen2_o_proj": ("qwen2", _scale(_A.format(0) + "linear_proj"), "attn.out", 0),
    "mixtral_router": ("mixtral", _scale("decoder.layers.1.mlp.router", "weight", 1.05), "moe.router_logits", 1),
    "mixtral_expert": ("mixtral", _scale("decoder.layers.0.mlp.experts.local_experts.2.linear_fc2"),
                       "moe.experts_out", 0),
    "qwen2_moe_shared_expert": ("qwen2_moe", _scale("decoder.layers.1.mlp.shared_experts.linear_fc2"),
                                "moe.shared_out", 1),
    # Phi-3 (partial RoPE: half of each head rotated): a wrong rotary share, and the fused up-projection's halves
    "phi3_rotary_percent": ("phi3", lambda m: setattr(m.rotary_pos_emb, "inv_freq", m.rotary_pos_emb.inv_freq * 0.9),
                            "attn.q_rope", 0),
    "phi3_fc1": ("phi3", _scale("decoder.layers.1.mlp.linear_fc1"), "mlp.out", 1),
    # the gate acts after moe.shared_out, on the sum the MoE block returns
    "qwen2_moe_shared_gate": ("qwen2_moe", _scale("decoder.layers.0.mlp.shared_experts", "gate_weight", 1.5),
                              "mlp.out", 0),
}


@pytest.mark.parametrize("case", sorted(FAULTS))
def test_planted_fault_in_megatron_found_at_its_point_and_layer(tmp_path, hf_side, case):
    name, plant, point, layer = FAULTS[case]
    _, hf, sd = hf_side(name, torch.float32)
    rep = find_divergence(str(hf), _megatron(tmp_path / "mg", name, sd, torch.float32, plant=plant))
    assert_planted_fault_found(rep, point, layer)
