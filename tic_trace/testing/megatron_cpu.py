"""Run real megatron-core 0.16.1 ``GPTModel`` (local spec) on CPU, on gloo.

TEST SUPPORT ONLY. This module monkeypatches megatron-core (and ``torch.cuda.current_device``) so that
the upstream CUDA-only code paths run on a CPU machine. It may be imported by tests and by the ``demo``
command; product code (the tracer, the adapters) must never import it, and nothing here may leak into a
real training job.

Every shim names the upstream megatron-core 0.16.1 file, function and line it works around (line numbers
are of the released wheel, identical to git tag ``core_v0.16.1``). Each ``apply_*`` function is
idempotent; :func:`remove_shims` restores every original attribute.

Typical use (one process per rank; world size 1 works in the current process)::

    from tic_trace.testing import megatron_cpu as mc
    mc.init_parallel(rank, world, tp=2, ep=1, sp=True, port=port)
    model = mc.build_gpt_model(hf_config, tp=2, ep=1, sp=True)
    load_into(model, hf_to_megatron_state_dict(hf_sd, hf_config, tp_rank=..., tp_size=2))
    with torch.no_grad():
        logits = model(tokens, positions, attention_mask=None)   # [b, s, V/tp]
    mc.destroy()

See ``/work/shared/notes/megatron-internals.md`` §5 for how the recipe was found.
"""

from __future__ import annotations

from tic_trace.testing.spawn import free_port, spawn_ranks  # noqa: F401 - re-exported for tests

import contextlib
import copy
import datetime
import socket
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

__all__ = [
    "apply_base",
    "apply_moe_ep_and_sp",
    "apply_gloo_uneven_collectives",
    "apply_all",
    "remove_shims",
    "applied_shims",
    "free_port",
    "init_parallel",
    "build_transformer_config",
    "build_gpt_model",
    "gather_vocab_logits",
    "destroy",
    "single_rank",
    "per_segment_thd_attention",
    "spawn_ranks",
]

SUPPORTED_MCORE_VERSION = "0.16.1"

# (owner, attribute name) -> original value, recorded the first time a shim replaces it.
_ORIGINALS: dict[tuple[Any, str], Any] = {}
_MISSING = object()
_APPLIED: set[str] = set()
# What init_parallel set up, so build_gpt_model can default to it.
_STATE: dict[str, Any] = {}


def _patch(owner: Any, name: str, new: Any) -> None:
    """Replace ``owner.name`` with ``new``, remembering the original once (idempotent)."""
    key = (owner, name)
    if key not in _ORIGINALS:
        _ORIGINALS[key] = owner.__dict__.get(name, _MISSING) if isinstance(owner, type) else getattr(
            owner, name, _MISSING
        )
    setattr(owner, name, new)


def applied_shims() -> set[str]:
    """Names of the shim groups currently applied."""
    return set(_APPLIED)


def remove_shims() -> None:
    """Undo every shim (restore the original attributes). Safe to call when none is applied."""
    for (owner, name), orig in reversed(list(_ORIGINALS.items())):
        if orig is _MISSING:
            with contextlib.suppress(AttributeError):
                delattr(owner, name)
        else:
            setattr(owner, name, orig)
    _ORIGINALS.clear()
    _APPLIED.clear()


def _check_version() -> None:
    import megatron.core

    version = getattr(megatron.core, "__version__", "?")
    if version != SUPPORTED_MCORE_VERSION:
        import warnings

        warnings.warn(
            f"tic_trace.testing.megatron_cpu was written against megatron-core {SUPPORTED_MCORE_VERSION}; "
            f"found {version}. The shims may not apply.",
            stacklevel=3,
        )


# ---------------------------------------------------------------------------------------------
# Shims
# ---------------------------------------------------------------------------------------------


def _cpu_current_device() -> torch.device:
    return torch.device("cpu")


def _cpu_default_causal_mask(sq: int) -> torch.Tensor:
    # Like upstream, not cached: a fresh mask per call, so a dispatch-mode tracer sees the same ops.
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


def _cpu_sliding_window_causal_mask(sq: int, skv: int, window_size: Any) -> torch.Tensor:
    # Upstream's construction (True = masked) on the CPU: the bands above the causal diagonal and below the window.
    m = torch.ones(sq, skv, dtype=torch.bool)
    return ~torch.tril(torch.triu(m, diagonal=skv - sq - window_size[0]), diagonal=skv - sq + window_size[1])


class _CpuDtoHStream:
    """Placeholder for ``MoEAlltoAllTokenDispatcher.cuda_dtoh_stream``; never used as a stream."""

    def __repr__(self) -> str:  # pragma: no cover - cosmetic
        return "<tic_trace cpu dtoh stream placeholder>"


class _NoopEvent:
    def synchronize(self) -> None:
        return None


def _to_host(t: Any, as_numpy: bool = False) -> Any:
    # What megatron.core.transformer.moe.moe_utils.maybe_move_tensor_to_cpu (moe_utils.py:1078-1100)
    # returns on GPU: a host tensor, or a numpy array when as_numpy.
    if torch.is_tensor(t):
        t = t.detach().cpu()
        if as_numpy:
            return t.numpy()
    return t


def _cpu_maybe_dtoh_and_synchronize(self, point: str, tokens_per_expert: Optional[torch.Tensor] = None):
    """CPU version of ``MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize``.

    Same data movement as upstream token_dispatcher.py:861-901, minus the CUDA side stream and event:
    at ``cuda_dtoh_point`` the split sizes become numpy arrays (what ``all_to_all_single`` needs) and the
    token counts host tensors; at ``cuda_sync_point`` there is nothing to wait for.
    """
    if not self.drop_and_pad and point == self.cuda_dtoh_point:
        tokens_per_expert = _to_host(tokens_per_expert)
        self.input_splits = _to_host(self.input_splits, as_numpy=True)
        self.output_splits = _to_host(self.output_splits, as_numpy=True)
        self.output_splits_tp = _to_host(self.output_splits_tp, as_numpy=True)
        self.num_out_tokens = _to_host(self.num_out_tokens)
        if self.num_local_experts > 1 and not self.config.moe_permute_fusion:
            self.num_global_tokens_per_local_expert = _to_host(self.num_global_tokens_per_local_expert)
        self.d2h_event = _NoopEvent()
    return tokens_per_expert


def apply_base() -> None:
    """Shims every CPU run needs (dense and MoE, any TP/EP). Idempotent.

    P0 (no patch, handled in :func:`init_parallel`): ``model_parallel_cuda_manual_seed`` is called with
    ``inference_rng_tracker=True`` so that tensor_parallel/random.py:321-340 installs a tracker whose
    ``add``/``fork`` do not touch ``torch.cuda.get_rng_state`` (random.py:417-429 would otherwise fail,
    and attention's ``get_cuda_rng_tracker().fork()`` raises "cuda rng state ... is not added").
    """
    if "base" in _APPLIED:
        return
    _check_version()
    import megatron.core.fusions.fused_softmax as fused_softmax
    import megatron.core.transformer.moe.moe_utils as moe_utils
    import megatron.core.transformer.moe.token_dispatcher as token_dispatcher
    import megatron.core.transformer.utils as transformer_utils

    # P1. ~100 allocation sites use device=torch.cuda.current_device(), e.g.
    #   tensor_parallel/mappings.py:91 and :141 (_gather_along_first_dim output buffer),
    #   transformer/dot_product_attention.py:123,132, parallel_state.py GlobalMemoryBuffer.get_tensor,
    #   transformer/moe/router.py:90 (router weight moved to the "current device"),
    #   models/gpt/gpt_model.py:415, models/common/embeddings/rotary_pos_embedding.py:162.
    # Without CUDA, torch.cuda.current_device() raises. Return the CPU device instead.
    _patch(torch.cuda, "current_device", _cpu_current_device)

    # P2. transformer/utils.py:33-35 get_default_causal_mask() builds its mask with device="cuda"; it is
    # imported by name into fusions/fused_softmax.py:8 and called at fused_softmax.py:327 whenever
    # attention_mask is None (the causal default). Patch both names with a CPU bool mask (True = masked).
    _patch(transformer_utils, "get_default_causal_mask", _cpu_default_causal_mask)
    _patch(fused_softmax, "get_default_causal_mask", _cpu_default_causal_mask)
    # P2b. transformer/utils.py:38-45 get_sliding_window_causal_mask() (sliding-window attention, the
    # `window_size` switch) builds its mask with device="cuda"; imported by name into fused_softmax.py:8 and
    # called at fused_softmax.py:322. The same mask on the CPU.
    _patch(transformer_utils, "get_sliding_window_causal_mask", _cpu_sliding_window_causal_mask)
    _patch(fused_softmax, "get_sliding_window_causal_mask", _cpu_sliding_window_causal_mask)

    # P3. transformer/moe/moe_utils.py:22-39 imports te_general_gemm only when transformer_engine is
    # present, but RouterGatingLinearFunction.forward (moe_utils.py:1192) tests `te_general_gemm is not
    # None` unconditionally -> NameError without TE (fixed upstream after 0.16.1). Define it as None.
    if not hasattr(moe_utils, "te_general_gemm"):
        _patch(moe_utils, "te_general_gemm", None)

    # P4 (+P5). MoEAlltoAllTokenDispatcher.__init__ (token_dispatcher.py:444-445) creates a class-level
    # torch.cuda.Stream() for device-to-host copies, and _maybe_dtoh_and_synchronize
    # (token_dispatcher.py:861-901) uses torch.cuda.current_stream()/stream()/record_event(). A pre-set
    # placeholder makes __init__ skip the Stream; the method is replaced by a CPU version doing the same
    # copies. That CPU version also turns the all-to-all split sizes into numpy arrays, which the GPU
    # path gets from maybe_move_tensor_to_cpu(as_numpy=True) (moe_utils.py:1093-1096) but the CPU path
    # does not (that helper is a no-op for CPU tensors): all_to_all_single() then fails with
    # "incompatible function arguments" at EP>1 (notes P5).
    cls = token_dispatcher.MoEAlltoAllTokenDispatcher
    if cls.__dict__.get("cuda_dtoh_stream") is None:
        _patch(cls, "cuda_dtoh_stream", _CpuDtoHStream())
    _patch(cls, "_maybe_dtoh_and_synchronize", _cpu_maybe_dtoh_and_synchronize)

    _APPLIED.add("base")


def apply_moe_ep_and_sp() -> None:
    """Shims for sequence parallelism with the local spec (P6). Idempotent.

    The EP>1 alltoall split-size problem (notes P5) is already covered by :func:`apply_base` (P4+P5).
    """
    if "moe_ep_and_sp" in _APPLIED:
        return
    apply_base()
    from megatron.core.transformer import torch_norm

    # P6. transformer/torch_norm.py:32 WrappedTorchNorm.__new__ asserts
    # "sequence parallel not supported by torch LayerNorm". The forward of a norm does not depend on SP
    # (the flag only tells the DDP wrapper to all-reduce its grads), so build the norm from a config copy
    # with sequence_parallel=False and mark the parameters the way TE/apex norms do.
    orig_new = torch_norm.WrappedTorchNorm.__dict__["__new__"]
    orig_new = orig_new.__func__ if isinstance(orig_new, staticmethod) else orig_new

    def _sp_tolerant_new(cls, config, hidden_size, *args, **kwargs):
        if not getattr(config, "sequence_parallel", False):
            return orig_new(cls, config, hidden_size, *args, **kwargs)
        cfg = copy.copy(config)
        cfg.sequence_parallel = False
        norm = orig_new(cls, cfg, hidden_size, *args, **kwargs)
        for p in norm.parameters():
            setattr(p, "sequence_parallel", True)
        return norm

    _patch(torch_norm.WrappedTorchNorm, "__new__", staticmethod(_sp_tolerant_new))
    _APPLIED.add("moe_ep_and_sp")


def apply_gloo_uneven_collectives() -> None:
    """Make the uneven first-dim gather / reduce-scatter work on gloo (P7). Idempotent.

    tensor_parallel/mappings.py:143-150 (_gather_along_first_dim with output_split_sizes) and
    mappings.py:181-193 (_reduce_scatter_along_first_dim with input_split_sizes) use the list forms
    torch.distributed.all_gather / reduce_scatter with tensors of different sizes; gloo rejects them
    ("ProcessGroupGloo::allgather: invalid tensor size"). The alltoall dispatcher reaches them when
    expert-TP > 1 and EP > 1 (gather_from_sequence_parallel_region(output_split_sizes=...)).
    Replacement: pad every chunk to the largest size, use the equal-size collectives
    (all_gather_into_tensor / reduce_scatter_tensor, which gloo supports), and trim.
    Even splits and non-gloo groups go to the upstream functions unchanged.
    """
    if "gloo_uneven" in _APPLIED:
        return
    apply_base()
    from megatron.core.tensor_parallel import mappings

    orig_gather = mappings._gather_along_first_dim
    orig_rs = mappings._reduce_scatter_along_first_dim

    def _is_gloo(group) -> bool:
        try:
            return dist.get_backend(group) == "gloo"
        except Exception:  # pragma: no cover - defensive
            return False

    def _gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
        if (
            output_split_sizes is None
            or group is None
            or group.size() == 1
            or len(set(int(s) for s in output_split_sizes)) <= 1
            or not _is_gloo(group)
        ):
            return orig_gather(input_, group, output_split_sizes, use_global_buffer)
        sizes = [int(s) for s in output_split_sizes]
        world, pad_to = group.size(), max(sizes)
        x = input_.contiguous()
        padded = x.new_zeros((pad_to, *x.shape[1:]))
        padded[: x.shape[0]] = x
        out = x.new_empty((pad_to * world, *x.shape[1:]))
        dist.all_gather_into_tensor(out, padded, group=group)
        chunks = out.split(pad_to, dim=0)
        return torch.cat([c[:n] for c, n in zip(chunks, sizes)], dim=0)

    def _reduce_scatter_along_first_dim(input_, group, input_split_sizes=None, use_global_buffer=False):
        if (
            input_split_sizes is None
            or group is None
            or group.size() == 1
            or len(set(int(s) for s in input_split_sizes)) <= 1
            or not _is_gloo(group)
        ):
            return orig_rs(input_, group, input_split_sizes, use_global_buffer)
        sizes = [int(s) for s in input_split_sizes]
        pad_to = max(sizes)
        x = input_.contiguous()
        padded = x.new_zeros((pad_to * len(sizes), *x.shape[1:]))
        for r, chunk in enumerate(x.split(sizes, dim=0)):
            padded[r * pad_to : r * pad_to + chunk.shape[0]] = chunk
        out = x.new_empty((pad_to, *x.shape[1:]))
        dist.reduce_scatter_tensor(out, padded, group=group)
        return out[: sizes[group.rank()]].clone()

    # The autograd Functions in mappings.py look these helpers up as module globals at call time.
    _patch(mappings, "_gather_along_first_dim", _gather_along_first_dim)
    _patch(mappings, "_reduce_scatter_along_first_dim", _reduce_scatter_along_first_dim)
    _APPLIED.add("gloo_uneven")


def apply_all() -> None:
    """Apply every shim (each is a no-op for runs that never reach the patched code)."""
    apply_base()
    apply_moe_ep_and_sp()
    apply_gloo_uneven_collectives()


# ---------------------------------------------------------------------------------------------
# Process group and parallel state
# ---------------------------------------------------------------------------------------------


def init_parallel(
    rank: int,
    world: int,
    tp: int = 1,
    ep: int = 1,
    sp: bool = False,
    port: Optional[int] = None,
    *,
    etp: Optional[int] = None,
    seed: int = 1234,
    timeout_s: float = 1800.0,
) -> None:
    """Start a gloo process group and megatron's parallel state for this rank.

    Applies all shims, creates the default process group (``tcp://127.0.0.1:port``), calls
    ``parallel_state.initialize_model_parallel(tp, pp=1, ep, etp)`` and installs megatron's inference RNG
    tracker (P0). ``world`` must be a multiple of ``tp*pp`` and of ``etp*ep``; the rest is data parallel.
    ``port`` is required when ``world > 1`` (all ranks must agree); with ``world == 1`` a free port is
    picked. ``sp`` is recorded for :func:`build_gpt_model` (it is a model-config option, not a group).
    ``timeout_s`` is gloo's wait in a collective: torch's own default (30 min), not a test deadline (a rank
    waits there while the other computes, minutes on a loaded machine; a real hang is `spawn_ranks`' to see).
    """
    if sp and tp < 2:
        raise ValueError("sequence parallelism needs tp >= 2")
    apply_all()
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if dist.is_initialized():
        raise RuntimeError("a torch.distributed process group already exists; call destroy() first")
    if port is None:
        if world > 1:
            raise ValueError("port is required when world > 1 (pick it once with free_port())")
        port = free_port()
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=1,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
    )
    # P0: see apply_base(). force_reset so a second init in the same process starts clean.
    model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True, force_reset_rng=True)
    _STATE.clear()
    _STATE.update(rank=rank, world=world, tp=tp, ep=ep, etp=etp or tp, sp=sp)



@contextlib.contextmanager
def single_rank():
    """World size 1 in this process for the duration; the process group and the shims are removed after."""
    init_parallel(0, 1)
    try:
        yield
    finally:
        destroy(remove_patches=True)


def per_segment_thd_attention(model):
    """Let a local-spec model run packed THD batches on CPU: megatron-core 0.16.1's local
    ``DotProductAttention.forward`` (transformer/dot_product_attention.py) asserts ``packed_seq_params is
    None`` -- packed batches need TE's fused kernel. This stand-in runs the local kernel causally on each
    packed segment (padded boundaries when given); everything else -- embedding, THD RoPE, QKV, norms, MoE,
    head -- stays megatron's own code. Returns ``model``."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    for mod in model.modules():
        if isinstance(mod, DotProductAttention):
            def forward(query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                        packed_seq_params=None, _mod=mod):
                if packed_seq_params is None:
                    return DotProductAttention.forward(_mod, query, key, value, attention_mask)
                cu = (packed_seq_params.cu_seqlens_q_padded if packed_seq_params.cu_seqlens_q_padded is not None
                      else packed_seq_params.cu_seqlens_q).tolist()
                outs = [DotProductAttention.forward(_mod, query[a:b, None], key[a:b, None], value[a:b, None], None)
                        for a, b in zip(cu[:-1], cu[1:])]
                return torch.cat(outs, 0).reshape(cu[-1], -1)
            mod.forward = forward
    return model


def destroy(remove_patches: bool = False) -> None:
    """Tear down megatron's parallel state and the process group (and optionally the shims)."""
    try:
        from megatron.core import parallel_state as ps

        ps.destroy_model_parallel()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        _STATE.clear()
        if remove_patches:
            remove_shims()


# ---------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------


def _cfg(hf_config: Any, name: str, default: Any = _MISSING) -> Any:
    if isinstance(hf_config, dict):
        value = hf_config.get(name, default)
    else:
        value = getattr(hf_config, name, default)
    if value is _MISSING:
        raise KeyError(f"HF config has no {name!r}")
    return value


def _rope_settings(hf_config: Any) -> tuple[float, float]:
    """(rope_theta, rotary_percent) from a transformers 5.x (rope_parameters) or 4.x config."""
    params = _cfg(hf_config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", None):
        raise NotImplementedError(f"RoPE scaling {rope_type!r} is not mapped to Megatron in this harness")
    theta = params.get("rope_theta", _cfg(hf_config, "rope_theta", 10000.0))
    percent = params.get("partial_rotary_factor", _cfg(hf_config, "partial_rotary_factor", 1.0))
    return float(theta), float(percent)


def moe_layer_pattern(hf_config: Any) -> list[int]:
    """Per layer 1 (MoE) or 0 (dense), with HF Qwen3-MoE's rule (decoder_sparse_step, mlp_only_layers)."""
    n_layers = int(_cfg(hf_config, "num_hidden_layers"))
    n_experts = int(_cfg(hf_config, "num_experts", 0) or 0)
    if n_experts <= 0:
        return [0] * n_layers
    step = int(_cfg(hf_config, "decoder_sparse_step", 1) or 1)
    dense_only = set(_cfg(hf_config, "mlp_only_layers", []) or [])
    return [1 if (i not in dense_only and (i + 1) % step == 0) else 0 for i in range(n_layers)]


def build_transformer_config(
    hf_config: Any,
    tp: int = 1,
    ep: int = 1,
    sp: bool = False,
    dispatcher: str = "alltoall",
    dtype: torch.dtype = torch.float32,
    etp: Optional[int] = None,
    **overrides: Any,
):
    """The megatron ``TransformerConfig`` equivalent to a HF Qwen3 / Qwen3-MoE config."""
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    if dispatcher not in ("alltoall", "allgather"):
        raise ValueError(f"dispatcher must be 'alltoall' or 'allgather', not {dispatcher!r}")
    if _cfg(hf_config, "hidden_act", "silu") != "silu":
        raise NotImplementedError("only SwiGLU (hidden_act='silu') is mapped")
    hidden = int(_cfg(hf_config, "hidden_size"))
    n_heads = int(_cfg(hf_config, "num_attention_heads"))
    head_dim = _cfg(hf_config, "head_dim", None) or hidden // n_heads
    pattern = moe_layer_pattern(hf_config)
    kwargs: dict[str, Any] = dict(
        num_layers=int(_cfg(hf_config, "num_hidden_layers")),
        hidden_size=hidden,
        num_attention_heads=n_heads,
        num_query_groups=int(_cfg(hf_config, "num_key_value_heads", n_heads) or n_heads),
        kv_channels=int(head_dim),
        ffn_hidden_size=int(_cfg(hf_config, "intermediate_size")),
        normalization="RMSNorm",
        layernorm_epsilon=float(_cfg(hf_config, "rms_norm_eps")),
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=bool(_cfg(hf_config, "attention_bias", False)),
        qk_layernorm=True,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=1,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        sequence_parallel=sp,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=True,
        # Weights are loaded right after construction: skip the (slow) random init.
        perform_initialization=False,
    )
    if any(pattern):
        kwargs.update(
            num_moe_experts=int(_cfg(hf_config, "num_experts")),
            moe_router_topk=int(_cfg(hf_config, "num_experts_per_tok")),
            moe_ffn_hidden_size=int(_cfg(hf_config, "moe_intermediate_size")),
            moe_layer_freq=pattern,
            moe_grouped_gemm=False,
            moe_token_dispatcher_type=dispatcher,
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_router_score_function="softmax",
            # norm_topk_prob=True: HF softmax(all) -> top-k -> renormalise == megatron top-k on logits ->
            # softmax over the k (pre_softmax=False). norm_topk_prob=False: softmax(all) -> top-k, no renorm
            # == megatron pre_softmax=True.
            moe_router_pre_softmax=not bool(_cfg(hf_config, "norm_topk_prob", True)),
        )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def build_gpt_model(
    hf_config: Any,
    tp: Optional[int] = None,
    ep: Optional[int] = None,
    sp: Optional[bool] = None,
    dispatcher: str = "alltoall",
    dtype: torch.dtype = torch.float32,
    *,
    etp: Optional[int] = None,
    padded_vocab_size: Optional[int] = None,
    **config_overrides: Any,
):
    """An eval-mode megatron ``GPTModel`` (local spec) shaped like the HF Qwen3 / Qwen3-MoE config.

    Local spec (torch RMSNorm, ColumnParallel/RowParallelLinear, DotProductAttention, SequentialMLP
    experts), SwiGLU, QK-norm, GQA, RoPE (rotate-half) with HF's base and partial factor, no biases.
    Weights are uninitialised: load them with ``tic_trace.adapters.megatron_weights.load_into``.
    ``tp``/``ep``/``sp``/``etp`` default to what :func:`init_parallel` set up. The vocabulary is the HF
    one unless ``padded_vocab_size`` is given (it must then be used for the weight conversion too).
    Forward: ``model(input_ids[b,s], position_ids[b,s], attention_mask=None)`` -> logits ``[b, s, V/tp]``
    (``runtime_gather_output=True`` gathers the vocab).
    """
    apply_all()
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_local_spec,
    )

    tp = _STATE.get("tp", 1) if tp is None else tp
    ep = _STATE.get("ep", 1) if ep is None else ep
    sp = _STATE.get("sp", False) if sp is None else sp
    etp = _STATE.get("etp") if etp is None else etp
    config = build_transformer_config(
        hf_config, tp=tp, ep=ep, sp=sp, dispatcher=dispatcher, dtype=dtype, etp=etp, **config_overrides
    )
    if config.num_moe_experts:
        # One spec per layer: MoE or dense, following config.moe_layer_freq.
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    else:
        spec = get_gpt_layer_local_spec(qk_layernorm=config.qk_layernorm, normalization="RMSNorm")
    theta, percent = _rope_settings(hf_config)
    vocab = int(_cfg(hf_config, "vocab_size"))
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=padded_vocab_size or vocab,
        max_sequence_length=int(_cfg(hf_config, "max_position_embeddings", 4096)),
        pre_process=True,
        post_process=True,
        parallel_output=True,
        share_embeddings_and_output_weights=bool(_cfg(hf_config, "tie_word_embeddings", False)),
        position_embedding_type="rope",
        rotary_percent=percent,
        rotary_base=theta,
    )
    return model.eval()


def gather_vocab_logits(logits: torch.Tensor, vocab_size: Optional[int] = None) -> torch.Tensor:
    """All-gather vocab-sharded logits ``[b, s, V/tp]`` over the TP group and cut vocab padding."""
    from megatron.core import parallel_state as ps

    group = ps.get_tensor_model_parallel_group()
    if group.size() > 1:
        parts = [torch.empty_like(logits) for _ in range(group.size())]
        dist.all_gather(parts, logits.contiguous(), group=group)
        logits = torch.cat(parts, dim=-1)
    return logits[..., :vocab_size] if vocab_size is not None else logits
