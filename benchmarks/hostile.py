"""Hostile input and load, measured against the real gpushare-submitd process (no Slurm needed).

1. A corpus of hostile batch scripts (expansion bombs, 64 KiB of short lines, NULs, one huge line,
   continuation chains, directive spam) sent through the service's socket with asynchronous estimation
   on (so training-command discovery runs): time per request and the service's peak RSS.
2. Asynchronous estimation parsing a 30,000-job ``squeue --json`` (a stand-in ``squeue`` printing a
   22.05-shaped queue) continuously in its own process, while submit requests are timed.

    python benchmarks/hostile.py [--requests 400] [--queue-jobs 30000]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gpushare.slurm_plugins.protocol import encode_request


def corpus() -> list[tuple[str, str]]:
    """(name, batch script) pairs, each at most 64 KiB, each built to cost the service as much as it can."""
    bomb_var = "x" * 30000
    return [
        ("expansion bomb, one line", f"#!/bin/sh\nA={bomb_var}\npython t.py " + "$A" * 4000 + "\n"),
        ("expansion bomb, 62 KB line", f"#!/bin/sh\nA={bomb_var}\npython t.py " + "$A" * 16000 + "\n"),
        ("expansion bomb, many words", "#!/bin/sh\nA=" + "y" * 4000 + "\npython t.py " + "$A " * 2000 + "\n"),
        ("64 KiB of short lines", "#!/bin/sh\n" + "a\n" * 32700),
        ("64 KiB of python lines", "#!/bin/sh\n" + "python t.py\n" * 5400),
        ("NULs", "#!/bin/sh\n" + "\x00" * 65000),
        ("one huge line", "#!/bin/sh\npython t.py " + "z" * 65000 + "\n"),
        ("continuation chain", "#!/bin/sh\n" + "python t.py \\\n" * 4600),
        ("unbalanced quotes", "#!/bin/sh\n" + "python t.py 'a \"b\n" * 3000),
        ("directive spam", "#!/bin/sh\n" + "#GPUSHARE mem=1G\n" * 3800),
    ]


def _fake_slurm_bin(directory: Path, queue_jobs: int) -> Path:
    """``sinfo --version`` and ``squeue --json`` stand-ins; squeue prints a queue of ``queue_jobs``."""
    directory.mkdir(parents=True, exist_ok=True)
    jobs = [{"job_id": 100000 + i, "name": f"job{i}", "user_id": 1000 + i % 50, "group_id": 1000,
             "job_state": "PENDING", "state_reason": "Priority", "priority": 1000 + i, "nice": 0,
             "submit_time": 1_700_000_000 + i, "partition": "gpu", "tres_per_node": "gres:shard:4",
             "admin_comment": 'gpushare:{"decision":"shared","v":1}', "work_dir": "/home/u", "command": "/home/u/x.sh",
             "standard_output": "/home/u/out-%j.txt", "standard_error": "", "nodes": "", "batch_host": "",
             "restart_cnt": 0, "requeue": True, "exit_code": 0, "features": "", "comment": "x" * 40}
            for i in range(queue_jobs)]
    (directory / "queue.json").write_text(json.dumps({"jobs": jobs}))
    (directory / "sinfo").write_text("#!/bin/sh\necho 'slurm-wlm 22.05.8'\n")
    (directory / "squeue").write_text(f"#!/bin/sh\nexec cat '{directory / 'queue.json'}'\n")
    (directory / "scontrol").write_text("#!/bin/sh\nexit 1\n")
    for name in ("sinfo", "squeue", "scontrol"):
        os.chmod(directory / name, 0o755)
    return directory


def start_service(base: Path, queue_jobs: int, poll_s: float = 0.1) -> tuple[subprocess.Popen[bytes], Path]:
    """The real gpushare-submitd with asynchronous estimation on, against the stand-in Slurm tools."""
    bin_dir = _fake_slurm_bin(base / "bin", queue_jobs)
    config = base / "gpushare.toml"
    sock = base / "submitd.sock"
    config.write_text(
        f'version = 1\n[policy]\nwithout_estimate = "async"\n'
        f'[submit]\nsocket = "{sock}"\ncache_dir = "{base}/cache"\nlog_file = "{base}/submitd.log"\n'
        f'[estimation]\npartition = "cpu"\npoll_s = {poll_s}\nspool_dir = "{base}/spool"\n'
        f'[oom]\nledger_dir = "{base}/ledger"\n[slurm]\nbin_dir = "{bin_dir}"\n'
        '[[nodes]]\nnames = "n1"\ngpu = "a100-40gb"\ncount = 2\n')
    executable = os.path.join(os.path.dirname(sys.executable), "gpushare-submitd")
    proc = subprocess.Popen([executable, "--config", str(config), "--log-level", "WARNING"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while not sock.exists():
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            raise RuntimeError(f"gpushare-submitd did not start; see {base}/submitd.log")
        time.sleep(0.05)
    return proc, sock


def ask(sock: Path, script: str, timeout_s: float = 5.0) -> float:
    """One submit request (a GPU job with this batch script); seconds until the full reply."""
    request = encode_request({"op": "submit", "user_id": 1000, "tres_per_node": "gres:gpu:1",
                              "work_dir": "/tmp", "name": "bench", "script": script})
    started = time.perf_counter()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(timeout_s)
        conn.connect(str(sock))
        conn.sendall(request)
        reply = b""
        while not reply.endswith(b"end\n"):
            chunk = conn.recv(65536)
            if not chunk:
                break
            reply += chunk
    return time.perf_counter() - started


def rss_kib(pid: int, field: str = "VmHWM") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def measure_corpus(base: Path, repeat: int = 3) -> list[dict[str, float | str]]:
    """Each hostile script ``repeat`` times through the service: worst ms, and the service's peak RSS."""
    proc, sock = start_service(base, queue_jobs=0, poll_s=5.0)
    try:
        ask(sock, "#!/bin/sh\npython train.py\n")
        rows = []
        for name, script in corpus():
            worst = max(ask(sock, script) for _ in range(repeat))
            rows.append({"script": name, "bytes": len(script.encode()), "worst_ms": round(worst * 1000, 2),
                         "service_peak_rss_mib": round(rss_kib(proc.pid) / 1024, 1)})
        return rows
    finally:
        proc.terminate()
        proc.wait(10)


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def measure_async_parse(base: Path, requests: int, queue_jobs: int) -> dict[str, float]:
    """Submit latency while the estimation process parses a ``queue_jobs``-job queue every round."""
    proc, sock = start_service(base, queue_jobs=queue_jobs, poll_s=0.1)
    script = "#!/bin/sh\n#GPUSHARE mem=6G\npython train.py --bs 64\n"
    try:
        time.sleep(2.0)  # the estimation process is now parsing the queue round after round
        samples = []
        for _ in range(requests):
            samples.append(ask(sock, script))
            time.sleep(0.005)
        child_cpu = _children_cpu_s(proc.pid)
        return {"requests": requests, "queue_jobs": queue_jobs, "p50_ms": round(statistics.median(samples) * 1000, 2),
                "p99_ms": round(percentile(samples, 0.99) * 1000, 2), "max_ms": round(max(samples) * 1000, 2),
                "estimation_process_cpu_s": round(child_cpu, 1)}
    finally:
        proc.terminate()
        proc.wait(10)


def _children_cpu_s(pid: int) -> float:
    total = 0.0
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return 0.0
    for child in children:
        fields = Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--queue-jobs", type=int, default=30000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="gpushare-hostile-") as tmp:
        print("hostile scripts through gpushare-submitd (asynchronous estimation on):")
        for row in measure_corpus(Path(tmp) / "corpus"):
            print(f"  {row['script']:<28} {row['bytes']:>6} B  worst {row['worst_ms']:>7.2f} ms  "
                  f"service peak RSS {row['service_peak_rss_mib']:.1f} MiB")
        result = measure_async_parse(Path(tmp) / "async", args.requests, args.queue_jobs)
        print(f"submit latency while the estimation process parses a {result['queue_jobs']}-job queue: "
              f"p50 {result['p50_ms']} ms, p99 {result['p99_ms']} ms, max {result['max_ms']} ms "
              f"over {result['requests']} requests (estimation process CPU {result['estimation_process_cpu_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
