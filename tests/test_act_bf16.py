"""The known fault "activation evaluated op by op in bf16" (tic_trace/replay/act_bf16.py): its forms are what
real code computes when it writes the activation as tensor ops (HF's Python GELUs, SGLang's NewGELU,
megatron-core's fusion functions without their fuser), none of them is what the engines' one-rounding paths
compute, and planted in a tiny bf16 model it is found at its MLP and named, while a fused act x up in fp32
(SGLang's act-and-mul kernels, megatron-core's fusions under torch.compile) is named as the clean variant it is.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tic_trace.replay.act_bf16 import op_by_op
from tic_trace.replay.intrinsic import IntrinsicError, replay_side
from tic_trace.replay.intrinsic_verdict import first_intrinsic_divergence
from tic_trace.replay.reference import ExactReference
from tic_trace.testing.hf_models import build_hf_model_stable, sample_tokens, tiny_qwen3_config
from tic_trace.view.align import CanonicalView

from arch_configs_gemma_phi3_gptoss import GEMMA_PHI3_GPTOSS
from conftest import trace_hf

IDS = sample_tokens(2, 10)


def _x() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(8192, generator=g) * torch.logspace(-2, 1, 8192)).to(torch.bfloat16)


def _reproduced(out: torch.Tensor, act: str, x: torch.Tensor) -> bool:
    return any(torch.equal(out, f(x)) for f in op_by_op(act))


def test_the_forms_are_real_codes_op_by_op_activations_and_not_the_one_rounding_ones():
    import transformers.activations as A
    from megatron.core.fusions.fused_bias_geglu import geglu
    from megatron.core.fusions.fused_bias_gelu import bias_gelu
    from sglang.srt.layers.activation import NewGELU
    x = _x()
    for mod in (A.NewGELUActivation(), A.GELUTanh(use_gelu_tanh_python=True), A.FastGELUActivation()):
        assert _reproduced(mod(x), "gelu_pytorch_tanh", x), type(mod).__name__
    assert _reproduced(NewGELU.forward_native(None, x), "gelu_pytorch_tanh", x)
    # megatron-core's fusions as written, run without their fuser (torch.compile keeps them in fp32)
    assert _reproduced(bias_gelu._torchdynamo_orig_callable(torch.zeros_like(x), x), "gelu_pytorch_tanh", x)
    ones = torch.ones_like(x)
    assert _reproduced(geglu._torchdynamo_orig_callable(torch.cat([x, ones])), "gelu_pytorch_tanh", x)
    assert _reproduced(A.GELUActivation(use_gelu_python=True)(x), "gelu", x)
    assert _reproduced(x * torch.sigmoid(x), "silu", x)
    # the one-rounding paths (HF's configured activations, SGLang's forward_native, the fused kernels) differ
    for act, once in (("gelu_pytorch_tanh", F.gelu(x, approximate="tanh")), ("gelu", F.gelu(x)), ("silu", F.silu(x))):
        for f in op_by_op(act):
            assert float((f(x) != once).float().mean()) > 0.05, (act, f.__name__)


def _gemma3(tmp_path):
    cfg = GEMMA_PHI3_GPTOSS["Gemma3ForCausalLM"]()
    cfg._attn_implementation = "eager"
    model = build_hf_model_stable(cfg, dtype=torch.bfloat16)
    model.save_pretrained(tmp_path / "ck")
    trace_hf(model, tmp_path / "a", IDS)
    return model


def test_gemma3_gelu_written_out_in_bf16_is_found_at_its_mlp_and_named(tmp_path):
    """A port that takes HF's gelu_new (the formula as tensor ops) where the config says gelu_pytorch_tanh."""
    import transformers.activations as A
    model = _gemma3(tmp_path)
    model.model.layers[1].mlp.act_fn = A.NewGELUActivation()
    trace_hf(model, tmp_path / "b", IDS)
    got = first_intrinsic_divergence(str(tmp_path / "a"), str(tmp_path / "b"), ExactReference(str(tmp_path / "ck")))
    assert got is not None and (got.key, got.side) == ("L1.mlp.out", "B"), got
    assert (got.b.match_kind, got.b.match) == ("fault", "act_bf16"), got.b
    assert "op by op in bf16" in got.reason and got.a.match_kind == "clean", got.reason


def _fused_gelu_and_mul(self, x):
    """SGLang's gelu_tanh_and_mul kernel: the activation and the product in fp32, one rounding."""
    g, u = self.gate_proj(x), self.up_proj(x)
    return self.down_proj((F.gelu(g.float(), approximate="tanh") * u.float()).to(x.dtype))


def test_gemma3_fused_gelu_and_mul_in_fp32_is_a_clean_variant_not_the_fault(tmp_path):
    import types
    model = _gemma3(tmp_path)
    for lay in model.model.layers:
        lay.mlp.forward = types.MethodType(_fused_gelu_and_mul, lay.mlp)
    trace_hf(model, tmp_path / "b", IDS)
    b = {r.key: r for r in replay_side(CanonicalView(str(tmp_path / "b")), ExactReference(str(tmp_path / "ck")))
         if isinstance(r, IntrinsicError)}
    for layer in (0, 1):
        e = b[f"L{layer}.mlp.out"]
        assert (e.match_kind, e.match) == ("clean", "fused_act_up"), e
    assert first_intrinsic_divergence(str(tmp_path / "a"), str(tmp_path / "b"),
                                      ExactReference(str(tmp_path / "ck"))) is None


def test_qwen3_silu_as_x_over_one_plus_exp_in_bf16_is_found_and_named(tmp_path):
    """The other op-by-op SiLU (x / (1 + exp(-x))) in a dense Qwen3's MLP: the silu_bf16 fault, named."""
    model = build_hf_model_stable(tiny_qwen3_config(moe=False), dtype=torch.bfloat16)
    model.save_pretrained(tmp_path / "ck")
    trace_hf(model, tmp_path / "a", IDS)
    model.model.layers[1].mlp.act_fn.forward = lambda x: x / (1.0 + torch.exp(-x))
    trace_hf(model, tmp_path / "b", IDS)
    got = first_intrinsic_divergence(str(tmp_path / "a"), str(tmp_path / "b"), ExactReference(str(tmp_path / "ck")))
    assert got is not None and (got.key, got.side) == ("L1.mlp.out", "B"), got
    assert (got.b.match_kind, got.b.match) == ("fault", "silu_bf16"), got.b
