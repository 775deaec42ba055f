"""PNG plots of a simulation (matplotlib, Agg backend: no display needed on a login node).

Three figures: GPU memory in use over time, SMACT over time (one line per GPU), and the per-job
waiting/execution breakdown, the same views CARMA §3.5 uses to explain a policy's effect.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gpushare.gpus import GiB


def write(sim: Any, folder: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    cfg = sim.config
    title = f"{cfg.policy} / {cfg.estimator}, {cfg.nodes}x{cfg.gpus_per_node} {cfg.gpu}, seed {cfg.seed}"
    written = []
    for column, label, scale, name in ((1, "memory in use (GiB)", 1 / GiB, "memory.png"),
                                       (2, "SMACT", 1.0, "utilisation.png")):
        fig, ax = plt.subplots(figsize=(9, 3.5))
        for gpu in sim.gpus:
            times = [p[0] / 3600 for p in gpu.history]
            values = [p[column] * scale for p in gpu.history]
            ax.step(times, values, where="post", label=f"GPU {gpu.index}", linewidth=0.8)
        if column == 1:
            ax.axhline(sim.gpus[0].capacity_bytes / GiB, color="k", linestyle=":", linewidth=0.8)
        ax.set_xlabel("time (h)")
        ax.set_ylabel(label)
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7, ncol=4)
        fig.tight_layout()
        fig.savefig(folder / name, dpi=110)
        plt.close(fig)
        written.append(folder / name)
    jobs = sorted((j for j in sim.jobs.values() if j.end is not None), key=lambda j: j.spec.submit_s)
    fig, ax = plt.subplots(figsize=(9, 4))
    ids = range(len(jobs))
    ax.bar(ids, [j.wait_s / 60 for j in jobs], label="waiting", color="tab:orange")
    ax.bar(ids, [j.exec_s / 60 for j in jobs], bottom=[j.wait_s / 60 for j in jobs], label="execution",
           color="tab:blue")
    for k, job in enumerate(jobs):
        if job.ooms:
            ax.annotate("OOM", (k, (job.wait_s + job.exec_s) / 60), fontsize=6, ha="center", color="red")
    ax.set_xlabel("job (submission order)")
    ax.set_ylabel("minutes")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(folder / "jobs.png", dpi=110)
    plt.close(fig)
    written.append(folder / "jobs.png")
    return written
