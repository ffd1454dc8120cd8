"""Real megatron-core GPTModel (local spec) on CPU, loaded with the weights of a tiny HF Qwen3 / Qwen3-MoE,
gives the HF logits: single process (in this process) and multi-process on gloo (TP, EP, SP).

Checks ``tic_trace.testing.megatron_cpu`` (the CPU shims and model builder) and
``tic_trace.adapters.megatron_weights`` (HF -> megatron weight conversion, per-rank shards).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import megatron.core  # noqa: E402,F401 - a required test dependency: fail loudly if missing
import transformers  # noqa: E402 - required

from tic_trace.adapters.megatron_weights import WeightLoadError, hf_to_megatron_state_dict, load_into  # noqa: E402
from tic_trace.testing import megatron_cpu as mc  # noqa: E402

B, S = 2, 12
ATOL = RTOL = 1e-5


# ------------------------------------------------------------------------------------------------
# tiny HF models (built locally; independent of tic_trace.testing.hf_models)
# ------------------------------------------------------------------------------------------------


def hf_config(moe: bool):
    common = dict(
        vocab_size=128,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=96,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
    if moe:
        return transformers.Qwen3MoeConfig(
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, **common
        )
    return transformers.Qwen3Config(**common)


def build_hf(moe: bool, seed: int = 0):
    """fp32 eval HF model with random weights of a useful scale (norm weights around 1)."""
    cfg = hf_config(moe)
    torch.manual_seed(seed)
    cls = transformers.Qwen3MoeForCausalLM if moe else transformers.Qwen3ForCausalLM
    model = cls(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif "embed_tokens" in name:
                p.normal_(0.0, 1.0)
            else:  # [out, in] or HF 3D experts [E, out, in]
                p.normal_(0.0, p.shape[-1] ** -0.5)
    return model


def tokens(seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 128, (B, S), generator=g)


def hf_logits(model, toks) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=toks).logits.float()


# ------------------------------------------------------------------------------------------------
# one megatron rank: build, convert + load, forward, gather the vocab
# ------------------------------------------------------------------------------------------------


def megatron_logits(cfg, hf_sd, toks, dispatcher: str = "alltoall") -> torch.Tensor:
    """Run on an initialised rank (mc.init_parallel done); return full-vocab logits [b, s, V]."""
    from megatron.core import parallel_state as ps

    model = mc.build_gpt_model(cfg, dispatcher=dispatcher)
    sd = hf_to_megatron_state_dict(
        hf_sd,
        cfg,
        tp_rank=ps.get_tensor_model_parallel_rank(),
        tp_size=ps.get_tensor_model_parallel_world_size(),
        ep_rank=ps.get_expert_model_parallel_rank(),
        ep_size=ps.get_expert_model_parallel_world_size(),
        etp_rank=ps.get_expert_tensor_parallel_rank(),
        etp_size=ps.get_expert_tensor_parallel_world_size(),
    )
    load_into(model, sd)
    positions = torch.arange(toks.shape[1]).unsqueeze(0).expand_as(toks)
    with torch.no_grad():
        logits = model(toks, positions, attention_mask=None)
    return mc.gather_vocab_logits(logits, cfg.vocab_size).float()


def _worker(rank: int, world: int, port: int, case: dict, workdir: str) -> None:
    """Spawned rank (top level so the spawn context can import it)."""
    torch.set_num_threads(1)  # 2 cores shared by all ranks
    workdir = Path(workdir)
    data = torch.load(workdir / "inputs.pt", weights_only=True)
    cfg = hf_config(case["moe"])
    mc.init_parallel(rank, world, tp=case["tp"], ep=case["ep"], sp=case["sp"], port=port)
    try:
        out = megatron_logits(cfg, data["hf_sd"], data["tokens"], case["dispatcher"])
        torch.save(out, workdir / f"logits_rank{rank}.pt")
    finally:
        mc.destroy()


@pytest.fixture
def single_rank():
    """World size 1 in this process; shims and the process group are removed afterwards."""
    with mc.single_rank():
        yield


# ------------------------------------------------------------------------------------------------
# single process
# ------------------------------------------------------------------------------------------------


def test_dense_tp1_matches_hf(single_rank):
    hf = build_hf(moe=False)
    toks = tokens()
    ref = hf_logits(hf, toks)
    out = megatron_logits(hf.config, hf.state_dict(), toks)
    assert out.shape == (B, S, 128)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_moe_tp1_matches_hf(single_rank, dispatcher):
    hf = build_hf(moe=True)
    toks = tokens()
    ref = hf_logits(hf, toks)
    out = megatron_logits(hf.config, hf.state_dict(), toks, dispatcher)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=RTOL)


def test_moe_model_structure_and_outputs(single_rank):
    """Facts an adapter author relies on: names, classes, output tuples, [s, b, h] layout, in-place bda."""
    hf = build_hf(moe=True)
    model = mc.build_gpt_model(hf.config)
    load_into(model, hf_to_megatron_state_dict(hf.state_dict(), hf.config))
    names = dict(model.named_modules())
    layer = "decoder.layers.0."
    assert type(names[layer + "input_layernorm"]).__name__ == "RMSNorm"  # plain torch.nn.RMSNorm
    assert type(names[layer + "mlp"]).__name__ == "MoELayer"
    assert type(names[layer + "mlp.router"]).__name__ == "TopKRouter"
    assert type(names[layer + "mlp.experts"]).__name__ == "SequentialMLP"
    assert layer + "mlp.experts.local_experts.3.linear_fc1" in names

    seen: dict[str, object] = {}
    aliased: dict[str, torch.Tensor] = {}

    def hook(name):
        def fn(_mod, _inp, out):
            seen[name] = out
            if name.endswith("self_attention"):
                aliased["ref"] = out[0]  # no clone: bda adds the residual into this tensor in place
                aliased["copy"] = out[0].detach().clone()

        return fn

    for n in ("embedding", "decoder.layers.0", "decoder.layers.0.self_attention",
              "decoder.layers.0.self_attention.linear_qkv", "decoder.layers.0.mlp", "decoder.layers.0.mlp.router",
              "decoder.final_layernorm", "output_layer"):
        names[n].register_forward_hook(hook(n))
    toks = tokens()
    with torch.no_grad():
        model(toks, torch.arange(S).unsqueeze(0).expand(B, -1), attention_mask=None)
    assert seen["embedding"].shape == (S, B, 64)  # [s, b, h]
    assert isinstance(seen["decoder.layers.0"], tuple) and seen["decoder.layers.0"][0].shape == (S, B, 64)
    qkv, bias = seen["decoder.layers.0.self_attention.linear_qkv"]
    assert bias is None and qkv.shape == (S, B, (4 + 2 * 2) * 16)
    probs, routing_map = seen["decoder.layers.0.mlp.router"]
    assert probs.shape == (S * B, 4) and routing_map.dtype == torch.bool and routing_map.sum(-1).eq(2).all()
    assert isinstance(seen["decoder.layers.0.mlp"], tuple) and seen["decoder.layers.0.mlp"][1] is None
    assert seen["output_layer"][0].shape == (S, B, 128)
    # in-place residual add (fused_bias_dropout under no_grad): the hooked tensor changed afterwards
    assert not torch.equal(aliased["ref"], aliased["copy"])


def test_tied_embeddings_and_vocab_padding(single_rank):
    cfg = hf_config(moe=False)
    cfg.tie_word_embeddings = True
    torch.manual_seed(3)
    hf = transformers.Qwen3ForCausalLM(cfg).float().eval()
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    toks = tokens()
    ref = hf_logits(hf, toks)
    model = mc.build_gpt_model(cfg, padded_vocab_size=160)
    sd = hf_to_megatron_state_dict(hf.state_dict(), cfg, padded_vocab_size=160)
    assert "output_layer.weight" not in sd and sd["embedding.word_embeddings.weight"].shape == (160, 64)
    load_into(model, sd)
    with torch.no_grad():
        out = model(toks, torch.arange(S).unsqueeze(0).expand(B, -1), attention_mask=None)
    assert out.shape == (B, S, 160)
    torch.testing.assert_close(out[..., :128], ref, atol=ATOL, rtol=RTOL)


def test_load_into_reports_all_problems():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    bad = {"0.weight": torch.zeros(3, 4), "0.bias": torch.zeros(5), "1.weight": torch.zeros(2, 3), "x.weight": torch.zeros(1)}
    with pytest.raises(WeightLoadError) as err:
        load_into(model, bad)
    msg = str(err.value)
    assert "missing (1)" in msg and "1.bias" in msg
    assert "unexpected (1)" in msg and "x.weight" in msg
    assert "shape mismatch (1)" in msg and "0.bias" in msg


def test_converter_shards_rebuild_tp1_layout():
    """Per-rank shards follow megatron's TP layout: qkv / embeddings contiguous, fc1 stride-2, proj by columns."""
    hf = build_hf(moe=True)
    cfg, hsd = hf.config, hf.state_dict()
    full = hf_to_megatron_state_dict(hsd, cfg)
    r0, r1 = (hf_to_megatron_state_dict(hsd, cfg, tp_rank=r, tp_size=2) for r in (0, 1))
    key = "decoder.layers.1.self_attention.linear_qkv.weight"
    assert torch.equal(torch.cat([r0[key], r1[key]]), full[key])
    key = "decoder.layers.1.self_attention.linear_proj.weight"
    assert torch.equal(torch.cat([r0[key], r1[key]], 1), full[key])
    key = "decoder.layers.0.mlp.experts.local_experts.2.linear_fc1.weight"
    g0, u0 = r0[key].chunk(2)
    g1, u1 = r1[key].chunk(2)
    assert torch.equal(torch.cat([g0, g1, u0, u1]), full[key])
    # qkv group 1 = [q heads 2,3; k head 1; v head 1]
    q = hsd["model.layers.0.self_attn.q_proj.weight"]
    k = hsd["model.layers.0.self_attn.k_proj.weight"]
    v = hsd["model.layers.0.self_attn.v_proj.weight"]
    g1_rows = full["decoder.layers.0.self_attention.linear_qkv.weight"][64:128]
    assert torch.equal(g1_rows, torch.cat([q[32:64], k[16:32], v[16:32]]))
    # EP: rank 1 of 2 holds global experts 2, 3 as local 0, 1
    e1 = hf_to_megatron_state_dict(hsd, cfg, ep_rank=1, ep_size=2)
    assert torch.equal(e1["decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight"],
                       hsd["model.layers.0.mlp.experts.down_proj"][2])
    assert "decoder.layers.0.mlp.experts.local_experts.2.linear_fc1.weight" not in e1


def test_shims_are_idempotent_and_removable():
    orig = torch.cuda.current_device
    mc.apply_all()
    mc.apply_all()
    assert mc.applied_shims() == {"base", "moe_ep_and_sp", "gloo_uneven"}
    assert torch.cuda.current_device() == torch.device("cpu")
    mc.remove_shims()
    assert torch.cuda.current_device is orig and not mc.applied_shims()
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    assert MoEAlltoAllTokenDispatcher.cuda_dtoh_stream is None


# ------------------------------------------------------------------------------------------------
# multi-process (gloo)
# ------------------------------------------------------------------------------------------------

MULTI = {
    "moe_tp2": dict(moe=True, tp=2, ep=1, sp=False, dispatcher="alltoall", world=2),
    "moe_ep2": dict(moe=True, tp=1, ep=2, sp=False, dispatcher="alltoall", world=2),
    "dense_tp2_sp": dict(moe=False, tp=2, ep=1, sp=True, dispatcher="alltoall", world=2),
    "moe_tp2_ep2_sp": dict(moe=True, tp=2, ep=2, sp=True, dispatcher="alltoall", world=4),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MULTI))
def test_multiprocess_matches_hf(tmp_path, name):
    case = MULTI[name]
    hf = build_hf(moe=case["moe"])
    toks = tokens()
    ref = hf_logits(hf, toks)
    torch.save({"hf_sd": hf.state_dict(), "tokens": toks}, tmp_path / "inputs.pt")
    mc.spawn_ranks(_worker, case["world"], args=(case, str(tmp_path)))
    for rank in range(case["world"]):
        out = torch.load(tmp_path / f"logits_rank{rank}.pt", weights_only=True)
        torch.testing.assert_close(out, ref, atol=ATOL, rtol=RTOL, msg=lambda m: f"{name} rank {rank}: {m}")
