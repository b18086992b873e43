"""Adaptive batch-size tests (paper section 3.3; Byrd et al. 2012, Bollapragada et al. 2017, AdAdaGrad).

Each test looks at the gradient samples of one trainer (`GradientSamples`: rows g_i, each the mean
gradient over b_i examples, and a group id per row), or at their sums (`GradientStatistics`, which
nodes can build without exchanging gradients), and returns the batch each node should request next.

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
class GradientStatistics:
    """What every test needs, as sums over a trainer's samples (d_i = g_i - mean of g_i's group).

    Built directly from the samples (`statistics_of`, the simulated cluster), or from sums each node
    computes on its own samples and a reduction adds up (`NodeGradientSums`: one vector all-reduce of
    the b-weighted gradient sum plus scalars, so no node ever holds another node's gradients).
    """

    mean: torch.Tensor  # [P] b-weighted mean of all samples (fp64)
    sq_norm: float  # ||mean||^2
    weighted_dev: float  # sum_i b_i ||d_i||^2
    plain_dev: float  # sum_i ||d_i||^2 (logged as sum_sq_diffs)
    inner: float  # sum_i b_i <d_i, mean>^2
    ortho_dev: float  # sum_i b_i ||d_i - <d_i, mean> / ||mean||^2 mean||^2
    dof: int  # n - number of groups


def statistics_of(samples: GradientSamples) -> GradientStatistics:
    g = samples.grads.double()
    b = samples.batch_sizes.double()
    mean = (b[:, None] * g).sum(0) / b.sum()
    d = torch.empty_like(g)
    groups = samples.groups.tolist()
    for group in sorted(set(groups)):
        rows = torch.tensor([i for i, x in enumerate(groups) if x == group])
        group_mean = (b[rows, None] * g[rows]).sum(0) / b[rows].sum()
        d[rows] = g[rows] - group_mean
    sq_norm = float(mean @ mean)
    sq_dev = (d**2).sum(dim=1)
    inner = d @ mean  # <d_i, g>
    residual = d - (inner / sq_norm)[:, None] * mean[None, :] if sq_norm > 0 else d
    return GradientStatistics(mean, sq_norm, float((b * sq_dev).sum()), float(sq_dev.sum()),
                              float((b * inner**2).sum()), float((b * (residual**2).sum(dim=1)).sum()),
                              len(groups) - len(set(groups)))


@dataclass
class NodeGradientSums:
    """One node's share of a trainer's GradientStatistics: sums that add up across nodes.

    within_node: the node's samples form their own group (the micro_batches estimator), so its
    deviations are measured here; otherwise all of a trainer's samples form one group (the nodes
    estimator) and the deviations follow from the totals: sum b ||g - m||^2 = sum b ||g||^2 - B ||m||^2.
    The inner-product term needs the trainer's mean first: a second, scalar reduction (`inner_sum`).
    """

    weighted_sum: torch.Tensor  # [P] sum_i b_i g_i (fp64)
    plain_sum: torch.Tensor | None  # [P] sum_i g_i; None within_node (the deviations are measured here)
    batch: float  # sum_i b_i
    weighted_sq: float  # sum_i b_i ||g_i||^2
    plain_sq: float  # sum_i ||g_i||^2
    count: int  # samples
    groups: int  # groups measured here (within_node: 1 per node with samples)
    weighted_dev: float  # within_node: sum_i b_i ||g_i - node mean||^2
    plain_dev: float

    @classmethod
    def of(cls, grads: torch.Tensor, batch_sizes: torch.Tensor, within_node: bool) -> NodeGradientSums:
        # fp64, in as few passes over the [k, P] samples as possible (matmuls and norms, no squares kept)
        g, b = grads.double(), batch_sizes.to(grads.device, torch.float64)
        weighted_sum = b @ g
        weighted_dev = plain_dev = 0.0
        if within_node:
            sq_dev = torch.linalg.vector_norm(g - weighted_sum / b.sum(), dim=1) ** 2
            weighted_dev, plain_dev = float((b * sq_dev).sum()), float(sq_dev.sum())
        sq = torch.linalg.vector_norm(g, dim=1) ** 2
        return cls(weighted_sum, None if within_node else g.sum(0), float(b.sum()), float((b * sq).sum()),
                   float(sq.sum()), len(b), int(within_node), weighted_dev, plain_dev)

    # What crosses the network, in two reductions (SUM): first the vectors and the batch, in the wire dtype
    # of statistics_comm (the batch is a small whole number, exact in fp32); then, once the trainer's
    # mean is known, the scalars and this node's inner sum, always fp64 (the nodes estimator subtracts
    # two of them, which fp32 would not survive).
    def vectors(self, wire: torch.dtype = torch.float64) -> torch.Tensor:
        """[weighted_sum, plain_sum (nodes estimator only), batch] in the wire dtype."""
        vectors = [self.weighted_sum] + ([self.plain_sum] if self.plain_sum is not None else [])
        batch = torch.tensor([self.batch], dtype=torch.float64, device=self.weighted_sum.device)
        return torch.cat([*vectors, batch]).to(wire)

    @staticmethod
    def vectors_size(numel: int, within_node: bool) -> int:
        return numel * (1 if within_node else 2) + 1

    SCALARS = 7  # weighted_sq, plain_sq, count, groups, weighted_dev, plain_dev, inner

    def scalars(self, inner: float) -> torch.Tensor:
        return torch.tensor([self.weighted_sq, self.plain_sq, self.count, self.groups, self.weighted_dev,
                             self.plain_dev, inner], dtype=torch.float64)

    @staticmethod
    def reduced_mean(vectors: torch.Tensor, within_node: bool) -> torch.Tensor:
        """The trainer's b-weighted mean from the summed vectors (fp64)."""
        p = (vectors.numel() - 1) // (1 if within_node else 2)
        vectors = vectors.double()
        return vectors[:p] / vectors[-1]

    @classmethod
    def from_reduced(cls, vectors: torch.Tensor, scalars: torch.Tensor,
                     within_node: bool) -> tuple[NodeGradientSums, float]:
        """The trainer's summed shares and summed inner sums, from the two reduced buffers."""
        p = (vectors.numel() - 1) // (1 if within_node else 2)
        vectors = vectors.double()
        weighted_sq, plain_sq, count, groups, weighted_dev, plain_dev, inner = scalars.tolist()
        total = cls(vectors[:p], None if within_node else vectors[p:2 * p], float(vectors[-1]), weighted_sq, plain_sq,
                    round(count), round(groups), weighted_dev, plain_dev)
        return total, inner

    def inner_sum(self, grads: torch.Tensor, batch_sizes: torch.Tensor, mean: torch.Tensor,
                  within_node: bool) -> float:
        """This node's sum_i b_i <d_i, mean>^2, given the trainer's mean."""
        g, b = grads.double(), batch_sizes.to(grads.device, torch.float64)
        group_mean = self.weighted_sum / self.batch if within_node else mean
        return float((b * (g @ mean - group_mean @ mean) ** 2).sum())  # <g_i - group mean, mean>, no [k, P] temporary

    def statistics(self, inner: float, within_node: bool) -> GradientStatistics:
        """The trainer's statistics from the summed node shares (self) and the summed inner sums."""
        mean = self.weighted_sum / self.batch
        sq_norm = float(mean @ mean)
        if within_node:
            weighted_dev, plain_dev, dof = self.weighted_dev, self.plain_dev, self.count - self.groups
        else:
            weighted_dev = self.weighted_sq - self.batch * sq_norm
            plain_dev = self.plain_sq - 2 * float(mean @ self.plain_sum) + self.count * sq_norm
            dof = self.count - 1
        ortho_dev = weighted_dev - inner / sq_norm if sq_norm > 0 else weighted_dev
        return GradientStatistics(mean, sq_norm, weighted_dev, plain_dev, inner, ortho_dev, dof)


STATISTICS_WIRE = {"fp64": torch.float64, "fp32": torch.float32, "sketch": torch.float64}  # statistics_comm


def statistics_payload_bytes(numel: int, within_node: bool, wire: torch.dtype = torch.float64) -> int:
    """Bytes one node puts into its trainer's two statistics reductions (numel: length of a sample)."""
    element = torch.empty(0, dtype=wire).element_size()
    return NodeGradientSums.vectors_size(numel, within_node) * element + NodeGradientSums.SCALARS * 8


def trainer_statistics(node_samples: list[tuple[torch.Tensor, torch.Tensor]], within_node: bool,
                       wire: torch.dtype = torch.float64) -> GradientStatistics:
    """A trainer's statistics from its nodes' samples (each on its node's device), in one process: the
    same two reductions as across processes (vectors in the wire dtype, then the fp64 scalars), added in
    node order on the first node's device, so no sample is stacked or copied to the host."""
    node_samples = [(g.double(), b) for g, b in node_samples]  # once: both passes below read fp64
    shares = [NodeGradientSums.of(g, b, within_node) for g, b in node_samples]
    device = shares[0].weighted_sum.device
    vectors = shares[0].vectors(wire)
    for share in shares[1:]:
        vectors = vectors + share.vectors(wire).to(device)
    mean = NodeGradientSums.reduced_mean(vectors, within_node)
    scalars = None
    for share, (g, b) in zip(shares, node_samples):
        part = share.scalars(share.inner_sum(g, b, mean.to(g.device), within_node))
        scalars = part if scalars is None else scalars + part
    total, inner = NodeGradientSums.from_reduced(vectors, scalars, within_node)
    return total.statistics(inner, within_node)


class BatchTest(ABC):
    name: str
    uses_statistics = True  # False: the decision ignores the gradient statistics (they are only logged)

    def __init__(self, max_batch: int = 1 << 30) -> None:
        self.max_batch = max_batch

    def __call__(self, samples: GradientSamples | GradientStatistics | None, current: int, num_nodes: int,
                 tokens_seen: int = 0) -> BatchDecision:
        """The next requested batch from this round's gradient samples or their statistics (None: keep the batch)."""
        if samples is None:
            return BatchDecision(current, {})
        dev = statistics_of(samples) if isinstance(samples, GradientSamples) else samples
        if dev.dof < 1:
            return BatchDecision(current, {})  # one sample per group has no variance: keep the batch
        if dev.sq_norm < _MIN_SQ_NORM:
            return BatchDecision(current, {"grad_sq_norm": dev.sq_norm})
        target, stats = self.target(dev, max(1, num_nodes))
        stats["grad_sq_norm"] = dev.sq_norm
        stats["T_k"] = target
        asked = max(current, math.ceil(target - 1e-9))
        stats["test_requested_batch"] = asked  # before the cap: what the test itself asked for
        return BatchDecision(int(min(self.max_batch, asked)), stats)

    @abstractmethod
    def target(self, dev: GradientStatistics, num_nodes: int) -> tuple[float, dict[str, float]]:
        """The batch size the test asks for (before rounding, monotonicity and the cap)."""


class NormTest(BatchTest):
    """b >= sigma^2 / (M * eta^2 * ||g||^2), sigma^2 the per-example gradient variance (paper eq. 10)."""

    name = "norm_test"

    def __init__(self, eta: float, max_batch: int = 1 << 30) -> None:
        super().__init__(max_batch)
        self.eta = eta

    def target(self, dev, num_nodes):
        variance = dev.weighted_dev / dev.dof
        target = variance / (num_nodes * self.eta**2 * dev.sq_norm)
        return target, {"variance": variance, "sum_sq_diffs": dev.plain_dev}


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
        sq_norm = dev.sq_norm
        inner_variance = dev.inner / dev.dof
        ortho_variance = dev.ortho_dev / dev.dof
        t_ip = inner_variance / (num_nodes * self.vartheta**2 * sq_norm**2)
        t_ortho = ortho_variance / (num_nodes * self.nu**2 * sq_norm)
        stats = {"inner_variance": inner_variance, "ortho_variance": ortho_variance, "T_ip": t_ip,
                 "T_ortho": t_ortho}
        return max(t_ip, t_ortho), stats


def logged_only(stats: dict[str, float]) -> dict[str, float]:
    """A schedule that is not a test logs the norm test's statistics, but nothing it asked for: its batch is
    never the test's, so no request of the test was capped."""
    return {k: v for k, v in stats.items() if k != "test_requested_batch"}


class ConstantBatch(BatchTest):
    """No adaptation; still reports the norm-test statistics for comparison."""

    name = "constant"
    uses_statistics = False

    def __init__(self, eta: float, max_batch: int = 1 << 30) -> None:
        super().__init__(max_batch)
        self._norm = NormTest(eta, max_batch)

    def __call__(self, samples, current, num_nodes, tokens_seen=0):
        return BatchDecision(current, logged_only(self._norm(samples, current, num_nodes).stats))

    def target(self, dev, num_nodes):  # pragma: no cover - unused
        raise NotImplementedError


class LinearRampup(BatchTest):
    """A batch-size warmup baseline (Megatron's rampup-batch-size; Merrill et al. 2025): not a test.

    The batch grows linearly with the tokens the run has seen, from `start` to `max_batch` at
    `rampup_tokens`, in whole examples (floor), and never shrinks. Reports the norm-test statistics.
    """

    name = "linear_rampup"
    uses_statistics = False

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
        stats = logged_only(self._norm(samples, current, num_nodes).stats)
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
