"""The memory-bandwidth floor of a turn: the weights read once per forward step.

A micro-turn step is bound by memory, not arithmetic: it reads every weight once whatever the
batch, so no engine finishes a turn faster than (forward steps per turn) x (weight bytes read per
step) / (memory bandwidth). The bench measures the bandwidth on its own device with a large
device-to-device copy, counted as bytes read plus bytes written (how the GPU issue's ~3.0 TB/s on
an H100 was counted), and reports streaming's latency as a multiple of that floor. KV reads are
left out of the floor: it is what the weights alone cost.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

# The copy: large enough to leave every cache, repeated so one final read-back (which waits for
# the device on any backend) costs little next to the copies it waits for.
COPY_BYTES = 256 * 2**20
COPIES = 8
REPEATS = 3
# The GPU issue's target: streaming's turns within this multiple of the floor.
FLOOR_TARGET_X = 1.25


@dataclass(frozen=True)
class Floor:
    weight_bytes: int  # read by every forward step
    copy_gbps: float  # measured, GB/s (read + write)
    steps_per_turn: int  # the fewest forward steps a turn can take
    steps_per_turn_taken: float  # what the streaming run took, all sessions together

    @property
    def step_ms(self) -> float:
        return self.weight_bytes / (self.copy_gbps * 1e9) * 1000

    @property
    def turn_ms(self) -> float:
        return self.step_ms * self.steps_per_turn


def steps_per_turn(output_tokens: int) -> int:
    """One append step samples the first output token; each further output token is a decode step.

    A turn with no output is its one append step, which samples nothing and so skips lm_head: the
    floor then overstates it by that matrix (it exists for turns that answer).
    """
    return max(output_tokens, 1)


def copy_bandwidth_gbps(device: torch.device) -> float:
    """The best of REPEATS timings of COPIES copies of COPY_BYTES, in GB/s (read + write)."""
    source = torch.ones(COPY_BYTES, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    target.copy_(source)
    int(target[-1])  # warm-up done on the device
    best = float("inf")
    for _ in range(REPEATS):
        started = time.perf_counter()
        for _ in range(COPIES):
            target.copy_(source)
        int(target[-1])  # reading one byte back waits for every copy queued before it
        best = min(best, time.perf_counter() - started)
    return 2 * COPY_BYTES * COPIES / best / 1e9
