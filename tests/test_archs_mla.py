"""DeepSeek-V3 (multi-latent attention, sigmoid routing) and GLM-4.5 (`Glm4Moe`) on the HF adapter.

Tiny random models of the real transformers 5.24 classes, built here (no hub access), with what makes these
architectures what they are: a sigmoid router whose choice (not its weights) reads a score-correction bias,
group-limited top-k (2 groups of 4 experts, 1 kept), routed scaling, shared experts, a dense first layer;
GLM's partial RoPE, q/k/v bias and QK-norm; DeepSeek's q and kv latents, interleaved RoPE of q's rope dims
and of the one k_pe all heads share. Faults are planted in the computation of side B (a module's forward,
an attribute, a router buffer), never in the trace, and each must be the first divergence, at its point
and layer.
"""
import numpy as np
import pytest
import torch
import transformers as T

from tic_trace import find_divergence
from tic_trace.adapters import hf as hf_adapter
from tic_trace.graph.adapter import get_adapter
from tic_trace.replay.intrinsic import IntrinsicError, replay_side
from tic_trace.replay.reference import ExactReference
from tic_trace.replay.intrinsic_verdict import first_intrinsic_divergence
from tic_trace.testing import trained_like
from tic_trace.testing.clean_variants import attention
from tic_trace.testing.hf_models import build_hf_model, build_hf_model_stable, sample_tokens
from tic_trace.testing.precision_faults import PRECISION_FAULTS
from tic_trace.view.align import CanonicalView

from conftest import assert_planted_fault_found, trace_hf

IDS = sample_tokens(2, 10)
_BASE = dict(vocab_size=128, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, intermediate_size=128,
             max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False, pad_token_id=0,
             bos_token_id=1, eos_token_id=2)
# 8 experts in 2 groups, 1 group kept: the top-2 is group-limited; layer 0 is dense
_MOE = dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
            first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True)
_LATENT = dict(kv_lora_rank=32, q_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)

CONFIGS = {
    "glm": lambda: T.Glm4MoeConfig(**_BASE, **_MOE, num_key_value_heads=2, head_dim=16, attention_bias=True,
                                   use_qk_norm=True),
    "deepseek": lambda: T.DeepseekV3Config(**_BASE, **_MOE, **_LATENT, num_key_value_heads=4),
    "deepseek_rotate_half": lambda: T.DeepseekV3Config(**_BASE, **_MOE, **_LATENT, num_key_value_heads=4,
                                                       rope_interleave=False),
    # DeepSeek-V3's own RoPE: YaRN, with mscale_all_dim scaling the softmax too
    "deepseek_yarn": lambda: T.DeepseekV3Config(**_BASE, **_MOE, **_LATENT, num_key_value_heads=4, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}),
    "deepseek_no_q_latent": lambda: T.DeepseekV3Config(**_BASE, **_MOE, **{**_LATENT, "q_lora_rank": None},
                                                       num_key_value_heads=4),
}
ARCH = {"glm": "Glm4MoeForCausalLM", "deepseek": "DeepseekV3ForCausalLM"}


def _config(name: str):
    cfg = CONFIGS[name]()
    cfg._attn_implementation = "eager"
    return cfg


def _divergence(tmp_path, name: str, plant) -> object:
    """Side A: the clean model; side B: the same model with `plant(model)` applied to its computation."""
    model = build_hf_model(_config(name))
    trace_hf(model, tmp_path / "a", IDS)
    with torch.no_grad():
        plant(model)
    trace_hf(model, tmp_path / "b", IDS)
    return find_divergence(str(tmp_path / "a"), str(tmp_path / "b"))


# ------------------------------------------------------------------------------------------------ the mapping

@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_point_and_its_exact_op(tmp_path, name):
    """fp32: the clean pair is consistent, every promised point is recorded (the dense layer 0 has no moe.*,
    never listed as missing), and the float64 replay of each point on the side's own inputs agrees with what
    HF computed to fp32 accuracy: each point is the op the schema says (a wrong split, a missed norm or a
    wrong RoPE layout would be off by O(1))."""
    model = build_hf_model_stable(_config(name))
    model.save_pretrained(tmp_path / "ck")
    trace_hf(model, tmp_path / "a", IDS)
    trace_hf(model, tmp_path / "b", IDS)
    rep = find_divergence(str(tmp_path / "a"), str(tmp_path / "b"))
    assert rep.verdict == "consistent" and rep.not_comparable == [], rep.not_comparable
    v = CanonicalView(str(tmp_path / "a"))
    assert v.config["architecture_verified"] is True and v.config["num_experts"] == 8
    assert v.config["router_scoring"] == "sigmoid"
    have = set(v.points())
    assert {p for p, _ in have} == set(v.adapter.promised_points(v.config)) | {"logprobs"}
    assert not [p for p, layer in have if layer == 0 and p.startswith("moe.")]
    assert {p for p, layer in have if layer == 1} >= {"moe.router_logits", "moe.topk_ids", "moe.shared_out"}
    latent = {"attn.q_a", "attn.q_a_norm", "attn.kv_a", "attn.kv_a_norm", "attn.kv_b"}
    if name == "glm":
        assert not latent & {p for p, _ in have} and ("attn.k_norm", 1) in have
    else:
        want = latent - ({"attn.q_a", "attn.q_a_norm"} if name == "deepseek_no_q_latent" else set())
        assert want <= {p for p, _ in have} and not {"attn.k", "attn.v"} & {p for p, _ in have}
    results = replay_side(v, ExactReference(str(tmp_path / "ck")))
    skipped = [(r.key, r.reason) for r in results if not isinstance(r, IntrinsicError) and r.point != "logprobs"]
    assert skipped == [], skipped
    off = [(r.key, r.rel_l2) for r in results if isinstance(r, IntrinsicError) and r.rel_l2 > (0 if r.kind == "ids" else 1e-5)]
    assert not off, off
    assert {r.point for r in results} >= {"attn.q", "attn.q_rope", "attn.k_rope", "attn.core", "moe.topk_ids"}


@pytest.mark.parametrize("name", ["glm", "deepseek"])
def test_bf16_clean_pair_with_reference_blames_no_side(tmp_path, name):
    """bf16 against its own checkpoint: consistent, no contract difference (n_routed_experts is the expert
    count, the router is sigmoid, the latent ranks agree), every point replayed, each side inside its
    envelope."""
    model = build_hf_model_stable(_config(name), dtype=torch.bfloat16)
    model.save_pretrained(tmp_path / "ck")
    trace_hf(model, tmp_path / "a", IDS)
    trace_hf(model, tmp_path / "b", IDS)
    rep = find_divergence(str(tmp_path / "a"), str(tmp_path / "b"), reference=str(tmp_path / "ck"))
    assert rep.verdict == "consistent", [(f.cause, f.key, f.summary) for f in rep.findings if f.divergent]
    assert [d for d in rep.contract if d["section"] != "reference"] == []
    assert not [n for n in rep.notes if n.kind == "not_replayed"]
    far = [(p.key, s, e["excess"], e["limit"]) for p in rep.points for s, e in (p.intrinsic or {}).items()
           if isinstance(e, dict) and isinstance(e.get("limit"), float) and e["excess"] > e["limit"]]
    assert not far, far
    judged = {p.key for p in rep.points if p.intrinsic}
    assert {"L1.moe.topk_ids", "L1.moe.topk_weights", "L1.moe.shared_out", "L0.mlp.out", "L1.attn.core"} <= judged
    if name == "deepseek":
        assert {"L1.attn.kv_a_norm", "L1.attn.kv_b", "L1.attn.q_a_norm", "L1.attn.k_rope"} <= judged


def test_table_rows_and_refusal_are_gone():
    ad = get_adapter("hf")
    for arch in ARCH.values():
        assert ad.check_architecture({"architecture": arch}).verified and arch not in hf_adapter.REFUSED


# ------------------------------------------------------------------------------------------------ planted faults

def _bias_towards_expert(layer: int, expert: int):
    """A changed e_score_correction_bias: a pure routing change (the logits and the weights' formula are the
    same; only the choice reads the bias)."""
    def plant(m):
        m.model.layers[layer].mlp.gate.e_score_correction_bias[expert] += 0.3
    return plant


def _scale_output(path: str, factor: float = 1.01):
    def plant(m):
        mod = m.get_submodule(path)
        orig = mod.forward
        mod.forward = lambda *a, **k: orig(*a, **k) * factor
    return plant


def _set(path: str, attr: str, value):
    def plant(m):
        setattr(m.get_submodule(path), attr, value)
    return plant


FAULT_CASES = {
    # GLM-4.5
    "glm_correction_bias": ("glm", _bias_towards_expert(2, 5), "moe.topk_ids", 2),
    "glm_routed_scaling": ("glm", _set("model.layers.1.mlp.gate", "routed_scaling_factor", 2.0),
                           "moe.topk_weights", 1),
    "glm_shared_experts": ("glm", _scale_output("model.layers.2.mlp.shared_experts"), "moe.shared_out", 2),
    "glm_k_norm_eps": ("glm", _set("model.layers.1.self_attn.k_norm", "variance_epsilon", 0.1), "attn.k_norm", 1),
    # DeepSeek-V3
    "ds_kv_a_layernorm_eps": ("deepseek", _set("model.layers.1.self_attn.kv_a_layernorm", "variance_epsilon", 0.1),
                              "attn.kv_a_norm", 1),
    "ds_q_a_layernorm_eps": ("deepseek", _set("model.layers.2.self_attn.q_a_layernorm", "variance_epsilon", 0.1),
                             "attn.q_a_norm", 2),
    "ds_kv_b_proj": ("deepseek", _scale_output("model.layers.0.self_attn.kv_b_proj"), "attn.kv_b", 0),
    "ds_correction_bias": ("deepseek", _bias_towards_expert(1, 2), "moe.topk_ids", 1),
    "ds_routed_scaling": ("deepseek", _set("model.layers.2.mlp.gate", "routed_scaling_factor", 2.0),
                          "moe.topk_weights", 2),
}


@pytest.mark.parametrize("case", sorted(FAULT_CASES))
def test_planted_fault_found_at_its_point_and_layer(tmp_path, case):
    name, plant, point, layer = FAULT_CASES[case]
    rep = _divergence(tmp_path, name, plant)
    assert_planted_fault_found(rep, point, layer)


def _rmsnorm_without_upcast(path: str):
    """The norm computed in bf16 throughout (no fp32 statistics): a precision fault, same dtype as clean."""
    def plant(m):
        mod = m.get_submodule(path)

        def forward(x):
            return mod.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + mod.variance_epsilon))
        mod.forward = forward
    return plant


@pytest.mark.parametrize("path,key", [("model.layers.1.self_attn.kv_a_layernorm", "L1.attn.kv_a_norm"),
                                      ("model.layers.2.self_attn.q_a_layernorm", "L2.attn.q_a_norm")])
def test_bf16_latent_norm_without_upcast_blames_its_side(tmp_path, path, key):
    """With the checkpoint as reference, a bf16 latent norm without the fp32 upcast is found at its point and
    blamed on the side that runs it: the less exact op, measured against MLA's exact norm (eps 1e-6)."""
    model = build_hf_model_stable(_config("deepseek"), dtype=torch.bfloat16)
    model.save_pretrained(tmp_path / "ck")
    trace_hf(model, tmp_path / "a", IDS)
    _rmsnorm_without_upcast(path)(model)
    trace_hf(model, tmp_path / "b", IDS)
    rep = find_divergence(str(tmp_path / "a"), str(tmp_path / "b"), reference=str(tmp_path / "ck"))
    doc = rep.to_json()
    first = doc["first_divergence"]
    assert (first["key"], first["cause"], first["replay"]["side"]) == (key, "intrinsic", "B"), \
        (first["key"], first["cause"], first["replay"])


# ------------------------------------------------------------------- MLA's own ops: clean variants and faults

def _mla_pair(tmp_path, plant_b=None):
    """DeepSeek-V3 bf16 with trained-like norm gains: (checkpoint, trace of A, trace of B with `plant_b`)."""
    model = build_hf_model_stable(_config("deepseek"), dtype=torch.bfloat16)
    trained_like.lognormal_norm_gains(model, seed=3, sigma=1.5, high=41.0, include_qk=True)
    model.save_pretrained(tmp_path / "ck")
    trace_hf(model, tmp_path / "a", IDS)
    if plant_b is not None:
        plant_b(model)
    trace_hf(model, tmp_path / "b", IDS)
    return str(tmp_path / "ck"), str(tmp_path / "a"), str(tmp_path / "b")


def test_hf_mla_ops_are_among_their_clean_variants(tmp_path):
    """HF's own latent norms, latent RoPE and MLA attention are reproduced by a clean variant on their own
    inputs (latent_variants.py): each is judged by a same-input envelope, not a borrowed constant."""
    ck, a, _ = _mla_pair(tmp_path)
    results = replay_side(CanonicalView(a), ExactReference(ck))
    by_key = {r.key: r for r in results if isinstance(r, IntrinsicError)}
    for key in ("L1.attn.q_a_norm", "L1.attn.kv_a_norm", "L1.attn.q_rope", "L1.attn.k_rope", "L1.attn.core"):
        e = by_key[key]
        assert e.clean_excess > 0 and e.match_kind == "clean" and e.match_equal > 0.9, (key, e)


@pytest.mark.parametrize("fault,words", [("softmax_bf16", "bf16 softmax"), ("kv_a_norm_no_upcast", "no fp32 upcast"),
                                         ("q_a_norm_no_upcast", "no fp32 upcast")])
def test_mla_precision_fault_found_with_its_fingerprint(tmp_path, fault, words):
    """A bf16 softmax inside MLA's attention stays under any constant envelope; against the clean
    variants on the side's own inputs it is found, at its point and layer, with the fault named."""
    f = PRECISION_FAULTS[fault]
    ck, a, b = _mla_pair(tmp_path, lambda m: f.plant(m, 1))
    got = first_intrinsic_divergence(a, b, ExactReference(ck))
    assert got is not None and (got.key, got.side, got.kind) == (f"L1.{f.point}", "B", "intrinsic"), got
    assert got.b.match_kind == "fault" and f"matches *{words}*" in got.reason, got.reason


def test_mla_clean_sdpa_side_blames_no_side(tmp_path):
    """SDPA instead of HF's eager MLA attention (one rounding instead of three): a clean implementation."""
    ck, a, b = _mla_pair(tmp_path, attention("sdpa"))
    rep = find_divergence(a, b, reference=ck)
    assert rep.verdict == "consistent", [(f.cause, f.key, f.summary) for f in rep.findings if f.divergent]


def test_a_kv_latent_under_a_model_type_no_family_owns_is_replayed_as_mla():
    """Kimi-K2's config says `kimi_k2` with DeepSeek-V3's architecture: the kv latent its config states, not its
    model_type, decides that MLA's ops replay it (as before the families had folders)."""
    from tic_trace.families import family_for
    from tic_trace.replay.model_spec import model_spec
    from tic_trace.replay.reference import op_of
    mla = _config("deepseek").to_dict()
    as_kimi = model_spec({**mla, "model_type": "kimi_k2"})
    as_deepseek = model_spec({**mla, "model_type": "deepseek_v3", "rope_interleave": True})
    assert family_for(as_kimi).name == "deepseek"
    for point in ("attn.q", "attn.core", "attn.kv_a_norm"):
        assert op_of(point, as_kimi) == op_of(point, as_deepseek) != op_of(point, model_spec(
            {**_config("glm").to_dict(), "model_type": "kimi_k2"}))
