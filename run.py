"""Train AdLoCo: `python run.py [--config config.yaml] [key=value ...]`.

Reads the config (validated once), checks devices and paths, prepares data and the initial model,
builds the simulated cluster, runs the outer loop and leaves everything in logs/<model>_<dataset>_<date>/.

    python run.py --resume RUN_DIR [key=value ...]

continues a stopped run from its latest complete checkpoint, in the same run directory; only keys that
do not change what is computed may be given (num_outer_steps to extend it, logging, fault handling).
SIGINT / SIGTERM stop a run cleanly: a checkpoint of the last complete outer step, exit 130 / 143.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from run_dir.claim import check_run_name
from run_dir.lifecycle import RunSession, ending_of
from run_dir.run_config import load_run_config
from utils.config import RESUME_MAY_CHANGE, Config, load_config, parse_overrides
from utils.errors import ConfigError, UserError
from utils.openmp import limit_openmp_spinning
from utils.preflight import check_before_work

log = logging.getLogger("run")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, like every other input error (argparse adds the usage)
        print(f"error: {message} (see python run.py --help)", file=sys.stderr)
        sys.exit(2)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = _Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=None, help="YAML config (default: config.yaml)")
    parser.add_argument("--resume", metavar="RUN_DIR", default=None,
                        help="continue the run in RUN_DIR from its latest complete checkpoint")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. num_outer_steps=5 lr_outer=0.7")
    return parser.parse_args(argv)


# ----------------------------------------------------------------------------------------------
# Before any data work: devices, model limits


def request_cpu_kernels(cfg: Config) -> None:
    """torch picks its CPU kernels once, at its first operation: the choice must be in the environment before."""
    if cfg.cpu_capability != "auto":
        os.environ["ATEN_CPU_CAPABILITY"] = cfg.cpu_capability


def resolve_cpu_kernels(cfg: Config) -> Config:
    """The kernels and threads this process really uses; config.yaml then records them, so a plain --resume
    uses the same ones. A capability this CPU (or this already started process) cannot give is refused."""
    import torch

    actual = torch.backends.cpu.get_cpu_capability().lower()
    if cfg.cpu_capability not in ("auto", actual):
        raise ConfigError("cpu_capability", f"'{cfg.cpu_capability}' is not what torch uses in this process "
                          f"('{actual}'): this CPU lacks it, or torch started before it was set (set "
                          f"ATEN_CPU_CAPABILITY={cfg.cpu_capability} before Python starts)")
    if cfg.cpu_threads:
        torch.set_num_threads(cfg.cpu_threads)
    return cfg.replace(cpu_capability=actual)


def check_devices(cfg: Config) -> None:
    import torch

    for device in cfg.device_names:
        if not device.startswith("cuda"):
            continue
        if not torch.cuda.is_available():
            raise ConfigError("devices", f"'{device}' needs CUDA, which this torch ({torch.__version__}) cannot use "
                              "here; use devices: [cpu, cpu]")
        index = int(device.split(":")[1]) if ":" in device else 0
        if index >= torch.cuda.device_count():
            raise ConfigError("devices", f"'{device}': this machine has {torch.cuda.device_count()} CUDA device(s)")


# ----------------------------------------------------------------------------------------------
# --resume


def resume_config(run_dir: Path, overrides: list[str], config_arg: str | None):
    """The run's own config with the allowed overrides, and its latest complete checkpoint."""
    from utils.checkpoint import ConfigMismatch, latest_checkpoint

    if config_arg is not None:
        raise UserError("--config: a resumed run uses RUN_DIR/config.yaml; give changes as key=value")
    if not run_dir.is_dir():
        raise UserError(f"--resume: {run_dir} is not a directory")
    if not (run_dir / "config.yaml").is_file():
        raise UserError(f"--resume: {run_dir} has no config.yaml; is it a run directory?")
    fixed = sorted(k for k in parse_overrides(overrides) if k not in RESUME_MAY_CHANGE)
    pinned = sorted(k for k in parse_overrides(overrides) if k in ("run_name", "log_dir", "log_file"))
    if fixed:
        raise ConfigError(fixed[0], "cannot change when resuming: it would change what the run computes "
                          f"(allowed: {', '.join(sorted(RESUME_MAY_CHANGE - {'run_name', 'log_dir', 'log_file'}))})")
    if pinned:
        raise ConfigError(pinned[0], "cannot change when resuming: the run directory is given by --resume")
    cfg = load_run_config(run_dir / "config.yaml", overrides, resuming=True)
    saved = load_run_config(run_dir / "config.yaml", resuming=True).meaning()
    changed = sorted(k for k, v in cfg.meaning().items() if saved.get(k) != v)
    if changed:  # e.g. max_tokens, when it sets the length of linear_rampup's schedule
        raise ConfigError(changed[0], "cannot change when resuming: it would change what the run computes")
    try:
        checkpoint = latest_checkpoint(run_dir / "model_weights", cfg.meaning_hashes())
    except ConfigMismatch as exc:
        raise UserError(what_changed(exc, cfg.meaning(), overrides, run_dir)) from None
    if checkpoint.path.name == "final" and checkpoint.outer_step >= cfg.num_outer_steps:
        raise ConfigError("num_outer_steps", f"the run in {run_dir} already finished its {checkpoint.outer_step} "
                          "outer steps; give a larger num_outer_steps to extend it")
    return cfg, checkpoint


def what_changed(exc, now: dict, overrides: list[str], run_dir: Path) -> str:
    """A refused resume in one line: the keys whose values differ from the checkpoint's, and where each change came
    from (the command line, or RUN/config.yaml edited since the checkpoint was written)."""
    if exc.config is None:  # written before checkpoints recorded their settings
        return f"{exc} (it predates recording its settings, so the keys that differ cannot be named)"
    given = set(parse_overrides(overrides))
    if "max_tokens" in given:  # it sets linear_rampup's length when rampup_tokens is 0
        given.add("rampup_tokens")

    def shown(values: dict, key: str) -> str:  # keys added later are left out of the settings at their default
        return json.dumps(values[key]) if key in values else "its default"

    changes = []
    for key in sorted(set(exc.config) | set(now)):
        if exc.config.get(key, changes) != now.get(key, changes):
            where = "the command line" if key in given else f"{run_dir / 'config.yaml'}, edited since"
            if key == "fragment_alpha_weighs":  # see run_dir.run_config.load_run_config
                where = "the checkpoint was written when fragment_alpha weighed the global copy"
            changes.append(f"{key}: {shown(exc.config, key)} -> {shown(now, key)} ({where})")
    return (f"--resume: {exc.path} was written with other settings: {'; '.join(changes)}; put them back to resume, "
            "or start a new run with them")


# ----------------------------------------------------------------------------------------------


def train(cfg: Config, resume: tuple[Path, object] | None = None, stop=None) -> tuple[Path, dict]:
    """Train from scratch, or continue `resume` = (run directory, checkpoint). Returns (run_dir, summary).
    The run directory's life (claim, lock, status.json, trackers, summary.json, rank roles) is run_dir/'s."""
    from distributed import torchrun

    env = torchrun.from_environ()
    if env is not None:
        torchrun.check(cfg, env)
    check_devices(cfg)
    request_cpu_kernels(cfg)  # for direct callers; main() has done it before torch was imported
    cfg = resolve_cpu_kernels(cfg)
    check_before_work(cfg)  # model, data paths: before any data work
    if resume is None:
        check_run_name(cfg)
    if env is None:  # what each device will hold: refused now if it cannot fit (torchrun: one node per process)
        from cluster.memory_plan import check_memory_plan

        plan = check_memory_plan(cfg)
        for line in plan.lines() if plan is not None else []:
            print(line, flush=True)
    from utils.cache import forget_refusals

    forget_refusals()  # each run says once if its cache_dir cannot be written (utils/cache.py)
    # Heavy imports after validation, so config errors come back instantly.
    from cluster import ClusterController
    from fabrics.corpus import load_corpus
    from fabrics.models import build_model, count_parameters
    from utils.signals import StopSignals
    from utils.utils import set_seeds

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if env is not None:
        torchrun.init(cfg, env)
        torchrun.agree_on_config(cfg)  # before the run directory is claimed: a mismatch touches nothing
    with RunSession(cfg, resume, env, stop or StopSignals()) as session:
        set_seeds(cfg.training_seed)
        data = load_corpus(cfg)
        log.info("data: %s", data.description)
        if env is not None:
            torchrun.agree_on_data(data.fingerprint())
        model = build_model(cfg, len(data.tokenizer), data.tokenizer.pad_token_id)
        log.info("model: %s (%s), %.2fM parameters", cfg.model_config.name, type(model).__name__,
                 count_parameters(model) / 1e6)
        logger = session.open_logger(classification=data.val.labels is not None)
        cluster = ClusterController.build(cfg, model, data, logger, session.run_dir / "model_weights",
                                          session.checkpoint, session.stop, env)
        summary = cluster.train()
        session.complete(summary)
    return session.run_dir, summary


def with_rank(line: str) -> str:
    """Under torchrun every process prints its own line on one terminal: each says which rank it is (but for what
    the ranks agreed on together, `error: torchrun: ...`, the same line on every rank)."""
    from distributed.torchrun import from_environ

    env = from_environ()
    if env is None or not line.startswith("error: ") or line.startswith(("error: rank ", "error: torchrun:")):
        return line
    return f"error: rank {env.rank}: {line.removeprefix('error: ')}"


def main(argv: list[str] | None = None) -> int:
    """Exit codes: 0 done, 2 bad input, 3 training fault, 1 unexpected error, 130 / 143 stopped by a signal."""
    from utils.signals import StopSignals, stop_with_parent

    limit_openmp_spinning()  # before anything loads torch
    args = parse_args(argv)
    stop = StopSignals().install()  # from the start: a signal during set-up ends the process in one line too
    stop_with_parent()  # a tool's child: its tool's death (SIGKILL included) stops it like SIGTERM
    try:
        if args.resume:
            run_dir = Path(args.resume).expanduser()
            cfg, checkpoint = resume_config(run_dir, args.overrides, args.config)
            request_cpu_kernels(cfg)
            train(cfg, (run_dir, checkpoint), stop)
        else:
            from distributed.torchrun import restarted_run

            cfg = load_config(args.config or "config.yaml", args.overrides)
            request_cpu_kernels(cfg)
            run_dir = restarted_run(cfg.log_dir)  # torchrun --max-restarts: continue where the group died
            if run_dir is not None:
                print(f"torchrun restarted the processes: resuming {run_dir}", file=sys.stderr)
                cfg, checkpoint = resume_config(run_dir, [], None)
                request_cpu_kernels(cfg)
                train(cfg, (run_dir, checkpoint), stop)
            else:
                train(cfg, None, stop)
    except BaseException as exc:
        if isinstance(exc, SystemExit):
            raise
        _, code, line = ending_of(exc, resuming=args.resume)
        line = with_rank(line)
        # one write: under torchrun several processes end at once on one terminal, and print() writes the
        # text and the newline apart, so their lines could run together
        sys.stderr.write(f"{line}\n")
        sys.stderr.flush()
        return code
    return 0


if __name__ == "__main__":
    from utils.process_end import end_process

    code = main()
    # the run is written: skip the interpreter's teardown of torch & co. (utils/process_end.py); stopped by a signal,
    # nothing is left to wait for either (tracker threads, exit hooks)
    end_process(code, run_exit_hooks=code < 128)
