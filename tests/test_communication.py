"""Compression of the outer sync, error feedback, the count sketch of the batch statistics: exact numbers."""

import math

import pytest
import torch

from algorithms.calc_batch import GradientSamples, NormTest, statistics_of
from algorithms.compression import CHUNK, build_compressor
from algorithms.outer_sync import OuterSync
from algorithms.sketch import CountSketch, sketch_coefficients


def test_int8_round_trip_by_hand():
    codec = build_compressor("int8")
    x = torch.tensor([1.0, -0.5, 0.25, 0.0])  # one chunk: scale = 1 / 127
    payload = codec.encode(x)
    assert payload.dtype == torch.uint8 and payload.numel() == codec.payload_bytes(4) == 4 + 4
    # the scale (fp32) first, then one int8 per entry: round(-63.5) = -64 (half to even), round(31.75) = 32
    assert payload[:4].view(torch.float32).item() == pytest.approx(1 / 127)
    assert payload[4:].view(torch.int8).tolist() == [127, -64, 32, 0]
    assert codec.decode(payload, 4).tolist() == pytest.approx([1.0, -64 / 127, 32 / 127, 0.0], abs=1e-7)


@pytest.mark.parametrize("name, bound", [("int8", 0.5 / 127), ("fp8", 2 ** -4), ("bf16", 2 ** -8)])
def test_round_trip_error_stays_within_its_bound(name, bound):
    """int8: |error| <= scale / 2 = max|chunk| / 254; fp8 e4m3 and bf16: relative rounding 2^-4 and 2^-8."""
    codec = build_compressor(name)
    x = torch.randn(3 * CHUNK + 17, generator=torch.Generator().manual_seed(0))
    x[CHUNK:2 * CHUNK] *= 1e-3  # chunks of very different magnitudes keep their own scales
    back = codec.decode(codec.encode(x), x.numel())
    chunk_max = torch.cat([c.abs().max().expand(c.numel()) for c in x.split(CHUNK)])
    if name == "int8":
        assert bool(((back - x).abs() <= bound * chunk_max + 1e-9).all())
    else:  # floating formats: relative to each value (fp8 also has a subnormal floor relative to its chunk)
        assert bool(((back - x).abs() <= bound * x.abs() + 2 ** -9 * chunk_max / 448 + 1e-12).all())
    assert codec.payload_bytes(x.numel()) == codec.encode(x).numel()


def test_payload_sizes():
    n = 10 * CHUNK
    assert build_compressor("none").payload_bytes(n) == 4 * n
    assert build_compressor("bf16").payload_bytes(n) == 2 * n
    assert build_compressor("int8").payload_bytes(n) == n + 4 * 10
    assert build_compressor("fp8").payload_bytes(n) == n + 4 * 10
    # top 2%: 205 kept, each a 4-byte index and a byte, and one scale for the 205 values
    assert build_compressor("topk", 0.02).payload_bytes(n) == 205 * 5 + 4


def test_topk_keeps_the_largest_entries_and_breaks_ties_by_index():
    codec = build_compressor("topk", 0.5)
    x = torch.tensor([0.1, -3.0, 2.0, 0.0, 2.0, -0.2])  # k = 3: -3 and both 2s, as int8 with scale 3/127
    back = codec.decode(codec.encode(x), 6)
    step = 3.0 / 127
    assert back.tolist() == pytest.approx([0.0, -127 * step, 85 * step, 0.0, 85 * step, 0.0], abs=1e-6)
    quarter = build_compressor("topk", 0.25)  # k = 1 of 4
    tie = quarter.decode(quarter.encode(torch.tensor([1.0, -1.0, 1.0, 0.5])), 4)
    assert tie.tolist() == [1.0, 0.0, 0.0, 0.0]  # equal magnitudes: the lowest index wins


def _state(values):
    return {"w": torch.tensor(values, dtype=torch.float32)}


def test_error_feedback_sends_what_compression_dropped_in_a_later_round():
    """top-1 of two entries: without feedback the small entry never travels; with it, the residual grows
    until it is the largest and goes out, so over rounds the sum sent approaches the sum of the deltas."""
    master = _state([0.0, 0.0])
    node = _state([-1.0, -0.4])  # delta = master - node = [1.0, 0.4] every round
    for feedback, expected_second in ((False, 0.0), (True, 0.4 * 10)):
        sync = OuterSync("topk", error_feedback=feedback, topk_fraction=0.5)
        residual, sent = None, torch.zeros(2)
        for _ in range(10):
            payload, residual = sync.encode(master, node, residual)
            sent += sync.compressor.decode(payload, 2)
        # with feedback the second entry went out 3 times (1.2 each; 3 x 1.2 = 3.6 of 4.0); the rest is the residual
        if feedback:
            assert sent[1].item() + residual[1].item() == pytest.approx(expected_second, rel=1e-6)
            assert sent[0].item() + residual[0].item() == pytest.approx(10.0, rel=1e-6)
            assert sent[1].item() == pytest.approx(3.6, abs=0.02)
        else:
            assert residual is None and sent[1].item() == expected_second and sent[0].item() == pytest.approx(10.0)


def test_error_feedback_recovers_a_component_int8_rounds_away():
    """A delta far below one int8 step of its chunk is rounded to 0 every round; error feedback adds it up
    until it crosses half a step, so the mean sent over N rounds converges to the true delta."""
    master = _state([0.0, 0.0])
    node = _state([-1.0, -0.001])  # delta [1, 0.001]; one step = 1/127 ~ 0.0079
    sync = OuterSync("int8", error_feedback=True)
    residual, sent = None, torch.zeros(2)
    for _ in range(127):
        payload, residual = sync.encode(master, node, residual)
        sent += sync.compressor.decode(payload, 2)
    assert sent[1].item() == pytest.approx(0.127, abs=1 / 127)  # within one step of 127 x 0.001
    assert sent[1].item() + residual[1].item() == pytest.approx(0.127, rel=1e-4)
    without = OuterSync("int8", error_feedback=False)
    assert without.compressor.decode(without.encode(master, node, None)[0], 2)[1].item() == 0.0


def test_node_mean_of_compressed_pseudo_gradients_by_hand():
    master = {"a": torch.tensor([1.0, 1.0]), "b": torch.tensor([2.0])}
    nodes = [{"a": torch.tensor([0.5, 1.0]), "b": torch.tensor([2.0])},
             {"a": torch.tensor([1.0, 0.0]), "b": torch.tensor([1.0])}]
    sync = OuterSync("bf16")  # these deltas are exact in bf16
    payloads = [sync.encode(master, n, None)[0] for n in nodes]
    mean = sync.node_mean(master, payloads)
    # deltas [0.5, 0, 0] and [0, 1, 1]: mean [0.25, 0.5, 0.5]; node mean = master - mean
    assert mean["a"].tolist() == [0.75, 0.5] and mean["b"].tolist() == [1.5]
    assert OuterSync("none").exact and not OuterSync("none").error_feedback


def test_unknown_scheme_and_bad_fraction():
    with pytest.raises(ValueError, match="unknown compression"):
        build_compressor("int4")
    with pytest.raises(ValueError, match="topk_fraction"):
        build_compressor("topk", 0.0)


# --- the count sketch -----------------------------------------------------------------------------------
def test_sketch_is_linear_seeded_and_exact_without_collisions():
    sketch = CountSketch(8, sketch_coefficients(5))
    x = torch.randn(3, 100, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    y = sketch(x)
    assert y.shape == (3, 8) and y.dtype == torch.float64
    torch.testing.assert_close(sketch(2 * x[:1] - x[1:2]), 2 * y[:1] - y[1:2])  # linear
    assert torch.equal(CountSketch(8, sketch_coefficients(5))(x), y)  # the same matrix from the same seed
    buckets, signs = sketch.buckets_and_signs(0, 100)
    dense = torch.zeros(8, 100, dtype=torch.float64)
    dense[buckets, torch.arange(100)] = signs
    torch.testing.assert_close(y, x @ dense.T)  # S has one +-1 per column
    # a vector with one nonzero entry keeps its norm exactly
    one = torch.zeros(1, 100, dtype=torch.float64)
    one[0, 37] = 3.0
    assert float((sketch(one) ** 2).sum()) == 9.0


def test_sketched_squared_norms_are_unbiased_with_relative_error_about_sqrt_2_over_k():
    k, p = 256, 4096
    x = torch.randn(1, p, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    exact = float((x ** 2).sum())
    ratios = torch.tensor([float((CountSketch(k, sketch_coefficients(s))(x) ** 2).sum()) / exact for s in range(200)])
    assert abs(float(ratios.mean()) - 1) < 3 * math.sqrt(2 / k) / math.sqrt(200)  # unbiased
    assert float(ratios.std()) == pytest.approx(math.sqrt(2 / k), rel=0.25)  # the error the README states


def test_norm_test_statistics_in_sketch_space_agree_with_the_exact_ones():
    """Known answer: 8 samples, mean direction m plus noise; the norm test's variance and ||g||^2 from the
    sketched samples are within a few sqrt(2/k) of the exact ones, and the decision matches."""
    gen = torch.Generator().manual_seed(3)
    p, k = 20000, 4096
    direction = torch.randn(p, generator=gen, dtype=torch.float64)
    grads = direction + 0.5 * torch.randn(8, p, generator=gen, dtype=torch.float64)
    sizes = torch.full((8,), 4.0, dtype=torch.float64)
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    exact = statistics_of(GradientSamples(grads, sizes, groups))
    sketched = statistics_of(GradientSamples(CountSketch(k, sketch_coefficients(9))(grads), sizes, groups))
    tolerance = 4 * math.sqrt(2 / k)
    assert sketched.sq_norm == pytest.approx(exact.sq_norm, rel=tolerance)
    assert sketched.weighted_dev == pytest.approx(exact.weighted_dev, rel=tolerance)
    test = NormTest(eta=0.5)
    assert test(sketched, 1, 2).requested_batch == test(exact, 1, 2).requested_batch


# ----------------------------------------------------------------------------------------------
# The ring of quantized shards (issue 33)


def test_ring_shards_are_chunk_aligned_and_each_is_the_encoding_of_its_entries_alone():
    assert OuterSync.ring_spans(2500, 2) == [(0, 2048), (2048, 2500)]
    assert OuterSync.ring_spans(2500, 4) == [(0, 1024), (1024, 2048), (2048, 2500), (2500, 2500)]
    x = torch.randn(2500, generator=torch.Generator().manual_seed(0))
    for name in ("int8", "fp8", "bf16"):
        sync = OuterSync(name)
        assert sync.ring and not OuterSync("topk").ring and not OuterSync("none").ring
        payload = sync.compressor.encode(x)
        shards = sync.shards(payload, 2500, 4)
        assert sum(s.numel() for s in shards) == payload.numel() == sync.payload_bytes(2500)
        for shard, (a, b) in zip(shards, OuterSync.ring_spans(2500, 4)):
            assert torch.equal(shard, sync.compressor.encode(x[a:b]))  # byte for byte
        assert shards[3].numel() == 0


def test_an_owner_sums_in_fp32_and_re_encodes_the_mean_with_its_own_scale_by_hand():
    """int8, two nodes, one shard each way: node 0's delta [1, 0.5] travels as [127, 64] x 1/127 (63.5 rounds
    half to even), node 1's [0, 0.25] as [0, 127] x 0.25/127; the owner's mean [0.5, 0.37697] is re-encoded
    with the scale 0.5/127: [127, 96] (95.75 rounds up), so every node ends with [0.5, 96 x 0.5/127]."""
    sync = OuterSync("int8")
    master = {"w": torch.tensor([2.0, 2.0])}
    payloads = [sync.encode(master, {"w": torch.tensor([1.0, 1.5])}, None)[0],
                sync.encode(master, {"w": torch.tensor([2.0, 1.75])}, None)[0]]
    ring = sync.ring_node_mean(master, payloads, 2)["w"]
    mean = torch.tensor([0.5, 96 * (0.5 / 127)])
    assert torch.allclose(ring, torch.tensor([2.0, 2.0]) - mean, rtol=0, atol=1e-7)
    plain = sync.node_mean(master, payloads)["w"]  # every payload decoded: no re-encoding of the mean
    assert plain[1].item() == pytest.approx(2.0 - (64 / 127 + 0.25) / 2, abs=1e-7) and plain[1] != ring[1]
    assert torch.equal(sync.mean_of(master, payloads, 2)["w"], ring)
    assert torch.equal(sync.mean_of(master, payloads[:1], 1)["w"], sync.node_mean(master, payloads[:1])["w"])


def test_the_ring_sends_two_n_minus_one_payloads_in_all_and_falls_with_the_compression_at_any_n():
    from algorithms.traffic import SyncCost, Traffic

    def sent(n, payload, **how):
        traffic = Traffic()
        traffic.add(SyncCost(**how), n, payload)  # payload: P, the fp32 weights
        return traffic.allreduce_bytes

    assert sent(4, 100) == 2 * 3 * 100  # a ring all-reduce of the payload
    assert sent(4, 0, sync_bytes=100) == 4 * 3 * 100  # top-k: all-gathered
    assert sent(4, 0, sync_bytes=100, ring=True) == 2 * 3 * 100  # a ring of quantized shards
    # a fragment: each shard message carries the flag
    assert sent(4, 0, sync_bytes=99, fragment_bytes=(104,), ring=True) == 2 * 3 * (100 + 4 * 4)
    numel = 3_478_016 // 4  # microllama-tiny's weights
    for n in (2, 4, 8, 16, 64):
        fp32 = sent(n, 4 * numel)
        assert sent(n, 4 * numel, sync_bytes=OuterSync("int8").payload_bytes(numel), ring=True) <= 0.30 * fp32
        assert sent(n, OuterSync("fp8").payload_bytes(numel)) <= 0.30 * fp32
        assert sent(n, OuterSync("bf16").payload_bytes(numel)) <= 0.55 * fp32


def test_topk_selection_is_the_stable_sorts_on_ties_and_random_data():
    from algorithms.compression import TopK

    gen = torch.Generator().manual_seed(0)
    for x in (torch.randn(5000, generator=gen), torch.randint(0, 4, (5000,), generator=gen).float(),
              torch.zeros(100), torch.tensor([1.0, 2.0, 2.0, 2.0, 1.0])):
        for k in (1, 3, 50, x.numel()):
            k = min(k, x.numel())
            stable = torch.sort(x.abs(), descending=True, stable=True).indices[:k].sort().values
            assert torch.equal(TopK.largest(x.abs(), k), stable)


def test_a_master_flattened_once_per_trainer_encodes_as_each_node_flattening_it():
    from algorithms.outer_sync import flatten

    gen = torch.Generator().manual_seed(1)
    master = {"b": torch.randn(3000, generator=gen), "a": torch.randn(7, 5, generator=gen)}
    node = {k: v + 1e-3 * torch.randn(v.shape, generator=gen) for k, v in master.items()}
    for name in ("int8", "topk"):
        sync = OuterSync(name)
        residual = torch.randn(3035, generator=gen) * 1e-4
        own = sync.encode(master, node, residual)
        shared = sync.encode(master, node, residual, flatten(master, sorted(master), "cpu"))
        assert torch.equal(own[0], shared[0]) and torch.equal(own[1], shared[1])


def test_the_plain_rounds_mean_is_one_function_whatever_crosses_processes():
    """distributed/plain.py: node_mean by hand, with every node here (the in-process transport) and with one node
    here and the other's part arriving through the transport (as torchrun's all-reduce): the same numbers."""
    from distributed.plain import LocalWeights, node_mean

    master = {"w": torch.zeros(2), "b": torch.zeros(1)}
    states = {0: {"w": torch.tensor([1.0, 2.0]), "b": torch.tensor([4.0])},
              1: {"w": torch.tensor([3.0, 6.0]), "b": torch.tensor([8.0])}}
    exact = OuterSync("none")
    here = node_mean(master, states, {}, [0, 1], None, LocalWeights(exact, 2), "cpu")
    assert here["w"].tolist() == [2.0, 4.0] and here["b"].tolist() == [6.0]
    shared = node_mean(master, states, {}, [0, 1], [0.25, 0.75], LocalWeights(exact, 2), "cpu")
    assert shared["w"].tolist() == [2.5, 5.0] and shared["b"].tolist() == [7.0]  # token shares: no division

    class OtherProcess(LocalWeights):  # node 1 lives elsewhere: its weights arrive in the sum (sorted names: b, w)
        def sum(self, total):
            return total + torch.tensor([8.0, 3.0, 6.0])

    apart = node_mean(master, {0: states[0]}, {}, [0, 1], None, OtherProcess(exact, 2), "cpu")
    assert all(torch.equal(apart[k], here[k]) for k in master)
    failed_here = node_mean(master, {0: None}, {}, [1], None, OtherProcess(exact, 2), "cpu")
    assert failed_here["w"].tolist() == [3.0, 6.0]  # a failed node adds nothing; the mean is over the good one
    # compressed: the good nodes' payloads, decoded, master minus their mean (int8, every payload here)
    int8 = OuterSync("int8", error_feedback=False)
    payloads = {n: int8.encode(master, states[n], None)[0] for n in states}
    ring = node_mean(master, {}, payloads, [0, 1], None, LocalWeights(int8, 2), "cpu")
    assert torch.allclose(ring["w"], here["w"], atol=0.05) and torch.allclose(ring["b"], here["b"], atol=0.05)
