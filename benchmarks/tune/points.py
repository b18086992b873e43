"""The search: every variant's trials are the points of one scrambled Halton sequence (quasi-random, as AlgoPerf's
external tuning), mapped onto its own search space. Point i is the same draw for every variant with as many tuned
keys, whatever the order in which trials finish, the number of workers or of machines: no method gets a smarter
search, and a study continued to more trials extends the same sequence."""

from __future__ import annotations

import math

import optuna
from optuna.distributions import BaseDistribution, FloatDistribution
from optuna.samplers import BaseSampler
from scipy.stats import qmc

from benchmarks.compare.variants import Knob
from utils.config import Config

SEQUENCE_SEED = 0  # the Halton sequence's scrambling: fixed, so that every study walks the same points


def unit_point(index: int, dims: int) -> list[float]:
    """Point `index` (0-based) of the scrambled Halton sequence in [0, 1)^dims."""
    halton = qmc.Halton(d=dims, scramble=True, seed=SEQUENCE_SEED)
    if index:
        halton.fast_forward(index)
    return [float(u) for u in halton.random(1)[0]]


def distributions(space: tuple[Knob, ...], cfg: Config) -> dict[str, FloatDistribution]:
    """Each tuned key's range in this regime (relative knobs scale with the value cfg runs)."""
    return {k.key: FloatDistribution(*k.bounds(cfg), log=k.log) for k in space}


def point_params(index: int, space: tuple[Knob, ...], cfg: Config) -> dict[str, float]:
    """The run.py values of point `index`: the unit point mapped uniformly (or log-uniformly) into each range, to 4
    significant digits (what the override says is what ran)."""
    params = {}
    for u, (key, dist) in zip(unit_point(index, len(space)), distributions(space, cfg).items()):
        low, high = (math.log(dist.low), math.log(dist.high)) if dist.log else (dist.low, dist.high)
        value = low + u * (high - low)
        value = float(f"{math.exp(value) if dist.log else value:.4g}")
        params[key] = min(max(value, dist.low), dist.high)
    return params


class PointSampler(BaseSampler):
    """Optuna's sampler interface over the sequence: a trial labelled with its point (user attr "point") gets that
    point's values, so Optuna records each trial's parameters and distributions as its own."""

    def __init__(self, space: tuple[Knob, ...], cfg: Config) -> None:
        self.space, self.cfg = space, cfg

    def infer_relative_search_space(self, study, trial) -> dict[str, BaseDistribution]:
        return {}

    def sample_relative(self, study, trial, search_space) -> dict:
        return {}

    def sample_independent(self, study: optuna.Study, trial: optuna.trial.FrozenTrial, param_name: str,
                           param_distribution: BaseDistribution) -> float:
        return point_params(trial.user_attrs["point"], self.space, self.cfg)[param_name]
