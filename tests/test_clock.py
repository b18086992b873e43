"""The simulated clock (algorithms/clock.py) on hand-computed cases, and its replay of committed runs."""

import json
from pathlib import Path

import pytest

from algorithms.clock import Clock, NodeWork, ThroughputCurve, TrainerWork
from algorithms.network import Network, parse_network
from algorithms.round_schedule import NodeSchedule, RoundNodes, RoundSchedule
from algorithms.traffic import SyncCost
from benchmarks.replay import RoundWork, TrainerRound, read_rounds, replay, timeline

MB = 10**6
SLOW = Network("slow", bandwidth=1 * MB, latency=0.01)  # 1 MB/s, 10 ms: a message of 1 MB takes 1.01 s
# tokens/s of a speed-1 node: 1000 at micro-batch 1, 2000 at 4 (linear between), 2500 at 4 with accumulation 2
CURVE = ThroughputCurve(((1, 1, 1000.0), (4, 1, 2000.0), (4, 2, 2500.0)), "hand")
FIXTURES = Path(__file__).parent / "fixtures" / "priced_runs"


def test_the_curve_interpolates_saturates_and_picks_the_accumulation_level_below():
    assert CURVE.tokens_per_s(1) == 1000 and CURVE.tokens_per_s(4) == 2000
    assert CURVE.tokens_per_s(2) == pytest.approx(1000 + 1000 / 3)  # a third of the way from 1 to 4
    assert CURVE.tokens_per_s(64) == 2000  # above the largest measured micro-batch: saturated
    assert CURVE.tokens_per_s(4, 2) == 2500 and CURVE.tokens_per_s(4, 16) == 2500  # level 2 is the largest below 16
    assert CURVE.tokens_per_s(4, 3) == 2500 and CURVE.tokens_per_s(1, 2) == 2500  # one point at level 2: flat there
    assert CURVE.largest_micro_batch == 4 and ThroughputCurve.flat(7.0).tokens_per_s(999, 9) == 7.0


def test_a_step_is_repriced_in_the_micro_batches_the_curves_device_fits():
    # the curve measured micro-batches 1 and 4 without accumulation: 8 sequences run as 4 x 2 (not the 2 x 4 a
    # smaller machine ran), 6 as 1 x 6 (4 does not divide it), 3 as 1 x 3; a flat curve keeps the shape as run
    assert [CURVE.device_shape(m, a) for m, a in ((2, 4), (4, 1), (2, 3), (3, 1), (1, 1))] == [
        (4, 2), (4, 1), (1, 6), (1, 3), (1, 1)]
    assert ThroughputCurve.flat(5.0).device_shape(2, 4) == (2, 4)
    # replayed: one trainer, one node, 8000 tokens in steps of 2 x 4; as run, at level 2 (2500 tokens/s at its
    # largest point): 3.2 s; in the device's shape 4 x 2, also level 2: 3.2 s; a curve with 8 sequences in one
    # pass (8, 1, 4000) runs it as 8 x 1 at 4000 tokens/s: 2 s
    work = [RoundWork(1, [TrainerRound(1, 8000.0, micro_batch=2, accumulation=4, nodes=(0,))])]
    as_run = replay(work, SLOW, CURVE, MB)[0].now
    assert as_run == pytest.approx(3.2)
    assert replay(work, SLOW, CURVE, MB, device_shapes=True)[0].now == pytest.approx(3.2)
    wide = ThroughputCurve(((1, 1, 1000.0), (8, 1, 4000.0), (2, 4, 1500.0)), "hand")
    assert replay(work, SLOW, wide, MB)[0].now == pytest.approx(8000 / 1500)  # the CPU's 2 x 4, accumulated
    assert replay(work, SLOW, wide, MB, device_shapes=True)[0].now == pytest.approx(2.0)


def _round(clock, trainers, slowdown=None):
    return {t: {n.node_id: n for n in times} for t, times in clock.round(trainers, slowdown).items()}


def test_two_trainers_four_nodes_by_hand_merges_wait_for_the_slower_member():
    speeds = [1.0, 1.0, 0.5, 0.25]
    clock = Clock(SLOW, CURVE, speeds, weight_bytes=MB)
    # round 1: T0 on nodes 0, 1 (2000 tokens each at micro-batch 4: 2000 tokens/s -> 1 s); T1 on nodes 2, 3
    # (1000 tokens each at micro-batch 2: 1333.3 tokens/s x speed -> 1.5 s and 3 s). Each trainer's fp32 ring
    # all-reduce of 1 MB over 2 nodes: 2 x 10 ms + 1 MB / (1 MB/s) = 1.02 s
    r1 = _round(clock, [TrainerWork(0, [NodeWork(0, 2000, 4, 1), NodeWork(1, 2000, 4, 1)]),
                        TrainerWork(1, [NodeWork(2, 1000, 2, 1), NodeWork(3, 1000, 2, 1)])])
    assert clock.ready == {0: pytest.approx(2.02), 1: pytest.approx(4.02)}  # each trainer's own time
    assert [r1[0][n].compute for n in (0, 1)] == pytest.approx([1.0, 1.0])
    assert [r1[1][n].compute for n in (2, 3)] == pytest.approx([1.5, 3.0])
    assert [r1[0][0].idle, r1[1][2].idle, r1[1][3].idle] == pytest.approx([1.02, 2.52, 1.02])
    assert clock.utilisation() == pytest.approx(6.5 / (4 * 4.02))  # busy 1 + 1 + 1.5 + 3 of 4 nodes x 4.02 s
    # the merge of T0 into T1 waits for T1 (4.02 s), then T0's 1 MB state travels: 1.01 s
    assert clock.merge(1, [1, 0], [MB]) == pytest.approx(5.03) and clock.ready == {1: pytest.approx(5.03)}
    # round 2: T1 on all four nodes, 1000 tokens each at micro-batch 4 x 2 accumulation (2500 tokens/s x speed):
    # 0.4, 0.4, 0.8, 1.6 s. Nodes 0, 1 (from T0) and 3 (not the merge's node) first receive T1's state: 1.01 s.
    # Ring all-reduce over 4 nodes: 6 x 10 ms + 6/4 MB / (1 MB/s) = 1.56 s
    r2 = _round(clock, [TrainerWork(1, [NodeWork(0, 1000, 4, 2, MB), NodeWork(1, 1000, 4, 2, MB),
                                        NodeWork(2, 1000, 4, 2), NodeWork(3, 1000, 4, 2, MB)])])[1]
    assert [r2[n].start for n in range(4)] == pytest.approx([6.04, 6.04, 5.03, 6.04])
    assert clock.ready[1] == pytest.approx(6.04 + 1.6 + 1.56)  # node 3 is the straggler
    assert [r2[n].idle for n in range(4)] == pytest.approx([9.2 - 2.02 - 0.4, 9.2 - 2.02 - 0.4, 9.2 - 4.02 - 0.8,
                                                            9.2 - 4.02 - 1.6])
    assert clock.utilisation() == pytest.approx(9.7 / (4 * 9.2))
    # round 3: node 3 is away; 3 nodes: ring of 4 x 10 ms + 4/3 MB / (1 MB/s)
    r3 = _round(clock, [TrainerWork(1, [NodeWork(n, 1000, 4, 2) for n in range(3)])])[1]
    assert clock.ready[1] == pytest.approx(9.2 + 0.8 + 0.04 + 4 / 3) and 3 not in r3
    end3 = 9.2 + 0.8 + 0.04 + 4 / 3
    assert clock.utilisation() == pytest.approx(11.3 / (3 * end3 + 9.2))  # node 3 was available until 9.2 s
    # round 4: node 3 is back (away for end3 - 9.2 s), node 0 runs 8x slower: 1000 / (2500 / 8) = 3.2 s
    r4 = _round(clock, [TrainerWork(1, [NodeWork(n, 1000, 4, 2) for n in range(4)])], slowdown={0: 8.0})[1]
    assert r4[0].compute == pytest.approx(3.2) and r4[3].idle == pytest.approx(3.2 + 1.56 - 1.6)
    assert clock.now == pytest.approx(end3 + 3.2 + 1.56)
    assert clock.utilisation() == pytest.approx(17.3 / (4 * clock.now - (end3 - 9.2)))
    assert clock.goodput() == pytest.approx((6000 + 4000 + 3000 + 4000) / clock.now)
    assert clock.counters() == {"utilisation": clock.utilisation(), "goodput_tokens_per_s": clock.goodput()}
    assert clock.idle() == pytest.approx(clock.available() - 17.3)


def test_lockstep_waits_for_the_slowest_trainer_independent_trainers_do_not():
    def run(lockstep):
        clock = Clock(SLOW, CURVE, [1.0, 0.25], weight_bytes=MB, lockstep=lockstep)
        for _ in range(2):
            clock.round([TrainerWork(0, [NodeWork(0, 1000, 1, 1)]), TrainerWork(1, [NodeWork(1, 1000, 1, 1)])])
        return clock
    independent, lockstep = run(False), run(True)
    assert independent.ready == {0: pytest.approx(2.0), 1: pytest.approx(8.0)}  # 1 s and 4 s rounds, no sync
    assert lockstep.ready == {0: pytest.approx(5.0), 1: pytest.approx(8.0)}  # T0's second round starts at 4 s
    assert independent.utilisation() == pytest.approx(10 / 16) == lockstep.utilisation()  # both idle at the end


def test_streaming_collectives_are_hidden_by_the_slowest_nodes_inner_steps():
    sync = SyncCost(fragment_bytes=(500_004, 500_004), overlap_steps=1, inner_steps=10)
    one = SLOW.allreduce(2, 500_004)
    assert sync.seconds(SLOW, 2, MB, compute=2.0) == pytest.approx(2 * (one - 0.2))
    assert SyncCost().seconds(SLOW, 1, MB, 2.0) == 0.0  # one node sends nothing


def test_flat_equal_speeds_in_lockstep_reproduce_the_first_models_predictions_on_committed_runs():
    """lockstep_predictions.json holds what benchmarks/replay.py predicted for these committed runs before the
    clock existed (every trainer's round starting together, moves after the merges). The clock replays the same
    logs with a flat curve and equal speeds: lockstep gives those numbers; independent trainers are never later."""
    expected = json.loads((FIXTURES / "lockstep_predictions.json").read_text())
    for run, by_network in expected.items():
        rounds, weight_bytes, _ = read_rounds(FIXTURES / run)
        assert sum(w.node_moves for w in rounds) == sum(len(t.receivers) for w in rounds for t in w.trainers)
        for name, predicted in by_network.items():
            times, compute = timeline(rounds, parse_network(name), 5000.0, weight_bytes, lockstep=True)
            assert {str(k): v for k, v in times.items()} == pytest.approx(predicted["times"], rel=1e-12)
            assert compute == pytest.approx(predicted["compute"], rel=1e-12)
            free, _ = timeline(rounds, parse_network(name), 5000.0, weight_bytes)
            assert free[max(free)] <= times[max(times)] + 1e-9
    adloco = read_rounds(FIXTURES / "adloco_int8_seed0")[0]
    assert replay(adloco, parse_network("consumer"), 5000.0, 4 * 10**6)[0].now < \
        replay(adloco, parse_network("consumer"), 5000.0, 4 * 10**6, lockstep=True)[0].now


def test_runs_of_older_formats_replay_as_they_did(tmp_path):
    """run_dir/past.py's rebuild, read through RunFiles: the committed runs predate node_clock.csv's received_bytes
    (their nodes' rounds come from training_log.csv, each trainer's tokens split evenly, node moves re-simulated); one
    written before summary.json carried weight_bytes gets P back from its all-reduce traffic, and replays the same."""
    import shutil

    assert not (FIXTURES / "adloco_seed1" / "model_training_report" / "node_clock.csv").is_file()
    rounds, weight_bytes, communicated = read_rounds(FIXTURES / "adloco_seed1")
    assert any(w.node_moves for w in rounds)
    assert all([n.tokens for n in t.work] == [t.tokens / t.num_nodes] * t.num_nodes for w in rounds for t in w.trainers)
    older = tmp_path / "adloco_seed1"
    shutil.copytree(FIXTURES / "adloco_seed1", older)
    summary = json.loads((older / "summary.json").read_text())
    del summary["weight_bytes"]
    (older / "summary.json").write_text(json.dumps(summary))
    again, inferred, _ = read_rounds(older)
    assert inferred == weight_bytes == 7148032 and again == rounds


def test_the_past_says_how_an_older_run_synced_and_what_its_evaluations_scored():
    """run_dir/past.py: a run says it reduced its compressed sync as a ring (summary.json's compressed_sync); runs
    before the ring say nothing and all-gathered. inner_eval.csv's rows name the nodes whose synced model they score;
    runs before that rule have no nodes column (None) and scored the first node's own weights."""
    from types import SimpleNamespace

    from run_dir.past import reduced_as_ring, scored_synced_models

    assert reduced_as_ring({"compressed_sync": "ring"})
    assert not reduced_as_ring({"compressed_sync": "all_gather"}) and not reduced_as_ring({})
    assert scored_synced_models([SimpleNamespace(nodes="0 1"), SimpleNamespace(nodes="2")])
    assert not scored_synced_models([SimpleNamespace(nodes="0 1"), SimpleNamespace(nodes=None)])
    assert not reduced_as_ring(json.loads((FIXTURES / "adloco_int8_seed0" / "summary.json").read_text()))


def test_a_slow_node_in_a_replayed_run_slows_its_trainer_only():
    rounds, weight_bytes, _ = read_rounds(FIXTURES / "diloco_streaming_seed0")
    nodes = {n for w in rounds for t in w.trainers for n in t.nodes}
    base, _ = timeline(rounds, parse_network("datacentre"), 5000.0, weight_bytes)
    slow, _ = timeline(rounds, parse_network("datacentre"), 5000.0, weight_bytes,
                       speeds=[0.5 if n == min(nodes) else 1.0 for n in range(max(nodes) + 1)])
    assert slow[max(slow)] > 1.9 * base[max(base)]  # one trainer: its slowest node sets every round


def test_node_schedule_parses_presence_and_slowdowns():
    schedule = NodeSchedule.parse([{"node": 3, "leave": 4, "return": 8}, {"node": 1, "slowdown": 4, "from": 2,
                                                                           "until": 6}], total_nodes=4)
    assert schedule.present(3, 4) == [0, 1, 2, 3] and schedule.present(4, 4) == [0, 1, 2]
    assert schedule.present(8, 4) == [0, 1, 2, 3]
    assert schedule.slowdown(1) == {} and schedule.slowdown(2) == {1: 4.0} and schedule.slowdown(6) == {}
    assert schedule.changes(4) == ["node 3 leaves until outer step 8"] and schedule.changes(8) == ["node 3 returns"]
    # the round driver's question, one answer per outer step
    assert schedule.round(4, 4) == RoundNodes([0, 1, 2], {1: 4.0}, ["node 3 leaves until outer step 8"])
    assert schedule.round(6, 4) == RoundNodes([0, 1, 2], {}, ["node 1 is back to full speed"])
    for bad, match in [([{"node": 9, "leave": 2}], "node 9 does not exist"),
                       ([{"node": 1, "slowdown": 0}], "slowdown must be a positive"),
                       ([{"node": 1, "leave": 4, "return": 3}], "later one"),
                       ([{"node": 1, "leave": 2, "speed": 3}], "unknown key 'speed'"),
                       ([{"node": 1}], "give leave"), (["node 1"], "expected a mapping")]:
        with pytest.raises(ValueError, match=match):
            NodeSchedule.parse(bad, total_nodes=4)


def test_a_rounds_plan_is_decided_in_one_answer_before_it():
    """RoundSchedule.plan by hand: 4 nodes, node 3 away at step 4, node 1 four times slower; trainer 0 asks 12, trainer
    1 asks 4. Three nodes present: quotas 2.25 and 0.75, trainer 1 held at one node, trainer 0 takes two; each keeps
    the nodes it had. Switch mode: 12 over max_batch 4 (above 2 x 4) accumulates 3 passes of 4, 4 over 8 runs in one.
    DyLU: at 4 x 3 the curve gives 2500 tokens/s, node 1 a quarter of it: 10 x 625 / 2500 = 2.5 -> 2 inner steps."""

    from algorithms.switch_mode import ThresholdSwitchMode

    events = NodeSchedule.parse([{"node": 3, "leave": 4, "return": 8}, {"node": 1, "slowdown": 4, "from": 2,
                                                                         "until": 6}], total_nodes=4)
    clock = Clock(SLOW, CURVE, [1.0] * 4, MB)
    owners, max_batch = {0: 0, 1: 0, 2: 1, 3: 1}, [4, 4, 8, 4]
    for by_speed, steps in ((False, {0: 10, 1: 10, 2: 10}), (True, {0: 10, 1: 2, 2: 10})):
        schedule = RoundSchedule(clock, events, ThresholdSwitchMode(), num_inner_steps=10, by_speed=by_speed)
        plan = schedule.plan(4, {0: 12, 1: 4}, owners, max_batch)
        assert plan.present == [0, 1, 2] and plan.slowdown == {1: 4.0}
        assert plan.changes == ["node 3 leaves until outer step 8"]
        assert plan.assignment == {0: [0, 1], 1: [2]}
        assert plan.shapes == {0: (4, 3), 1: (4, 3), 2: (4, 1)}
        assert plan.inner_steps == steps
    # every node back, none slower: trainer 0's 12 of 16 gives it three nodes, and node 3 (trainer 1's) moves to it
    plan = schedule.plan(8, {0: 12, 1: 4}, owners, max_batch)
    assert plan.assignment == {0: [0, 1, 3], 1: [2]} and plan.inner_steps == {0: 10, 1: 10, 2: 10, 3: 10}


def test_curve_files_are_checked(tmp_path):
    path = tmp_path / "curve.json"
    path.write_text(json.dumps(CURVE.to_dict(device="cpu")))
    assert ThroughputCurve.load(path).points == CURVE.points
    for content, match in [("{", "not a JSON"), ('{"points": []}', "non-empty list"),
                           ('{"points": [{"micro_batch": 2, "accumulation": 2, "tokens_per_s": 5}]}', "accumulation 1"),
                           ('{"points": [{"micro_batch": 2, "tokens_per_s": -5}]}', "positive")]:
        path.write_text(content)
        with pytest.raises(ValueError, match=match):
            ThroughputCurve.load(path)
    with pytest.raises(ValueError, match="cannot read"):
        ThroughputCurve.load(tmp_path / "missing.json")
    path.write_text('{"flat": true, "points": [{"micro_batch": 1, "tokens_per_s": 5}, {"micro_batch": 2, '
                    '"tokens_per_s": 6}]}')
    with pytest.raises(ValueError, match="exactly one point"):
        ThroughputCurve.load(path)


def test_a_curve_names_where_it_falls_or_bends_beyond_two_percent():
    concave = ThroughputCurve(((1, 1, 1000.0), (2, 1, 1800.0), (4, 1, 2600.0), (8, 1, 2590.0)))
    assert concave.shape_problems() == []  # 2590 is within 2% of 2600: noise, not a fall
    bent = ThroughputCurve(((1, 1, 1000.0), (2, 1, 1100.0), (3, 1, 1500.0), (2, 2, 900.0), (4, 2, 800.0)))
    assert bent.shape_problems() == [
        "is not concave at micro-batch 2 (1100 tokens/s, below the 1250 of the chord from 1 to 3, accumulation 1)",
        "falls from micro-batch 2 to 4 (900 -> 800 tokens/s, accumulation 2)"]
