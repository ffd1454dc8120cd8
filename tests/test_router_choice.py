"""Flip margins in the space the router chooses in (tic_trace/compare/choice.py): a DeepSeek-style router's top-k
compares sigmoid(logits) + a selection bias inside the kept expert groups, not the logits.

Checked against the real routers (transformers 5.24's `DeepseekV3TopkRouter`, megatron-core 0.16.1's
`group_limited_topk`), on the traces (the bias the model held is the bias the trace states), and end to end:
a near tie of the choice scores between experts whose logits are far apart is a near tie; a changed bias is
an unexplained flip and a named difference of the routers' selection bias.
"""
import numpy as np
import pytest
import torch
import transformers as T

from tic_trace import find_divergence
from tic_trace.compare.choice import RouterChoice, router_choice
from tic_trace.families.base import ROUTER_SELECTION_BIAS
from tic_trace.replay.intrinsic import IntrinsicError, replay_side
from tic_trace.replay.reference import ExactReference
from tic_trace.testing.hf_models import build_hf_model, sample_tokens
from tic_trace.view.align import CanonicalView

from conftest import trace_hf

IDS = sample_tokens(2, 10)
LAYER = 1                      # the first MoE layer (layer 0 is dense)
_CFG = dict(vocab_size=128, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
            intermediate_size=128, max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False,
            pad_token_id=0, bos_token_id=1, eos_token_id=2, n_routed_experts=8, num_experts_per_tok=2,
            moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1,
            routed_scaling_factor=2.5, norm_topk_prob=True, kv_lora_rank=32, q_lora_rank=24, qk_nope_head_dim=16,
            qk_rope_head_dim=8, v_head_dim=16)


def _model():
    cfg = T.DeepseekV3Config(**_CFG)
    cfg._attn_implementation = "eager"
    return build_hf_model(cfg)


def _chosen(choice: RouterChoice, logits: np.ndarray, k: int) -> list[set]:
    """The experts whose eligible choice score is among the k best (what `margins` ranks)."""
    scores = choice.eligible(logits)
    return [set(np.argsort(-scores[r], kind="stable")[:k].tolist()) for r in range(len(logits))]


def test_the_choice_is_the_hf_routers_choice():
    """Random logits and bias, 16 experts in 4 groups, 2 kept: the experts ranked best by RouterChoice are
    the ones HF's router selects, row for row."""
    cfg = T.DeepseekV3Config(**{**_CFG, "n_routed_experts": 16, "num_experts_per_tok": 4, "n_group": 4,
                                "topk_group": 2})
    router = T.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3TopkRouter(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=g))
        router.e_score_correction_bias.copy_(0.5 * torch.randn(16, generator=g))
        logits, _, ids = router(torch.randn(64, cfg.hidden_size, generator=g))
    choice = RouterChoice("sigmoid", router.e_score_correction_bias.double().numpy(), 4, 2, 2)
    assert _chosen(choice, logits.numpy(), 4) == [set(r.tolist()) for r in ids]
    # the raw logits' top-k is another choice on most rows: a margin read there is not the router's
    assert sum(set(np.argsort(-l)[:4].tolist()) != set(r.tolist()) for l, r in zip(logits.numpy(), ids)) > 16


def test_the_choice_is_megatrons_group_limited_choice():
    """megatron-core scores a group by its best topk // group_topk scores (here 3, not HF's 2)."""
    from megatron.core.transformer.moe.moe_utils import group_limited_topk
    g = torch.Generator().manual_seed(1)
    scores = torch.rand(64, 24, generator=g, dtype=torch.float64)
    _, ids = group_limited_topk(scores, topk=6, num_tokens=64, num_experts=24, num_groups=4, group_topk=2)
    logits = torch.logit(scores).numpy()         # sigmoid(logits) are the scores, no bias
    assert _chosen(RouterChoice("sigmoid", None, 4, 2, 3), logits, 6) == [set(r.tolist()) for r in ids]


def test_the_trace_states_the_bias_the_router_held(tmp_path):
    model = _model()
    with torch.no_grad():
        model.model.layers[LAYER].mlp.gate.e_score_correction_bias.copy_(torch.linspace(-0.2, 0.3, 8))
    trace_hf(model, tmp_path / "t", IDS)
    cfg = CanonicalView(str(tmp_path / "t")).config
    assert cfg["router_selection_bias"][str(LAYER)] == torch.linspace(-0.2, 0.3, 8).double().tolist()
    assert str(0) not in cfg["router_selection_bias"]           # the dense layer has no router
    assert (cfg["router_n_group"], cfg["router_topk_group"], cfg["router_group_top"]) == (2, 1, 2)
    choice = router_choice(cfg, LAYER)
    assert choice.space == "sigmoid+bias in groups" and choice.bias is not None
    assert router_choice({**cfg, "router_scoring": "softmax"}, LAYER).space == "logits"
    bad = {**cfg, "router_selection_bias": {str(LAYER): [0.0] * 7}}      # the wrong width: not used
    assert router_choice(bad, LAYER).bias is None
    # another layer's bias stated, not this one's (a pipeline stage's manifest): said, not assumed zero
    other = router_choice({**cfg, "router_selection_bias": {"2": [0.0] * 8}}, LAYER)
    assert other.bias is None and "not in the trace" in other.space
    assert "not in the trace" not in router_choice({**cfg, "router_selection_bias": {}}, LAYER).space
    # reports and `inspect` show the biases summarised, not 256 numbers per layer
    rep = find_divergence(str(tmp_path / "t"), str(tmp_path / "t"))
    assert rep.to_json()["sides"]["a"]["model"]["router_selection_bias"] == "2 layers x 8 experts, max |bias| 0.3"


def test_the_replay_chooses_with_the_bias_the_checkpoint_holds(tmp_path):
    """The float64 replay's top-k choice adds the router's selection bias, which the checkpoint stores under the
    family's name (`mlp.gate.e_score_correction_bias`: families/deepseek's `derived_weight` for the base's
    ROUTER_SELECTION_BIAS): it is read, and with a bias that dominates the scores the replayed ids are the model's."""
    model = _model()
    gate = model.model.layers[LAYER].mlp.gate
    with torch.no_grad():
        gate.e_score_correction_bias.copy_(torch.linspace(-1.0, 1.0, 8))
    model.save_pretrained(tmp_path / "ck")
    trace_hf(model, tmp_path / "t", IDS)
    ref = ExactReference(str(tmp_path / "ck"))
    bias = ref.weights(LAYER).get(ROUTER_SELECTION_BIAS, optional=True)
    assert bias is not None and torch.equal(bias.cpu(), gate.e_score_correction_bias.detach().double())
    ids = [r for r in replay_side(CanonicalView(str(tmp_path / "t")), ref) if r.point == "moe.topk_ids"]
    assert ids and all(isinstance(r, IntrinsicError) and r.rel_l2 == 0 for r in ids), ids


def _gate_logits(model, ids) -> torch.Tensor:
    got = {}

    def hook(mod, args, out):
        got["logits"] = out[0].detach().clone()
    h = model.model.layers[LAYER].mlp.gate.register_forward_hook(hook)
    with torch.no_grad():
        model(ids)
    h.remove()
    return got["logits"]


def _tie_choice_scores(model) -> tuple[int, int, int]:
    """Bias expert y so that its choice score sits just under expert x's at one token (x the k-th choice,
    y the next eligible expert, their logits far apart): (token row, x, y)."""
    gate = model.model.layers[LAYER].mlp.gate
    logits = _gate_logits(model, IDS).double()
    bias = gate.e_score_correction_bias.double()
    choice = RouterChoice("sigmoid", bias.numpy(), gate.num_group, gate.topk_group, 2)
    top, _ = choice.margins(logits.numpy(), 8)
    scores = choice.scores(logits.numpy())
    k = gate.top_k
    for row in range(len(logits)):
        x = int(np.flatnonzero(scores[row] == top[row, k - 1])[0])
        y = int(np.flatnonzero(scores[row] == top[row, k])[0])
        if abs(float(logits[row, x] - logits[row, y])) > 0.05 and x // 4 == y // 4:   # same group: stays eligible
            with torch.no_grad():
                gate.e_score_correction_bias[y] += float(top[row, k - 1] - top[row, k]) - 2e-7
            return row, x, y
    raise AssertionError("no token whose k-th and next expert have logits 0.05 apart")


def test_a_near_tie_of_the_choice_scores_is_a_near_tie(tmp_path):
    """Side B's router rounds one expert's logits a little differently (its weight row scaled by a few 1e-6):
    at the token whose choice scores were tied to 2e-7 the choice flips. On the choice scores the margin is within the
    error; on the raw logits (the margin the finder read before) it is over 100x the logits' error."""
    model = _model()
    row, x, y = _tie_choice_scores(model)
    logits_a = _gate_logits(model, IDS)
    trace_hf(model, tmp_path / "a", IDS)
    w = model.model.layers[LAYER].mlp.gate.weight
    with torch.no_grad():       # expert y's logit at that token 2e-6 higher: its score ~5e-7, over the tie
        w[y] *= 1 + 2e-6 / float(logits_a[row, y])
    logits_b = _gate_logits(model, IDS)
    trace_hf(model, tmp_path / "b", IDS)
    rep = find_divergence(str(tmp_path / "a"), str(tmp_path / "b"))
    f = next(f for f in rep.findings if f.cause == "routing" and f.layer == LAYER)
    assert f.detail["flipped"] >= 1 and f.detail["unexplained"] == 0, f.detail
    assert f.detail["margin_space"] == "sigmoid+bias in groups"
    assert not f.computational
    err = float((logits_a[row] - logits_b[row]).abs().max())
    assert abs(float(logits_a[row, x] - logits_a[row, y])) > 100 * 2 * err
    assert not [d for d in rep.contract if d["section"] == "weights" and "bias" in str(d)]


def test_a_changed_selection_bias_is_unexplained_and_named(tmp_path):
    """Side B's router adds another bias to one expert (an expert bias not synced after a training step): the
    flips have margins over the error, and the contract names the bias and the expert."""
    model = _model()
    trace_hf(model, tmp_path / "a", IDS)
    with torch.no_grad():
        model.model.layers[LAYER].mlp.gate.e_score_correction_bias[3] += 0.3
    trace_hf(model, tmp_path / "b", IDS)
    rep = find_divergence(str(tmp_path / "a"), str(tmp_path / "b"))
    assert rep.verdict == "divergent" and rep.first["key"] == f"L{LAYER}.moe.topk_ids"
    f = rep.findings[0]
    assert f.cause == "routing" and f.computational and f.detail["unexplained"] == f.detail["flipped"] > 0
    bias = [d for d in rep.contract if d["section"] == "weights" and d["key"] == f"L{LAYER}.moe.topk_ids"]
    assert len(bias) == 1 and "expert(s) 3" in bias[0]["note"], rep.contract
    assert any(x.cause == "weights" and x.key == f"L{LAYER}.moe.topk_ids" for x in rep.findings)


@pytest.mark.parametrize("scoring", ["softmax", None])
def test_softmax_routers_keep_their_logit_margins(scoring):
    """A softmax router (or a trace that states no scoring) chooses on the logits' order: margins and errors
    are the logits' own."""
    c = router_choice({"router_scoring": scoring, "router_selection_bias": {"1": [1.0, 2.0]}, "num_experts": 2}, 1)
    logits = np.array([[0.3, -0.2, 0.1]])
    top, gm = c.margins(logits, 3)
    assert c.space == "logits" and gm is None and top.tolist() == [[0.3, 0.1, -0.2]]
    assert c.score_error(np.array([1e-3]), "bfloat16").tolist() == [1e-3]


def test_selection_bias_differences_name_layers_and_experts():
    from tic_trace.compare.choice import selection_bias_differences
    a = {"router_selection_bias": {"1": [0.0, 0.1, float("nan")], "2": [0.0, 0.0, 0.0], "x": [1.0]}}
    b = {"router_selection_bias": {"1": [0.0, 0.2, float("nan")], "2": [0.0, 0.0, 0.0], "3": [1.0, 1.0, 1.0]}}
    assert selection_bias_differences(a, b) == [(1, [1])]
    assert selection_bias_differences(a, {}) == []
