"""Group-limited top-k (DeepSeek-V3 / GLM-4.5 routers, `n_group` > 1), in float64.

The experts are split into `n_group` equal groups; a group's score is the sum of its two best choice scores
(sigmoid + correction bias); only the `topk_group` best groups stay eligible, and the top-k is taken among
their experts (HF's `DeepseekV3TopkRouter.forward`, transformers 5.24). The weights are not affected: they
are the chosen experts' scores without the bias (reference.route).
"""
from __future__ import annotations

import math

import torch

from .model_spec import ModelSpec


class GroupedTopkError(ValueError):
    """The config's groups do not divide the experts, or hold fewer than the two experts a group's score sums."""


def eligible_choice(choice: torch.Tensor, spec: ModelSpec) -> torch.Tensor:
    """`choice` [rows, E] with every expert outside the `topk_group` best groups set to -inf."""
    g, e = spec.n_group, choice.shape[-1]
    if g <= 1:
        return choice
    if e % g or e // g < 2 or not 1 <= spec.topk_group <= g:
        raise GroupedTopkError(f"n_group {g} / topk_group {spec.topk_group} do not fit {e} experts (equal groups "
                               "of at least 2, topk_group from 1 to n_group)")
    grouped = choice.reshape(choice.shape[0], g, e // g)
    group_score = grouped.topk(2, dim=-1).values.sum(-1)
    keep = torch.zeros_like(group_score, dtype=torch.bool)
    keep.scatter_(1, group_score.topk(spec.topk_group, dim=-1).indices, True)
    return grouped.masked_fill(~keep[..., None], -math.inf).reshape_as(choice)
