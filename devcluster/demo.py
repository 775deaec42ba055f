"""``make demo``: estimate a training script on the CPU, then submit it with plain sbatch to a real local
Slurm with simulated GPUs and show what the job_submit hook did.

Why this demo: it is the researcher's whole path in one screen — ``gpu-estimate`` on a login node with
no GPU, ``sbatch --gres=gpu:1`` as always, and the job landing on a right-sized shard of a GPU.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from devcluster.local_cluster import LocalCluster, missing_requirements
from devcluster.slurm_runtime import ENV_VAR, VERSIONS, requested_version
from gpushare.slurm_plugins.decision import parse_record

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
EXAMPLE = REPO / "examples" / "resnet50_train.py"
EXAMPLE_ARGS = ["--batch-size", "64"]

BATCH_SCRIPT = """#!/bin/bash
#SBATCH --job-name=resnet50
#SBATCH --gres=gpu:1
#GPUSHARE estimate=estimate.json
echo "job $SLURM_JOB_ID on $(hostname): CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES SLURM_SHARDS_ON_NODE=${SLURM_SHARDS_ON_NODE:-none}"
"""


def banner(text: str) -> None:
    print(f"\n\033[1m== {text}\033[0m" if sys.stdout.isatty() else f"\n== {text}", flush=True)


def show_job(cluster: LocalCluster, job_id: int, work: Path) -> None:
    record = cluster.wait_job(job_id)
    ours = parse_record(record.admin_comment) or {}
    print(f"JobState={record.state}  TresPerNode={record.tres_per_node}")
    estimate = f" estimate={ours['est_gib']} GiB ({ours.get('src')})" if "est_gib" in ours else ""
    print(f"AdminComment: decision={ours.get('decision')}{estimate} {ours.get('old')} -> "
          f"{ours.get('new', ours.get('old'))}: {ours.get('why')}")
    out = work / f"slurm-{job_id}.out"
    if out.exists():
        print("job output:", out.read_text().strip())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpushare.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--slurm", choices=VERSIONS, default=requested_version(),
                        help=f"Slurm version to run (default: ${ENV_VAR}, else the host's)")
    version = parser.parse_args(argv).slurm
    problem = missing_requirements(version)
    if problem:
        print(f"demo: cannot start a local Slurm here: {problem}", file=sys.stderr)
        return 1
    base = Path(tempfile.mkdtemp(prefix="gpushare-demo-"))
    work = base / "work"
    work.mkdir()
    targets = ["--gpu", "a100-40gb", "--gpu", "a100-40gb:3g.20gb", "--gpu", "h100-80gb"]
    banner(f"gpu-estimate {' '.join(targets)} {EXAMPLE.relative_to(REPO)} {' '.join(EXAMPLE_ARGS)}   (CPU only)")
    estimate = subprocess.run([str(BIN / "gpu-estimate"), *targets, str(EXAMPLE), *EXAMPLE_ARGS], cwd=work)
    if estimate.returncode != 0:
        print("demo: gpu-estimate failed", file=sys.stderr)
        return estimate.returncode
    with open(work / "estimate.json", "w") as handle:  # same run again: served from the estimate cache
        subprocess.run([str(BIN / "gpu-estimate"), *targets, "--json", str(EXAMPLE), *EXAMPLE_ARGS],
                       cwd=work, stdout=handle, check=True)

    banner(f"starting a local Slurm {version}: 1 node, 2 simulated A100-40GB (80 shards of 1 GiB), our hook")
    cluster = LocalCluster(base / "cluster", bin_dir=str(BIN), slurm_version=version)
    try:
        cluster.start()
        (work / "train.sbatch").write_text(BATCH_SCRIPT)
        env = {**os.environ, **cluster.env}
        banner("sbatch train.sbatch   (the script asks for --gres=gpu:1 and names the estimate)")
        result = subprocess.run(["sbatch", "train.sbatch"], cwd=work, env=env, capture_output=True, text=True)
        print(result.stdout.strip())
        print(result.stderr.strip())
        job_id = int(result.stdout.split()[-1])
        show_job(cluster, job_id, work)

        banner("sbatch --gres=gpu:1 without an estimate")
        (work / "plain.sbatch").write_text("#!/bin/bash\necho CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES\n")
        result = subprocess.run(["sbatch", "--gres=gpu:1", "plain.sbatch"], cwd=work, env=env,
                                capture_output=True, text=True)
        print(result.stdout.strip())
        print(result.stderr.strip())
        show_job(cluster, int(result.stdout.split()[-1]), work)
    finally:
        cluster.stop()
    banner(f"done; files and Slurm logs are in {base}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
