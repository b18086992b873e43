"""A network in the alpha-beta model: the one definition of what a message or a collective costs in time.

Used live by the simulated clock (algorithms/clock.py, config `network`) and on finished runs by
benchmarks/replay.py. Bandwidth is per node link and per direction; latency is per message.

    a message of S bytes                     latency + S / bandwidth
    ring all-reduce of S bytes over n nodes  2 (n-1) steps of S/n bytes = 2 (n-1) x latency + 2 (n-1)/n x S / bandwidth
    ring all-gather of C bytes per node      (n-1) steps of C bytes = (n-1) x (latency + C / bandwidth)
    (0 for n = 1)
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass


def ring_allreduce_bytes(num_nodes: int, payload_bytes: int) -> int:
    """Bytes all nodes together send in a ring all-reduce of `payload_bytes` among `num_nodes` nodes."""
    return 2 * (num_nodes - 1) * payload_bytes if num_nodes > 1 else 0


# named settings (config `network`, benchmarks --network); per node link, per direction
PRESETS = {
    "datacentre": "100Gbit/s,10us",  # one cluster, Ethernet/InfiniBand class
    "cross-region": "1Gbit/s,50ms",  # data centres in different regions or continents
    "consumer": "100Mbit/s,30ms",  # volunteers' home internet
}
_RATE = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_TIME = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}


@dataclass(frozen=True)
class Network:
    name: str
    bandwidth: float  # bytes per second, per node link and direction
    latency: float  # seconds per message

    def message(self, nbytes: float) -> float:
        """One point-to-point message of `nbytes`."""
        return self.latency + nbytes / self.bandwidth

    def allreduce(self, num_nodes: int, nbytes: float) -> float:
        """A ring all-reduce of `nbytes` among `num_nodes` nodes: 2 (n-1) steps of nbytes / n each."""
        if num_nodes <= 1:
            return 0.0
        # each node sends its share of the accounting's ring bytes, one latency per step
        return 2 * (num_nodes - 1) * self.latency + ring_allreduce_bytes(num_nodes, nbytes) / num_nodes / self.bandwidth

    def allgather(self, num_nodes: int, nbytes: float) -> float:
        """A ring all-gather of each node's `nbytes`: n-1 steps, each node sending one payload per step."""
        return (num_nodes - 1) * (self.latency + nbytes / self.bandwidth) if num_nodes > 1 else 0.0


INSTANT = Network("instant", math.inf, 0.0)  # an infinitely fast network: what compute alone takes


def parse_bandwidth(text: str) -> float:
    """'10Gbit/s', '100 Mbps', '1.25GB/s' -> bytes per second."""
    m = re.fullmatch(r"\s*([0-9.]+(?:e[+-]?\d+)?)\s*([kmgt]?)(bit/s|bps|b/s|byte/s)\s*", text, re.IGNORECASE)
    if not m:
        raise ValueError(f"bandwidth '{text}': write a number and a unit, e.g. 10Gbit/s, 100Mbps, 1.25GB/s")
    value, prefix, unit = float(m[1]), _RATE[m[2].lower()], m[3]
    is_bits = unit.lower() in ("bit/s", "bps") or unit == "b/s"
    rate = value * prefix / (8 if is_bits else 1)
    if rate <= 0:
        raise ValueError(f"bandwidth '{text}' must be > 0")
    return rate


def parse_latency(text: str) -> float:
    """'1ms', '50 ms', '10us', '0.2s' -> seconds."""
    m = re.fullmatch(r"\s*([0-9.]+(?:e[+-]?\d+)?)\s*(s|ms|us|µs|ns)\s*", text)
    if not m:
        raise ValueError(f"latency '{text}': write a number and a unit, e.g. 1ms, 10us, 0.05s")
    return float(m[1]) * _TIME[m[2]]


def parse_network(spec: str) -> Network:
    """A preset name ('datacentre', 'cross-region', 'consumer'), 'BANDWIDTH,LATENCY' or 'NAME=BANDWIDTH,LATENCY'."""
    name, _, value = spec.rpartition("=")
    value = PRESETS.get(value.strip(), value)
    name = name.strip() or (spec.strip() if spec.strip() in PRESETS else value.replace(" ", ""))
    parts = value.split(",")
    if len(parts) != 2:
        raise ValueError(f"'{spec}': give BANDWIDTH,LATENCY (e.g. '10Gbit/s,1ms') or a preset: {', '.join(PRESETS)}")
    return Network(name, parse_bandwidth(parts[0]), parse_latency(parts[1]))


def format_rate(bits_per_s: float, digits: int = 6) -> str:
    """1.25e10 -> '12.5 Gbit/s'."""
    unit, factor = next((u, f) for u, f in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3), ("bit/s", 1.0))
                        if bits_per_s >= f * 0.999 or f == 1.0)
    return f"{bits_per_s / factor:.{digits}g} {unit}"


def describe(net: Network) -> str:
    lat = f"{net.latency * 1e3:g} ms" if net.latency >= 1e-3 else f"{net.latency * 1e6:g} us"
    return f"{net.name} ({format_rate(net.bandwidth * 8)}, {lat})"
