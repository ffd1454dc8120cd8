"""The rollout side: ``--custom-generate-function-path`` and the rid slime's ``post`` sends.

:func:`generate` is awaited as ``fn(args, sample, sampling_params, evaluation=...)`` by
``slime/rollout/sglang_rollout.py:generate_and_rm``. It gives a traced sample's ``/generate`` requests the
request id ``f"{rollout_id}-{sample.index}"`` and delegates to the user's generate function or slime's; the
log-probs each such request's answer returns are recorded with its sampling parameters (:mod:`.used_logprobs`).
"""
from __future__ import annotations

import contextvars
import functools
import importlib
import inspect
import sys
import threading

from tic_trace.integrations.slime.config import (
    chained_hook, enabled, sample_key, selected, traced, warn_once, wrap_once,
)

#: The thread ``slime/rollout/fully_async_rollout.py`` (``AsyncRolloutWorker.start``) generates from.
FULLY_ASYNC_THREAD = "fully-async-rollout"

_RID: contextvars.ContextVar[str | None] = contextvars.ContextVar("tic_trace_rid", default=None)
#: Where the traced sample's returned log-probs go (the rollout's sglang/ trace directory), with `_RID`.
_USED_DIR: contextvars.ContextVar[str | None] = contextvars.ContextVar("tic_trace_used_dir", default=None)
#: How many /generate answers `post` recorded for the sample `generate` is running ([count], shared in the task).
_ANSWERS: contextvars.ContextVar[list | None] = contextvars.ContextVar("tic_trace_answers", default=None)


async def generate(args, sample, sampling_params, evaluation=False):
    """``--custom-generate-function-path``: for a traced sample of a traced rollout, every ``/generate``
    request it sends carries ``rid = f"{rollout_id}-{sample.index}"`` (set by a wrapper around slime's HTTP
    ``post``, for this coroutine only); then the user's own generate function (if one was set) or slime's
    ``slime.rollout.sglang_rollout.generate`` runs unchanged. Evaluation requests are never tagged."""
    rid = _rid_for(args, sample, evaluation)
    fn = _generate_delegate(args)
    if rid is None:
        return await _call(fn, args, sample, sampling_params, evaluation)
    used, answers, before = _used_dir(args, rid), [0], _response_length(sample)
    tokens = (_RID.set(rid), _USED_DIR.set(used), _ANSWERS.set(answers))
    try:
        out = await _call(fn, args, sample, sampling_params, evaluation)
    finally:
        for var, token in zip((_ANSWERS, _USED_DIR, _RID), reversed(tokens)):
            var.reset(token)
    if used is not None and not answers[0]:
        # no answer came through `post` (a streamed request, another client): what slime kept on the sample
        _record_sample(used, rid, before, out, sampling_params)
    return out


async def _call(fn, args, sample, sampling_params, evaluation):
    if "evaluation" in _params(fn):
        return await fn(args, sample, sampling_params, evaluation=evaluation)
    return await fn(args, sample, sampling_params)


def _response_length(sample) -> int:
    try:
        return int(getattr(sample, "response_length", 0) or 0)
    except (TypeError, ValueError):
        return 0


def _used_dir(args, rid: str) -> str | None:
    """The sglang/ trace directory of the rollout a rid "{rollout_id}-{index}" belongs to (None: not known)."""
    from tic_trace.integrations.slime.config import rollout_dir
    try:
        return str(rollout_dir(args.tic_trace_dir, int(rid.split("-", 1)[0])) / "sglang")
    except Exception as e:  # noqa: BLE001 - never break a rollout over tracing
        warn_once("used-dir", f"tic-trace: returned log-probs not recorded: {type(e).__name__}: {e}")
        return None


def request_rid() -> str | None:
    """The rid :func:`generate` gives the sample whose request is being sent from this coroutine, or None.
    For a custom generate function that sends requests with its own HTTP client: ``payload["rid"] = rid``."""
    return _RID.get()


def _params(fn) -> set[str]:
    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return set()


def _generate_delegate(args):
    user = chained_hook(args, "custom_generate_function_path")
    if user is not None:
        return user
    return importlib.import_module("slime.rollout.sglang_rollout").generate


def current_rollout_id() -> int | None:
    """The rollout the RolloutManager is generating: slime publishes it with
    ``slime.rollout.sample_hooks.set_current_rollout_id`` (v0.3.1+) before calling the rollout function."""
    try:
        mod = importlib.import_module("slime.rollout.sample_hooks")
    except ImportError:
        return None
    v = getattr(mod, "_current_rollout_id", None)
    return None if v is None else int(v)


def _rid_for(args, sample, evaluation) -> str | None:
    try:
        if evaluation or not enabled(args):
            return None
        idx = getattr(sample, "index", None)
        if idx is None:
            return None
        if threading.current_thread().name == FULLY_ASYNC_THREAD:
            warn_once("fully-async", "tic-trace: requests sent by slime's fully asynchronous rollout worker are not "
                                     "tagged: the rollout they are trained in is not known when they are sent "
                                     "(use the default rollout function for a traced run)")
            return None
        rollout_id = current_rollout_id()
        if rollout_id is None:
            warn_once("no-current-rollout", "tic-trace: slime does not publish the current rollout id "
                                             "(slime.rollout.sample_hooks, v0.3.1+): requests are not tagged")
            return None
        if not traced(args, rollout_id) or not selected(args, idx):
            return None
        install_rid_injection()
        return sample_key(rollout_id, idx)
    except Exception as e:  # noqa: BLE001 - never break a rollout over tracing
        warn_once("rid", f"tic-trace: request not tagged: {type(e).__name__}: {e}")
        return None


#: Modules whose ``post`` sends the rollout's ``/generate`` requests (slime's default ``generate`` uses the
#: name it imported into ``sglang_rollout``; custom generate functions usually import it from http_utils).
POST_MODULES = ("slime.utils.http_utils", "slime.rollout.sglang_rollout")


def install_rid_injection() -> None:
    """Wrap ``post`` in :data:`POST_MODULES` (once): a ``/generate`` payload sent while :func:`generate`
    runs for a traced sample gets that sample's ``rid`` unless it already has one. Other requests, other
    coroutines and untraced samples pass through unchanged."""
    for name in POST_MODULES:
        mod = sys.modules.get(name)
        if mod is None:
            try:
                mod = importlib.import_module(name)
            except ImportError:
                continue
        wrap_once(mod, "post", _rid_post)
    try:
        _wrap_stream(sys.modules.get(POST_MODULES[0]))
    except Exception as e:  # noqa: BLE001 - post still carries the rid
        warn_once("stream", f"tic-trace: streamed requests are not tagged: {type(e).__name__}: {e}")


def _wrap_stream(http_utils) -> None:
    """slime's streaming generate (``sglang_streaming_rollout.generate_streaming``) sends its ``/generate`` through
    ``http_utils._http_client.stream("POST", url, json=payload)``: the client's ``stream`` gets the rid too (the
    client is made once by ``init_http_client``; a new one is wrapped at the next traced sample)."""
    wrap_once(getattr(http_utils, "_http_client", None), "stream", _rid_stream)


def _rid_stream(orig):
    @functools.wraps(orig)
    def stream(method, url, *a, **kw):
        rid, body = _RID.get(), kw.get("json")
        if rid is not None and str(method).upper() == "POST" and isinstance(body, dict) and "rid" not in body \
                and _is_generate(url):
            kw["json"] = {**body, "rid": rid}
        return orig(method, url, *a, **kw)
    return stream


def _is_generate(url) -> bool:
    return str(url).split("?", 1)[0].rstrip("/").endswith("/generate")


def _rid_post(orig):
    @functools.wraps(orig)
    async def post(url, payload, *a, **kw):
        rid = _RID.get()
        generate = rid is not None and isinstance(payload, dict) and _is_generate(url)
        if generate and "rid" not in payload:
            payload = {**payload, "rid": rid}
        out = orig(url, payload, *a, **kw)
        out = await out if inspect.isawaitable(out) else out
        if generate and _USED_DIR.get() is not None:
            # the log-probs slime's generate takes from this answer (meta_info.output_token_logprobs)
            _record_answer(_USED_DIR.get(), rid, payload, out)
            if _ANSWERS.get() is not None:
                _ANSWERS.get()[0] += 1
        return out
    return post


def _record_answer(out_dir: str, rid: str, payload, answer) -> None:
    try:
        from tic_trace.integrations.slime.used_logprobs import record_response
        record_response(out_dir, rid, payload, answer)
    except Exception as e:  # noqa: BLE001 - never break a rollout over tracing
        warn_once("used-logprobs-rollout", f"tic-trace: returned log-probs not recorded: {type(e).__name__}: {e}")


def _record_sample(out_dir: str, rid: str, before: int, sample, sampling_params) -> None:
    try:
        from tic_trace.integrations.slime.used_logprobs import record_sample
        record_sample(out_dir, rid, before, sample, sampling_params)
    except Exception as e:  # noqa: BLE001 - never break a rollout over tracing
        warn_once("used-logprobs-rollout", f"tic-trace: returned log-probs not recorded: {type(e).__name__}: {e}")
