"""Run real SGLang 0.5.23 model classes on CPU, as a small rollout engine.

Test support only: product code never imports this module.

What is real here (SGLang's own code, unchanged):
  * the model classes (``Qwen3ForCausalLM``, ``Qwen3MoeForCausalLM``, ...), built
    from a transformers config exactly as SGLang's model loader builds them;
  * weight loading: the HF checkpoint (``save_pretrained`` output, i.e. the
    on-disk names ``q_proj``/``k_proj``/``v_proj``, ``gate_proj``/``up_proj``,
    ``experts.{e}.*``) is streamed through SGLang's ``safetensors_weights_iterator``
    into ``DefaultModelLoader.load_weights_and_postprocess`` -> ``model.load_weights``,
    so the qkv/gate_up fusion, TP sharding and expert stacking are SGLang's;
  * tensor parallelism: SGLang's ``parallel_state`` groups over gloo;
  * the KV cache: SGLang's ``ReqToTokenPool``, ``MHATokenToKVPool`` and
    ``TokenToKVPoolAllocator``;
  * attention: SGLang's ``TorchNativeAttnBackend`` (per-request SDPA reading
    K/V back from the pools through ``req_to_token``);
  * ``ForwardBatch`` fields are filled the way ``ForwardBatch.init_new`` fills
    them (positions from SGLang's ``compute_position`` / ``clamp_position``,
    ``extend_logprob_start_lens`` from the scheduler's
    ``compute_extend_logprob_start_len``), and each forward runs the way
    ``EagerRunner._execute_extend/_execute_decode`` run it:
    ``attn_backend.init_forward_metadata(fb)`` then
    ``model.forward(fb.input_ids, fb.positions, fb)`` inside a
    ``forward_context(ForwardContext(attn_backend=...), forward_batch=fb)``.

What is *not* SGLang: the scheduler. ``SGLangRollout`` is a tiny stand-in for
it (no radix cache, no overlap, no CUDA graphs, greedy or forced sampling),
which mirrors the scheduler's choices for what it does cover: which rows an
EXTEND computes, chunked prefill order, input-logprob token ids.

NOTE for module-hook users: like SGLang's ModelRunner, the engine calls
``model.forward(...)`` directly, not ``model(...)``, so hooks registered on the
*root* module never fire; hooks on every submodule do.

Numerics are SGLang's native (``forward_native``) CPU paths, not the GPU
kernels (FlashInfer / FA3 / triton fused MoE / fused add-RMSNorm in place).
Use this to test naming, row identity, sharding and alignment logic.

Shims (each is a function below with the upstream file/function it bypasses):
  * ``_shim_stub_vllm_custom_ops``       (installed by ``install_cpu_shims``)
  * ``_shim_gloo_groups_without_pynccl`` (installed by ``install_cpu_shims``)
  * ``_shim_rope_without_cpu_engine``    (installed by ``install_cpu_shims``)
  * ``disable_torch_compile``            (opt-in, for spawned TP>1 workers: speed only)
plus one setting, not a patch: ``SGLANG_CPU_OMP_THREADS_BIND`` gets one entry per
rank (see ``init_sglang_distributed``). No ``SGLANG_USE_CPU_ENGINE``: that path needs
the CPU sgl-kernel build.

Light packages SGLang's import graph needs beyond torch/transformers are pinned in
``requirements/sglang-light.txt``.
"""

from __future__ import annotations

from tic_trace.testing import sglang_compat
from tic_trace.testing.spawn import free_port, spawn_ranks  # noqa: F401 - re-exported for tests

import contextlib
import dataclasses
import glob
import inspect
import os
import socket
import sys
import tempfile
import types
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import torch

SGLANG_VERSION = "0.5.23"

__all__ = [
    "SGLANG_VERSION",
    "install_cpu_shims",
    "free_port",
    "init_sglang_distributed",
    "destroy_sglang_distributed",
    "disable_torch_compile",
    "spawn_ranks",
    "row_rids_of",
    "sglang_model_class",
    "hf_checkpoint_weights",
    "build_sglang_model",
    "Request",
    "ForwardRecord",
    "RolloutResult",
    "SGLangRollout",
]


# --------------------------------------------------------------------------------------
# CPU shims
# --------------------------------------------------------------------------------------

_SHIMS_INSTALLED = False
_ENV_BEFORE: Dict[str, Optional[str]] = {}


def _shim_stub_vllm_custom_ops() -> None:
    """Provide an importable ``vllm._custom_ops`` module.

    Bypasses: ``sglang/srt/layers/rotary_embedding/base.py`` ``RotaryEmbedding.__init__``
    (0.5.23). On a platform that is neither CUDA/HIP/NPU nor the CPU engine it does
    ``from vllm._custom_ops import rotary_embedding`` as its fallback kernel, which
    assumes vLLM's CUDA wheel is installed. Our path is ``forward_native`` (pure torch),
    which never calls that kernel, so the stub raises if anything ever does.
    """
    if "vllm._custom_ops" in sys.modules:
        return
    try:  # a real vllm install (unlikely on CPU CI) wins
        import vllm._custom_ops  # noqa: F401

        return
    except Exception:
        pass

    def _not_on_cpu(*args, **kwargs):
        raise RuntimeError(
            "tic_trace.testing.sglang_cpu: vllm._custom_ops is a stub; the CPU path must "
            "use forward_native"
        )

    vllm = sys.modules.get("vllm") or types.ModuleType("vllm")
    ops = types.ModuleType("vllm._custom_ops")
    ops.rotary_embedding = _not_on_cpu
    ops.batched_rotary_embedding = _not_on_cpu
    vllm._custom_ops = ops
    sys.modules.setdefault("vllm", vllm)
    sys.modules["vllm._custom_ops"] = ops


def _shim_gloo_groups_without_pynccl() -> None:
    """Force ``use_pynccl=False`` (and no custom all-reduce) when SGLang builds groups.

    Bypasses: ``sglang/srt/distributed/parallel_state.py`` ``init_model_parallel_group``
    (0.5.23), which defaults ``use_pynccl`` to True on every non-NPU/XPU platform;
    ``GroupCoordinator.__init__`` then builds a ``PyNcclCommunicator``, which calls
    ``torch.cuda.device(...)`` and loads libnccl: a CUDA assumption. With gloo the
    group's collectives fall back to ``torch.distributed`` (gloo), as on CPU.
    """
    from sglang.srt.distributed import parallel_state as ps

    original = ps.init_model_parallel_group
    if getattr(original, "_tic_trace_shim", False):
        return

    # Every device communicator off, under the name this release gives it (0.5.15.post1: use_mscclpp_allreduce).
    accepted = inspect.signature(original).parameters
    off = {k: False for k in ("use_pynccl", "use_custom_allreduce", "use_mscclpp", "use_mscclpp_allreduce",
                              "use_torch_symm_mem_allreduce") if k in accepted}

    def init_model_parallel_group(*args, **kwargs):
        kwargs.update(off)
        return original(*args, **kwargs)

    init_model_parallel_group._tic_trace_shim = True
    init_model_parallel_group.__wrapped__ = original
    ps.init_model_parallel_group = init_model_parallel_group


def _shim_rope_without_cpu_engine() -> None:
    """Build RoPE on the CPU the way every other platform builds it (``get_rope``).

    Bypasses: ``sglang/srt/layers/rotary_embedding/factory.py`` ``get_rope_wrapper`` (0.5.23), which sends
    ``device == "cpu"`` (``deepseek_v2.py``'s MLA passes ``get_device().device``) to ``get_rope_cpu``: the
    sgl-kernel CPU engine's RoPE, which asserts a ``deepseek_yarn`` ``rope_scaling`` ("Only deepseek_yarn is
    supported for CPU for now") because that engine's fused kernel knows no other. Without a scaling, this
    builds the plain RoPE ``get_rope`` builds on GPU (run through ``forward_native`` here); a YaRN scaling still
    goes to the CPU factory, which handles it.
    """
    from sglang.srt.layers.rotary_embedding import factory

    original = factory.get_rope_cpu
    if getattr(original, "_tic_trace_shim", False):
        return

    def get_rope_cpu(head_size, rotary_dim, max_position, base, is_neox_style=True, rope_scaling=None,
                     dtype=None, partial_rotary_factor=1.0, device=None):
        if rope_scaling is not None:        # the case the CPU factory handles (its DeepSeek YaRN): unchanged
            return original(head_size, rotary_dim, max_position, base, is_neox_style, rope_scaling, dtype,
                            partial_rotary_factor, device)
        return factory.get_rope(head_size, rotary_dim, max_position, base, is_neox_style, rope_scaling,
                                dtype, partial_rotary_factor)

    get_rope_cpu._tic_trace_shim = True
    get_rope_cpu.__wrapped__ = original
    factory.get_rope_cpu = get_rope_cpu


def disable_torch_compile() -> None:
    """Make SGLang's ``@torch.compile``-decorated helpers run eagerly in this process.

    Bypasses: ``sglang/srt/layers/vocab_parallel_embedding.py``
    ``get_masked_input_and_mask`` (0.5.23), decorated
    ``@torch.compile(dynamic=True, backend=get_compiler_backend())``. With TP>1,
    ``VocabParallelEmbedding.forward`` calls it on the first forward, and inductor
    builds a C++ kernel: 15-20 s on 2 cores with a cold ``/tmp/torchinductor_$USER``
    cache (an assumption that compile time is amortised over a long-lived GPU server).
    It only masks/offsets integer token ids, so eager gives identical results.
    Process-global (``torch._dynamo.config.disable``): meant for spawned TP workers,
    not for a shared pytest process. Not part of ``install_cpu_shims``.
    """
    import torch._dynamo

    torch._dynamo.config.disable = True


def install_cpu_shims() -> None:
    """Install every shim (idempotent). Call before importing SGLang model modules."""
    global _SHIMS_INSTALLED
    if _SHIMS_INSTALLED:
        return
    if os.environ.get("SGLANG_USE_CPU_ENGINE") == "1":
        raise RuntimeError(
            "SGLANG_USE_CPU_ENGINE=1 selects the sgl-kernel CPU build; this harness runs "
            "SGLang's forward_native paths instead. Unset it."
        )
    _shim_stub_vllm_custom_ops()
    _shim_gloo_groups_without_pynccl()
    _shim_rope_without_cpu_engine()
    _SHIMS_INSTALLED = True


# --------------------------------------------------------------------------------------
# Distributed setup (TP over gloo)
# --------------------------------------------------------------------------------------


def init_sglang_distributed(
    tp_size: int = 1,
    rank: int = 0,
    port: Optional[int] = None,
    **server_args_overrides: Any,
):
    """Publish SGLang server args for this process and build its TP groups on gloo.

    Does what a scheduler process does at start-up, with SGLang's own functions:
    ``runtime_context.publish(server_args, role="scheduler", ranks=SpawnRanks(...))``
    then ``distributed.bootstrap.init_parallel_runtime`` (gloo for device "cpu",
    ``init_distributed_environment`` + ``initialize_model_parallel`` +
    ``initialize_dp_attention``). Every rank of a TP group calls this with the same
    ``tp_size`` and ``port``. Returns the ``ServerArgs``.
    """
    install_cpu_shims()
    from sglang.srt.server_args import ServerArgs

    if torch.distributed.is_initialized():
        # SGLang's init_distributed_environment would silently adopt it.
        raise RuntimeError(
            "a torch.distributed process group already exists; destroy it first "
            "(destroy_sglang_distributed / the other harness's teardown)"
        )

    if port is None:
        if tp_size != 1:
            raise ValueError("TP>1 needs an explicit port shared by all ranks")
        port = free_port()
    kwargs = dict(
        # "dummy" is ServerArgs' own model-less short circuit
        # (arg_groups/pipeline.py run_resolution_pipeline): no config download, no
        # model-dependent resolution. Any other name is resolved on the HF hub.
        model_path="dummy",
        device="cpu",
        host="127.0.0.1",
        attention_backend="torch_native",
        sampling_backend="pytorch",
        tp_size=tp_size,
        disable_cuda_graph=True,
        disable_radix_cache=True,
        disable_overlap_schedule=True,
        disable_custom_all_reduce=True,
    )
    kwargs.update(server_args_overrides)
    # bootstrap._bind_threads_if_cpu -> numa_utils.init_threads_binding asserts
    # "one rank per NUMA node" unless this is set. The value is only consumed by the
    # sgl-kernel CPU engine (AMX/arm64 thread pinning), which is not used here, so any
    # per-rank entry works; give each rank one core id. (An inherited value with too
    # few entries, e.g. from a TP=1 parent of spawned TP=2 workers, is replaced.)
    bind = os.environ.get("SGLANG_CPU_OMP_THREADS_BIND")
    _ENV_BEFORE.setdefault("SGLANG_CPU_OMP_THREADS_BIND", bind)
    if bind is None or bind == "all" or len(bind.split("|")) < tp_size:
        ncpu = os.cpu_count() or 1
        os.environ["SGLANG_CPU_OMP_THREADS_BIND"] = "|".join(
            str(i % ncpu) for i in range(tp_size)
        )
    server_args = ServerArgs(**kwargs)
    sglang_compat.init_parallel(server_args, rank=rank, tp_size=tp_size, port=port)   # 0.5.23 or 0.5.15.post1
    return server_args


def destroy_sglang_distributed() -> None:
    """Tear down SGLang's groups and the default process group; restore env vars."""
    from sglang.srt.distributed import parallel_state as ps

    try:
        ps.destroy_model_parallel()
    finally:
        ps.destroy_distributed_environment()
        for k, v in _ENV_BEFORE.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        _ENV_BEFORE.clear()


# --------------------------------------------------------------------------------------
# Model construction + real weight loading
# --------------------------------------------------------------------------------------


#: SGLang model module (``sglang/srt/models/<module>.py``) of each class the tests build.
_SGLANG_MODULE_OF_CLASS = {
    "Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3_moe", "Qwen2ForCausalLM": "qwen2",
    "Qwen2MoeForCausalLM": "qwen2_moe", "LlamaForCausalLM": "llama", "Phi3ForCausalLM": "llama",
    "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3_causal", "GptOssForCausalLM": "gpt_oss",
    "Glm4MoeForCausalLM": "glm4_moe", "DeepseekV2ForCausalLM": "deepseek_v2", "DeepseekV3ForCausalLM": "deepseek_v2",
    "MixtralForCausalLM": "mixtral", "OlmoeForCausalLM": "olmoe",
}


def sglang_model_class(hf_config) -> type:
    """The SGLang class for a transformers config (by ``architectures`` or model_type)."""
    install_cpu_shims()
    arch = (getattr(hf_config, "architectures", None) or [None])[0]
    model_type = getattr(hf_config, "model_type", None)
    if arch in (None, ""):
        arch = {
            "qwen3": "Qwen3ForCausalLM",
            "qwen3_moe": "Qwen3MoeForCausalLM",
            "qwen2": "Qwen2ForCausalLM",
            "qwen2_moe": "Qwen2MoeForCausalLM",
            "llama": "LlamaForCausalLM",
            "phi3": "Phi3ForCausalLM",
            "gemma2": "Gemma2ForCausalLM",
            "gemma3_text": "Gemma3ForCausalLM",
            "gpt_oss": "GptOssForCausalLM",
            "glm4_moe": "Glm4MoeForCausalLM",
            "deepseek_v3": "DeepseekV3ForCausalLM",
            "mixtral": "MixtralForCausalLM",
            "olmoe": "OlmoeForCausalLM",
        }.get(model_type)
    module = _SGLANG_MODULE_OF_CLASS.get(arch)
    if module is None:
        raise ValueError(f"no SGLang class wired for architecture={arch!r} model_type={model_type!r}")
    import importlib

    cls = getattr(importlib.import_module(f"sglang.srt.models.{module}"), arch)
    return cls


@contextlib.contextmanager
def _hf_checkpoint_dir(hf_model_or_dir) -> Iterator[str]:
    if isinstance(hf_model_or_dir, (str, os.PathLike)):
        yield os.fspath(hf_model_or_dir)
        return
    with tempfile.TemporaryDirectory(prefix="tic-trace-hf-ckpt-") as d:
        # save_pretrained writes the *checkpoint* layout (transformers 5 keeps fused
        # expert tensors in memory but reverts them to experts.{e}.{gate,up,down}_proj
        # on save), which is the layout SGLang's load_weights expects.
        # transformers' save_pretrained writes only on torch.distributed rank 0
        # (PreTrainedModel.should_save_on_this_rank); every TP rank here needs its own
        # private copy, so let this instance write on any rank.
        model = hf_model_or_dir
        had_attr = "should_save_on_this_rank" in vars(model)
        model.should_save_on_this_rank = lambda is_main_process=True: True
        try:
            model.save_pretrained(d, safe_serialization=True)
        finally:
            if not had_attr:
                del model.should_save_on_this_rank
        yield d


def hf_checkpoint_weights(hf_model_or_dir) -> List[Tuple[str, torch.Tensor]]:
    """``(name, tensor)`` pairs of an HF model in its on-disk checkpoint layout.

    Read with SGLang's own ``safetensors_weights_iterator``. Do NOT feed
    ``hf_model.state_dict()`` to SGLang with transformers>=5: MoE experts are fused
    there (``mlp.experts.gate_up_proj``), and Qwen3-MoE's ``load_weights`` silently
    skips names it does not know, leaving the experts uninitialised.
    """
    from sglang.srt.model_loader.weight_utils import safetensors_weights_iterator

    with _hf_checkpoint_dir(hf_model_or_dir) as d:
        files = sorted(glob.glob(os.path.join(d, "*.safetensors")))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {d}")
        return [(n, t.clone()) for n, t in safetensors_weights_iterator(files)]


def build_sglang_model(
    hf_config,
    weights: Union[Iterable[Tuple[str, torch.Tensor]], Any],
    *,
    dtype: Optional[torch.dtype] = None,
    strict: bool = True,
) -> torch.nn.Module:
    """Build the SGLang model for ``hf_config`` and load ``weights`` through SGLang.

    ``weights``: an HF model (saved to a temp checkpoint first), a checkpoint
    directory, or an iterable of checkpoint-named ``(name, tensor)`` pairs.
    Distributed state must be initialised (``init_sglang_distributed``).

    ``strict``: every parameter is pre-filled with NaN and must be overwritten by
    the load; a parameter SGLang's loader skipped raises instead of silently
    carrying garbage.
    """
    install_cpu_shims()
    from sglang.srt.model_loader.loader import DefaultModelLoader
    from sglang.srt.model_loader.utils import set_default_torch_dtype

    if dtype is None:
        dtype = getattr(hf_config, "torch_dtype", None) or getattr(hf_config, "dtype", None)
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        dtype = dtype or torch.float32
    if isinstance(weights, (str, os.PathLike)) or hasattr(weights, "save_pretrained"):
        weights = hf_checkpoint_weights(weights)

    cls = sglang_model_class(hf_config)
    device = torch.device("cpu")
    with set_default_torch_dtype(dtype), device:
        model = cls(hf_config)
    if strict:
        with torch.no_grad():
            for p in model.parameters():
                if p.is_floating_point():
                    p.fill_(float("nan"))
    DefaultModelLoader.load_weights_and_postprocess(model, iter(weights), device)
    if strict:
        missing = [
            n for n, p in model.named_parameters() if p.is_floating_point() and torch.isnan(p).any()
        ]
        if missing:
            raise RuntimeError(f"SGLang load_weights left parameters unloaded: {missing}")
    return model.eval()


# --------------------------------------------------------------------------------------
# Rollout engine
# --------------------------------------------------------------------------------------


def _kv_pool(config, attns: list, size: int, dtype: torch.dtype, device: str):
    """The KV pool SGLang's ModelRunner builds for the model: ``MLATokenToKVPool`` (one latent + k_pe row per
    token and layer) for multi-latent attention (``kv_lora_rank`` in the config), else ``MHATokenToKVPool``.
    MLA layers hold two RadixAttentions (``attn_mha``, ``attn_mqa``) of one layer id: layers are counted by id."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool

    a0, layers = attns[0], len({a.layer_id for a in attns})
    if getattr(config, "kv_lora_rank", None):
        return MLATokenToKVPool(size=size, page_size=1, dtype=dtype, kv_lora_rank=int(config.kv_lora_rank),
                                qk_rope_head_dim=int(config.qk_rope_head_dim), layer_num=layers, device=device,
                                enable_memory_saver=False, start_layer=a0.layer_id)
    return MHATokenToKVPool(size=size, page_size=1, dtype=dtype, head_num=a0.tp_k_head_num,
                            head_dim=a0.qk_head_dim, v_head_dim=a0.v_head_dim, layer_num=layers, device=device,
                            enable_memory_saver=False, start_layer=a0.layer_id, enable_alt_stream=False)


@dataclasses.dataclass
class Request:
    """One request's state in the stand-in scheduler."""

    rid: str
    prompt: List[int]
    output: List[int] = dataclasses.field(default_factory=list)
    req_pool_idx: Optional[int] = None
    kv_len: int = 0  # tokens whose K/V are in the pool (= prefix len of the next pass)
    logprob_start_len: int = -1  # SGLang semantics: -1 = output tokens only

    @property
    def fill_ids(self) -> List[int]:
        return self.prompt + self.output

    @property
    def prefill_done(self) -> bool:
        return self.kv_len >= len(self.prompt)


@dataclasses.dataclass
class ForwardRecord:
    """Everything a test / tracer needs about one ``model.forward`` call."""

    index: int  # forward-call counter in this engine (0-based)
    forward_mode: Any  # sglang ForwardMode (EXTEND or DECODE)
    forward_batch: Any  # the sglang ForwardBatch passed to model.forward
    rids: List[str]  # one per request in the batch, batch order
    input_ids: torch.Tensor  # [T] token id of each row
    positions: torch.Tensor  # [T] absolute position of each row
    seq_lens: List[int]  # per request: kv length after this pass
    extend_prefix_lens: Optional[List[int]]  # EXTEND: per request, tokens already cached
    extend_seq_lens: Optional[List[int]]  # EXTEND: per request, rows computed now
    sampling_rids: List[str]  # requests whose next_token_logits row is a real next-token
    logits_output: Any  # sglang LogitsProcessorOutput, as returned
    next_token_logits: torch.Tensor  # [bs, V] clone of logits_output.next_token_logits
    prompt_logits: Optional[torch.Tensor] = None  # [T, V] when capture_prompt_logits

    @property
    def is_extend(self) -> bool:
        return self.forward_mode.is_extend()

    @property
    def is_decode(self) -> bool:
        return self.forward_mode.is_decode()

    @property
    def row_rids(self) -> List[str]:
        """rid of every row of this pass's token axis."""
        return row_rids_of(self.forward_batch)

    @property
    def row_keys(self) -> List[Tuple[str, int]]:
        """``(rid, position)`` of every row, in row order."""
        return list(zip(self.row_rids, self.positions.tolist()))

    def last_logits(self, rid: str) -> torch.Tensor:
        return self.next_token_logits[self.rids.index(rid)]


def row_rids_of(forward_batch) -> List[str]:
    """rid of each row of a ForwardBatch's token axis (EXTEND/MIXED or DECODE).

    EXTEND: request i owns rows ``[extend_start_loc[i], +extend_seq_lens_cpu[i])``,
    concatenated in batch order. DECODE: row i is request i. Only the first
    ``batch_size`` requests are real (graph padding adds none here).
    """
    mode = forward_batch.forward_mode
    rids = list(forward_batch.rids)
    if mode.is_decode():
        return rids[: forward_batch.batch_size]
    if mode.is_extend():
        out: List[str] = []
        for rid, n in zip(rids, forward_batch.extend_seq_lens_cpu):
            out.extend([rid] * int(n))
        return out
    if mode.is_idle():
        return []
    raise ValueError(f"unsupported forward mode {mode}")


@dataclasses.dataclass
class RolloutResult:
    records: List[ForwardRecord]
    outputs: Dict[str, List[int]]  # rid -> generated tokens
    prompts: Dict[str, List[int]]

    def sequence(self, rid: str) -> List[int]:
        return self.prompts[rid] + self.outputs[rid]

    def next_token_logits_by_position(self) -> Dict[Tuple[str, int], torch.Tensor]:
        """``(rid, position)`` -> logits predicting the token at ``position + 1``.

        Collected from every forward's sampling rows (the last row of a finished
        prefill, every decode row).
        """
        out: Dict[Tuple[str, int], torch.Tensor] = {}
        for rec in self.records:
            last_pos: Dict[str, int] = {}
            for rid, pos in rec.row_keys:
                last_pos[rid] = pos
            for i, rid in enumerate(rec.rids):
                if rid in rec.sampling_rids:
                    out[(rid, last_pos[rid])] = rec.next_token_logits[i]
        return out


ForwardCallback = Callable[[Any], None]


class SGLangRollout:
    """A minimal SGLang "scheduler + model runner" over the real pools and backend.

    Usage::

        eng = SGLangRollout(model)
        res = eng.generate({"r0": [3, 5, 7], "r1": [2, 4]}, num_decode_steps=4)
        for rec in res.records: rec.row_keys, rec.next_token_logits, rec.forward_batch

    ``before_forward`` / ``after_forward`` callbacks receive the ForwardBatch and the
    ForwardRecord; a tracer can use them as its per-pass ``step()``.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        max_requests: int = 16,
        max_context_len: int = 512,
        kv_cache_tokens: int = 4096,
        kv_cache_dtype: Optional[torch.dtype] = None,
        before_forward: Sequence[ForwardCallback] = (),
        after_forward: Sequence[ForwardCallback] = (),
        attn_backend_cls: Optional[type] = None,
    ):
        """``attn_backend_cls``: a subclass of SGLang's ``TorchNativeAttnBackend`` to run instead of it
        (e.g. ``sglang_attention.SoftcapSinkAttnBackend`` for soft-capped or sink attention)."""
        install_cpu_shims()
        from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
        from sglang.srt.layers.radix_attention import RadixAttention
        from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
        from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

        self.model = model
        self.device = "cpu"
        attns = sorted(
            (m for m in model.modules() if isinstance(m, RadixAttention)), key=lambda a: a.layer_id
        )
        if not attns:
            raise ValueError("model has no RadixAttention layers")
        a0 = attns[0]
        if kv_cache_dtype is None:
            kv_cache_dtype = next(model.parameters()).dtype
        self.req_to_token_pool = ReqToTokenPool(
            size=max_requests,
            max_context_len=max_context_len,
            device=self.device,
            enable_memory_saver=False,
        )
        self.token_to_kv_pool = _kv_pool(model.config, attns, kv_cache_tokens, kv_cache_dtype, self.device)
        self.token_to_kv_pool_allocator = TokenToKVPoolAllocator(
            size=kv_cache_tokens,
            dtype=kv_cache_dtype,
            device=self.device,
            kvcache=self.token_to_kv_pool,
            need_sort=False,
        )
        # TorchNativeAttnBackend only reads .device and the two pools off the runner.
        runner_view = types.SimpleNamespace(
            device=self.device,
            req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool=self.token_to_kv_pool,
        )
        self.attn_backend = (attn_backend_cls or TorchNativeAttnBackend)(runner_view)
        self.vocab_size = int(getattr(model.config, "vocab_size"))
        self.requests: Dict[str, Request] = {}
        self.records: List[ForwardRecord] = []
        self.before_forward: List[ForwardCallback] = list(before_forward)
        self.after_forward: List[ForwardCallback] = list(after_forward)
        self._forward_count = 0

    # ---------------------------------------------------------------- requests

    def add_request(self, rid: str, prompt: Sequence[int], *, logprob_start_len: int = -1) -> Request:
        if rid in self.requests:
            raise ValueError(f"duplicate rid {rid!r}")
        if not prompt:
            raise ValueError("empty prompt")
        slot = sglang_compat.take_request_row(self.req_to_token_pool)
        req = Request(rid=rid, prompt=[int(t) for t in prompt], req_pool_idx=slot,
                      logprob_start_len=logprob_start_len)
        self.requests[rid] = req
        return req

    def release(self, rid: str) -> None:
        req = self.requests.pop(rid)
        if req.kv_len:
            locs = self.req_to_token_pool.req_to_token[req.req_pool_idx, : req.kv_len].to(torch.int64)
            self.token_to_kv_pool_allocator.free(locs)
        sglang_compat.free_request_row(self.req_to_token_pool, req.req_pool_idx)

    def _alloc_kv(self, req: Request, n: int) -> torch.Tensor:
        locs = self.token_to_kv_pool_allocator.alloc(n)
        if locs is None:
            raise RuntimeError("KV pool exhausted")
        self.req_to_token_pool.write(
            (req.req_pool_idx, slice(req.kv_len, req.kv_len + n)), locs.to(torch.int32)
        )
        return locs

    # ---------------------------------------------------------------- forward

    def _run_forward(self, fb, *, sampling_rids: List[str], capture_prompt_logits: bool) -> ForwardRecord:
        for cb in self.before_forward:
            cb(fb)
        layout_ctx = sglang_compat.shared_experts_layout(self.model)
        # == ModelRunner._forward_raw + EagerRunner._execute_{extend,decode} (eager, no graph)
        with torch.no_grad(), layout_ctx, sglang_compat.forward_context(self.attn_backend, fb):
            self.attn_backend.init_forward_metadata(fb)
            out = self.model.forward(fb.input_ids, fb.positions, fb)
            prompt_logits = None
            if capture_prompt_logits:
                prompt_logits = self._logits_of_all_rows(out, fb)
        rec = ForwardRecord(
            index=self._forward_count,
            forward_mode=fb.forward_mode,
            forward_batch=fb,
            rids=list(fb.rids),
            input_ids=fb.input_ids.clone(),
            positions=fb.positions.clone(),
            seq_lens=[int(x) for x in fb.seq_lens.tolist()],
            extend_prefix_lens=list(fb.extend_prefix_lens_cpu) if fb.forward_mode.is_extend() else None,
            extend_seq_lens=list(fb.extend_seq_lens_cpu) if fb.forward_mode.is_extend() else None,
            sampling_rids=list(sampling_rids),
            logits_output=out,
            next_token_logits=out.next_token_logits.detach().clone(),
            prompt_logits=prompt_logits,
        )
        self._forward_count += 1
        self.records.append(rec)
        for cb in self.after_forward:
            cb(rec)
        return rec

    def _logits_of_all_rows(self, out, fb) -> torch.Tensor:
        """Logits of every row, through SGLang's own lm-head path.

        The LogitsProcessor only returns last-row logits (plus input *logprobs* when
        ``return_logprob``); with ``capture_hidden_mode=FULL`` it also returns the final
        normed hidden states of every row, and ``LogitsProcessor._get_logits`` (the
        function it uses itself: lm_head matmul, TP all-gather, vocab cut) turns them
        into logits. Collective under TP: every rank calls it.
        """
        from sglang.srt.layers.logits_processor import LogitsMetadata

        hs = out.hidden_states
        if hs is None:
            raise RuntimeError("capture_hidden_mode=FULL did not return hidden states")
        meta = LogitsMetadata.from_forward_batch(fb)
        logits = self.model.logits_processor._get_logits(
            hs, self.model.lm_head, meta, use_logits_buffer=False
        )
        return logits[:, : self.vocab_size].detach().clone()

    def extend(
        self,
        chunks: Sequence[Tuple[str, int]],
        *,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        capture_prompt_logits: bool = False,
    ) -> ForwardRecord:
        """One EXTEND pass: for each ``(rid, n)``, compute the next ``n`` prompt tokens.

        The request's cached prefix (earlier chunks) is ``extend_prefix_lens``.
        """
        from sglang.srt.managers.schedule_batch import compute_extend_logprob_start_len
        from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode, compute_position

        reqs = [self.requests[rid] for rid, _ in chunks]
        lens = [int(n) for _, n in chunks]
        input_ids: List[int] = []
        prefix_lens, seq_lens, locs, sampling_rids = [], [], [], []
        logprob_starts: List[int] = []
        logprob_token_ids: List[int] = []
        for req, n in zip(reqs, lens):
            if n <= 0 or req.kv_len + n > len(req.prompt):
                raise ValueError(f"bad extend length {n} for {req.rid}")
            ids = req.fill_ids[req.kv_len : req.kv_len + n]
            input_ids.extend(ids)
            prefix_lens.append(req.kv_len)
            seq_lens.append(req.kv_len + n)
            locs.append(self._alloc_kv(req, n))
            if req.kv_len + n == len(req.prompt):
                sampling_rids.append(req.rid)
            start = compute_extend_logprob_start_len(
                logprob_start_len=req.logprob_start_len,
                prefix_len=req.kv_len,
                extend_len=n,
                full_untruncated_fill_len=len(req.fill_ids),
            )
            logprob_starts.append(start)
            if return_logprob:  # == ScheduleBatch.prepare_for_extend
                g0, g1 = req.kv_len, req.kv_len + n
                lp_start = len(req.prompt) if req.logprob_start_len == -1 else req.logprob_start_len
                g0 = max(g0, lp_start)
                tok = req.prompt[g0 + 1 : g1 + 1]
                logprob_token_ids.extend(tok)
                logprob_token_ids.extend([0] * (n - start - len(tok)))
        bs = len(reqs)
        ext = torch.tensor(lens, dtype=torch.int32)
        pre = torch.tensor(prefix_lens, dtype=torch.int32)
        positions, extend_start_loc = compute_position("torch_native", pre, ext, int(ext.sum()))
        seq_lens_t = torch.tensor(seq_lens, dtype=torch.int64)
        fb = sglang_compat.forward_batch(
            forward_mode=ForwardMode.EXTEND,
            batch_size=bs,
            input_ids=torch.tensor(input_ids, dtype=torch.int64),
            req_pool_indices=torch.tensor([r.req_pool_idx for r in reqs], dtype=torch.int64),
            seq_lens=seq_lens_t,
            out_cache_loc=torch.cat(locs).to(torch.int64),
            seq_lens_sum=int(seq_lens_t.sum()),
            seq_lens_cpu=seq_lens_t.clone(),
            orig_seq_lens=seq_lens_t.clone(),
            positions=positions,
            extend_num_tokens=int(ext.sum()),
            extend_seq_lens=ext,
            extend_prefix_lens=pre,
            extend_start_loc=extend_start_loc,
            extend_prefix_lens_cpu=list(prefix_lens),
            extend_seq_lens_cpu=list(lens),
            extend_logprob_start_lens_cpu=logprob_starts,
            return_logprob=return_logprob,
            top_logprobs_nums=[top_logprobs_num] * bs if return_logprob else None,
            token_ids_logprobs=[None] * bs if return_logprob else None,
            extend_input_logprob_token_ids_gpu=(
                torch.tensor(logprob_token_ids, dtype=torch.int64).clamp_(0, self.vocab_size - 1)
                if return_logprob
                else None
            ),
            capture_hidden_mode=CaptureHiddenMode.FULL if capture_prompt_logits else CaptureHiddenMode.NULL,
            rids=[r.rid for r in reqs],
            req_pool_indices_cpu=torch.tensor([r.req_pool_idx for r in reqs], dtype=torch.int64),
            is_extend_in_batch=True,
            contains_last_prefill_chunk=all(r.kv_len + n == len(r.prompt) for r, n in zip(reqs, lens)),
        )
        rec = self._run_forward(fb, sampling_rids=sampling_rids, capture_prompt_logits=capture_prompt_logits)
        for req, n in zip(reqs, lens):
            req.kv_len += n
        return rec

    def decode(self, next_tokens: Dict[str, int]) -> ForwardRecord:
        """One DECODE pass: append ``next_tokens[rid]`` to each request and run it."""
        from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode

        reqs = [self.requests[rid] for rid in next_tokens]
        locs = []
        for req in reqs:
            if not req.prefill_done or req.kv_len != len(req.fill_ids):
                raise RuntimeError(f"{req.rid}: decode before its prefill finished")
            req.output.append(int(next_tokens[req.rid]))
            locs.append(self._alloc_kv(req, 1))
        seq_lens = torch.tensor([r.kv_len + 1 for r in reqs], dtype=torch.int64)
        fb = sglang_compat.forward_batch(
            forward_mode=ForwardMode.DECODE,
            batch_size=len(reqs),
            input_ids=torch.tensor([r.output[-1] for r in reqs], dtype=torch.int64),
            req_pool_indices=torch.tensor([r.req_pool_idx for r in reqs], dtype=torch.int64),
            seq_lens=seq_lens,
            out_cache_loc=torch.cat(locs).to(torch.int64),
            seq_lens_sum=int(seq_lens.sum()),
            seq_lens_cpu=seq_lens.clone(),
            orig_seq_lens=seq_lens.clone(),
            positions=sglang_compat.clamp_position()(seq_lens),  # == ForwardBatch.init_new for decode
            capture_hidden_mode=CaptureHiddenMode.NULL,
            rids=[r.rid for r in reqs],
        )
        rec = self._run_forward(fb, sampling_rids=[r.rid for r in reqs], capture_prompt_logits=False)
        for req in reqs:
            req.kv_len += 1
        return rec

    # ---------------------------------------------------------------- scheduling

    def prefill(
        self,
        rids: Sequence[str],
        *,
        chunked_prefill_size: Optional[int] = None,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        capture_prompt_logits: bool = False,
    ) -> List[ForwardRecord]:
        """Prefill ``rids`` in as few EXTEND passes as the token budget allows.

        ``chunked_prefill_size=None``: one pass with every prompt. Otherwise each pass
        takes at most that many tokens; requests are packed in order and the one that
        does not fit is split (SGLang's chunked prefill: the chunked request goes first
        in the next pass and continues from its cached prefix).
        """
        pending = [r for r in rids if not self.requests[r].prefill_done]
        recs: List[ForwardRecord] = []
        while pending:
            budget = chunked_prefill_size if chunked_prefill_size else float("inf")
            chunks: List[Tuple[str, int]] = []
            for rid in pending:
                if budget <= 0:
                    break
                req = self.requests[rid]
                n = min(len(req.prompt) - req.kv_len, budget)
                chunks.append((rid, int(n)))
                budget -= n
            recs.append(
                self.extend(
                    chunks,
                    return_logprob=return_logprob,
                    top_logprobs_num=top_logprobs_num,
                    capture_prompt_logits=capture_prompt_logits,
                )
            )
            pending = [r for r in pending if not self.requests[r].prefill_done]
        return recs

    def generate(
        self,
        prompts: Union[Dict[str, Sequence[int]], Sequence[Tuple[str, Sequence[int]]]],
        num_decode_steps: int,
        *,
        forced_tokens: Optional[Dict[str, Sequence[int]]] = None,
        chunked_prefill_size: Optional[int] = None,
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
        capture_prompt_logits: bool = False,
        release: bool = True,
    ) -> RolloutResult:
        """Prefill all prompts, then run ``num_decode_steps`` decode passes.

        The token fed to decode step j is ``forced_tokens[rid][j]`` when given, else the
        greedy argmax of the previous pass's logits. ``num_decode_steps`` decode passes
        generate ``num_decode_steps + 1`` tokens (the last one sampled but never fed).
        """
        items = list(prompts.items()) if isinstance(prompts, dict) else list(prompts)
        start = len(self.records)
        for rid, prompt in items:
            self.add_request(rid, prompt, logprob_start_len=logprob_start_len)
        rids = [rid for rid, _ in items]
        self.prefill(
            rids,
            chunked_prefill_size=chunked_prefill_size,
            return_logprob=return_logprob,
            top_logprobs_num=top_logprobs_num,
            capture_prompt_logits=capture_prompt_logits,
        )

        def pick(rid: str, logits: torch.Tensor) -> int:
            req = self.requests[rid]
            j = len(req.output)
            if forced_tokens is not None and rid in forced_tokens and j < len(forced_tokens[rid]):
                return int(forced_tokens[rid][j])
            return int(torch.argmax(logits[: self.vocab_size]).item())

        # sample from the pass that finished each prompt
        last_logits: Dict[str, torch.Tensor] = {}
        for rec in self.records[start:]:
            for rid in rec.sampling_rids:
                last_logits[rid] = rec.last_logits(rid)
        for _ in range(num_decode_steps):
            nxt = {rid: pick(rid, last_logits[rid]) for rid in rids}
            rec = self.decode(nxt)
            for rid in rec.rids:
                last_logits[rid] = rec.last_logits(rid)
        outputs = {}
        for rid in rids:
            req = self.requests[rid]
            outputs[rid] = list(req.output) + [pick(rid, last_logits[rid])]
        result = RolloutResult(
            records=self.records[start:],
            outputs=outputs,
            prompts={rid: list(p) for rid, p in items},
        )
        if release:
            for rid in rids:
                self.release(rid)
        return result
