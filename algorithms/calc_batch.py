"""Adaptive batch-size tests (paper section 3.3; Byrd et al. 2012, Bollapragada et al. 2017, AdAdaGrad).

Each test looks at `n` gradient samples g_1..g_n of one trainer (rows of `grads`, each the mean
gradient over `sample_batch` examples) and returns the batch each node should request next.

Per-example variance is estimated from batch gradients: Var[g_example] ~= sample_batch * Var[g_row].
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
class BatchDecision:
    requested_batch: int
    stats: dict[str, float] = field(default_factory=dict)


class BatchTest(ABC):
    name: str

    def __init__(self, max_batch: int = 1 << 30) -> None:
        self.max_batch = max_batch

    def __call__(self, grads: torch.Tensor | None, sample_batch: float, current: int, num_nodes: int) -> BatchDecision:
        """grads: [n, P] gradient samples (float64 is used inside); returns the next requested batch."""
        if grads is None or grads.shape[0] < 2:
            return BatchDecision(current, {})  # one sample has no variance: keep the batch
        g = grads.double()
        mean = g.mean(dim=0)
        sq_norm = float(mean @ mean)
        if sq_norm < _MIN_SQ_NORM:
            return BatchDecision(current, {"grad_sq_norm": sq_norm})
        target, stats = self.target(g, mean, sq_norm, float(sample_batch), max(1, num_nodes))
        stats["grad_sq_norm"] = sq_norm
        stats["T_k"] = target
        new = min(self.max_batch, max(current, math.ceil(target - 1e-9)))
        return BatchDecision(int(new), stats)

    @abstractmethod
    def target(self, g: torch.Tensor, mean: torch.Tensor, sq_norm: float, sample_batch: float,
               num_nodes: int) -> tuple[float, dict[str, float]]:
        """The batch size the test asks for (before rounding, monotonicity and the cap)."""


class NormTest(BatchTest):
    """b >= sigma^2 / (M * eta^2 * ||g||^2), sigma^2 the per-example gradient variance (paper eq. 10)."""

    name = "norm_test"

    def __init__(self, eta: float, max_batch: int = 1 << 30) -> None:
        super().__init__(max_batch)
        self.eta = eta

    def target(self, g, mean, sq_norm, sample_batch, num_nodes):
        sum_sq_diffs = float(((g - mean) ** 2).sum())
        variance = sample_batch * sum_sq_diffs / (g.shape[0] - 1)
        target = variance / (num_nodes * self.eta**2 * sq_norm)
        return target, {"variance": variance, "sum_sq_diffs": sum_sq_diffs}


class AugmentedInnerProductTest(BatchTest):
    """Inner-product term with vartheta and orthogonality term with nu (Bollapragada et al. 2017, eq. 13).

    T_ip    = Var_i(<g_i, g>)            / (M * vartheta^2 * ||g||^4)
    T_ortho = E_i ||g_i - <g_i,g>/||g||^2 g||^2 / (M * nu^2 * ||g||^2)
    both with per-example variances (sample_batch times the variance of the batch gradients).
    """

    name = "augmented_inner_product_test"

    def __init__(self, vartheta: float, nu: float, max_batch: int = 1 << 30) -> None:
        super().__init__(max_batch)
        self.vartheta = vartheta
        self.nu = nu

    def target(self, g, mean, sq_norm, sample_batch, num_nodes):
        n = g.shape[0]
        inner = g @ mean  # <g_i, g>
        inner_variance = sample_batch * float(((inner - inner.mean()) ** 2).sum()) / (n - 1)
        residual = g - (inner / sq_norm)[:, None] * mean[None, :]
        ortho_variance = sample_batch * float((residual**2).sum()) / (n - 1)
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

    def __call__(self, grads, sample_batch, current, num_nodes):
        decision = self._norm(grads, sample_batch, current, num_nodes)
        return BatchDecision(current, decision.stats)

    def target(self, g, mean, sq_norm, sample_batch, num_nodes):  # pragma: no cover - unused
        raise NotImplementedError


BATCH_TESTS = {cls.name: cls for cls in (NormTest, AugmentedInnerProductTest, ConstantBatch)}


def build_batch_test(name: str, *, eta: float, vartheta: float, nu: float, max_batch: int) -> BatchTest:
    if name not in BATCH_TESTS:
        raise ValueError(f"unknown sampling_method '{name}'; choose from {', '.join(BATCH_TESTS)}")
    if name == AugmentedInnerProductTest.name:
        return AugmentedInnerProductTest(vartheta, nu, max_batch)
    return BATCH_TESTS[name](eta, max_batch)
