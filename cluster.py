"""The simulated cluster: devices hosting nodes, node assignment, rounds, merges and the outer loop.

The seam for a real multi-process backend is `RoundBackend.run_round(jobs) -> {trainer: RoundResult}`:
it executes one round of node jobs and combines their results (the mean of the node weights, in
fp32, summed in node-id order so the result never depends on thread timing). A torch.distributed
backend would implement the same method with an all-reduce; algorithms/ and trainers.py stay as they are.
"""

from __future__ import annotations

import logging
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from algorithms.assignment import assign_nodes, node_counts
from algorithms.calc_batch import GradientSamples, build_batch_test
from algorithms.policies import build_merge_policy
from algorithms.switch_mode import build_switch_mode
from algorithms.traffic import Traffic
from fabrics.dataset_loader import CorpusData, ShardSampler
from fabrics.eval_tool import Evaluator
from fabrics.models import float_state, replicate
from trainers import TRAINERS, Node, NodeJob, NodeResult, Trainer
from training_logs.training_monitoring import TrainingLogger
from utils.checkpoint import save_checkpoint
from utils.config import Config
from utils.max_batch_calculator import find_max_batch_size

log = logging.getLogger(__name__)


@dataclass
class RoundResult:
    """One trainer's combined round: mean node weights plus what the batch test and the logs need."""

    node_mean: dict[str, torch.Tensor]
    nodes: list[int]
    train_loss: float
    tokens: int
    optimizer_steps: int
    node_samples: dict[int, tuple[torch.Tensor, torch.Tensor]]  # node id -> (gradient samples, their batch sizes)
    node_step_losses: dict[int, list[float]]  # node id -> loss of each inner step
    learning_rate: float


def combine(results: list[NodeResult]) -> dict[int, RoundResult]:
    by_trainer: dict[int, list[NodeResult]] = {}
    for r in sorted(results, key=lambda r: r.node_id):
        by_trainer.setdefault(r.trainer_id, []).append(r)
    combined = {}
    for trainer_id, group in by_trainer.items():
        mean = {}
        for name in group[0].state:
            acc = torch.zeros(group[0].state[name].shape, dtype=torch.float32)
            for r in group:
                acc += r.state[name].detach().to("cpu", torch.float32)
            mean[name] = acc / len(group)
        combined[trainer_id] = RoundResult(
            node_mean=mean, nodes=[r.node_id for r in group],
            train_loss=sum(sum(r.step_losses) / len(r.step_losses) for r in group) / len(group),
            tokens=sum(r.tokens for r in group), optimizer_steps=sum(len(r.step_losses) for r in group),
            node_samples={r.node_id: (r.grad_samples, r.sample_batches) for r in group
                          if r.grad_samples is not None},
            node_step_losses={r.node_id: r.step_losses for r in group},
            learning_rate=group[0].learning_rate)
    return combined


class RoundBackend:
    """Runs the jobs of one round on their nodes and combines the results per trainer."""

    def __init__(self, nodes: list[Node], concurrent: bool) -> None:
        self.nodes = nodes
        self.pool = ThreadPoolExecutor(max_workers=len(nodes), thread_name_prefix="node") if concurrent else None

    def run_round(self, jobs: list[NodeJob]) -> dict[int, RoundResult]:
        if self.pool is None:
            results = [self.nodes[j.node_id].run(j) for j in jobs]
        else:
            results = [f.result() for f in [self.pool.submit(self.nodes[j.node_id].run, j) for j in jobs]]
        return combine(results)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()


def use_threads(cfg: Config) -> bool:
    if cfg.node_execution != "auto":
        return cfg.node_execution == "threads"
    # Threads pay off when nodes sit on distinct accelerators; on CPU cores they only contend.
    cuda = [d for d in cfg.devices if d.startswith("cuda")]
    return len(set(cuda)) > 1 and len(cuda) == len(cfg.devices)


class ClusterController:
    def __init__(self, cfg: Config, model: torch.nn.Module, data: CorpusData, logger: TrainingLogger,
                 weights_dir: Path) -> None:
        self.cfg, self.data, self.logger, self.weights_dir = cfg, data, logger, weights_dir
        algo = TRAINERS[cfg.distributed_algo]
        make_optimizer = algo.inner_optimizer_factory(cfg)
        self.switch_mode = build_switch_mode(cfg.switch_mode)
        self.merge_policy = build_merge_policy(cfg.merging_policy)
        self.batch_test = build_batch_test(cfg.sampling_method, eta=cfg.ETA, vartheta=cfg.vartheta, nu=cfg.nu,
                                           max_batch=cfg.max_requested_batch, start=cfg.initial_batch_size,
                                           rampup_tokens=cfg.rampup_tokens or cfg.max_tokens)
        # micro_batches: each node's chunks form their own group, so drift between nodes is not noise
        self.pool_within_nodes = cfg.variance_estimator == "micro_batches"
        self.nodes: list[Node] = []
        for device in cfg.devices:
            if cfg.max_batch_size:
                max_batch = cfg.max_batch_size
            else:
                max_batch = find_max_batch_size(model, make_optimizer, device, cfg.seq_len,
                                                padding_percentage=cfg.padding_percentage,
                                                nodes_per_gpu=cfg.nodes_per_gpu,
                                                device_memory_mb=cfg.device_memory_mb,
                                                upper=min(cfg.max_requested_batch, len(data.train)))
            for _ in range(cfg.nodes_per_gpu):
                node = Node(len(self.nodes), device, replicate(model, device), make_optimizer, cfg.grad_clip,
                            data.train)
                node.max_batch = max_batch
                node.show_progress = cfg.inner_progress
                self.nodes.append(node)
        log.info("nodes: %s", ", ".join(f"{n.node_id}@{n.device} (max batch {n.max_batch})" for n in self.nodes))
        initial = float_state(model)
        parameter_names = {n for n, _ in model.named_parameters()}
        self.trainers: dict[int, Trainer] = {
            t: algo(t, initial, parameter_names, cfg, ShardSampler(len(data.train), cfg.training_seed * 1000 + t))
            for t in range(cfg.num_init_trainers)}
        self.owner: dict[int, int | None] = {n.node_id: None for n in self.nodes}
        # (trainer, weights version) each node holds; None = the common initial weights
        self.holds: dict[int, tuple[int, int] | None] = {n.node_id: None for n in self.nodes}
        self.evaluator = Evaluator(replicate(model, cfg.devices[0]), data.val, cfg.eval_batch_size, cfg.devices[0])
        self.backend = RoundBackend(self.nodes, use_threads(cfg))
        self.param_bytes = sum(v.numel() * 4 for v in initial.values())  # fp32 weights / pseudo-gradients
        self.traffic = Traffic()  # rounds, syncs and bytes as a real cluster would send them
        self.tokens_total = 0
        self.last_outer_step = 0
        self.best_seen: float | None = None  # best metric of any model evaluated during the run

    def _seen(self, value: float) -> None:
        better = self.best_seen is None or (value > self.best_seen) == self.evaluator.higher_is_better
        if math.isfinite(value) and better:
            self.best_seen = value

    def _gradient_samples(self, res: RoundResult) -> GradientSamples | None:
        if not res.node_samples:
            return None
        grads, sizes, groups = [], [], []
        for node_id, (g, b) in sorted(res.node_samples.items()):
            grads.append(g)
            sizes.append(b)
            groups += [node_id if self.pool_within_nodes else 0] * len(b)
        return GradientSamples(torch.cat(grads), torch.cat(sizes), torch.tensor(groups))

    # -------------------------------------------------------------------------------------------
    def _jobs(self) -> list[NodeJob]:
        cfg = self.cfg
        requested = {t: tr.requested_batch for t, tr in self.trainers.items()}
        assignment = assign_nodes(node_counts(requested, len(self.nodes)), self.owner)
        jobs = []
        for t in sorted(assignment):
            trainer = self.trainers[t]
            version = (t, trainer.weights_version)
            for node_id in assignment[t]:
                if self.holds[node_id] not in (None, version):
                    self.traffic.node_move(trainer.transfer_bytes())  # the node receives this trainer's state
                self.holds[node_id] = version
                node = self.nodes[node_id]
                loader_batch, accumulation = self.switch_mode.decide(trainer.requested_batch, node.max_batch)
                n = cfg.num_inner_steps * accumulation * loader_batch
                indices = trainer.sampler.take(n).view(cfg.num_inner_steps, accumulation, loader_batch)
                chunks = cfg.variance_micro_batches if cfg.variance_estimator == "micro_batches" else 1
                jobs.append(NodeJob(node_id, t, trainer.master, indices, chunks,
                                    reset_optimizer=self.owner[node_id] != t))
        for t, node_ids in assignment.items():
            for node_id in node_ids:
                self.owner[node_id] = t
        return jobs

    def run_outer_step(self, outer_step: int) -> list[dict]:
        """One round for every trainer, outer steps, evaluation, batch tests; returns the metric rows."""
        jobs = self._jobs()
        # (loader_batch, accumulation_steps) each node ran, read off its job's index tensor
        plan = {j.node_id: (j.sample_indices.shape[2], j.sample_indices.shape[1]) for j in jobs}
        self.logger.memory.begin_round(outer_step)
        results = self.backend.run_round(jobs)
        self.logger.memory.end_round(outer_step)
        self.logger.log_step_losses([
            {"outer_step": outer_step, "trainer_id": t, "node_id": node, "inner_step": i, "loss": f"{loss:.6g}",
             "micro_batch": plan[node][0], "accumulation_steps": plan[node][1], "learning_rate": res.learning_rate}
            for t, res in sorted(results.items()) for node, losses in sorted(res.node_step_losses.items())
            for i, loss in enumerate(losses)])
        self.traffic.rounds += 1
        self.tokens_total += sum(res.tokens for res in results.values())
        rows = []
        for t in sorted(results):
            trainer, res = self.trainers[t], results[t]
            requested_before = trainer.requested_batch
            trainer.outer_step(res.node_mean)
            self.traffic.trainer_sync(len(res.nodes), self.param_bytes)
            evaluation = self.evaluator.evaluate(trainer.master)
            self._seen(evaluation.value)
            decision = self.batch_test(self._gradient_samples(res), trainer.requested_batch, len(res.nodes),
                                       tokens_seen=self.tokens_total)
            trainer.requested_batch = decision.requested_batch
            s = trainer.stats
            s.sync_number += 1
            s.optimizer_steps += res.optimizer_steps
            s.tokens_seen += res.tokens
            loader_batch, accumulation = plan[res.nodes[0]]
            rows.append({
                "outer_step": outer_step, "trainer_id": t, "nodes": " ".join(map(str, res.nodes)),
                "num_nodes": len(res.nodes), "requested_batch": requested_before, "loader_batch": loader_batch,
                "accumulation_steps": accumulation, "optimizer_steps": s.optimizer_steps,
                "tokens_seen": s.tokens_seen, "global_tokens": self.tokens_total, "train_loss": res.train_loss,
                **evaluation.metrics,
                "next_requested_batch": decision.requested_batch, **decision.stats})
        return rows

    def merge(self, outer_step: int, metrics: dict[int, float]) -> dict | None:
        """Merge by the policy, then evaluate the result; metrics: each trainer's metric before the merge."""
        if not self.merge_policy.should_merge(outer_step, self.cfg.merge_frequency, len(self.trainers)):
            return None
        requested = {t: tr.requested_batch for t, tr in self.trainers.items()}
        plan = self.merge_policy.plan(requested)
        survivor = self.trainers[plan.survivor]
        others = [self.trainers[m] for m in plan.members[1:]]
        moved = sum(o.transfer_bytes() for o in others)  # the absorbed states travel to the survivor's first node
        survivor.absorb(others, list(plan.weights))
        for other in others:
            del self.trainers[other.trainer_id]
            survivor.stats.tokens_seen += other.stats.tokens_seen
            survivor.stats.optimizer_steps += other.stats.optimizer_steps
        self.traffic.merge(moved)
        coordinator = min((n for n, t in self.owner.items() if t == plan.survivor), default=None)
        if coordinator is not None:  # it computed the average, so it holds the merged weights
            self.holds[coordinator] = (plan.survivor, survivor.weights_version)
        after = self.evaluator.evaluate(survivor.master).value  # does averaging hurt? measured, not assumed
        self._seen(after)
        return {"outer_step": outer_step, "survivor": plan.survivor,
                "merged": " ".join(map(str, plan.members[1:])),
                "weights": " ".join(f"{w:.4f}" for w in plan.weights),
                "requested_batches": " ".join(str(requested[m]) for m in plan.members), "bytes": moved,
                "metric": self.evaluator.metric,
                "metric_before": " ".join(f"{metrics[m]:.6g}" for m in plan.members),
                "metric_weighted_before": sum(w * metrics[m] for m, w in zip(plan.members, plan.weights)),
                "metric_after": after}

    # -------------------------------------------------------------------------------------------
    def train(self) -> dict:
        cfg = self.cfg
        start = time.time()
        initial = self.evaluator.evaluate(next(iter(self.trainers.values())).master)
        log.info("outer step 0: %s %.4g (all trainers start from the same weights)", initial.name, initial.value)
        self.logger.log_initial(initial.metrics, list(self.trainers))
        bar = tqdm(range(1, cfg.num_outer_steps + 1), desc="outer steps", unit="step", dynamic_ncols=True)
        for outer_step in bar:
            rows = self.run_outer_step(outer_step)
            self.logger.memory.record("after_outer_step", outer_step)
            merge_event = self.merge(outer_step, {r["trainer_id"]: r[self.evaluator.metric] for r in rows})
            if merge_event:
                self.logger.memory.record("after_merge", outer_step)
            wall = time.time() - start
            for row in rows:  # counters at the end of the outer step, its merge included
                row.update(self.traffic.row(), wall_time=wall)
            self.logger.log_step(rows, merge_event, trainers_alive=len(self.trainers))
            log.info(self._step_line(outer_step, rows, merge_event))
            best = self.best_seen if self.best_seen is not None else math.nan
            bar.set_postfix(trainers=len(rows), **{self.evaluator.metric[4:]: f"{best:.4g}"},
                            batch=max(r["next_requested_batch"] for r in rows))
            if cfg.save_weights_every and outer_step % cfg.save_weights_every == 0 and outer_step < cfg.num_outer_steps:
                save_checkpoint(self.weights_dir, f"outer_step_{outer_step:04d}", self.trainers)
            if outer_step % cfg.plot_every == 0:
                self.logger.plot(outer_step)
            self.last_outer_step = outer_step
            if cfg.max_tokens and self.tokens_total >= cfg.max_tokens:
                log.info("token budget reached: %d >= max_tokens %d", self.tokens_total, cfg.max_tokens)
                break
        bar.close()
        self.backend.close()
        return self._finish(initial.value, time.time() - start)

    def _step_line(self, outer_step: int, rows: list[dict], merge_event: dict | None) -> str:
        metric = self.evaluator.metric
        parts = [f"[outer {outer_step}/{self.cfg.num_outer_steps}] trainers {len(rows)}"]
        for r in rows:
            parts.append(f"T{r['trainer_id']} nodes [{r['nodes']}] req {r['requested_batch']} "
                         f"loader {r['loader_batch']}x{r['accumulation_steps']} loss {r['train_loss']:.3f} "
                         f"{metric[4:]} {r[metric]:.4g} -> req {r['next_requested_batch']}")
        if merge_event:
            parts.append(f"merged T{merge_event['merged']} into T{merge_event['survivor']} "
                         f"(weights {merge_event['weights']}; {metric[4:]} "
                         f"{' '.join(f'{float(v):.4g}' for v in merge_event['metric_before'].split())} -> "
                         f"{merge_event['metric_after']:.4g})")
        return " | ".join(parts)

    def _finish(self, initial_metric: float, wall: float) -> dict:
        scores = {t: self.evaluator.evaluate(tr.master).value for t, tr in self.trainers.items()}
        sign = -1 if self.evaluator.higher_is_better else 1
        final_id = min(scores, key=lambda t: (sign * scores[t], t))
        final = self.trainers[final_id]
        save_checkpoint(self.weights_dir, "final", self.trainers, self.evaluator.model, self.data.tokenizer, final_id)
        self.logger.plot(self.last_outer_step)
        summary = {
            "metric": self.evaluator.metric, "initial_metric": initial_metric, "final_trainer": final_id,
            "final_metric": scores[final_id], "surviving_trainers": scores,
            "outer_steps": self.last_outer_step, "wall_time_s": wall,
            "best_metric_seen": self.best_seen, "tokens_seen": self.tokens_total, **self.traffic.row(),
            "final_requested_batch": final.requested_batch,
            "max_batch_per_node": {n.node_id: n.max_batch for n in self.nodes},
            "accumulation_used": self.logger.accumulation_used, "merges": self.logger.merges,
            "batch_increases": self.logger.batch_increases,
        }
        if not math.isfinite(scores[final_id]):
            log.warning("final %s is not finite", self.evaluator.metric)
        return summary
