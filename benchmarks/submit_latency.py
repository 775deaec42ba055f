"""Submit latency added by the job_submit hook, measured on two real local Slurm clusters in one run.

Both clusters run on this host at the same time; submissions alternate between them so machine noise
hits both equally. "plain" has no JobSubmitPlugins; "hook" runs our job_submit.lua → gpushare-submitd.
Each sample is one `sbatch --hold` of a GPU job carrying a `#GPUSHARE mem=` directive (the path that
does the most work). Also measured: the service's own round trip over its unix socket from Python.

    sudo python benchmarks/submit_latency.py --jobs 300
"""

from __future__ import annotations

import argparse
import socket
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from devcluster.local_cluster import LocalCluster, missing_requirements
from gpushare.slurm_plugins.protocol import encode_request

SCRIPT = "#!/bin/bash\n#GPUSHARE mem=6G\nsrun python train.py\n"


def sbatch_seconds(cluster: LocalCluster) -> float:
    started = time.perf_counter()
    subprocess.run(["sbatch", "--hold", "--parsable", "--gres=gpu:1", "-o", "/dev/null"], input=SCRIPT,
                   text=True, capture_output=True, env=cluster.env, check=True)
    return time.perf_counter() - started


def service_round_trip(path: Path, n: int) -> list[float]:
    request = encode_request({"op": "submit", "user_id": 0, "tres_per_node": "gres:gpu:1", "script": SCRIPT})
    samples = []
    for _ in range(n):
        started = time.perf_counter()
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.connect(str(path))
            sock.sendall(request)
            data = b""
            while not data.endswith(b"end\n"):
                chunk = sock.recv(4096)
                if not chunk:
                    break
                data += chunk
        samples.append(time.perf_counter() - started)
    return samples


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=300)
    args = parser.parse_args()
    problem = missing_requirements()
    if problem:
        print(f"cannot run: {problem}")
        return 1
    base = Path(tempfile.mkdtemp(prefix="gpushare-bench-"))
    plain = LocalCluster(base / "plain", with_hook=False, with_submitd=False)
    hook = LocalCluster(base / "hook")
    try:
        plain.start()
        hook.start()
        for cluster in (plain, hook):  # warm-up
            for _ in range(10):
                sbatch_seconds(cluster)
        times: dict[str, list[float]] = {"plain": [], "hook": []}
        for _ in range(args.jobs):
            times["plain"].append(sbatch_seconds(plain))
            times["hook"].append(sbatch_seconds(hook))
        service = service_round_trip(hook.submitd_socket, args.jobs)
    finally:
        plain.stop()
        hook.stop()
    print(f"sbatch --hold of a GPU job, {args.jobs} submissions each, alternating (ms)")
    print(f"{'':8}{'median':>9}{'p99':>9}")
    for name, values in times.items():
        print(f"{name:8}{statistics.median(values) * 1e3:9.2f}{pct(values, 0.99) * 1e3:9.2f}")
    added_median = (statistics.median(times["hook"]) - statistics.median(times["plain"])) * 1e3
    added_p99 = (pct(times["hook"], 0.99) - pct(times["plain"], 0.99)) * 1e3
    print(f"added by the hook: median {added_median:+.2f} ms, p99 {added_p99:+.2f} ms; "
          f"ratio hook/plain median {statistics.median(times['hook']) / statistics.median(times['plain']):.3f}")
    print(f"service round trip alone (Python client): median {statistics.median(service) * 1e3:.3f} ms, "
          f"p99 {pct(service, 0.99) * 1e3:.3f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
