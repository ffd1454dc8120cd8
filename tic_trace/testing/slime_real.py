"""Drive slime's own code (the vendored snapshot) on CPU: argument parsing, the Megatron train actor and the
rollout's HTTP path. TEST SUPPORT ONLY; call :func:`tic_trace.testing.slime_vendor.activate` first, in a
process of its own.

What is real: slime's ``parse_args`` (with Megatron-LM's parser behind it), ``MegatronTrainRayActor.train``
/ ``train_actor`` / ``compute_log_prob``, ``forward_only`` / ``train`` / ``train_one_step`` on Megatron's
own schedule (``get_forward_backward_func``), ``get_batch`` / ``DataIterator``, the loss and advantage
code, ``TensorBackuper`` (the ref-model weight swap), ``RolloutManager._convert_samples_to_train_data`` /
``_split_train_data_by_dp`` (``build_dp_schedule``), ``generate_and_rm_group`` / ``generate_and_rm`` /
``generate`` / ``http_utils.post`` (httpx, over a real local HTTP socket), Megatron's GPTModel and
optimizer, SGLang's model code.

What is not: the model is built by :mod:`tic_trace.testing.megatron_cpu` from the HF config (slime's
``initialize_model_and_optimizer`` goes through ``get_model`` and a checkpoint load, CUDA only), the
actor's ``init`` (Ray placement, NCCL groups, checkpoint load) is replaced by setting the attributes it
sets (its weight updater is the stub ``slime_vendor.NoWeightUpdater``), and the SGLang server behind the
router URL is :class:`EngineServer` (the CPU harness's engine behind an aiohttp endpoint that answers
``/generate`` the way SGLang's does).
"""
from __future__ import annotations

import asyncio
import dataclasses
import sys
from pathlib import Path

import torch

from tic_trace.testing.slime_vendor import NoWeightUpdater

# ================================================================== checkpoint and arguments


def write_checkpoint(hf_config, directory: str | Path) -> str:
    """A ``--hf-checkpoint`` folder: the HF config and a word-level tokenizer over ``vocab_size`` ids
    (``GenerateState`` loads a tokenizer from it; prompts are given as token ids, never encoded)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    hf_config.save_pretrained(d)
    vocab = {f"t{i}": i for i in range(hf_config.vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", pad_token="t0", eos_token="t1").save_pretrained(d)
    return str(d)


def model_argv(hf_config) -> list[str]:
    """Megatron model flags equal to the tiny Qwen3-MoE config (slime checks them against the HF config)."""
    c = hf_config
    rope = (getattr(c, "rope_parameters", None) or {}).get("rope_theta", getattr(c, "rope_theta", 10000))
    return ["--num-layers", str(c.num_hidden_layers), "--hidden-size", str(c.hidden_size),
            "--num-attention-heads", str(c.num_attention_heads), "--group-query-attention",
            "--num-query-groups", str(c.num_key_value_heads), "--kv-channels", str(c.head_dim),
            "--ffn-hidden-size", str(c.intermediate_size), "--moe-ffn-hidden-size", str(c.moe_intermediate_size),
            "--num-experts", str(c.num_experts), "--moe-router-topk", str(c.num_experts_per_tok),
            "--norm-epsilon", str(c.rms_norm_eps), "--rotary-base", str(int(rope)), "--qk-layernorm",
            "--untie-embeddings-and-output-weights", "--vocab-size", str(c.vocab_size),
            "--seq-length", "64", "--max-position-embeddings", str(c.max_position_embeddings)]


def base_argv(ckpt: str, hf_config) -> list[str]:
    """A slime command line for a one-GPU colocated-style run (no Ray is started: nothing reads the counts
    but the argument validation)."""
    return ["--hf-checkpoint", ckpt, *model_argv(hf_config),
            "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1",
            "--rollout-batch-size", "2", "--n-samples-per-prompt", "1", "--global-batch-size", "2",
            "--micro-batch-size", "1", "--num-rollout", "2", "--lr", "1e-6",
            "--sglang-router-ip", "127.0.0.1", "--sglang-router-port", "1", "--rollout-max-response-len", "4",
            "--rollout-temperature", "1.0", "--data-pad-size-multiplier", "16"]


def parse_args(argv: list[str], add_custom_arguments=None):
    """slime's ``parse_args`` on ``argv`` (it reads ``sys.argv`` itself, as in ``train.py``)."""
    from slime.utils.arguments import parse_args as slime_parse_args
    saved = sys.argv
    sys.argv = ["train.py", *argv]
    try:
        return slime_parse_args(add_custom_arguments=add_custom_arguments)
    finally:
        sys.argv = saved


# ================================================================== CPU runtime for slime's Megatron side


def install_cpu_accelerator() -> None:
    """slime's device calls (``slime.utils.accelerator``: ``device()``, ``current_device()``,
    ``synchronize()``) go through a pluggable backend; registered are cuda and musa. This one is the CPU."""
    from slime.utils import accelerator
    from slime.utils.accelerator.torch_accelerator import TorchAccelerator

    class CpuAccelerator(TorchAccelerator):
        name, device_type, communication_backend_name = "cpu", "cpu", "gloo"

        def _module(self):
            return torch.cpu

        def device_name(self, index=None) -> str:
            return "cpu"

        def current_device(self):
            return "cpu"

        def set_device(self, index) -> None:
            return None

        def synchronize(self, device=None) -> None:
            return None

        def empty_cache(self) -> None:
            return None

        def memory_allocated(self, device=None) -> int:
            return 0

        def memory_reserved(self, device=None) -> int:
            return 0

        def mem_get_info(self, device=None) -> tuple[int, int]:
            return 0, 0

    accelerator.set_accelerator(CpuAccelerator())


class _CudaFactoriesOnCpu(torch.overrides.TorchFunctionMode):
    """Tensor factories asked for ``device='cuda'`` or ``pin_memory=True`` build plain CPU tensors."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "cpu"
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        return func(*args, **kwargs)


def install_cpu_shims() -> None:
    """CUDA-only allocations on the actor's path, each function run under :class:`_CudaFactoriesOnCpu`:
    ``slime/utils/tensor_backper.py:61`` (``_TensorBackuperNormal.backup``: ``torch.empty_like(...,
    pin_memory=True)``, pinned memory needs CUDA), Megatron-LM ``megatron/core/optimizer/optimizer.py:907``
    (``FP32Optimizer.__init__``: ``torch.tensor([1.0], device='cuda')``), ``optimizer.py:1314``
    (``ChainedOptimizer.step`` -> ``clip_grads.py:103`` ``get_grad_norm_fp32``: ``torch.zeros(1, device='cuda')``) and
    ``megatron/core/pipeline_parallel/schedules.py:599`` (``forward_backward_no_pipelining``:
    ``torch.zeros([], dtype=torch.int, device="cuda")``; ``get_forward_backward_func`` returns the module
    attribute, so the schedule slime calls is this wrapper around the real one)."""
    from megatron.core.optimizer import optimizer as mopt
    from megatron.core.pipeline_parallel import schedules
    from slime.utils import tensor_backper

    for owner, name in ((tensor_backper._TensorBackuperNormal, "backup"), (mopt.FP32Optimizer, "__init__"),
                        (mopt.ChainedOptimizer, "step"),
                        (schedules, "forward_backward_no_pipelining")):
        orig = vars(owner)[name]
        if getattr(orig, "_tic_trace_cpu", False):
            continue

        def on_cpu(*a, _orig=orig, **kw):
            with _CudaFactoriesOnCpu():
                return _orig(*a, **kw)
        on_cpu._tic_trace_cpu = True
        setattr(owner, name, on_cpu)


# ================================================================== the train actor


def model_chunks(hf_model) -> list:
    """``[DDP(GPTModel)]`` with ``role = "actor"``, as ``initialize_model_and_optimizer`` returns them (the
    GPTModel built from the HF config with the HF weights; THD attention per segment on CPU)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from tic_trace.adapters.megatron_weights import hf_to_megatron_state_dict, load_into
    from tic_trace.testing import megatron_cpu as mc
    gpt = mc.build_gpt_model(hf_model.config)
    load_into(gpt, hf_to_megatron_state_dict(hf_model.state_dict(), hf_model.config))
    mc.per_segment_thd_attention(gpt)
    chunk = DistributedDataParallel(gpt.config, DistributedDataParallelConfig(), gpt)
    chunk.role = "actor"
    return [chunk]


def optimizer_and_scheduler(args, model):
    """slime's ``setup_model_and_optimizer`` optimizer part (OptimizerConfig from ``args``) with fp32 params,
    no distributed optimizer and no gradient clipping (its multi-tensor norm is CUDA only)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from slime.backends.megatron_utils.model import get_optimizer_param_scheduler

    kw = {f.name: getattr(args, f.name) for f in dataclasses.fields(OptimizerConfig) if hasattr(args, f.name)}
    kw.update(bf16=False, fp16=False, use_distributed_optimizer=False, clip_grad=0.0)
    config = OptimizerConfig(**kw)
    config.timers = None
    optimizer = get_megatron_optimizer(config=config, model_chunks=model, use_gloo_process_groups=False)
    return optimizer, get_optimizer_param_scheduler(args, optimizer)


def train_actor(args, model, *, with_ref: bool):
    """A ``MegatronTrainRayActor`` in the state ``init`` leaves it in (``init`` itself needs Ray and CUDA):
    model chunks, optimizer, scheduler, the weight backuper with ``"actor"`` (and ``"ref"``, a copy of the
    same weights, as ``load_other_checkpoint("ref", ...)`` would leave) backed up."""
    from slime.backends.megatron_utils.actor import MegatronTrainRayActor
    from slime.backends.megatron_utils.update_weight.common import named_params_and_buffers
    from slime.observability.profile_utils import TrainProfiler
    from slime.utils.tensor_backper import TensorBackuper

    actor = MegatronTrainRayActor.__new__(MegatronTrainRayActor)
    actor.args, actor.role, actor.model = args, "actor", model
    actor.optimizer, actor.opt_param_scheduler = optimizer_and_scheduler(args, model)
    actor.prof = TrainProfiler(args)
    actor.weights_backuper = TensorBackuper.create(
        source_getter=lambda: named_params_and_buffers(args, model, convert_to_global_name=True), single_tag=None)
    actor._active_model_tag = "actor"
    actor.weights_backuper.backup("actor")
    if with_ref:
        actor.weights_backuper.backup("ref")
    actor.rollout_data_postprocess = None
    actor.weight_updater = NoWeightUpdater()
    actor.rollout_engines = None
    from slime.observability.timer import Timer
    Timer().start("train_wait")            # init's @with_defer(lambda: Timer().start("train_wait"))
    return actor


def rollout_manager(args):
    """A ``RolloutManager`` with only what ``_convert_samples_to_train_data`` and ``_split_train_data_by_dp``
    read (its ``__init__`` starts the SGLang engines and the router)."""
    from slime.ray.rollout import RolloutManager
    rm = RolloutManager.__new__(RolloutManager)
    rm.args = args
    rm.custom_reward_post_process_func = None
    rm.custom_convert_samples_to_train_data_func = None
    rm.train_parallel_config = {"dp_size": 1, "cp_size": 1, "vpp_size": 1, "microbatch_group_size_per_vp_stage": 1}
    return rm


def train_data_refs(args, samples) -> list:
    """``RolloutManager.generate``'s tail: samples -> train data -> per-DP-rank boxes (slime's own code)."""
    rm = rollout_manager(args)
    return rm._split_train_data_by_dp(rm._convert_samples_to_train_data(samples))


# ================================================================== the rollout's HTTP side


class EngineServer:
    """An HTTP endpoint at the router address answering ``POST /generate`` as SGLang does (``text``,
    ``meta_info.output_token_logprobs`` as ``[logprob, token, None]``, ``finish_reason``), backed by the CPU
    harness's engine (SGLang's model code). Requests are batched like the scheduler would: once
    ``expected`` of them are waiting, one prefill and the decode steps run for all of them, with the
    request's ``rid`` (or an auto id) as SGLang's request id. Runs on slime's background event loop
    (``slime.utils.async_utils``), where slime's rollout coroutines run."""

    def __init__(self, engine, expected: int):
        self.engine, self.expected = engine, expected
        self.pending: list = []
        self.seen: list[dict] = []
        self.runner = None
        self.port = None

    async def _handle(self, request):
        from aiohttp import web
        payload = await request.json()
        fut = asyncio.get_running_loop().create_future()
        self.seen.append(payload)
        self.pending.append((payload.get("rid") or f"auto-{len(self.seen)}", payload, fut))
        if len(self.pending) == self.expected:
            batch, self.pending = self.pending, []
            self._run(batch)
        if payload.get("stream"):
            return await self._stream(request, await fut)
        return web.json_response(await fut)

    @staticmethod
    async def _stream(request, result: dict):
        """``"stream": true``: server-sent events as SGLang's ``/generate`` sends them (each chunk cumulative, a
        ``data: [DONE]`` last): one chunk after the first token, then the whole answer."""
        import json as _json

        from aiohttp import web
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        meta = result["meta_info"]
        first = {**result, "meta_info": {**meta, "output_token_logprobs": meta["output_token_logprobs"][:1],
                                         "completion_tokens": 1, "finish_reason": None}}
        for chunk in (first, result):
            await resp.write(f"data: {_json.dumps(chunk)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    def _run(self, batch) -> None:
        n = int(batch[0][1]["sampling_params"]["max_new_tokens"])
        res = self.engine.generate({r: p["input_ids"] for r, p, _ in batch}, n - 1)
        logits = res.next_token_logits_by_position()
        for r, p, fut in batch:
            out, plen = res.outputs[r], len(p["input_ids"])
            t = _logprob_temperature(p["sampling_params"])
            lps = [float(torch.log_softmax(logits[(r, plen - 1 + j)].float() / t, -1)[tok])
                   for j, tok in enumerate(out)]
            fut.set_result({"text": " ".join(f"t{t}" for t in out), "meta_info": {
                "id": r, "output_token_logprobs": [[lp, t, None] for lp, t in zip(lps, out)],
                "finish_reason": {"type": "length", "length": len(out)}, "completion_tokens": len(out),
                "prompt_tokens": plen, "cached_tokens": 0}})

    async def _start(self) -> int:
        from aiohttp import web
        app = web.Application()
        app.router.add_post("/generate", self._handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        return site._server.sockets[0].getsockname()[1]

    def start(self) -> int:
        from slime.utils.async_utils import run
        self.port = run(self._start())
        return self.port

    def stop(self) -> None:
        from slime.utils.async_utils import run
        if self.runner is not None:
            run(self.runner.cleanup())


def _logprob_temperature(sampling_params: dict) -> float:
    """The temperature SGLang's sampler divides the logits by before the log-softmax of the log-probs it returns
    (sglang/srt/layers/sampler.py, Sampler.forward: ``if sampling_info.is_all_greedy or
    SGLANG_RETURN_ORIGINAL_LOGPROB: log_softmax(logits)`` else ``log_softmax(logits / temperatures)``; greedy is
    temperature 0). The token is still chosen greedily here; top-p / top-k renormalisation is not modelled."""
    import os
    t = float(sampling_params.get("temperature", 1.0))
    original = os.environ.get("SGLANG_RETURN_ORIGINAL_LOGPROB", "false").strip().lower() in ("1", "true", "yes", "on")
    return 1.0 if original or t <= 0 else t


def rollout(args, rollout_id: int, samples: list, *, evaluation: bool = False) -> list:
    """``RolloutManager.generate`` -> ``set_current_rollout_id`` -> the rollout function's
    ``generate_and_rm_group`` per group of ``n_samples_per_prompt`` (slime's code from there: the
    semaphore, ``--custom-generate-function-path``, ``generate``, ``post``, sample hooks, reward)."""
    from slime.rollout.sample_hooks import set_current_rollout_id
    from slime.rollout.sglang_rollout import GenerateState, generate_and_rm_group
    from slime.utils.async_utils import run
    set_current_rollout_id(rollout_id)
    state = GenerateState(args)
    n = int(args.n_samples_per_prompt)
    groups = [samples[i:i + n] for i in range(0, len(samples), n)]

    async def go():
        return await asyncio.gather(*[generate_and_rm_group(args, g, dict(state.sampling_params),
                                                            evaluation=evaluation) for g in groups])
    return [s for g in run(go()) for s in g]


async def constant_reward(args, sample, **kwargs) -> float:
    """``--custom-rm-path``: no reward model in these tests."""
    return 1.0


# ================================================================== a user's own hooks (chained by --tic-trace)

#: Calls of the hooks below, in order: what slime passed to the user's hooks while ours were installed.
USER_CALLS: list[tuple] = []


def user_init(args) -> None:
    USER_CALLS.append(("init",))


def user_before_log_prob(args, model_chunks, store_prefix) -> None:
    USER_CALLS.append(("log_prob", store_prefix, type(model_chunks).__name__))


def user_before_train_step(args, rollout_id, step_id, model_chunks, optimizer, opt_param_scheduler) -> None:
    USER_CALLS.append(("train_step", int(rollout_id), int(step_id)))


async def mask_first_token(args, sample, sampling_params, evaluation=False):
    """A user's generate function that leaves each sample's first generated token out of the loss (loss_mask 0),
    as partial-rollout masking or a custom filter does: slime's metric weighs it 0."""
    from slime.rollout.sglang_rollout import generate
    sample = await generate(args, sample, sampling_params)
    sample.loss_mask = [0] + list(sample.loss_mask[1:])
    return sample


async def user_generate(args, sample, sampling_params, evaluation=False):
    """A user's generate function wrapping slime's (the common case: pre/post-processing around it)."""
    from slime.rollout.sglang_rollout import generate
    USER_CALLS.append(("generate", sample.index, evaluation))
    return await generate(args, sample, sampling_params)
