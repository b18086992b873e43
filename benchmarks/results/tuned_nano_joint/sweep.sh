#!/bin/bash
# Issue 58's re-run of the nano regime (benchmarks/results/tuned_nano: microllama-nano, 4 epochs of the embedded corpus,
# 2848256 tokens): every study its own quasi-random design over all its knobs at once (AdLoCo: lr, ETA, merge_frequency,
# starting batch; the Nesterov outer steps: lr, outer lr, momentum; the constant-batch methods' "_tuned_batch" studies:
# their batch too), each trial on the two tuning seeds 1000 and 1001 (its objective: the mean at the token budget), 28
# trials per study (equal per method: the fewest at which the trials near any lr, within a factor of 2, meet 3 values of
# each other knob over the 0.1x-50x lr range, and over SNOO's 0.035x-50x; tests/test_tune.py). PRIMARY first: the paper's AdLoCo, ours and DiLoCo
# with its batch tuned; then the per-batch studies of the critical batch (8 lr points per batch on the same 2 seeds:
# CRITICAL) and the other baselines (REST: DiLoCo with Nesterov, DDP and SNOO, each with its batch tuned). Switch mode's
# ablations are not tuned (SWITCH): they are ablations of a method, not methods, and at both AdLoCos' tuned points so
# far no batch grows past the largest that fits (8 against 11: accumulation_used false), so there switch mode never acts
# and its ablations are those very runs; they run untuned at each variant's own defaults instead, where batches grow to
# the cap and switch mode decides (python -m benchmarks.compare, 10 seeds, with the matched control). The request cap is
# 64 (the probe's 32 capped the warm AdLoCo on every seed). Every finalist run evaluates each trainer's synced model
# every 2 of its 10 inner steps (eval_every_inner_steps: steps to a target at that grain, not in whole rounds); trials
# make no such evaluation and no plot (their objective reads neither, benchmarks.tune TRIAL_SKIPS; until 2026-11-28 they
# made them, with the same numbers). No run draws PNG plots (plot_every 0: 2.5 s a plot every 4 outer steps, a tenth of
# a finalist's time; the report draws its own from the CSVs, which are the same). 2 to 3.5 minutes of one core per trial
# run: a multi-session study, continued by the same command with the same --storage; the journal is committed as it
# grows. avx2 kernels, as the probe.
# ROOT: this checkout (the script's own); TREE (default ROOT): the checkout whose code runs (a worktree of main, so that
# commits during hours of runs change nothing that runs); OUT (default: this folder): where results land.
# PART (default primary): primary | critical | rest | switch | final. final: the finalists of the primary and critical
# parts once both are in, each study's best trial on the evaluation seeds 0-9 (--seeds 10: a primary comparison rests on
# at least 10), tuned variants only, and their report; --trials 8 there tunes nothing more (every study of the call
# holds at least 8 finished trials: 28 for the primary ones), and a study's best is the best of all its trials. Run
# final as one process with WORKERS=2 (its finalists share the call's workers; two calls would share run directories).
# Its runs go variant by variant in the order of VARIANTS (benchmarks.tune in_named_order), all seeds of one before
# the next: the primary comparisons' first (both AdLoCos, DiLoCo with its batch tuned, and DiLoCo at their starting
# batches 4 and 8), batch 1 last (its 556 rounds, each evaluated 5 times, make it the costliest), so a session that
# ends midway leaves them complete.
# switch runs its runs with benchmarks.compare, WORKERS at once (default 1: one core, beside a part of the tuner on
# the other; WORKERS=2 alone on the 2 cores).
# keep: the finished runs of final and switch (run directories stay out of git, and a fresh checkout loses them) as
# OUT/finished_runs.tar.gz, their small files only (benchmarks/compare/bundle.py FILES: what reusing and reading a
# finished run needs), the finished trial runs as well (a trial recorded before 2026-11-29 keeps what its knobs
# decided only in its runs' summary.json, which says whether a best point at the top of ETA's range is a plateau or
# an edge: without them trials.csv flags adloco@aeac77a97d's best an edge), and the runs that stopped on a training fault (an outcome, reused as such: their config,
# status and log); commit it at the end of a session. keep unpacks the tarball first (never over a file already
# there), so what an earlier keep holds stays in it, also in a fresh checkout that has unpacked nothing yet. final
# and switch unpack it first too, so a fresh checkout goes on where the last session ended instead of training those
# runs again.
# final_all: after rest has completed (it leaves OUT/rest.done, committed), the finalists of all three parts and the
# one report of them all (the nine of final are reused, not run again); refused before rest.done exists, since
# --trials 8 would otherwise stop the rest studies at 8 trials of their 28.
# all: final, rest, final_all, switch in turn, each continuing where the last call ended; a part that stops (a signal:
# exit 128 + its number) or fails ends the chain there. Stop it with pkill -TERM -f 'benchmarks.(tune|compare) --config'.
ROOT=$(cd "$(dirname "$0")/../../.." && pwd)
OUT=${OUT:-$ROOT/benchmarks/results/tuned_nano_joint}
if [ "${PART:-primary}" = all ]; then
  for part in final rest final_all switch; do
    PART=$part bash "$0" || { rc=$?; echo "PART=all: PART=$part ended with exit $rc; the chain stops there" >&2; exit $rc; }
  done
  exit 0
fi
cd "${TREE:-$ROOT}" || exit 1
# what was kept, unpacked first (never over a file already there): final and switch reuse it, and keep adds to it
# (a fresh checkout that has unpacked nothing would otherwise replace it with an empty tarball)
case "${PART:-primary}" in final|final_all|switch|keep) [ -f "$OUT/finished_runs.tar.gz" ] &&
  { tar xzf "$OUT/finished_runs.tar.gz" -C "$OUT" --skip-old-files || exit 1; } ;; esac
if [ "${PART:-primary}" = keep ]; then
  read -ra KEPT <<< "$(cd "$ROOT" && .venv/bin/python -c 'from benchmarks.compare.bundle import FILES; print(*FILES)')"
  cd "$OUT" || exit 1
  for d in runs/*/ switch/runs/*/ trials/runs/*/; do
    # a finished run, or one that stopped on a training fault (its outcome: reused, not trained again)
    [ -f "$d/summary.json" ] || grep -qs '"state": "fault"' "$d/status.json" || continue
    for f in "${KEPT[@]}"; do [ -f "$d$f" ] && echo "$d$f"; done
  done | tar czf finished_runs.tar.gz.tmp -T - && mv finished_runs.tar.gz.tmp finished_runs.tar.gz
  faulted=$(grep -ls '"state": "fault"' runs/*/status.json switch/runs/*/status.json trials/runs/*/status.json | wc -l)
  echo "$(tar tzf finished_runs.tar.gz | grep -c summary.json) finished runs and $faulted that stopped on a training" \
    "fault kept in $OUT/finished_runs.tar.gz"; exit 0
fi
# the finalists of the primary and critical parts, in the order they run (final, and the first of final_all's)
FINAL=adloco_paper,adloco,diloco_tuned_batch,diloco_b4,diloco_b8,diloco_b2,diloco_b16,diloco_b32,diloco_b1
case "${PART:-primary}" in
  primary) VARIANTS=diloco_tuned_batch,adloco_paper,adloco; TRIALS=28 ;;
  critical) VARIANTS=diloco_b1,diloco_b2,diloco_b4,diloco_b8,diloco_b16,diloco_b32; TRIALS=8 ;;
  rest) VARIANTS=diloco_nesterov_tuned_batch,ddp_tuned_batch,snoo_tuned_batch; TRIALS=28 ;;
  switch) exec "$ROOT/.venv/bin/python" -m benchmarks.compare --config configs/compare_cpu.yaml --seeds 10 \
    --max_tokens 2848256 --max_outer_steps 600 --node_throughput 8360 --diloco_batches 1,2,4,8,16,32 \
    --variants adloco_paper,adloco,switch --workers "${WORKERS:-1}" --out "$OUT"/switch \
    model_config.name=microllama-nano max_requested_batch=64 eval_every_inner_steps=2 plot_every=0 cpu_threads=1 \
    cpu_capability=avx2 ;;
  final) VARIANTS=$FINAL; TRIALS=8; FINALISTS=(--seeds 10 --tuned_only) ;;
  final_all) [ -f "$OUT/rest.done" ] || { echo "PART=final_all: PART=rest has not completed ($OUT/rest.done)" >&2
    exit 2; }
    VARIANTS=$FINAL,diloco_nesterov_tuned_batch,ddp_tuned_batch,snoo_tuned_batch
    TRIALS=8; FINALISTS=(--seeds 10 --tuned_only) ;;
  *) echo "PART: primary, critical, rest, switch, final, final_all, all or keep" >&2; exit 2 ;;
esac
"$ROOT/.venv/bin/python" -m benchmarks.tune --config configs/compare_cpu.yaml \
  --max_tokens 2848256 --max_outer_steps 600 --node_throughput 8360 --diloco_batches 1,2,4,8,16,32 \
  --variants "$VARIANTS" --trials "$TRIALS" "${FINALISTS[@]}" --tuning_seed 1000,1001 --workers "${WORKERS:-1}" \
  --storage "$OUT"/studies.journal --out "$OUT" \
  model_config.name=microllama-nano max_requested_batch=64 eval_every_inner_steps=2 plot_every=0 cpu_threads=1 \
  cpu_capability=avx2
rc=$?
[ "$rc" = 0 ] && [ "${PART:-primary}" = rest ] && date -u +%FT%TZ > "$OUT/rest.done"
exit $rc
