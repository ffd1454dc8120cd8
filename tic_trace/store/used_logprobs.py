"""The log-probs a side actually used, per token, with what it says it applied to compute them (issue 37).

slime's `train_rollout_logprob_abs_diff` compares two such lists: the log-probs SGLang *returned*
(`meta_info.output_token_logprobs`, computed under the request's sampling parameters) and the log-probs the
trainer computed (`compute_log_prob`: logits / `rollout_temperature`, then log-softmax). A trace's own Δ logprob
is its log-softmax of each side's traced logits; these records let the comparison reconcile the two numbers.

Rows are keyed like the trace's rows: the sample key (`f"{rollout_id}-{sample.index}"`, SGLang's request id and
Megatron's packed-segment key) and the position, in the sample's token sequence, of the token whose log-prob it
is (its logits are the row at `position - 1`).

numpy only: both the record flow (writing) and the answer flow (reading) use it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class Sampling:
    """What a side says it applied to the logits before taking the log-prob it used. `None`: not known (the
    comparison then names it unknown, never assumes the default)."""
    temperature: float | None = 1.0
    top_p: float | None = 1.0
    top_k: int | None = -1          # -1 or 0: off
    min_p: float | None = 0.0
    source: str = ""                # where the numbers came from, e.g. "sglang meta_info.output_token_logprobs"
    extra: dict = field(default_factory=dict)   # other stated parameters (str -> str | float | int | bool)


@dataclass(frozen=True)
class UsedLogprobs:
    """One sample's used log-probs on one side."""
    sample: str                     # the sample key, as the trace's rows
    positions: np.ndarray           # int64 [n]: the position of each token whose log-prob this is
    tokens: np.ndarray              # int64 [n]: its token id
    logprobs: np.ndarray            # float64 [n]: the log-prob the side used
    sampling: Sampling

    def __post_init__(self) -> None:
        n = len(self.positions)
        if len(self.tokens) != n or len(self.logprobs) != n:
            raise ValueError(f"sample {self.sample!r}: {n} positions, {len(self.tokens)} tokens and "
                             f"{len(self.logprobs)} log-probs; one of each per token")
