"""Derive simulator/data/carma_trace{1,2}.csv from a local copy of CARMA's repository (github.com/itu-rad/CARMA).

Why: the simulator's calibration against CARMA's measured runs needs the arrivals *and* the exact
task-to-model mapping CARMA replayed, not a seeded draw. CARMA ran each trace as a shell script
(``assets/philly-based-evaluation-traces/philly_trace-t{1,2}.sh``: ``sleep GAP`` then ``submit.py --task
workloads/NAME.rad``); each ``.rad`` file names the training command (script, ``--batch_size``,
``--epochs``), the GPU count and the measured solo peak memory (MB). This script reads those files from
a bare git mirror and writes the simulator's rich trace format (docs/simulator.md, *Trace formats*).
The tests read only the committed CSVs; this script is how they were made:

    python benchmarks/carma_traces.py --git-dir /path/to/CARMA.git --out simulator/data
"""

from __future__ import annotations

import argparse
import re
import subprocess
from pathlib import Path

TRACES = {1: "assets/philly-based-evaluation-traces/philly_trace-t1.sh",
          2: "assets/philly-based-evaluation-traces/philly_trace-t2.sh"}

# training script -> the model's name in gpushare.simulator.workload (CARMA Table 2)
SCRIPTS = {
    "BERT_base_on_wiki.py": "BERT_base", "BERT_large_on_wiki.py": "BERT_large",
    "xlnet_base_cased.py": "xlnet_base", "xlnet_large_cased.py": "xlnet_large",
    "gpt2_large_on_wiki.py": "gpt2_large", "efficientNet.py": "efficientnet_b0", "resnet50.py": "resnet50",
    "mobilenet.py": "mobilenet_v2", "vgg.py": "vgg16", "Xception.py": "Xception", "Inception.py": "inception",
    "UNet.py": "UNet", "train.py": "MaskRCNN", "dlrm_s_pytorch.py": "DLRM",
    "efficientNet_cifar100.py": "efficientnet_b0_cifar", "resnet18_cifar100.py": "resnet18",
    "resnet34_cifar100.py": "resnet34", "mobilenet_cifar100.py": "mobilenetv3_small",
}
HEADER = "job_id,submit_s,gpus,model,batch,duration_s,mem_gib"


def _show(git_dir: str, path: str) -> str:
    return subprocess.run(["git", f"--git-dir={git_dir}", "show", f"HEAD:{path}"], check=True,
                          capture_output=True, text=True).stdout


def task_row(git_dir: str, rad: str) -> tuple[str, int | None, int | None, int, float]:
    """(model, batch or None for the table's only row, epochs or None for the table's, GPUs, peak GB)."""
    lines = _show(git_dir, f"workloads/{rad}").splitlines()
    command = lines[2]
    script = next(Path(w).name for w in command.split() if w.endswith(".py"))
    model = SCRIPTS[script]
    batch = re.search(r"--batch_size (\d+)", command)
    epochs = re.search(r"--epochs (\d+)", command)
    # lines after the command: model file, dataset, batch, mode, GPUs, peak MB, ...
    gpus, peak_mb = int(lines[7]), float(lines[8])
    return model, int(batch.group(1)) if batch else None, int(epochs.group(1)) if epochs else None, gpus, peak_mb


def derive(git_dir: str, trace: int) -> list[str]:
    from gpushare.simulator import workload

    rows, clock, n = [], 0.0, 0
    for line in _show(git_dir, TRACES[trace]).splitlines():
        if line.startswith("sleep "):
            clock += float(line.split()[1])
        elif "--task" in line:
            rad = Path(line.split("--task")[1].strip()).name
            model, batch, epochs, gpus, peak_mb = task_row(git_dir, rad)
            row = workload.lookup(model, batch)
            solo = row.solo_seconds(epochs if epochs is not None else row.epochs[0])
            n += 1
            rows.append(f"t{trace}-{n:02d}-{rad.removesuffix('.rad')},{clock:g},{gpus},{row.model},{row.batch},"
                        f"{solo:.0f},{peak_mb / 1000:.2f}")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--git-dir", required=True, help="bare git mirror of github.com/itu-rad/CARMA")
    ap.add_argument("--out", default="simulator/data")
    args = ap.parse_args()
    rev = subprocess.run(["git", f"--git-dir={args.git_dir}", "rev-parse", "HEAD"], check=True,
                         capture_output=True, text=True).stdout.strip()
    for trace in TRACES:
        rows = derive(args.git_dir, trace)
        path = Path(args.out) / f"carma_trace{trace}.csv"
        path.write_text(f"# CARMA evaluation trace {trace}: {TRACES[trace]} at github.com/itu-rad/CARMA {rev}\n"
                        f"# (Apache-2.0); derived by benchmarks/carma_traces.py\n{HEADER}\n" + "\n".join(rows) + "\n")
        print(f"wrote {path}: {len(rows)} tasks, last arrival {float(rows[-1].split(',')[1]) / 3600:.2f} h")


if __name__ == "__main__":
    main()
