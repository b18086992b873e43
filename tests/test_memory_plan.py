"""The memory plan (cluster/memory_plan.py), the bound on nodes computing at once (max_concurrent_nodes) and idle
nodes offloaded to host memory (offload_idle_nodes): bytes against real tensors, the paper's two readings on an
80 GB card, a refused plan, and the probe's share."""

import json
import subprocess
import sys
import threading

import pytest
import torch

from benchmarks.memory_plan import main
from cluster.max_batch_calculator import NodeShare
from cluster.memory_plan import ModelSizes, model_sizes, plan_for_config, plan_memory
from fabrics.models import load_preset
from node import Node, NodeJob
from tests.conftest import ROOT, TINY
from utils.config import load_config

GiB = 1 << 30


def _tiny_llama(device: str = "cpu"):
    from transformers import LlamaForCausalLM

    with torch.device(device):
        return LlamaForCausalLM(load_preset("microllama-tiny")).float()


def adamw(params):
    return torch.optim.AdamW(list(params), lr=1e-3)


def test_the_plans_bytes_are_the_tensors_of_a_real_node():
    """weights, gradients and AdamW state as planned from the meta model are the bytes a real node holds after a
    step; the meta activations are within 20% above what a real CPU pass saves (the plan errs on the safe side)."""
    from cluster.max_batch_calculator import _activation_bytes

    torch.manual_seed(0)
    model = _tiny_llama()
    sizes = model_sizes(_tiny_llama("meta"), adamw, seq_len=64)
    opt = adamw(model.parameters())
    ids = torch.randint(0, 4096, (2, 64))
    model(input_ids=ids, labels=ids).loss.backward()
    grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters())
    opt.step()
    state = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values() if v.dim() > 0)
    weights = sum(v.numel() * v.element_size() for v in model.state_dict().values() if v.is_floating_point())
    assert (sizes.weight_bytes, sizes.gradient_bytes, sizes.optimizer_bytes) == (weights, grads, state)
    assert sizes.optimizer_bytes == 2 * sizes.gradient_bytes  # AdamW: two fp32 moments
    model.train()
    real = _activation_bytes(model, 64, 3) - _activation_bytes(model, 64, 2)  # one more sequence, weights aside
    assert real <= sizes.activation_bytes_per_sequence <= 1.2 * real


def test_the_statistics_reserved_are_the_samples_the_cluster_takes_by_hand():
    """One rule for a node's gradient samples (algorithms.comm_plan.gradient_samples), read by build_cluster's plan
    and by the memory plan: fp32 samples of every trainable parameter, or the fp64 sketch; none without statistics."""
    from algorithms.comm_plan import gradient_samples
    from utils.run_plan import sample_bytes as statistics_sample_bytes

    assert [gradient_samples(False, True, 4), gradient_samples(True, True, 4), gradient_samples(True, False, 4)] == [
        0, 4, 1]
    base = load_config(ROOT / "config.yaml", ["sampling_method=norm_test", "variance_estimator=micro_batches",
                                              "variance_micro_batches=4"])
    assert statistics_sample_bytes(base, 1000) == 4 * 1000 * 4
    assert statistics_sample_bytes(base.replace(variance_estimator="nodes"), 1000) == 1000 * 4
    sketched = base.replace(statistics_comm="sketch", statistics_sketch_dim=64)
    assert statistics_sample_bytes(sketched, 1000) == 4 * 64 * 8
    constant = base.replace(sampling_method="constant", log_batch_statistics=False)
    assert statistics_sample_bytes(constant, 1000) == 0
    assert statistics_sample_bytes(constant.replace(log_batch_statistics=True), 1000) == 4 * 1000 * 4


def test_the_plan_adds_up_by_hand():
    """16 nodes on one card, 4 simulated devices, 4 trainers, masters on the card: every term by hand."""
    cfg = load_config(ROOT / "configs" / "paper_microllama_c4_16nodes.yaml")
    w, a1, a = 1000, 50, 10  # weight bytes, activations of one sequence, per further sequence
    sizes = ModelSizes(w, w, 2 * w, a1, a, trainable=250)
    resident = plan_memory(cfg.replace(offload_idle_nodes=False, max_concurrent_nodes=0), sizes, 3, True,
                           "cuda:0", 80, statistics_sample_bytes=w)
    (card,) = resident.devices
    assert (card.device, card.nodes, card.computing) == ("cuda:0", 16, 16)
    assert card.resident == {"node_weights": 16 * w, "node_optimizer": 16 * 2 * w, "residuals": 0, "evaluator": w,
                             "masters": 4 * w, "outer_optimizer": 0}
    assert card.transient == {"moved_in": 0, "gradients": 16 * w, "activations": 16 * (a1 + 2 * a),
                              "statistics": 16 * w}
    assert card.capacity_bytes == 80 * GiB
    assert resident.host == {"offloaded_nodes": 0, "masters": 0, "rollback_snapshot": 16 * 2 * w,
                             "checkpoint_copy": 16 * 2 * w}  # each node's optimizer state, copied twice
    offloaded = plan_memory(cfg, sizes, 3, True, "cuda:0", 80, statistics_sample_bytes=w)  # as written: both keys
    (card,) = offloaded.devices
    assert card.computing == 4  # one per simulated device
    assert card.resident["node_weights"] == card.resident["node_optimizer"] == 0
    assert card.transient["moved_in"] == 4 * 3 * w and card.transient["gradients"] == 4 * w
    assert offloaded.host["offloaded_nodes"] == 16 * 3 * w and offloaded.host_bytes == 16 * 3 * w + 2 * 16 * 2 * w
    looped = plan_memory(cfg, sizes, 3, False, "cuda:0", 80)  # nodes in a loop: one computes at a time
    assert looped.devices[0].computing == 1


def test_the_paper_readings_on_an_80_gb_card(capsys):
    """The 16-node reading does not fit with every node resident, fits offloaded with one node per simulated device
    computing (its config as written); the 4-node reading fits as it is (MicroLlama's preset on the meta device)."""
    sixteen = str(ROOT / "configs" / "paper_microllama_c4_16nodes.yaml")
    def memory_plan(*args):  # python -m benchmarks.memory_plan, in this process
        code = main(list(args))
        return code, capsys.readouterr().out

    code, out = memory_plan("--config", sixteen, "--capacity_gb", "80", "--json", "offload_idle_nodes=false",
                            "max_concurrent_nodes=0")
    plan = json.loads(out)
    assert code == 1 and plan["fits"] is False and plan["devices"][0]["planned_bytes"] > 80 * GiB
    assert plan["keys_that_fit"] == "offload_idle_nodes=true max_concurrent_nodes=1"
    code, out = memory_plan("--config", sixteen, "--capacity_gb", "80", "--json")
    plan = json.loads(out)
    assert code == 0 and plan["devices"][0]["fits"] is True and plan["devices"][0]["capacity_bytes"] == 80 * GiB
    assert plan["host_bytes"] > 50 * GiB  # 16 nodes' weights and AdamW state wait in host memory
    code, out = memory_plan("--config", str(ROOT / "configs" / "paper_microllama_c4.yaml"), "--capacity_gb", "80")
    assert code == 0 and "cuda:0" in out and "fits" in out and "NOT" not in out


def test_a_plan_that_cannot_fit_is_refused_before_any_run_directory(tmp_path, tiny_config):
    """run.py: one line naming the keys that would make it fit, exit 2, no run directory."""
    cfg = tiny_config()
    args = [f"{k}={v}" for k, v in (("cache_dir", cfg.cache_dir), ("log_dir", cfg.log_dir))]
    too_small = ["nodes_per_gpu=64", "num_init_trainers=2", "device_memory_mb=100", "node_execution=threads",
                 "max_batch_size=1", "tokenizer=bpe", "tokenizer_vocab_size=512", "seq_len=32",
                 "sampling_method=constant", "log_batch_statistics=false"]
    out = subprocess.run([sys.executable, str(ROOT / "run.py"), *args, "clearml_mode=off", *too_small], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2, out.stderr
    assert len(lines) == 1 and lines[0].startswith("error: memory plan: cpu[0] needs"), lines
    assert "(64 nodes, 64 computing at once)" in lines[0]
    assert "set offload_idle_nodes=true max_concurrent_nodes=1" in lines[0]  # neither alone is enough here
    assert not (tmp_path / "logs").exists()
    fixed = load_config(ROOT / "config.yaml", [*too_small, "offload_idle_nodes=true", "max_concurrent_nodes=1"])
    assert plan_for_config(fixed).fits


def test_the_probe_shares_memory_among_the_nodes_that_compute():
    """A node's share: the device's usable bytes less what the idle nodes keep, over the nodes computing at once."""
    mib = 1 << 20
    every = NodeShare(0.5, 4, memory_mb=100)
    assert every.cpu_bytes() == 0.5 * 100 * mib / 4  # today's share, unchanged when all compute
    bounded = NodeShare(0.5, 4, memory_mb=100, computing=1, idle_bytes=2 * mib)
    assert bounded.cpu_bytes() == 0.5 * 100 * mib - 3 * 2 * mib
    offloaded = NodeShare(0.5, 4, memory_mb=100, computing=2, idle_bytes=0)
    assert offloaded.cpu_bytes() == 0.5 * 100 * mib / 2
    card = NodeShare(0.9, 4, nodes_on_card=16, computing=1, computing_on_card=4, idle_bytes=GiB)
    assert card.cuda_bytes(80 * GiB) == (0.9 * 80 * GiB - 12 * GiB) / 4


def test_offloading_moves_a_nodes_state_exactly_and_frees_the_device_copy():
    """release: weights and AdamW moments to host buffers (same tensor objects); the next round brings them back
    bit for bit, and the round's numbers are those of a node that never left."""
    from fabrics.dataset_loader import PackedData

    torch.manual_seed(0)
    model = _tiny_llama()
    ids = torch.randint(0, 4096, (8, 16))
    data = PackedData(ids, torch.ones_like(ids))
    twins = [Node(i, "cpu", _copy(model), adamw, 0.0, data) for i in range(2)]
    twins[1].offload.enabled = True
    master = {k: v.clone() for k, v in model.state_dict().items()}
    job = NodeJob(0, 0, master, torch.arange(8).reshape(2, 2, 2), grad_chunks=0, reset_optimizer=False)
    for _ in range(2):  # the second round starts from the moments the first left (offloaded in between)
        results = [n.run(job) for n in twins]
        before = {id(p): p.data.data_ptr() for p in twins[1].params}
        twins[1].release()
        assert not twins[1].offload.resident
        assert all(p.data.data_ptr() != before[id(p)] for p in twins[1].params)  # now the host buffers
        assert results[0].step_losses == results[1].step_losses
        for k in results[0].state:
            assert torch.equal(results[0].state[k], results[1].state[k])
    moments = [[v for s in n.optimizer.state.values() for k, v in s.items() if k != "step"] for n in twins]
    assert all(torch.equal(a, b) for a, b in zip(*moments))


def _copy(model):
    import copy

    return copy.deepcopy(model)


def test_offloaded_nodes_taking_turns_change_no_number(tmp_path, cache_dir, monkeypatch):
    """Threads, 2 devices x 2 nodes, merges and accumulation: with offload_idle_nodes and max_concurrent_nodes 1
    every CSV and the final weights are those of the same run without them; at most one node of a device computed
    at once, and the nodes' state came in from host memory."""
    import node as node_module
    from run import train
    from tests.test_resume_and_faults import assert_same_run, overrides

    base = ["node_execution=threads", "num_outer_steps=4"]
    plain, _ = train(load_config(ROOT / "config.yaml", overrides(cache_dir, tmp_path, "run_name=plain", *base)))
    busy: dict[int, int] = {}
    peak: dict[int, int] = {}
    lock = threading.Lock()
    loads = []
    real_steps, real_load = node_module.Node.steps, node_module.Node._load_in

    def steps(self, job, pauses=()):
        device = self.node_id // 2
        with lock:
            busy[device] = busy.get(device, 0) + 1
            peak[device] = max(peak.get(device, 0), busy[device])
        try:
            return (yield from real_steps(self, job, pauses))
        finally:
            with lock:
                busy[device] -= 1

    def load_in(self):
        loads.append(not self.offload.resident)
        return real_load(self)

    monkeypatch.setattr(node_module.Node, "steps", steps)
    monkeypatch.setattr(node_module.Node, "_load_in", load_in)
    turns, summary = train(load_config(ROOT / "config.yaml", overrides(
        cache_dir, tmp_path, "run_name=turns", *base, "offload_idle_nodes=true", "max_concurrent_nodes=1")))
    assert_same_run(plain, turns)
    assert peak == {0: 1, 1: 1}
    assert sum(loads) >= 4 * 4  # every node, every round, came in from host memory
    assert summary["memory_plan"]["devices"][0]["resident"]["node_weights"] == 0


@pytest.mark.parametrize("shape", [["sync_fragments=2", "sync_delay=1", "num_inner_steps=4"], ["distributed_algo=DDP",
                                   "sampling_method=constant", "num_init_trainers=1", "merge_frequency=0"]],
                         ids=["streaming", "ddp"])
def test_offloading_changes_no_number_in_paused_rounds(tiny_config, shape):
    """Streaming DiLoCo and DDP rounds pause every node mid-round; offloaded nodes give the same numbers."""
    from run import train

    runs = [train(tiny_config(f"run_name=r{i}", "node_execution=threads", *shape, *extra))[0]
            for i, extra in enumerate([[], ["offload_idle_nodes=true", "max_concurrent_nodes=1"]])]
    from tests.test_resume_and_faults import rows

    for name in ("training_log.csv", "step_loss_log.csv"):
        assert rows(runs[1], name) == rows(runs[0], name), name


def test_the_probe_finds_a_larger_batch_when_fewer_nodes_compute(tiny_config):
    """The probe of a simulated CPU device of 4 nodes: with max_concurrent_nodes 1 (threads) the computing node gets
    the device less the 3 idle nodes' state, more than a quarter of it; offloaded, the whole device."""
    from cluster.build import _probe
    from trainers import TRAINERS

    torch.manual_seed(0)
    model = _tiny_llama()
    cfg = tiny_config("nodes_per_gpu=4", "device_memory_mb=400", "max_requested_batch=4096", "seq_len=128",
                      "node_execution=threads")

    class Data:
        train = range(4096)

    def probed(*overrides):
        c = cfg.replace(**dict(overrides))
        return _probe(c, model, TRAINERS[c.distributed_algo].inner_optimizer_factory(c), "cpu", 0,
                      c.device_specs[0], Data)

    every = probed()
    one = probed(("max_concurrent_nodes", 1))
    alone = probed(("max_concurrent_nodes", 1), ("offload_idle_nodes", True))
    assert 0 < every < one < alone
    assert probed(("max_concurrent_nodes", 4)) == every  # all four compute: today's share


def test_a_plan_the_host_cannot_hold_is_named():
    """The 16-node reading offloaded needs its nodes' state, the rollback snapshot and a checkpoint's copy in host
    memory: a machine with less available is told so, in one line with each part."""
    from cluster.memory_plan import host_shortfall

    plan = plan_for_config(load_config(ROOT / "configs" / "paper_microllama_c4_16nodes.yaml"), capacity_gb=80)
    assert plan.fits and host_shortfall(plan, plan.host_bytes) == ""
    line = host_shortfall(plan, 64 * GiB)
    assert line.startswith("the host needs 127 GiB (offloaded_nodes 54.5, rollback_snapshot 36.3, checkpoint_copy "
                           "36.3 GiB), more than the 64 GiB available")


def test_the_system_benchmark_times_the_records_and_measures_against_the_memory_plan(cache_dir):
    """benchmarks.system's round split reads each step's record (RoundRecord.seconds, MergeRecord.seconds), patching
    nothing in the engine, and its expected memory is the run's own memory plan, part by part."""
    import distributed.node_round
    from benchmarks.system import bench_round
    from cluster.memory_plan import plan_for_config

    args = [*TINY, f"cache_dir={cache_dir}", "num_outer_steps=2", "merge_frequency=1", "cpu_threads=1"]
    statistics = distributed.node_round.trainer_statistics
    times, memory = bench_round(str(ROOT / "config.yaml"), args)
    assert distributed.node_round.trainer_statistics is statistics
    assert all(times[k] > 0 for k in ("round", "statistics", "outer", "eval", "merge"))  # 2 merges, the norm test
    assert times["statistics"] < times["round"] and times["round"] + times["outer"] + times["eval"] + times[
        "merge"] <= times["total"]
    plan = plan_for_config(load_config(ROOT / "config.yaml", args), micro_batch=4)
    assert memory["expected"] == plan.host_bytes + sum(d.planned_bytes for d in plan.devices)
    assert memory["parts"]["host: masters"] == 2 * memory["params"] * 4 and memory["measured"] > 0
