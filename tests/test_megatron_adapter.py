"""The Megatron adapter on real megatron-core 0.16.1 (CPU, gloo): HF vs Megatron with identical weights is
consistent at every canonical point; TP=2, TP=2+SP and EP=2 traces (all ranks in one trace directory)
reassemble to the TP=1 trace; planted faults on the Megatron side are found at their point and layer;
promised-but-missing points are reported; packed-THD / context-parallel row mapping; Transformer-Engine
names (on a TE-shaped module tree: identity norms, norm fused into the next linear).

All multi-rank configurations run in ONE 2-process spawn (`_multi_worker`), which re-initialises megatron's
parallel state between configurations.
"""
from __future__ import annotations

import copy
import json
from pathlib import Path


import numpy as np
import pytest
import torch

import megatron.core  # noqa: E402,F401 - a required test dependency: fail loudly if missing
import transformers  # noqa: E402,F401 - a required test dependency: fail loudly if missing

import tic_trace  # noqa: E402
from tic_trace.graph.adapter import get_adapter  # noqa: E402
from tic_trace.adapters.megatron import POINTS, MegatronAdapter  # noqa: E402
from tic_trace.adapters.megatron_layout import rows_from_packed, rows_from_sbhd, zigzag_position  # noqa: E402
from tic_trace.adapters.megatron_weights import hf_to_megatron_state_dict, load_into  # noqa: E402
from tic_trace.view.align import CanonicalView  # noqa: E402
from tic_trace.graph.canonical import key_name  # noqa: E402
from tic_trace import Filters, find_divergence  # noqa: E402
from tic_trace.compare.diverge import rejudge  # noqa: E402
from tic_trace.testing import megatron_cpu as mc  # noqa: E402
from tic_trace.testing.faults import FAULTS, hf_faults, megatron_faults, plant, prepare  # noqa: E402
from tic_trace.testing.hf_models import build_hf_model, sample_tokens, tiny_qwen3_config  # noqa: E402

B, S = 2, 12
KEYS = ["s0", "s1"]
FAULT_LAYER = 1


# ------------------------------------------------------------------------------------------------
# helpers shared by the test process and the spawned ranks
# ------------------------------------------------------------------------------------------------

def hf_cfg(kind: str):
    """dense | moe | mixed (layer 0 dense, layer 1 MoE)."""
    if kind == "mixed":
        return tiny_qwen3_config(moe=True, mlp_only_layers=[0])
    return tiny_qwen3_config(moe=kind == "moe")


def trace_megatron(out, cfg, hf_sd, ids, keys, *, tp=1, ep=1, sp=False, dispatcher="alltoall", fault=None,
                   layer=FAULT_LAYER, rank=None, filters=None, wrap=None, packed=None, padded_vocab=None,
                   recompute=False):
    """Build the GPTModel of the current parallel state, load the HF weights, optionally plant a fault or
    reshape the module tree (`wrap(model) -> model`), trace one forward into `out`. `recompute`: training
    mode with full activation recompute, forward + backward traced."""
    from megatron.core import parallel_state as ps

    extra = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1) if recompute else {}
    model = mc.build_gpt_model(cfg, tp=tp, ep=ep, sp=sp, dispatcher=dispatcher, padded_vocab_size=padded_vocab,
                               **extra)
    load_into(model, hf_to_megatron_state_dict(
        hf_sd, cfg, tp_rank=ps.get_tensor_model_parallel_rank(), tp_size=ps.get_tensor_model_parallel_world_size(),
        ep_rank=ps.get_expert_model_parallel_rank(), ep_size=ps.get_expert_model_parallel_world_size(),
        etp_rank=ps.get_expert_tensor_parallel_rank(), etp_size=ps.get_expert_tensor_parallel_world_size(),
        padded_vocab_size=padded_vocab))
    if fault:
        plant(model, "megatron", fault, layer)
    if wrap is not None:
        model = wrap(model)
    pos = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
    with tic_trace.trace(model, out, adapter=MegatronAdapter(vocab_size=cfg.vocab_size), points_mode="full",
                         sample_keys=keys, rank=rank, filters=filters) as t:
        if recompute:
            model.train()
            model(ids, pos, attention_mask=None).float().pow(2).mean().backward()
        else:
            with torch.no_grad():
                model(ids, pos, attention_mask=None, packed_seq_params=packed)
    assert t.failed is None, t.failed
    return model


def trace_hf(out, model, ids, keys):
    with tic_trace.trace(model, out, adapter="hf", points_mode="full", sample_keys=keys) as t, torch.no_grad():
        model(ids)
    assert t.failed is None, t.failed


def _reinit_parallel(tp: int, ep: int) -> None:
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=1,
                                 expert_model_parallel_size=ep)
    model_parallel_cuda_manual_seed(1234, inference_rng_tracker=True, force_reset_rng=True)


MULTI = {
    "dense_tp2": dict(kind="dense", tp=2, ep=1, sp=False),
    "moe_tp2": dict(kind="moe", tp=2, ep=1, sp=False),
    "dense_tp2_sp": dict(kind="dense", tp=2, ep=1, sp=True),
    "moe_tp2_sp": dict(kind="moe", tp=2, ep=1, sp=True),
    # EP=2 at TP=1: the two ranks are data-parallel for attention, each with its own sample
    "moe_ep2": dict(kind="moe", tp=1, ep=2, sp=False, split_batch=True),
    # fewer query groups (2) than TP ranks (4): each KV head lives on two ranks
    "dense_tp4": dict(kind="dense", tp=4, ep=1, sp=False, world=4),
}


def _multi_worker(rank: int, world: int, port: int, workdir: str) -> None:
    """One spawned rank: traces every MULTI configuration of this world size into workdir/<name> (rank set
    explicitly), re-initialising megatron's parallel state between configurations."""
    torch.set_num_threads(1)
    workdir = Path(workdir)
    data = torch.load(workdir / "inputs.pt", weights_only=True)
    mc.init_parallel(rank, world, tp=world, port=port)
    try:
        for name, case in MULTI.items():
            if case.get("world", 2) != world:
                continue
            _reinit_parallel(case["tp"], case["ep"])
            ids, keys = data["tokens"], KEYS
            if case.get("split_batch"):
                ids, keys = ids[rank:rank + 1], keys[rank:rank + 1]
            trace_megatron(workdir / name, hf_cfg(case["kind"]), data[f"sd_{case['kind']}"], ids, keys,
                           tp=case["tp"], ep=case["ep"], sp=case["sp"], rank=rank)
    finally:
        mc.destroy()


# ------------------------------------------------------------------------------------------------
# fixtures: HF models, single-rank megatron in this process, one multi-rank spawn
# ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def hf_models():
    return {k: build_hf_model(hf_cfg(k), seed=0) for k in ("dense", "moe", "mixed")}


@pytest.fixture(scope="module")
def tokens():
    return sample_tokens(B, S)


@pytest.fixture(scope="module")
def single_rank():
    with mc.single_rank():
        yield


@pytest.fixture(scope="module")
def base_traces(tmp_path_factory, hf_models, tokens, single_rank):
    """HF and Megatron TP1 traces of the dense and the MoE model (same weights, fp32)."""
    root = tmp_path_factory.mktemp("base")
    out = {}
    for kind in ("dense", "moe"):
        hf = hf_models[kind]
        trace_hf(root / f"hf_{kind}", hf, tokens, KEYS)
        trace_megatron(root / f"mg_{kind}", hf.config, hf.state_dict(), tokens, KEYS)
        out[f"hf_{kind}"], out[f"mg_{kind}"] = root / f"hf_{kind}", root / f"mg_{kind}"
    return out


@pytest.fixture(scope="module")
def multi_traces(tmp_path_factory, hf_models, tokens):
    root = tmp_path_factory.mktemp("multi")
    torch.save({"tokens": tokens, "sd_dense": hf_models["dense"].state_dict(),
                "sd_moe": hf_models["moe"].state_dict()}, root / "inputs.pt")
    for world in sorted({case.get("world", 2) for case in MULTI.values()}):
        mc.spawn_ranks(_multi_worker, world, args=(str(root),))
    return root


def _compared(rep) -> set[str]:
    return {p.point for p in rep.points if p.status != "not_comparable"}


def _promised(path) -> set[str]:
    v = CanonicalView(path)
    return set(v.adapter.promised_points(v.config)) | {"logprobs"}


# ------------------------------------------------------------------------------------------------
# HF vs Megatron, TP=1
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_hf_vs_megatron_consistent_at_every_point(base_traces, kind):
    a, b = base_traces[f"hf_{kind}"], base_traces[f"mg_{kind}"]
    rep = find_divergence(str(a), str(b))
    assert rep.verdict == "consistent", [(p.key, p.status, p.error) for p in rep.points if p.status != "ok"]
    assert rep.not_comparable == []
    promised = _promised(b)
    hf_lacks = promised - _promised(a)
    assert _compared(rep) == promised - hf_lacks
    assert ("moe.router_logits" in promised) == (kind == "moe")
    n_layers = CanonicalView(str(b)).n_layers
    layered = {p.point for p in POINTS} & promised - {"embed", "final_norm", "logits"}
    assert len(rep.points) == len(layered) * n_layers + 4   # + embed, final_norm, logits, logprobs
    assert _counts(rep.rows) == {"a": B * S, "b": B * S, "matched": B * S, "unmatched_a": 0, "unmatched_b": 0}
    assert max(p.error for p in rep.points) < 1e-5


def test_megatron_view_is_pre_residual_and_s_major(base_traces, tokens):
    """attn.out and mlp.out are recorded before bda's in-place residual add; rows are s-major."""
    v = CanonicalView(str(base_traces["mg_moe"]))
    for lay in range(2):
        inp, att, mid = (v.load(p, lay).values for p in ("input", "attn.out", "mid"))
        mlp, out = (v.load(p, lay).values for p in ("mlp.out", "output"))
        np.testing.assert_allclose(inp + att, mid, rtol=0, atol=1e-6)
        np.testing.assert_allclose(mid + mlp, out, rtol=0, atol=1e-6)
        # no shared experts: the routed experts' combined output is the whole MoE output
        np.testing.assert_array_equal(v.load("moe.experts_out", lay).values, mlp)
    emb = v.load("embed", None)
    assert emb.rows[:4] == [("s0", 0), ("s1", 0), ("s0", 1), ("s1", 1)]
    assert [v.tokens[("s1", p)] for p in range(S)] == tokens[1].tolist()


# ------------------------------------------------------------------------------------------------
# multi-rank traces reassemble to TP=1
# ------------------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("name", list(MULTI))
def test_multi_rank_trace_reassembles_to_tp1(base_traces, multi_traces, name):
    case = MULTI[name]
    ref, path = base_traces[f"mg_{case['kind']}"], multi_traces / name
    vb = CanonicalView(str(path))
    world = case.get("world", 2)
    assert vb.trace.ranks == list(range(world))
    groups = vb.adapter.rank_groups(vb.trace.ranks, {r: vb.trace.rank_info(r) for r in vb.trace.ranks})
    assert groups == ([[0], [1]] if case["tp"] == 1 else [list(range(world))])
    rep = find_divergence(str(ref), vb)
    assert rep.verdict == "consistent", [(p.key, p.status, p.error) for p in rep.points if p.status != "ok"]
    assert rep.not_comparable == []
    assert _compared(rep) == _promised(ref) == _promised(path)
    assert rep.rows["matched"] == B * S
    assert max(p.error for p in rep.points) < 1e-5
    # the shards really were shards: rank 0 holds half of the fused QKV / the vocab / (SP) the sequence
    p0 = vb.trace.open_pass(0, 0)
    qkv = p0.record("decoder.layers.0.self_attention.linear_qkv:out[0]")
    full_qkv = (4 + 2 * 2) * 16
    assert qkv.shape[-1] == full_qkv // case["tp"]
    assert p0.record("output_layer:out[0]").shape[-1] == 128 // case["tp"]
    assert p0.record("decoder.layers.1:out[0]").shape[0] == (S // 2 if case["sp"] else S)


# ------------------------------------------------------------------------------------------------
# planted faults on the Megatron side
# ------------------------------------------------------------------------------------------------

def test_every_hf_fault_has_a_megatron_planter():
    assert set(hf_faults(moe=True)) <= set(megatron_faults(moe=True))
    assert set(hf_faults(moe=False)) <= set(megatron_faults(moe=False))


@pytest.mark.parametrize("fault", megatron_faults(moe=True))
def test_planted_fault_found_at_its_point_and_layer(tmp_path, base_traces, hf_models, tokens, fault):
    f = FAULTS[fault]
    hf = hf_models["moe"]
    trace_megatron(tmp_path / "mg", hf.config, hf.state_dict(), tokens, KEYS, fault=fault)
    rep = find_divergence(str(base_traces["hf_moe"]), str(tmp_path / "mg"))
    assert rep.verdict == "divergent"
    assert rep.first["key"] == key_name(f.point, FAULT_LAYER if f.layered else None), rep.first["key"]
    cause = rep.first["cause"]
    assert cause == f.cause or (f.point == "moe.router_logits" and cause == "routing"), cause
    doc = json.loads(json.dumps(rep.to_json()))
    assert rejudge(doc) == doc


def test_near_tie_routing_hf_vs_megatron(tmp_path, hf_models, tokens, single_rank):
    """Two experts nearly tied in both models; Megatron's gate rounds their difference the other way."""
    hf = copy.deepcopy(hf_models["moe"])
    prepare(hf, "hf", "routing_near_tie", FAULT_LAYER)
    trace_hf(tmp_path / "hf", hf, tokens, KEYS)
    trace_megatron(tmp_path / "mg", hf.config, hf.state_dict(), tokens, KEYS, fault="routing_near_tie")
    rep = find_divergence(str(tmp_path / "hf"), str(tmp_path / "mg"))
    assert rep.first["key"] == key_name("moe.topk_ids", FAULT_LAYER) and rep.first["cause"] == "routing"
    f = next(x for x in rep.findings if x.cause == "routing")
    assert f.layer == FAULT_LAYER and not f.computational and f.detail["near_tie"] == f.detail["flipped"] > 0
    assert not [p.key for p in rep.points if p.status == "divergent" and p.cause != "routing"]
    assert find_divergence(str(tmp_path / "hf"), str(tmp_path / "mg"), accept_near_tie=True).verdict == "consistent"


# ------------------------------------------------------------------------------------------------
# the adapter's promises
# ------------------------------------------------------------------------------------------------

def test_missing_promised_points_are_reported_not_hidden(tmp_path, base_traces, hf_models, tokens):
    hf = hf_models["moe"]
    trace_megatron(tmp_path / "mg", hf.config, hf.state_dict(), tokens, KEYS,
                   filters=Filters(exclude_modules=["*core_attention"]))
    rep = find_divergence(str(base_traces["hf_moe"]), str(tmp_path / "mg"))
    nc = {d["key"]: d["reason"] for d in rep.not_comparable}
    for point in ("attn.q_rope", "attn.k_rope", "attn.core"):
        assert "side B's adapter promises it" in nc[point]
        assert "only side A" in nc[key_name(point, 0)]
    assert rep.verdict == "consistent"           # everything that was recorded agrees

    # a mapping whose regex matches no record (a wrong mapping) is reported the same way
    class Broken(MegatronAdapter):
        name = "megatron"
        points = tuple(pm if pm.point != "mlp.out" else type(pm)("mlp.out", r"decoder\.layers\.(?P<layer>\d+)\.mlp:output")
                       for pm in POINTS)
    vb = CanonicalView(str(base_traces["mg_moe"]), Broken())
    rep = find_divergence(str(base_traces["hf_moe"]), vb)
    nc = {d["key"]: d["reason"] for d in rep.not_comparable}
    assert "side B's adapter promises it" in nc["mlp.out"]


def test_padded_vocab(tmp_path, base_traces, hf_models, tokens):
    """Vocab padded to 160: the adapter, told the true 128, cuts the padding columns."""
    hf = hf_models["moe"]
    trace_megatron(tmp_path / "pad", hf.config, hf.state_dict(), tokens, KEYS, padded_vocab=160)
    vb = CanonicalView(str(tmp_path / "pad"))
    rep = find_divergence(str(base_traces["hf_moe"]), vb)
    assert rep.verdict == "consistent" and rep.not_comparable == []
    assert _compared(rep) == _promised(tmp_path / "pad")
    assert vb.config["padded_vocab_size"] == 160 and vb.config["vocab_size"] == 128
    assert vb.trace.open_pass(0, 0).record("output_layer:out[0]").shape == (S, B, 160)
    assert vb.load("logits", None).values.shape == (B * S, 128)


def test_activation_recompute_is_skipped(tmp_path, base_traces, hf_models, tokens, monkeypatch):
    """Training forward + backward with full activation recompute: the layers run twice, the second time
    inside backward; those records are tagged and skipped, and the view equals the eval forward's."""
    import megatron.core.tensor_parallel.random as mrandom

    # test-only: CheckpointFunction saves/restores the CUDA RNG state; there is none on CPU
    monkeypatch.setattr(mrandom, "_get_cuda_rng_state", lambda *a, **k: None)
    monkeypatch.setattr(mrandom, "_set_cuda_rng_state", lambda *a, **k: None)
    hf = hf_models["moe"]
    calls = []
    model = trace_megatron(tmp_path / "rec", hf.config, hf.state_dict(), tokens, KEYS, recompute=True,
                           wrap=lambda m: (m.decoder.layers[0].register_forward_hook(lambda *a: calls.append(1)), m)[1])
    assert len(calls) == 2                        # forward, and the recompute inside backward
    assert model.decoder.layers[0].self_attention.linear_qkv.weight.grad is not None
    vb = CanonicalView(str(tmp_path / "rec"))
    rep = find_divergence(str(base_traces["hf_moe"]), vb)
    assert rep.verdict == "consistent" and rep.not_comparable == []
    assert {r.phase for r in vb.trace.open_pass(0, 0).records} == {"forward"}
    assert all(len(es) == 1 for es in vb.entries.values())


def test_rank_groups_and_global_layers_for_pipeline_stages():
    ad = MegatronAdapter()
    infos = {}
    for r in range(8):   # tp2 x pp2 x dp2, megatron's default order tp-cp-ep-dp-pp
        tp, dp, pp = r % 2, (r // 2) % 2, r // 4
        infos[r] = {"coords": {"tp_rank": tp, "tp_size": 2, "dp_rank": dp, "pp_rank": pp, "cp_rank": 0,
                               "layer_offset": 3 * pp}}
    assert ad.rank_groups(list(range(8)), infos) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert ad.global_layer(1, infos[5], {}) == 4 and ad.global_layer(1, infos[1], {}) == 1
    infos[1]["coords"]["tp_rank"], infos[0]["coords"]["tp_rank"] = 0, 1
    assert ad.rank_groups([0, 1], {0: infos[0], 1: infos[1]}) == [[1, 0]]     # TP-rank order
    assert ad.rank_groups([0, 1], {0: {}, 1: {}}) == [[0], [1]]
    # virtual pipeline: the tracer names chunk i `chunk{i}.`; each chunk has its own offset
    vpp = {"coords": {"layer_offset": 0, "layer_offsets": [0, 4]}}
    pm = next(pm for pm in POINTS if pm.point == "output")
    m = pm.regex().match("chunk1.module.decoder.layers.1:out[0]")
    assert m.group("chunk") == "1" and m.group("layer") == "1"
    assert ad.global_layer(1, {**vpp, "chunk": 1}, {}) == 5 and ad.global_layer(1, {**vpp, "chunk": 0}, {}) == 1


def test_pipeline_chunks_map_to_global_layers(tmp_path, base_traces, hf_models, tokens):
    """Two pipeline chunks in one process (like virtual pipeline stages on one rank): chunk 0 = embedding +
    layer 0, chunk 1 = layer 1 (layer_number 2) + final norm + head, fed with chunk 0's output through
    set_input_tensor. Traced as a list (`chunk{i}.` names), the view has global layers 0 and 1."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    hf = hf_models["moe"]
    cfg = hf.config
    full = mc.build_gpt_model(cfg)
    load_into(full, hf_to_megatron_state_dict(hf.state_dict(), cfg))
    tcfg = full.config
    spec = get_gpt_decoder_block_spec(tcfg, use_transformer_engine=False, normalization="RMSNorm")

    def chunk(pre, post, layer):
        m = GPTModel(config=tcfg, transformer_layer_spec=spec, vocab_size=cfg.vocab_size,
                     max_sequence_length=cfg.max_position_embeddings, pre_process=pre, post_process=post,
                     parallel_output=True, position_embedding_type="rope", rotary_base=10000.0).eval()
        m.decoder.layers = torch.nn.ModuleList([full.decoder.layers[layer]])
        if pre:
            m.embedding = full.embedding
        if post:
            m.decoder.final_layernorm, m.output_layer = full.decoder.final_layernorm, full.output_layer
        return m

    c0, c1 = chunk(True, False, 0), chunk(False, True, 1)
    assert c1.decoder.layers[0].layer_number == 2
    pos = torch.arange(S).unsqueeze(0).expand(B, -1)
    with tic_trace.trace([c0, c1], tmp_path / "pp", adapter="megatron", points_mode="full", sample_keys=KEYS) as t, \
            torch.no_grad():
        h = c0(tokens, pos, attention_mask=None)
        c1.set_input_tensor(h)
        c1(tokens, pos, attention_mask=None)
    assert t.failed is None
    vb = CanonicalView(str(tmp_path / "pp"))
    assert vb.trace.rank_info(0)["coords"]["layer_offsets"] == [0, 1]
    assert vb.trace.open_pass(0, 0).get("chunk1.decoder.layers.0:out[0]") is not None
    rep = find_divergence(str(base_traces["hf_moe"]), vb)
    assert rep.verdict == "consistent" and rep.not_comparable == []
    assert _compared(rep) == _promised(base_traces["mg_moe"])
    assert {lay for _, lay in vb.points() if lay is not None} == {0, 1}


def test_shared_experts_split_from_routed_output(tmp_path, hf_models, tokens, single_rank):
    """A Megatron MoE with a shared expert: experts_out (tapped combine_postprocess) is the routed part only,
    shared_out the shared expert's, and the two add up to the MoE output."""
    hf = hf_models["moe"]
    model = mc.build_gpt_model(hf.config, moe_shared_expert_intermediate_size=32)
    missing = model.load_state_dict(hf_to_megatron_state_dict(hf.state_dict(), hf.config), strict=False).missing_keys
    assert missing and all(".shared_experts." in k for k in missing)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".shared_experts." in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
    pos = torch.arange(S).unsqueeze(0).expand(B, -1)
    with tic_trace.trace(model, tmp_path / "mg", adapter="megatron", points_mode="full", sample_keys=KEYS) as t, \
            torch.no_grad():
        model(tokens, pos, attention_mask=None)
    assert t.failed is None
    v = CanonicalView(str(tmp_path / "mg"))
    assert v.config["shared_experts"] and "moe.shared_out" in v.adapter.promised_points(v.config)
    assert {p for p, _ in v.points()} == _promised(tmp_path / "mg")
    for lay in range(2):
        routed, shared, mlp = (v.load(p, lay).values for p in ("moe.experts_out", "moe.shared_out", "mlp.out"))
        assert np.abs(shared).max() > 1e-3 and np.abs(routed).max() > 1e-3
        np.testing.assert_allclose(routed + shared, mlp, rtol=0, atol=1e-6)


def test_promised_points_match_what_the_trace_has(base_traces):
    for kind in ("dense", "moe"):
        v = CanonicalView(str(base_traces[f"mg_{kind}"]))
        assert {p for p, _ in v.points()} == _promised(base_traces[f"mg_{kind}"])
        assert v.config["spec"] == "local" and v.config["vocab_size"] == 128
        assert get_adapter("megatron").name == "megatron"


# ------------------------------------------------------------------------------------------------
# rows: SBHD, packed THD, context parallel
# ------------------------------------------------------------------------------------------------

def _te_partition_reference(cu_padded: list[int], cp_size: int, cp_rank: int) -> list[int]:
    """Global token indices on a CP rank, as TE's thd_get_partitioned_indices gives them: every segment is
    cut into 2*cp pieces; the rank keeps pieces cp_rank and 2*cp-1-cp_rank, segment after segment."""
    out = []
    for i in range(len(cu_padded) - 1):
        start, length = cu_padded[i], cu_padded[i + 1] - cu_padded[i]
        seg = length // (2 * cp_size)
        for piece in (cp_rank, 2 * cp_size - 1 - cp_rank):
            out.extend(range(start + piece * seg, start + (piece + 1) * seg))
    return out


def _packed(real_lengths, padded_lengths):
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.tensor([0, *np.cumsum(real_lengths)], dtype=torch.int32)
    cup = torch.tensor([0, *np.cumsum(padded_lengths)], dtype=torch.int32)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cup,
                           cu_seqlens_kv_padded=cup, max_seqlen_q=int(max(padded_lengths)),
                           max_seqlen_kv=int(max(padded_lengths)))


def test_rows_from_packed_without_cp():
    psp = _packed([5, 7, 3], [6, 8, 4])
    keys, pos = rows_from_packed(psp, ["a", "b", "c"])
    assert len(keys) == 18
    assert keys[:6] == ["a"] * 5 + [None] and pos[:6] == list(range(6))
    assert keys[6:14] == ["b"] * 7 + [None] and pos[6:14] == list(range(8))
    assert keys[14:] == ["c"] * 3 + [None]
    # no padded cu_seqlens: the real ones are the layout; default keys s{i}; extra rows are padding
    psp.cu_seqlens_q_padded = None
    keys, pos = rows_from_packed(psp, n_rows=17)
    assert keys == ["s0"] * 5 + ["s1"] * 7 + ["s2"] * 3 + [None, None] and pos[5:8] == [0, 1, 2]
    with pytest.raises(ValueError):
        rows_from_packed(psp, ["a"])


@pytest.mark.parametrize("cp_size", [2, 4])
def test_rows_from_packed_with_context_parallel(cp_size):
    real, padded = [13, 6, 16], [16, 8, 16]
    psp = _packed(real, padded)
    cup = psp.cu_seqlens_q_padded.tolist()
    # the global packed batch as Megatron builds it: input_ids [1, T]; token t of segment i is at t - cup[i]
    glob_keys, glob_pos = rows_from_packed(psp, ["a", "b", "c"])
    seen = []
    for r in range(cp_size):
        keys, pos = rows_from_packed(psp, ["a", "b", "c"], cp_size=cp_size, cp_rank=r)
        idx = _te_partition_reference(cup, cp_size, r)
        assert len(keys) == len(idx) == cup[-1] // cp_size
        assert keys == [glob_keys[t] for t in idx] and pos == [glob_pos[t] for t in idx]
        seen += [(k, p) for k, p in zip(keys, pos) if k is not None]
    assert sorted(seen) == sorted((k, p) for k, n in zip("abc", real) for p in range(n))
    with pytest.raises(ValueError):
        rows_from_packed(_packed([5], [6]), ["a"], cp_size=2, cp_rank=0)   # 6 is not a multiple of 4


def test_rows_from_sbhd_context_parallel_matches_megatron_split(single_rank):
    """SBHD + CP: megatron's own get_batch_on_this_cp_rank split, positions from the zigzag formula."""
    from megatron.core.utils import get_batch_on_this_cp_rank

    class _Group:                # a stand-in CP group of size 2 (get_pg_size/get_pg_rank only ask these)
        def __init__(self, rank):
            self._rank = rank

        def size(self):
            return 2

        def rank(self):
            return self._rank

    seq = 16
    pos_ids = torch.arange(seq).unsqueeze(0).expand(B, -1)
    for r in range(2):
        local = get_batch_on_this_cp_rank({"position_ids": pos_ids.clone()}, cp_group=_Group(r))["position_ids"]
        keys, pos = rows_from_sbhd(B, local.shape[1], KEYS, cp_size=2, cp_rank=r)
        assert pos == local.t().reshape(-1).tolist()            # s-major rows
        assert keys[:2] == KEYS
    assert [zigzag_position(p, 16, 2, 1) for p in range(8)] == [4, 5, 6, 7, 8, 9, 10, 11]
    assert [zigzag_position(p, 16, 2, 0) for p in range(8)] == [0, 1, 2, 3, 12, 13, 14, 15]


def test_rows_from_forward_packed_and_sbhd(single_rank):
    class _T:
        sample_keys = ["x", "y"]

    ad = MegatronAdapter()
    psp = _packed([3, 4], [4, 4])
    ids = torch.arange(8).unsqueeze(0)
    keys, pos, toks = ad.rows_from_forward(_T(), (ids, None, None), {"packed_seq_params": psp})
    assert keys == ["x", "x", "x", None, "y", "y", "y", "y"] and pos == [0, 1, 2, 3, 0, 1, 2, 3]
    assert toks == list(range(8))
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    keys, pos, toks = ad.rows_from_forward(_T(), (ids, None, None), {})
    assert keys == ["x", "y"] * 3 and pos == [0, 0, 1, 1, 2, 2] and toks == [1, 4, 2, 5, 3, 6]


def test_packed_thd_forward_matches_hf(tmp_path, hf_models, single_rank):
    """Two samples of different lengths: HF runs them one by one, Megatron as one padded THD pack."""
    hf = hf_models["moe"]
    lens, padded = [9, 6], [10, 8]
    g = torch.Generator().manual_seed(7)
    samples = [torch.randint(0, 128, (n,), generator=g) for n in lens]
    with tic_trace.trace(hf, tmp_path / "hf", adapter="hf", points_mode="full") as t, torch.no_grad():
        for key, ids in zip(KEYS, samples):
            t.sample_keys = [key]
            hf(ids[None])
            t.step()
    packed = torch.zeros(1, sum(padded), dtype=torch.long)
    off = 0
    for ids, n in zip(samples, padded):
        packed[0, off:off + len(ids)] = ids
        off += n
    psp = _packed(lens, padded)
    trace_megatron(tmp_path / "mg", hf.config, hf.state_dict(), packed, KEYS, wrap=mc.per_segment_thd_attention,
                   packed=psp)
    vb = CanonicalView(str(tmp_path / "mg"))
    rep = find_divergence(str(tmp_path / "hf"), vb)
    assert rep.verdict == "consistent", [(p.key, p.status, p.error) for p in rep.points if p.status != "ok"]
    assert rep.not_comparable == []
    assert _counts(rep.rows) == {"a": sum(lens), "b": sum(lens), "matched": sum(lens), "unmatched_a": 0,
                                 "unmatched_b": 0}
    assert _compared(rep) == _promised(tmp_path / "mg")
    # records really were THD: [t, 1, h] hidden states, squeezed [t, heads, hn] core-attention inputs
    p0 = vb.trace.open_pass(0, 0)
    assert p0.record("decoder.layers.0:out[0]").shape == (sum(padded), 1, 64)
    assert p0.record("decoder.layers.0.self_attention.core_attention:in[0]").shape == (sum(padded), 4, 16)


# ------------------------------------------------------------------------------------------------
# Transformer-Engine names
# ------------------------------------------------------------------------------------------------

class TELayerNormColumnParallelLinear(torch.nn.Module):
    """Name-alike of TE's fused norm+linear: holds `layer_norm_weight`, never returns the normalised input."""

    def __init__(self, linear, norm_weight, eps):
        super().__init__()
        self.linear = linear
        self.layer_norm_weight = torch.nn.Parameter(norm_weight.detach().clone())
        self.eps = eps

    def forward(self, x, *args, **kwargs):
        h = torch.nn.functional.rms_norm(x, (x.shape[-1],), self.layer_norm_weight, self.eps)
        return self.linear(h, *args, **kwargs)


class _Wrapper(torch.nn.Module):
    """Like DDP / Float16Module: the model is `.module`."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


def te_shaped(model):
    """Turn a local-spec GPTModel into the TE spec's module tree: identity input norms fused into linear_qkv,
    dense layers' identity pre-MLP norm fused into linear_fc1 (MoE layers keep a real norm); then wrap it
    twice (module.module.*)."""
    from megatron.core.transformer.identity_op import IdentityOp

    for lay in model.decoder.layers:
        att = lay.self_attention
        att.linear_qkv = TELayerNormColumnParallelLinear(att.linear_qkv, lay.input_layernorm.weight,
                                                         lay.input_layernorm.eps)
        lay.input_layernorm = IdentityOp()
        if not hasattr(lay.mlp, "router"):
            lay.mlp.linear_fc1 = TELayerNormColumnParallelLinear(lay.mlp.linear_fc1, lay.pre_mlp_layernorm.weight,
                                                                 lay.pre_mlp_layernorm.eps)
            lay.pre_mlp_layernorm = IdentityOp()
    return _Wrapper(_Wrapper(model))


def test_te_spec_names_on_a_te_shaped_tree(tmp_path, hf_models, tokens, single_rank):
    hf = hf_models["mixed"]                      # layer 0 dense, layer 1 MoE
    trace_hf(tmp_path / "hf", hf, tokens, KEYS)
    trace_megatron(tmp_path / "mg", hf.config, hf.state_dict(), tokens, KEYS, wrap=te_shaped)
    vb = CanonicalView(str(tmp_path / "mg"))
    assert vb.config["spec"] == "te" and vb.config["fused_input_norm"] and vb.config["fused_dense_mlp_norm"]
    assert vb.config["moe_layers"] == [1]
    p0 = vb.trace.open_pass(0, 0)
    assert p0.get("module.module.decoder.layers.0.input_layernorm:out") is not None   # recorded, not mapped
    assert ("attn_norm", 0) not in vb.entries and ("mlp_norm", 0) not in vb.entries
    assert ("mlp_norm", 1) in vb.entries
    rep = find_divergence(str(tmp_path / "hf"), vb)
    assert rep.verdict == "consistent", [(p.key, p.status, p.error) for p in rep.points if p.status != "ok"]
    nc = {d["key"]: d["reason"] for d in rep.not_comparable}
    assert set(nc) == {"L0.attn_norm", "L1.attn_norm", "L0.mlp_norm"}
    assert all("only side A" in r for r in nc.values())
    assert "attn_norm" not in vb.adapter.promised_points(vb.config)


def test_qkv_split_and_kv_head_merge_units():
    """megatron_qkv against megatron_weights' own interleave (with and without the output gate), and the
    KV-head de-duplication when query groups < TP ranks."""
    from tic_trace.graph.adapter import TransformContext, merge, transform
    from tic_trace.adapters.megatron_weights import _interleave_qkv

    n, nq, ng, hd = 5, 8, 2, 3
    rng = np.random.default_rng(0)
    q, k, v, gate = (rng.normal(size=(n, h * hd)) for h in (nq, ng, ng, nq))
    fused = _interleave_qkv(*(torch.tensor(x.T) for x in (q, k, v)), nq, ng, hd).T.numpy()
    cfg = {"num_attention_heads": nq, "num_key_value_heads": ng, "head_dim": hd}
    for part, want, heads in (("q", q, nq), ("k", k, ng), ("v", v, ng)):
        got = transform("megatron_qkv")(fused, TransformContext(n, cfg, {"part": part}, 0, {}))
        np.testing.assert_array_equal(got, want.reshape(n, heads, hd))
    # with attention_output_gate each group is [q heads | gate heads | k | v]
    per = lambda x, h: x.reshape(n, ng, h // ng * hd)   # noqa: E731
    gated = np.concatenate([per(q, nq), per(gate, nq), per(k, ng), per(v, ng)], -1).reshape(n, -1)
    gcfg = {**cfg, "attention_output_gate": True}
    for part, want, heads in (("q", q, nq), ("k", k, ng), ("v", v, ng)):
        got = transform("megatron_qkv")(gated, TransformContext(n, gcfg, {"part": part}, 0, {}))
        np.testing.assert_array_equal(got, want.reshape(n, heads, hd))
    # tp=4, ng=2: ranks 0,1 hold kv head 0, ranks 2,3 kv head 1
    shards = [np.full((3, 2, 1, hd), r // 2) for r in range(4)]
    out = merge("kv_heads", shards, {"num_key_value_heads": 2})
    assert out.shape == (3, 2, 2, hd) and (out[:, :, 0] == 0).all() and (out[:, :, 1] == 1).all()
    assert merge("heads", shards, {}).shape == (3, 2, 4, hd)
    assert merge("seq", shards, {"sequence_parallel": True}).shape == (12, 2, 1, hd)
    assert merge("seq", shards, {}) is shards[0]


TE_RECORDS = {   # record names of a TE-spec GPTModel inside DDP(Float16Module(...)) -> canonical point
    "module.module.embedding:out": "embed",
    "module.module.decoder.layers.3:in.hidden_states": "input",
    "module.module.decoder.layers.3.self_attention.linear_qkv:out[0]": "attn.q",
    "module.module.decoder.layers.3.self_attention.q_layernorm:out": "attn.q_norm",
    "module.module.decoder.layers.3.self_attention.k_layernorm:out": "attn.k_norm",
    "module.module.decoder.layers.3.self_attention.core_attention:in[0]": "attn.q_rope",
    "module.module.decoder.layers.3.self_attention.core_attention:in[1]": "attn.k_rope",
    "module.module.decoder.layers.3.self_attention.core_attention:out": "attn.core",
    "module.module.decoder.layers.3.self_attention.linear_proj:out[0]": "attn.out",
    "module.module.decoder.layers.3.pre_mlp_layernorm:in[0]": "mid",
    "module.module.decoder.layers.3.pre_mlp_layernorm:out": "mlp_norm",
    "module.module.decoder.layers.3.mlp.router/fn:gating:out": "moe.router_logits",
    "module.module.decoder.layers.3.mlp.router:out[1]": "moe.topk_ids",
    "module.module.decoder.layers.3.mlp.router:out[0]": "moe.topk_weights",
    "module.module.decoder.layers.3.mlp/fn:combine_postprocess:out": "moe.experts_out",
    "module.module.decoder.layers.3.mlp.shared_experts:out": "moe.shared_out",
    "module.module.decoder.layers.3.mlp:out[0]": "mlp.out",
    "module.module.decoder.layers.3:out[0]": "output",
    "module.module.decoder.final_layernorm:out": "final_norm",
    "chunk1.module.module.decoder.final_layernorm:out": "final_norm",
    "module.module.output_layer:out[0]": "logits",
    # not points: TE expert GEMMs, the fused fc1, the identity input norm is matched but dropped (keeps)
    "module.module.decoder.layers.3.mlp.experts.linear_fc1:out[0]": None,
    "module.module.decoder.layers.3.mlp.linear_fc1:out[0]": None,
    "module.module.decoder.layers.3.mlp.experts:out[0]": None,
}


def test_te_record_names_map_by_name():
    ad = MegatronAdapter()
    cfg = {"fused_input_norm": True, "fused_dense_mlp_norm": True, "moe_layers": [3], "num_experts": 4,
           "shared_experts": True, "qk_layernorm": True}
    for name, want in TE_RECORDS.items():
        got = [pm.point for pm in POINTS if pm.regex().match(name)]
        assert (got[0] if got else None) == want, name
        if want is not None:
            m = next(pm for pm in POINTS if pm.point == want).regex().match(name)
            layer = int(m.group("layer")) if "layer" in m.re.groupindex and m.group("layer") else None
            assert ad.keeps(next(pm for pm in POINTS if pm.point == want), layer, cfg)
    pm = next(pm for pm in POINTS if pm.point == "attn_norm")
    assert pm.regex().match("module.module.decoder.layers.3.input_layernorm:out") and not ad.keeps(pm, 3, cfg)
    pm = next(pm for pm in POINTS if pm.point == "mlp_norm")
    assert not ad.keeps(pm, 2, cfg) and ad.keeps(pm, 3, cfg)
    # the fused QKV output feeds three points; `also` templates follow the wrapper prefix
    qkv = "module.module.decoder.layers.3.self_attention.linear_qkv:out[0]"
    assert {pm.point for pm in POINTS if pm.regex().match(qkv)} == {"attn.q", "attn.k", "attn.v"}
    pm = next(pm for pm in POINTS if pm.point == "moe.topk_weights")
    fields = pm.regex().match("module.module.decoder.layers.3.mlp.router:out[0]").groupdict()
    assert pm.also["map"].format(**fields) == "module.module.decoder.layers.3.mlp.router:out[1]"


def _counts(rows: dict) -> dict:
    """The report's row counts that these tests check (the identity counts beyond them are 0 here)."""
    assert not any(rows[k] for k in ("excluded", "different_tokens", "duplicates_a", "duplicates_b")), rows
    return {k: rows[k] for k in ("a", "b", "matched", "unmatched_a", "unmatched_b")}
