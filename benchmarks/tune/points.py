"""The search: each study's trials are the points of its own scrambled Halton sequence (quasi-random, as AlgoPerf's
external tuning), mapped onto its own search space, every knob at once. The sequence's scrambling is seeded by the
study's variant (design_seed), so two studies draw different points (no lr of one method is paired with the same
ETA, momentum or batch as another's), while point i of a study is the same draw whatever the order in which trials
finish, the number of workers or of machines; a study continued to more trials extends its own sequence. A discrete
knob (choices) takes the choice whose share of [0, 1) holds the point's coordinate."""

from __future__ import annotations

import hashlib
import math

import optuna
from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution
from optuna.samplers import BaseSampler
from scipy.stats import qmc

from benchmarks.compare.variants import Knob
from utils.config import Config

SEQUENCE_SEED = 0  # the scrambling of a design that names no study (tests, hand-made spaces)


def design_seed(variant: str) -> int:
    """A study's own scrambling, from its variant's name: stable across processes and machines (not hash())."""
    return int(hashlib.sha256(variant.encode()).hexdigest()[:8], 16)


def unit_point(index: int, dims: int, seed: int = SEQUENCE_SEED) -> list[float]:
    """Point `index` (0-based) of the scrambled Halton sequence `seed` in [0, 1)^dims."""
    halton = qmc.Halton(d=dims, scramble=True, seed=seed)
    if index:
        halton.fast_forward(index)
    return [float(u) for u in halton.random(1)[0]]


def distributions(space: tuple[Knob, ...], cfg: Config) -> dict[str, BaseDistribution]:
    """Each tuned key's range in this regime (relative knobs scale with the value cfg runs; discrete knobs list their
    choices)."""
    return {k.key: CategoricalDistribution(k.choices) if k.choices else FloatDistribution(*k.bounds(cfg), log=k.log)
            for k in space}


def ends(dist: BaseDistribution) -> tuple[float, float]:
    """A range's two ends (a discrete knob's smallest and largest choice)."""
    if isinstance(dist, CategoricalDistribution):
        return min(dist.choices), max(dist.choices)
    return dist.low, dist.high


def point_params(index: int, space: tuple[Knob, ...], cfg: Config, seed: int = SEQUENCE_SEED) -> dict[str, float]:
    """The run.py values of point `index`: the unit point mapped uniformly (or log-uniformly) into each range, to 4
    significant digits (what the override says is what ran); a discrete knob's choice by the coordinate's share."""
    params = {}
    for u, (key, dist) in zip(unit_point(index, len(space), seed), distributions(space, cfg).items()):
        if isinstance(dist, CategoricalDistribution):
            params[key] = dist.choices[min(int(u * len(dist.choices)), len(dist.choices) - 1)]
            continue
        low, high = (math.log(dist.low), math.log(dist.high)) if dist.log else (dist.low, dist.high)
        value = low + u * (high - low)
        value = float(f"{math.exp(value) if dist.log else value:.4g}")
        params[key] = min(max(value, dist.low), dist.high)
    return params


class PointSampler(BaseSampler):
    """Optuna's sampler interface over a study's sequence: a trial labelled with its point (user attr "point") gets
    that point's values, so Optuna records each trial's parameters and distributions as its own."""

    def __init__(self, space: tuple[Knob, ...], cfg: Config, seed: int = SEQUENCE_SEED) -> None:
        self.space, self.cfg, self.seed = space, cfg, seed

    def infer_relative_search_space(self, study, trial) -> dict[str, BaseDistribution]:
        return {}

    def sample_relative(self, study, trial, search_space) -> dict:
        return {}

    def sample_independent(self, study: optuna.Study, trial: optuna.trial.FrozenTrial, param_name: str,
                           param_distribution: BaseDistribution) -> float:
        return point_params(trial.user_attrs["point"], self.space, self.cfg, self.seed)[param_name]
