"""SGLang 0.5.23's own model classes for Llama, Phi-3 (SGLang runs it with `llama.py`), Gemma 2, Gemma 3 (text)
and GPT-OSS against HF transformers with the same weights (CPU, TP=1): per class a clean fp32 pair is
consistent, a clean bf16 pair replayed against the checkpoint both ran blames no side, and faults planted in
the architecture's own computation on the SGLang side (a module's forward, a weight, a buffer) are found at
exactly their point and layer.

SGLang runs a rollout (two requests of different lengths batched in one prefill, then decode steps with
forced responses) through its real KV pools and TorchNativeAttnBackend (tic_trace.testing.sglang_cpu); HF runs
one forward per full sequence. Tiny configs (tests/arch_configs_gemma_phi3_gptoss.py), at most 11 tokens.
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Callable

import pytest
import sglang  # noqa: F401 - a required test dependency: fail loudly if missing
import torch
import transformers as T

import tic_trace
from tic_trace import find_divergence
from tic_trace.adapters import sglang as sga
from tic_trace.graph.canonical import parse_key
from tic_trace.testing import sglang_cpu as sc
from tic_trace.testing.sglang_cpu_kernels import SoftcapSinkAttnBackend, shim_final_logit_softcap
from tic_trace.testing.hf_models import build_hf_model, build_hf_model_stable
from tic_trace.view.align import CanonicalView

from arch_configs_gemma_phi3_gptoss import COMMON, GEMMA_PHI3_GPTOSS

PROMPTS = {"req-a": [3, 5, 7, 9, 11], "req-b": [2, 4, 6, 8, 10, 12, 14, 16]}
RESPONSES = {"req-a": [20, 21, 22], "req-b": [30, 31, 32]}
DECODE = 2                      # decode steps: response tokens 0..1 are fed, token 2 is sampled, never fed
SG_ROWS = sum(len(p) for p in PROMPTS.values()) + DECODE * len(PROMPTS)

CONFIGS: dict[str, Callable] = {"LlamaForCausalLM": lambda: T.LlamaConfig(**COMMON), **GEMMA_PHI3_GPTOSS}
GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
# TorchNativeAttnBackend ignores RadixAttention.logit_cap (and takes no sinks): these classes run the shim that
# computes what SGLang's GPU backends do (tic_trace/testing/sglang_cpu_kernels.py); the others run it unchanged.
SHIMMED_ATTENTION = ("Gemma2ForCausalLM", "GptOssForCausalLM")


@pytest.fixture(scope="module")
def sglang_env():
    sc.init_sglang_distributed(tp_size=1)
    shim_final_logit_softcap()
    yield
    sga.close_sessions()
    sc.destroy_sglang_distributed()


def _config(name: str):
    cfg = CONFIGS[name]()
    cfg._attn_implementation = "eager"
    if name in GEMMA:
        # as Gemma's hub checkpoints: the head tied to the embedding (SGLang's Gemma classes always read the
        # head from embed_tokens) and `hidden_act` besides `hidden_activation` (gemma2.py reads the former)
        cfg.tie_word_embeddings = True
        cfg.hidden_act = "gelu_pytorch_tanh"
    return cfg


def _hf_trace(model, out) -> None:
    """One HF forward per full sequence (prompt + response), each its own sample."""
    with tic_trace.trace(model, out, adapter="hf", points_mode="full") as t, torch.no_grad():
        for rid in PROMPTS:
            t.sample_keys = [rid]
            model(torch.tensor([PROMPTS[rid] + RESPONSES[rid]]))
            t.step()
    assert t.failed is None, t.failed


def _sg_trace(cfg, weights, out, plant: Callable | None = None, dtype=torch.float32, shim: bool | None = None):
    """An SGLang rollout of the class SGLang builds for `cfg`, loaded from `weights` (an HF model or checkpoint
    directory) through SGLang's own loader; `plant(model)` first when given. `shim`: run the soft-cap / sink
    attention backend (default: for SHIMMED_ATTENTION classes)."""
    cfg = copy.deepcopy(cfg)
    cfg.dtype = dtype       # a torch dtype, as in a config loaded from a checkpoint (gpt_oss.py builds with it)
    model = sc.build_sglang_model(cfg, weights, dtype=dtype)
    if shim is None:
        shim = type(model).__name__ in SHIMMED_ATTENTION
    if plant is not None:
        plant(model)
    with sga.trace_forwards(model, out, points_mode="full") as t:
        eng = sc.SGLangRollout(model, attn_backend_cls=SoftcapSinkAttnBackend if shim else None)
        res = eng.generate(PROMPTS, DECODE, forced_tokens=RESPONSES)
    assert t.failed is None and res.outputs == RESPONSES, t.failed


@pytest.fixture(scope="module")
def hf_pairs(sglang_env, tmp_path_factory):
    """name -> (HF fp32 model, its HF trace): built once per class, on first use."""
    root, cache = tmp_path_factory.mktemp("hf_archs"), {}

    def get(name: str):
        if name not in cache:
            model = build_hf_model(_config(name))
            assert type(model).__name__ == name
            _bf16_sinks(model)
            _hf_trace(model, root / name)
            cache[name] = (model, root / name)
        return cache[name]
    return get


def _bf16_sinks(model) -> None:
    """GPT-OSS: SGLang holds the attention sinks in bf16 (gpt_oss.py, every backend but trtllm_mha), so an fp32
    checkpoint's sinks are rounded there and its attention differs from HF's at attn.core (a real difference,
    left to the test that shows it). GPT-OSS checkpoints are bf16: sinks of bf16 values are what they hold."""
    for layer in getattr(model.model, "layers", []):
        sinks = getattr(layer.self_attn, "sinks", None)
        if sinks is not None:
            with torch.no_grad():
                sinks.copy_(sinks.to(torch.bfloat16).float())


def _detail(rep):
    return [(p.key, p.status, p.error) for p in rep.points if p.status != "ok"]


def _check_clean_fp32(tmp_path, hf_pairs, name: str) -> None:
    model, hf = hf_pairs(name)
    _sg_trace(_config(name), model, tmp_path / "sg")
    vb = CanonicalView(str(tmp_path / "sg"))
    assert vb.config["architecture"] == name and vb.config["architecture_verified"] is True
    assert {p for p, _ in vb.points()} == set(vb.adapter.promised_points(vb.config)) | {"logprobs"}
    rep = find_divergence(str(hf), vb)
    assert rep.verdict == "consistent", _detail(rep)
    assert rep.not_comparable == [] and rep.rows["matched"] == SG_ROWS
    assert max(p.error for p in rep.points) < 1e-5


def _check_clean_bf16_replayed(tmp_path, name: str, accept: tuple[str, ...] = ()) -> None:
    """bf16 on both sides, replayed against the checkpoint both loaded: no side is blamed anywhere (but at the
    points whose precision difference is `accept`ed)."""
    model = build_hf_model_stable(_config(name), dtype=torch.bfloat16)
    model.save_pretrained(tmp_path / "ck")
    _hf_trace(model, tmp_path / "hf")
    _sg_trace(T.AutoConfig.from_pretrained(str(tmp_path / "ck")), str(tmp_path / "ck"), tmp_path / "sg",
              dtype=torch.bfloat16)
    rep = find_divergence(str(tmp_path / "hf"), str(tmp_path / "sg"), reference=str(tmp_path / "ck"),
                          accept_precision=list(accept))
    assert rep.verdict == "consistent" and rep.first is None, rep.first and rep.first["summary"]
    blamed = [p.key for p in rep.points if (p.replay or {}).get("side") and not (p.replay or {}).get("accepted")]
    assert not blamed, blamed
    assert not [n for n in rep.notes if n.kind == "not_replayed"]


def _first(tmp_path, hf_pairs, name: str, plant: Callable | None, **kw) -> tuple[str, int | None]:
    """(point, layer) of the first divergence between HF (A) and SGLang with `plant` applied (B)."""
    model, hf = hf_pairs(name)
    _sg_trace(_config(name), model, tmp_path / "sg", plant, **kw)
    rep = find_divergence(str(hf), str(tmp_path / "sg"))
    assert rep.verdict == "divergent", _detail(rep)
    return parse_key(rep.first["key"])


def _layer(model, i: int):
    return model.model.layers[i]


def _wrap_output(mod: torch.nn.Module, fn: Callable) -> None:
    """mod's forward, its output passed through fn (in the computation: every later op reads it)."""
    inner = mod.forward
    mod.forward = lambda *a, **k: fn(inner(*a, **k))


def _rows(param: torch.nn.Parameter, lo: int, hi: int, fn: Callable) -> None:
    with torch.no_grad():
        param[lo:hi] = fn(param[lo:hi].clone())


# ------------------------------------------------------------------------------------------------ Llama

def test_llama_clean_fp32_pair_is_consistent(tmp_path, hf_pairs):
    _check_clean_fp32(tmp_path, hf_pairs, "LlamaForCausalLM")


def test_llama_clean_bf16_pair_replayed_blames_no_side(tmp_path, sglang_env):
    _check_clean_bf16_replayed(tmp_path, "LlamaForCausalLM")


def test_llama_rope_with_another_base_is_found_at_q_rope(tmp_path, hf_pairs):
    """Layer 1's rotary embedding recomputed with base 10^6 instead of 10^4 (its cos/sin cache buffer)."""
    def plant(model):
        rot = _layer(model, 1).self_attn.rotary_emb
        _layer(model, 1).self_attn.rotary_emb = other = type(rot)(
            rot.head_size, rot.rotary_dim, rot.max_position_embeddings, 1e6, rot.is_neox_style, torch.float32)
        assert other is not rot
    assert _first(tmp_path, hf_pairs, "LlamaForCausalLM", plant) == ("attn.q_rope", 1)


def test_llama_gate_and_up_swapped_in_the_fused_weight_is_found_at_mlp_out(tmp_path, hf_pairs):
    """gate_up_proj's halves loaded the other way round: silu(up) * gate instead of silu(gate) * up."""
    def plant(model):
        w = _layer(model, 0).mlp.gate_up_proj.weight
        with torch.no_grad():
            w.copy_(torch.cat(w.chunk(2, 0)[::-1], 0))
    assert _first(tmp_path, hf_pairs, "LlamaForCausalLM", plant) == ("mlp.out", 0)


# ------------------------------------------------------------------------------------------------ Phi-3

def test_phi3_clean_fp32_pair_is_consistent(tmp_path, hf_pairs):
    _check_clean_fp32(tmp_path, hf_pairs, "Phi3ForCausalLM")


def test_phi3_clean_bf16_pair_replayed_blames_no_side(tmp_path, sglang_env):
    _check_clean_bf16_replayed(tmp_path, "Phi3ForCausalLM")


def test_phi3_fused_qkv_with_k_and_v_swapped_is_found_at_attn_k(tmp_path, hf_pairs):
    """SGLang's fused qkv_proj split the other way (its k and v row blocks swapped): first seen at attn.k."""
    def plant(model):
        attn = _layer(model, 1).self_attn
        q, kv = attn.q_size, attn.kv_size
        w = attn.qkv_proj.weight
        with torch.no_grad():
            w.copy_(torch.cat([w[:q], w[q + kv:], w[q:q + kv]], 0))
    assert _first(tmp_path, hf_pairs, "Phi3ForCausalLM", plant) == ("attn.k", 1)


def test_phi3_q_block_fault_of_the_fused_qkv_is_found_at_attn_q(tmp_path, hf_pairs):
    """The q rows of layer 0's fused qkv_proj weight scaled by 1.01: at attn.q, not at k or v."""
    def plant(model):
        attn = _layer(model, 0).self_attn
        _rows(attn.qkv_proj.weight, 0, attn.q_size, lambda w: w * 1.01)
    assert _first(tmp_path, hf_pairs, "Phi3ForCausalLM", plant) == ("attn.q", 0)


# ------------------------------------------------------------------------------------------------ Gemma 2

def _without_unit_offset(norm: torch.nn.Module) -> None:
    """A Gemma RMSNorm scaling by w instead of (1 + w) (the Llama-style norm), residual form kept."""
    def forward(x, residual=None):
        if residual is not None:
            x = residual = x + residual
        xf = x.float()
        y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon) * norm.weight.float())
        return y.to(x.dtype) if residual is None else (y.to(x.dtype), residual)
    norm.forward = forward


def test_gemma2_clean_fp32_pair_is_consistent(tmp_path, hf_pairs):
    _check_clean_fp32(tmp_path, hf_pairs, "Gemma2ForCausalLM")


def test_gemma2_clean_bf16_pair_replayed_blames_no_side(tmp_path, sglang_env):
    _check_clean_bf16_replayed(tmp_path, "Gemma2ForCausalLM")


def test_gemma2_upstream_cpu_attention_ignores_the_soft_cap(tmp_path, hf_pairs):
    """Why the shim: SGLang's TorchNativeAttnBackend itself (no shim) computes layer 0's attention without
    `logit_cap`, which is another attention than HF's and SGLang's GPU backends compute: found at attn.core.
    Should SGLang's CPU backend start honouring the cap, this fails and the shim can go."""
    assert _first(tmp_path, hf_pairs, "Gemma2ForCausalLM", None, shim=False) == ("attn.core", 0)


def test_gemma2_attention_branch_norm_without_the_unit_offset_is_found_at_attn_post_norm(tmp_path, hf_pairs):
    plant = lambda m: _without_unit_offset(_layer(m, 1).post_attention_layernorm)  # noqa: E731
    assert _first(tmp_path, hf_pairs, "Gemma2ForCausalLM", plant) == ("attn.post_norm", 1)


def test_gemma2_attention_soft_cap_dropped_is_found_at_attn_core(tmp_path, hf_pairs):
    def plant(model):
        _layer(model, 1).self_attn.attn.logit_cap = 0.0
    assert _first(tmp_path, hf_pairs, "Gemma2ForCausalLM", plant) == ("attn.core", 1)


def test_gemma2_sliding_layer_attending_to_every_key_is_found_at_attn_core(tmp_path, hf_pairs):
    """Layer 0 is a sliding-window layer (window 4 < 11 tokens): without its window it reads keys it must not."""
    def plant(model):
        _layer(model, 0).self_attn.attn.sliding_window_size = -1
    assert _first(tmp_path, hf_pairs, "Gemma2ForCausalLM", plant) == ("attn.core", 0)


def test_gemma2_other_final_soft_cap_is_found_at_logits(tmp_path, hf_pairs):
    def plant(model):
        model.logits_processor.final_logit_softcapping = 2.0
    assert _first(tmp_path, hf_pairs, "Gemma2ForCausalLM", plant) == ("logits", None)


def test_gemma2_mlp_branch_norm_fault_is_found_at_mlp_post_norm(tmp_path, hf_pairs):
    plant = lambda m: _wrap_output(_layer(m, 0).post_feedforward_layernorm, lambda y: y * 1.01)  # noqa: E731
    assert _first(tmp_path, hf_pairs, "Gemma2ForCausalLM", plant) == ("mlp.post_norm", 0)


# ------------------------------------------------------------------------------------------------ Gemma 3

def test_gemma3_clean_fp32_pair_is_consistent(tmp_path, hf_pairs):
    _check_clean_fp32(tmp_path, hf_pairs, "Gemma3ForCausalLM")


def test_gemma3_clean_bf16_pair_replayed_blames_no_side(tmp_path, sglang_env):
    _check_clean_bf16_replayed(tmp_path, "Gemma3ForCausalLM")


def test_gemma3_sliding_layer_rotated_with_the_global_base_is_found_at_q_rope(tmp_path, hf_pairs):
    """Layer 0 is a sliding layer (local RoPE base 10^4), layer 1 full (10^6): the model's local rotary
    embedding given the global frequencies changes layer 0's RoPE first."""
    def plant(model):
        local, full = model.model.rotary_emb_local, model.model.rotary_emb
        local.inv_freq = full.inv_freq.clone()
    assert _first(tmp_path, hf_pairs, "Gemma3ForCausalLM", plant) == ("attn.q_rope", 0)


def test_gemma3_k_norm_without_the_unit_offset_is_found_at_attn_k_norm(tmp_path, hf_pairs):
    def plant(model):
        norm = _layer(model, 1).self_attn.k_norm
        norm.forward = lambda x: norm._norm(x.float()).mul(norm.weight.float()).type_as(x)
    assert _first(tmp_path, hf_pairs, "Gemma3ForCausalLM", plant) == ("attn.k_norm", 1)


def test_gemma3_pre_feedforward_norm_fault_is_found_at_mlp_norm(tmp_path, hf_pairs):
    def plant(model):
        norm = _layer(model, 1).pre_feedforward_layernorm
        inner = norm.forward
        norm.forward = lambda x, residual: (lambda y, r: (y * 1.01, r))(*inner(x, residual))
    assert _first(tmp_path, hf_pairs, "Gemma3ForCausalLM", plant) == ("mlp_norm", 1)


# ------------------------------------------------------------------------------------------------ GPT-OSS

def test_gpt_oss_clean_fp32_pair_is_consistent(tmp_path, hf_pairs):
    _check_clean_fp32(tmp_path, hf_pairs, "GptOssForCausalLM")


def test_gpt_oss_clean_bf16_pair_replayed_blames_no_side(tmp_path, sglang_env):
    """SGLang keeps the top-k routing weights in fp32 where HF rounds them to bf16: a real precision difference
    (HF the coarser, as with Qwen3-MoE in test_replay_sglang.py), accepted here; nothing else is blamed."""
    _check_clean_bf16_replayed(tmp_path, "GptOssForCausalLM", accept=("moe.topk_weights",))


def test_gpt_oss_fp32_sinks_are_rounded_by_sglang_and_found_at_attn_core(tmp_path, sglang_env):
    """An fp32 checkpoint whose sinks are not bf16 values: SGLang's bf16 sinks parameter rounds them, a real
    difference from HF's fp32 sinks, found at the first attention (not hidden by the consistent pairs above)."""
    model = build_hf_model(_config("GptOssForCausalLM"))
    _hf_trace(model, tmp_path / "hf")
    _sg_trace(_config("GptOssForCausalLM"), model, tmp_path / "sg")
    rep = find_divergence(str(tmp_path / "hf"), str(tmp_path / "sg"))
    assert rep.verdict == "divergent" and parse_key(rep.first["key"]) == ("attn.core", 0), _detail(rep)


def test_gpt_oss_attention_sinks_dropped_is_found_at_attn_core(tmp_path, hf_pairs):
    """Layer 1's sinks at -inf: exp(sink) = 0, attention without sinks."""
    def plant(model):
        with torch.no_grad():
            _layer(model, 1).self_attn.sinks.fill_(float("-inf"))
    assert _first(tmp_path, hf_pairs, "GptOssForCausalLM", plant) == ("attn.core", 1)


def test_gpt_oss_router_bias_fault_is_found_at_the_router(tmp_path, hf_pairs):
    def plant(model):
        with torch.no_grad():
            _layer(model, 1).mlp.router.bias.add_(0.01)
    assert _first(tmp_path, hf_pairs, "GptOssForCausalLM", plant) == ("moe.router_logits", 1)


def test_gpt_oss_swiglu_clamp_changed_is_found_at_the_experts(tmp_path, hf_pairs):
    """The experts' SwiGLU clamp tightened (7 -> 0.05, below the tiny model's gate values)."""
    def plant(model):
        experts = _layer(model, 1).mlp.experts
        tight = dataclasses.replace(experts.moe_runner_config, gemm1_clamp_limit=0.05)
        for holder in (experts, experts.quant_method):
            if hasattr(holder, "moe_runner_config"):
                holder.moe_runner_config = tight
    assert _first(tmp_path, hf_pairs, "GptOssForCausalLM", plant) == ("moe.experts_out", 1)


# ------------------------------------------------------------------------------------------------ Gemma 3 RoPE

def _gemma3_with_global_rope(full_attention: dict):
    cfg = _config("Gemma3ForCausalLM")
    cfg.rope_parameters = {"full_attention": {"rope_theta": 1e6, **full_attention},
                           "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
    return cfg


def test_gemma3_linear_rope_of_the_global_layers_matches_hf(tmp_path, sglang_env):
    """Gemma 3's released 4B/12B/27B configs scale the global layers' RoPE linearly (factor 8), the local ones
    not: SGLang's rollout agrees with HF at every point; against HF without the factor (same weights) it
    diverges first at the global layer's RoPE, so the factor is really applied on both sides."""
    cfg = _gemma3_with_global_rope({"rope_type": "linear", "factor": 8.0})
    model = build_hf_model(cfg)
    _hf_trace(model, tmp_path / "hf")
    _sg_trace(cfg, model, tmp_path / "sg")
    rep = find_divergence(str(tmp_path / "hf"), str(tmp_path / "sg"))
    assert rep.verdict == "consistent" and rep.rows["matched"] == SG_ROWS, _detail(rep)
    plain = build_hf_model(_gemma3_with_global_rope({"rope_type": "default"}))
    plain.load_state_dict(model.state_dict())
    _hf_trace(plain, tmp_path / "plain")
    rep = find_divergence(str(tmp_path / "plain"), str(tmp_path / "sg"))
    assert rep.verdict == "divergent" and rep.first.key in ("L1.attn.q_rope", "L1.attn.k_rope"), rep.first
