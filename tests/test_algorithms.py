"""Every algorithm against hand-computed values."""

import pytest
import torch

from algorithms.assignment import assign_nodes, node_counts
from algorithms.calc_batch import AugmentedInnerProductTest, ConstantBatch, NormTest, build_batch_test
from algorithms.policies import BestWithWorst, WorstWithWorst, batch_weights, weighted_average
from algorithms.switch_mode import OnlyDataLoader, OnlyGradientAccumulation, ThresholdSwitchMode


# --- batch tests ------------------------------------------------------------------------------
def test_norm_test_hand_values():
    grads = torch.tensor([[0.0, 0.0], [4.0, 0.0]])
    # mean (2,0), ||mean||^2 = 4, S = 8, per-example variance = 1 * 8 / 1 = 8, T = 8 / (1 * 0.25 * 4) = 8
    d = NormTest(eta=0.5)(grads, sample_batch=1, current=1, num_nodes=1)
    assert d.requested_batch == 8
    assert d.stats["variance"] == pytest.approx(8.0)
    assert d.stats["sum_sq_diffs"] == pytest.approx(8.0)
    assert d.stats["T_k"] == pytest.approx(8.0)


def test_norm_test_scales_with_sample_batch_and_nodes():
    grads = torch.tensor([[0.0, 0.0], [4.0, 0.0]])
    # sample_batch 2 doubles the variance, 2 nodes halve the need: T stays 8; eta=1 divides by 4 -> 2
    assert NormTest(eta=0.5)(grads, 2, 1, 2).requested_batch == 8
    assert NormTest(eta=1.0)(grads, 2, 1, 2).requested_batch == 2


def test_norm_test_never_shrinks_and_respects_cap():
    grads = torch.tensor([[0.0, 0.0], [4.0, 0.0]])
    assert NormTest(eta=0.5)(grads, 1, current=20, num_nodes=1).requested_batch == 20
    assert NormTest(eta=0.5, max_batch=5)(grads, 1, current=1, num_nodes=1).requested_batch == 5


def test_norm_test_needs_two_samples_and_a_direction():
    assert NormTest(0.5)(torch.ones(1, 3), 1, 3, 1).requested_batch == 3
    assert NormTest(0.5)(None, 1, 3, 1).requested_batch == 3
    assert NormTest(0.5)(torch.tensor([[1.0], [-1.0]]), 1, 3, 1).requested_batch == 3  # mean is 0


def test_augmented_inner_product_orthogonality_term_uses_nu():
    grads = torch.tensor([[2.0, 1.0], [2.0, -1.0]])
    # <g_i, g> = 4, 4 -> inner variance 0; residuals (0, 1), (0, -1): sum 2 / (n-1) = 2
    # T_ortho = 2 / (1 * 0.5^2 * 4) = 2
    d = AugmentedInnerProductTest(vartheta=0.01, nu=0.5)(grads, 1, 1, 1)
    assert d.stats["inner_variance"] == pytest.approx(0.0)
    assert d.stats["ortho_variance"] == pytest.approx(2.0)
    assert d.stats["T_ortho"] == pytest.approx(2.0)
    assert d.requested_batch == 2


def test_augmented_inner_product_inner_term_uses_vartheta():
    grads = torch.tensor([[1.0, 0.0], [3.0, 0.0]])
    # <g_i, g> = 2, 6 -> variance 8; T_ip = 8 / (vartheta^2 * ||g||^4 = 0.25 * 16) = 2; residuals are 0
    d = AugmentedInnerProductTest(vartheta=0.5, nu=0.3)(grads, 1, 1, 1)
    assert d.stats["T_ip"] == pytest.approx(2.0)
    assert d.stats["T_ortho"] == pytest.approx(0.0)
    assert d.requested_batch == 2
    assert AugmentedInnerProductTest(vartheta=0.25, nu=0.3)(grads, 1, 1, 1).requested_batch == 8


def test_constant_keeps_batch_but_reports_statistics():
    d = ConstantBatch(eta=0.5)(torch.tensor([[0.0, 0.0], [4.0, 0.0]]), 1, 3, 1)
    assert d.requested_batch == 3
    assert d.stats["T_k"] == pytest.approx(8.0)


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


def test_should_merge_frequency():
    p = WorstWithWorst()
    assert p.should_merge(3, 3, 2) and not p.should_merge(2, 3, 2)
    assert not p.should_merge(3, 3, 1) and not p.should_merge(3, 0, 4)


# --- node assignment --------------------------------------------------------------------------
def test_node_counts_proportional_with_minimum_one():
    assert node_counts({0: 2, 1: 2, 2: 2, 3: 2}, 4) == {0: 1, 1: 1, 2: 1, 3: 1}
    # spare 2 nodes shared 8:2 -> 1.6 / 0.4 -> 1 + 1 (largest remainder) and 1 + 0
    assert node_counts({0: 8, 1: 2}, 4) == {0: 3, 1: 1}
    assert node_counts({0: 1000, 1: 1, 2: 1}, 4) == {0: 2, 1: 1, 2: 1}
    assert sum(node_counts({0: 3, 1: 7, 2: 11}, 8).values()) == 8


def test_node_counts_rejects_too_many_trainers():
    with pytest.raises(ValueError):
        node_counts({0: 1, 1: 1, 2: 1}, 2)


def test_assign_nodes_keeps_nodes_with_their_trainer():
    previous = {0: 0, 1: 1, 2: 2, 3: 3}  # trainer 2 was merged away
    out = assign_nodes({0: 1, 1: 2, 3: 1}, previous)
    assert out == {0: [0], 1: [1, 2], 3: [3]}
    out = assign_nodes({0: 3, 1: 1}, {0: 0, 1: 1, 2: 1, 3: None})
    assert out == {0: [0, 2, 3], 1: [1]}
