"""A tiny PyTorch training loop on the CPU for the lanes tests; it knows nothing about lanes.

The lanes hooks come from the environment (``PYTHONPATH`` with the package's ``lane_site``, as the
TaskProlog sets it). It logs ``start <t>`` when a forward begins and ``end <t>`` when an optimizer step
finishes (a per-optimizer post hook, which PyTorch runs before the global ones that give the turn back),
so the log shows when it held its turn.

Usage: lane_worker.py LOG STEPS [SLEEP_S] [GO_FILE]
"""

from __future__ import annotations

import os
import sys
import time

import torch

log_path, steps = sys.argv[1], int(sys.argv[2])
sleep_s = float(sys.argv[3]) if len(sys.argv) > 3 else 0.05
go = sys.argv[4] if len(sys.argv) > 4 else ""
log = open(log_path, "a", buffering=1)


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        log.write(f"start {time.time():.6f}\n")
        time.sleep(sleep_s)  # an iteration long enough to be seen
        return self.layer(x)


log.write(f"pid {os.getpid()}\n")
while go and not os.path.exists(go):
    time.sleep(0.02)
model = Tiny()
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
optimizer.register_step_post_hook(lambda *_: log.write(f"end {time.time():.6f}\n"))
for _ in range(steps):
    optimizer.zero_grad()
    loss = model(torch.randn(8, 16)).pow(2).mean()
    loss.backward()
    optimizer.step()
log.write("done\n")
