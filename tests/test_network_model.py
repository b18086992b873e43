"""The network cost model of benchmarks/replay.py on hand-computed cases (lockstep=True: one round alone;
algorithms/clock.py's own cases are in test_clock.py)."""

import pytest

from algorithms.network import PRESETS, Network, parse_bandwidth, parse_latency, parse_network
from algorithms.traffic import SyncCost, ring_allreduce_bytes
from benchmarks.replay import MergeWork, RoundWork, TrainerRound, accounted_bytes, timeline

MB = 1e6
SLOW = Network("slow", bandwidth=1 * MB, latency=0.01)  # 1 MB/s, 10 ms


class Spent:
    """One round's predicted time: total, compute alone, and what the network adds."""

    def __init__(self, work: RoundWork, net: Network, node_throughput: float, weight_bytes: int) -> None:
        times, self.compute = timeline([work], net, node_throughput, weight_bytes, lockstep=True)
        self.total = times[work.step]
        self.communication = self.total - self.compute


round_time = Spent


@pytest.mark.parametrize("text, expected", [("10Gbit/s", 1.25e9), ("100 Mbps", 12.5e6), ("1.25GB/s", 1.25e9),
                                            ("8bit/s", 1.0), ("1Gb/s", 1.25e8), ("500 kB/s", 5e5)])
def test_bandwidth_units_bits_and_bytes(text, expected):
    assert parse_bandwidth(text) == pytest.approx(expected)


def test_latency_units_and_network_specs():
    assert parse_latency("1ms") == pytest.approx(1e-3) and parse_latency("10us") == pytest.approx(1e-5)
    assert parse_latency("0.05s") == pytest.approx(0.05)
    net = parse_network("10Gbit/s,1ms")
    assert (net.name, net.bandwidth, net.latency) == ("10Gbit/s,1ms", pytest.approx(1.25e9), pytest.approx(1e-3))
    assert parse_network("lab=1Gbit/s, 0.2ms") == Network("lab", pytest.approx(1.25e8), pytest.approx(2e-4))
    for name in PRESETS:
        assert parse_network(name).name == name
    assert parse_network("home=consumer").bandwidth == parse_network("consumer").bandwidth
    for bad in ("10Gbit/s", "fast,1ms", "10Gbit/s,soon", "0Gbit/s,1ms"):
        with pytest.raises(ValueError):
            parse_network(bad)


def test_a_trainer_whose_nodes_all_failed_costs_nothing():
    work = RoundWork(1, [TrainerRound(num_nodes=0, tokens=0), TrainerRound(num_nodes=1, tokens=500)], merges=[])
    assert round_time(work, SLOW, node_throughput=1000, weight_bytes=10**6).total == pytest.approx(0.5)


def test_one_node_trainer_costs_no_communication():
    work = RoundWork(1, [TrainerRound(num_nodes=1, tokens=3000, sync=SyncCost(statistics_bytes=10**9))], merges=[])
    spent = round_time(work, SLOW, node_throughput=1000, weight_bytes=10**9)
    assert spent.total == spent.compute == pytest.approx(3.0) and spent.communication == 0


def test_ring_allreduce_time_and_bytes():
    # 4 nodes, 1 MB: 2 x 3 steps of 0.25 MB, each 10 ms + 0.25 s
    assert SLOW.allreduce(4, 1 * MB) == pytest.approx(6 * (0.01 + 0.25))
    assert SLOW.allreduce(1, 1 * MB) == 0
    # the bytes one node sends are the accounting's ring bytes shared by the n nodes
    for n in (2, 3, 8):
        per_node_time = SLOW.allreduce(n, 1 * MB) - 2 * (n - 1) * SLOW.latency
        assert per_node_time * SLOW.bandwidth == pytest.approx(ring_allreduce_bytes(n, 10**6) / n)


def test_a_round_by_hand_trainers_in_parallel_merges_by_survivor_moves_in_parallel():
    work = RoundWork(1, [TrainerRound(1, 1000),  # 1 s, no sync
                         TrainerRound(2, 4000)],  # 2 s per node + ring of 1 MB over 2: 2 x (0.01 + 0.5)
                     merges=[MergeWork(0, 2 * 10**6), MergeWork(0, 10**6),  # into 0: 2.01 + 1.01; into 5: 1.01
                             MergeWork(5, 10**6)],
                     node_moves=2, node_move_bytes=2 * 10**6)  # each node receives 1 MB: 1.01, in parallel
    spent = round_time(work, SLOW, node_throughput=1000, weight_bytes=10**6)
    assert spent.compute == pytest.approx(2.0)
    assert spent.total == pytest.approx(3.02 + 3.02 + 1.01)
    assert accounted_bytes([work], 10**6) == 2 * 10**6 + 4 * 10**6 + 2 * 10**6


def test_statistics_add_their_vector_all_reduce_and_a_scalar_one():
    plain = RoundWork(1, [TrainerRound(4, 4000)], merges=[])
    with_stats = RoundWork(1, [TrainerRound(4, 4000, sync=SyncCost(statistics_bytes=2 * 10**6 + 56))], merges=[])
    extra = (round_time(with_stats, SLOW, 1000, 10**6).total - round_time(plain, SLOW, 1000, 10**6).total)
    assert extra == pytest.approx(SLOW.allreduce(4, 2 * 10**6) + SLOW.allreduce(4, 56))


def test_a_gathered_compressed_sync_is_an_all_gather_of_the_payload():
    """4 nodes, each with a 250 kB payload all-gathered (top-k, and every compressed run made before the ring):
    3 steps of (latency + 250 kB / bandwidth), instead of the fp32 ring all-reduce's 6 steps of P / 4; the
    accounting charges n (n-1) x C."""
    fp32 = RoundWork(1, [TrainerRound(4, 4000)], merges=[])
    int8 = RoundWork(1, [TrainerRound(4, 4000, sync=SyncCost(sync_bytes=250_000))], merges=[])
    assert round_time(int8, SLOW, 1000, 10**6).communication == pytest.approx(3 * (SLOW.latency + 250_000 / MB))
    assert round_time(fp32, SLOW, 1000, 10**6).communication == pytest.approx(6 * (SLOW.latency + 250_000 / MB))
    assert accounted_bytes([int8], 10**6) == 4 * 3 * 250_000
    assert SLOW.allgather(1, 10**6) == 0.0


def test_a_compressed_ring_costs_what_a_ring_all_reduce_of_the_payload_does():
    """4 nodes, a 250 kB int8 payload as a ring of quantized shards: 6 steps of (latency + 62.5 kB / bandwidth),
    2 (n-1) x C in all; a streamed fragment's shard messages each carry the sender's 4-byte flag."""
    ring = RoundWork(1, [TrainerRound(4, 4000, sync=SyncCost(sync_bytes=250_000, ring=True))], merges=[])
    assert round_time(ring, SLOW, 1000, 10**6).communication == pytest.approx(6 * (SLOW.latency + 62_500 / MB))
    assert accounted_bytes([ring], 10**6) == 2 * 3 * 250_000
    fragment = SyncCost(sync_bytes=250_000, fragment_bytes=(125_008, 125_008), ring=True)
    fragments = RoundWork(1, [TrainerRound(4, 4000, sync=fragment)], merges=[])
    assert accounted_bytes([fragments], 10**6) == 2 * 2 * 3 * (125_004 + 4 * 4)


def test_streaming_fragments_cost_only_what_the_delay_does_not_hide():
    """2 nodes, 1000 tokens per node at 1000 tokens/s over H = 10 inner steps (0.1 s each); two fragments of
    0.5 MB (+4 bytes): each ring all-reduce takes 2 x 10 ms + 0.5 MB / (1 MB/s) = 0.52 s (the 4 bytes aside)."""
    def work(delay):
        fragments = TrainerRound(2, 2000, sync=SyncCost(fragment_bytes=(500_004, 500_004), overlap_steps=delay,
                                                        inner_steps=10))
        return RoundWork(1, [fragments], merges=[])

    one = SLOW.allreduce(2, 500_004)
    assert one == pytest.approx(0.52, abs=1e-5)
    assert round_time(work(0), SLOW, 1000, 10**6).communication == pytest.approx(2 * one)  # F latencies, no hiding
    assert round_time(work(1), SLOW, 1000, 10**6).communication == pytest.approx(2 * (one - 0.1))
    assert round_time(work(4), SLOW, 1000, 10**6).communication == pytest.approx(2 * (one - 0.4))
    fast = Network("fast", bandwidth=100 * MB, latency=0.001)  # 2 x 1 ms + 5 ms < one inner step: all hidden
    assert round_time(work(1), fast, 1000, 10**6).communication == 0.0
    assert accounted_bytes([work(1)], 10**6) == 2 * ring_allreduce_bytes(2, 500_004)
    # compressed: each fragment's payload all-gathered
    gathered = TrainerRound(2, 2000, sync=SyncCost(sync_bytes=250_000, fragment_bytes=(125_008, 125_008),
                                                   overlap_steps=1, inner_steps=10))
    assert accounted_bytes([RoundWork(1, [gathered], merges=[])], 10**6) == 2 * 2 * 1 * 125_008
    assert round_time(RoundWork(1, [gathered], merges=[]), SLOW, 1000, 10**6).communication == \
        pytest.approx(2 * (SLOW.allgather(2, 125_008) - 0.1))


def test_latency_is_paid_per_round_and_bandwidth_per_byte():
    rounds = [RoundWork(step, [TrainerRound(4, 4000)], merges=[]) for step in (1, 2, 3)]
    instant = Network("no bandwidth limit", bandwidth=1e30, latency=0.05)
    times, compute = timeline(rounds, instant, node_throughput=1000, weight_bytes=10**9)
    assert compute == pytest.approx(3.0)  # 1000 tokens per node per round at 1000 tokens/s
    assert times == {0: 0.0, 1: pytest.approx(1.3), 2: pytest.approx(2.6), 3: pytest.approx(3.9)}  # 6 x 50 ms each
    no_latency = Network("bandwidth only", bandwidth=1 * MB, latency=0.0)
    times, _ = timeline(rounds, no_latency, node_throughput=1000, weight_bytes=10**6)
    assert times[3] == pytest.approx(3 * (1.0 + 1.5))  # each node sends 2 x 3/4 MB per round


def test_network_check_calibrates_on_loopback_and_compares_all_reduces(tmp_path):
    """benchmarks/network_check.py under a real torchrun (2 gloo processes): calibrated numbers, and every
    all-reduce size measured beside its prediction (how close they are is machine-dependent: not asserted)."""
    import json
    import subprocess
    import sys

    from tests.conftest import ROOT

    out = tmp_path / "check"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.network_check", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    cal = json.loads((out / "calibration.json").read_text())
    assert cal["procs"] == 2 and cal["latency_s"] > 0 and cal["bandwidth_bytes_s"] > 0
    sizes = [r["bytes"] for r in cal["allreduce"]]
    assert sizes == sorted(sizes) and 7_148_032 in sizes
    for r in cal["allreduce"]:
        model = Network("loopback", cal["bandwidth_bytes_s"], cal["latency_s"])
        assert r["predicted_s"] == pytest.approx(model.allreduce(2, r["bytes"]))
        assert r["measured_s"] > 0 and r["measured_over_predicted"] == pytest.approx(r["measured_s"] / r["predicted_s"])
    assert "| all-reduce of | measured s | model s |" in (out / "results.md").read_text()
