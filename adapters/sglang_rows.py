"""What SGLang's runtime says about a forward and about this process: the rows of a ``ForwardBatch`` (request
id, position, token of every activation row) and this process's parallel coordinates. Imports SGLang lazily."""
from __future__ import annotations

import re
from typing import Any

from tic_trace.graph.adapter import as_ints as _ints

# ---------------------------------------------------------------- rows of a forward batch

def _rids(fb: Any) -> list[str]:
    rids = getattr(fb, "rids", None)
    bs = int(getattr(fb, "batch_size", 0) or 0)
    if rids is not None:
        rids = list(rids)
        return [None if r is None else str(r) for r in (rids[:bs] if bs else rids)]
    # SGLang without ForwardBatch.rids (0.5.6): the request-pool slot, stable while the request lives
    return [f"slot{i}" for i in _ints(getattr(fb, "req_pool_indices", None))[:bs]]


def _mode(fb: Any) -> str:
    m = getattr(fb, "forward_mode", None)
    if m is None:
        return "unknown"
    if m.is_idle():
        return "idle"
    if m.is_decode():
        return "decode"
    target = getattr(m, "is_target_verify", lambda: False)()
    draft = getattr(m, "is_draft_extend", lambda *a: False)()
    if m.is_extend() and not target and not draft:
        return "extend"
    return "other"


def _extend_layout(fb: Any) -> tuple[list[int], list[int], list[int]]:
    """(start row, rows, cached prefix) per request of an EXTEND batch, from the CPU-side fields."""
    lens = _ints(getattr(fb, "extend_seq_lens_cpu", None)) or _ints(getattr(fb, "extend_seq_lens", None))
    prefix = _ints(getattr(fb, "extend_prefix_lens_cpu", None)) or _ints(getattr(fb, "extend_prefix_lens", None))
    starts = []
    s = 0
    for n in lens:
        starts.append(s)
        s += n
    if not prefix:
        prefix = [0] * len(lens)
    return starts, lens, prefix


def row_rids(fb: Any, n_rows: int | None = None) -> list[str | None]:
    """The request id of every row of a ForwardBatch's token axis (None: padding / no request), from CPU-side
    fields only (no device sync): what the hook session uses to choose passes and rows."""
    mode = _mode(fb)
    rids = _rids(fb)
    if n_rows is None:
        ids = getattr(fb, "input_ids", None)
        n_rows = int(ids.shape[0]) if ids is not None and hasattr(ids, "shape") else 0
    out: list[str | None] = [None] * n_rows
    if mode == "decode":
        for i, rid in enumerate(rids[:n_rows]):
            out[i] = rid
    elif mode == "extend":
        starts, lens, _ = _extend_layout(fb)
        for rid, s, n in zip(rids, starts, lens):
            for r in range(s, min(s + n, n_rows)):
                out[r] = rid
    return out


def forward_batch_rows(fb: Any, input_ids: Any = None) -> dict:
    """Row identity of one SGLang forward.

    Returns ``{"keys", "positions", "tokens", "logits_rows", "input_logprob_rows"}``: per row of the token
    axis the request id (None for padding), the absolute position and the token id; the rows of
    ``next_token_logits`` (one per request: the last row of each request in EXTEND, row i in DECODE); the
    rows of ``input_token_logprobs`` when the pass computes them (-1: an entry that is not joined, see the
    module docstring)."""
    ids = input_ids if input_ids is not None else getattr(fb, "input_ids", None)
    tokens = _ints(ids)
    n = len(tokens)
    keys: list[str | None] = [None] * n
    pos = [0] * n
    mode = _mode(fb)
    rids = _rids(fb)
    logits_rows: list[int] = []
    lp_rows: list[int] | None = None
    if mode == "decode":
        seq = getattr(fb, "seq_lens_cpu", None)
        p = [v - 1 for v in _ints(seq)] if seq is not None else _ints(getattr(fb, "positions", None))
        for i, rid in enumerate(rids[:n]):
            keys[i] = rid
            pos[i] = int(p[i])
        logits_rows = list(range(min(len(rids), n)))
    elif mode == "extend":
        starts, lens, prefix = _extend_layout(fb)
        for rid, s, k, pre in zip(rids, starts, lens, prefix):
            for j in range(k):
                if s + j < n:
                    keys[s + j] = rid
                    pos[s + j] = pre + j
            logits_rows.append(s + k - 1)
        if getattr(fb, "return_logprob", False):
            lp_start = _ints(getattr(fb, "extend_logprob_start_lens_cpu", None)) or [0] * len(lens)
            lp_rows = []
            for s, k, st in zip(starts, lens, lp_start):
                entries = list(range(s + st, s + k))
                if entries:
                    entries[-1] = -1
                lp_rows.extend(entries)
    return {"keys": keys, "positions": pos, "tokens": tokens, "logits_rows": logits_rows,
            "input_logprob_rows": lp_rows, "mode": mode}


_RID_RE = re.compile(r"^(\d+)-(\d+)$")


def parse_sample_rid(rid: str | None) -> tuple[int, int] | None:
    """``"{rollout_id}-{sample_index}"`` (the rid slime's integration gives traced samples) -> the two ints."""
    if rid is None:
        return None
    m = _RID_RE.match(str(rid))
    return (int(m.group(1)), int(m.group(2))) if m else None


# ---------------------------------------------------------------- this process's parallel coordinates

def _par(name: str) -> int | None:
    """A parallel coordinate of this SGLang process (``tp_rank``, ``tp_size``, ``pp_rank``, ...): SGLang's
    ``get_parallel()`` (0.5.2x), else the older ``parallel_state`` getters; None when not initialised."""
    try:
        from sglang.srt.runtime_context import get_parallel
        v = getattr(get_parallel(), name)
        if v is not None:
            return int(v)
    except Exception:  # noqa: BLE001 - older SGLang, or not published
        pass
    old = {"tp": "tensor_model_parallel", "pp": "pipeline_model_parallel", "attn_tp": "attn_tensor_model_parallel",
           "moe_ep": "moe_expert_parallel", "moe_tp": "moe_tensor_parallel"}
    kind, what = name.rsplit("_", 1)
    try:
        import warnings

        from sglang.srt.distributed import parallel_state as ps
        fn = getattr(ps, f"get_{old[kind]}_{'rank' if what == 'rank' else 'world_size'}")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            return int(fn())
    except Exception:  # noqa: BLE001
        return None


def _tp() -> tuple[int, int]:
    return _par("tp_size") or 1, _par("tp_rank") or 0
