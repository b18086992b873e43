"""The simulated cluster: `build_cluster` (build.py) makes its parts from the config, `ClusterController`
(controller.py) runs the outer loop over them. Its parts: state.py (owners, holds, counters, traffic, the rollback
snapshot), round_driver.py (an outer step with its merge, returned as one record), ledgers.py (the simulated clock,
the traffic and the best seen, fed from that record), max_batch_calculator.py (the memory probe), memory_plan.py
(what each device holds, before any work), placement.py (where the parts live, how the nodes run) and throughput.py
(the measured throughput curves). What is decided before a round is algorithms/round_schedule.py."""

from cluster.build import ClusterParts, build_cluster
from cluster.controller import ClusterController
from cluster.placement import master_device_of, use_threads

__all__ = ["ClusterController", "ClusterParts", "build_cluster", "master_device_of", "use_threads"]
