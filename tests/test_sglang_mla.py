"""SGLang 0.5.23's own DeepSeek-V3 (``deepseek_v2.py``: multi-latent attention, sigmoid router with a correction
bias, group-limited top-k, routed scaling, shared experts, a dense first layer) and GLM-4.5 (``glm4_moe.py``)
against HF transformers and against megatron-core 0.16.1 with the same weights (CPU, TP=1).

SGLang runs a rollout (two requests batched in one prefill, then decode steps with forced responses) through
its real KV pools: MLA's latent pool, the MHA path in the prefill and the absorbed path (``w_kc``/``w_vc``) in
decode. HF and Megatron run one forward over the full sequences. Per architecture: a clean fp32 pair is
consistent with every promised point present; a clean bf16 pair replayed against the checkpoint blames no side;
faults planted in SGLang's computation (a module's weight or attribute, a buffer, the absorbed decode weight)
are found at exactly their point and layer, against HF and against Megatron. In bf16, the absorbed decode path is judged on its own inputs (the recorded
latent, up-projected exactly; clean absorbed implementations set its envelope).

Order matters in this process: every Megatron trace is made first (megatron's gloo group is torn down again),
then SGLang's distributed state is initialised for the rest of the module.
"""
from __future__ import annotations

import copy
import types
from typing import Callable

import megatron.core  # noqa: F401 - a required test dependency: fail loudly if missing
import pytest
import sglang  # noqa: F401 - a required test dependency: fail loudly if missing
import torch

import tic_trace
from tic_trace import find_divergence
from tic_trace.adapters import sglang as sga
from tic_trace.adapters.megatron import MegatronAdapter
from tic_trace.adapters.megatron_weights import hf_to_megatron_state_dict, load_into
from tic_trace.replay.intrinsic_verdict import first_intrinsic_divergence
from tic_trace.replay.reference import ExactReference
from tic_trace.testing import megatron_cpu as mc
from tic_trace.testing import megatron_mla as mm
from tic_trace.testing import sglang_cpu as sc
from tic_trace.testing.precision_faults import _rmsnorm_bf16, _wrap
from tic_trace.testing.sglang_cpu_kernels import LatentCacheAttnBackend
from tic_trace.view.align import CanonicalView

from arch_configs_mla import mla_config, mla_hf_model
from conftest import assert_planted_fault_found

# Both full sequences 11 tokens long (one unpadded batch for HF and Megatron); prompts of 5 and 8 tokens.
PROMPTS = {"req-a": [3, 5, 7, 9, 11], "req-b": [2, 4, 6, 8, 10, 12, 14, 16]}
RESPONSES = {"req-a": [20, 21, 22, 23, 24, 25], "req-b": [30, 31, 32]}
SEQS = {rid: PROMPTS[rid] + RESPONSES[rid] for rid in PROMPTS}
DECODE = 2
NAMES = ("deepseek", "glm")
CLASS = {"deepseek": "DeepseekV3ForCausalLM", "glm": "Glm4MoeForCausalLM"}
BUILD_MG = {"deepseek": mm.build_mla_gpt_model, "glm": mm.build_glm4_moe_gpt_model}
LATENT = {"attn.q_a", "attn.q_a_norm", "attn.kv_a", "attn.kv_a_norm", "attn.kv_b"}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _hf_trace(model, out) -> str:
    ids = torch.tensor([SEQS[rid] for rid in SEQS])
    with tic_trace.trace(model, out, adapter="hf", points_mode="full", sample_keys=list(SEQS)) as t, \
            torch.no_grad():
        model(ids)
    assert t.failed is None, t.failed
    return str(out)


def _mg_trace(out, name: str, cfg, sd, dtype) -> str:
    model = BUILD_MG[name](cfg, dtype=dtype)
    load_into(model, hf_to_megatron_state_dict(sd, cfg))
    ids = torch.tensor([SEQS[rid] for rid in SEQS])
    pos = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
    with tic_trace.trace(model, out, adapter=MegatronAdapter(vocab_size=cfg.vocab_size), points_mode="full",
                         sample_keys=list(SEQS)) as t, torch.no_grad():
        model(ids, pos, attention_mask=None)
    assert t.failed is None, t.failed
    return str(out)


@pytest.fixture(scope="module")
def sides(tmp_path_factory):
    """(name, "fp32"|"bf16") -> {"ck", "hf", "mg"}: the checkpoint, HF's trace and Megatron's trace, every one
    made before SGLang is initialised; then SGLang's distributed state for the module."""
    d, out = tmp_path_factory.mktemp("sglang_mla"), {}
    with mc.single_rank():
        for name in NAMES:
            for tag, dtype in DTYPES.items():
                cfg, where = mla_config(name), d / f"{name}_{tag}"
                hf = mla_hf_model(cfg, dtype)
                hf.save_pretrained(where / "ck")
                out[name, tag] = {"ck": str(where / "ck"), "hf": _hf_trace(hf, where / "hf"),
                                  "mg": _mg_trace(where / "mg", name, cfg, hf.state_dict(), dtype)}
    sc.init_sglang_distributed(tp_size=1)
    yield out
    sga.close_sessions()
    sc.destroy_sglang_distributed()


def _sg_trace(out, ck: str, dtype, plant: Callable | None = None) -> str:
    """An SGLang rollout of the checkpoint `ck` (loaded through SGLang's own loader), `plant(model)` first."""
    import transformers as T
    cfg = T.AutoConfig.from_pretrained(ck)
    model = sc.build_sglang_model(cfg, ck, dtype=dtype)
    if plant is not None:
        with torch.no_grad():
            plant(model)
    backend = LatentCacheAttnBackend if getattr(cfg, "kv_lora_rank", None) else None
    with sga.trace_forwards(model, out, points_mode="full") as t:
        res = sc.SGLangRollout(model, attn_backend_cls=backend).generate(PROMPTS, DECODE, forced_tokens=RESPONSES)
    assert t.failed is None and res.outputs == {rid: r[:DECODE + 1] for rid, r in RESPONSES.items()}, t.failed
    return str(out)


def _not_ok(rep):
    return [(p.key, p.status, p.error) for p in rep.points if p.status != "ok"]


# ------------------------------------------------------------------------------------------------ clean pairs

@pytest.mark.parametrize("name", NAMES)
def test_clean_fp32_pairs_with_hf_and_megatron_are_consistent(tmp_path, sides, name):
    """fp32: SGLang <-> HF and SGLang <-> Megatron consistent at fp32 accuracy; the SGLang trace is verified and
    holds every promised point (DeepSeek: MLA's latent points, including kv_b from the MHA prefill; no k/v);
    where SGLang's CPU path applies the routed scale (after the experts) is recorded."""
    s = sides[name, "fp32"]
    sg = _sg_trace(tmp_path / "sg", s["ck"], torch.float32)
    v = CanonicalView(sg)
    assert (v.config["architecture"], v.config["architecture_verified"]) == (CLASS[name], True)
    assert (v.config["routed_scale_in_weights"], v.config["routed_scale_in_experts"]) == (False, False)
    assert v.config["fused_shared_experts"] == 0
    assert v.config["router_scoring"] == "sigmoid" and v.config["router_selection_bias"]
    if name == "deepseek":      # the absorbed path's backend, and that it passes the RoPE dims inside q and k
        assert (v.config["mla_decode_backend"], v.config["mla_rope_apart"]) == ("torch_native", False)
    points = {p for p, _ in v.points()}
    assert points == set(v.adapter.promised_points(v.config)) | {"logprobs"}
    if name == "deepseek":
        assert LATENT <= points and not {"attn.k", "attn.v", "attn.q_norm"} & points
    else:
        assert not LATENT & points and {"attn.k", "attn.v", "attn.q_norm", "attn.k_norm"} <= points
    for other in ("hf", "mg"):
        rep = find_divergence(s[other], sg)
        assert rep.verdict == "consistent" and rep.not_comparable == [], (other, _not_ok(rep))
        assert [d for d in rep.contract if d["section"] == "config"] == [], (other, rep.contract)
        assert max(p.error for p in rep.points) < 1e-5, other
        assert {"L1.moe.topk_weights", "L1.moe.experts_out", "L2.attn.q_rope", "L2.attn.core"} <= \
            {p.key for p in rep.points}


#: SGLang's CPU path scores DeepSeek's router in bf16 (``MoEGate.forward``: ``F.linear(hidden_states,
#: self.weight)`` where not on CUDA, whose path is a bf16 x bf16 -> fp32 GEMM) and its top-k takes the sigmoid
#: of those bf16 logits in bf16 (``biased_grouped_topk_impl``: ``gating_output.sigmoid()``), stored as fp32;
#: HF and Megatron score in fp32. Real differences of that path, so a bf16 pair shows them, blamed on SGLang:
#: the logits as a precision difference (accepted by name), the weights as an op less exact than its fp32
#: output (same dtype on both sides: never accepted as precision). Nothing else is blamed.
CPU_ROUTER = {"deepseek": ("moe.router_logits", "moe.topk_weights"), "glm": ()}


@pytest.mark.parametrize("name", NAMES)
def test_clean_bf16_pairs_replayed_blame_no_side(tmp_path, sides, name):
    """bf16 against the checkpoint both loaded, SGLang against HF and against Megatron: every point replayed
    (but the absorbed path's attn.core, said), no side blamed at the first divergence or along the walk but
    for SGLang's CPU router precision (named, then accepted); a routing flip is only ever a near tie."""
    s = sides[name, "bf16"]
    sg = _sg_trace(tmp_path / "sg", s["ck"], torch.bfloat16)
    for other in ("hf", "mg"):
        rep = find_divergence(s[other], sg, reference=s["ck"])
        blamed = {p.key: p.replay for p in rep.points if (p.replay or {}).get("side")}
        assert set(blamed) == {f"L{i}.{pt}" for i in (1, 2) for pt in CPU_ROUTER[name]}, (other, blamed)
        assert all(r["side"] == "B" for r in blamed.values()), blamed
        if name == "deepseek":
            assert "float32 on A and bfloat16 on B" in blamed["L1.moe.router_logits"]["reason"], blamed
            assert blamed["L1.moe.topk_weights"]["kind"] == "intrinsic", blamed
        rep = find_divergence(s[other], sg, reference=s["ck"], accept_precision=list(CPU_ROUTER[name]))
        left = {p.key for p in rep.points if (p.replay or {}).get("side") and not p.replay.get("accepted")}
        assert left == {k for k in blamed if k.endswith("topk_weights")}, (other, left)
        assert not [n for n in rep.notes if n.kind == "not_replayed"], other
        judged = {p.key for p in rep.points if p.intrinsic}
        assert {"L1.attn.q_rope", "L1.attn.k_rope", "L1.attn.core", "L1.moe.topk_weights", "L1.moe.experts_out",
                "L2.mlp.out"} <= judged, other
        if name == "deepseek":
            assert {"L1.attn.q_a_norm", "L1.attn.kv_a_norm", "L1.attn.kv_b"} <= judged
        routing = [f for f in rep.findings if f.cause == "routing"]
        assert all(f.detail["unexplained"] == 0 for f in routing), (other, routing)
        off = [f.key for f in rep.findings if f.divergent and f.cause != "routing"]
        assert set(off) <= left, (other, rep.findings)


# ------------------------------------------------------------------------------------------------ faults

def _attn(model, layer: int):
    return model.model.layers[layer].self_attn


def _scale(getter: Callable, factor: float = 1.02) -> Callable:
    def plant(model):
        getter(model).mul_(factor)
    return plant


def _correction_bias(layer: int, expert: int, delta: float = 1.0) -> Callable:
    """A changed score-correction bias: a pure routing change (logits and the weights' formula unchanged). +1
    on a sigmoid score in (0, 1): the expert (and its group) is chosen for most tokens, whatever they are."""
    def plant(model):
        model.model.layers[layer].mlp.gate.e_score_correction_bias[expert] += delta
    return plant


def _full_rotary(layer: int) -> Callable:
    """GLM-4.5's partial RoPE computed over the whole head at one layer (its own rotary module)."""
    def plant(model):
        attn = _attn(model, layer)
        rot = attn.rotary_emb
        attn.rotary_emb = type(rot)(rot.head_size, rot.head_size, rot.max_position_embeddings, rot.base,
                                    rot.is_neox_style, torch.float32)
    return plant


FAULTS = {
    # DeepSeek-V3: MLA's latent norms, the absorbed decode-only value weight, the router's correction bias
    "ds_kv_latent_norm_weight": ("deepseek", _scale(lambda m: _attn(m, 1).kv_a_layernorm.weight), "attn.kv_a_norm", 1),
    "ds_q_latent_norm_weight": ("deepseek", _scale(lambda m: _attn(m, 2).q_a_layernorm.weight), "attn.q_a_norm", 2),
    "ds_absorbed_value_weight": ("deepseek", _scale(lambda m: _attn(m, 2).w_vc), "attn.core", 2),
    "ds_correction_bias": ("deepseek", _correction_bias(1, 2), "moe.topk_ids", 1),
    # GLM-4.5: partial RoPE, QK-norm, shared experts, the correction bias
    "glm_full_rotary": ("glm", _full_rotary(1), "attn.q_rope", 1),
    "glm_k_norm_weight": ("glm", _scale(lambda m: _attn(m, 2).k_norm.weight), "attn.k_norm", 2),
    "glm_shared_experts": ("glm", _scale(lambda m: m.model.layers[2].mlp.shared_experts.down_proj.weight),
                           "moe.shared_out", 2),
    "glm_correction_bias": ("glm", _correction_bias(2, 1), "moe.topk_ids", 2),
}


@pytest.mark.parametrize("case", sorted(FAULTS))
def test_planted_fault_in_sglang_found_at_its_point_and_layer(tmp_path, sides, case):
    """Against HF and against Megatron: the first divergence is the planted fault's point and layer."""
    name, plant, point, layer = FAULTS[case]
    s = sides[name, "fp32"]
    sg = _sg_trace(tmp_path / "sg", s["ck"], torch.float32, plant)
    for other in ("hf", "mg"):
        assert_planted_fault_found(find_divergence(s[other], sg), point, layer)


def test_bf16_kv_latent_norm_without_upcast_is_found_with_sglang_blamed(tmp_path, sides):
    """SGLang's kv latent norm in bf16 throughout (no fp32 statistics): a precision fault of one side, the
    same dtype on both: the replay names layer 1's attn.kv_a_norm and blames SGLang (B)."""
    s = sides["deepseek", "bf16"]
    sg = _sg_trace(tmp_path / "sg", s["ck"], torch.bfloat16, lambda m: _wrap(_attn(m, 1).kv_a_layernorm, _rmsnorm_bf16))
    got = first_intrinsic_divergence(s["hf"], sg, ExactReference(s["ck"]))
    assert got is not None and (got.key, got.side, got.kind) == ("L1.attn.kv_a_norm", "B", "intrinsic"), got


def _fp8_absorbed_value_weight(model) -> None:
    """Layer 1's absorbed value weight (w_vc, what decode takes the latent attention output out by) rounded
    through fp8 e4m3, as an fp8 checkpoint's is: the prefill's MHA path (kv_b_proj) is untouched, decode's
    attention is not."""
    attn = _attn(model, 1)
    attn.w_vc.copy_(attn.w_vc.to(torch.float8_e4m3fn).to(attn.w_vc.dtype))


def test_bf16_fp8_absorbed_value_weight_in_decode_is_found_at_attn_core_with_sglang_blamed(tmp_path, sides):
    """The absorbed path is judged on its own inputs (the recorded latent, up-projected exactly): a precision
    fault only SGLang's decode attention has is found at layer 1's attn.core, SGLang (B) blamed."""
    s = sides["deepseek", "bf16"]
    sg = _sg_trace(tmp_path / "sg", s["ck"], torch.bfloat16, _fp8_absorbed_value_weight)
    got = first_intrinsic_divergence(s["hf"], sg, ExactReference(s["ck"]))
    assert got is not None and (got.key, got.side, got.kind) == ("L1.attn.core", "B", "intrinsic"), got


def test_routed_scale_facts_follow_the_block_flags(sides):
    """Where the routed scale is taken from: SGLang's top-k config and the platform flags its MoE block reads
    (CUDA: the MoE runner applies it inside the experts; elsewhere the block multiplies afterwards)."""
    from tic_trace.adapters import sglang_facts as sgl_ds
    s = sides["glm", "fp32"]
    import transformers as T
    cfg = T.AutoConfig.from_pretrained(s["ck"])
    model = sc.build_sglang_model(cfg, s["ck"], dtype=torch.float32)
    mlp = model.model.layers[1].mlp
    ns = types.SimpleNamespace(_is_cuda=True, _use_aiter=False)
    facts = sgl_ds.routed_scale_facts(model, cfg)
    assert facts == {"routed_scaling_factor": 2.5, "routed_scale_in_weights": False,
                     "routed_scale_in_experts": False}
    import sys
    real = sys.modules[type(mlp).__module__]
    try:
        sys.modules[type(mlp).__module__] = ns
        assert sgl_ds.routed_scale_facts(model, cfg)["routed_scale_in_experts"] is True
        ns._use_aiter = True
        assert sgl_ds.routed_scale_facts(model, cfg)["routed_scale_in_experts"] is None
    finally:
        sys.modules[type(mlp).__module__] = real
    mlp.topk.topk_config = copy.copy(mlp.topk.topk_config)
    mlp.topk.topk_config.apply_routed_scaling_factor_on_output = True
    assert sgl_ds.routed_scale_facts(model, cfg)["routed_scale_in_weights"] is True


def test_setups_not_run_in_the_tests_are_refused_by_name():
    """An MLA trace is verified only at TP 1 on a backend that passes the RoPE dims inside q and k (the rows
    read them there): TP 2, a backend taking them apart (fa3, flashinfer, trtllm_mla) or a trace that does not
    say which backend ran are refused, naming why; GLM-4.5 (no MLA) is not concerned by those (it ran at TP=1 only:
    refused above by the one-rank rule). Either, with its
    shared expert fused into the routed ones, is refused naming the flag that keeps them apart."""
    ad = sga.SGLangAdapter()
    base = {"architecture": "DeepseekV3ForCausalLM", "attention": "mla", "tensor_model_parallel_size": 1,
            "mla_decode_backend": "torch_native", "mla_rope_apart": False}
    assert ad.check_architecture(base).verified
    for change, word in (({"tensor_model_parallel_size": 4}, "tensor parallelism 4"),
                         ({"mla_decode_backend": "fa3", "mla_rope_apart": True}, "`fa3` takes the RoPE dims apart"),
                         ({"mla_decode_backend": None, "mla_rope_apart": None}, "does not say which attention")):
        c = ad.check_architecture({**base, **change})
        assert not c.verified and word in c.why, (change, c.why)
    glm = {"architecture": "Glm4MoeForCausalLM", "attention": "mha", "tensor_model_parallel_size": 1}
    assert ad.check_architecture(glm).verified
    # GLM-4.5 ran at TP=1 only: above it, refused by that rule (sglang_names.tp_refusal), not by MLA's
    c = ad.check_architecture({**glm, "tensor_model_parallel_size": 2})
    assert not c.verified and "TP=1 only" in c.why and "MLA" not in c.why, c.why
    # SGLang's GPU default for both: the shared expert fused into the routed ones (experts_out holds it)
    for arch in ({**base, "fused_shared_experts": 1}, {"architecture": "Glm4MoeForCausalLM", "fused_shared_experts": 1}):
        c = ad.check_architecture(arch)
        assert not c.verified and "--disable-shared-experts-fusion" in c.why, c.why


# DeepSeek-V3's released checkpoints run YaRN RoPE (rope_scaling yarn, factor 40) with the mscale in the
# attention's softmax scale: SGLang builds it through its CPU factory (DeepseekScalingRotaryEmbedding) and
# `compute_mla_mscale_scaling`. Megatron's MLA with YaRN is refused (megatron_mla.latent_refusal): HF only.
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32.0,
        "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0}


def _plain_softmax_scale(model) -> None:
    """Layer 1's attention without YaRN's mscale in its softmax scale (both paths): 1/sqrt(nope + rope)."""
    attn = _attn(model, 1)
    plain = (attn.qk_nope_head_dim + attn.qk_rope_head_dim) ** -0.5
    attn.attn_mha.scaling = attn.attn_mqa.scaling = plain


@pytest.fixture(scope="module")
def yarn_sides(sides, tmp_path_factory):
    """("fp32"|"bf16") -> (checkpoint, HF trace) of the DeepSeek-V3 model with YaRN RoPE (after `sides`, whose
    Megatron traces come first in this process)."""
    d, out = tmp_path_factory.mktemp("sglang_mla_yarn"), {}
    for tag, dtype in DTYPES.items():
        hf = mla_hf_model(mla_config("deepseek", rope_parameters=YARN), dtype)
        hf.save_pretrained(d / tag / "ck")
        out[tag] = (str(d / tag / "ck"), _hf_trace(hf, d / tag / "hf"))
    return out


def test_yarn_rope_pairs_with_hf_are_consistent_and_replayed_clean(tmp_path, yarn_sides):
    """YaRN: fp32 SGLang <-> HF consistent at fp32 accuracy; bf16 against the checkpoint: every point replayed
    and nothing blamed but SGLang's CPU router precision (CPU_ROUTER)."""
    ck, hf = yarn_sides["fp32"]
    rep = find_divergence(hf, _sg_trace(tmp_path / "sg32", ck, torch.float32))
    assert rep.verdict == "consistent" and max(p.error for p in rep.points) < 1e-5, _not_ok(rep)
    ck, hf = yarn_sides["bf16"]
    rep = find_divergence(hf, _sg_trace(tmp_path / "sg16", ck, torch.bfloat16), reference=ck,
                          accept_precision=list(CPU_ROUTER["deepseek"]))
    assert not [n for n in rep.notes if n.kind == "not_replayed"]
    left = {p.key for p in rep.points if (p.replay or {}).get("side") and not p.replay.get("accepted")}
    assert left <= {"L1.moe.topk_weights", "L2.moe.topk_weights"}, left
    assert {"L1.attn.q_rope", "L1.attn.k_rope", "L1.attn.core"} <= {p.key for p in rep.points if p.intrinsic}


def test_yarn_mscale_left_out_of_the_softmax_scale_is_found_at_attn_core(tmp_path, yarn_sides):
    ck, hf = yarn_sides["fp32"]
    rep = find_divergence(hf, _sg_trace(tmp_path / "sg", ck, torch.float32, _plain_softmax_scale))
    assert_planted_fault_found(rep, "attn.core", 1)


def _tp2_worker(rank: int, world: int, port: int, ck: str, out: str, tag: str) -> None:
    """One spawned TP rank of SGLang's DeepSeek-V3 (heads of q_b_proj, kv_b_proj, the attention and o_proj
    sharded; the latents replicated), loaded from the checkpoint `ck` in DTYPES[tag] and traced into `out`."""
    import transformers as T
    torch.set_num_threads(1)
    sc.disable_torch_compile()
    sc.init_sglang_distributed(tp_size=world, rank=rank, port=port)
    try:
        model = sc.build_sglang_model(T.AutoConfig.from_pretrained(ck), ck, dtype=DTYPES[tag])
        with sga.trace_forwards(model, out, points_mode="full") as t:
            sc.SGLangRollout(model, attn_backend_cls=LatentCacheAttnBackend).generate(PROMPTS, DECODE,
                                                                                       forced_tokens=RESPONSES)
        assert t.failed is None, t.failed
    finally:
        sga.close_sessions()
        sc.destroy_sglang_distributed()


def test_tp2_mla_shards_merge_to_the_hf_points(tmp_path, sides):
    """SGLang's DeepSeek-V3 at TP=2 over gloo: the per-rank head shards of q, kv_b, the attention's inputs and
    o_proj's input merge back into every head, the latents are taken once, and the pair with HF (and with
    Megatron) is consistent at fp32 accuracy with every promised point."""
    s = sides["deepseek", "fp32"]
    sc.spawn_ranks(_tp2_worker, world=2, args=(s["ck"], str(tmp_path / "tp2"), "fp32"))
    v = CanonicalView(str(tmp_path / "tp2"))
    assert v.trace.ranks == [0, 1] and v.config["tensor_model_parallel_size"] == 2
    assert v.adapter.check_architecture(v.config).verified
    p0 = v.trace.open_pass(0, 0)
    assert p0.record("model.layers.1.self_attn.q_b_proj:out[0]").shape[-1] == 2 * (16 + 8)      # 2 of 4 heads
    assert p0.record("model.layers.1.self_attn.o_proj:in[0]").shape[-1] == 2 * 16
    for other in ("hf", "mg"):
        rep = find_divergence(s[other], v)
        assert rep.verdict == "consistent" and rep.not_comparable == [], (other, _not_ok(rep))
        assert max(p.error for p in rep.points) < 1e-5, other
    assert {p for p, _ in v.points()} == set(v.adapter.promised_points(v.config)) | {"logprobs"}


def test_tp2_bf16_replayed_blames_no_side(tmp_path, sides):
    """bf16 at TP=2 against the checkpoint: the TP partial sums merge as the all-reduce returns them (rounded
    onto bf16, as the residual add reads them), so no residual or projection is blamed; the MoE block's output,
    a sum of per-rank (experts + shared) partials whose addends the trace does not hold, is said as not
    replayed; the CPU router precision is the only finding (CPU_ROUTER)."""
    s = sides["deepseek", "bf16"]
    sc.spawn_ranks(_tp2_worker, world=2, args=(s["ck"], str(tmp_path / "tp2"), "bf16"))
    rep = find_divergence(s["hf"], str(tmp_path / "tp2"), reference=s["ck"],
                          accept_precision=list(CPU_ROUTER["deepseek"]))
    left = {p.key for p in rep.points if (p.replay or {}).get("side") and not p.replay.get("accepted")}
    assert left <= {"L1.moe.topk_weights", "L2.moe.topk_weights"}, left
    gaps = {k: why for n in rep.notes if n.kind == "not_replayed" for k, why in n.detail["points"].items()}
    assert set(gaps) == {"L1.mlp.out", "L2.mlp.out"} and all("TP 2" in w for w in gaps.values()), gaps
    assert {"L1.attn.core", "L1.attn.out", "L1.mid", "L2.output"} <= {p.key for p in rep.points if p.intrinsic}
