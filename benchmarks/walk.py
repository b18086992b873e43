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

Returns are counted twice: every return as it happens (a loop over nodes, trainers or micro-batches returns once per
pass), and the distinct places they happen at (a return at the same line of the same function, from the same file,
counts once however often a loop repeats it).

The same step is also read as a newcomer reads it by hand (`Reading`): each function of the repository read once, in
the order the step first calls it; a call to a function already read is not followed (nor anything it calls); a
return is going back to the file that called. On the code the issue measured (main at 0ebb3f1), this reading gives
70 returns, where the issue counted 68 by hand (its 23 files are not reproduced: 30 here); so it is the scale of the
issue's target of 40 returns.
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


class FileMoves:
    """What both counts keep: the repository's files in the order entered (`seen`), the file executing now, and the
    returns into each file; `_mine` tells the repository's frames from the libraries'."""

    def __init__(self, root: Path) -> None:
        self.root = str(root) + "/"
        self.skip = (str(root / ".venv"), str(root / "benchmarks" / "walk.py"))
        self.current: str | None = None
        self.seen: list[str] = []
        self.returns: Counter = Counter()  # file -> returns into it

    def _mine(self, frame):
        """The innermost repository frame at or above `frame`, or None."""
        while frame is not None:
            name = frame.f_code.co_filename
            if name.startswith(self.root) and not name.startswith(self.skip):
                return frame
            frame = frame.f_back
        return None


class Walk(FileMoves):
    """The moves between the repository's files while active (see the module's docstring)."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.sites: dict[str, set] = {}  # file -> the distinct places returned to: (from file, function, line)

    def __call__(self, frame, event, arg) -> None:
        if event not in ("call", "return"):
            return
        mine = self._mine(frame if event == "call" else frame.f_back)
        now = None if mine is None else mine.f_code.co_filename[len(self.root):]
        if now is None or now == self.current:
            return
        if now in self.seen:
            self.returns[now] += 1
            self.sites.setdefault(now, set()).add((self.current, mine.f_code.co_name, mine.f_lineno))
        else:
            self.seen.append(now)
        self.current = now

    def distinct_returns(self, name: str) -> int:
        return len(self.sites.get(name, ()))


class Reading(FileMoves):
    """A newcomer's reading (see the module's docstring): `seen`, the files in the order entered; `returns`, per file,
    the returns into it from a function it called; `calls_back`, per file, the calls into it after the reading had
    left it. A generator is read at its first call (its later resumptions are calls to a function already read)."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.read: set = set()  # the functions read: their code objects' (file, first line, name)
        self.not_followed = None  # the frame of a call to a function already read, until it returns
        self.calls_back: Counter = Counter()

    def _move(self, now: str, back: bool) -> None:
        if now == self.current:
            return
        if now not in self.seen:
            self.seen.append(now)
        elif back:
            self.returns[now] += 1
        else:
            self.calls_back[now] += 1
        self.current = now

    def __call__(self, frame, event, arg) -> None:
        if event not in ("call", "return"):
            return
        if self.not_followed is not None:
            if event == "return" and frame is self.not_followed:
                self.not_followed = None
            return
        if self._mine(frame) is not frame:  # torch, transformers, the standard library: passed through
            return
        code = frame.f_code
        if event == "call":
            function = (code.co_filename, code.co_firstlineno, code.co_name)
            if function in self.read and self.current is not None:
                self.not_followed = frame
                return
            self.read.add(function)
            self._move(code.co_filename[len(self.root):], back=False)
        else:
            caller = self._mine(frame.f_back)
            if caller is not None:
                self._move(caller.f_code.co_filename[len(self.root):], back=True)


class StepWindow:
    """Hands the profile's events to each of `counters` from the call of ClusterController.run_outer_step(step) to
    the next call of it (its frame's own arguments say which step; no engine code is patched)."""

    def __init__(self, step: int, *counters: FileMoves) -> None:
        self.step, self.counters, self.active, self.done = step, counters, False, False

    def __call__(self, frame, event, arg) -> None:
        if self.done:
            return
        if event == "call" and frame.f_code.co_name == "run_outer_step" and "outer_step" in frame.f_locals:
            self.done = self.active  # the next step starts: the walk is over
            self.active = frame.f_locals["outer_step"] == self.step
        if self.active and not self.done:
            for counter in self.counters:
                counter(frame, event, arg)


def walk_step(step: int, overrides: list[str]) -> tuple[Walk, Reading]:
    """The walk and the reading of outer step `step` of a run of the tiny config (plus overrides), in this process
    (both counters see the same events)."""
    import tempfile

    from run import train
    from utils.config import load_config

    walk, reading = Walk(ROOT), Reading(ROOT)
    sys.setprofile(StepWindow(step, walk, reading))
    try:
        with tempfile.TemporaryDirectory() as logs:
            train(load_config(ROOT / "config.yaml", [*TINY, f"log_dir={logs}", *overrides]))
    finally:
        sys.setprofile(None)
    return walk, reading


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--step", type=int, default=2, help="the outer step walked (the tiny run merges at step 2)")
    p.add_argument("--markdown", default="", help="append the table to this file")
    p.add_argument("overrides", nargs="*", help="run.py overrides (KEY=VALUE)")
    args = p.parse_args(argv)
    walk, reading = walk_step(args.step, args.overrides)
    rows = [[name, walk.returns[name], walk.distinct_returns(name), reading.returns[name]] for name in walk.seen]
    text = table(f"One outer step with a merge (step {args.step}): {len(walk.seen)} files entered, "
                 f"{sum(walk.returns.values())} returns, at {sum(r[2] for r in rows)} distinct places; read by hand, "
                 f"{len(reading.seen)} files and {sum(reading.returns.values())} returns",
                 ["file (in the order entered)", "returns into it", "at distinct places", "read by hand: returns"],
                 rows)
    print(text)
    if args.markdown:
        with Path(args.markdown).open("a") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
