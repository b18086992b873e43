"""Every algorithm against hand-computed values."""

import functools
import operator

import pytest
import torch

from algorithms.calc_batch import (
    REFERENCE_WIRE,
    STATISTICS_WIRE,
    AugmentedInnerProductTest,
    ConstantBatch,
    GradientSamples,
    LinearRampup,
    NodeGradientSums,
    NormTest,
    StatisticsWire,
    build_batch_test,
    statistics_of,
    statistics_payload_bytes,
    trainer_statistics,
)
from algorithms.policies import BestWithWorst, MergePlan, WorstWithWorst, batch_weights, weighted_average
from algorithms.round_schedule import assign, assign_nodes, node_counts
from algorithms.switch_mode import OnlyDataLoader, OnlyGradientAccumulation, ThresholdSwitchMode
from algorithms.traffic import SyncCost, Traffic, ring_allreduce_bytes


# --- batch tests ------------------------------------------------------------------------------
def S(grads, batch=1.0, groups=None) -> GradientSamples:  # noqa: N802 - reads like the maths
    """Gradient samples: rows of `grads`, each over `batch` examples (a number or one per row), in `groups`."""
    g = torch.as_tensor(grads, dtype=torch.float64)
    b = torch.as_tensor(batch, dtype=torch.float64).expand(g.shape[0]).clone()
    return GradientSamples(g, b, torch.as_tensor(groups if groups is not None else [0] * g.shape[0]))


def node_shares(grads, sizes, nodes, within_node, wire=REFERENCE_WIRE):
    """A trainer's statistics as nodes would build them: each its own sums, then a sum (the all-reduce)."""
    ids = nodes.unique().tolist()
    shares = [NodeGradientSums.of(grads[nodes == n], sizes[nodes == n], within_node, wire) for n in ids]
    vectors = functools.reduce(operator.add, (share.vectors() for share in shares))
    mean = wire.reduced_mean(vectors, within_node)
    scalars = functools.reduce(operator.add, (share.scalars(mean) for share in shares))
    return wire.statistics(vectors, scalars, within_node)


@pytest.mark.parametrize("within_node", [True, False])
def test_node_sums_give_the_same_statistics_as_the_samples(within_node):
    gen = torch.Generator().manual_seed(0)
    grads = torch.randn(9, 50, generator=gen, dtype=torch.float64) + 0.3
    sizes = torch.tensor([1.0, 2, 3, 2, 2, 1, 4, 3, 1], dtype=torch.float64)
    nodes = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2]) if within_node else torch.arange(9)
    direct = statistics_of(GradientSamples(grads, sizes, nodes if within_node else torch.zeros(9, dtype=torch.long)))
    reduced = node_shares(grads, sizes, nodes, within_node)
    assert reduced.dof == direct.dof
    assert torch.allclose(reduced.mean, direct.mean, rtol=1e-12)
    for field in ("sq_norm", "weighted_dev", "plain_dev", "inner", "ortho_dev"):
        assert getattr(reduced, field) == pytest.approx(getattr(direct, field), rel=1e-10), field
    for test in (NormTest(eta=0.05), AugmentedInnerProductTest(vartheta=0.05, nu=0.1)):
        assert test(reduced, 1, 3).requested_batch == test(direct, 1, 3).requested_batch > 1


@pytest.mark.parametrize("within_node", [True, False])
@pytest.mark.parametrize("mode", ["minimal", "fp64", "fp32"])
def test_node_sums_travel_as_vectors_then_scalars(within_node, mode):
    wire = STATISTICS_WIRE[mode]
    share = NodeGradientSums.of(torch.tensor([[1.0, 2.0], [3.0, 4.0]]), torch.tensor([1.0, 3.0]), within_node, wire)
    vectors = share.vectors()
    # only the fp64 reference's nodes estimator sends the plain sum as a second vector
    two = wire.two_vectors and not within_node
    assert vectors.dtype == wire.dtype and vectors.shape == ((2 if two else 1) * 2 + 1,)
    assert vectors.numel() == wire.vectors_size(2, within_node)
    # 1*[1, 2] + 3*[3, 4] = [10, 14]; batch 4; every value is exact in fp32 too
    assert vectors[:2].tolist() == [10.0, 14.0] and vectors[-1] == 4.0
    expected_mean = torch.tensor([2.5, 3.5], dtype=torch.float64)
    assert torch.equal(wire.reduced_mean(vectors, within_node), expected_mean)
    scalars = share.scalars(expected_mean)
    assert scalars.dtype == torch.float64 and scalars.numel() == wire.scalars_size == (7 if wire.two_vectors else 6)
    element = 8 if mode == "fp64" else 4
    assert statistics_payload_bytes(2, within_node, wire) == vectors.numel() * element + scalars.numel() * 8
    # by hand, one node, mean m = (2.5, 3.5) (also the node's own mean): d = (-1.5, -1.5), (0.5, 0.5);
    # sum b ||d||^2 = 1 * 4.5 + 3 * 0.5 = 6, sum ||d||^2 = 5; <d, m> = -9, 3: sum b <d, m>^2 = 81 + 27 = 108;
    # sum b <g, m> = 1 * 9.5 + 3 * 21.5 = 74 = B ||m||^2 (4 * 18.5)
    stats = wire.statistics(vectors, scalars, within_node)
    got = (stats.sq_norm, stats.weighted_dev, stats.plain_dev, stats.inner, stats.ortho_dev)
    assert got == pytest.approx((18.5, 6.0, 5.0, 108.0, 6.0 - 108.0 / 18.5), rel=1e-14) and stats.dof == 1


def test_minimal_wire_recovers_the_exact_squared_norm_from_an_fp32_mean():
    """<m*, m> travels in fp64, so ||m*||^2 = 2 <m*, m> - ||m||^2 up to the square of the fp32 rounding."""
    gen = torch.Generator().manual_seed(5)
    grads = torch.randn(6, 3000, generator=gen, dtype=torch.float64) * 0.01 + 1.0 / 3
    sizes = torch.tensor([1.0, 2, 3, 1, 2, 4], dtype=torch.float64)
    nodes = torch.tensor([0, 0, 1, 1, 2, 2])
    exact = node_shares(grads, sizes, nodes, False)
    minimal = node_shares(grads, sizes, nodes, False, STATISTICS_WIRE["minimal"])
    fp32_mean = STATISTICS_WIRE["minimal"].reduced_mean(
        functools.reduce(operator.add, (NodeGradientSums.of(grads[nodes == n], sizes[nodes == n], False,
                                                            STATISTICS_WIRE["minimal"]).vectors() for n in range(3))),
        False)
    naive = float(fp32_mean @ fp32_mean)
    assert abs(naive - exact.sq_norm) > 1e-10 * exact.sq_norm  # the fp32 mean alone is off ...
    assert minimal.sq_norm == pytest.approx(exact.sq_norm, rel=1e-12)  # ... the fp64 scalar puts it right
    for field in ("weighted_dev", "plain_dev", "inner", "ortho_dev"):
        assert getattr(minimal, field) == pytest.approx(getattr(exact, field), rel=1e-6), field


@pytest.mark.parametrize("within_node", [True, False])
def test_minimal_statistics_decide_as_the_fp64_two_vector_protocol_on_random_cases(within_node):
    """300 random trainers (1-4 nodes, 1-4 samples each, equal or unequal batches, means of every size against
    the noise): the default wire's decisions equal the exact reference's, for the norm test and the AIPT."""
    gen = torch.Generator().manual_seed(11)
    tests = [NormTest(eta=0.3), NormTest(eta=0.8), AugmentedInnerProductTest(vartheta=0.05, nu=0.3)]
    decided = 0
    for case in range(300):
        n_nodes = int(torch.randint(1, 5, (1,), generator=gen))
        per_node = [int(torch.randint(1, 5, (1,), generator=gen)) for _ in range(n_nodes)]
        equal = case % 2 == 0
        sizes = torch.cat([torch.full((k,), 4.0) if equal else torch.randint(1, 9, (k,), generator=gen).double()
                           for k in per_node])
        nodes = torch.cat([torch.full((k,), n) for n, k in enumerate(per_node)])
        scale = 10 ** float(torch.empty(1).uniform_(-2, 1, generator=gen))
        grads = torch.randn(len(sizes), 257, generator=gen, dtype=torch.float64) / sizes.sqrt()[:, None]
        grads = grads + scale * torch.randn(257, generator=gen, dtype=torch.float64) + 0.1 * nodes[:, None]
        grads = grads.float()  # nodes hold fp32 gradients
        reference = node_shares(grads, sizes, nodes, within_node)
        minimal = node_shares(grads, sizes, nodes, within_node, STATISTICS_WIRE["minimal"])
        for test in tests:
            expected, got = test(reference, 2, n_nodes), test(minimal, 2, n_nodes)
            assert got.requested_batch == expected.requested_batch, (case, test.name)
            assert got.stats.get("test_requested_batch") == expected.stats.get("test_requested_batch")
            decided += "T_k" in expected.stats and expected.requested_batch > 2
    assert decided > 100  # most cases grow the batch: the equality is not one of "keep the batch"


def test_minimal_statistics_bytes_are_the_weights_bytes_plus_a_few_scalars():
    """The acceptance bound: one node's statistics payload is at most 1.1x its fp32 weights all-reduce
    payload, for both estimators; the fp64 reference is 2x (micro_batches) and 4x (nodes)."""
    numel = 1_793_664  # microllama-tiny
    for within_node in (True, False):
        minimal = statistics_payload_bytes(numel, within_node, STATISTICS_WIRE["minimal"])
        assert minimal == 4 * (numel + 1) + 6 * 8 <= 1.1 * 4 * numel
        reference = statistics_payload_bytes(numel, within_node, REFERENCE_WIRE)
        assert reference == 8 * (numel * (1 if within_node else 2) + 1) + 7 * 8
    assert StatisticsWire().dtype == torch.float32 and not StatisticsWire().two_vectors


@pytest.mark.parametrize("within_node", [True, False])
def test_trainer_statistics_in_one_process_equal_the_samples(within_node):
    """The simulated cluster's path (node sums added in one process) against the stacked samples."""
    gen = torch.Generator().manual_seed(1)
    parts = [(torch.randn(k, 30, generator=gen) + 0.2, torch.arange(1.0, k + 1, dtype=torch.float64))
             for k in (3, 2, 4)]
    grads, sizes = torch.cat([g for g, _ in parts]), torch.cat([b for _, b in parts])
    groups = torch.cat([torch.full((len(b),), n) for n, (_, b) in enumerate(parts)])
    direct = statistics_of(GradientSamples(grads, sizes, groups if within_node else torch.zeros_like(groups)))
    got = trainer_statistics(parts, within_node)
    assert trainer_statistics(parts, within_node, STATISTICS_WIRE['minimal']).dof == direct.dof
    assert got.dof == direct.dof
    for field in ("sq_norm", "weighted_dev", "plain_dev", "inner", "ortho_dev"):
        assert getattr(got, field) == pytest.approx(getattr(direct, field), rel=1e-9), field


def test_norm_test_hand_values():
    # mean (2,0), ||mean||^2 = 4, S = 8, per-example variance = 1 * 8 / 1 = 8, T = 8 / (1 * 0.25 * 4) = 8
    d = NormTest(eta=0.5)(S([[0.0, 0.0], [4.0, 0.0]]), current=1, num_nodes=1)
    assert d.requested_batch == 8
    assert d.stats["variance"] == pytest.approx(8.0)
    assert d.stats["sum_sq_diffs"] == pytest.approx(8.0)
    assert d.stats["T_k"] == pytest.approx(8.0)


def test_a_capped_request_keeps_what_the_test_asked_for():
    # the hand case above asks for 8; max_requested_batch 5 caps the decision, the stats keep the 8
    d = NormTest(eta=0.5, max_batch=5)(S([[0.0, 0.0], [4.0, 0.0]]), current=1, num_nodes=1)
    assert d.requested_batch == 5 and d.stats["test_requested_batch"] == 8
    assert NormTest(eta=0.5)(S([[0.0, 0.0], [4.0, 0.0]]), 1, 1).stats["test_requested_batch"] == 8  # uncapped
    # schedules that are not tests log the statistics but ask for nothing
    assert "test_requested_batch" not in ConstantBatch(eta=0.5, max_batch=5)(S([[0.0, 0.0], [4.0, 0.0]]), 1, 1).stats


def test_norm_test_scales_with_sample_batch_and_nodes():
    grads = [[0.0, 0.0], [4.0, 0.0]]
    # sample batch 2 doubles the variance, 2 nodes halve the need: T stays 8; eta=1 divides by 4 -> 2
    assert NormTest(eta=0.5)(S(grads, 2), 1, 2).requested_batch == 8
    assert NormTest(eta=1.0)(S(grads, 2), 1, 2).requested_batch == 2


def test_norm_test_weights_each_sample_by_its_own_batch():
    # samples over 1 and 2 examples: the gradient is the example-weighted mean (0*1 + 3*2) / 3 = (2, 0),
    # deviations (-2, 0), (1, 0): variance = (1 * 4 + 2 * 1) / (2 - 1) = 6; T = 6 / (0.25 * 4) = 6.
    # (Node 0's batch for both rows and the plain mean would give 8.)
    d = NormTest(eta=0.5)(S([[0.0, 0.0], [3.0, 0.0]], [1.0, 2.0]), 1, 1)
    assert d.stats["variance"] == pytest.approx(6.0)
    assert d.stats["grad_sq_norm"] == pytest.approx(4.0)
    assert d.requested_batch == 6


def test_unequal_batch_variance_is_unbiased():
    # rows g_i = mu + noise of variance 1/b_i per coordinate: sigma^2 (trace) = P per example
    gen = torch.Generator().manual_seed(0)
    sizes = torch.tensor([1.0, 2.0, 8.0, 8.0, 3.0] * 4)
    p, estimates = 2000, []
    for _ in range(20):
        g = 0.1 + torch.randn(len(sizes), p, generator=gen, dtype=torch.float64) / sizes.sqrt()[:, None]
        estimates.append(NormTest(1.0)(S(g, sizes), 1, 1).stats["variance"] / p)
    assert sum(estimates) / len(estimates) == pytest.approx(1.0, abs=0.02)


def test_micro_batch_variance_is_pooled_within_nodes():
    # node 0's chunks (1,0), (3,0); node 1's (11,0), (13,0): within-node deviations +-1, so
    # variance = 4 / (4 samples - 2 groups) = 2, whatever the drift between the nodes; g = (7, 0).
    grads = [[1.0, 0.0], [3.0, 0.0], [11.0, 0.0], [13.0, 0.0]]
    pooled = NormTest(eta=1.0)(S(grads, 1, [0, 0, 1, 1]), 1, 1)
    assert pooled.stats["variance"] == pytest.approx(2.0)
    assert pooled.stats["T_k"] == pytest.approx(2.0 / 49.0)
    drift = NormTest(eta=1.0)(S(grads, 1, [0, 0, 0, 0]), 1, 1)  # one group: the paper's nodes estimator
    assert drift.stats["variance"] == pytest.approx(104.0 / 3.0)


def test_norm_test_never_shrinks_and_respects_cap():
    grads = S([[0.0, 0.0], [4.0, 0.0]])
    assert NormTest(eta=0.5)(grads, current=20, num_nodes=1).requested_batch == 20
    assert NormTest(eta=0.5, max_batch=5)(grads, current=1, num_nodes=1).requested_batch == 5


def test_norm_test_needs_two_samples_per_group_and_a_direction():
    assert NormTest(0.5)(S(torch.ones(1, 3)), 3, 1).requested_batch == 3
    assert NormTest(0.5)(None, 3, 1).requested_batch == 3
    assert NormTest(0.5)(S([[1.0], [-1.0]]), 3, 1).requested_batch == 3  # mean is 0
    assert NormTest(0.5)(S([[0.0], [4.0]], 1, [0, 1]), 3, 1).stats == {}  # one sample per group: no variance


def test_augmented_inner_product_orthogonality_term_uses_nu():
    # <g_i, g> = 4, 4 -> inner variance 0; residuals (0, 1), (0, -1): sum 2 / (n-1) = 2
    # T_ortho = 2 / (1 * 0.5^2 * 4) = 2
    d = AugmentedInnerProductTest(vartheta=0.01, nu=0.5)(S([[2.0, 1.0], [2.0, -1.0]]), 1, 1)
    assert d.stats["inner_variance"] == pytest.approx(0.0)
    assert d.stats["ortho_variance"] == pytest.approx(2.0)
    assert d.stats["T_ortho"] == pytest.approx(2.0)
    assert d.requested_batch == 2


def test_augmented_inner_product_inner_term_uses_vartheta():
    grads = S([[1.0, 0.0], [3.0, 0.0]])
    # <g_i, g> = 2, 6 -> variance 8; T_ip = 8 / (vartheta^2 * ||g||^4 = 0.25 * 16) = 2; residuals are 0
    d = AugmentedInnerProductTest(vartheta=0.5, nu=0.3)(grads, 1, 1)
    assert d.stats["T_ip"] == pytest.approx(2.0)
    assert d.stats["T_ortho"] == pytest.approx(0.0)
    assert d.requested_batch == 2
    assert AugmentedInnerProductTest(vartheta=0.25, nu=0.3)(grads, 1, 1).requested_batch == 8


def test_augmented_inner_product_with_unequal_batches():
    # b = (1, 3): g = ((2*1 + 2*3)/4, (1 - 3)/4) = (2, -0.5), ||g||^2 = 4.25; d = (0, 1.5), (0, -0.5)
    # <d_i, g> = -0.75, 0.25 -> inner variance 1 * 0.5625 + 3 * 0.0625 = 0.75
    # sum b ||d||^2 = 2.25 + 0.75 = 3 splits into 0.75 / 4.25 along g and the rest orthogonal to it
    d = AugmentedInnerProductTest(vartheta=1.0, nu=1.0)(S([[2.0, 1.0], [2.0, -1.0]], [1.0, 3.0]), 1, 1)
    assert d.stats["inner_variance"] == pytest.approx(0.75)
    assert d.stats["ortho_variance"] == pytest.approx(3.0 - 0.75 / 4.25)
    assert d.stats["T_ip"] == pytest.approx(0.75 / 4.25**2)


def test_constant_keeps_batch_but_reports_statistics():
    d = ConstantBatch(eta=0.5)(S([[0.0, 0.0], [4.0, 0.0]]), 3, 1)
    assert d.requested_batch == 3
    assert d.stats["T_k"] == pytest.approx(8.0)


def test_linear_rampup_grows_with_tokens_to_the_cap_and_never_shrinks():
    ramp = LinearRampup(eta=0.5, start=2, rampup_tokens=1000, max_batch=16)
    # 2 + 14 * progress, floored: 0 -> 2, 250 -> 5.5 -> 5, 500 -> 9, 1000 and beyond -> 16
    assert [ramp(None, 2, 1, tokens).requested_batch for tokens in (0, 250, 500, 999, 1000, 5000)] == \
        [2, 5, 9, 15, 16, 16]
    assert ramp(None, 12, 1, 250).requested_batch == 12
    assert ramp(S([[0.0, 0.0], [4.0, 0.0]]), 2, 1, 0).stats["T_k"] == pytest.approx(8.0)
    with pytest.raises(ValueError, match="rampup_tokens"):
        LinearRampup(0.5, 2, 0, 16)


def test_registry_rejects_unknown_names():
    with pytest.raises(ValueError, match="norm_test"):
        build_batch_test("bogus", eta=1, vartheta=1, nu=1, max_batch=10)


# --- switch modes -----------------------------------------------------------------------------
@pytest.mark.parametrize("requested,expected", [(3, (3, 1)), (4, (4, 1)), (6, (4, 1)), (8, (4, 1)),
                                                (9, (3, 3)), (16, (4, 4)), (17, (4, 5))])
def test_threshold_switch_mode(requested, expected):
    assert ThresholdSwitchMode().decide(requested, 4) == expected


@pytest.mark.parametrize("requested,expected", [(3, (3, 1)), (5, (3, 2)), (8, (4, 2)), (9, (3, 3))])
def test_only_gradient_accumulation(requested, expected):
    assert OnlyGradientAccumulation().decide(requested, 4) == expected


def test_only_data_loader_truncates():
    assert OnlyDataLoader().decide(9, 4) == (4, 1)
    assert OnlyDataLoader().decide(3, 4) == (3, 1)


@pytest.mark.parametrize("mode", [ThresholdSwitchMode(), OnlyGradientAccumulation(), OnlyDataLoader()])
def test_micro_batch_never_exceeds_max(mode):
    for requested in range(1, 60):
        loader, steps = mode.decide(requested, 7)
        assert 1 <= loader <= 7 and steps >= 1


# --- merging ----------------------------------------------------------------------------------
def test_batch_weights():
    assert batch_weights([5, 3]) == [5 / 8, 3 / 8]


def test_weighted_average_floats_only():
    a = {"w": torch.tensor([1.0, 2.0]), "count": torch.tensor([7])}
    b = {"w": torch.tensor([3.0, 6.0]), "count": torch.tensor([1])}
    out = weighted_average([a, b], [0.25, 0.75])
    assert torch.allclose(out["w"], torch.tensor([2.5, 5.0]))
    assert out["count"].item() == 7  # integer buffers come from the survivor


def test_worst_with_worst_merges_two_smallest_requests():
    plan = WorstWithWorst().plan({0: 3, 1: 8, 2: 5})
    assert plan.survivor == 2 and plan.members == (2, 0)
    assert plan.weights == pytest.approx((5 / 8, 3 / 8))
    tie = WorstWithWorst().plan({0: 5, 1: 8, 2: 5, 3: 6})
    assert tie.survivor == 0 and tie.members == (0, 2) and tie.weights == pytest.approx((0.5, 0.5))


def test_best_with_worst():
    plan = BestWithWorst().plan({0: 3, 1: 8, 2: 5})
    assert plan.members == (1, 0) and plan.weights == pytest.approx((8 / 11, 3 / 11))


def test_best_with_worst_merges_two_distinct_trainers_when_requests_tie():
    # the paper's start: batch 1 everywhere. worst = T0 (smaller id), best = T1 (the smallest other id)
    plan = BestWithWorst().plan({0: 1, 1: 1, 2: 1, 3: 1})
    assert plan.survivor == 1 and plan.members == (1, 0) and plan.weights == pytest.approx((0.5, 0.5))
    plan = BestWithWorst().plan({2: 4, 5: 4})
    assert plan.members == (5, 2)


def test_a_merge_plan_never_holds_one_trainer_twice():
    with pytest.raises(ValueError, match="distinct"):
        MergePlan(0, (0, 0), (0.5, 0.5))
    with pytest.raises(ValueError, match="distinct"):
        MergePlan(0, (0,), (1.0,))


def test_should_merge_frequency():
    p = WorstWithWorst()
    assert p.should_merge(3, 3, 2) and not p.should_merge(2, 3, 2)
    assert not p.should_merge(3, 3, 1) and not p.should_merge(3, 0, 4)


def test_the_merge_at_a_step_is_one_answer():
    p = WorstWithWorst()
    # step 3 of every 3: requests 8, 2, 4 -> the two smallest (T1: 2, T2: 4) merge, the larger request survives,
    # weighted by the requests 4 : 2
    plan = p.decide(3, 3, {0: 8, 1: 2, 2: 4})
    assert (plan.survivor, plan.members) == (2, (2, 1)) and plan.weights == pytest.approx((4 / 6, 2 / 6))
    assert p.decide(2, 3, {0: 8, 1: 2}) is None and p.decide(3, 3, {0: 8}) is None  # not a merge step; one trainer


# --- node assignment --------------------------------------------------------------------------
def test_node_counts_proportional_with_minimum_one():
    assert node_counts({0: 2, 1: 2, 2: 2, 3: 2}, 4) == {0: 1, 1: 1, 2: 1, 3: 1}
    # spare 2 nodes shared 8:2 -> 1.6 / 0.4 -> 1 + 1 (largest remainder) and 1 + 0
    assert node_counts({0: 8, 1: 2}, 4) == {0: 3, 1: 1}
    assert node_counts({0: 1000, 1: 1, 2: 1}, 4) == {0: 2, 1: 1, 2: 1}
    assert sum(node_counts({0: 3, 1: 7, 2: 11}, 8).values()) == 8


def test_node_counts_are_proportional_not_one_each_plus_spare_share():
    # 32 nodes shared 2:30 is exactly 2 and 30 ("one each, spare by share" gave 3 and 29)
    assert node_counts({0: 2, 1: 30}, 32) == {0: 2, 1: 30}
    # quotas 0.31 (x3) and 31.07: the small ones are held at one node, the large one takes the other 29
    assert node_counts({0: 1, 1: 1, 2: 1, 3: 100}, 32) == {0: 1, 1: 1, 2: 1, 3: 29}
    # 5:3 of 4 nodes = 2.5 / 1.5: floors 2 + 1, the tie of remainders goes to the larger request
    assert node_counts({0: 5, 1: 3}, 4) == {0: 3, 1: 1}
    # 1:2:5 of 16 = 2, 4, 10 exactly
    assert node_counts({0: 1, 1: 2, 2: 5}, 16) == {0: 2, 1: 4, 2: 10}


def test_node_counts_rejects_too_many_trainers():
    with pytest.raises(ValueError):
        node_counts({0: 1, 1: 1, 2: 1}, 2)


def test_a_rounds_assignment_is_counts_then_nodes_among_the_present():
    # node 2 is away: 3 present nodes shared 4:2 -> 2 and 1; trainer 0 keeps node 0, takes free node 3; trainer 1
    # keeps node 1
    assert assign({0: 4, 1: 2}, {0: 0, 1: 1, 3: None}) == {0: [0, 3], 1: [1]}


def test_assign_nodes_keeps_nodes_with_their_trainer():
    previous = {0: 0, 1: 1, 2: 2, 3: 3}  # trainer 2 was merged away
    out = assign_nodes({0: 1, 1: 2, 3: 1}, previous)
    assert out == {0: [0], 1: [1, 2], 3: [3]}
    out = assign_nodes({0: 3, 1: 1}, {0: 0, 1: 1, 2: 1, 3: None})
    assert out == {0: [0, 2, 3], 1: [1]}


# --- communication accounting -----------------------------------------------------------------
def test_ring_allreduce_bytes_by_hand():
    assert ring_allreduce_bytes(1, 1000) == 0  # one node sends nothing
    assert ring_allreduce_bytes(2, 1000) == 2000  # each of 2 nodes sends 2 * 1/2 * P
    assert ring_allreduce_bytes(4, 1000) == 6000  # each of 4 nodes sends 2 * 3/4 * P


def test_traffic_counts_only_cross_node_syncs():
    traffic = Traffic()
    traffic.add(SyncCost(), 1, 1000)  # a one-node trainer: no sync, no bytes
    traffic.add(SyncCost(), 3, 1000)  # the fp32 weights (P = 1000) in a ring: 2 (n-1) x P
    traffic.merge(2000)
    traffic.node_move(1000)
    traffic.add(SyncCost(statistics_bytes=100), 1, 1000)  # a one-node trainer reduces nothing
    # 2 nodes, 100 bytes of statistics each: 2 (n-1) x 100, apart from the weights traffic (P = 0 here, so its
    # sync counts and weighs nothing)
    traffic.add(SyncCost(statistics_bytes=100), 2, 0)
    traffic.add(SyncCost(statistics_bytes=10, statistics_for_the_log=True), 3, 0)  # for the log only: apart
    assert traffic.row() == {"rounds": 0, "syncs": 4, "allreduce_bytes": 4000, "merge_bytes": 2000,
                             "node_move_bytes": 1000, "node_moves": 1, "statistics_bytes": 200,
                             "logged_statistics_bytes": 40, "weights_traffic_bytes": 7000, "total_traffic_bytes": 7200}


def test_a_round_is_counted_in_one_call():
    traffic = Traffic()
    # two states sent to nodes first (1000 bytes each); trainer 0 syncs 3 nodes (a ring of P = 1000: 2 (n-1) P),
    # trainer 1 one node (nothing crosses), its 100 bytes of statistics reduced by nobody
    traffic.round([1000, 1000], {1: 1, 0: 3}, {0: SyncCost(), 1: SyncCost(statistics_bytes=100)}, 1000)
    assert traffic.row() == {"rounds": 1, "syncs": 1, "allreduce_bytes": 4000, "merge_bytes": 0,
                             "node_move_bytes": 2000, "node_moves": 2, "statistics_bytes": 0,
                             "logged_statistics_bytes": 0, "weights_traffic_bytes": 6000, "total_traffic_bytes": 6000}


def test_a_compressed_sync_counts_an_all_gather_of_the_payload():
    traffic = Traffic()
    topk = SyncCost(sync_bytes=100)  # top-k: each of 3 nodes sends its 100 bytes to the 2 others
    assert topk.gathered and not SyncCost(sync_bytes=100, ring=True).gathered
    traffic.add(topk, 3, 10**6)
    traffic.add(topk, 1, 10**6)
    assert (traffic.syncs, traffic.allreduce_bytes) == (1, 600)
    ddp = SyncCost(step_bytes=40, inner_steps=5)  # DDP: a ring all-reduce after each of 5 inner steps
    traffic.add(ddp, 2, 10**6)
    assert (traffic.syncs, traffic.allreduce_bytes) == (6, 600 + 5 * 2 * 40)
