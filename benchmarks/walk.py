"""How one outer step with a merge walks through the code: the files it enters and how often it returns to one it left.

    python -m benchmarks.walk [--step 2] [--markdown FILE] [overrides ...]

Runs the tiny default run (2 trainers on 2 nodes, a merge every 2 outer steps) in this process, with a
`sys.setprofile` hook counting from the start of outer step --step (ClusterController.run_outer_step) to the start
of the next one (or the end), told apart by the hook itself (no engine code is patched): that step's round, outer
steps, evaluation, batch tests, its merge, the logging and the bookkeeping after it. Counted over the repository's
own Python files (torch, transformers and the standard library pass through): on every call and return, the
repository file now executing (the innermost repository frame); each change of that file is a move, into a file not
seen before in the step (`files entered`) or back into one already left (`returns`). A file is one concern here, so
a move between files is a conversation between concerns: issue 61 asks for at most 15 files and 40 returns
(nanoGPT's step: 2 files, about 3 returns; torchft's DiLoCo: 3-5 files, about 4).
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

from benchmarks.system import table

ROOT = Path(__file__).resolve().parents[1]
TINY = ["num_outer_steps=3", "num_inner_steps=3", "num_init_trainers=2", "nodes_per_gpu=2", "devices=[cpu]",
        "seq_len=32", "val_size=8", "eval_batch_size=8", "initial_batch_size=2", "max_batch_size=4",
        "merge_frequency=2", "save_weights_every=0", "plot_every=0", "tokenizer=bpe", "tokenizer_vocab_size=512",
        "embedded_sources=[tiny]", "clearml_mode=off", "cpu_threads=1"]


class Walk:
    """The moves between the repository's files while active (see the module's docstring)."""

    def __init__(self, root: Path) -> None:
        self.root = str(root) + "/"
        self.skip = (str(root / ".venv"), str(root / "benchmarks" / "walk.py"))
        self.current: str | None = None
        self.seen: list[str] = []
        self.returns: Counter = Counter()  # file -> returns into it

    def _mine(self, frame) -> str | None:
        while frame is not None:
            name = frame.f_code.co_filename
            if name.startswith(self.root) and not name.startswith(self.skip):
                return name[len(self.root):]
            frame = frame.f_back
        return None

    def __call__(self, frame, event, arg) -> None:
        if event not in ("call", "return"):
            return
        now = self._mine(frame if event == "call" else frame.f_back)
        if now is None or now == self.current:
            return
        if now in self.seen:
            self.returns[now] += 1
        else:
            self.seen.append(now)
        self.current = now


class StepWalk(Walk):
    """A Walk of one outer step: active from the call of ClusterController.run_outer_step(step) to the next call
    of it (its frame's own arguments say which step; no engine code is patched)."""

    def __init__(self, root: Path, step: int) -> None:
        super().__init__(root)
        self.step, self.active, self.done = step, False, False

    def __call__(self, frame, event, arg) -> None:
        if self.done:
            return
        if event == "call" and frame.f_code.co_name == "run_outer_step" and "outer_step" in frame.f_locals:
            self.done = self.active  # the next step starts: the walk is over
            self.active = frame.f_locals["outer_step"] == self.step
        if self.active and not self.done:
            super().__call__(frame, event, arg)


def walk_step(step: int, overrides: list[str]) -> Walk:
    """The walk of outer step `step` of a run of the tiny config (plus overrides), in this process."""
    import tempfile

    from run import train
    from utils.config import load_config

    walk = StepWalk(ROOT, step)
    sys.setprofile(walk)
    try:
        with tempfile.TemporaryDirectory() as logs:
            train(load_config(ROOT / "config.yaml", [*TINY, f"log_dir={logs}", *overrides]))
    finally:
        sys.setprofile(None)
    return walk


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--step", type=int, default=2, help="the outer step walked (the tiny run merges at step 2)")
    p.add_argument("--markdown", default="", help="append the table to this file")
    p.add_argument("overrides", nargs="*", help="run.py overrides (KEY=VALUE)")
    args = p.parse_args(argv)
    walk = walk_step(args.step, args.overrides)
    rows = [[name, walk.returns[name]] for name in walk.seen]
    text = table(f"One outer step with a merge (step {args.step}): {len(walk.seen)} files entered, "
                 f"{sum(walk.returns.values())} returns", ["file (in the order entered)", "returns into it"], rows)
    print(text)
    if args.markdown:
        with Path(args.markdown).open("a") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
