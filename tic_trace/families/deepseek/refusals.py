"""What the DeepSeek family's rows were verified in, as refusals: why a trace's setup (its manifest's facts) is
not one the tests ran (None: it is). The Megatron and SGLang adapters refuse such a trace by these words.
"""
from __future__ import annotations

from .names_sglang import MLA, ROUTED_SCALED


def latent_refusal(config: dict) -> str | None:
    """Why an MLA trace's setup is not the one the tests verify (None: it is, or the model is not MLA)."""
    if not config.get("kv_lora_rank"):
        return None
    why = []
    if not config.get("rope_interleave", True):
        why.append("`rotary_interleaved=True`: megatron's MLA RoPE then rotates pairs of the de-interleaved dims, "
                   "a layout no reference computes")
    if config.get("mla_rope_fusion"):
        why.append("`apply_rope_fusion` (TE's fused MLA YaRN RoPE): not run in the tests")
    if config.get("mla_rope_type") not in (None, "rope"):
        why.append(f"MLA RoPE `{config.get('mla_rope_type')}` (YaRN): not run against a reference in the tests")
    if config.get("spec") == "te":
        why.append("the Transformer Engine spec (latent norms fused into `linear_q_up_proj` / `linear_kv_up_proj`): "
                   "not run in the tests")
    if int(config.get("tensor_model_parallel_size") or 1) > 2 or config.get("sequence_parallel"):
        why.append(f"`tensor_model_parallel_size` {config.get('tensor_model_parallel_size')}"
                   f"{' with sequence parallelism' if config.get('sequence_parallel') else ''}: the tests run MLA "
                   "at TP 1 and 2, without sequence parallelism")
    for k in ("context_parallel_size", "pipeline_model_parallel_size"):
        if int(config.get(k) or 1) > 1:
            why.append(f"`{k}` {config.get(k)}: not run with MLA in the tests")
    if int(config.get("expert_model_parallel_size") or 1) > 1:
        why.append("expert parallelism with MLA: not run in the tests")
    return "MLA: " + "; ".join(why) if why else None


def setup_refusal(config: dict) -> str | None:
    """Why a DeepSeek-V3 / GLM-4.5 trace's setup is not the one the tests verify (None: it is, or the model is
    neither): shared experts fused into the routed ones, and MLA's (mla_refusal)."""
    if config.get("architecture") not in ROUTED_SCALED:
        return None
    why = []
    if config.get("fused_shared_experts"):
        why.append(f"{config['fused_shared_experts']} shared expert(s) fused into the routed experts: "
                   "`moe.experts_out` and the top-k hold the shared expert too and `moe.shared_out` is not "
                   "produced; start the server with --disable-shared-experts-fusion")
    mla = mla_refusal(config)
    return "; ".join(why + ([mla] if mla else [])) or None


def mla_refusal(config: dict) -> str | None:
    """Why an MLA trace's setup is not the one the tests verify (None: it is, or the model is not MLA)."""
    if config.get("attention") != "mla" or config.get("architecture") not in MLA:
        return None
    why = []
    if int(config.get("tensor_model_parallel_size") or 1) > 2:
        why.append(f"tensor parallelism {config.get('tensor_model_parallel_size')}: MLA's sharded heads are run "
                   "at TP 1 and 2 only in the tests")
    apart = config.get("mla_rope_apart")
    if apart is None:
        why.append("the trace does not say which attention backend ran the absorbed path (where its RoPE dims are)")
    elif apart:
        why.append(f"decode attention backend `{config.get('mla_decode_backend')}` takes the RoPE dims apart "
                   "(`q_rope=` / `k_rope=`): the rows read them inside the attention's q and k inputs, as "
                   "torch_native, triton and flashmla pass them; not run in the tests")
    return "MLA: " + "; ".join(why) if why else None
