"""The score space an MoE router chooses its experts in, so that a flip's margin is measured where the choice is made.

A router's recorded point is its logits; the top-k is taken on something else:
- softmax routers (Qwen, Mixtral, OLMoE, GPT-OSS): on the probabilities, a monotone map of the logits, so the
  margin between the k-th and the next expert is read on the logits themselves, against the logits' error;
- sigmoid routers (DeepSeek-V3, GLM-4.5, Kimi-K2): on sigmoid(logits) + a selection-only bias (the
  score-correction bias, updated during training), inside the `topk_group` best of `n_group` expert groups
  (a group scored by the sum of its best `group_top` choice scores). Read on the raw logits, two experts
  whose biases differ look far apart although their choice scores are tied, and a clean pair's rounding flip
  reads "unexplained"; so the margin is taken on the choice scores, against the error a logit error makes
  of them.

The facts come from side A's model description (adapters' `describe()`: `router_scoring`,
`router_selection_bias` per layer, `router_n_group`, `router_topk_group`, `router_group_top`). A trace that
states a sigmoid router but not its bias gives margins on sigmoid(logits) alone, and says so (`space`).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Unit roundoff of the dtype a side may hold its choice scores in (Megatron rounds sigmoid(logits) to the
# logits' dtype before adding the bias): the score error a rounding of the scores alone makes.
_UNIT_ROUNDOFF = {"float64": 2.0 ** -53, "float32": 2.0 ** -24, "bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}
_SIGMOID_SLOPE = 0.25      # the largest d sigmoid / d logit: a logit error e moves a score by at most e / 4


@dataclass(frozen=True)
class RouterChoice:
    """How one layer's router turns its logits into the scores its top-k is taken on."""
    scoring: str = "softmax"             # "softmax" | "sigmoid"
    bias: np.ndarray | None = None       # [E] selection-only bias (float64), or None
    n_group: int = 1
    topk_group: int = 1
    group_top: int = 2                   # a group's score: the sum of its best `group_top` choice scores
    bias_missing: bool = False           # the trace states other layers' biases but not this one's (a
                                         # pipeline stage's manifest): margins without it, and said so

    @property
    def space(self) -> str:
        """Where the margins are taken, as the report names it."""
        if self.scoring != "sigmoid":
            return "logits"
        return ("sigmoid" + ("+bias" if self.bias is not None else "") + (" in groups" if self.n_group > 1 else "")
                + (" (this layer's selection bias is not in the trace)" if self.bias_missing else ""))

    def scores(self, logits: np.ndarray) -> np.ndarray:
        """[rows, E] float64 scores the top-k compares (before the group limit)."""
        x = logits.astype(np.float64)
        if self.scoring != "sigmoid":
            return x
        with np.errstate(over="ignore"):
            s = 1.0 / (1.0 + np.exp(-x))
        return s + self.bias if self.bias is not None else s

    def score_error(self, logit_error: np.ndarray, dtype: str | None) -> np.ndarray:
        """Per row: how far the choice scores can move for that row's router-logit error (max |a-b|): the
        logits' error itself on the logits; through the sigmoid's slope, plus a rounding of the scores to the
        logits' dtype, on sigmoid scores."""
        err = np.asarray(logit_error, dtype=np.float64)
        if self.scoring != "sigmoid":
            return err
        return _SIGMOID_SLOPE * err + _UNIT_ROUNDOFF.get(dtype or "", 2.0 ** -8)

    def _groups_fit(self, e: int) -> bool:
        return self.n_group > 1 and e % self.n_group == 0 and e // self.n_group >= self.group_top \
            and 1 <= self.topk_group < self.n_group

    def _group_scores(self, s: np.ndarray) -> np.ndarray:
        grouped = s.reshape(s.shape[0], self.n_group, -1)
        return -np.sort(-grouped, axis=2)[:, :, :self.group_top].sum(axis=2)

    def _kept(self, s: np.ndarray, gscore: np.ndarray) -> np.ndarray:
        """`s` with every expert outside the `topk_group` best groups (by `gscore`) at -inf."""
        keep = np.zeros_like(gscore, dtype=bool)
        np.put_along_axis(keep, np.argsort(-gscore, axis=1, kind="stable")[:, :self.topk_group], True, axis=1)
        return np.where(np.repeat(keep, s.shape[1] // self.n_group, axis=1), s, -np.inf)

    def eligible(self, logits: np.ndarray) -> np.ndarray:
        """[rows, E] choice scores with every expert outside the kept groups at -inf: the top-k's input."""
        s = self.scores(logits)
        return self._kept(s, self._group_scores(s)) if self._groups_fit(s.shape[1]) else s

    def margins(self, logits: np.ndarray, top: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Per row of side A's logits: the `top` best eligible choice scores, descending (-inf past the eligible
        experts), and with groups the margin between the `topk_group`-th and the next group's score divided by
        `group_top` (a group score sums that many choice scores, so this compares against a choice score's
        error like an expert margin does); None without groups. The scores and group scores are computed
        once (a router point holds every token's row)."""
        s = self.scores(logits)
        group_margin = None
        if self._groups_fit(s.shape[1]):
            gscore = self._group_scores(s)
            order = -np.sort(-gscore, axis=1)
            group_margin = (order[:, self.topk_group - 1] - order[:, self.topk_group]) / self.group_top
            s = self._kept(s, gscore)
        return -np.sort(-s, axis=1)[:, :top], group_margin


def router_choice(config: dict, layer: int | None) -> RouterChoice:
    """Side A's router at `layer`, from its model description (a softmax router where nothing is stated). A
    bias of the wrong width or with a non-finite entry is not used (the margins fall back to the scores
    without it, and `space` says so)."""
    scoring = config.get("router_scoring")
    if scoring != "sigmoid":
        return RouterChoice()
    biases = config.get("router_selection_bias")
    raw = biases.get(str(layer)) if isinstance(biases, dict) else None
    bias = None
    if isinstance(raw, list) and raw and len(raw) == config.get("num_experts"):
        b = np.asarray(raw, dtype=np.float64)
        bias = b if np.isfinite(b).all() else None
    n_group = _count(config.get("router_n_group"), 1)
    return RouterChoice("sigmoid", bias, n_group, _count(config.get("router_topk_group"), n_group),
                        _count(config.get("router_group_top"), 2), bias_missing=bias is None and bool(biases))


def _count(v, default: int) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 1 else default


def selection_bias_differences(config_a: dict, config_b: dict) -> list[tuple[int, list[int]]]:
    """(layer, experts whose selection bias differs) for every MoE layer both sides state a bias of: a router
    that adds another bias chooses other experts from the same logits (an expert bias not synced to the
    engine after a training step is this)."""
    out = []
    a, b = config_a.get("router_selection_bias"), config_b.get("router_selection_bias")
    if not (isinstance(a, dict) and isinstance(b, dict)):
        return out
    for key in sorted(set(a) & set(b), key=lambda k: (len(k), k)):
        ba, bb = np.asarray(a[key], dtype=np.float64), np.asarray(b[key], dtype=np.float64)
        if key.isdigit() and ba.shape == bb.shape:
            experts = np.flatnonzero((ba != bb) & ~(np.isnan(ba) & np.isnan(bb))).tolist()
            if experts:
                out.append((int(key), experts))
    return out

