"""``--plot``: allocated and reserved memory over the replayed events, phases shaded (matplotlib, Agg)."""

from __future__ import annotations

from typing import Any

PHASE_COLOURS = {"forward": "#cfe8ff", "backward": "#ffe0c2", "optimizer": "#d8f5d0", "zero_grad": "#f3d9f7",
                 "other": "#f2f2f2"}


def write_plot(path: str, allocated: Any, reserved: Any, phases: list[str], context_bytes: int, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gib = float(1 << 30)
    fig, ax = plt.subplots(figsize=(11, 4.5), dpi=110)
    start = 0
    seen: set[str] = set()
    for i in range(1, len(phases) + 1):  # shade runs of equal phase
        if i == len(phases) or phases[i] != phases[start]:
            phase = phases[start]
            ax.axvspan(start, i, color=PHASE_COLOURS.get(phase, "#eeeeee"), lw=0,
                       label=phase if phase not in seen else None)
            seen.add(phase)
            start = i
    xs = range(len(allocated))
    ax.plot(xs, [a / gib for a in allocated], color="#1f5fa8", lw=1.2, label="allocated")
    ax.plot(xs, [r / gib for r in reserved], color="#c0392b", lw=1.2, label="reserved (segments)")
    if len(reserved):
        ax.axhline((max(reserved) + context_bytes) / gib, color="#555555", ls="--", lw=0.8,
                   label="peak total (reserved + context)")
    ax.set_xlabel("allocator event")
    ax.set_ylabel("GiB")
    ax.set_title(title)
    ax.set_xlim(0, max(1, len(allocated)))
    ax.legend(loc="upper left", fontsize=8, ncol=3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
