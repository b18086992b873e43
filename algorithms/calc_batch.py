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


@dataclass(frozen=True)
class StatisticsWire:
    """How a trainer's batch-test statistics travel (statistics_comm; the derivation: docs/mechanisms.md,
    "The batch tests' statistics on the wire").

    Two reductions (SUM) among the trainer's nodes. First one vector per node: its b-weighted gradient sum
    sum_i b_i g_i and its batch sum_i b_i, in `dtype`, from which every node knows the trainer's mean m. Then
    fp64 scalars that each node measures on its own samples against m:

    minimal (two_vectors False; statistics_comm minimal, and sketch in sketch space): [count, groups,
      sum b ||d||^2, sum ||d||^2, sum b <d, m>^2, sum b <g, m>], d_i = g_i minus its group's mean (the node's
      own: micro_batches; m: nodes). The last scalar gives <m*, m> in fp64 (m* the exact mean, m the one the
      fp32 vector delivered), so ||m*||^2 = 2 <m*, m> - ||m||^2 + ||m* - m||^2 is known to fp64 accuracy
      (the last term is second order in the fp32 rounding).
    reference (two_vectors True; statistics_comm fp64, the exact protocol every earlier result used): the
      nodes estimator sends the plain sum sum_i g_i as a second vector and takes its deviations from totals
      (sum b ||g - m||^2 = sum b ||g||^2 - B ||m||^2); 7 scalars [sum b ||g||^2, sum ||g||^2, count, groups,
      sum b ||d||^2, sum ||d||^2 (micro_batches only), sum b <d, m>^2].
    """

    dtype: torch.dtype = torch.float32
    two_vectors: bool = False

    def vectors_size(self, numel: int, within_node: bool) -> int:
        """Entries of one node's vector reduction (numel: length of a gradient sample)."""
        return numel * (2 if self.two_vectors and not within_node else 1) + 1

    @property
    def scalars_size(self) -> int:
        return 7 if self.two_vectors else 6

    def payload_bytes(self, numel: int, within_node: bool) -> int:
        """Bytes one node puts into its trainer's two statistics reductions."""
        element = torch.empty(0, dtype=self.dtype).element_size()
        return self.vectors_size(numel, within_node) * element + 8 * self.scalars_size

    def reduced_mean(self, vectors: torch.Tensor, within_node: bool) -> torch.Tensor:
        """The trainer's b-weighted mean m from the summed vectors (fp64)."""
        p = (vectors.numel() - 1) // (2 if self.two_vectors and not within_node else 1)
        vectors = vectors.double()
        return vectors[:p] / vectors[-1]

    def statistics(self, vectors: torch.Tensor, scalars: torch.Tensor, within_node: bool) -> GradientStatistics:
        """The trainer's statistics from the two summed buffers."""
        mean = self.reduced_mean(vectors, within_node)
        batch, m_sq = float(vectors[-1]), float(mean @ mean)
        if self.two_vectors:
            weighted_sq, plain_sq, count, groups, weighted_dev, plain_dev, inner = scalars.tolist()
            sq_norm = m_sq
            if not within_node:  # from totals: sum b ||g - m||^2 = sum b ||g||^2 - B ||m||^2, and the plain one
                p = mean.numel()
                plain_sum = vectors.double()[p:2 * p]
                weighted_dev = weighted_sq - batch * sq_norm
                plain_dev = plain_sq - 2 * float(mean @ plain_sum) + count * sq_norm
        else:
            count, groups, weighted_dev, plain_dev, inner, mean_dot = scalars.tolist()
            sq_norm = max(0.0, 2 * mean_dot / batch - m_sq) if batch > 0 else 0.0
        dof = round(count) - (round(groups) if within_node else 1)
        ortho_dev = weighted_dev - inner / sq_norm if sq_norm > 0 else weighted_dev
        return GradientStatistics(mean, sq_norm, weighted_dev, plain_dev, inner, ortho_dev, dof)


REFERENCE_WIRE = StatisticsWire(torch.float64, two_vectors=True)
STATISTICS_WIRE = {  # statistics_comm
    "minimal": StatisticsWire(torch.float32),  # one fp32 vector + 6 fp64 scalars: the default
    "fp64": REFERENCE_WIRE,  # the exact two-vector reference
    "fp32": StatisticsWire(torch.float32, two_vectors=True),  # the reference's vectors in fp32 (superseded)
    "sketch": StatisticsWire(torch.float64),  # the minimal protocol in sketch space (k entries, fp64)
}


@dataclass
class NodeGradientSums:
    """One node's share of its trainer's statistics: the vector it sends, then (`scalars`) the numbers it
    measures once the trainer's mean is known. No node ever holds another node's gradients."""

    grads: torch.Tensor  # [k, P] this node's samples (fp64); they never travel
    batch_sizes: torch.Tensor  # [k] examples behind each (fp64)
    weighted_sum: torch.Tensor  # [P] sum_i b_i g_i (fp64)
    within_node: bool  # the micro_batches estimator: this node's samples form their own group
    wire: StatisticsWire

    @classmethod
    def of(cls, grads: torch.Tensor, batch_sizes: torch.Tensor, within_node: bool,
           wire: StatisticsWire = REFERENCE_WIRE) -> NodeGradientSums:
        g, b = grads.double(), batch_sizes.to(grads.device, torch.float64)
        return cls(g, b, b @ g, within_node, wire)

    def vectors(self) -> torch.Tensor:
        """[weighted_sum, plain_sum (reference protocol, nodes estimator), batch] in the wire dtype; the batch
        is a small whole number, exact in fp32."""
        parts = [self.weighted_sum]
        if self.wire.two_vectors and not self.within_node:
            parts.append(self.grads.sum(0))
        batch = self.batch_sizes.sum().reshape(1)
        return torch.cat([*parts, batch]).to(self.wire.dtype)

    def scalars(self, mean: torch.Tensor) -> torch.Tensor:
        """This node's fp64 scalars, given the trainer's mean (on this node's device)."""
        g, b, mean = self.grads, self.batch_sizes, mean.to(self.grads.device, torch.float64)
        center = self.weighted_sum / b.sum() if self.within_node else mean
        g_dot_m = g @ mean
        inner = float((b * (g_dot_m - center @ mean) ** 2).sum())  # sum b <d_i, m>^2, no [k, P] temporary
        count, groups = len(b), int(self.within_node)
        measured = self.within_node or not self.wire.two_vectors
        sq_dev = torch.linalg.vector_norm(g - center, dim=1) ** 2 if measured else None
        weighted_dev = float((b * sq_dev).sum()) if measured else 0.0
        plain_dev = float(sq_dev.sum()) if measured else 0.0
        if self.wire.two_vectors:
            sq = torch.linalg.vector_norm(g, dim=1) ** 2
            values = [float((b * sq).sum()), float(sq.sum()), count, groups, weighted_dev, plain_dev, inner]
        else:
            values = [count, groups, weighted_dev, plain_dev, inner, float((b * g_dot_m).sum())]
        return torch.tensor(values, dtype=torch.float64)


def statistics_payload_bytes(numel: int, within_node: bool, wire: StatisticsWire = REFERENCE_WIRE) -> int:
    """Bytes one node puts into its trainer's two statistics reductions (numel: length of a sample)."""
    return wire.payload_bytes(numel, within_node)


def trainer_statistics(node_samples: list[tuple[torch.Tensor, torch.Tensor]], within_node: bool,
                       wire: StatisticsWire = REFERENCE_WIRE) -> GradientStatistics:
    """A trainer's statistics from its nodes' samples (each on its node's device), in one process: the
    same two reductions as across processes (the vectors in the wire dtype, then the fp64 scalars), added
    in node order on the first node's device, so no sample is stacked or copied to the host."""
    shares = [NodeGradientSums.of(g, b, within_node, wire) for g, b in node_samples]
    device = shares[0].weighted_sum.device
    vectors = shares[0].vectors()
    for share in shares[1:]:
        vectors = vectors + share.vectors().to(device)
    mean = wire.reduced_mean(vectors, within_node)
    scalars = sum((share.scalars(mean).cpu() for share in shares[1:]), shares[0].scalars(mean).cpu())
    return wire.statistics(vectors, scalars, within_node)


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
