"""DeepSeek-V3-style megatron-core 0.16.1 ``GPTModel`` (its own ``MLASelfAttention``, sigmoid router with an expert
bias and group-limited top-k, routed scaling, shared experts, a dense first layer) against HF
``DeepseekV3ForCausalLM`` with the same weights, on CPU, one rank; and GLM-4.5-style (the same MoE on standard
attention with q/k/v bias, QK-norm and partial RoPE) against HF ``Glm4MoeForCausalLM``.

The megatron models are built from the HF configs by ``tic_trace.testing.megatron_mla`` (local spec; MLA with
the two shims its docstring names) and loaded with ``megatron_weights.hf_to_megatron_state_dict``. Faults are planted in
the megatron side's computation (a module attribute, a weight, a buffer, a module's config), never in the trace;
each must be the first divergence, at its point and layer.
"""
from __future__ import annotations

import copy
import types
from pathlib import Path

import megatron.core  # noqa: F401 - a required test dependency: fail loudly if missing
import pytest
import torch

import tic_trace
from tic_trace import find_divergence
from tic_trace.adapters import megatron as mg_adapter
from tic_trace.adapters.megatron import MegatronAdapter
from tic_trace.adapters.megatron_weights import hf_to_megatron_state_dict, load_into
from tic_trace.replay.intrinsic_verdict import first_intrinsic_divergence, intrinsic_walk
from tic_trace.replay.reference import ExactReference
from tic_trace.testing import megatron_cpu as mc
from tic_trace.testing import megatron_mla as mm
from tic_trace.testing.hf_models import sample_tokens
from tic_trace.testing.precision_faults import _rmsnorm_bf16_torch
from tic_trace.view.align import CanonicalView

from arch_configs_mla import mla_config, mla_hf_model
from conftest import (assert_every_point_is_its_exact_op, assert_planted_fault_found,
                      assert_replayed_within_envelopes, checkpointed_sides, trace_hf)

IDS = sample_tokens(2, 12)
KEYS = ["s0", "s1"]
ARCH = "GPTModel/TransformerLayer/MLASelfAttention/MLP+MoELayer"
LATENT = {"attn.q_a", "attn.q_a_norm", "attn.kv_a", "attn.kv_a_norm", "attn.kv_b"}


CFGS = {"deepseek": mla_config("deepseek"), "glm": mla_config("glm")}
BUILD = {"deepseek": mm.build_mla_gpt_model, "glm": mm.build_glm4_moe_gpt_model}
ARCH = {"deepseek": "GPTModel/TransformerLayer/MLASelfAttention/MLP+MoELayer",
        "glm": "GPTModel/TransformerLayer/SelfAttention/MLP+MoELayer"}


def _hf_model(name: str, dtype: torch.dtype):
    return mla_hf_model(CFGS[name], dtype)


@pytest.fixture(scope="module")
def hf_side(tmp_path_factory, megatron_rank):
    """hf_side(name, dtype) -> (checkpoint dir, HF trace dir, HF state dict), built once per module."""
    return checkpointed_sides(tmp_path_factory, _hf_model, IDS, sample_keys=KEYS)


def _megatron(out, name: str, sd, dtype, plant=None) -> str:
    """Trace megatron's model of `name` (fault `plant(model)` applied to its computation first) into `out`."""
    cfg = CFGS[name]
    model = BUILD[name](cfg, dtype=dtype)
    load_into(model, hf_to_megatron_state_dict(sd, cfg))
    if plant is not None:
        with torch.no_grad():
            plant(model)
    pos = torch.arange(IDS.shape[1]).unsqueeze(0).expand_as(IDS)
    with tic_trace.trace(model, out, adapter=MegatronAdapter(vocab_size=cfg.vocab_size), points_mode="full",
                         sample_keys=KEYS) as t, torch.no_grad():
        model(IDS, pos, attention_mask=None)
    assert t.failed is None, t.failed
    return str(out)


# ------------------------------------------------------------------------------------------------ clean pairs

@pytest.mark.parametrize("name", sorted(CFGS))
def test_clean_fp32_pair_is_consistent_and_every_point_is_its_exact_op(tmp_path, hf_side, name):
    """fp32: HF <-> Megatron consistent, nothing not comparable; the Megatron trace holds every promised point
    (DeepSeek: MLA's latent points, no k/v/QK-norm; no moe.* in the dense layer 0); and the float64 replay of
    each point on Megatron's own inputs (the HF checkpoint as reference) agrees to fp32 accuracy: each canonical
    point is the op the schema says (a wrong split of the latent, of the rope dims or of the heads would be O(1)
    off)."""
    ck, hf, sd = hf_side(name, torch.float32)
    mg = _megatron(tmp_path / "mg", name, sd, torch.float32)
    rep = find_divergence(str(hf), mg)
    assert rep.verdict == "consistent" and rep.not_comparable == [], (rep.verdict, rep.not_comparable)
    v = CanonicalView(mg)
    assert (v.config["architecture"], v.config["architecture_verified"]) == (ARCH[name], True)
    assert (v.config["router_scoring"], v.config["num_experts"], v.config["shared_experts"]) == ("sigmoid", 8, True)
    have = set(v.points())
    points = {p for p, _ in have}
    assert points == set(v.adapter.promised_points(v.config)) | {"logprobs"}
    if name == "deepseek":
        assert (v.config["kv_lora_rank"], v.config["head_dim"]) == (32, 8)
        assert LATENT <= points and not {"attn.k", "attn.v", "attn.q_norm"} & points
    else:
        assert not LATENT & points and {"attn.k", "attn.v", "attn.q_norm", "attn.k_norm"} <= points
    assert not [p for p, layer in have if layer == 0 and p.startswith("moe.")]
    assert {p for p, layer in have if layer == 1} >= {"moe.router_logits", "moe.topk_ids", "moe.shared_out"}
    results = assert_every_point_is_its_exact_op(v, ck)
    want = {"attn.q", "attn.q_rope", "attn.k_rope", "attn.core", "moe.topk_ids", "moe.topk_weights", "moe.shared_out"}
    assert {r.point for r in results} >= want | (LATENT if name == "deepseek" else set())


@pytest.mark.parametrize("name", sorted(CFGS))
def test_clean_bf16_pair_with_reference_blames_no_side(tmp_path, hf_side, name):
    """bf16 against the checkpoint: no contract difference in the model facts, every point replayed, each side
    inside its clean envelope, and the replay blames neither side, at the first divergence or anywhere along
    the walk. The bf16 noise between the two implementations can flip a token's experts: every such flip is a
    near tie of the choice scores (sigmoid + expert bias, inside the kept group: the space the margins are
    taken in), never an unexplained one, and accepting near ties leaves the pair consistent."""
    ck, hf, sd = hf_side(name, torch.bfloat16)
    mg = _megatron(tmp_path / "mg", name, sd, torch.bfloat16)
    rep = find_divergence(str(hf), mg, reference=str(ck))
    assert_replayed_within_envelopes(rep)
    judged = {p.key for p in rep.points if p.intrinsic}
    assert {"L1.attn.q_rope", "L1.attn.k_rope", "L1.attn.core", "L1.moe.topk_ids", "L1.moe.topk_weights",
            "L1.moe.shared_out", "L0.mlp.out"} <= judged
    if name == "deepseek":
        assert {"L1.attn.q_a_norm", "L1.attn.kv_a_norm", "L1.attn.kv_b"} <= judged
    first = rep.to_json()["first_divergence"]
    # both traces state the routers' selection bias and group limit alike (the flip margins' choice space)
    cfg_hf, cfg_mg = CanonicalView(str(hf)).config, CanonicalView(mg).config
    assert cfg_mg["router_selection_bias"] == cfg_hf["router_selection_bias"] and cfg_hf["router_selection_bias"]
    assert [cfg_mg[k] for k in ("router_n_group", "router_topk_group", "router_group_top")] == \
        [cfg_hf[k] for k in ("router_n_group", "router_topk_group", "router_group_top")]
    routing = [f for f in rep.findings if f.cause == "routing"]
    assert all(f.detail["unexplained"] == 0 and f.detail["margin_space"] == "sigmoid+bias in groups"
               for f in routing), routing
    if rep.verdict != "consistent":
        assert {f.cause for f in rep.findings if f.divergent} == {"routing"}, rep.findings
        assert first["replay"]["side"] is None, first["replay"]
        assert find_divergence(str(hf), mg, reference=str(ck), accept_near_tie=True).verdict == "consistent"
    walk = intrinsic_walk(CanonicalView(str(hf)), CanonicalView(mg), ExactReference(str(ck)))
    assert walk and all(w.side is None for w in walk), [w for w in walk if w.side]


def _tp2_worker(rank: int, world: int, port: int, workdir: str) -> None:
    """One spawned rank of the TP=2 DeepSeek-V3 model: its shard of the HF weights, traced into workdir/mg."""
    torch.set_num_threads(1)
    cfg, out = CFGS["deepseek"], Path(workdir)
    mc.init_parallel(rank, world, tp=world, port=port)
    try:
        model = mm.build_mla_gpt_model(cfg, tensor_model_parallel_size=world)
        sd = torch.load(out / "sd.pt", weights_only=True)
        load_into(model, hf_to_megatron_state_dict(sd, cfg, tp_rank=rank, tp_size=world))
        pos = torch.arange(IDS.shape[1]).unsqueeze(0).expand_as(IDS)
        with tic_trace.trace(model, out / "mg", adapter=MegatronAdapter(vocab_size=cfg.vocab_size),
                             points_mode="full", sample_keys=KEYS, rank=rank) as t, torch.no_grad():
            model(IDS, pos, attention_mask=None)
        assert t.failed is None, t.failed
    finally:
        mc.destroy()


def test_tp2_mla_shards_merge_to_the_hf_points(tmp_path):
    """MLA at TP=2 (two gloo ranks): the column-parallel latents and up-projections, the per-rank heads of core
    attention's inputs and the replicated k_pe merge to HF's points: consistent, nothing not comparable."""
    hf = _hf_model("deepseek", torch.float32)
    torch.save(hf.state_dict(), tmp_path / "sd.pt")
    trace_hf(hf, tmp_path / "hf", IDS, sample_keys=KEYS)
    mc.spawn_ranks(_tp2_worker, 2, args=(str(tmp_path),))
    v = CanonicalView(str(tmp_path / "mg"))
    assert (v.config["tensor_model_parallel_size"], v.config["architecture_verified"]) == (2, True)
    rep = find_divergence(str(tmp_path / "hf"), str(tmp_path / "mg"))
    assert rep.verdict == "consistent" and rep.not_comparable == [], (rep.verdict, rep.not_comparable)
    assert LATENT | {"attn.q_rope", "attn.k_rope", "attn.core"} <= {p.point for p in rep.points if p.status == "ok"}


# ------------------------------------------------------------------------------------------------ planted faults

def _attr(path: str, name: str, value):
    def plant(m):
        setattr(m.get_submodule(path), name, value)
    return plant


def _expert_bias(layer: int, expert: int, delta: float = 0.3):
    """A changed expert bias: a pure routing change (logits and the weights' formula unchanged)."""
    def plant(m):
        m.decoder.layers[layer].mlp.router.expert_bias[expert] += delta
    return plant


def _router_config(layer: int, **changes):
    """The router of one layer computing with another setting (its own copy of the shared config)."""
    def plant(m):
        router = m.decoder.layers[layer].mlp.router
        router.config = copy.copy(router.config)
        for k, v in changes.items():
            setattr(router.config, k, v)
    return plant


def _scale_weight(path: str, factor: float = 1.02):
    def plant(m):
        m.get_submodule(path).weight.mul_(factor)
    return plant

_ATTN = "decoder.layers.{}.self_attention."
FAULTS = {
    # DeepSeek-V3
    "ds_kv_latent_norm_eps": ("deepseek", _attr(_ATTN.format(1) + "kv_layernorm", "eps", 0.1), "attn.kv_a_norm", 1),
    "ds_q_latent_norm_weight": ("deepseek", _scale_weight(_ATTN.format(2) + "q_layernorm"), "attn.q_a_norm", 2),
    "ds_kv_up_proj_weight": ("deepseek", _scale_weight(_ATTN.format(0) + "linear_kv_up_proj"), "attn.kv_b", 0),
    "ds_expert_bias": ("deepseek", _expert_bias(1, 2), "moe.topk_ids", 1),
    "ds_routed_scaling_factor": ("deepseek", _router_config(2, moe_router_topk_scaling_factor=2.0),
                                 "moe.topk_weights", 2),
    # GLM-4.5
    "glm_expert_bias": ("glm", _expert_bias(2, 5), "moe.topk_ids", 2),
    "glm_routed_scaling_factor": ("glm", _router_config(1, moe_router_topk_scaling_factor=2.0), "moe.topk_weights", 1),
    "glm_shared_experts": ("glm", _scale_weight("decoder.layers.2.mlp.shared_experts.linear_fc2"),
                           "moe.shared_out", 2),
    "glm_k_norm_eps": ("glm", _attr(_ATTN.format(1) + "k_layernorm", "eps", 0.1), "attn.k_norm", 1),
}


@pytest.mark.parametrize("case", sorted(FAULTS))
def test_planted_fault_in_megatron_found_at_its_point_and_layer(tmp_path, hf_side, case):
    name, plant, point, layer = FAULTS[case]
    _, hf, sd = hf_side(name, torch.float32)
    rep = find_divergence(str(hf), _megatron(tmp_path / "mg", name, sd, torch.float32, plant=plant))
    assert_planted_fault_found(rep, point, layer)


def _latent_norm_without_upcast(path: str):
    """The latent norm computed in bf16 throughout (no fp32 statistics): a precision fault, same dtype."""
    def plant(m):
        mod = m.get_submodule(path)
        mod.forward = types.MethodType(_rmsnorm_bf16_torch, mod)
    return plant


def test_bf16_kv_latent_norm_without_upcast_is_found_with_megatron_blamed(tmp_path, hf_side):
    ck, hf, sd = hf_side("deepseek", torch.bfloat16)
    plant = _latent_norm_without_upcast(_ATTN.format(1) + "kv_layernorm")
    mg = _megatron(tmp_path / "mg", "deepseek", sd, torch.bfloat16, plant=plant)
    got = first_intrinsic_divergence(str(hf), mg, ExactReference(str(ck)))
    assert got is not None and (got.key, got.side, got.kind) == ("L1.attn.kv_a_norm", "B", "intrinsic"), got


# ------------------------------------------------------------------------------------------------ the table

def test_table_rows_and_the_setups_still_refused():
    """DeepSeek-V3's MLA structure is mapped (MLASelfAttention left REFUSED) and GLM-4.5 runs through the
    dense+MoE row; the MLA setups the tests do not run are refused by name: TP > 2, sequence parallelism, the
    TE spec, rotary_interleaved, fused / YaRN MLA RoPE."""
    ad = MegatronAdapter()
    assert "MLASelfAttention" not in mg_adapter.REFUSED and ARCH["deepseek"] in mg_adapter.ARCHITECTURES
    assert "GLM-4.5 (MoE)" in mg_adapter.ARCHITECTURES[ARCH["glm"]].families
    base = {"architecture": ARCH["deepseek"], "kv_lora_rank": 32, "rope_interleave": True, "mla_rope_type": "rope",
            "spec": "local", "tensor_model_parallel_size": 1}
    assert ad.check_architecture(base).verified
    assert ad.check_architecture({**base, "tensor_model_parallel_size": 2}).verified
    for change, word in (({"tensor_model_parallel_size": 4}, "tensor_model_parallel_size"),
                         ({"tensor_model_parallel_size": 2, "sequence_parallel": True}, "sequence parallelism"),
                         ({"spec": "te"}, "Engine"), ({"pipeline_model_parallel_size": 2}, "pipeline"),
                         ({"rope_interleave": False}, "rotary_interleaved"), ({"mla_rope_fusion": True}, "fusion"),
                         ({"mla_rope_type": "yarn"}, "YaRN")):
        c = ad.check_architecture({**base, **change})
        assert not c.verified and word in c.why, (change, c.why)


def test_configs_megatron_cannot_reproduce_are_refused_by_the_harness():
    for change in ({"rope_interleave": False}, {"rms_norm_eps": 1e-5}, {"num_experts_per_tok": 4},
                   {"norm_topk_prob": False}):
        cfg = mla_config("deepseek")
        for k, v in change.items():
            setattr(cfg, k, v)
        with pytest.raises(NotImplementedError):
            mm.build_mla_transformer_config(cfg)
