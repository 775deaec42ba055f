"""``make demo``: estimate a training script on the CPU, then submit it with plain sbatch to a real Slurm
with simulated GPUs and show what the job_submit hook did, and which host did what.

Why this demo: it is the researcher's whole path in one screen — ``gpu-estimate`` on a login node with
no GPU, ``sbatch --gres=gpu:1`` as always, and the job landing on a right-sized shard of a GPU. It runs on
the multi-host cluster (devcluster/multihost.py): the login host, the controller and the GPU node are hosts
of their own, the user's home is 0700, and the estimate travels inside the batch script.
"""

from __future__ import annotations

import argparse
import re
import signal
import sys
import tempfile
from pathlib import Path

from devcluster.local_cluster import ClusterError
from devcluster.multihost import MultiHostCluster
from devcluster.slurm_runtime import ENV_VAR, VERSIONS, missing_requirements, requested_version
from gpushare.slurm_plugins.decision import parse_record

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
EXAMPLE = REPO / "examples" / "resnet50_train.py"
EXAMPLE_ARGS = ["--batch-size", "64"]
USER = "gpushare-alice"

BATCH_SCRIPT = """#!/bin/bash
#SBATCH --job-name=resnet50
#SBATCH --gres=gpu:1
#SBATCH --output=/tmp/slurm-%j.out
echo "job $SLURM_JOB_ID on $(hostname): CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES SLURM_SHARDS_ON_NODE=${SLURM_SHARDS_ON_NODE:-none}"
"""


def banner(text: str) -> None:
    print(f"\n\033[1m== {text}\033[0m" if sys.stdout.isatty() else f"\n== {text}", flush=True)


def failure(returncode: int, stdout: str, stderr: str) -> str:
    """Why a command failed, in one paragraph, even when it printed nothing: a status above 128 is the
    shell's way of saying a signal ended it (SIGKILL from the kernel's OOM killer is the usual one)."""
    status = f"exit {returncode}"
    code = 256 - returncode if returncode > 128 + 64 else returncode - 128 if returncode > 128 else -returncode
    if code > 0:
        try:
            status += f" ({signal.Signals(code).name}: killed; out of memory or a time limit?)"
        except ValueError:
            pass
    tail = (stderr.strip() or stdout.strip())[-1000:]
    return f"{status}; {tail}" if tail else f"{status}; it printed nothing"


def show_job(cluster: MultiHostCluster, job_id: int) -> None:
    record = cluster.wait_job(job_id)
    ours = parse_record(record.admin_comment) or {}
    print(f"JobState={record.state}  TresPerNode={record.tres_per_node}  on host {record.batch_host}")
    estimate = f" estimate={ours['est_gib']} GiB ({ours.get('src')})" if "est_gib" in ours else ""
    print(f"AdminComment (written on ctl by gpushare-submitd): decision={ours.get('decision')}{estimate} "
          f"{ours.get('old')} -> {ours.get('new', ours.get('old'))}: {ours.get('why')}")
    out = cluster.path_on(record.batch_host, f"/tmp/slurm-{job_id}.out")
    if out.exists():
        print(f"job output, in {record.batch_host}:/tmp:", out.read_text().strip())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m devcluster.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--slurm", choices=VERSIONS, default=requested_version(),
                        help=f"Slurm version to run (default: ${ENV_VAR}, else the host's)")
    version = parser.parse_args(argv).slurm
    problem = missing_requirements(version)
    if problem:
        print(f"demo: cannot start a local Slurm here: {problem}", file=sys.stderr)
        return 1
    base = Path(tempfile.mkdtemp(prefix="gpushare-demo-"))
    cluster = MultiHostCluster(base, slurm_version=version, toml_extra='[estimation]\npartition = "cpu"\n')
    banner(f"starting Slurm {version} on {len(cluster.hosts)} hosts: "
           + ", ".join(f"{h.name} ({'/'.join(h.roles)}{', configless' if h.configless else ''})" for h in cluster.hosts))
    try:
        cluster.start()
        cluster.write_as(USER, "train.py", EXAMPLE.read_text())
        cluster.write_as(USER, "train.sbatch", BATCH_SCRIPT)
        targets = ["--gpu", "a100-40gb", "--gpu", "a100-40gb:3g.20gb", "--gpu", "h100-80gb"]
        command = ["gpu-estimate", *targets, "--annotate", "train.py", *EXAMPLE_ARGS, "--", "train.sbatch"]
        banner(f"{USER}@login: {' '.join(command)}   (CPU only; the estimate goes into the script, then sbatch)")
        done = cluster.run("login", command, user=USER, cwd=f"/home/{USER}", check=False, timeout_s=600)
        print(done.stderr.strip())
        print(done.stdout.strip())
        if done.returncode != 0:
            print(f"demo: gpu-estimate failed: {failure(done.returncode, done.stdout, done.stderr)}", file=sys.stderr)
            return done.returncode
        show_job(cluster, int(re.findall(r"Submitted batch job (\d+)", done.stdout + done.stderr)[-1]))

        banner(f"{USER}@login: sbatch --gres=gpu:1 plain.sbatch   (no estimate, no training command to estimate)")
        plain = "#!/bin/bash\n#SBATCH --output=/tmp/slurm-%j.out\necho \"on $(hostname): CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES\"\n"
        try:
            job_id = cluster.sbatch("login", USER, plain, "--gres=gpu:1")
        except ClusterError as exc:
            print(f"demo: sbatch failed: {exc}", file=sys.stderr)
            return 1
        print(f"Submitted batch job {job_id}")
        show_job(cluster, job_id)
    finally:
        cluster.stop()
    banner(f"done; each host's files and Slurm logs are in {base}/hosts/<host>/fs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
