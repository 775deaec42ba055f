"""The submission path end to end on a real local Slurm: sbatch → job_submit.lua → gpushare-submitd."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from gpushare.gpus import GiB
from gpushare.slurm_plugins.decision import parse_record
from gpushare.slurm.gres_request import plain_gres
from gpushare.slurm.jobs import number
from devcluster.local_cluster import LocalCluster

pytestmark = pytest.mark.slurm

ENV_PROBE = "env | grep -E '^(CUDA_VISIBLE_DEVICES|SLURM_SHARDS_ON_NODE|SLURM_JOB_GPUS)=' | sort\n"


def submit(cluster: LocalCluster, job_dir: Path, body: str, *args: str) -> tuple[int, str]:
    return cluster.client.sbatch(*args, "-D", str(job_dir), "-o", str(job_dir / "job-%j.out"),
                                 script="#!/bin/bash\n" + body)


def output_env(job_dir: Path, job_id: int) -> dict[str, str]:
    lines = (job_dir / f"job-{job_id}.out").read_text().split()
    return dict(line.split("=", 1) for line in lines if "=" in line)


def test_annotated_job_runs_on_right_sized_shard(slurm_cluster, job_dir):
    job_id, stderr = submit(slurm_cluster, job_dir, "#GPUSHARE mem=12G\n" + ENV_PROBE, "--gres=gpu:1")
    assert "shard:14" in stderr  # the one-line message reached the user through sbatch
    record = slurm_cluster.wait_job(job_id)
    assert record.state == "COMPLETED"
    assert plain_gres(record.tres_per_node) == "shard:14"
    ours = parse_record(record.admin_comment)
    assert ours["decision"] == "shared" and ours["est_gib"] == 12.0 and plain_gres(ours["old"]) == "gpu:1"
    env = output_env(job_dir, job_id)
    assert env["SLURM_SHARDS_ON_NODE"] == "14" and env["CUDA_VISIBLE_DEVICES"] in ("0", "1")


def test_estimate_file_directive(slurm_cluster, job_dir):
    (job_dir / "est.json").write_text(json.dumps(
        {"targets": [{"gpu": "a100-40gb", "peak_total_bytes": int(5.5 * GiB)}]}))
    job_id, _ = submit(slurm_cluster, job_dir, "#GPUSHARE estimate=est.json\ntrue\n", "--gres=gpu:1")
    record = slurm_cluster.wait_job(job_id)
    assert plain_gres(record.tres_per_node) == "shard:7"  # 5.5 + 1 GiB margin -> 7
    assert parse_record(record.admin_comment)["src"] == "directive:estimate"


def test_two_shared_jobs_share_one_gpu_within_its_memory(slurm_cluster, job_dir):
    # 2 × 17 shards fit one 40 GiB GPU; Slurm packs them onto the same GPU index, or spreads them,
    # but never lets the shards on one GPU exceed 40.
    ids = [submit(slurm_cluster, job_dir, "#GPUSHARE mem=15G\n" + ENV_PROBE + "sleep 2\n", "--gres=gpu:1")[0]
           for _ in range(3)]
    records = [slurm_cluster.wait_job(i, timeout_s=90) for i in ids]
    assert all(r.state == "COMPLETED" and plain_gres(r.tres_per_node) == "shard:17" for r in records)


def test_job_without_estimate_keeps_whole_gpu(slurm_cluster, job_dir):
    job_id, stderr = submit(slurm_cluster, job_dir, ENV_PROBE, "--gres=gpu:1")
    assert "keeps a whole GPU" in stderr
    record = slurm_cluster.wait_job(job_id)
    assert plain_gres(record.tres_per_node) == "gpu:1"
    assert parse_record(record.admin_comment)["decision"] == "exclusive"
    assert "SLURM_SHARDS_ON_NODE" not in output_env(job_dir, job_id)


def test_cpu_job_untouched(slurm_cluster, job_dir):
    job_id, stderr = submit(slurm_cluster, job_dir, "true\n")
    assert "gpushare" not in stderr
    record = slurm_cluster.wait_job(job_id)
    assert record.state == "COMPLETED" and not record.admin_comment


@pytest.mark.parametrize("args, kind", [
    (("--gres=gpu:2",), "multi-gpu"),
    (("--gres=shard:3",), "explicit"),
    (("--gpus=1",), "per-job"),
])
def test_requests_kept_deliberately(slurm_cluster, job_dir, args, kind):
    job_id, _ = submit(slurm_cluster, job_dir, "#GPUSHARE mem=4G\ntrue\n", *args)
    record = slurm_cluster.wait_job(job_id)
    assert record.state == "COMPLETED"
    assert parse_record(record.admin_comment)["decision"] == kind


def test_array_job_every_task_shared(slurm_cluster, job_dir):
    job_id, _ = submit(slurm_cluster, job_dir, "#GPUSHARE mem=3G\ntrue\n", "--gres=gpu:1", "--array=0-2")
    for task in range(3):
        record = slurm_cluster.wait_job(f"{job_id}_{task}")  # type: ignore[arg-type]
        assert plain_gres(record.tres_per_node) == "shard:4"
        assert parse_record(record.admin_comment)["array"] is True


def test_heterogeneous_job_components_kept(slurm_cluster, job_dir):
    script = ("#!/bin/bash\n#SBATCH --gres=gpu:1\n#SBATCH hetjob\n#SBATCH --gres=gpu:1\n"
              "#GPUSHARE mem=3G\ntrue\n")
    (job_dir / "het.sh").write_text(script)
    job_id, _ = slurm_cluster.client.sbatch("--hold", "-D", str(job_dir), "-o", str(job_dir / "het-%j.out"),
                                            str(job_dir / "het.sh"))
    for component in (job_id, job_id + 1):  # each component passes job_submit on its own
        record = slurm_cluster.client.require_job(component)
        assert number(record.raw.get("het_job_id")) == job_id
        assert plain_gres(record.tres_per_node) == "gpu:1"
        assert parse_record(record.admin_comment)["decision"] == "heterogeneous"
    slurm_cluster.client.run("scancel", str(job_id))


def test_update_of_rewritten_pending_job_keeps_request_and_record(slurm_cluster, job_dir):
    job_id, _ = submit(slurm_cluster, job_dir, "#GPUSHARE mem=4G\ntrue\n", "--gres=gpu:1", "--hold")
    slurm_cluster.client.update_job(job_id, timelimit="10")
    record = slurm_cluster.client.require_job(job_id)
    assert number(record.raw.get("time_limit")) == 10 and plain_gres(record.tres_per_node) == "shard:5"
    assert parse_record(record.admin_comment)["decision"] == "shared"
    slurm_cluster.client.run("scancel", str(job_id))


def test_burst_of_500_jobs_all_accepted_and_annotated(slurm_cluster, job_dir):
    def one(i: int) -> int:
        return submit(slurm_cluster, job_dir, f"#GPUSHARE mem={1 + i % 20}G\ntrue\n", "--gres=gpu:1", "--hold",
                      f"--job-name=burst{i}")[0]

    with ThreadPoolExecutor(8) as pool:
        ids = list(pool.map(one, range(500)))
    assert len(set(ids)) == 500
    jobs = {int(j.job_id): j for j in slurm_cluster.client.jobs() if int(j.job_id) in set(ids)}
    assert len(jobs) == 500
    for i, job_id in enumerate(ids):
        comment = jobs[job_id].admin_comment
        assert parse_record(comment)["decision"] == "shared"
    slurm_cluster.client.run("scancel", "--name", ",".join(f"burst{i}" for i in range(500)))


# --- fail open -------------------------------------------------------------------------------------
def _serve(path: Path, behaviour: str, stop: threading.Event) -> threading.Thread:
    """A misbehaving peer on the service socket: accepts and hangs, or answers garbage."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(64)
    server.settimeout(0.2)

    def loop() -> None:
        held = []
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except socket.timeout:
                continue
            if behaviour == "garbage":
                conn.sendall(b"action=modify\ntres_per_node=gres:shard:1\n\x00\xff no end marker\n")
                conn.close()
            else:
                held.append(conn)  # never answer
        for conn in held:
            conn.close()
        server.close()

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("behaviour", ["stopped", "hung", "garbage"])
def test_job_accepted_unchanged_when_service_fails(make_cluster, tmp_path, behaviour):
    cluster: LocalCluster = make_cluster()
    cluster.stop_process("submitd")
    stop = threading.Event()
    thread = None
    if behaviour != "stopped":
        thread = _serve(cluster.submitd_socket, behaviour, stop)
    try:
        started = time.monotonic()
        job_id, stderr = submit(cluster, tmp_path, "#GPUSHARE mem=4G\ntrue\n", "--gres=gpu:1")
        elapsed = time.monotonic() - started
        record = cluster.wait_job(job_id)
    finally:
        stop.set()
        if thread:
            thread.join()
    assert record.state == "COMPLETED"
    assert plain_gres(record.tres_per_node) == "gpu:1" and not record.admin_comment
    assert elapsed < 5  # the shim's deadline is 0.5 s in the test config
    log = (cluster.base / "log" / "slurmctld.log").read_text()
    assert "gpushare: job of uid 0 accepted unchanged" in log


def test_two_node_cluster_places_shared_jobs_on_both(make_cluster, tmp_path):
    cluster: LocalCluster = make_cluster(node_names=("n1", "n2"), gpus_per_node=1)
    ids = [submit(cluster, tmp_path, f"#GPUSHARE mem=4G\n{ENV_PROBE}", "--gres=gpu:1", f"--nodelist={node}")[0]
           for node in ("n1", "n2")]
    for job_id, node in zip(ids, ("n1", "n2")):
        record = cluster.wait_job(job_id)
        assert record.state == "COMPLETED" and record.nodes == node
        assert output_env(tmp_path, job_id)["SLURM_SHARDS_ON_NODE"] == "5"


def test_huge_non_utf8_script_is_handled(slurm_cluster, job_dir):
    # 4 MiB of filler after the directive, with bytes that are not UTF-8: the shim sends only the first
    # [submit] max_script_bytes, escaped; the directive near the top still counts.
    body = b"#!/bin/bash\n#GPUSHARE mem=2G\n# \xff\xfe\xc3\x28 latin-1 caf\xe9\ntrue\n" + (b"# " + b"\xa0" * 1000 + b"\n") * 4096
    path = job_dir / "huge.sh"
    path.write_bytes(body)
    job_id, stderr = slurm_cluster.client.sbatch("-D", str(job_dir), "-o", "/dev/null", "--gres=gpu:1", str(path))
    record = slurm_cluster.wait_job(job_id)
    assert record.state == "COMPLETED" and plain_gres(record.tres_per_node) == "shard:3"


def test_malformed_directive_accepted_unchanged_with_reason(slurm_cluster, job_dir):
    job_id, stderr = submit(slurm_cluster, job_dir, "#GPUSHARE mem=a-lot\ntrue\n", "--gres=gpu:1")
    assert "ignoring the job's #GPUSHARE lines" in stderr and "line 2" in stderr
    record = slurm_cluster.wait_job(job_id)
    assert plain_gres(record.tres_per_node) == "gpu:1"
    assert parse_record(record.admin_comment)["decision"] == "bad-directive"


def test_reject_mode_refuses_users_bad_directive_but_never_root(make_cluster):
    import pwd
    import subprocess

    user = "gpushare-u1"
    try:
        pwd.getpwnam(user)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/bin/sh", user], check=True)
    cluster: LocalCluster = make_cluster(submit_settings={"on_bad_directive": "reject"})
    tmp_path = cluster.base / "work"  # pytest's tmp tree is private to root
    tmp_path.mkdir(mode=0o777)
    os.chmod(tmp_path, 0o777)
    script = tmp_path / "bad.sh"
    script.write_text("#!/bin/bash\n#GPUSHARE mem=a-lot\ntrue\n")
    os.chmod(script, 0o644)
    as_user = subprocess.run(cluster.user_argv(user, ["sbatch", "--gres=gpu:1", "-D", str(tmp_path), str(script)]),
                             env=cluster.env, capture_output=True, text=True)
    assert as_user.returncode != 0
    assert "gpushare: #GPUSHARE on line 2" in as_user.stderr
    job_id, _ = cluster.client.sbatch("--gres=gpu:1", "-D", str(tmp_path), "-o", "/dev/null", str(script))
    assert cluster.wait_job(job_id).state == "COMPLETED"  # root's job: logged, not rejected
