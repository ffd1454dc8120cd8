"""Recording the log-probs each side of slime actually used (issue 37), beside each side's trace.

slime's ``train_rollout_logprob_abs_diff`` compares, per response token, the log-prob SGLang returned
(``meta_info.output_token_logprobs``, under the request's sampling parameters) with the one the trainer computed
(``get_log_probs_and_entropy``: logits / ``rollout_temperature``, log-softmax, top-p mask when
``--rollout-top-p`` < 1). Both are recorded here, keyed like the trace's rows (sample key, position of the token),
into ``rollout_NNNNN/{sglang,megatron}/used_logprobs/`` (tic_trace.store.used_logprobs: framed msgpack and raw
arrays). Only traced samples of traced rollouts; a failure here warns once and never reaches the rollout or the
training step.
"""
from __future__ import annotations

import itertools
import math
import os
from pathlib import Path
from typing import Any

from tic_trace.integrations.slime.config import warn_once

_WRITER = f"{os.getpid()}-{os.urandom(4).hex()}"
_SEQ = itertools.count()
#: SGLang's SamplingParams defaults (sglang/srt/sampling/sampling_params.py): what a request that omits a
#: parameter runs with.
SGLANG_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0}
#: Other sampling parameters that change the logits SGLang's sampler takes its log-probs from (kept as stated).
_PROCESSING = ("repetition_penalty", "frequency_penalty", "presence_penalty", "min_new_tokens", "sampling_seed")
#: SGLang's switch between log-probs of the processed (temperature-scaled) logits and of the original ones
#: (sglang/srt/layers/sampler.py); read in the server's environment, so only what the recording process sees.
RETURN_ORIGINAL_ENV = "SGLANG_RETURN_ORIGINAL_LOGPROB"


def _writer_id(side: str) -> str:
    return f"{side}-{_WRITER}-{next(_SEQ)}"


# ================================================================== the rollout side

def record_response(out_dir: str | os.PathLike, key: str, payload: Any, output: Any) -> None:
    """One ``/generate`` answer of a traced sample: its returned token log-probs at their positions (the
    request's prompt length is the first) with the request's sampling parameters. Never raises."""
    try:
        entry = response_entry(key, payload, output)
        if entry is not None:
            from tic_trace.store.used_logprobs import write_part
            write_part(out_dir, _writer_id("rollout"), [entry])
    except Exception as e:  # noqa: BLE001 - never break a rollout over tracing
        warn_once("used-logprobs-rollout", f"tic-trace: the returned log-probs of {key} were not recorded: "
                                           f"{type(e).__name__}: {e}")


def response_entry(key: str, payload: Any, output: Any):
    """The :class:`UsedLogprobs` of one SGLang ``/generate`` answer, or None when it returned no log-probs."""
    import numpy as np

    from tic_trace.store.used_logprobs import UsedLogprobs
    meta = output.get("meta_info") if isinstance(output, dict) else None
    items = meta.get("output_token_logprobs") if isinstance(meta, dict) else None
    if not items:
        return None
    ids = payload.get("input_ids") if isinstance(payload, dict) else None
    if isinstance(ids, list) and all(isinstance(t, int) for t in ids):
        first = len(ids)
    elif isinstance(meta.get("prompt_tokens"), int):      # a text / multimodal request: SGLang's count
        first = int(meta["prompt_tokens"])
    else:
        raise ValueError("neither input_ids nor meta_info.prompt_tokens says where the response starts")
    lps = [math.nan if it[0] is None else float(it[0]) for it in items]
    toks = [int(it[1]) for it in items]
    return UsedLogprobs(key, np.arange(first, first + len(toks), dtype=np.int64), np.asarray(toks, dtype=np.int64),
                        np.asarray(lps, dtype=np.float64), request_sampling(payload, meta))


def record_sample(out_dir: str | os.PathLike, key: str, before: int, sample: Any, sampling_params: Any) -> None:
    """When no ``/generate`` answer came through ``post`` (a streamed request, another HTTP client): the
    log-probs slime kept on the sample for the tokens this call added (``rollout_log_probs[before:]``), with the
    sampling parameters the generate function was given. Never raises."""
    try:
        entry = sample_entry(key, before, sample, sampling_params)
        if entry is not None:
            from tic_trace.store.used_logprobs import write_part
            write_part(out_dir, _writer_id("rollout"), [entry])
    except Exception as e:  # noqa: BLE001 - never break a rollout over tracing
        warn_once("used-logprobs-rollout", f"tic-trace: the returned log-probs of {key} were not recorded: "
                                           f"{type(e).__name__}: {e}")


def sample_entry(key: str, before: int, sample: Any, sampling_params: Any):
    """The :class:`UsedLogprobs` of the response tokens a generate call added to `sample` (None: none)."""
    import dataclasses

    import numpy as np

    from tic_trace.store.used_logprobs import UsedLogprobs
    tokens, lps = list(getattr(sample, "tokens", None) or []), getattr(sample, "rollout_log_probs", None)
    r = int(getattr(sample, "response_length", 0) or 0)
    if lps is None or r <= before or len(lps) < r or len(tokens) < r:
        return None
    start = len(tokens) - r + before
    sampling = request_sampling({"sampling_params": sampling_params if isinstance(sampling_params, dict) else {}}, {})
    return UsedLogprobs(key, np.arange(start, len(tokens), dtype=np.int64), np.asarray(tokens[start:], dtype=np.int64),
                        np.asarray([float(x) for x in lps[before:r]], dtype=np.float64),
                        dataclasses.replace(sampling, source="slime Sample.rollout_log_probs (no /generate answer "
                                                              "through post: a streamed request or another client)"))


def request_sampling(payload: dict, meta: dict):
    """What the request asked SGLang to apply (its defaults for what it omits) and what else was stated."""
    from tic_trace.store.used_logprobs import Sampling
    sp = payload.get("sampling_params") or {}
    got = {k: (SGLANG_DEFAULTS[k] if sp.get(k) is None else sp[k]) for k in SGLANG_DEFAULTS}
    extra: dict = {k: sp[k] for k in _PROCESSING if isinstance(sp.get(k), (int, float, str, bool))}
    if sp.get("logit_bias"):
        extra["logit_bias"] = True
    custom = sp.get("custom_params")
    if isinstance(custom, dict) and custom.get("return_top_p_token_ids"):
        extra["return_top_p_token_ids"] = True
    extra[f"env {RETURN_ORIGINAL_ENV} (rollout process)"] = os.environ.get(RETURN_ORIGINAL_ENV, "unset")
    if isinstance(meta.get("id"), str):
        extra["request_id"] = meta["id"]
    return Sampling(temperature=float(got["temperature"]), top_p=float(got["top_p"]), top_k=int(got["top_k"]),
                    min_p=float(got["min_p"]), source="sglang meta_info.output_token_logprobs", extra=extra)


# ================================================================== the trainer side

def record_trainer(args: Any, out_dir: Path, phase: str, keys: list, kwargs: dict, result: Any,
                   loss_masks: list | None = None) -> None:
    """The per-sample log-probs ``get_log_probs_and_entropy`` returned for one micro-batch (``kwargs``: the
    call's ``unconcat_tokens``, ``total_lengths``, ``response_lengths``), for the samples with a key, with the
    micro-batch's loss masks (``get_batch``'s ``loss_masks``, one per sample over its response). Never raises."""
    try:
        entries = trainer_entries(args, phase, keys, kwargs, result, loss_masks)
        if entries:
            from tic_trace.store.used_logprobs import write_part
            write_part(out_dir, _writer_id("megatron"), entries)
    except Exception as e:  # noqa: BLE001 - never break the training step over tracing
        warn_once("used-logprobs-trainer", f"tic-trace: the trainer's log-probs were not recorded: "
                                           f"{type(e).__name__}: {e}")


def trainer_entries(args: Any, phase: str, keys: list, kwargs: dict, result: Any,
                    loss_masks: list | None = None) -> list:
    import numpy as np

    from tic_trace.store.used_logprobs import UsedLogprobs
    if _context_parallel(args):
        warn_once("used-logprobs-cp", "tic-trace: with context parallelism each rank holds part of a sample's "
                                      "log-probs: the trainer's used log-probs are not recorded")
        return []
    if not _first_tensor_rank():
        return []                        # every tensor-parallel rank holds the same all-reduced log-probs
    # slime returns (an empty loss tensor, {"log_probs": [per sample], ...})
    res = result[1] if isinstance(result, tuple) and len(result) == 2 else result
    lps = res.get("log_probs") if isinstance(res, dict) else None
    tokens, totals, responses = kwargs["unconcat_tokens"], kwargs["total_lengths"], kwargs["response_lengths"]
    if lps is None or len(lps) != len(tokens) or len(keys) < len(tokens):
        raise ValueError(f"{0 if lps is None else len(lps)} log-prob lists for {len(tokens)} samples and "
                         f"{len(keys)} keys")
    sampling = trainer_sampling(args, phase, kwargs.get("top_p_token_ids") is not None)
    masks = loss_masks if loss_masks is not None and len(loss_masks) == len(tokens) else [None] * len(tokens)
    out = []
    for key, lp, tok, total, resp, mask in zip(keys, lps, tokens, totals, responses, masks):
        total, resp = int(total), int(resp)
        if key is None or resp <= 0:
            continue
        v = lp.detach().float().cpu().numpy().astype(np.float64)
        if v.shape != (resp,):
            raise ValueError(f"sample {key}: {tuple(v.shape)} log-probs for a response of {resp} tokens")
        m = None if mask is None else np.asarray(mask.detach().float().cpu().numpy() if hasattr(mask, "detach")
                                                 else mask, dtype=np.float64).reshape(-1)
        out.append(UsedLogprobs(key, np.arange(total - resp, total, dtype=np.int64),
                                tok[-resp:].detach().cpu().numpy().astype(np.int64), v, sampling,
                                m if m is not None and m.shape == (resp,) else None))
    return out


def trainer_sampling(args: Any, phase: str, top_p_replay: bool):
    """What ``get_log_probs_and_entropy`` applied: logits / ``rollout_temperature``; with ``--rollout-top-p`` < 1,
    the log-softmax restricted to the rollout's nucleus token ids; never top-k or min-p."""
    from tic_trace.store.used_logprobs import Sampling
    use_rollout = bool(getattr(args, "use_rollout_logprobs", False))
    # policy_loss_function: `log_probs if use_rollout_logprobs else old_log_probs`, old_log_probs being the
    # log-prob pass's (or train step 0's when that pass was skipped)
    compared = phase == "train_step0" or not use_rollout
    return Sampling(temperature=float(getattr(args, "rollout_temperature", 1.0)),
                    top_p=float(getattr(args, "rollout_top_p", 1.0)) if top_p_replay else 1.0, top_k=-1, min_p=0.0,
                    source=f"slime get_log_probs_and_entropy ({'compute_log_prob' if phase == 'logprob' else phase})",
                    extra={"phase": phase, "compared_by_slime": compared, "use_rollout_logprobs": use_rollout,
                           "top_p_replay": bool(top_p_replay)})


def _context_parallel(args: Any) -> bool:
    return int(getattr(args, "context_parallel_size", 1) or 1) > 1


def _first_tensor_rank() -> bool:
    try:
        from megatron.core import parallel_state as mps
        return not mps.model_parallel_is_initialized() or mps.get_tensor_model_parallel_rank() == 0
    except ImportError:
        return True
