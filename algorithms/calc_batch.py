"""Adaptive batch-size tests (paper section 3.3; Byrd et al. 2012, Bollapragada et al. 2017, AdAdaGrad).

Each test looks at the gradient samples of one trainer (`GradientSamples`: rows g_i, each the mean
gradient over b_i examples, and a group id per row) and returns the batch each node should request next.

Estimating the per-example variance sigma^2 from batch gradients of unequal sizes: Var[g_i] = sigma^2 / b_i,
so with d_i = g_i - (b-weighted mean of g_i's group),

    sigma^2 ~= sum_i b_i ||d_i||^2 / (n - number of groups)

is unbiased (each group loses one degree of freedom to its own mean). The variance is pooled *within*
groups: the micro_batches estimator puts each node's chunks in its own group, so the drift between
nodes (different local iterates) is not counted as noise; the nodes estimator (the paper's) has one
sample per node in a single group, so it counts that drift too. The gradient g itself is the
b-weighted mean of all rows (the gradient over every example seen).

A trainer averages the work of `num_nodes` nodes, so the averaged gradient's variance shrinks by
num_nodes as well (Lau et al. 2024a, local SGD with adaptive batches) -- hence the division by M.
Batches never shrink (as in AdAdaGrad and the authors' code) and are capped at `max_batch`.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

# Below this squared norm the mean gradient carries no direction; the tests would divide by ~0.
_MIN_SQ_NORM = 1e-20


@dataclass
class GradientSamples:
    grads: torch.Tensor  # [n, P] gradient samples
    batch_sizes: torch.Tensor  # [n] examples behind each sample
    groups: torch.Tensor  # [n] group id of each sample; variance is pooled around each group's own mean

    def __post_init__(self) -> None:
        n = self.grads.shape[0]
        if self.batch_sizes.shape != (n,) or self.groups.shape != (n,):
            raise ValueError(f"{n} gradient samples need {n} batch sizes and {n} group ids")


@dataclass
class BatchDecision:
    requested_batch: int
    stats: dict[str, float] = field(default_factory=dict)


@dataclass
class Deviations:
    """What every test needs: the mean gradient and each sample's deviation from its group mean."""

    mean: torch.Tensor  # [P] b-weighted mean of all samples
    sq_norm: float  # ||mean||^2
    deviations: torch.Tensor  # [n, P] g_i - mean of g_i's group
    batch_sizes: torch.Tensor  # [n] float64
    dof: int  # n - number of groups


def deviations(samples: GradientSamples) -> Deviations:
    g = samples.grads.double()
    b = samples.batch_sizes.double()
    mean = (b[:, None] * g).sum(0) / b.sum()
    d = torch.empty_like(g)
    groups = samples.groups.tolist()
    for group in sorted(set(groups)):
        rows = torch.tensor([i for i, x in enumerate(groups) if x == group])
        group_mean = (b[rows, None] * g[rows]).sum(0) / b[rows].sum()
        d[rows] = g[rows] - group_mean
    return Deviations(mean, float(mean @ mean), d, b, len(groups) - len(set(groups)))


class BatchTest(ABC):
    name: str

    def __init__(self, max_batch: int = 1 << 30) -> None:
        self.max_batch = max_batch

    def __call__(self, samples: GradientSamples | None, current: int, num_nodes: int,
                 tokens_seen: int = 0) -> BatchDecision:
        """The next requested batch from this round's gradient samples (None: no samples, keep the batch)."""
        if samples is None:
            return BatchDecision(current, {})
        dev = deviations(samples)
        if dev.dof < 1:
            return BatchDecision(current, {})  # one sample per group has no variance: keep the batch
        if dev.sq_norm < _MIN_SQ_NORM:
            return BatchDecision(current, {"grad_sq_norm": dev.sq_norm})
        target, stats = self.target(dev, max(1, num_nodes))
        stats["grad_sq_norm"] = dev.sq_norm
        stats["T_k"] = target
        new = min(self.max_batch, max(current, math.ceil(target - 1e-9)))
        return BatchDecision(int(new), stats)

    @abstractmethod
    def target(self, dev: Deviations, num_nodes: int) -> tuple[float, dict[str, float]]:
        """The batch size the test asks for (before rounding, monotonicity and the cap)."""


class NormTest(BatchTest):
    """b >= sigma^2 / (M * eta^2 * ||g||^2), sigma^2 the per-example gradient variance (paper eq. 10)."""

    name = "norm_test"

    def __init__(self, eta: float, max_batch: int = 1 << 30) -> None:
        super().__init__(max_batch)
        self.eta = eta

    def target(self, dev, num_nodes):
        sq_dev = (dev.deviations**2).sum(dim=1)
        variance = float((dev.batch_sizes * sq_dev).sum()) / dev.dof
        target = variance / (num_nodes * self.eta**2 * dev.sq_norm)
        return target, {"variance": variance, "sum_sq_diffs": float(sq_dev.sum())}


class AugmentedInnerProductTest(BatchTest):
    """Inner-product term with vartheta and orthogonality term with nu (Bollapragada et al. 2017, eq. 13).

    T_ip    = Var_i(<g_i, g>)            / (M * vartheta^2 * ||g||^4)
    T_ortho = E_i ||g_i - <g_i,g>/||g||^2 g||^2 / (M * nu^2 * ||g||^2)
    both with per-example variances, estimated from the deviations d_i as the norm test does.
    """

    name = "augmented_inner_product_test"

    def __init__(self, vartheta: float, nu: float, max_batch: int = 1 << 30) -> None:
        super().__init__(max_batch)
        self.vartheta = vartheta
        self.nu = nu

    def target(self, dev, num_nodes):
        b, d, mean, sq_norm = dev.batch_sizes, dev.deviations, dev.mean, dev.sq_norm
        inner = d @ mean  # <d_i, g>
        inner_variance = float((b * inner**2).sum()) / dev.dof
        residual = d - (inner / sq_norm)[:, None] * mean[None, :]
        ortho_variance = float((b * (residual**2).sum(dim=1)).sum()) / dev.dof
        t_ip = inner_variance / (num_nodes * self.vartheta**2 * sq_norm**2)
        t_ortho = ortho_variance / (num_nodes * self.nu**2 * sq_norm)
        stats = {"inner_variance": inner_variance, "ortho_variance": ortho_variance, "T_ip": t_ip,
                 "T_ortho": t_ortho}
        return max(t_ip, t_ortho), stats


class ConstantBatch(BatchTest):
    """No adaptation; still reports the norm-test statistics for comparison."""

    name = "constant"

    def __init__(self, eta: float, max_batch: int = 1 << 30) -> None:
        super().__init__(max_batch)
        self._norm = NormTest(eta, max_batch)

    def __call__(self, samples, current, num_nodes, tokens_seen=0):
        return BatchDecision(current, self._norm(samples, current, num_nodes).stats)

    def target(self, dev, num_nodes):  # pragma: no cover - unused
        raise NotImplementedError


class LinearRampup(BatchTest):
    """A batch-size warmup baseline (Megatron's rampup-batch-size; Merrill et al. 2025): not a test.

    The batch grows linearly with the tokens the run has seen, from `start` to `max_batch` at
    `rampup_tokens`, in whole examples (floor), and never shrinks. Reports the norm-test statistics.
    """

    name = "linear_rampup"

    def __init__(self, eta: float, start: int, rampup_tokens: int, max_batch: int) -> None:
        super().__init__(max_batch)
        if rampup_tokens <= 0:
            raise ValueError("linear_rampup needs rampup_tokens > 0")
        self.start, self.rampup_tokens = start, rampup_tokens
        self._norm = NormTest(eta, max_batch)

    def scheduled(self, tokens_seen: int) -> int:
        progress = min(1.0, tokens_seen / self.rampup_tokens)
        return min(self.max_batch, math.floor(self.start + (self.max_batch - self.start) * progress + 1e-9))

    def __call__(self, samples, current, num_nodes, tokens_seen=0):
        stats = self._norm(samples, current, num_nodes).stats
        return BatchDecision(max(current, self.scheduled(tokens_seen)), stats)

    def target(self, dev, num_nodes):  # pragma: no cover - unused
        raise NotImplementedError


BATCH_TESTS = {cls.name: cls for cls in (NormTest, AugmentedInnerProductTest, ConstantBatch, LinearRampup)}


def build_batch_test(name: str, *, eta: float, vartheta: float, nu: float, max_batch: int, start: int = 1,
                     rampup_tokens: int = 0) -> BatchTest:
    if name not in BATCH_TESTS:
        raise ValueError(f"unknown sampling_method '{name}'; choose from {', '.join(BATCH_TESTS)}")
    if name == AugmentedInnerProductTest.name:
        return AugmentedInnerProductTest(vartheta, nu, max_batch)
    if name == LinearRampup.name:
        return LinearRampup(eta, start, rampup_tokens, max_batch)
    return BATCH_TESTS[name](eta, max_batch)
