"""Pieces of the torch.distributed path (issue 11), checked over a real gloo process group on CPU."""

import json

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from algorithms.calc_batch import AugmentedInnerProductTest, GradientSamples, NodeGradientSums, NormTest, statistics_of

WORLD = 3
SIZES = [[1.0, 2.0, 3.0], [2.0, 2.0], [4.0, 1.0, 1.0, 2.0]]  # unequal micro-batches on each node


def node_samples(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + rank)
    sizes = torch.tensor(SIZES[rank], dtype=torch.float64)
    return torch.randn(len(sizes), 40, generator=gen, dtype=torch.float64) + 0.2 * (rank + 1), sizes


def batch_tests():
    return {"norm": NormTest(eta=0.05), "aip": AugmentedInnerProductTest(vartheta=0.05, nu=0.1)}


def worker(rank: int, store: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        grads, sizes = node_samples(rank)
        results = {}
        for within_node in (True, False):
            share = NodeGradientSums.of(grads, sizes, within_node)
            buffer = share.pack()
            dist.all_reduce(buffer)  # one vector all-reduce: the b-weighted gradient sum plus scalars
            total = NodeGradientSums.unpack(buffer)
            mean = total.weighted_sum / total.batch
            inner = torch.tensor([share.inner_sum(grads, sizes, mean, within_node)], dtype=torch.float64)
            dist.all_reduce(inner)  # then one scalar
            stats = total.statistics(float(inner), within_node)
            decisions = {name: test(stats, 1, WORLD) for name, test in batch_tests().items()}
            results[str(within_node)] = {name: d.stats | {"batch": d.requested_batch} for name, d in decisions.items()}
        with open(f"{out}/rank{rank}.json", "w") as f:
            json.dump(results, f)
    finally:
        dist.destroy_process_group()


def test_batch_tests_over_a_gloo_all_reduce_match_the_simulation(tmp_path):
    mp.start_processes(worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=WORLD, start_method="spawn")
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    assert ranks[0] == ranks[1] == ranks[2]  # every rank takes the same decision
    parts = [node_samples(r) for r in range(WORLD)]
    grads = torch.cat([g for g, _ in parts])
    sizes = torch.cat([b for _, b in parts])
    for within_node in (True, False):
        groups = torch.cat([torch.full((len(b),), r) for r, (_, b) in enumerate(parts)]) if within_node \
            else torch.zeros(len(sizes), dtype=torch.long)
        direct = statistics_of(GradientSamples(grads, sizes, groups))
        for name, test in batch_tests().items():
            expected = test(direct, 1, WORLD)
            got = ranks[0][str(within_node)][name]
            assert got["batch"] == expected.requested_batch > 1
            for key, value in expected.stats.items():
                assert abs(got[key] - value) <= 1e-9 * abs(value), (within_node, name, key)
