"""The outer loop over the simulated cluster: devices hosting nodes.

The controller takes every decision; a backend executes what crosses nodes (distributed/protocol.py:
`InProcessBackend` runs every node in this process, `TorchrunBackend` one node per torchrun process).
build.py makes every part from the config (`build_cluster`, the one composition root); state.py holds the
cluster's state (owners, holds, counters, traffic, the rollback snapshot), round_driver.py runs an outer step with
its merge and returns its record, ledgers.py counts what the record says (the simulated clock, the traffic, the best
seen) and the logger writes it: a step is those three calls (`run_outer_step`). `ClusterController` takes the parts,
loads a resume; `train` is the loop.
"""

from __future__ import annotations

import logging
import math
import signal
import time
from pathlib import Path

import torch
from tqdm import tqdm

from cluster.build import ClusterParts, build_cluster
from cluster.round_driver import RoundRecord
from fabrics.dataset_loader import CorpusData
from node import RoundAbandoned
from training_logs.training_monitoring import TrainingLogger
from utils import collector
from utils.checkpoint import Checkpoint, FinalModel, prune_checkpoints, save_checkpoint
from utils.config import Config
from utils.errors import RunStopped, TrainingFault, UserError
from utils.signals import StopSignals

log = logging.getLogger(__name__)


class ClusterController:
    """The simulated cluster and the outer loop.

    resume: a verified checkpoint to continue from (node max batches, trainers, counters, RNGs come from
    it; the memory probe does not run again, so every later decision is the same as in the first run).
    stop: the SIGINT/SIGTERM request the loop turns into a checkpoint and a clean exit.
    """

    def __init__(self, cfg: Config, parts: ClusterParts, data: CorpusData, logger: TrainingLogger,
                 weights_dir: Path, resume: Checkpoint | None = None, stop: StopSignals | None = None,
                 dist_env=None) -> None:
        self.cfg, self.data, self.logger, self.weights_dir = cfg, data, logger, weights_dir
        self.dist_env = dist_env  # torchrun: this process runs node dist_env.rank only
        self.writes = dist_env is None or dist_env.is_main  # only rank 0 writes checkpoints
        self.stop = stop or StopSignals()
        self.nodes, self.trainers, self.evaluator = parts.nodes, parts.trainers, parts.evaluator
        self.sketch, self.plan, self.state = parts.sketch, parts.plan, parts.state
        self.backend, self.ledgers, self.driver = parts.backend, parts.ledgers, parts.driver
        self.streaming, self.sizes = self.plan.streaming, self.plan.sizes
        self.memory_plan = parts.memory_plan
        self.compiled = parts.compiled  # compile: the buckets and the warm-up (cluster/build.py: warm_up_compiled)
        # the memory monitor samples while the nodes work, and reads after the outer steps and after a merge
        self.driver.round_window, self.driver.reading = logger.memory.round, logger.memory.record
        self._start = time.time()  # reset when training starts
        if resume is not None:
            for t, trainer in self.trainers.items():
                try:
                    trainer.load_state_dict(resume.trainer_state(t), resume.trainer_weights(t))
                except (ValueError, KeyError, RuntimeError) as exc:
                    raise UserError(f"--resume: {resume.path} does not fit this model ({exc})") from None
            self.load_state_dict(parts.resume_state)
            self.state.checkpointed_step = resume.outer_step

    @classmethod
    def build(cls, cfg: Config, model: torch.nn.Module, data: CorpusData, logger: TrainingLogger, weights_dir: Path,
              resume: Checkpoint | None = None, stop: StopSignals | None = None, dist_env=None) -> ClusterController:
        """The cluster built from the config (cluster/build.py: build_cluster), then resumed if asked."""
        stop = stop or StopSignals()
        parts = build_cluster(cfg, model, data, stop.event, resume, dist_env)
        return cls(cfg, parts, data, logger, weights_dir, resume, stop, dist_env)

    @property
    def tokens_total(self) -> int:
        return self.state.tokens_total

    # -------------------------------------------------------------------------------------------
    # Checkpoints: the trainers, and this state

    def state_dict(self) -> dict:
        """Everything a checkpoint holds besides the trainers (under torchrun: a collective, every rank calls it)."""
        distributed = self.dist_env is not None  # each process holds its own node's inner optimizer
        state = self.state.state_dict(self.backend.gather_optimizer_states if distributed else None,
                                      self.dist_env.rank if distributed else None)
        return {**state, "logger": self.logger.counters(),
                "sketch": self.sketch.state_dict() if self.sketch is not None else None,
                "clock": self.ledgers.state_dict(), "wall_time": self.state.wall_before + time.time() - self._start}

    def load_state_dict(self, state: dict) -> None:
        if len(state["nodes"]) != len(self.nodes):
            raise UserError(f"--resume: the checkpoint has {len(state['nodes'])} nodes, the config {len(self.nodes)}")
        self.state.load_state_dict(state)
        self.logger.load_counters(state["logger"])
        self.ledgers.load_state_dict(state.get("clock"))

    def save(self, label: str | None = None, final_id: int | None = None) -> Path:
        """A checkpoint of the state after outer step last_outer_step."""
        step = self.state.last_outer_step
        label = label or f"outer_step_{step:04d}"
        final = FinalModel(final_id, self.evaluator.model, self.data.tokenizer) if final_id is not None else None
        # under torchrun, rank 0 writes every trainer: those it does not hold come to it first
        holders = self.state.holders(sorted(self.trainers))
        self.backend.transfer([(t, node, 0) for t, node in holders.items()], self.trainers, "checkpoint")
        state = self.state_dict()
        path = self.weights_dir / label
        if self.writes:
            path = save_checkpoint(self.weights_dir, label, step, self.trainers, state, self.cfg.meaning_hash(),
                                   final, config=self.cfg.meaning())
            for old in prune_checkpoints(self.weights_dir, self.cfg.keep_checkpoints, path):
                log.debug("keep_checkpoints: removed %s", old)
        self.state.checkpointed_step = step
        return path

    def _checkpoint_now(self) -> Path:
        """The state after the last complete outer step, written unless it already is."""
        if self.state.checkpointed_step != self.state.last_outer_step:
            return self.save()
        return self.weights_dir / f"outer_step_{self.state.last_outer_step:04d}"

    def _stopped(self) -> RunStopped:
        """The stop request turned into a checkpoint of the last complete outer step."""
        self.stop.signum = self.stop.signum or signal.SIGTERM  # under torchrun: another rank got the signal
        path = self._checkpoint_now()
        return RunStopped(self.stop.signum or 2, f"stopped by {self.stop.name} after outer step "
                          f"{self.state.last_outer_step}; checkpoint {path}")

    def _fault_stop(self, fault: TrainingFault) -> TrainingFault:
        """on_node_fault: stop. The round was rolled back: checkpoint the last good state, say where it is."""
        if not getattr(fault, "state_is_good", True):
            return TrainingFault(f"{fault}; the last checkpoint in {self.weights_dir} is intact")
        path = self._checkpoint_now()
        return TrainingFault(f"{fault}; the state after outer step {self.state.last_outer_step} is in {path}")

    # -------------------------------------------------------------------------------------------
    # The loop

    def run_outer_step(self, outer_step: int) -> tuple[RoundRecord, float]:
        """One outer step with its merge (cluster/round_driver.py), counted by the ledgers and logged: its record, and
        the metric of the best model alive after it."""
        try:
            record = self.driver.run(outer_step)
            self.ledgers.count(record)
            wall = self.state.wall_before + time.time() - self._start
            for row in record.rows:  # a counter of the step's end, as the ledgers' are
                row["wall_time"] = wall
        finally:
            best = self.logger.log_step(self.driver.record)  # also what a failed step did before it failed
        return record, best

    def train(self) -> dict:
        cfg, state = self.cfg, self.state
        self._start = time.time()
        first_step = state.last_outer_step + 1
        if state.initial_metric is None:
            initial = self.driver.evaluate([min(self.trainers)])[min(self.trainers)]
            state.initial_metric = initial.value
            log.info("outer step 0: %s %.4g (%s)", initial.name, initial.value, start_words(cfg, min(self.trainers)))
            self.logger.log_initial(initial.metrics, list(self.trainers))
        else:
            log.info("resuming after outer step %d of %d", state.last_outer_step, cfg.num_outer_steps)
        budget_left = not (cfg.max_tokens and state.tokens_total >= cfg.max_tokens)
        steps = range(first_step, cfg.num_outer_steps + 1) if budget_left else range(0)
        bar = tqdm(steps, desc="outer steps", unit="step", dynamic_ncols=True, initial=first_step - 1,
                   total=cfg.num_outer_steps)
        self.stop.can_checkpoint = True
        collector.freeze_setup()
        try:
            for outer_step in bar:
                tokens_before = state.tokens_total
                if self.backend.agree(self.stop.event.is_set()):  # the event the nodes poll
                    raise self._stopped()
                try:
                    _, best = self.run_outer_step(outer_step)
                except RoundAbandoned:
                    raise self._stopped() from None
                except TrainingFault as fault:
                    raise self._fault_stop(fault) from None
                # the bar shows what exists after the step: the trainers left after its merge, their best model
                bar.set_postfix(trainers=len(self.trainers), **{self.evaluator.metric[4:]: f"{best:.4g}"},
                                batch=max(t.requested_batch for t in self.trainers.values()))
                bar.total = last_step_expected(cfg, outer_step, state.tokens_total, state.tokens_total - tokens_before)
                state.last_outer_step = outer_step
                if cfg.save_weights_every and outer_step % cfg.save_weights_every == 0 \
                        and outer_step < cfg.num_outer_steps:
                    self.save()
                if cfg.plot_every and outer_step % cfg.plot_every == 0:
                    self.logger.plot(outer_step)
                if cfg.max_tokens and state.tokens_total >= cfg.max_tokens:
                    log.info("token budget reached: %d >= max_tokens %d", state.tokens_total, cfg.max_tokens)
                    break
            if self.backend.agree(self.stop.event.is_set()):
                raise self._stopped()
        finally:
            collector.thaw()
            bar.close()
            self.backend.close()
        # A signal from here on only sets the flag: the final checkpoint is short and completes the run.
        return self._finish(state.initial_metric, state.wall_before + time.time() - self._start)

    def _finish(self, initial_metric: float, wall: float) -> dict:
        scores = {t: result.value for t, result in self.driver.evaluate(sorted(self.trainers)).items()}
        sign = -1 if self.evaluator.higher_is_better else 1
        final_id = min(scores, key=lambda t: (sign * scores[t], t))
        final, state = self.trainers[final_id], self.state
        sent = self.backend.total_sent()  # torchrun: what the collectives sent, all ranks together
        self.save("final", final_id)
        if self.cfg.plot_every:
            self.logger.plot(state.last_outer_step)
        summary = {
            "metric": self.evaluator.metric, "initial_metric": initial_metric, "final_trainer": final_id,
            "final_metric": scores[final_id], "surviving_trainers": scores,
            "outer_steps": state.last_outer_step, "wall_time_s": wall,
            "best_metric_seen": state.best_seen, "tokens_seen": state.tokens_total, **state.traffic.row(),
            "weight_bytes": self.sizes.param_bytes,  # P of the accounting: one trainer's fp32 weights
            "final_requested_batch": final.requested_batch,
            "max_batch_per_node": {n.node_id: n.max_batch for n in self.nodes},
            "accumulation_used": self.logger.accumulation_used, "merges": self.logger.merges,
            "batch_increases": self.logger.batch_increases,
            # decisions where max_requested_batch, not the batch test, set the batch; the largest the test asked
            "capped_requests": self.logger.capped_requests,
            "largest_capped_request": self.logger.largest_capped_request,
            **self.ledgers.summary(),  # the simulated clock (docs/clock.md)
        }
        if self.sizes.gradient_bytes:  # DDP / SNOO: each inner step's all-reduce per node (benchmarks/replay.py)
            summary["gradient_bytes"] = self.sizes.gradient_bytes
        if self.streaming is not None:  # each node's payload per fragment (benchmarks/replay.py prices them)
            summary["fragment_bytes"] = list(self.sizes.fragment_bytes)
        if not self.plan.outer_sync.exact:  # how the encoded payloads travelled (runs before the ring: gathered)
            summary["compressed_sync"] = "ring" if self.plan.outer_sync.ring else "all_gather"
        if sent is not None:  # weights == weights_traffic_bytes: the accounting is what was sent
            summary["bytes_sent_by_collectives"] = sent
        if self.compiled is not None:  # compile: graphs made after the warm-up (0: no shape was new in training)
            from torch._dynamo.utils import counters

            made = counters["stats"]["unique_graphs"] - self.compiled["graphs_before_training"]
            summary["compile"] = {"buckets": self.compiled["buckets"],
                                  "warm_up_graphs": self.compiled["warm_up_graphs"], "graphs_after_warm_up": made}
            if made:
                log.warning("compile: %d graphs were compiled during training, after the warm-up", made)
        if self.memory_plan is not None:  # what each device holds at the nodes' max batch (cluster/memory_plan.py)
            summary["memory_plan"] = self.memory_plan.as_dict()
        if not math.isfinite(scores[final_id]):
            log.warning("final %s is not finite", self.evaluator.metric)
        return summary


def start_words(cfg: Config, first: int) -> str:
    """What the step-0 evaluation measured."""
    if cfg.need_to_reinit_output_layers:
        return f"trainer {first}; each trainer has its own output layer"
    return "all trainers start from the same weights"


def last_step_expected(cfg: Config, step: int, tokens: int, round_tokens: int) -> int:
    """The progress bar's total: num_outer_steps, or with max_tokens the step at which the budget is reached at this
    round's tokens per round (growing batches reach it sooner), so a run that stops at its budget after 2 steps does
    not show 200 and their hours."""
    if not cfg.max_tokens or round_tokens <= 0:
        return cfg.num_outer_steps
    return min(cfg.num_outer_steps, step + math.ceil(max(0, cfg.max_tokens - tokens) / round_tokens))
