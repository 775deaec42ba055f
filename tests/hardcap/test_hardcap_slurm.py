"""The hard cap under real Slurm: Prolog → TaskProlog → shim → Epilog, with the node agent sampling the same
device, on a test cluster whose jobs live in cgroups (proctrack/cgroup over cgroup/v1: the test machines mount
the v1 hierarchies, and Slurm's cgroup/v2 plugin refuses such a hybrid host; docs/isolation.md).
``[agent] hardcap = "auto"``: the driver backend is unavailable here (no cgroup v2), said once, and the shim
applies. The jobs are an ordinary user's (devcluster's test user, submitting with sbatch as itself), as the
shim reads its limits as the job's user; the node's runtime directory is made first by the AdminComment
lock, as on a node where the agent wrote a note before any Prolog ran. The jobs run a C program linked
against the fake driver (tests/hardcap/fake_cuda.c, device memory in a shared file of the A100's size) and a
Python ctypes one; each gets CUDA_ERROR_OUT_OF_MEMORY at its share while
its neighbour on the same GPU takes its own; NVML inside the job (fake_nvml.c) reports the job's slice; the
Epilog removes each job's hard cap folder. The fake driver mirrors each process's usage into the simulated GPU
(tests/hardcap/sim_mirror.py) that the running agent samples: the agent tracks every job at its real peak and
its backstop stays silent, since the shim already held each job inside its share."""
from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from devcluster.slots import host_lock
from devcluster.local_cluster import LOGIN_TEST_USER, LocalCluster, ensure_login_user, missing_requirements
from gpushare.node.api import AgentUnavailable, call
from gpushare.atomic import write_text_atomic
from gpushare.epilog.records import RecordLedger
from gpushare.gres.sim_backend import SimBackend
from gpushare.node.hardcap import HARDCAP_DIR, UNAVAILABLE_NOTE, context_charge

pytestmark = [pytest.mark.slurm, pytest.mark.hardcap]
HERE = Path(__file__).parent
MiB = 1 << 20
A100 = 40960 * MiB
# its own cgroup hierarchy (slurm_<node>) per run: a job of an earlier cluster with the same id may linger there
NODE = f"hc{os.getpid()}"
BIN_DIR = os.path.dirname(sys.executable)
SILENT = ("backstop_stops", "backstop_records", "unattributed_stops", "unattributed_records", "oom_avoided")


class CgroupCluster(LocalCluster):
    """A LocalCluster whose slurmstepd keeps every job in a cgroup (freezer hierarchy of cgroup v1)."""

    def _slurm_conf(self, cfg: object) -> str:
        text = super()._slurm_conf(cfg)  # type: ignore[arg-type]
        return text.replace("ProctrackType=proctrack/linuxproc", "ProctrackType=proctrack/cgroup")

    def write_files(self) -> None:
        super().write_files()
        write_text_atomic(self.base / "etc" / "cgroup.conf", "CgroupPlugin=cgroup/v1\n")

    agent_proc: subprocess.Popen[bytes] | None = None

    @property
    def agent_socket(self) -> Path:
        return self.base / "run-agent" / "agent" / "agent.sock"

    def agent_answers(self) -> bool:
        try:
            return bool(call(self.agent_socket, {"op": "ping"}, timeout_s=1.0).get("ok"))
        except AgentUnavailable:
            return False

    def start_agent(self) -> None:
        """The node agent as a daemon beside slurmd (in its chroot for newer Slurm), as tests/agent starts it."""
        with open(self.base / "log" / "agent.out", "ab") as log:
            self.agent_proc = subprocess.Popen(
                self.argv([f"{BIN_DIR}/gpushare-agent", "--node", NODE, "--log-level", "DEBUG"]), env=self.env,
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self._wait(self.agent_answers, 15, "gpushare-agent did not answer")

    def stop(self) -> None:
        if self.agent_proc is not None:
            self.agent_proc.terminate()
            try:
                self.agent_proc.wait(10)
            except subprocess.TimeoutExpired:
                self.agent_proc.kill()
                self.agent_proc.wait(5)
            self.agent_proc = None
        super().stop()


@pytest.fixture(scope="module")
def hardcap_dir_alone() -> Iterator[None]:
    """The shim's folder (/run/gpushare/hardcap, compiled in) is the machine's, and its per-job folders are
    named by job id, which every test cluster counts from 1: one such cluster at a time on the machine, even
    with other test sessions or pytest-xdist workers beside (devcluster.slots)."""
    with host_lock("hardcap"):
        yield


@pytest.fixture(scope="module")
def cluster(hardcap_dir_alone: None) -> Iterator[CgroupCluster]:
    problem = missing_requirements()
    if problem:
        pytest.skip(f"real Slurm unavailable: {problem}")
    if not shutil.which("gcc") or not Path("/sys/fs/cgroup/freezer").is_dir():
        pytest.skip("needs gcc and the cgroup v1 freezer hierarchy")
    ensure_login_user()  # before the cluster starts: a chroot's copy of the accounts has it
    base = Path(tempfile.mkdtemp(prefix="gpushare-hardcap-", dir="/tmp"))
    os.chmod(base, 0o755)
    bin_dir = base / "hardcap-bin"
    (bin_dir / "driver").mkdir(parents=True)
    cc = ["gcc", "-O2", "-Wall"]
    for cmd in (["-fPIC", "-shared", "-o", f"{bin_dir}/driver/libcuda.so.1", f"{HERE}/fake_cuda.c"],
                ["-fPIC", "-shared", "-o", f"{bin_dir}/libgpushare-hardcap.so", f"{HERE.parents[1]}/gres/hardcap/hardcap.c",
                 "-ldl", "-lpthread"],  # the production build: /proc/self/cgroup and /run/gpushare/hardcap
                ["-fPIC", "-shared", "-o", f"{bin_dir}/driver/libnvidia-ml.so.1", f"{HERE}/fake_nvml.c"],
                ["-DLINKED", "-o", f"{bin_dir}/alloc", f"{HERE}/alloc.c", f"{bin_dir}/driver/libcuda.so.1", "-ldl",
                 f"-Wl,-rpath,{bin_dir}/driver"]):
        subprocess.run(cc + cmd, check=True, capture_output=True)
    toml = (f'[agent]\nstate_dir = "{base}/agent-state"\nrecords_dir = "{base}/records"\nrun_dir = "{base}/run-agent"\n'
            f'device_backend = "sim:{base}/sim.json"\nlog_file = "{base}/log/agent.log"\nmetrics_port = 0\n'
            f'hardcap = "auto"\nhardcap_library = "{bin_dir}/libgpushare-hardcap.so"\nadmin_comment = "no"\n'
            'collocation = "fraction"\nbackstop_grace_s = 1.0\nsample_period_s = 0.25\nwindow_samples = 4\nflush_every_s = 1.0\n')
    SimBackend.from_scenario({"version": 1, "gpus": [{"model": "a100-40gb"}]}, base / "sim.json")
    made = CgroupCluster(base, node_names=(NODE,), gpus_per_node=1, bin_dir=os.path.dirname(sys.executable),
                         toml_extra=toml)
    started = time.monotonic()
    made.start()
    os.chmod(base, 0o777)  # the user's jobs write their logs, the fake device's usage files and the simulated state
    for name in ("devmem", "sim.json", "sim.json.lock", "log/agent.log"):  # the jobs' processes write these too
        (base / name).touch()
        os.chmod(base / name, 0o666)
    made.start_agent()
    print(f"cluster up in {time.monotonic() - started:.1f} s")
    yield made
    made.stop()
    shutil.rmtree(base, ignore_errors=True)
    for hierarchy in Path("/sys/fs/cgroup").glob(f"*/slurm_{NODE}"):  # empty cgroups: rmdir, deepest first
        for cg in sorted((p for p in hierarchy.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)) + [hierarchy]:
            try:
                cg.rmdir()
            except OSError:
                pass


def submit(cluster: CgroupCluster, name: str, command: str, mem: str = "4.5G") -> int:
    base = cluster.base
    text = (f"#!/bin/sh\n#GPUSHARE mem={mem}\n"
            f"echo limit $GPUSHARE_MEM_LIMIT_MIB preload $LD_PRELOAD torch $PYTORCH_CUDA_ALLOC_CONF\n"
            f"export FAKE_CUDA_MEM={base}/devmem FAKE_CUDA_TOTAL={A100} LD_LIBRARY_PATH={base}/hardcap-bin/driver "
            f"FAKE_NVML_UUID={SimBackend.open(base / 'sim.json').gpu(0).uuid} "
            f"FAKE_CUDA_SIM_MIRROR=\"'{sys.executable}' '{HERE}/sim_mirror.py' {base}/sim.json $SLURM_JOB_GPUS\"\n"
            f"{command}\n")
    done = subprocess.run(cluster.user_argv(LOGIN_TEST_USER, [
        "sbatch", "--parsable", "-D", str(base), "-o", f"{base}/{name}-%j.out", "--gres=gpu:1",
        f"--export=ALL,GPUSHARE_CONFIG={cluster.gpushare_conf}"]), input=text, capture_output=True, text=True,
        env=cluster.env, timeout=60)
    assert done.returncode == 0, done.stderr
    return int(done.stdout.strip().split(";")[0])


def words(text: str) -> dict[str, str]:
    w = text.split()
    return {w[i]: w[i + 1] for i in range(len(w) - 1)}


def test_c_and_ctypes_jobs_stop_at_their_share_beside_a_neighbour(cluster: CgroupCluster) -> None:
    started = time.monotonic()
    # the reason is said once per node until it changes: forget an earlier run's
    subprocess.run(cluster.argv(["rm", "-f", f"{HARDCAP_DIR}/{UNAVAILABLE_NOTE}"]), env=cluster.env, check=True)
    # the node's runtime directory as the AdminComment lock makes it when it runs before any Prolog (it once
    # made it 0700, and no job of an ordinary user was capped after that)
    subprocess.run(cluster.argv([sys.executable, "-c", "from gpushare.slurm.admin_comment import _host_lock\n"
                                 "with _host_lock():\n    pass\n"]), env=cluster.env, check=True)
    guard_before = call(cluster.agent_socket, {"op": "status"})["guard"]
    alloc = f"{cluster.base}/hardcap-bin/alloc"
    ctypes_job = (f"'{sys.executable}' -c \"import ctypes\n"
                  "cu = ctypes.CDLL('libcuda.so.1'); got = 0\n"
                  "while got < 1 << 40 and cu.cuMemAlloc_v2(ctypes.byref(ctypes.c_ulonglong()), ctypes.c_size_t(1 << 20)) == 0:\n"
                  "    got += 1 << 20\n"
                  "nv = ctypes.CDLL('libnvidia-ml.so.1'); h = ctypes.c_void_p(); m = (ctypes.c_ulonglong * 3)()\n"
                  "nv.nvmlInit_v2(); nv.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(h))\n"
                  "print('ctypes', got, 'nvml', nv.nvmlDeviceGetMemoryInfo(h, m), 'nvml_total', m[0], 'nvml_used', m[2])\n"
                  "import time; time.sleep(4)\n\"")  # holds its memory for the agent's samples
    jobs = {"c": submit(cluster, "c", f"{alloc} linked {MiB} 100000 6"),  # holds its memory 6 s
            "py": submit(cluster, "py", ctypes_job),
            "neighbour": submit(cluster, "neighbour", f"sleep 2; {alloc} linked {MiB} 2000 4", mem="3G")}
    # the shim's per-process context charge the Prolog wrote: the simulated A100's (compute capability 8.0)
    charge = context_charge(SimBackend.open(cluster.base / "sim.json").gpu(0))
    assert charge == 612 * MiB
    out = {}
    for name, job in jobs.items():
        log = cluster.base / f"{name}-{job}.out"
        assert cluster.wait_job(job, 90).state == "COMPLETED", log.read_text() if log.exists() else "no log"
        out[name] = log.read_text()
    user = pwd.getpwnam(LOGIN_TEST_USER).pw_uid
    assert {cluster.client.require_job(job).user_id for job in jobs.values()} == {user}  # an ordinary user's jobs
    for name in ("c", "py"):
        assert "gpushare-hardcap:" not in out[name], out[name]  # never "cannot open limits file (…)"
        got = words(out[name])
        share = int(got["limit"]) * MiB
        assert got["preload"].startswith(f"{cluster.base}/hardcap-bin/libgpushare-hardcap.so"), out[name]
        # PyTorch's fraction stays of the whole GPU (it is taken of the device's total memory property, which
        # the shim leaves alone: measured on an H200, docs/isolation.md): far below 1 for a share of one GPU
        fraction = float(got["torch"].removeprefix("per_process_memory_fraction:"))
        assert 0 < fraction < 0.5, out[name]
        allocated = int(got["allocated"] if name == "c" else got["ctypes"])
        assert allocated == share - charge, out[name]  # every byte of the share, none past it
        if name == "c":
            assert got["result"] == "2" and int(got["total"]) == share  # CUDA_ERROR_OUT_OF_MEMORY; the slice shown
        else:  # NVML inside the job shows the job's slice and its charge, not the GPU's
            assert (got["nvml"], int(got["nvml_total"]), int(got["nvml_used"])) == ("0", share, share), out[name]
    neighbour = words(out["neighbour"])
    assert neighbour["allocated"] == str(2000 * MiB) and neighbour["result"] == "0", out["neighbour"]
    said = (cluster.base / "log" / "agent.log").read_text()  # the hooks' log ([agent] log_file)
    assert said.count("driver memory limits unavailable:") == 1, said  # said once, not per job
    assert "not a cgroup v2 hierarchy; using the shim" in said, said
    for job in jobs.values():  # the Epilog removed each job's folder (where the cluster's jobs see /run)
        gone = subprocess.run(cluster.argv(["test", "-e", f"{HARDCAP_DIR}/job_{job}"]), env=cluster.env)
        assert gone.returncode == 1, f"{HARDCAP_DIR}/job_{job} left behind"
    # the agent sampled each job's usage on the simulated GPU the fake driver mirrors into: its records show
    # each job's real peak (all of its share but the shim's context charge; the neighbour's 2000 MiB) ...
    ledger = RecordLedger(str(cluster.base / "records"))
    cluster._wait(lambda: all(ledger.get(str(job)) for job in jobs.values()), 30, "the agent's record of every job",
                  seen=lambda: {name: ledger.get(str(job)) for name, job in jobs.items()})
    peaks = {name: ledger.get(str(job))[0]["gpus"]["0"]["peak_bytes"] for name, job in jobs.items()}
    limits = {name: int(words(out[name])["limit"]) * MiB for name in jobs}
    assert peaks["c"] == peaks["py"] == limits["c"] - charge, (peaks, limits)
    assert peaks["neighbour"] == 2000 * MiB, peaks
    # ... and its backstop stayed silent: no job was over its cap, nothing was stopped or recorded
    assert [ledger.get(str(job))[0].get("oom") for job in jobs.values()] == [None] * 3
    guard = call(cluster.agent_socket, {"op": "status"})["guard"]
    assert {k: guard[k] for k in SILENT} == {k: guard_before[k] for k in SILENT}, guard
    assert "agent-backstop" not in (cluster.base / "log" / "agent.out").read_text()
    print(f"three jobs in {time.monotonic() - started:.1f} s")


def test_a_program_escaping_the_shim_is_stopped_by_the_backstop(cluster: CgroupCluster) -> None:
    """The shim is cooperative (a program that drops LD_PRELOAD escapes it): the backstop, sampling the same
    mirrored device, is what holds such a job, and it is live in this cluster, so the silence above is earned."""
    started = time.monotonic()
    before = call(cluster.agent_socket, {"op": "status"})["guard"]["backstop_stops"]
    job = submit(cluster, "escape", f"env -u LD_PRELOAD {cluster.base}/hardcap-bin/alloc linked {MiB} 10000 3")
    ledger = RecordLedger(str(cluster.base / "records"))
    cluster._wait(lambda: any((r.get("oom") or {}).get("source") == "agent-backstop" for r in ledger.get(str(job))),
                  60, "the backstop to stop the escaping job (an agent-backstop OOM record)",
                  seen=lambda: (ledger.get(str(job)), cluster.client.job(job)))
    oom = next(r["oom"] for r in ledger.get(str(job)) if r.get("oom"))
    assert oom["action"] == "stop" and oom["peak_bytes"] == 10000 * MiB > oom["cap_bytes"] + oom["tolerance_bytes"]
    assert call(cluster.agent_socket, {"op": "status"})["guard"]["backstop_stops"] == before + 1
    cluster.wait_job(job, 90)  # its recovery rerun ends before the cluster stops
    print(f"escaping job stopped in {time.monotonic() - started:.1f} s")
