"""SGLang 0.5.23's Mixtral (``mixtral.py``: the MoE block is ``block_sparse_moe``) against HF
``MixtralForCausalLM`` and against megatron-core 0.16.1 with the same weights (CPU, TP=1): a clean fp32 pair is
consistent with every MoE point found under ``block_sparse_moe``; a clean bf16 pair replayed against the
checkpoint blames no side; faults planted in SGLang's router and experts are found at their point and layer.

SGLang runs test_sglang_archs.py's rollout; HF and Megatron one forward per full sequence. Every Megatron trace
is made first: megatron's gloo group is torn down before SGLang's distributed state starts.
"""
from __future__ import annotations

import megatron.core  # noqa: F401 - a required test dependency: fail loudly if missing
import pytest
import sglang  # noqa: F401 - a required test dependency: fail loudly if missing
import torch
import transformers as T

import tic_trace
from tic_trace import find_divergence
from tic_trace.adapters import sglang as sga
from tic_trace.adapters.megatron import MegatronAdapter
from tic_trace.adapters.megatron_weights import hf_to_megatron_state_dict, load_into
from tic_trace.graph.canonical import parse_key
from tic_trace.testing import megatron_cpu as mc
from tic_trace.testing import sglang_cpu as sc
from tic_trace.testing.hf_models import build_hf_model, build_hf_model_stable
from tic_trace.view.align import CanonicalView

from arch_configs_gemma_phi3_gptoss import COMMON
from test_megatron_families import _megatron_view
from test_sglang_archs import PROMPTS, RESPONSES, SG_ROWS, _hf_trace, _layer, _sg_trace

NAME = "MixtralForCausalLM"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
MOE = {"moe.router_logits", "moe.topk_ids", "moe.topk_weights", "moe.experts_out"}


def _config():
    cfg = T.MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2)
    cfg._attn_implementation = "eager"
    return cfg


def _mg_trace(out, hf, dtype) -> str:
    cfg = _config()
    view = _megatron_view(cfg)
    model = mc.build_gpt_model(view, dtype=dtype, qk_layernorm=False)
    load_into(model, hf_to_megatron_state_dict(hf.state_dict(), view))
    with tic_trace.trace(model, out, adapter=MegatronAdapter(vocab_size=cfg.vocab_size), points_mode="full") as t, \
            torch.no_grad():
        for rid in PROMPTS:
            t.sample_keys = [rid]
            ids = torch.tensor([PROMPTS[rid] + RESPONSES[rid]])
            model(ids, torch.arange(ids.shape[1]).unsqueeze(0), attention_mask=None)
            t.step()
    assert t.failed is None, t.failed
    return str(out)


@pytest.fixture(scope="module")
def sides(tmp_path_factory):
    """"fp32"|"bf16" -> {"ck", "hf", "mg", "model"}, every trace made before SGLang starts."""
    root, out = tmp_path_factory.mktemp("sg_mixtral"), {}
    with mc.single_rank():
        for tag, dtype in DTYPES.items():
            d = root / tag
            hf = build_hf_model(_config()) if dtype == torch.float32 else build_hf_model_stable(_config(), dtype=dtype)
            hf.save_pretrained(d / "ck")
            _hf_trace(hf, d / "hf")
            out[tag] = {"ck": str(d / "ck"), "hf": str(d / "hf"), "mg": _mg_trace(d / "mg", hf, dtype), "model": hf}
    sc.init_sglang_distributed(tp_size=1)
    yield out
    sga.close_sessions()
    sc.destroy_sglang_distributed()


def _detail(rep):
    return [(p.key, p.status, p.error) for p in rep.points if p.status != "ok"]


def test_clean_fp32_pairs_are_consistent_with_the_moe_points_under_block_sparse_moe(tmp_path, sides):
    s = sides["fp32"]
    _sg_trace(_config(), s["model"], tmp_path / "sg")
    v = CanonicalView(str(tmp_path / "sg"))
    assert (v.config["architecture"], v.config["architecture_verified"]) == (NAME, True)
    points = {p for p, _ in v.points()}
    assert points == set(v.adapter.promised_points(v.config)) | {"logprobs"} and MOE <= points
    for other in ("hf", "mg"):
        rep = find_divergence(s[other], str(tmp_path / "sg"))
        assert rep.verdict == "consistent", (other, _detail(rep))
        assert rep.not_comparable == [] and rep.rows["matched"] == SG_ROWS


def test_clean_bf16_pairs_replayed_blame_no_side(tmp_path, sides):
    """Against HF (both keep the top-k weights in fp32) and against Megatron (which rounds them to bf16: a real
    precision difference, Megatron the coarser, accepted here): no side blamed anywhere else."""
    s = sides["bf16"]
    _sg_trace(T.AutoConfig.from_pretrained(s["ck"]), s["ck"], tmp_path / "sg", dtype=torch.bfloat16)
    for other, accept in (("hf", []), ("mg", ["moe.topk_weights"])):
        rep = find_divergence(s[other], str(tmp_path / "sg"), reference=s["ck"], accept_precision=accept)
        assert {f.cause for f in rep.findings if f.divergent} <= {"routing"}, (other, [f.key for f in rep.findings])
        blamed = [p.key for p in rep.points if (p.replay or {}).get("side") and not (p.replay or {}).get("accepted")]
        assert not blamed, (other, blamed)
        assert not [n for n in rep.notes if n.kind == "not_replayed"]


def _router(model):
    with torch.no_grad():
        _layer(model, 1).block_sparse_moe.gate.weight.mul_(1.05)


def _expert(model):
    """One expert's down-projection scaled (FusedMoE's w2_weight [E, H, I])."""
    with torch.no_grad():
        _layer(model, 0).block_sparse_moe.experts.w2_weight[2].mul_(1.05)


@pytest.mark.parametrize("plant, want", [(_router, ("moe.router_logits", 1)), (_expert, ("moe.experts_out", 0))],
                         ids=["router", "expert"])
def test_planted_fault_in_sglang_found_against_hf_and_megatron(tmp_path, sides, plant, want):
    s = sides["fp32"]
    _sg_trace(_config(), s["model"], tmp_path / "sg", plant)
    for other in ("hf", "mg"):
        rep = find_divergence(s[other], str(tmp_path / "sg"))
        assert rep.verdict == "divergent" and parse_key(rep.first["key"]) == want, (other, rep.first["summary"])
