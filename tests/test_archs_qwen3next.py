"""Qwen3-Next (HF `Qwen3NextForCausalLM`, transformers 5.24, its pure-torch Gated DeltaNet and conv paths): the
hybrid layers mapped, replayed exactly, and faults planted in the architecture's own computation (a module
attribute, a weight, a hook on a module's input, on side B only) found at exactly their point and layer.

The model is tiny and random, built locally (tests/arch_configs_qwen3next.py): layers 0 and 2 run linear
attention with a dense MLP, layers 1 and 3 gated softmax attention with the MoE block; 2 x 10 tokens.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from tic_trace import find_divergence
from tic_trace.replay.intrinsic import SideReplayer
from tic_trace.replay.reference import ExactReference
from tic_trace.testing.hf_models import build_hf_model, build_hf_model_stable, sample_tokens
from tic_trace.view.align import CanonicalView

from arch_configs_qwen3next import qwen3next_config
from conftest import first_divergence_of_plant, trace_hf

IDS = sample_tokens(2, 10)
LINEAR = {"attn.linear_qkvz", "attn.linear_ba", "attn.linear_conv", "attn.linear_core", "attn.linear_norm"}
SOFTMAX = {"attn.q", "attn.gate", "attn.k", "attn.v", "attn.q_norm", "attn.k_norm", "attn.q_rope", "attn.k_rope",
           "attn.core"}


def _model(dtype=torch.float32, attn: str = "eager"):
    cfg = qwen3next_config()
    cfg._attn_implementation = attn
    model = build_hf_model(cfg) if dtype == torch.float32 else build_hf_model_stable(cfg, dtype=dtype)
    assert type(model).__name__ == "Qwen3NextForCausalLM"
    return model


def _layer(model, i: int):
    return model.model.layers[i]


def _first(tmp_path, plant) -> tuple[str, int | None]:
    """(point, layer) of the first divergence between the clean fp32 model (A) and the same model planted (B)."""
    return first_divergence_of_plant(_model(), plant, tmp_path, IDS)


# ------------------------------------------------------------------------------------------------ clean

def test_clean_fp32_pair_of_two_attention_implementations_is_consistent_with_each_layer_its_points(tmp_path):
    """Eager against SDPA attention: consistent, nothing missing; the linear layers hold the linear-attention
    points and no softmax-attention one, the softmax layers the reverse, and the linear layers' attn.out reads
    the gated norm (not an absent attn.core resolved back to attn_norm)."""
    model = _model()
    trace_hf(model, tmp_path / "a", IDS)
    model.config._attn_implementation = "sdpa"
    trace_hf(model, tmp_path / "b", IDS)
    rep = find_divergence(str(tmp_path / "a"), str(tmp_path / "b"))
    assert rep.verdict == "consistent", [(p.key, p.status) for p in rep.points if p.status != "ok"]
    assert rep.not_comparable == []
    by_layer: dict[int, set] = {}
    for p in rep.points:
        if p.layer is not None:
            by_layer.setdefault(p.layer, set()).add(p.point)
    for layer in (0, 2):
        assert LINEAR <= by_layer[layer] and not SOFTMAX & by_layer[layer], by_layer[layer]
    for layer in (1, 3):
        assert SOFTMAX <= by_layer[layer] and not LINEAR & by_layer[layer], by_layer[layer]
    inputs = {p.key: p.inputs for p in rep.points}
    assert inputs["L0.attn.out"] == ["L0.attn.linear_norm"]
    assert inputs["L1.attn.out"] == ["L1.attn.core"]
    assert set(inputs["L1.attn.core"]) == {"L1.attn.q_rope", "L1.attn.k_rope", "L1.attn.v", "L1.attn.gate"}
    assert inputs["L0.attn.linear_core"] == ["L0.attn.linear_conv", "L0.attn.linear_ba"]


def test_fp32_trace_matches_the_float64_reference_at_every_point(tmp_path):
    """The exact ops are the model's: an fp32 trace is within fp32 accumulation error (relative 1e-5) of the
    float64 replay at every point, the gated delta rule, conv and gated norm included (a wrong grouping of
    the in-projections' columns, a missing SiLU or a wrong decay is off by orders of magnitude)."""
    model = _model()
    trace_hf(model, tmp_path / "a", IDS)
    model.save_pretrained(tmp_path / "ck")
    view = CanonicalView(str(tmp_path / "a"))
    side = SideReplayer(view, ExactReference(str(tmp_path / "ck")))
    seen = set()
    for point, layer in view.points():
        if point == "logprobs":
            continue
        _, y, exact, _ = side.exact_pair(point, layer)
        rel = np.linalg.norm(y - exact) / max(np.linalg.norm(exact), 1e-30)
        assert rel < 1e-5, (point, layer, rel)
        seen.add(point)
    assert LINEAR | SOFTMAX <= seen


def test_clean_bf16_pair_replayed_blames_no_side_and_matches_hf_eager_renderings(tmp_path):
    model = _model(torch.bfloat16)
    model.save_pretrained(tmp_path / "ck")
    trace_hf(model, tmp_path / "a", IDS)
    trace_hf(model, tmp_path / "b", IDS)
    rep = find_divergence(str(tmp_path / "a"), str(tmp_path / "b"), reference=str(tmp_path / "ck"))
    assert rep.verdict == "consistent" and not rep.findings
    assert not [n for n in rep.notes if n.kind == "not_replayed"]
    assert [d for d in rep.contract if d["section"] != "reference"] == []
    # every new op is judged against clean renderings of it, and the side is one of them (HF's own)
    for key, match in (("L0.attn.linear_conv", "eager"), ("L0.attn.linear_core", "fp32_state"),
                       ("L0.attn.linear_norm", "eager"), ("L1.attn.core", "eager_eager_gate")):
        e = next(p for p in rep.points if p.key == key).intrinsic["a"]
        assert e["match_kind"] == "clean" and e["match"] == match and e["excess"] <= e["limit"], (key, e)


# ------------------------------------------------------------------------------------------------ gated attention

def test_gate_applied_without_its_sigmoid_is_found_at_attn_core(tmp_path):
    """attn_output x gate instead of x sigmoid(gate), in layer 3: what o_proj reads is changed, from q, k, v and
    a gate that are all still right."""
    def plant(model):
        attn = _layer(model, 3).self_attn
        hd = attn.head_dim
        seen = {}

        def keep_gate(mod, args, out):
            seen["gate"] = out.view(*out.shape[:-1], -1, 2 * hd)[..., hd:].reshape(*out.shape[:-1], -1)

        def without_sigmoid(mod, args):
            g = seen["gate"]
            return (args[0] / torch.sigmoid(g) * g,)
        attn.q_proj.register_forward_hook(keep_gate)
        attn.o_proj.register_forward_pre_hook(without_sigmoid)
    assert _first(tmp_path, plant) == ("attn.core", 3)


def test_gate_columns_of_q_proj_are_found_at_attn_gate_not_attn_q(tmp_path):
    """The gate half of each head's q_proj rows scaled: the gate is its own point, q stays exact."""
    def plant(model):
        attn = _layer(model, 1).self_attn
        hd = attn.head_dim
        with torch.no_grad():
            attn.q_proj.weight.view(-1, 2 * hd, attn.q_proj.weight.shape[1])[:, hd:] *= 1.01
    assert _first(tmp_path, plant) == ("attn.gate", 1)


# ------------------------------------------------------------------------------------------------ Gated DeltaNet

def test_conv_without_its_silu_is_found_at_attn_linear_conv(tmp_path):
    """Layer 2's causal conv run without its activation (the layer's own setting)."""
    def plant(model):
        _layer(model, 2).linear_attn.activation = None
    assert _first(tmp_path, plant) == ("attn.linear_conv", 2)


def test_decay_twice_as_fast_is_found_at_attn_linear_core(tmp_path):
    """exp(A_log) doubled in layer 0: every decay g = -exp(A_log) softplus(a + dt_bias) twice as large; the
    delta rule's inputs (conv output, b, a) are unchanged."""
    def plant(model):
        with torch.no_grad():
            _layer(model, 0).linear_attn.A_log.add_(math.log(2.0))
    assert _first(tmp_path, plant) == ("attn.linear_core", 0)


def test_gated_norm_weight_fault_is_found_at_attn_linear_norm(tmp_path):
    def plant(model):
        with torch.no_grad():
            _layer(model, 2).linear_attn.norm.weight.mul_(1.01)
    assert _first(tmp_path, plant) == ("attn.linear_norm", 2)


def test_bf16_gated_norm_without_upcast_is_blamed_on_its_side(tmp_path):
    """A precision fault, no wrong op: layer 0's gated RMSNorm computed in bf16 throughout. Replayed against the
    checkpoint both ran, side B computes attn.linear_norm less exactly than the clean renderings allow."""
    model = _model(torch.bfloat16)
    model.save_pretrained(tmp_path / "ck")
    trace_hf(model, tmp_path / "a", IDS)
    norm = _layer(model, 0).linear_attn.norm

    def no_upcast(x, gate):
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
        return norm.weight * h * torch.nn.functional.silu(gate)
    norm.forward = no_upcast
    trace_hf(model, tmp_path / "b", IDS)
    rep = find_divergence(str(tmp_path / "a"), str(tmp_path / "b"), reference=str(tmp_path / "ck"))
    assert (rep.first["key"], rep.first["cause"], rep.first["replay"]["side"]) == ("L0.attn.linear_norm",
                                                                                  "intrinsic", "B")


# ------------------------------------------------------------------------------------------------ decode

def test_generate_with_its_cached_decode_steps_matches_one_forward_and_the_float64_replay(tmp_path):
    """`generate()`: a prefill, then cached decode steps (`causal_conv1d_update`, the recurrent delta rule).
    Every linear-attention point holds every row, the prefill's and the decode steps', consistent with one
    forward over the same tokens, and each decode row is the float64 replay's over its sample's earlier rows."""
    import tic_trace
    model = _model()
    with tic_trace.trace(model, tmp_path / "a", adapter="hf", points_mode="full", auto_step=True) as t, \
            torch.no_grad():
        seq = model.generate(input_ids=IDS[:, :6], max_new_tokens=3, do_sample=False)
    assert t.failed is None, t.failed
    trace_hf(model, tmp_path / "b", seq[:, :-1])
    rep = find_divergence(str(tmp_path / "a"), str(tmp_path / "b"))
    assert rep.verdict == "consistent" and rep.not_comparable == []
    for point in LINEAR:
        p = next(p for p in rep.points if p.key == f"L2.{point}")
        assert (p.rows, p.only_a, p.only_b) == (16, 0, 0), (point, p.rows, p.only_a, p.only_b)
    model.save_pretrained(tmp_path / "ck")
    side = SideReplayer(CanonicalView(str(tmp_path / "a")), ExactReference(str(tmp_path / "ck")))
    for point in LINEAR:
        rows, y, exact, _ = side.exact_pair(point, 2)
        assert len(rows) == 16 and np.linalg.norm(y - exact) < 1e-5 * np.linalg.norm(exact), point


# ------------------------------------------------------------------------------------------------ layer kinds

def test_a_layer_kind_no_layer_runs_is_never_promised():
    """The points of a layer kind are promised only where some layer runs it (a model of one kind lists the
    other's as missing nowhere)."""
    from tic_trace.graph.adapter import get_adapter
    ad = get_adapter("hf")
    base = {"architecture": "Qwen3NextForCausalLM", "num_layers": 2, "num_experts": 4, "shared_experts": True,
            "qk_norm": True}
    both = set(ad.promised_points({**base, "linear_attention_layers": [0]}))
    linear_only = set(ad.promised_points({**base, "linear_attention_layers": [0, 1]}))
    softmax_only = set(ad.promised_points(base))
    assert LINEAR | SOFTMAX <= both
    assert LINEAR <= linear_only and not SOFTMAX & linear_only
    assert SOFTMAX <= softmax_only and not LINEAR & softmax_only


def test_replay_reads_the_layer_kinds_from_the_config_or_its_older_interval():
    """config.json's `layer_types`, else (older configs) every `full_attention_interval`-th layer full; a MoE
    block on every `decoder_sparse_step`-th layer but `mlp_only_layers` (ModelSpec.is_sparse), a dense MLP
    elsewhere."""
    from tic_trace.replay.model_spec import model_spec
    cfg = qwen3next_config().to_dict()
    spec = model_spec(cfg)
    assert spec.extra["linear_layers"] == [0, 2]
    assert spec.at_layer(0).num_experts == 0 and spec.at_layer(0).extra["at_linear_layer"]
    assert spec.at_layer(1).num_experts == 4 and not spec.at_layer(1).extra.get("at_linear_layer")
    older = {k: v for k, v in cfg.items() if k != "layer_types"}
    spec = model_spec({**older, "num_hidden_layers": 8, "full_attention_interval": 4, "decoder_sparse_step": 1,
                       "mlp_only_layers": [5]})
    assert spec.extra["linear_layers"] == [0, 1, 2, 4, 5, 6]
    assert [i for i in range(8) if not spec.at_layer(i).num_experts] == [5]
