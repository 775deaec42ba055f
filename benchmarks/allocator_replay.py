"""Replay speed of the caching-allocator simulator on a synthetic training-like event stream.

Why: the estimator replays every captured storage allocation (about 10^5 events for a GPT-2-small capture
of three steps) once per target GPU, so the replay has to stay well under a second.

The stream imitates a transformer training loop: persistent parameters and optimizer state, then per step a
forward pass that keeps activations of many sizes (small biases and norms, MiB-sized projections, large
attention and logits buffers), a backward pass that frees them in reverse with short-lived temporaries, and
gradients that live until the next zero_grad.

Run: python benchmarks/allocator_replay.py [--events N] [--repeats 5]
Wall time is what a user waits; CPU time is steadier on a shared machine. Both are medians of the repeats.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from gpushare.estimator_cli.allocator import AllocatorConfig, replay
from gpushare.gpus import KiB, MiB, GiB


def training_events(target: int, seed: int = 0) -> list[tuple[str, int, int, int]]:
    """About ``target`` alloc/free events shaped like a small transformer's training steps."""
    rng = random.Random(seed)
    events: list[tuple[str, int, int, int]] = []
    key = 0

    def alloc(size: int) -> int:
        nonlocal key
        key += 1
        events.append(("alloc", key, size, 0))
        return key

    def free(k: int) -> None:
        events.append(("free", k, 0, 0))

    layer_sizes = [768 * 4, 768 * 768 * 4, 768 * 3072 * 4, 3072 * 4, 768 * 2304 * 4]
    params = [alloc(rng.choice(layer_sizes)) for _ in range(150)]
    grads: list[int] = []
    state: list[int] = []
    while len(events) < target:
        for g in grads:
            free(g)
        grads = []
        acts = []
        for _layer in range(12):
            for _op in range(60):
                size = rng.choice((512, 3 * KiB, 96 * KiB, 1536 * KiB, 6 * MiB, 24 * MiB, 96 * MiB))
                acts.append(alloc(size + rng.randrange(0, 4096)))
                if rng.random() < 0.4:
                    free(acts.pop(rng.randrange(len(acts))))
        for k in reversed(acts):
            tmp = alloc(rng.choice((2 * KiB, 700 * KiB, 12 * MiB)))
            free(k)
            free(tmp)
        grads = [alloc(rng.choice(layer_sizes)) for _ in params]
        if not state:
            state = [alloc(rng.choice(layer_sizes)) for _ in range(2 * len(params))]
    return events[:target]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    events = training_events(args.events)
    for label, config in (
        ("default", AllocatorConfig()),
        ("expandable_segments", AllocatorConfig.from_env_string("expandable_segments:True")),
        ("max_split_size_mb:128", AllocatorConfig.from_env_string("max_split_size_mb:128")),
    ):
        wall, cpu = [], []
        for _ in range(args.repeats):
            w0, c0 = time.perf_counter(), time.process_time()
            result = replay(events, 80 * GiB, config)
            wall.append(time.perf_counter() - w0)
            cpu.append(time.process_time() - c0)
        median_wall, median_cpu = statistics.median(wall), statistics.median(cpu)
        print(
            f"{label:22s} {len(events):>7d} events  median wall {median_wall * 1000:6.1f} ms "
            f"({len(events) / median_wall:>9,.0f} events/s)  cpu {median_cpu * 1000:6.1f} ms "
            f"({len(events) / median_cpu:>9,.0f} events/s)  peak reserved {result.peak_reserved_bytes / GiB:.2f} GiB, "
            f"allocated {result.peak_allocated_bytes / GiB:.2f} GiB"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
