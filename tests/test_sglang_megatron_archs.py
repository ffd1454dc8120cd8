"""The pairs an RL run compares: SGLang 0.5.23's rollout against megatron-core 0.16.1's training forward, for the
families both tables claim beyond Qwen3 / DeepSeek-V3 / GLM-4.5 (test_replay_finder_mgsg.py, test_sglang_mla.py):
Llama, Qwen2, Phi-3 and GPT-OSS (sinks, sliding windows, clamped experts, YaRN), with the same weights, CPU, one rank.
Per family: a clean fp32 pair is consistent; a clean bf16 pair replayed against the checkpoint both loaded blames
no side; faults planted in SGLang's computation are found at exactly their point and layer against Megatron.

SGLang runs test_sglang_archs.py's rollout (two requests batched in one prefill, then decode steps with forced
responses); Megatron one forward per full sequence. Every Megatron trace is made first: megatron's gloo group is
torn down before SGLang's distributed state starts.
"""
from __future__ import annotations

import megatron.core  # noqa: F401 - a required test dependency: fail loudly if missing
import pytest
import sglang  # noqa: F401 - a required test dependency: fail loudly if missing
import torch
import transformers as T

from tic_trace import find_divergence
from tic_trace.adapters import sglang as sga
from tic_trace.adapters.megatron_weights import hf_to_megatron_state_dict, load_into
from tic_trace.graph.canonical import parse_key
from tic_trace.testing import megatron_cpu as mc
from tic_trace.testing import megatron_gptoss as mg
from tic_trace.testing import sglang_cpu as sc
from tic_trace.testing.hf_models import build_hf_model, build_hf_model_stable
from tic_trace.testing.sglang_cpu_kernels import shim_final_logit_softcap

from conftest import trace_megatron
from test_megatron_families import _megatron_view
from arch_configs_gemma_phi3_gptoss import COMMON
from test_sglang_archs import CONFIGS, PROMPTS, RESPONSES, SG_ROWS, _bf16_sinks, _layer, _rows, _sg_trace

NAMES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Phi3ForCausalLM", "GptOssForCausalLM")
_CONFIGS = {**CONFIGS, "Qwen2ForCausalLM": lambda: T.Qwen2Config(**COMMON)}


def _config(name: str):
    cfg = _CONFIGS[name]()
    cfg._attn_implementation = "eager"
    return cfg
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _megatron_model(name: str, cfg, dtype):
    if name == "GptOssForCausalLM":
        return mg.build_gpt_oss_gpt_model(cfg, dtype=dtype), cfg
    view = _megatron_view(cfg)
    return mc.build_gpt_model(view, dtype=dtype, qk_layernorm=False), view


def _mg_trace(out, name: str, hf, dtype) -> str:
    """One Megatron forward per full sequence (prompt + response), each its own sample, as HF's in
    test_sglang_archs.py."""
    cfg = _config(name)
    model, view = _megatron_model(name, cfg, dtype)
    load_into(model, hf_to_megatron_state_dict(hf.state_dict(), view))
    return trace_megatron(model, out, cfg.vocab_size, sequences={rid: PROMPTS[rid] + RESPONSES[rid] for rid in PROMPTS})


@pytest.fixture(scope="module")
def sides(tmp_path_factory):
    """(name, "fp32"|"bf16") -> {"ck", "mg", "hf_model"}: the checkpoint (bf16) and Megatron's trace, all made
    before SGLang starts; then SGLang's distributed state for the module."""
    root, out = tmp_path_factory.mktemp("sg_mg_archs"), {}
    with mc.single_rank():
        for name in NAMES:
            for tag, dtype in DTYPES.items():
                d = root / f"{name}_{tag}"
                if dtype == torch.float32:
                    hf = build_hf_model(_config(name))
                    _bf16_sinks(hf)     # SGLang's sinks parameter is bf16 (test_sglang_archs.py)
                else:
                    hf = build_hf_model_stable(_config(name), dtype=dtype)
                    hf.save_pretrained(d / "ck")
                out[name, tag] = {"ck": str(d / "ck"), "hf_model": hf, "mg": _mg_trace(d / "mg", name, hf, dtype)}
    sc.init_sglang_distributed(tp_size=1)
    shim_final_logit_softcap()
    yield out
    sga.close_sessions()
    sc.destroy_sglang_distributed()


def _detail(rep):
    return [(p.key, p.status, p.error) for p in rep.points if p.status != "ok"]


@pytest.mark.parametrize("name", NAMES)
def test_clean_fp32_pair_is_consistent(tmp_path, sides, name):
    s = sides[name, "fp32"]
    _sg_trace(_config(name), s["hf_model"], tmp_path / "sg")
    rep = find_divergence(s["mg"], str(tmp_path / "sg"))
    assert rep.verdict == "consistent", _detail(rep)
    assert rep.not_comparable == [] and rep.rows["matched"] == SG_ROWS
    assert max(p.error for p in rep.points) < 1e-5


@pytest.mark.parametrize("name", NAMES)
def test_clean_bf16_pair_replayed_blames_no_side(tmp_path, sides, name):
    """No side blamed at any replayed point. GPT-OSS: Megatron rounds the top-k routing weights to bf16 where
    SGLang keeps them in fp32, a real precision difference (as for Qwen3-MoE, docs/replay.md), accepted."""
    s = sides[name, "bf16"]
    _sg_trace(T.AutoConfig.from_pretrained(s["ck"]), s["ck"], tmp_path / "sg", dtype=torch.bfloat16)
    accept = ["moe.topk_weights"] if name == "GptOssForCausalLM" else []
    rep = find_divergence(s["mg"], str(tmp_path / "sg"), reference=s["ck"], accept_precision=accept)
    assert {f.cause for f in rep.findings if f.divergent} <= {"routing"}, [f.key for f in rep.findings]
    blamed = [p.key for p in rep.points if (p.replay or {}).get("side") and not (p.replay or {}).get("accepted")]
    assert not blamed, blamed
    assert not [n for n in rep.notes if n.kind == "not_replayed"]


def _sinks_dropped(model):
    with torch.no_grad():
        _layer(model, 1).self_attn.sinks.fill_(float("-inf"))


def _router_bias(model):
    with torch.no_grad():
        _layer(model, 1).mlp.router.bias.add_(0.01)


def _phi3_q_rows(model):
    attn = _layer(model, 0).self_attn
    _rows(attn.qkv_proj.weight, 0, attn.q_size, lambda w: w * 1.01)


def _phi3_k_and_v_swapped(model):
    attn = _layer(model, 1).self_attn
    q, kv, w = attn.q_size, attn.kv_size, attn.qkv_proj.weight
    with torch.no_grad():
        w.copy_(torch.cat([w[:q], w[q + kv:], w[q:q + kv]], 0))


def _qwen2_k_bias(model):
    """Layer 0's k bias rows of the fused qkv_proj shifted: at attn.k, not q or v."""
    attn = _layer(model, 0).self_attn
    _rows(attn.qkv_proj.bias, attn.q_size, attn.q_size + attn.kv_size, lambda b: b + 0.05)


def _qwen2_o_proj(model):
    with torch.no_grad():
        _layer(model, 1).self_attn.o_proj.weight.mul_(1.02)


def _llama_gate_up_swapped(model):
    w = _layer(model, 0).mlp.gate_up_proj.weight
    with torch.no_grad():
        w.copy_(torch.cat(w.chunk(2, 0)[::-1], 0))


def _llama_input_norm(model):
    with torch.no_grad():
        _layer(model, 1).input_layernorm.weight.mul_(1.05)


FAULTS = {
    "llama_gate_up_swapped": ("LlamaForCausalLM", _llama_gate_up_swapped, ("mlp.out", 0)),
    "llama_input_norm": ("LlamaForCausalLM", _llama_input_norm, ("attn_norm", 1)),
    "qwen2_k_bias": ("Qwen2ForCausalLM", _qwen2_k_bias, ("attn.k", 0)),
    "qwen2_o_proj": ("Qwen2ForCausalLM", _qwen2_o_proj, ("attn.out", 1)),
    "phi3_q_rows": ("Phi3ForCausalLM", _phi3_q_rows, ("attn.q", 0)),
    "phi3_k_and_v_swapped": ("Phi3ForCausalLM", _phi3_k_and_v_swapped, ("attn.k", 1)),
    "gpt_oss_sinks_dropped": ("GptOssForCausalLM", _sinks_dropped, ("attn.core", 1)),
    "gpt_oss_router_bias": ("GptOssForCausalLM", _router_bias, ("moe.router_logits", 1)),
}


@pytest.mark.parametrize("case", sorted(FAULTS))
def test_planted_fault_in_sglang_found_against_megatron(tmp_path, sides, case):
    name, plant, want = FAULTS[case]
    s = sides[name, "fp32"]
    _sg_trace(_config(name), s["hf_model"], tmp_path / "sg", plant)
    rep = find_divergence(s["mg"], str(tmp_path / "sg"))
    assert rep.verdict == "divergent", _detail(rep)
    assert parse_key(rep.first["key"]) == want, rep.first["summary"]
