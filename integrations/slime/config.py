"""The ``--tic-trace`` flag family and what :func:`configure` does to slime's parsed arguments.

Off (the default): nothing is imported, set or hooked. On: the ``tic_trace*`` values are validated, slime's
hook-path arguments point at this package (a hook the user set is kept and called by ours), the SGLang
server arguments tracing needs are set, and setups that would make the comparison wrong are refused or
warned about. Which samples are traced and how both sides name them is here too (one place for both sides).
"""
from __future__ import annotations

import argparse
import importlib
import logging
import os
from pathlib import Path
from typing import Any, Callable

log = logging.getLogger("tic_trace.slime")

#: `subset`: `rows` of a few rows per sample chosen by (sample, position) alone (tic_trace.graph.row_subset),
#: so that both sides keep the same rows however they batch them: comparable numerics at a small cost.
MODES = ("stats", "full", "rows", "subset")
DEFAULT_ROLLOUT_IDS = "0"
DEFAULT_MAX_SAMPLES = 4
DEFAULT_MODE = "rows"
#: How rollouts traced only because of --tic-trace-every are recorded unless --tic-trace-mode says otherwise.
PERIODIC_MODE = "subset"
#: Modes whose rollouts the disk budget removes last (the cheap periodic ones) or never (statistics only).
CHEAP_MODES = ("subset",)

#: The package whose attributes the hook paths name (slime's load_function wants ``pkg.module.attr``).
_HERE = __name__.rpartition(".")[0]   # "tic_trace.integrations.slime"
#: slime argument -> the function of this package it is pointed at when tracing is on.
HOOK_PATHS = {
    "custom_megatron_init_path": f"{_HERE}.megatron_init",
    "custom_megatron_before_log_prob_hook_path": f"{_HERE}.before_log_prob_hook",
    "custom_megatron_before_train_step_hook_path": f"{_HERE}.before_train_step_hook",
    "custom_generate_function_path": f"{_HERE}.generate",
}
#: Where configure() keeps the user's own hook paths (called by ours, never dropped).
CHAINED_ATTR = "tic_trace_chained_hooks"
#: SGLang server arguments (``args.sglang_<ServerArgs field>``) set for a traced run, and why.
SERVER_ARGS = {
    "sglang_disable_cuda_graph": "CUDA-graph replay runs captured kernels without calling the modules: "
                                 "no hook fires, decode steps would be invisible",
    "sglang_disable_radix_cache": "a prefix-cache hit skips the prompt rows of a request (siblings of one "
                                  "prompt share them): those rows would never be computed under its rid",
    "sglang_enforce_disable_flashinfer_allreduce_fusion": "FlashInfer's fused all-reduce + add + RMSNorm runs "
        "input_layernorm as one fused call (its records go missing) and leaves MoE outputs partial in every "
        "layer but the last (on by default for Qwen3-MoE, GLM-4-MoE, DeepSeek-V3 on SM90/SM100 at TP>1)",
}
_SGLANG_HOOK_FACTORY = "tic_trace.adapters.sglang"


# ================================================================== flags

def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The ``--tic-trace`` flag family, for ``slime.utils.arguments.parse_args(add_custom_arguments=...)``.

    Defines flags only: nothing is imported and nothing changes until :func:`configure` sees
    ``args.tic_trace`` true.
    """
    g = parser.add_argument_group("tic-trace", "train-inference consistency tracing (default off)")
    g.add_argument("--tic-trace", action="store_true", default=False,
                   help="Trace the SGLang rollout and the Megatron forward of the same samples for the rollouts "
                        "in --tic-trace-rollout-ids, for `tic-trace slime-report`. Sets the hook-path arguments "
                        "and --sglang-disable-cuda-graph / --sglang-disable-radix-cache itself.")
    g.add_argument("--tic-trace-dir", type=str, default=None,
                   help="Where traces go: {dir}/rollout_{id:05d}/{megatron,sglang}/. Must be on a filesystem "
                        "every train and rollout node writes to. Default: {--save}/tic_trace, else ./tic-trace.")
    g.add_argument("--tic-trace-rollout-ids", type=str, default=DEFAULT_ROLLOUT_IDS,
                   help="Comma-separated rollout ids to trace, e.g. '0,3' (default: 0).")
    g.add_argument("--tic-trace-max-samples", type=int, default=DEFAULT_MAX_SAMPLES,
                   help="Samples traced per rollout: those whose index modulo rollout_batch_size * "
                        f"n_samples_per_prompt is below this (default {DEFAULT_MAX_SAMPLES}).")
    g.add_argument("--tic-trace-every", type=int, default=0,
                   help="Also trace every N-th rollout (ids divisible by N), for `tic-trace drift`; 0 (default): "
                        "only --tic-trace-rollout-ids. These periodic traces are 'subset' unless --tic-trace-mode "
                        "is given.")
    g.add_argument("--tic-trace-disk-budget", type=str, default=None,
                   help="Most bytes the traces may take under --tic-trace-dir (e.g. 20G, 500M): past it, the "
                        "oldest rollouts traced with values ('rows'/'full') are removed, then the oldest 'subset' "
                        "ones; statistics-only ones are kept. Default: no budget.")
    g.add_argument("--tic-trace-mode", type=str, default=None, choices=MODES,
                   help="How the canonical points are recorded: 'rows' (values of the traced samples' tokens, "
                        "default for --tic-trace-rollout-ids), 'subset' (values of a few of those tokens per "
                        "sample, chosen by position: 0, powers of two, one in 512; default for --tic-trace-every), "
                        "'full' (whole tensors), 'stats' (statistics only; cannot join differently batched "
                        "passes). Dispatcher ops are always recorded as statistics.")
    g.add_argument("--tic-trace-filter", type=str, nargs="+", default=None,
                   help="Module-path globs to record (both frameworks' names, e.g. '*layers.0*' "
                        "'*layers.1*'); 're:' prefix for a regex. Default: every module.")
    return parser


_WARNED: set[str] = set()


def warn_once(key: str, msg: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        log.warning(msg)


def wrap_once(owner: Any, name: str, wrap: Callable[[Callable], Callable], *, required: bool = False) -> bool:
    """Replace ``owner.name`` (a module's function, a class's method, a client's method) by ``wrap(orig)``,
    marked as tic-trace's, unless it is already tic-trace's or missing (an AttributeError if `required`): every
    hook into slime patches this way, so a second install never wraps a wrapper."""
    orig = getattr(owner, name) if required else getattr(owner, name, None)
    if orig is None or getattr(orig, "_tic_trace", False):
        return False
    new = wrap(orig)
    new._tic_trace = True
    setattr(owner, name, new)
    return True


def _truthy(v: Any) -> bool:
    if isinstance(v, str):
        return v.strip().lower() in ("1", "true", "yes", "on")
    return bool(v)


def enabled(args: Any) -> bool:
    return _truthy(getattr(args, "tic_trace", False))


def parse_rollout_ids(v: Any) -> list[int]:
    if v is None or v == "":
        return [int(DEFAULT_ROLLOUT_IDS)]
    if isinstance(v, int) and not isinstance(v, bool):
        items = [v]
    elif isinstance(v, (list, tuple, set)):
        items = list(v)
    else:
        items = [p for p in str(v).replace(" ", ",").split(",") if p]
    out = set()
    for x in items:
        try:
            i = int(x)
        except (TypeError, ValueError):
            raise ValueError(f"tic_trace_rollout_ids: {x!r} is not an integer rollout id (give e.g. '0,3')") from None
        if i < 0:
            raise ValueError(f"tic_trace_rollout_ids: rollout ids are >= 0, got {i}")
        out.add(i)
    if not out:
        raise ValueError("tic_trace_rollout_ids: no rollout id given")
    return sorted(out)


def _parse_filters(v: Any) -> list[str] | None:
    if v is None or v == "" or v == []:
        return None
    items = [v] if isinstance(v, str) else list(v)
    out = []
    for x in items:
        s = str(x)
        out.extend(p for p in (s.split(",") if not s.startswith("re:") else [s]) if p)
    return out or None


def _default_dir(args: Any) -> str:
    save = getattr(args, "save", None)
    return os.path.join(save, "tic_trace") if save else "tic-trace"


def normalize(args: Any) -> Any:
    """Validate and normalise the ``tic_trace*`` attributes in place (they may come from argparse or from
    a ``--custom-config-path`` YAML, which slime ``setattr``s unchecked). Raises ``ValueError``."""
    args.tic_trace = True
    args.tic_trace_rollout_ids = parse_rollout_ids(getattr(args, "tic_trace_rollout_ids", DEFAULT_ROLLOUT_IDS))
    n = getattr(args, "tic_trace_max_samples", DEFAULT_MAX_SAMPLES)
    try:
        n = int(n if n is not None else DEFAULT_MAX_SAMPLES)
    except (TypeError, ValueError):
        raise ValueError(f"tic_trace_max_samples: expected a positive integer, got {n!r}") from None
    if n < 1:
        raise ValueError(f"tic_trace_max_samples: expected a positive integer, got {n}")
    args.tic_trace_max_samples = n
    given = getattr(args, "tic_trace_mode", None)
    if getattr(args, "tic_trace_periodic_mode", None) is not None:      # normalised before: keep its choice
        given = getattr(args, "tic_trace_mode_given", None)
    mode = str(given or DEFAULT_MODE).lower()
    if mode not in MODES:
        raise ValueError(f"tic_trace_mode: expected one of {', '.join(MODES)}, got {mode!r}")
    args.tic_trace_mode_given = given
    args.tic_trace_mode = mode
    args.tic_trace_periodic_mode = mode if given else PERIODIC_MODE
    every = getattr(args, "tic_trace_every", 0)
    try:
        every = int(every or 0)
    except (TypeError, ValueError):
        raise ValueError(f"tic_trace_every: expected a whole number of rollouts >= 0, got {every!r}") from None
    if every < 0:
        raise ValueError(f"tic_trace_every: expected a whole number of rollouts >= 0, got {every}")
    args.tic_trace_every = every
    args.tic_trace_disk_budget = parse_size(getattr(args, "tic_trace_disk_budget", None))
    args.tic_trace_filter = _parse_filters(getattr(args, "tic_trace_filter", None))
    d = getattr(args, "tic_trace_dir", None) or _default_dir(args)
    # Absolute: SGLang servers and Ray actors do not share the driver's working directory.
    args.tic_trace_dir = os.path.abspath(os.path.expanduser(str(d)))
    return args


_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(v: Any) -> int | None:
    """`--tic-trace-disk-budget`: bytes, or a number with K/M/G/T (binary units, optional B/iB); None: no budget."""
    if v is None or v == "":
        return None
    if isinstance(v, int) and not isinstance(v, bool):
        n = v
    else:
        import re
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*", str(v), re.I)
        if m is None:
            raise ValueError(f"tic_trace_disk_budget: expected bytes or a size like 500M or 20G, got {v!r}")
        n = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if n <= 0:
        raise ValueError(f"tic_trace_disk_budget: expected a positive size, got {v!r}")
    return n


def traced(args: Any, rollout_id: int) -> bool:
    """Whether rollout `rollout_id` is traced: listed in --tic-trace-rollout-ids, or a multiple of
    --tic-trace-every (the same answer on both sides)."""
    rid = int(rollout_id)
    every = int(getattr(args, "tic_trace_every", 0) or 0)
    return rid in _listed(args) or (every > 0 and rid % every == 0)


def _listed(args: Any) -> list[int]:
    v = args.tic_trace_rollout_ids
    return v if isinstance(v, list) else parse_rollout_ids(v)


def mode_for(args: Any, rollout_id: int) -> str:
    """The points mode of a traced rollout: --tic-trace-mode for listed rollouts (default rows), the periodic
    mode (default subset) for rollouts traced only because of --tic-trace-every."""
    if int(rollout_id) in _listed(args):
        return args.tic_trace_mode
    return getattr(args, "tic_trace_periodic_mode", None) or PERIODIC_MODE


def tracer_points_mode(mode: str) -> tuple[str, Any]:
    """A --tic-trace-mode as the tracer's ``points_mode`` and ``row_subset`` (``subset``: ``rows`` with the
    identity rule of tic_trace.graph.row_subset, the one the SGLang hook applies too)."""
    if mode == "subset":
        from tic_trace.graph.row_subset import RowSubset
        return "rows", RowSubset()
    return mode, None


# ================================================================== configure

def configure(args: Any) -> Any:
    """Turn the parsed slime ``args`` into a traced run when ``args.tic_trace`` is set; else change nothing.

    Sets ``custom_megatron_init_path``, ``custom_megatron_before_log_prob_hook_path``,
    ``custom_megatron_before_train_step_hook_path`` and ``custom_generate_function_path`` to this module
    (a hook the user set is kept in ``args.tic_trace_chained_hooks`` and called by ours), appends the
    SGLang adapter's hook spec to ``sglang_forward_hooks``, and sets ``sglang_disable_cuda_graph`` and
    ``sglang_disable_radix_cache``. Idempotent. Returns ``args``.
    """
    if not enabled(args):
        return args
    normalize(args)
    _refuse_unsupported(args)
    chained = dict(getattr(args, CHAINED_ATTR, None) or {})
    for attr, ours in HOOK_PATHS.items():
        current = getattr(args, attr, None)
        if current and current != ours:
            chained[attr] = current
        setattr(args, attr, ours)
    setattr(args, CHAINED_ATTR, chained)
    for attr in SERVER_ARGS:
        setattr(args, attr, True)
    if not getattr(args, "debug_train_only", False):
        args.sglang_forward_hooks = _with_sglang_spec(args)
    _warn_about_setup(args)
    return args


#: slime's fully asynchronous rollout function: a background thread generates across rollout boundaries.
FULLY_ASYNC_ROLLOUT = "slime.rollout.fully_async_rollout.generate_rollout_fully_async"


def _refuse_unsupported(args: Any) -> None:
    """Setups where a trace would be named wrongly: refused, with what to do instead."""
    if str(getattr(args, "rollout_function_path", "") or "").endswith("fully_async_rollout.generate_rollout_fully_async") \
            and not getattr(args, "debug_train_only", False):
        raise ValueError(
            "tic-trace: --tic-trace does not support --rollout-function-path " + FULLY_ASYNC_ROLLOUT + ": its "
            "background worker generates samples across rollout boundaries, so the rollout a request belongs to "
            "(and is trained in) is not known when it is sent. For the traced run use the default rollout "
            "function (slime.rollout.sglang_rollout.generate_rollout), or add --debug-train-only to trace the "
            "Megatron side only.")
    if not getattr(args, "debug_train_only", False):
        try:
            importlib.import_module("slime")
        except ImportError:
            return                              # configure() on arguments made without slime (a driver script)
        from tic_trace.integrations.slime.version import check_rollout_side
        check_rollout_side()


def _with_sglang_spec(args: Any) -> list[dict]:
    import json
    have = getattr(args, "sglang_forward_hooks", None)
    if isinstance(have, str):
        have = json.loads(have) if have.strip() else None
    if isinstance(have, dict):
        have = [have]
    keep = [h for h in (have or []) if not str((h or {}).get("hook_factory", "")).startswith(_SGLANG_HOOK_FACTORY)]
    from tic_trace.adapters.sglang_server import forward_hooks_spec
    spec = forward_hooks_spec(args.tic_trace_dir, list(args.tic_trace_rollout_ids), _SGLANG_MAX_SAMPLES,
                              args.tic_trace_mode, args.tic_trace_filter, every=args.tic_trace_every,
                              periodic_mode=args.tic_trace_periodic_mode)
    return keep + list(spec)


# The SGLang hooks trace rows whose rid is "{rollout_id}-{sample_index}" with sample_index below a bound.
# Sample indices run on across rollouts, so that bound cannot be the per-rollout sample count: the
# selection is made by `generate` (only selected samples get such a rid); the bound only has to let them in.
_SGLANG_MAX_SAMPLES = 2 ** 62


def _warn_about_setup(args: Any) -> None:
    if getattr(args, "rollout_external", False) or getattr(args, "rollout_external_engine_addrs", None):
        log.warning("tic-trace: external rollout engines are not started by slime: start them with "
                    "--disable-cuda-graph --disable-radix-cache --forward-hooks '%s' yourself",
                    _json(getattr(args, "sglang_forward_hooks", None)))
    if getattr(args, "sglang_config", None):
        log.warning("tic-trace: --sglang-config server groups may override disable_cuda_graph / "
                    "disable_radix_cache / forward_hooks per group; keep them out of the groups' overrides")
    if int(getattr(args, "update_weights_interval", 1) or 1) > 1 or getattr(args, "keep_old_actor", False):
        log.warning("tic-trace: with --update-weights-interval > 1 or --keep-old-actor the rollout and the "
                    "traced Megatron pass may use different weights: expect differences from that alone")
    if _entry_script(args) == "train_async.py":
        log.warning("tic-trace: train_async.py generates rollout N+1 while rollout N trains, with the weights from "
                    "before that training: only rollout 0 compares the same weights on both sides")
    if getattr(args, "debug_train_only", False):
        log.warning("tic-trace: --debug-train-only: only the Megatron side is traced")
    if getattr(args, "debug_rollout_only", False):
        log.warning("tic-trace: --debug-rollout-only: only the SGLang side is traced")


#: Set by ``tic_trace.integrations.slime.train`` to the slime entry script it runs (``train.py``, ...).
ENTRY_ATTR = "tic_trace_entry"


def _entry_script(args: Any) -> str:
    """The slime entry script of this run: what our entry point recorded, else the ``__main__`` script."""
    import sys
    name = getattr(args, ENTRY_ATTR, None) or getattr(sys.modules.get("__main__"), "__file__", None) or ""
    return os.path.basename(str(name))


def _json(x: Any) -> str:
    import json
    try:
        return json.dumps(x)
    except (TypeError, ValueError):
        return str(x)


# ================================================================== selection and keys

def samples_per_rollout(args: Any) -> int:
    return int(getattr(args, "rollout_batch_size", 0) or 0) * int(getattr(args, "n_samples_per_prompt", 1) or 1)


def selected(args: Any, sample_index: int) -> bool:
    """Whether sample ``sample_index`` of a traced rollout is traced (same answer on both sides)."""
    per = samples_per_rollout(args)
    i = int(sample_index)
    return (i % per if per > 0 else i) < int(getattr(args, "tic_trace_max_samples", DEFAULT_MAX_SAMPLES))


def sample_key(rollout_id: int, sample_index: int) -> str:
    """The row key both sides use: SGLang's request id, Megatron's packed-segment key."""
    return f"{int(rollout_id)}-{int(sample_index)}"


def rollout_dir(base: str | os.PathLike, rollout_id: int) -> Path:
    return Path(base) / f"rollout_{int(rollout_id):05d}"


# ================================================================== chaining

def _load(path: str):
    """``pkg.module.attr`` (slime's convention) or ``pkg.module:attr``."""
    if ":" in path:
        mod, _, attr = path.partition(":")
    else:
        mod, _, attr = path.rpartition(".")
    return getattr(importlib.import_module(mod), attr)


def chained_hook(args: Any, attr: str):
    path = (getattr(args, CHAINED_ATTR, None) or {}).get(attr)
    if not path or path == HOOK_PATHS.get(attr):
        return None
    return _load(path)

