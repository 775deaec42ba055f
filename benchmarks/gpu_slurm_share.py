"""Two users' jobs on one real GPU under a real Slurm: shards, framework caps, NVML in the agent, the backstop.

The single-host test cluster (devcluster.local_cluster) runs Slurm 24.11 from a packed Debian chroot on a
GPU machine that has no Slurm, no munge and no package registry. One node, one GPU (gres.conf
``File=/dev/nvidia0`` with its shards), the node agent on the real NVML backend with framework caps
(``collocation = "fraction"``) and the memory backstop live. Two ordinary users each submit one job with a
``#GPUSHARE mem=4G`` estimate on ``--gres=gpu:1``, which the job_submit hook turns into a ``shard:`` request:

- the neighbour holds 3000 MiB and multiplies matrices for 25 s, inside its share;
- the offender lifts its own framework cap (drops PYTORCH_CUDA_ALLOC_CONF before importing torch) and grows
  by 1 GiB/s past its 5 GiB share; the agent's backstop stops it, OOM recovery re-runs it on the whole GPU,
  where it runs steadily and completes.

Written under ``--out`` (default ``$OUT``): ``gpu_slurm_share.json`` (every step with its time, where each
job ran, the caps in its environment, the agent's per-job NVML peaks, the backstop's verdict and action, the
neighbour's completion), ``gpu_slurm_share.txt`` (the same for a person) and ``gpu_slurm_share-logs.tar.gz``
(daemon, hook, agent and job logs). It stops at the first step that fails, with one line
``FAILED at step <name>: <why>`` and exit status 1; the summary then says which step blocked.

    python benchmarks/gpu_slurm_share.py pack            # here: build/gpu-carry/slurm-24.11.tar.xz
    python benchmarks/gpu_slurm_share.py run [--sim]     # there (as root): the two jobs

``--sim`` runs the same steps on a machine without a GPU: the simulated backend (an H100 80GB state file)
instead of NVML, the packed chroot unpacked into a temporary cache, tests/agent/simjob.py instead of the
torch job. Only the real-GPU parts (driver libraries in the chroot, NVML, CUDA in the jobs) are left untried.
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import time
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
# devcluster/ is not installed. Appended, not first: the repository's own gpushare/ folder holds only part of the
# installed package (pyproject maps gres/, agent/ ... into it), which `run` installs first where it is missing.
sys.path.append(str(REPO))

VERSION = "24.11"
DEFAULT_CARRY = REPO / "build" / "gpu-carry"
TARBALL = f"slurm-{VERSION}.tar.xz"
USERS = ("gpushare-a", "gpushare-b")  # the neighbour's and the offender's owners
EST = "4G"  # each job's estimate; its share is the estimate plus the 1 GiB margin: 5 GiB
GiB = 1 << 30
# Left out of the packed chroot: documentation, translations, apt's lists and caches, and what a cluster
# start adds for the packing host's interpreter (prepare_runtime adds the target's own again).
PACK_EXCLUDES = ("./var/lib/apt/lists", "./var/cache/apt", "./usr/share/locale", "./usr/share/man",
                 "./usr/share/doc", "./usr/share/info", "./usr/share/lintian", "./usr/share/zsh",
                 "./usr/share/bash-completion", "./usr/lib/locale", "./usr/local/lib/gpushare-host",
                 "./etc/ld.so.conf.d/gpushare-host.conf", "./work", "./check", "./tmp/*", "./proc/*", "./sys/*",
                 "./var/log/*")
# The driver's user-space libraries a job's CUDA and the agent's NVML load (copied into the chroot).
DRIVER_LIBS = ("libcuda.so*", "libnvidia-ml.so*", "libnvidia-ptxjitcompiler.so*", "libnvidia-nvvm.so*",
               "libnvidia-gpucomp.so*", "libcudadebugger.so*")

# The torch job, written beside the jobs' outputs (readable by both users wherever the repository lies).
TORCH_JOB = r'''
import argparse, json, os, sys, time
p = argparse.ArgumentParser()
p.add_argument("--mem-mib", type=float, default=3000)
p.add_argument("--seconds", type=float, default=20)
p.add_argument("--grow-mib-per-s", type=float, default=0.0)
p.add_argument("--ignore-cap", action="store_true")
a = p.parse_args()
restarts = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
grow = a.grow_mib_per_s if restarts == 0 else 0.0  # a re-run on the whole GPU runs steadily
lifted = a.ignore_cap and restarts == 0
if lifted:  # the user's own script lifts the framework cap the TaskProlog handed it
    os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)
import torch
if lifted:
    torch.cuda.set_per_process_memory_fraction(1.0)
dev = torch.device("cuda")
held = [torch.empty(int(a.mem_mib * 2**20), dtype=torch.uint8, device=dev)]
x = torch.randn(2048, 2048, device=dev)
print(json.dumps({"job": os.environ.get("SLURM_JOB_ID"), "restarts": restarts, "pid": os.getpid(),
                  "device": torch.cuda.get_device_name(), "cap_lifted": lifted,
                  "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")}), flush=True)
start = last = time.monotonic()
while time.monotonic() - start < a.seconds:
    for _ in range(10):
        y = x @ x
    torch.cuda.synchronize()
    now = time.monotonic()
    if grow:
        held.append(torch.empty(int(grow * (now - last) * 2**20), dtype=torch.uint8, device=dev))
        print(f"t={now - start:.1f}s allocated {torch.cuda.memory_allocated() >> 20} MiB", flush=True)
    last = now
    time.sleep(0.1)
print(json.dumps({"done": True, "max_allocated_mib": torch.cuda.max_memory_allocated() >> 20,
                  "max_reserved_mib": torch.cuda.max_memory_reserved() >> 20}), flush=True)
'''


class StepFailed(Exception):
    pass


class Steps:
    """Each step timed and recorded; the first failure ends the run with one line naming the step."""

    def __init__(self) -> None:
        self.done: list[dict[str, Any]] = []
        self.failed: dict[str, Any] | None = None
        self.t0 = time.monotonic()

    @contextmanager
    def step(self, name: str) -> Iterator[dict[str, Any]]:
        info: dict[str, Any] = {"step": name}
        started = time.monotonic()
        print(f"[{started - self.t0:6.1f}s] {name} ...", flush=True)
        try:
            yield info
        except BaseException as exc:  # noqa: BLE001 - every failure becomes the run's one line
            why = str(exc).strip().splitlines()[0][:400] if str(exc).strip() else type(exc).__name__
            info.update(ok=False, seconds=round(time.monotonic() - started, 1), error=why)
            self.done.append(info)
            self.failed = info
            print(f"FAILED at step {name}: {why}", flush=True)
            raise StepFailed(name) from exc
        info.update(ok=True, seconds=round(time.monotonic() - started, 1))
        self.done.append(info)
        detail = {k: v for k, v in info.items() if k not in ("step", "ok", "seconds")}
        print(f"[{time.monotonic() - self.t0:6.1f}s] {name} ok ({info['seconds']} s) {json.dumps(detail)[:300]}",
              flush=True)


# --- pack (here) -----------------------------------------------------------------------------------------
def pack(carry: Path) -> None:
    """The ready chroot of this host, pruned and xz-compressed, into ``carry``."""
    from devcluster import chroot

    root = chroot.chroot_path(VERSION)
    if not chroot.is_ready(VERSION):
        raise SystemExit(f"no ready Slurm {VERSION} chroot at {root}: python -m devcluster.chroot build {VERSION}")
    carry.mkdir(parents=True, exist_ok=True)
    target = carry / TARBALL
    tmp = target.with_suffix(".tmp")
    excludes = [f"--exclude={e}" for e in PACK_EXCLUDES]
    with open(tmp, "wb") as out:
        tar = subprocess.Popen(["tar", "--numeric-owner", "-C", str(root), "-cf", "-", *excludes, "."],
                               stdout=subprocess.PIPE)
        xz = subprocess.run(["xz", "-T2", "-9"], stdin=tar.stdout, stdout=out)
        assert tar.stdout is not None
        tar.stdout.close()
        if tar.wait() != 0 or xz.returncode != 0:
            raise SystemExit("packing failed (tar or xz)")
    os.rename(tmp, target)
    print(f"{target}: {target.stat().st_size / 2**20:.1f} MiB")


# --- run (there) -----------------------------------------------------------------------------------------
def unpack(tarball: Path, cache: Path) -> Path:
    """The packed chroot at ``cache/VERSION`` (kept when a ready one is already there)."""
    from devcluster import chroot

    os.environ["GPUSHARE_CHROOT_DIR"] = str(cache)
    if chroot.is_ready(VERSION):
        return chroot.chroot_path(VERSION)
    if not tarball.is_file():
        raise RuntimeError(f"{tarball} missing: carry build/gpu-carry (made here by `gpu_slurm_share.py pack`)")
    cache.mkdir(parents=True, exist_ok=True)
    build = Path(tempfile.mkdtemp(prefix=f".unpack-{VERSION}-", dir=cache))
    with tarfile.open(tarball, "r:xz") as tar:
        # our own archive: device nodes, absolute links and owners as packed (3.12 asks for the filter by name)
        trusted: dict[str, Any] = {"filter": "fully_trusted"} if hasattr(tarfile, "fully_trusted_filter") else {}
        tar.extractall(build, numeric_owner=True, **trusted)
    os.chmod(build, 0o755)
    os.rename(build, chroot.chroot_path(VERSION))
    if not chroot.is_ready(VERSION):
        raise RuntimeError(f"unpacked chroot at {chroot.chroot_path(VERSION)} has no valid stamp")
    return chroot.chroot_path(VERSION)


def install_package(bin_dir: Path) -> str:
    """Make ``gpushare`` importable by this interpreter and its console scripts exist in ``bin_dir``.

    Where it is installed already (a development virtualenv) nothing changes. Elsewhere (the GPU machine's
    interpreter) a copy of this repository's package folders, laid out as pyproject's package-dir maps them,
    goes under /tmp (which the chroot sees, and the jobs' users can read wherever the repository lies), a .pth
    file in site-packages points at it, and each console script is a small launcher: no build backend, no
    network, and the code run is this working tree's.
    """
    if (bin_dir / "gpushare-agent").exists() and _imports("gpushare.agent.daemon"):
        return "already installed"
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    tool = project["tool"]["setuptools"]
    dirs: dict[str, str] = tool.get("package-dir", {})
    src = Path("/tmp/gpushare-src")
    shutil.rmtree(src, ignore_errors=True)
    (src / "gpushare").mkdir(parents=True)
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    for package, folder in {"gpushare": "gpushare", **dirs}.items():
        shutil.copytree(REPO / folder, src / Path(*package.split(".")), ignore=skip, dirs_exist_ok=True)
    subprocess.run(["chmod", "-R", "a+rX", str(src)], check=True)
    site = Path(sysconfig.get_paths()["purelib"])
    (site / "gpushare-src.pth").write_text(f"{src}\n")
    for name, target in project["project"]["scripts"].items():
        module, func = target.split(":")
        script = bin_dir / name
        script.write_text(f"#!{sys.executable}\nimport sys\nfrom {module} import {func}\nsys.exit({func}())\n")
        script.chmod(0o755)
    sys.path.insert(0, str(src))  # this process too (.pth files are read at start-up)
    if not _imports("gpushare.agent.daemon"):
        raise RuntimeError(f"gpushare still not importable by {sys.executable} after linking {src}")
    return f"linked {src} via {site / 'gpushare-src.pth'}"


def _imports(module: str) -> bool:
    # from / : in the repository's root its own gpushare/ folder would hide the installed package
    proc = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True, cwd="/")
    return proc.returncode == 0


def gpu_facts() -> dict[str, Any]:
    """The real GPU as NVML reports it, and its catalogue model (which sets the shards and the caps)."""
    import pynvml

    from gpushare.gres.nvml_backend import match_model

    pynvml.nvmlInit()
    count = pynvml.nvmlDeviceGetCount()
    if count < 1:
        raise RuntimeError("NVML sees no GPU")
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    name = pynvml.nvmlDeviceGetName(handle)
    name = name.decode() if isinstance(name, bytes) else str(name)
    driver = pynvml.nvmlSystemGetDriverVersion()
    facts = {"gpus": count, "name": name, "driver": driver.decode() if isinstance(driver, bytes) else driver,
             "memory_mib": pynvml.nvmlDeviceGetMemoryInfo(handle).total >> 20, "model": match_model(name)}
    pynvml.nvmlShutdown()
    if not facts["model"]:
        raise RuntimeError(f"{name!r} matches no GPU in gpushare/gpus.py's catalogue")
    if not os.path.exists("/dev/nvidia0"):
        raise RuntimeError("/dev/nvidia0 does not exist")
    return facts


def driver_into_chroot(root: Path) -> list[str]:
    """Copy the driver's CUDA/NVML libraries into the chroot (a Debian root holds none) and run ldconfig."""
    from devcluster import chroot

    folders = set()
    for soname in ("libcuda.so.1", "libnvidia-ml.so.1"):  # where this process's loader finds them
        try:
            ctypes.CDLL(soname)
        except OSError as exc:
            raise RuntimeError(f"{soname} does not load here: {exc}") from None
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1] if len(line.split()) >= 6 else ""
            if "/libcuda.so" in path or "/libnvidia-ml.so" in path:
                folders.add(os.path.dirname(path))
    if not folders:
        raise RuntimeError("libcuda.so.1 / libnvidia-ml.so.1 loaded but not found in /proc/self/maps")
    target = root / "usr/local/lib/gpushare-nvidia"
    target.mkdir(parents=True, exist_ok=True)
    copied = []
    for folder in sorted(folders):
        for pattern in DRIVER_LIBS:
            for path in glob.glob(os.path.join(folder, pattern)):
                dest = target / os.path.basename(path)
                if os.path.lexists(dest):
                    continue
                if os.path.islink(path) and "/" not in os.readlink(path):
                    os.symlink(os.readlink(path), dest)
                else:
                    shutil.copy2(path, dest)
                copied.append(os.path.basename(path))
    (root / "etc/ld.so.conf.d/gpushare-nvidia.conf").write_text("/usr/local/lib/gpushare-nvidia\n")
    subprocess.run(chroot.ns_argv(root, ["/sbin/ldconfig"]), check=True, capture_output=True,
                   env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"})
    if not any(name.startswith("libnvidia-ml.so") for name in copied + os.listdir(target)):
        raise RuntimeError(f"no libnvidia-ml.so in {sorted(folders)}")
    # the MPS control daemon and server, which the agent starts (inside the chroot) for one user's shared jobs
    search = os.environ.get("PATH", "") + ":/usr/bin:/usr/local/nvidia/bin:/usr/local/cuda/bin"
    for tool in ("nvidia-cuda-mps-control", "nvidia-cuda-mps-server"):
        found = shutil.which(tool, path=search)
        if found and not (root / "usr/bin" / tool).exists():
            shutil.copy2(os.path.realpath(found), root / "usr/bin" / tool)
            copied.append(found)
    return sorted(copied)


def make_cluster_class():  # type: ignore[no-untyped-def]
    from devcluster.local_cluster import LocalCluster
    from gpushare.node.api import AgentUnavailable, call

    class ShareCluster(LocalCluster):
        """LocalCluster with the node agent, and (``real_gpu``) the machine's own /dev/nvidia0 in gres.conf."""

        real_gpu: bool = False
        agent_proc: subprocess.Popen | None = None

        def device_dir(self, node: str) -> Path:
            return Path("/dev") if self.real_gpu else super().device_dir(node)

        @property
        def agent_socket(self) -> Path:
            return Path(self.config().agent.run_dir) / "agent" / "agent.sock"

        def agent_answers(self) -> bool:
            try:
                return bool(call(self.agent_socket, {"op": "ping"}, timeout_s=1.0).get("ok"))
            except AgentUnavailable:
                return False

        def start_agent(self) -> None:
            log = open(self.base / "log" / "agent.out", "ab")
            argv = self.argv([f"{self.bin_dir}/gpushare-agent", "--node", "n1", "--log-level", "DEBUG"])
            self.agent_proc = subprocess.Popen(argv, env=self.env, stdin=subprocess.DEVNULL, stdout=log,
                                               stderr=subprocess.STDOUT, start_new_session=True)
            log.close()
            self._wait(self.agent_answers, 30, "gpushare-agent did not answer")

        def stop(self) -> None:
            if self.agent_proc is not None:
                self.agent_proc.terminate()
                try:
                    self.agent_proc.wait(10)
                except subprocess.TimeoutExpired:
                    self.agent_proc.kill()
            super().stop()

    return ShareCluster


def agent_toml(base: Path, backend: str, collocation: str = "fraction") -> str:
    """``collocation = ""`` leaves the shipped default (MPS among one user's jobs, else fraction)."""
    return (f'[agent]\nstate_dir = "{base}/agent-state"\nrecords_dir = "{base}/records"\n'
            f'run_dir = "{base}/run-agent"\ndevice_backend = "{backend}"\nwithhold = "none"\n'
            'metrics_port = 0\nwindow_samples = 4\nsample_period_s = 0.25\nflush_every_s = 1.0\n'
            f'log_file = "{base}/log/agent.log"\n'
            + (f'collocation = "{collocation}"\n' if collocation else "")
            + 'backstop_grace_s = 1.0\nbackstop_tolerance_mib = 256\nforecast_action = "none"\n')


def job_script(python: str, program: str, args: str, out: Path) -> str:
    return (f"#!/bin/sh\n#GPUSHARE mem={EST}\n"
            "env | grep -E '^(CUDA_|GPUSHARE_|SLURM_JOB_GPUS|SLURM_STEP_GPUS|PYTORCH_|XLA_)' | sort "
            f"> '{out}'/env.$SLURM_JOB_ID.${{SLURM_RESTART_COUNT:-0}}\n"
            f"exec '{python}' '{program}' {args}\n")


def read_env(path: Path) -> dict[str, str]:
    if not path.exists():
        return {}
    return dict(line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)


def job_view(client: Any, job_id: int) -> dict[str, Any]:
    job = client.require_job(job_id)
    raw = job.raw
    return {"job": job_id, "user": job.user_name, "uid": job.user_id, "states": list(job.states),
            "restarts": job.restarts, "nodes": job.nodes, "tres_per_node": job.tres_per_node,
            "gres_detail": raw.get("gres_detail"), "admin_comment": job.admin_comment,
            "start_time": _epoch(raw.get("start_time")), "end_time": _epoch(raw.get("end_time")),
            "exit_status": job.exit_status}


def _epoch(value: Any) -> Any:
    if isinstance(value, dict):  # scontrol --json: {"set": true, "number": N}
        return value.get("number")
    return value


def run(args: argparse.Namespace) -> int:
    out_dir = Path(args.out or os.environ.get("OUT") or "gpu-slurm-share-out").resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    steps = Steps()
    summary: dict[str, Any] = {"mode": "sim" if args.sim else "real-gpu", "same_user": args.same_user,
                               "slurm_version": VERSION,
                               "host": socket.gethostname(), "python": sys.executable,
                               "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}

    def on_alarm(signum: int, frame: Any) -> None:
        raise TimeoutError(f"the run's time limit of {args.limit_s} s was reached")

    signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(args.limit_s)
    cluster = None
    scratch: list[Path] = []
    try:
        with steps.step("preflight") as info:
            if os.geteuid() != 0:
                raise RuntimeError("needs root (chroot, mount namespaces, Slurm daemons)")
            for tool in ("unshare", "chroot", "mount", "useradd", "runuser"):
                if not shutil.which(tool, path=os.environ.get("PATH", "") + ":/usr/sbin:/usr/bin:/sbin:/bin"):
                    raise RuntimeError(f"{tool} not found")
            info["kernel"] = os.uname().release
        with steps.step("install-gpushare") as info:
            info["how"] = install_package(Path(os.path.dirname(sys.executable)))
        if not args.sim:
            with steps.step("gpu-nvml") as info:
                info.update(gpu_facts())
                summary["gpu"] = dict(info)
        model = summary.get("gpu", {}).get("model") or "h100-80gb"
        with steps.step("unpack-chroot") as info:
            if args.sim:
                cache = Path(tempfile.mkdtemp(prefix="gpushare-chroots-", dir="/var/tmp"))
                scratch.append(cache)
            else:
                cache = Path(os.environ.get("GPUSHARE_CHROOT_DIR") or "/var/cache/gpushare/slurm-chroots")
            root = unpack(Path(args.carry) / TARBALL, cache)
            info["chroot"] = str(root)
            info["stamp"] = json.loads((root / ".gpushare-chroot.json").read_text()).get("slurm")
        if not args.sim:
            with steps.step("driver-into-chroot") as info:
                info["libraries"] = driver_into_chroot(root)
        with steps.step("users") as info:
            from devcluster.local_cluster import ensure_login_user
            from devcluster.slurm_runtime import slurm_account

            info["slurm_uid"] = slurm_account().pw_uid
            info["users"] = {u: ensure_login_user(u).pw_uid for u in USERS}
            # jobs and their hooks run this interpreter as those users: every folder on its way must let them in
            proc = subprocess.run(["runuser", "-u", USERS[0], "--", sys.executable, "-c", "import gpushare.gres"],
                                  capture_output=True, text=True, cwd="/")
            if proc.returncode != 0:
                raise RuntimeError(f"{USERS[0]} cannot run {sys.executable} "
                                   f"({os.path.realpath(sys.executable)}): {proc.stderr.strip()[-200:]}")
        base = Path(tempfile.mkdtemp(prefix="gpushare-share-", dir="/tmp"))
        scratch.append(base)
        os.chmod(base, 0o755)
        jobs_out = base / "jobs"
        jobs_out.mkdir()
        os.chmod(jobs_out, 0o777)
        with steps.step("prepare-runtime") as info:
            backend = "nvml"
            if args.sim:
                from gpushare.gres.sim_backend import SimBackend

                SimBackend.from_scenario({"version": 1, "name": "gpu-slurm-share", "processes": [],
                                          "gpus": [{"model": model}]}, base / "sim.json")
                backend = f"sim:{base}/sim.json"
            cls = make_cluster_class()
            cluster = cls(base, gpu=model, gpus_per_node=1, bin_dir=os.path.dirname(sys.executable),
                          toml_extra=agent_toml(base, backend, "" if args.same_user else "fraction"),
                          slurm_version=VERSION)
            cluster.real_gpu = not args.sim
            runtime = cluster._runtime()
            info["release"] = runtime.release
            summary["slurm_release"] = runtime.release
        if not args.sim:
            with steps.step("nvml-in-chroot") as info:
                code = ("import pynvml; pynvml.nvmlInit(); h = pynvml.nvmlDeviceGetHandleByIndex(0); "
                        "print(pynvml.nvmlDeviceGetName(h), pynvml.nvmlDeviceGetMemoryInfo(h).used >> 20)")
                proc = subprocess.run(cluster.argv([sys.executable, "-c", code]), capture_output=True, text=True,
                                      timeout=60)
                if proc.returncode != 0:
                    raise RuntimeError(" | ".join((proc.stdout + proc.stderr).strip().splitlines()[-3:]))
                info["nvml"] = proc.stdout.strip()
            with steps.step("cuda-in-chroot-as-user") as info:
                code = ("import torch; x = torch.ones(1 << 20, device='cuda'); torch.cuda.synchronize(); "
                        "print(torch.__version__, torch.cuda.get_device_name())")
                proc = subprocess.run(cluster.user_argv(USERS[0], [sys.executable, "-c", code]), capture_output=True,
                                      text=True, timeout=120, cwd="/tmp")
                if proc.returncode != 0:
                    raise RuntimeError(" | ".join((proc.stdout + proc.stderr).strip().splitlines()[-3:]))
                info["torch"] = proc.stdout.strip()
        with steps.step("start-cluster") as info:
            cluster.start(timeout_s=60)
            if args.sim:  # the simulated GPU is a state file every job's process writes itself into (after
                os.chmod(base, 0o777)  # start, which makes the cluster's folder 0755)
                for name in ("sim.json", "sim.json.lock"):
                    (base / name).touch()
                    os.chmod(base / name, 0o666)
            info["nodes"] = cluster.client.node_states()
            info["gres_conf"] = (base / "etc" / "gres.conf").read_text().strip().splitlines()[1:]
            info["node_gres"] = [n.get("Gres") for n in cluster.client.nodes()]
        with steps.step("start-agent") as info:
            cluster.start_agent()
            info["backend"] = backend
        if args.sim:
            python, program = sys.executable, str(REPO / "tests" / "agent" / "simjob.py")
        else:
            program_path = jobs_out / "share_job.py"
            program_path.write_text(TORCH_JOB)
            os.chmod(program_path, 0o644)
            python, program = sys.executable, str(program_path)
        with steps.step("submit") as info:
            from devcluster.local_cluster import ensure_login_user

            export = f"--export=ALL,GPUSHARE_CONFIG={cluster.gpushare_conf}"
            ids: dict[str, int] = {}
            plan = {"neighbour": (USERS[0], "--mem-mib 3000 --seconds 25"),
                    "offender": (USERS[0] if args.same_user else USERS[1],
                                 "--mem-mib 3000 --grow-mib-per-s 1024 --seconds 12"
                                 + ("" if args.sim else " --ignore-cap"))}
            for role, (user, job_args) in plan.items():
                account = ensure_login_user(user)
                job_id, err = cluster.client.sbatch(
                    "-D", str(jobs_out), "-o", str(jobs_out / f"{role}-%j.out"), "--open-mode=append", "-J", role,
                    export, "--gres=gpu:1", f"--uid={account.pw_uid}", f"--gid={account.pw_gid}",
                    script=job_script(python, program, job_args, jobs_out))
                ids[role] = job_id
                info[role] = {"job": job_id, "user": user, "args": job_args, "sbatch_stderr": err.strip()[:300]}
                if role == "neighbour":  # the neighbour is running when the offender arrives
                    cluster._wait(lambda: cluster.client.require_job(ids["neighbour"]).state == "RUNNING", 30,
                                  "the neighbour did not start")
            summary["submitted"] = {role: dict(info[role]) for role in ids}
            for role, job_id in ids.items():
                info[f"{role}_tres_per_node"] = cluster.client.require_job(job_id).tres_per_node
            if not all("shard" in info[f"{r}_tres_per_node"] for r in ids):
                raise RuntimeError(f"not shard requests: {[info[f'{r}_tres_per_node'] for r in ids]}")
        with steps.step("backstop-stops-offender") as info:
            from gpushare.epilog.records import RecordLedger

            ledger = RecordLedger(cluster.config().agent.records_dir)
            cluster._wait(lambda: bool(ledger.get(str(ids["offender"]), 0)), 90,
                          "no record of the offender's first run")
            first = ledger.get(str(ids["offender"]), 0)[0]
            info["oom"] = first.get("oom")
            info["neighbour_state_then"] = cluster.client.require_job(ids["neighbour"]).state
            oom = first.get("oom") or {}
            info["offender_log_tail"] = [line for p in sorted(jobs_out.glob(f"offender-{ids['offender']}.out"))
                                         for line in p.read_text(errors="replace").splitlines()[-6:]]
            if args.same_user:  # under MPS the client's own memory limit stops it first: its own CUDA OOM
                pass
            elif oom.get("source") != "agent-backstop" or oom.get("action") != "stop":
                raise RuntimeError(f"the offender's first run ended without the backstop: oom={oom}")
        with steps.step("neighbour-completes") as info:
            job = cluster.wait_job(ids["neighbour"], 90)
            info["state"] = job.state
            if job.state != "COMPLETED":
                raise RuntimeError(f"the neighbour ended {job.state}")
        with steps.step("offender-recovered") as info:
            def rerun_ended() -> bool:
                job = cluster.client.require_job(ids["offender"])
                return job.restarts >= 1 and job.state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT",
                                                           "OUT_OF_MEMORY", "NODE_FAIL") and not job.completing
            cluster._wait(rerun_ended, 90, "the offender was not re-run to its end")
            job = cluster.client.require_job(ids["offender"])
            info.update(state=job.state, restarts=job.restarts, tres_per_node=job.tres_per_node)
        with steps.step("records") as info:
            cluster._wait(lambda: bool(ledger.get(str(ids["neighbour"]))), 20, "no record of the neighbour")
            info["have"] = sorted(ledger.path(str(j), 0).name for j in ids.values())
    except StepFailed:
        pass
    except BaseException as exc:  # noqa: BLE001 - an error between steps still leaves a summary
        steps.failed = {"step": "(between steps)", "ok": False, "error": f"{type(exc).__name__}: {exc}"[:400]}
        print(f"FAILED at step (between steps): {steps.failed['error']}", flush=True)
    finally:
        signal.alarm(0)
        signal.alarm(60)  # collecting and stopping get a minute of their own
        try:
            if cluster is not None and cluster.runtime is not None:
                summary["jobs"] = collect(cluster, locals().get("ids", {}), base / "jobs")
        except BaseException as exc:  # noqa: BLE001
            summary["collect_error"] = f"{type(exc).__name__}: {exc}"[:400]
        summary["steps"] = steps.done
        summary["failed_step"] = steps.failed
        summary["wall_s"] = round(time.monotonic() - steps.t0, 1)
        write_outputs(out_dir, summary, locals().get("base"))
        try:
            if cluster is not None:
                cluster.stop()
        except BaseException as exc:  # noqa: BLE001
            print(f"stopping the cluster: {exc}", flush=True)
        signal.alarm(0)
        if args.sim or args.clean:
            for path in scratch:
                shutil.rmtree(path, ignore_errors=True)
    print(f"wrote {out_dir}/gpu_slurm_share.json and .txt ({summary['wall_s']} s)", flush=True)
    return 1 if steps.failed else 0


def collect(cluster: Any, ids: dict[str, int], jobs_out: Path) -> dict[str, Any]:
    """Per job: where it ran, its request, its caps (environment per run), the agent's NVML record per run."""
    from gpushare.epilog.records import RecordLedger

    ledger = RecordLedger(cluster.config().agent.records_dir)
    result: dict[str, Any] = {}
    for role, job_id in ids.items():
        view = job_view(cluster.client, job_id)
        runs = []
        for restarts in range(view["restarts"] + 1):
            env = read_env(jobs_out / f"env.{job_id}.{restarts}")
            records = ledger.get(str(job_id), restarts)
            record = records[0] if records else {}
            runs.append({
                "restarts": restarts,
                "caps_env": {k: v for k, v in env.items() if k.startswith(("GPUSHARE_", "PYTORCH_", "XLA_", "CUDA_"))},
                "gpus": env.get("SLURM_JOB_GPUS"),
                "agent_record": {k: record.get(k) for k in ("shards", "est_gib", "margin_gib", "caps", "start", "end",
                                                            "duration_s", "gpus", "oom", "closed_by", "user")}
                if record else None,
                "peak_mib": {g: (v.get("peak_bytes") or 0) >> 20 for g, v in (record.get("gpus") or {}).items()},
            })
        logs = sorted(jobs_out.glob(f"{role}-{job_id}.out"))
        view["log_tail"] = logs[0].read_text(errors="replace").splitlines()[-12:] if logs else []
        view["runs"] = runs
        result[role] = view
    log = Path(cluster.config().agent.log_file)
    if log.exists():  # the agent's own account of the stop
        result["agent_backstop_log"] = [line for line in log.read_text(errors="replace").splitlines()
                                        if "backstop" in line.lower()][-10:]
    return result


def write_outputs(out_dir: Path, summary: dict[str, Any], base: Path | None) -> None:
    (out_dir / "gpu_slurm_share.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
    gpu = summary.get("gpu", {}).get("name", "simulated GPU" if summary["mode"] == "sim" else "GPU not read")
    lines = [f"gpu_slurm_share ({summary['mode']}), Slurm {summary.get('slurm_release', VERSION)}, {gpu}, "
             f"wall {summary['wall_s']} s"]
    for step in summary["steps"]:
        lines.append(f"  {'ok ' if step.get('ok') else 'FAIL'} {step['step']:<26} {step.get('seconds', '')} s"
                     + (f"  {step['error']}" if step.get("error") else ""))
    failed = summary.get("failed_step")
    lines.append(f"RESULT: FAILED at step {failed['step']}: {failed.get('error')}" if failed else "RESULT: all steps ok")
    for role, job in (summary.get("jobs") or {}).items():
        if not isinstance(job, dict):  # the agent's backstop log lines
            lines.extend(f"  agent: {line[:300]}" for line in job)
            continue
        lines.append(f"{role}: job {job['job']} user {job['user']} on {job['nodes']} {job['tres_per_node']} "
                     f"{'+'.join(job['states'])} restarts {job['restarts']} ({job['start_time']} .. {job['end_time']})")
        for r in job["runs"]:
            caps = r["caps_env"]
            rec = r["agent_record"] or {}
            lines.append(f"  run {r['restarts']}: GPU {r['gpus']} fraction {caps.get('GPUSHARE_MEMORY_FRACTION')} "
                         f"mode {caps.get('GPUSHARE_CAPS_MODE')} alloc_conf {caps.get('PYTORCH_CUDA_ALLOC_CONF')} "
                         f"| agent: caps {rec.get('caps')} peak {r['peak_mib']} MiB oom {rec.get('oom')}")
    (out_dir / "gpu_slurm_share.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)
    if base is not None and base.exists():
        with tarfile.open(out_dir / "gpu_slurm_share-logs.tar.gz", "w:gz") as tar:
            for sub in ("log", "jobs", "etc"):
                if (base / sub).exists():
                    tar.add(base / sub, arcname=sub)
            for path in (base / "records").rglob("*") if (base / "records").exists() else []:
                tar.add(path, arcname=str(path.relative_to(base)), recursive=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("pack", help="pack this host's Slurm chroot for a machine without Slurm")
    p.add_argument("--carry", default=str(DEFAULT_CARRY))
    r = sub.add_parser("run", help="start the cluster, run the two jobs, write the summary")
    r.add_argument("--sim", action="store_true", help="simulated GPU backend (no GPU needed)")
    r.add_argument("--same-user", action="store_true",
                   help="both jobs by one user, under the shipped collocation (MPS among one user's jobs)")
    r.add_argument("--carry", default=str(DEFAULT_CARRY), help="folder holding the packed chroot")
    r.add_argument("--out", help="summary folder (default $OUT)")
    r.add_argument("--limit-s", type=int, default=270, help="the run's time limit before collecting")
    r.add_argument("--clean", action="store_true", help="remove the cluster's folder afterwards")
    args = parser.parse_args(argv)
    if args.command == "pack":
        pack(Path(args.carry))
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
