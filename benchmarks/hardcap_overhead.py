"""Time one cuMemAlloc_v2 + cuMemFree_v2 pair through the hard cap shim against the same pair unwrapped.

Both run over the tests' fake driver (tests/hardcap/fake_cuda.c: device memory in a shared file), reached
with dlopen + dlsym as the CUDA runtime does, in a C loop (no Python in the timed path). "wrapped" runs with
the shim preloaded and an active budget (job cgroup + root-owned limits file, as the Prolog would leave
them; the shim's testing build reads their places from the environment), so every pair pays the shim's
charge, pointer table and uncharge. The sample is the median over --batches of the mean ns per pair over a
batch of --pairs. Goal: the shim adds at most 200 ns per pair. Needs gcc and root (the limits file must be
root-owned).

    sudo .venv/bin/python benchmarks/hardcap_overhead.py --batches 200 --pairs 20000
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

BENCH_C = r"""
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
typedef int (*alloc_t)(unsigned long long *, size_t);
typedef int (*free_t)(unsigned long long);
int main(int argc, char **argv) {
    int batches = atoi(argv[1]), pairs = atoi(argv[2]);
    void *h = dlopen("libcuda.so.1", RTLD_NOW);
    alloc_t a = (alloc_t)dlsym(h, "cuMemAlloc_v2");
    free_t f = (free_t)dlsym(h, "cuMemFree_v2");
    unsigned long long p;
    for (int i = 0; i < 1000; i++) { a(&p, 4096); f(p); }
    for (int b = 0; b < batches; b++) {
        struct timespec t0, t1;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        for (int i = 0; i < pairs; i++) { if (a(&p, 4096)) return 1; f(p); }
        clock_gettime(CLOCK_MONOTONIC, &t1);
        printf("%.1f\n", ((t1.tv_sec - t0.tv_sec) * 1e9 + (t1.tv_nsec - t0.tv_nsec)) / pairs);
    }
    return 0;
}
"""


def build(d: Path) -> None:
    """The fake driver, the shim (testing build) and the timing loop, into ``d``."""
    (d / "driver").mkdir()
    (d / "bench.c").write_text(BENCH_C)
    cc = ["gcc", "-O2"]
    subprocess.run(cc + ["-fPIC", "-shared", "-o", str(d / "driver/libcuda.so.1"), str(ROOT / "tests/hardcap/fake_cuda.c")], check=True)
    subprocess.run(cc + ["-DHARDCAP_TESTING", "-fPIC", "-shared", "-o", str(d / "libshim.so"),
                         str(ROOT / "gres/hardcap/hardcap.c"), "-ldl", "-lpthread"], check=True)
    subprocess.run(cc + ["-o", str(d / "bench"), str(d / "bench.c"), "-ldl"], check=True)


def run(d: Path, wrapped: bool, batches: int, pairs: int) -> list[float]:
    """Per-batch mean ns per alloc+free pair."""
    env = dict(os.environ, FAKE_CUDA_MEM=str(d / "devmem"), FAKE_CUDA_TOTAL=str(1 << 40), LD_LIBRARY_PATH=str(d / "driver"))
    env.pop("LD_PRELOAD", None)
    if wrapped:
        env.update(LD_PRELOAD=str(d / "libshim.so"), GPUSHARE_HARDCAP_DIR=str(d / "limits"), GPUSHARE_HARDCAP_CGROUP=str(d / "cgroup"))
    out = subprocess.run([str(d / "bench"), str(batches), str(pairs)], env=env, capture_output=True, text=True, check=True)
    if wrapped and out.stderr:
        sys.exit(f"the shim is not active: {out.stderr.strip()}")
    return [float(x) for x in out.stdout.split()]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=200)
    ap.add_argument("--pairs", type=int, default=20000)
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("run as root: the shim uses only a root-owned limits file")
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        build(d)
        (d / "limits/job_1").mkdir(parents=True)
        (d / "limits/job_1/gpu0").write_text(f"{1 << 39} 0\n")
        os.chmod(d / "limits/job_1/gpu0", 0o644)
        (d / "cgroup").write_text("0::/system.slice/slurmstepd.scope/job_1/step_0/user/task_0\n")
        plain = run(d, False, args.batches, args.pairs)
        shim = run(d, True, args.batches, args.pairs)
        plain2 = run(d, False, args.batches, args.pairs)  # again, so drift on a loaded machine shows
    p, s, p2 = statistics.median(plain), statistics.median(shim), statistics.median(plain2)
    print(f"unwrapped: median {p:.1f} ns per alloc+free (again after: {p2:.1f})")
    print(f"shim:      median {s:.1f} ns per alloc+free")
    print(f"overhead:  {s - (p + p2) / 2:.1f} ns per pair (goal <= 200)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
