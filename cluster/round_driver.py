"""The round driver: one outer step for every trainer (its jobs from the round's plan, algorithms/round_schedule.py;
the round on the backend, faults, outer steps, evaluation, batch tests), then its merge. It decides and counts
nothing: it returns one record of what the step did (RoundRecord, its merge a MergeRecord in it), which the
controller hands to the ledgers (cluster/ledgers.py: the clock, the traffic, the best seen) and to the logger, each
in one call."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import Callable

import torch

from algorithms.clock import NodeWork
from algorithms.comm_plan import CommPlan
from algorithms.round_schedule import RoundSchedule
from algorithms.traffic import SyncCost
from cluster.state import STALE, ClusterState
from distributed.mid_round import MidRoundPlan, evaluation_steps
from distributed.protocol import Backend, NodeFault, RoundResult
from fabrics.eval_tool import EvalResult, Evaluator
from node import NodeJob, RoundAbandoned
from trainers import Trainer
from utils import collector
from utils.config import Config
from utils.errors import TrainingFault

log = logging.getLogger("cluster")


@dataclasses.dataclass
class RoundRecord:
    """What one outer step did, its merge included, as the ledgers count it and the logger writes it (filled as the
    step goes: a step that raises keeps what it did before, and the controller still logs that)."""
    outer_step: int
    comm: dict | None = None  # torchrun: what this rank's collectives cost (metrics.jsonl)
    faults: list[dict] = dataclasses.field(default_factory=list)  # fault_events.csv
    step_losses: list[dict] | None = None  # step_losses.csv (None: the step failed before its round ended)
    node_times: list[dict] | None = None  # node_clock.csv, from the ledgers (None: the step failed before them)
    inner_evals: list[dict] = dataclasses.field(default_factory=list)  # inner_eval.csv (eval_every_inner_steps)
    rows: list[dict] = dataclasses.field(default_factory=list)  # training_log.csv, one per trainer
    # what the ledgers read (cluster/ledgers.py): each trainer's nodes' work (tokens, shape, a state received first),
    # each node's inner steps and slowdown, what each trainer's collectives sent, how many nodes each trainer whose
    # round ended synced, and those trainers' evaluations
    work: dict[int, list[NodeWork]] = dataclasses.field(default_factory=dict)
    inner_steps: dict[int, int] = dataclasses.field(default_factory=dict)
    slowdown: dict[int, float] = dataclasses.field(default_factory=dict)
    costs: dict[int, SyncCost] = dataclasses.field(default_factory=dict)
    synced: dict[int, int] = dataclasses.field(default_factory=dict)
    scores: dict[int, float] = dataclasses.field(default_factory=dict)
    # wall seconds of its parts: the round (node work and transfers; "statistics" of it: the batch tests' sums),
    # the outer steps, the evaluations (benchmarks.system reads them)
    seconds: dict[str, float] = dataclasses.field(default_factory=dict)
    merge: MergeRecord | None = None  # the step's merge (None: it merged nothing, or the step failed before it)
    trainers_alive: int = 0  # after the step's merge
    counted: bool = False  # the ledgers counted the whole step: its rows carry the counters (cluster/ledgers.py)


@dataclasses.dataclass
class MergeRecord:
    """What a merge did: the absorbed states' payloads into the survivor, its evaluation, merge_events.csv's row
    (the ledgers add sim_time_s)."""
    survivor: int
    members: list[int]  # the survivor first
    payloads: list[int]  # each absorbed state's bytes, one message each
    metric_after: float
    event: dict
    seconds: dict[str, float] = dataclasses.field(default_factory=dict)  # wall: the merge, its evaluation


@dataclasses.dataclass
class Policies:
    """The paper's decisions after a round, picked by config strings from the registries in algorithms/ (switch mode,
    decided before a round, is the round schedule's)."""
    batch_test: Callable
    merge_policy: object


class RoundDriver:
    def __init__(self, cfg: Config, state: ClusterState, backend: Backend, schedule: RoundSchedule,
                 evaluator: Evaluator, policies: Policies, plan: CommPlan) -> None:
        self.cfg, self.nodes, self.state, self.backend, self.schedule = cfg, state.nodes, state, backend, schedule
        self.evaluator, self.policies, self.plan, self.sizes = evaluator, policies, plan, plan.sizes
        self.merge_sync, self.streaming = plan.merge_sync, plan.streams
        self.grad_chunks = plan.grad_chunks
        # what a trainer's round sends and costs, without and with its nodes' statistics: the plan's, every round
        self.sync_costs = {sent: plan.sync_cost(sent) for sent in (False, True)}
        # what a trainer's state weighs when it moves to a node (weights and outer state), and encoded for a merge:
        # the same for every trainer (one model, one algorithm) and every round, so, as the sync costs, known once
        self.state_bytes = next(iter(state.trainers.values())).transfer_bytes()
        self.merge_payload_bytes = self.merge_sync.payload_bytes(self.state_bytes // 4)
        self.tokens_per_sequence = state.nodes[0].data.tokens_per_sequence  # every node reads the same corpus
        self.injected = cfg.injected_faults()
        # the memory monitor's (training_logs/memory_monitor.py): its sampling during a round, a reading at a stage
        self.round_window: Callable[[int], contextlib.AbstractContextManager] = lambda step: contextlib.nullcontext()
        self.reading: Callable[[str, int], object] = lambda stage, step: None
        self.record = RoundRecord(0)  # the last step's

    @property
    def trainers(self) -> dict[int, Trainer]:
        return self.state.trainers

    def evaluate(self, trainer_ids) -> dict[int, EvalResult]:
        holders = {t: (node, self.trainers[t].master) for t, node in self.state.holders(trainer_ids).items()}
        return self.backend.evaluate(holders, self.evaluator)

    # -------------------------------------------------------------------------------------------
    def jobs(self, outer_step: int) -> tuple[list[NodeJob], list[tuple[int, int, int]]]:
        """This round's node jobs, by the round's plan (algorithms/round_schedule.py), and the moves (trainer, from
        node, to node) that must come first. Nodes away this round get no job; one that comes back joins as a new node
        would."""
        state = self.state
        plan = self.schedule.plan(outer_step, {t: tr.requested_batch for t, tr in self.trainers.items()}, state.owner,
                                  [n.max_batch for n in self.nodes])
        away = sorted(set(state.owner) - set(plan.present))
        for node_id in away:
            state.owner[node_id] = None  # its inner optimizer state is stale when it comes back
            state.continues[node_id] = None
        for change in plan.changes:
            log.info("outer step %d: %s", outer_step, change)
        jobs, moves = [], []
        self.record.slowdown = plan.slowdown
        sources = state.holders(plan.assignment)  # before this round changes holds
        for node_id in away:  # it may hand its state on now; its copy goes stale as its trainer trains on
            state.holds[node_id] = STALE
        for t in sorted(plan.assignment):
            trainer = self.trainers[t]
            version = (t, trainer.weights_version)
            # DDP / SNOO: the nodes step one AdamW in lockstep; when one of them starts afresh, they all do
            restart = trainer.syncs_gradients and any(state.owner[n] != t for n in plan.assignment[t])
            for node_id in plan.assignment[t]:
                moved = state.holds[node_id] not in (None, version)
                if moved:  # the node receives this trainer's state
                    moves.append((t, sources[t], node_id))
                state.holds[node_id] = version
                loader_batch, accumulation = plan.shapes[node_id]
                steps = plan.inner_steps[node_id]
                indices = trainer.sampler.take(steps * accumulation * loader_batch).view(steps, accumulation,
                                                                                         loader_batch)
                jobs.append(NodeJob(node_id, t, trainer.master, indices, self.grad_chunks,
                                    reset_optimizer=restart or state.owner[node_id] != t,
                                    inject_fault=self.injected.get((outer_step, node_id), ""),
                                    keep_local=self.streaming and state.continues[node_id] == version,
                                    sync_gradients=trainer.syncs_gradients))
                tokens = float(self.tokens_per_sequence[indices.reshape(-1)].sum())
                self.record.work.setdefault(t, []).append(
                    NodeWork(node_id, tokens, loader_batch, accumulation, self.state_bytes if moved else 0))
                self.record.inner_steps[node_id] = steps
        for t, node_ids in plan.assignment.items():
            for node_id in node_ids:
                state.owner[node_id] = t
        return jobs, moves

    def _handle_faults(self, outer_step: int, faults: list[NodeFault], before: dict, any_result: bool) -> None:
        """on_node_fault: stop -> back to the last good state and raise; skip -> log, reset the failed nodes."""
        action = self.cfg.on_node_fault if any_result else "stop"
        self.record.faults = [{"outer_step": outer_step, "trainer_id": f.trainer_id, "node_id": f.node_id,
                               "kind": f.kind, "action": action, "message": f.message} for f in faults]
        first = faults[0]
        where = f"outer step {outer_step}, trainer {first.trainer_id}, node {first.node_id}: {first.message}"
        more = f" (and {len(faults) - 1} more node faults)" if len(faults) > 1 else ""
        if action == "stop":
            self.state.restore(before)
            reason = "" if any_result or self.cfg.on_node_fault == "stop" else "every node failed; "
            raise TrainingFault(f"node fault at {where}{more}; {reason}stopped (on_node_fault: stop)")
        for f in faults:  # the node's inner state is whatever the failure left: back to the round's start
            self.nodes[f.node_id].load_optimizer_state(before["optimizers"][f.node_id])
        log.warning("node fault at %s%s; its contribution is dropped (on_node_fault: skip)", where, more)

    def _inner_evals(self, outer_step: int, jobs: list, results: dict) -> list[dict]:
        """inner_eval.csv's rows: each trainer's synced model at each mid-round evaluation, with the tokens every
        node had seen by that inner step (all trainers, from the start of the run; a node that failed still counts
        what it was given)."""
        rows = []
        for t, res in sorted(results.items()):
            for inner_step, nodes, metrics in res.mid_round:
                seen = sum(float(self.tokens_per_sequence[j.sample_indices[:inner_step].reshape(-1)].sum())
                           for j in jobs)
                rows.append({"outer_step": outer_step, "trainer_id": t, "nodes": " ".join(map(str, nodes)),
                             "inner_step": inner_step, "global_tokens": self.state.tokens_total + int(seen),
                             **metrics})
        return rows

    def _synced_metrics(self, trainer_id: int, node_mean: dict[str, torch.Tensor]) -> dict[str, float]:
        """A mid-round evaluation (distributed/mid_round.py): the trainer's outer step on its nodes' mean, applied
        to a copy, evaluated."""
        return self.evaluator.evaluate(self.trainers[trainer_id].synced_model(node_mean)).metrics

    def run(self, outer_step: int) -> RoundRecord:
        """One outer step: the round, its merge (by the policy), the memory readings after each; its record."""
        record = self.round(outer_step)
        self.reading("after_outer_step", outer_step)
        record.merge = self.merge(outer_step, {r["trainer_id"]: r[self.evaluator.metric] for r in record.rows})
        if record.merge is not None:
            self.reading("after_merge", outer_step)
        record.trainers_alive = len(self.trainers)
        return record

    def round(self, outer_step: int) -> RoundRecord:
        """One round for every trainer, outer steps, evaluation, batch tests: the step's record, its merge to come."""
        self.record = record = RoundRecord(outer_step)
        before = self.state.snapshot()
        jobs, moves = self.jobs(outer_step)
        # (loader_batch, accumulation_steps) each node ran, read off its job's index tensor
        plan = {j.node_id: (j.sample_indices.shape[2], j.sample_indices.shape[1]) for j in jobs}
        every = self.cfg.eval_every_inner_steps
        mid_round = MidRoundPlan(evaluation_steps(every, jobs), self._synced_metrics) if every else None
        start = time.perf_counter()
        try:
            with self.round_window(outer_step), collector.paused():  # no collector pause amid the node work
                outcome = self.backend.run_round(jobs, self.trainers, mid_round, moves)
        except RoundAbandoned:
            self.state.restore(before)
            raise
        results, faults, record.comm = outcome.results, outcome.faults, outcome.comm
        record.seconds["round"] = time.perf_counter() - start
        record.seconds["statistics"] = sum(res.statistics_seconds for res in results.values())
        if faults:
            self._handle_faults(outer_step, faults, before, any_result=bool(results))
        record.step_losses = [
            {"outer_step": outer_step, "trainer_id": t, "node_id": node, "inner_step": i, "loss": f"{loss:.6g}",
             "micro_batch": plan[node][0], "accumulation_steps": plan[node][1], "learning_rate": res.learning_rate}
            for t, res in sorted(results.items()) for node, losses in sorted(res.node_step_losses.items())
            for i, loss in enumerate(losses)]
        record.inner_evals = self._inner_evals(outer_step, jobs, results)
        self.state.tokens_total += sum(res.tokens for res in results.values())
        start = time.perf_counter()
        self._outer_steps(outer_step, results)
        record.seconds["outer"] = time.perf_counter() - start
        trainer_ids = sorted({j.trainer_id for j in jobs})
        # what each trainer's collectives sent and cost, once: the clock and the traffic counters read the same
        record.costs = {t: self.sync_costs[t in results and results[t].statistics is not None] for t in trainer_ids}
        record.synced = {t: len(res.nodes) for t, res in results.items()}
        if self.streaming:  # the good nodes' own weights go on next round, if their trainer stays the same
            for f in faults:
                self.state.continues[f.node_id] = None
            for t, res in results.items():
                for node_id in res.nodes:
                    self.state.continues[node_id] = (t, self.trainers[t].weights_version)
        start = time.perf_counter()
        evaluations = self.evaluate(trainer_ids)
        record.seconds["eval"] = time.perf_counter() - start
        for t in trainer_ids:
            if t not in results:  # every node of this trainer failed: it keeps its weights this round
                node_ids = [j.node_id for j in jobs if j.trainer_id == t]
                record.rows.append(self._failed_row(outer_step, t, plan[node_ids[0]], evaluations[t]))
            else:
                record.scores[t] = evaluations[t].value
                record.rows.append(self._row(outer_step, t, results[t], plan, evaluations[t]))
        return record

    def _outer_steps(self, outer_step: int, results: dict[int, RoundResult]) -> None:
        """Each trainer's outer step on its nodes' mean; a failed one anywhere stops every process."""
        failed = {}
        for t, res in sorted(results.items()):
            if res.outer_error:  # streaming: a fragment's outer step, during the round
                failed[t] = FloatingPointError(res.outer_error)
            if res.node_mean is None:  # torchrun: this process is not one of t's nodes (it gets t when it joins);
                continue  # streaming: the fragments stepped during the round
            try:
                self.trainers[t].outer_step(res.node_mean)
            except FloatingPointError as exc:
                failed[t] = exc
        if self.backend.agree(bool(failed)):  # earlier trainers already stepped: this state is not checkpointed
            detail = f"trainer {min(failed)}: {failed[min(failed)]}" if failed else "in another process"
            fault = TrainingFault(f"fault at outer step {outer_step}, {detail}")
            fault.state_is_good = False
            raise fault

    def _failed_row(self, outer_step: int, t: int, shape: tuple[int, int], evaluation: EvalResult) -> dict:
        trainer = self.trainers[t]
        return {"outer_step": outer_step, "trainer_id": t, "nodes": "", "num_nodes": 0,
                "requested_batch": trainer.requested_batch, "loader_batch": shape[0], "accumulation_steps": shape[1],
                "optimizer_steps": trainer.stats.optimizer_steps, "tokens_seen": trainer.stats.tokens_seen,
                "global_tokens": self.state.tokens_total, "train_loss": math.nan, **evaluation.metrics,
                "next_requested_batch": trainer.requested_batch}

    def _row(self, outer_step: int, t: int, res: RoundResult, plan: dict, evaluation: EvalResult) -> dict:
        """The batch test's decision and the trainer's row."""
        trainer, state = self.trainers[t], self.state
        requested_before = trainer.requested_batch
        decision = self.policies.batch_test(res.statistics, trainer.requested_batch, len(res.nodes),
                                            tokens_seen=state.tokens_total)
        trainer.requested_batch = decision.requested_batch
        s = trainer.stats
        s.sync_number += 1
        s.optimizer_steps += res.optimizer_steps
        s.tokens_seen += res.tokens
        loader_batch, accumulation = plan[res.nodes[0]]
        return {"outer_step": outer_step, "trainer_id": t, "nodes": " ".join(map(str, res.nodes)),
                "num_nodes": len(res.nodes), "requested_batch": requested_before, "loader_batch": loader_batch,
                "accumulation_steps": accumulation, "optimizer_steps": s.optimizer_steps,
                "tokens_seen": s.tokens_seen, "global_tokens": state.tokens_total, "train_loss": res.train_loss,
                **evaluation.metrics, "next_requested_batch": decision.requested_batch, **decision.stats}

    # -------------------------------------------------------------------------------------------
    def merge(self, outer_step: int, metrics: dict[int, float]) -> MergeRecord | None:
        """Merge by the policy, then evaluate the result; metrics: each trainer's metric before the merge."""
        policy, state = self.policies.merge_policy, self.state
        start = time.perf_counter()
        requested = {t: tr.requested_batch for t, tr in self.trainers.items()}
        plan = policy.decide(outer_step, self.cfg.merge_frequency, requested)
        if plan is None:
            return None
        survivor = self.trainers[plan.survivor]
        others = [self.trainers[m] for m in plan.members[1:]]
        holders = state.holders(plan.members)  # where each member's state is, asked once
        # the absorbed states travel to the survivor's first node, which computes the average
        coordinator = min((n for n, t in state.owner.items() if t == plan.survivor), default=holders[plan.survivor])
        payloads = [self.merge_payload_bytes] * len(others)
        self.backend.transfer([(m, holders[m], coordinator) for m in plan.members[1:]], self.trainers,
                              compression=self.merge_sync)
        survivor.absorb(others, list(plan.weights))  # under torchrun, only the coordinator's result is used
        for other in others:
            del self.trainers[other.trainer_id]
            survivor.stats.tokens_seen += other.stats.tokens_seen
            survivor.stats.optimizer_steps += other.stats.optimizer_steps
        state.holds[coordinator] = (plan.survivor, survivor.weights_version)  # the others receive it when they start
        merged = time.perf_counter()
        after = self.evaluate([plan.survivor])[plan.survivor].value  # does averaging hurt? measured, not assumed
        seconds = {"merge": merged - start, "eval": time.perf_counter() - merged}
        event = {"outer_step": outer_step, "survivor": plan.survivor, "merged": " ".join(map(str, plan.members[1:])),
                 "weights": " ".join(f"{w:.4f}" for w in plan.weights),
                 "requested_batches": " ".join(str(requested[m]) for m in plan.members), "bytes": sum(payloads),
                 "payloads": " ".join(map(str, payloads)), "metric": self.evaluator.metric,
                 "metric_before": " ".join(f"{metrics[m]:.6g}" for m in plan.members),
                 "metric_weighted_before": sum(w * metrics[m] for m, w in zip(plan.members, plan.weights)),
                 "metric_after": after}
        return MergeRecord(plan.survivor, list(plan.members), payloads, after, event, seconds)
