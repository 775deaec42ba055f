"""Estimation time with the user's interpreter (``gpu-estimate --python``) against gpu-estimate's own, same script.

Interpreters, each a fresh process per estimate (``--no-warm``: under ``--python`` the capture never uses the
warm worker, so the fair baseline is gpu-estimate's own cold child):
- *own*: gpu-estimate's interpreter (this project's venv, PyTorch 2.13 CPU build);
- *venv, same torch*: a venv made from Debian's Python that reaches the same PyTorch through a ``.pth`` line
  (what changes is only the interpreter and the capture code's path: the cost of ``--python`` itself);
- *PyTorch 2.4.1*, *PyTorch 2.14.1*: the cached venvs ``make python-envs`` builds (the CUDA builds
  `pip install torch` gives, imported without a GPU), when present.
Scripts:
``examples/resnet50_train.py --batch-size 32`` and ``examples/gpt2_train.py --preset gpt2-small --seq-len 256``,
fake mode, target a100-80gb, no cache. Wall time of the whole ``gpu-estimate`` process and its CPU time (user +
system of it and its child, which a loaded machine inflates less), medians of ``--repeats``; the estimates of
all interpreters are printed (peak_total, bytes) to show they are equal.

    python benchmarks/foreign_python.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = [
    ("ResNet-50", os.path.join(ROOT, "examples", "resnet50_train.py"), ["--batch-size", "32"]),
    ("GPT-2 small", os.path.join(ROOT, "examples", "gpt2_train.py"), ["--preset", "gpt2-small", "--seq-len", "256"]),
]
PYTHON_ENVS = os.environ.get("GPUSHARE_PYTHON_ENVS", "/var/cache/gpushare/python-envs")
OTHER_TORCH = ["2.4.1", "2.14.1"]  # the cached venvs of `make python-envs`


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


class Unsupported(Exception):
    """Fake mode cannot capture the script under this PyTorch (gpu-estimate exit 5)."""


def one_run(script: str, args: list[str], extra: list[str]) -> tuple[float, float, int]:
    cmd = [sys.executable, "-m", "gpushare.estimator_cli.cli", "--json", "--no-cache", "--mode", "fake",
           "--gpu", "a100-80gb", *extra, script, *args]
    start, cpu = time.monotonic(), _children_cpu()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=ROOT)
    wall, cpu = time.monotonic() - start, _children_cpu() - cpu
    if proc.returncode == 5:
        raise Unsupported(proc.stderr.split(":", 2)[-1].strip()[:70])
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(extra) or 'own'}: exit {proc.returncode}: {proc.stderr.strip()[-300:]}")
    return wall, cpu, json.loads(proc.stdout)["targets"][0]["peak_total_bytes"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="foreign-python-") as tmp:
        venv = os.path.join(tmp, "venv")
        subprocess.run(["/usr/bin/python3", "-m", "venv", "--without-pip", venv], check=True)
        site = subprocess.run([os.path.join(venv, "bin", "python"), "-c", "import sysconfig; print(sysconfig.get_paths()"
                               "['purelib'])"], capture_output=True, text=True, check=True).stdout.strip()
        with open(os.path.join(site, "borrowed_torch.pth"), "w", encoding="utf-8") as handle:
            handle.write(sysconfig.get_paths()["purelib"] + "\n")
        runs = [("own, cold", ["--no-warm"]), ("venv, same torch", ["--python", os.path.join(venv, "bin", "python")])]
        for version in OTHER_TORCH:
            python = os.path.join(PYTHON_ENVS, f"torch-{version}", "bin", "python")
            if os.path.exists(python):
                runs.append((f"PyTorch {version}", ["--python", python]))
        print(f"{'script':<12} {'interpreter':<18} {'wall s':>7} {'min s':>6} {'/own':>6} {'CPU s':>6} {'/own':>6}"
              "  peak_total")
        for name, script, args in CASES:
            base_wall = base_cpu = 0.0
            for label, extra in runs:
                walls, cpus, peaks = [], [], set()
                try:
                    for _ in range(opts.repeats):
                        wall, cpu, peak = one_run(script, args, extra)
                        walls.append(wall)
                        cpus.append(cpu)
                        peaks.add(peak)
                except Unsupported as exc:
                    print(f"{name:<12} {label:<18} fake mode unsupported: {exc}", flush=True)
                    continue
                wall, cpu = statistics.median(walls), statistics.median(cpus)
                base_wall, base_cpu = base_wall or wall, base_cpu or cpu
                print(f"{name:<12} {label:<18} {wall:>7.2f} {min(walls):>6.2f} {wall / base_wall:>5.2f}x {cpu:>6.2f} "
                      f"{cpu / base_cpu:>5.2f}x  {sorted(peaks)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
