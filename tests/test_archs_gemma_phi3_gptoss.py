"""Gemma2, Gemma3 (text), Phi-3 and GPT-OSS (HF, transformers 5.24): faults planted in each architecture's own
computation (a module's forward wrapped, or a setting of the model changed, on side B only) are found at
exactly their point and layer. The clean pairs (fp32, and bf16 replayed against the checkpoint both ran) are
test_supported_archs.py's, which runs them for every row of the HF table, these included.

Every model is a tiny random one built locally (no hub access), traced in fp32 with eager attention.
"""
from __future__ import annotations

from typing import Callable

import torch

from tic_trace import find_divergence
from tic_trace.testing.hf_models import build_hf_model, build_hf_model_stable, sample_tokens
from tic_trace.replay.intrinsic import IntrinsicError, replay_side
from tic_trace.replay.intrinsic_verdict import first_intrinsic_divergence
from tic_trace.replay.reference import ExactReference
from tic_trace.testing.clean_variants import tp_row_parallel
from tic_trace.testing.precision_faults import PRECISION_FAULTS, offset_rmsnorm_no_upcast
from tic_trace.view.align import CanonicalView

from arch_configs_gemma_phi3_gptoss import GEMMA_PHI3_GPTOSS
from conftest import first_divergence_of_plant, trace_hf

IDS = sample_tokens(2, 10)


def _model(name: str, dtype=torch.float32):
    cfg = GEMMA_PHI3_GPTOSS[name]()
    cfg._attn_implementation = "eager"
    model = build_hf_model(cfg) if dtype == torch.float32 else build_hf_model_stable(cfg, dtype=dtype)
    assert type(model).__name__ == name
    return model


def _first(tmp_path, name: str, plant) -> tuple[str, int | None]:
    """(point, layer) of the first divergence between the clean model (A) and the same model with `plant`
    applied to it (B)."""
    return first_divergence_of_plant(_model(name), plant, tmp_path, IDS)


def _wrap_output(mod: torch.nn.Module, fn) -> None:
    """mod's forward, its output passed through fn (the fault is in the computation: every later op reads it)."""
    inner = mod.forward
    mod.forward = lambda *a, **k: fn(inner(*a, **k))


def _layer(model, i: int):
    return model.model.layers[i]


# ------------------------------------------------------------------------------------------------ Gemma2

def test_gemma2_attention_branch_norm_without_the_unit_offset_is_found_at_attn_post_norm(tmp_path):
    """post_attention_layernorm scaling by w instead of (1 + w): the sandwich norm of the attention branch,
    before the residual add (the table once called it mlp_norm)."""
    def plant(model):
        norm = _layer(model, 1).post_attention_layernorm

        def llama_style(x):
            xf = x.float()
            return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight.float()).type_as(x)
        norm.forward = llama_style
    assert _first(tmp_path, "Gemma2ForCausalLM", plant) == ("attn.post_norm", 1)


def test_gemma2_attention_without_its_logit_soft_cap_is_found_at_attn_core(tmp_path):
    def plant(model):
        _layer(model, 0).self_attn.attn_logit_softcapping = None
    assert _first(tmp_path, "Gemma2ForCausalLM", plant) == ("attn.core", 0)


def test_gemma2_sliding_layer_attending_to_every_key_is_found_at_attn_core(tmp_path):
    """Layer 0 is a sliding-window layer (window 4 < 10 tokens): without its window it reads keys it must not."""
    def plant(model):
        _layer(model, 0).self_attn.sliding_window = None
        model.config.layer_types = ["full_attention", "full_attention"]   # the mask the model builds for layer 0
    assert _first(tmp_path, "Gemma2ForCausalLM", plant) == ("attn.core", 0)


def test_gemma2_mlp_branch_norm_and_final_soft_cap_are_found_at_their_points(tmp_path):
    def scale_mlp_branch(model):
        _wrap_output(_layer(model, 0).post_feedforward_layernorm, lambda y: y * 1.01)
    assert _first(tmp_path / "post_ffw", "Gemma2ForCausalLM", scale_mlp_branch) == ("mlp.post_norm", 0)

    def other_final_cap(model):
        model.config.final_logit_softcapping = 2.0
    assert _first(tmp_path / "cap", "Gemma2ForCausalLM", other_final_cap) == ("logits", None)


# ------------------------------------------------------------------------------------------------ Gemma3

def test_gemma3_k_norm_fault_is_found_at_attn_k_norm(tmp_path):
    def plant(model):
        _wrap_output(_layer(model, 1).self_attn.k_norm, lambda y: y * 1.01)
    assert _first(tmp_path, "Gemma3ForCausalLM", plant) == ("attn.k_norm", 1)


def test_gemma3_sliding_layer_rotated_with_the_global_base_is_found_at_q_rope(tmp_path):
    """Layer 0 is a sliding layer (local RoPE base 10^4), layer 1 full (10^6): the sliding layers' RoPE given
    the global base changes layer 0's rotary embedding first."""
    def plant(model):
        rot = model.model.rotary_emb
        rot.sliding_attention_inv_freq = rot.full_attention_inv_freq.clone()
    assert _first(tmp_path, "Gemma3ForCausalLM", plant) == ("attn.q_rope", 0)


def test_gemma3_pre_feedforward_norm_fault_is_found_at_mlp_norm(tmp_path):
    def plant(model):
        _wrap_output(_layer(model, 1).pre_feedforward_layernorm, lambda y: y * 1.01)
    assert _first(tmp_path, "Gemma3ForCausalLM", plant) == ("mlp_norm", 1)


# ------------------------------------------------------------------------------------------------ Phi-3

def _scale_columns(module, start: Callable, stop: Callable | None = None) -> None:
    """Scale the output columns [start(width), stop(width)) of a fused projection by 1.01 (in the computation)."""
    def fn(y):
        y = y.clone()
        w = y.shape[-1]
        y[..., start(w):stop(w) if stop else None] *= 1.01
        return y
    _wrap_output(module, fn)


def _q_width(attn) -> int:
    return attn.config.num_attention_heads * attn.head_dim


def test_phi3_v_fault_inside_the_fused_qkv_is_found_at_attn_v(tmp_path):
    """A fault in the v columns of the fused qkv_proj output: at attn.v, not attn.core."""
    def plant(model):
        attn = _layer(model, 1).self_attn
        nq = _q_width(attn)
        _scale_columns(attn.qkv_proj, lambda w: nq + (w - nq) // 2)
    assert _first(tmp_path, "Phi3ForCausalLM", plant) == ("attn.v", 1)


def test_phi3_q_and_up_faults_are_found_at_their_points(tmp_path):
    def scale_q(model):
        attn = _layer(model, 0).self_attn
        _scale_columns(attn.qkv_proj, lambda w: 0, lambda w: _q_width(attn))
    assert _first(tmp_path / "q", "Phi3ForCausalLM", scale_q) == ("attn.q", 0)

    def scale_up(model):          # the up half of the fused gate_up_proj: the MLP's output
        _scale_columns(_layer(model, 1).mlp.gate_up_proj, lambda w: w // 2)
    assert _first(tmp_path / "up", "Phi3ForCausalLM", scale_up) == ("mlp.out", 1)


# ------------------------------------------------------------------------------------------------ GPT-OSS

def test_gpt_oss_router_fault_is_found_at_the_router_not_the_experts(tmp_path):
    def plant(model):
        with torch.no_grad():
            _layer(model, 1).mlp.router.bias.add_(0.01)
    assert _first(tmp_path, "GptOssForCausalLM", plant) == ("moe.router_logits", 1)


def test_gpt_oss_attention_sinks_fault_is_found_at_attn_core(tmp_path):
    def plant(model):
        with torch.no_grad():
            _layer(model, 0).self_attn.sinks.add_(0.5)
    assert _first(tmp_path, "GptOssForCausalLM", plant) == ("attn.core", 0)


def test_gpt_oss_swiglu_clamp_fault_is_found_at_the_experts(tmp_path):
    """The clamp of the experts' SwiGLU tightened (7 -> 0.05, below the tiny model's gate values)."""
    def plant(model):
        _layer(model, 1).mlp.experts.limit = 0.05
    assert _first(tmp_path, "GptOssForCausalLM", plant) == ("moe.experts_out", 1)


# ------------------------------------------------------------------------------------------------ bf16, replayed

def _replayed_first(tmp_path, name: str, plant) -> tuple[str, str, str]:
    """(key, cause, blamed side) of the first divergence of a bf16 pair, B planted, both replayed against the
    checkpoint both ran: the architecture's own op replayed exactly names the side that computes it worse."""
    model = _model(name, torch.bfloat16)
    model.save_pretrained(tmp_path / "ck")
    trace_hf(model, tmp_path / "a", IDS)
    plant(model)
    trace_hf(model, tmp_path / "b", IDS)
    rep = find_divergence(str(tmp_path / "a"), str(tmp_path / "b"), reference=str(tmp_path / "ck"))
    return rep.first["key"], rep.first["cause"], rep.first["replay"]["side"]


def test_gemma2_bf16_sandwich_norm_without_upcast_is_blamed_on_its_side(tmp_path):
    got = _replayed_first(tmp_path, "Gemma2ForCausalLM",
                          lambda m: offset_rmsnorm_no_upcast(_layer(m, 1).post_attention_layernorm))
    assert got == ("L1.attn.post_norm", "intrinsic", "B")


def test_gemma3_bf16_q_norm_without_upcast_is_blamed_on_its_side(tmp_path):
    got = _replayed_first(tmp_path, "Gemma3ForCausalLM", lambda m: offset_rmsnorm_no_upcast(_layer(m, 0).self_attn.q_norm))
    assert got == ("L0.attn.q_norm", "intrinsic", "B")


def test_gpt_oss_bf16_experts_with_another_clamp_are_blamed_on_their_side(tmp_path):
    def plant(model):
        _layer(model, 1).mlp.experts.limit = 0.05
    assert _replayed_first(tmp_path, "GptOssForCausalLM", plant) == ("L1.moe.experts_out", "intrinsic", "B")


def test_phi3_with_partial_rotary_bf16_clean_pair_is_consistent_and_replayed_everywhere(tmp_path):
    """Phi-4-mini is a Phi3ForCausalLM rotating part of each head (partial_rotary_factor 0.75): the replay's
    RoPE rotates the same dims, so a clean bf16 pair is consistent with every point replayed."""
    import transformers as T

    from arch_configs_gemma_phi3_gptoss import COMMON
    cfg = T.Phi3Config(**{k: v for k, v in COMMON.items() if k != "head_dim"},
                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
    cfg._attn_implementation = "eager"
    model = build_hf_model_stable(cfg, dtype=torch.bfloat16)
    model.save_pretrained(tmp_path / "ck")
    trace_hf(model, tmp_path / "a", IDS)
    trace_hf(model, tmp_path / "b", IDS)
    rep = find_divergence(str(tmp_path / "a"), str(tmp_path / "b"), reference=str(tmp_path / "ck"))
    assert rep.verdict == "consistent" and not [n for n in rep.notes if n.kind == "not_replayed"]
    far = [(p.key, e["excess"], e["limit"]) for p in rep.points for e in (p.intrinsic or {}).values()
           if isinstance(e, dict) and isinstance(e.get("limit"), float) and e["excess"] > e["limit"]]
    assert not far, far
    rope = next(p for p in rep.points if p.key == "L0.attn.q_rope")
    # reproduced by a clean RoPE (a replay rotating other dims would match none and be far from exact)
    e = rope.intrinsic["a"]
    assert e["match_kind"] == "clean" and e["match"] in ("bf16_tables", "fp32_tables") and e["excess"] < 2, e


def test_gemma3_with_linear_scaled_global_rope_bf16_clean_pair_is_consistent(tmp_path):
    """Real Gemma3 checkpoints scale the global layers' RoPE (linear, factor 8) and leave the local ones plain:
    each layer replayed with its own layer type's RoPE, a clean bf16 pair is consistent, no contract difference."""
    import transformers as T

    from arch_configs_gemma_phi3_gptoss import COMMON
    cfg = T.Gemma3TextConfig(**COMMON, sliding_window=4, query_pre_attn_scalar=16,
                             layer_types=["sliding_attention", "full_attention"],
                             rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0,
                                                                 "rope_theta": 1e6},
                                              "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    cfg._attn_implementation = "eager"
    model = build_hf_model_stable(cfg, dtype=torch.bfloat16)
    model.save_pretrained(tmp_path / "ck")
    trace_hf(model, tmp_path / "a", IDS)
    trace_hf(model, tmp_path / "b", IDS)
    rep = find_divergence(str(tmp_path / "a"), str(tmp_path / "b"), reference=str(tmp_path / "ck"))
    assert rep.verdict == "consistent" and not [n for n in rep.notes if n.kind == "not_replayed"]
    assert [d for d in rep.contract if d["section"] != "reference"] == []
    for key in ("L0.attn.q_rope", "L1.attn.q_rope"):      # sliding (plain, base 1e4) and full (linear x8, 1e6)
        e = next(p for p in rep.points if p.key == key).intrinsic["a"]
        assert e["match_kind"] == "clean" and e["excess"] < 2, (key, e)


# ------------------------------------------------------------------------------------------------ bf16 variants

def _replayed_b(tmp_path, name: str, plant) -> dict:
    """Side B's replay results by key (bf16, B planted, against the checkpoint both ran)."""
    model = _model(name, torch.bfloat16)
    model.save_pretrained(tmp_path / "ck")
    plant(model)
    trace_hf(model, tmp_path / "b", IDS)
    return {r.key: r for r in replay_side(CanonicalView(str(tmp_path / "b")), ExactReference(str(tmp_path / "ck")))
            if isinstance(r, IntrinsicError)}


def test_gemma3_bf16_softmax_is_found_with_its_fingerprint(tmp_path):
    """A bf16 softmax in Gemma's attention (windows, no sinks) is named by its variant, not only blamed."""
    f = PRECISION_FAULTS["softmax_bf16"]
    model = _model("Gemma3ForCausalLM", torch.bfloat16)
    model.save_pretrained(tmp_path / "ck")
    trace_hf(model, tmp_path / "a", IDS)
    f.plant(model, 1)
    trace_hf(model, tmp_path / "b", IDS)
    got = first_intrinsic_divergence(str(tmp_path / "a"), str(tmp_path / "b"), ExactReference(str(tmp_path / "ck")))
    assert got is not None and (got.key, got.side) == ("L1.attn.core", "B"), got
    assert got.b.match_kind == "fault" and "matches *bf16 softmax*" in got.reason, got.reason


def test_gemma2_row_parallel_mlp_is_a_clean_variant_of_its_own(tmp_path):
    """A TP=2 row-parallel down_proj (bf16 partial sums) under Gemma's GELU MLP: its envelope is its own
    degree's row-parallel variant, not the single GEMM's."""
    got = _replayed_b(tmp_path, "Gemma2ForCausalLM", tp_row_parallel(2))
    for layer in (0, 1):
        e = got[f"L{layer}.mlp.out"]
        assert (e.match_kind, e.match) == ("clean", "row_parallel_tp2") and e.excess <= e.clean_excess, e
