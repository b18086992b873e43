"""Running under torchrun: one node per process (rank), gloo on CPU, NCCL on CUDA.

    torchrun --standalone --nproc-per-node 4 run.py [key=value ...]

torchrun is detected from its environment (RANK, WORLD_SIZE, LOCAL_RANK). The world size must equal
devices x nodes_per_gpu: rank r runs node r, on its device (cpu, or cuda:LOCAL_RANK).
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from utils.config import PER_MACHINE_KEYS, Config
from utils.errors import ConfigError, UserError
from utils.typed_yaml import flatten


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def from_environ() -> DistEnv | None:
    """The torchrun environment of this process, or None when it was not started by torchrun."""
    if "TORCHELASTIC_RUN_ID" not in os.environ and "LOCAL_RANK" not in os.environ:
        return None
    try:
        return DistEnv(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"]))
    except (KeyError, ValueError):
        return None


def check(cfg: Config, env: DistEnv) -> None:
    if env.world_size != cfg.total_nodes:
        raise ConfigError("nodes_per_gpu", f"torchrun started {env.world_size} processes, but devices x nodes_per_gpu "
                          f"= {len(cfg.devices)} x {cfg.nodes_per_gpu} = {cfg.total_nodes} nodes; each process runs "
                          f"one node: use --nproc-per-node {cfg.total_nodes} (times machines) or change devices / "
                          "nodes_per_gpu")


def device_of(cfg: Config, env: DistEnv) -> str:
    """Rank r runs node r on its configured device; a CUDA node uses the GPU of its local rank (modulo the
    GPUs this machine has: more processes than GPUs share them, e.g. 2 processes on one GPU)."""
    device = cfg.device_names[env.rank // cfg.nodes_per_gpu]
    if not device.startswith("cuda"):
        return "cpu"
    import torch

    return f"cuda:{env.local_rank % max(torch.cuda.device_count(), 1)}"


def backend_of(cfg: Config, env: DistEnv) -> str:
    """dist_backend: auto = NCCL for CUDA nodes, gloo for CPU ones."""
    if cfg.dist_backend != "auto":
        return cfg.dist_backend
    return "nccl" if device_of(cfg, env).startswith("cuda") else "gloo"


def comm_device(cfg: Config, env: DistEnv) -> str:
    """Where collectives' tensors live: NCCL reduces CUDA tensors, gloo CPU ones (copied from the GPU)."""
    return device_of(cfg, env) if backend_of(cfg, env) == "nccl" else "cpu"


_STORE = None  # this attempt's store: ranks mark their arrival at collectives in it


def store():
    return _STORE


def init(cfg: Config, env: DistEnv) -> None:
    import torch
    import torch.distributed as dist

    global _STORE
    device = device_of(cfg, env)
    backend = backend_of(cfg, env)
    if dist.is_initialized():
        return
    if device.startswith("cuda"):  # object collectives and NCCL communicators use the current device
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=cfg.dist_timeout_s)
    # A store prefix per restart: after torchrun restarts the group, keys the dead processes wrote (their
    # addresses) must not be read by the new ones.
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), env.world_size,
                          is_master=env.rank == 0 and not agent_store, timeout=timeout)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group(backend, store=dist.PrefixStore(f"adloco/attempt_{attempt}", store), rank=env.rank,
                            world_size=env.world_size, timeout=timeout)
    _STORE = dist.PrefixStore(f"adloco/attempt_{attempt}/arrivals", store)


# Keys that may differ between machines: where each keeps its files (whether the data they lead to is the
# same is checked apart, agree_on_data), and the CPU kernels and threads each machine's CPU offers (each
# rank logs its own; they change last digits, not decisions, which are taken from all-reduced values).
# (utils/config.py: the fields marked per_machine)


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def disagreements(per_rank: list[dict[str, Any]]) -> list[str]:
    """'key: value on ranks a, b; other on rank c' for each key whose value is not the same on every rank."""
    out = []
    for key in sorted(set().union(*per_rank)):
        groups: dict[str, list[int]] = {}
        for rank, values in enumerate(per_rank):
            groups.setdefault(repr(values.get(key)), []).append(rank)
        if len(groups) > 1:
            out.append(f"{key}: " + "; ".join(f"{value} on {_ranks(ranks)}" for value, ranks in groups.items()))
    return out


def agree(what: str, mine: dict[str, Any], advice: str) -> None:
    """Every rank shares `mine`; if any value differs, every rank stops with the same one line."""
    import torch.distributed as dist

    per_rank: list = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, mine)
    differ = disagreements(per_rank)
    if differ:
        raise UserError(f"torchrun: the processes were started with different {what}: {' | '.join(differ)}; "
                        f"{advice}")


def agree_on_config(cfg: Config) -> None:
    """Ranks train in lockstep from one config: a different lr_inner or seed on one machine is refused."""
    resolved = {k: v for k, v in cfg.to_dict().items() if k not in PER_MACHINE_KEYS}
    agree("configurations", {**flatten(resolved), "config_hash": cfg.meaning_hash()},
          "start every machine with the same config file and key=value overrides")


def agree_on_data(fingerprint: dict[str, Any]) -> None:
    agree("data", fingerprint, "give every machine the same corpus (cache_dir / c4 paths) and tokenizer")




def record_cause(rank: int, line: str) -> None:
    """This rank ends by an error of its own: the group's first cause, for the other ranks' lines and status.json
    (distributed/liveness.py)."""
    from distributed.liveness import record_cause as record

    if _STORE is not None:
        record(_STORE, rank, line)


def shared_run_dir(env: DistEnv, claim: Callable[[], tuple[Path, Any]]) -> tuple[Path, Any]:
    """Rank 0 claims the run directory (made and locked) and tells the others; its error too, so no rank
    waits for nothing. Returns (run directory, rank 0's lock or None)."""
    import torch.distributed as dist

    message: list = [None]
    lock = None
    if env.is_main:
        try:
            run_dir, lock = claim()
            message[0] = ("ok", str(run_dir))
            marker = restart_marker(run_dir.parent)
            if marker is not None:  # where a restarted group finds this run
                marker.write_text(str(run_dir))
        except UserError as exc:
            message[0] = ("error", str(exc))
    dist.broadcast_object_list(message, src=0)
    status, value = message[0]
    if status == "error":
        raise UserError(value)
    return Path(value), lock


def finish() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def restart_marker(log_dir: Path) -> Path | None:
    """log_dir/.torchrun-<run id>: the run directory of this torchrun job (its id survives restarts)."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    return log_dir / f".torchrun-{run_id}" if run_id else None


def restarted_run(log_dir: str) -> Path | None:
    """After torchrun restarted the group (--max-restarts): the run directory to resume, if it has one."""
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) < 1:
        return None
    marker = restart_marker(Path(log_dir).expanduser())
    if marker is None or not marker.is_file():
        return None
    run_dir = Path(marker.read_text().strip())
    return run_dir if any((run_dir / "model_weights").glob("*/manifest.json")) else None
