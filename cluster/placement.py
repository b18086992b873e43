"""Where the cluster's parts live and how its nodes run: threads or a loop, the masters' device, which simulated
devices share a CUDA card. Read by the composition root (build.py) and the memory plan (memory_plan.py)."""

from __future__ import annotations

import torch

from utils.config import Config


def use_threads(cfg: Config) -> bool:
    if cfg.node_execution != "auto":
        return cfg.node_execution == "threads"
    if cfg.compile:  # torch.compile is not thread-safe
        return False
    # Threads pay off when nodes sit on distinct accelerators; on CPU cores they only contend.
    cuda = [d for d in cfg.device_names if d.startswith("cuda")]
    return len(set(cuda)) > 1 and len(cuda) == len(cfg.device_names)


def master_device_of(cfg: Config, node_devices: list[str]) -> str:
    """master_device auto: the nodes' GPU when every node (of this process) is on the same one, else the CPU."""
    if cfg.master_device == "cpu":
        return "cpu"
    devices = {str(torch.device(d if d != "cuda" else "cuda:0")) for d in node_devices}
    return devices.pop() if len(devices) == 1 and next(iter(devices)).startswith("cuda") else "cpu"


def card_of(device: str) -> str:
    """The physical device a simulated one runs on: 'cuda' is 'cuda:0'."""
    return "cuda:0" if device == "cuda" else device


def nodes_on_card(cfg: Config, device: str) -> int:
    """Nodes of every simulated device on the same physical CUDA card as `device` (they share its memory)."""
    return cfg.nodes_per_gpu * sum(card_of(d) == card_of(device) for d in cfg.device_names)


def device_index_of_nodes(cfg: Config) -> list[int]:
    """Each node's simulated device: its index in `devices` (nodes_per_gpu nodes each, in order)."""
    return [i for i in range(len(cfg.devices)) for _ in range(cfg.nodes_per_gpu)]


def computing_together(cfg: Config) -> bool:
    """Whether a device's nodes compute at once: on the node threads, or stacked (a group holds its nodes'
    gradients and activations together, and a device's nodes may all be one group)."""
    return use_threads(cfg) or cfg.node_execution == "stacked"


def computing_per_device(cfg: Config, threads: bool) -> int:
    """Nodes of one simulated device that compute at once: max_concurrent_nodes (0: all) on the node threads; all
    of them stacked; one (the whole process's one) in a loop."""
    if not threads:
        return 1
    if cfg.node_execution == "stacked":
        return cfg.nodes_per_gpu
    return min(cfg.max_concurrent_nodes or cfg.nodes_per_gpu, cfg.nodes_per_gpu)
