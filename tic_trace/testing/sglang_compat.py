"""Where the CPU harness (sglang_cpu.py) meets SGLang 0.5.15.post1 (slime's pin) instead of 0.5.23. TEST SUPPORT ONLY.

The slime-stack CI lane (scripts/test-slime-stack.sh) runs the harness on 0.5.15.post1's model code; each
function below does what that release's own code does where 0.5.23 moved or renamed it, and 0.5.23's way
where that is installed. Which one runs is decided by what the installed SGLang has, never by a version string.
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import types
from typing import Any, Callable

import torch


def init_parallel(server_args: Any, *, rank: int, tp_size: int, port: int) -> None:
    """Publish ``server_args`` for this process and build its TP groups on gloo, as a scheduler does.

    0.5.23: ``runtime_context.publish`` then ``distributed.bootstrap.init_parallel_runtime``.
    0.5.15.post1 (no ``bootstrap``): ``ModelRunner.__init__``'s ``set_global_server_args_for_scheduler``, then
    what ``ModelRunner.init_torch_distributed`` calls (``model_executor/model_runner.py``, around line 1300):
    ``init_distributed_environment``, ``initialize_model_parallel``, ``initialize_dp_attention``.
    """
    try:
        from sglang.srt.distributed.bootstrap import init_parallel_runtime
    except ImportError:
        _init_parallel_0515(server_args, rank=rank, tp_size=tp_size, port=port)
        return
    from sglang.srt import runtime_context as rc
    rc.publish(server_args, role="scheduler", ranks=rc.SpawnRanks(world_rank=rank, gpu_id=rank))
    init_parallel_runtime(server_args=server_args, device="cpu", dist_port=port)


def _init_parallel_0515(server_args: Any, *, rank: int, tp_size: int, port: int) -> None:
    from sglang.srt.distributed import parallel_state as ps
    from sglang.srt.layers.dp_attention import initialize_dp_attention
    from sglang.srt.server_args import set_global_server_args_for_scheduler

    set_global_server_args_for_scheduler(server_args)
    ps.init_distributed_environment(backend="gloo", world_size=tp_size, rank=rank, local_rank=rank,
                                    distributed_init_method=f"tcp://127.0.0.1:{port}",
                                    timeout=server_args.dist_timeout)
    ps.initialize_model_parallel(tensor_model_parallel_size=tp_size)
    # initialize_dp_attention reads the model config only to size DP attention's gathered buffer (and a hybrid
    # pattern flag); DP attention is off here, so that buffer is never allocated.
    model_config = types.SimpleNamespace(hf_config=types.SimpleNamespace(), hidden_size=1, dtype=torch.float32)
    initialize_dp_attention(server_args=server_args, model_config=model_config)


def clamp_position() -> Callable[[torch.Tensor], torch.Tensor]:
    """``ForwardBatch.init_new``'s decode positions function: ``sglang.kernels.ops.attention.clamp_position``
    (0.5.23); ``forward_batch_info.clamp_position`` (0.5.15.post1: native on the CPU)."""
    try:
        from sglang.kernels.ops.attention.clamp_position import clamp_position as fn
    except ImportError:
        from sglang.srt.model_executor.forward_batch_info import clamp_position as fn
    return fn


def forward_batch(**fields: Any) -> Any:
    """A ``ForwardBatch`` of the fields this release declares: 0.5.15.post1's has none of 0.5.23's scheduler
    hints and CPU copies (``_ONLY_0523``), left out there; any other field it lacks is an error, never dropped."""
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch
    have = {f.name for f in dataclasses.fields(ForwardBatch)}
    dropped = {k: v for k, v in fields.items() if k not in have}
    unsafe = {k for k in dropped if k not in _ONLY_0523}
    if unsafe:
        raise TypeError(f"this SGLang's ForwardBatch has no field(s) {sorted(unsafe)}: the harness needs a case "
                        "for them (tic_trace/testing/sglang_compat.py)")
    return ForwardBatch(**{k: v for k, v in fields.items() if k in have})


#: 0.5.23 ForwardBatch fields that hint the scheduler's state or copy another field to the host
#: (``req_pool_indices_cpu``); 0.5.15.post1's model code and torch-native backend read neither.
_ONLY_0523 = frozenset({"is_extend_in_batch", "contains_last_prefill_chunk", "req_pool_indices_cpu"})


def shared_experts_layout(model: torch.nn.Module) -> contextlib.AbstractContextManager:
    """0.5.23 publishes a model's shared-experts layout in the runtime context around each forward
    (``get_model().override``); 0.5.15.post1 has no such context (its models read their own config)."""
    shared = getattr(model, "shared_experts_config", None)
    if shared is None:
        return contextlib.nullcontext()
    from sglang.srt.runtime_context import get_model
    return get_model().override(shared_experts=shared)


def take_request_row(pool: Any) -> int:
    """One free row of the ``ReqToTokenPool``: ``alloc_rows(1)`` (0.5.23); 0.5.15.post1's ``alloc(reqs)`` binds
    rows to request objects, here one holding only the ``req_pool_idx`` it sets (a new request: no row yet)."""
    if hasattr(pool, "alloc_rows"):
        rows = pool.alloc_rows(1)
    else:
        rows = pool.alloc([types.SimpleNamespace(req_pool_idx=None)])
    if not rows:
        raise RuntimeError("req_to_token_pool is full")
    return rows[0]


def free_request_row(pool: Any, row: int) -> None:
    """Give a row back: ``free_rows`` (0.5.23), ``free(req)`` (0.5.15.post1)."""
    if hasattr(pool, "free_rows"):
        pool.free_rows([row])
    else:
        pool.free(types.SimpleNamespace(req_pool_idx=row))


def forward_context(attn_backend: Any, fb: Any) -> contextlib.AbstractContextManager:
    """``forward_context(ForwardContext(attn_backend=...), forward_batch=fb)`` (0.5.23); 0.5.15.post1's
    ``forward_context`` takes the context alone (its layers read the batch from their arguments)."""
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context as enter
    ctx = ForwardContext(attn_backend=attn_backend)
    if "forward_batch" in inspect.signature(enter).parameters:
        return enter(ctx, forward_batch=fb)
    return enter(ctx)
