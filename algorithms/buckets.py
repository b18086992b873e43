"""Micro-batch shape buckets for compiled nodes (config compile: true).

AdLoCo's batch changes during a run, and every new micro-batch shape makes torch.compile trace and compile again
(and past dynamo's recompile limit, silently run eager). A compiled node instead pads each micro-batch up to the
smallest bucket that holds it, and every bucket is compiled in a warm-up before training, so no shape is new once
training starts. The buckets: powers of two and 1.5x powers of two up to the node's max batch, and the max batch
itself (16: 1, 2, 3, 4, 6, 8, 12, 16): few shapes to compile (about 2 log2(max batch)), and at most a quarter of a
micro-batch is padding (9 sequences in a bucket of 12), against half with powers of two alone. Padded rows carry
no label (-100), so every loss and gradient is the unpadded one's (up to the order of floating-point sums).
"""

from __future__ import annotations

import bisect


def micro_batch_buckets(max_batch: int) -> list[int]:
    """The micro-batch sizes a compiled node runs, for micro-batches of 1 to `max_batch` sequences."""
    if max_batch < 1:
        raise ValueError(f"max_batch {max_batch}: a node runs at least one sequence")
    sizes, power = {max_batch}, 1
    while power <= max_batch:
        sizes.add(power)
        if power >= 2 and power * 3 // 2 <= max_batch:
            sizes.add(power * 3 // 2)
        power *= 2
    return sorted(sizes)


def bucket_for(rows: int, buckets: list[int]) -> int:
    """The smallest bucket that holds `rows` sequences."""
    i = bisect.bisect_left(buckets, rows)
    if i == len(buckets):
        raise ValueError(f"a micro-batch of {rows} sequences is larger than the largest bucket {buckets[-1]}")
    return buckets[i]
