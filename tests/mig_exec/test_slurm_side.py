"""Slurm-side pieces of the executor without a cluster: file surgery, cap devices, scontrol/squeue parsing."""

from __future__ import annotations

import os
import stat
from collections import Counter
from pathlib import Path

import pytest

from gpushare.mig_manager.gres_files import (GresFileError, ensure_cap_devices, replace_gres_conf_lines,
                                    replace_node_gres, rewrite_node_gres, rewrite_site_node_gres)
from gpushare.mig_manager.slurm_actions import SlurmNodeActions, gpu_counts
from gpushare.slurm.jobs import Job, job_from_json

SLURM_CONF = """ClusterName=x
GresTypes=gpu
NodeName=n1 NodeAddr=127.0.0.1 CPUs=2 Gres=gpu:7g.40gb:1 State=UNKNOWN
NodeName=n10 NodeAddr=127.0.0.1 CPUs=2 Gres=gpu:a100:2 State=UNKNOWN
PartitionName=gpu Nodes=n1,n10 Default=YES
"""
GRES_CONF = """# site comment
NodeName=n10 Name=gpu Type=a100 File=/dev/nvidia[0-1]
NodeName=n1 Name=gpu Type=7g.40gb MultipleFiles=/dev/nvidia0,/dev/nvidia-caps/nvidia-cap3
"""
NEW = ["NodeName=n1 Name=gpu Type=3g.20gb MultipleFiles=/dev/nvidia0,/dev/nvidia-caps/nvidia-cap12",
       "NodeName=n1 Name=gpu Type=1g.5gb MultipleFiles=/dev/nvidia0,/dev/nvidia-caps/nvidia-cap21"]


def test_only_this_nodes_lines_change() -> None:
    out = replace_gres_conf_lines(GRES_CONF, "n1", NEW)
    assert out.splitlines() == ["# site comment", GRES_CONF.splitlines()[1], *NEW]
    conf = replace_node_gres(SLURM_CONF, "n1", "gpu:3g.20gb:1,gpu:1g.5gb:1")
    assert "NodeName=n1 NodeAddr=127.0.0.1 CPUs=2 Gres=gpu:3g.20gb:1,gpu:1g.5gb:1 State=UNKNOWN" in conf
    assert "NodeName=n10 NodeAddr=127.0.0.1 CPUs=2 Gres=gpu:a100:2" in conf  # n10 is not n1


def test_refusals_name_the_fix() -> None:
    with pytest.raises(GresFileError, match="no line of its own"):
        replace_node_gres("NodeName=n[1-4] CPUs=2 Gres=gpu:1\n", "n1", "gpu:1g.5gb:1")
    with pytest.raises(GresFileError, match="may also apply"):
        replace_gres_conf_lines("Name=gpu Type=a100 File=/dev/nvidia0\n", "n1", NEW)
    with pytest.raises(GresFileError, match="refusing"):
        replace_node_gres(SLURM_CONF, "n1", "gpu:1 State=DOWN")
    with pytest.raises(GresFileError):
        replace_gres_conf_lines(GRES_CONF, "n1", ["NodeName=n2 Name=gpu"])


def test_rewrite_is_atomic_and_reports_no_change_the_second_time(tmp_path: Path) -> None:
    conf, gres = tmp_path / "slurm.conf", tmp_path / "gres.conf"
    conf.write_text(SLURM_CONF)
    gres.write_text(GRES_CONF)
    assert rewrite_node_gres(conf, gres, "n1", NEW, "gpu:3g.20gb:1,gpu:1g.5gb:1")
    assert not rewrite_node_gres(conf, gres, "n1", NEW, "gpu:3g.20gb:1,gpu:1g.5gb:1")
    # no temporary file left; only the lock that serialises writers of this slurm.conf
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == [".slurm.conf.gpushare.lock"]


def _rewrite_many(conf: str, gres: str, node: str, rounds: int) -> None:
    for index in range(rounds):
        rewrite_node_gres(Path(conf), Path(gres), node, [f"NodeName={node} Name=gpu Type=1g.5gb File=/dev/x{index}"],
                          f"gpu:1g.5gb:{index % 7 + 1}")


def test_two_nodes_reshaping_at_once_keep_each_others_edits(tmp_path: Path) -> None:
    """Two MIG nodes sharing one slurm.conf: a per-node lock alone lost one node's Gres= edit."""
    import multiprocessing

    conf, gres = tmp_path / "slurm.conf", tmp_path / "gres.conf"
    conf.write_text("NodeName=n1 CPUs=2 Gres=gpu:1\nNodeName=n2 CPUs=2 Gres=gpu:1\n")
    gres.write_text("")
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_rewrite_many, args=(str(conf), str(gres), node, 150)) for node in ("n1", "n2")]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(60)
    final = 149 % 7 + 1
    assert conf.read_text() == f"NodeName=n1 CPUs=2 Gres=gpu:1g.5gb:{final}\nNodeName=n2 CPUs=2 Gres=gpu:1g.5gb:{final}\n"
    assert "File=/dev/x149" in gres.read_text() and gres.read_text().count("NodeName=n") == 2


@pytest.mark.skipif(os.geteuid() != 0, reason="mknod needs root")
def test_cap_devices_are_character_devices_and_impostors_are_refused(tmp_path: Path) -> None:
    made = ensure_cap_devices(tmp_path, [12, 13, 12], 234)
    assert [p.name for p in made] == ["nvidia-cap12", "nvidia-cap13"]
    st = (tmp_path / "nvidia-caps" / "nvidia-cap12").lstat()
    assert stat.S_ISCHR(st.st_mode) and os.major(st.st_rdev) == 234 and os.minor(st.st_rdev) == 12
    assert ensure_cap_devices(tmp_path, [12], 234) == []
    (tmp_path / "nvidia-caps" / "nvidia-cap30").write_text("not a device")
    with pytest.raises(GresFileError, match="not character device"):
        ensure_cap_devices(tmp_path, [30], 234)


class FakeClient:
    def __init__(self, node_line: str, jobs: list[dict]) -> None:
        self.node_line, self.listing, self.calls = node_line, jobs, []

    def run(self, tool: str, *args: str, **_: object) -> str:
        self.calls.append((tool, *args))
        if args[:2] == ("show", "node"):
            return self.node_line
        if args[:2] == ("show", "hostnames"):
            return "n1\nn2\n"
        return ""

    def jobs(self) -> list[Job]:
        return [job_from_json(j) for j in self.listing]


def test_status_and_running_jobs_from_structured_fields() -> None:
    line = ("NodeName=n1 Arch=x86_64 Gres=gpu:3g.20gb:1,gpu:1g.5gb:2 State=IDLE+DRAIN "
            "Reason=gpushare-mig reshape ab12cd34 [root@2026-11-22T03:19:09]")
    jobs = [{"job_id": 1, "job_state": "RUNNING", "nodes": "n1", "tres_per_node": "gres:gpu:1g.5gb:1"},
            {"job_id": 2, "job_state": "RUNNING", "nodes": "n[1-2]", "tres_per_node": "gres:gpu:3g.20gb:1"},
            {"job_id": 3, "job_state": "RUNNING", "nodes": "n1", "tres_per_node": "gres:gpu:1"},
            {"job_id": 4, "job_state": "PENDING", "nodes": "", "tres_per_node": "gres:gpu:7g.40gb:1"},
            {"job_id": 5, "job_state": "RUNNING", "nodes": "n11", "tres_per_node": "gres:gpu:7g.40gb:1"}]
    actions = SlurmNodeActions(FakeClient(line, jobs), Path("/x"), Path("/y"), lambda n: None)  # type: ignore[arg-type]
    status = actions.status("n1")
    assert (status.drained, status.reason, status.invalid) == (True, "gpushare-mig reshape ab12cd34", False)
    assert gpu_counts(status.gres) == {"3g.20gb": 1, "1g.5gb": 2}
    assert actions.running_gpu_jobs("n1") == {"1": Counter({"1g.5gb": 1}), "2": Counter({"3g.20gb": 1}),
                                              "3": Counter({"*": 1})}
    with pytest.raises(ValueError):
        actions.drain("n1", "x\nState=RESUME")


def _site(tmp_path: Path, slurm_extra: str = "", gres_extra: str = "") -> tuple[Path, Path]:
    """The site's files including gpushare's own, n1's lines in ours (as docs/mig.md asks)."""
    site, gres = tmp_path / "slurm.conf", tmp_path / "gres.conf"
    site.write_text(f"ClusterName=x\nGresTypes=gpu\nInclude {tmp_path}/gpushare-mig.conf\n{slurm_extra}"
                    "PartitionName=gpu Nodes=n1 Default=YES\n")
    gres.write_text(f"# site\nInclude gpushare-mig-gres.conf\n{gres_extra}")  # relative: beside gres.conf
    (tmp_path / "gpushare-mig.conf").write_text("NodeName=n1 NodeAddr=127.0.0.1 CPUs=2 Gres=gpu:7g.40gb:1\n")
    return site, gres


def test_only_our_include_files_are_written_and_the_sites_never(tmp_path: Path) -> None:
    site, gres = _site(tmp_path)
    before = (site.read_bytes(), gres.read_bytes())
    assert rewrite_site_node_gres(site, gres, "n1", NEW, "gpu:3g.20gb:1,gpu:1g.5gb:1")
    assert (site.read_bytes(), gres.read_bytes()) == before
    assert (tmp_path / "gpushare-mig.conf").read_text() == \
        "NodeName=n1 NodeAddr=127.0.0.1 CPUs=2 Gres=gpu:3g.20gb:1,gpu:1g.5gb:1\n"
    assert (tmp_path / "gpushare-mig-gres.conf").read_text().splitlines() == NEW


@pytest.mark.parametrize(("slurm_extra", "gres_extra", "include", "message"), [
    ("", "", "other.conf", "has no line 'Include"),
    ("NodeName=n1 CPUs=2 Gres=gpu:1\n", "", "", "still defines NodeName=n1; move that line"),
    ("", "NodeName=n1 Name=gpu Type=a100 File=/dev/nvidia0\n", "", "may also apply to n1"),
    ("", "Name=gpu Type=a100 File=/dev/nvidia0\n", "", "may also apply to n1"),
])
def test_site_files_that_do_not_leave_the_node_to_us_are_refused_unchanged(
        tmp_path: Path, slurm_extra: str, gres_extra: str, include: str, message: str) -> None:
    site, gres = _site(tmp_path, slurm_extra, gres_extra)
    if include:
        site.write_text(site.read_text().replace(f"{tmp_path}/gpushare-mig.conf", include))
    own = (tmp_path / "gpushare-mig.conf").read_bytes()
    with pytest.raises(GresFileError, match=message):
        rewrite_site_node_gres(site, gres, "n1", NEW, "gpu:3g.20gb:1")
    assert (tmp_path / "gpushare-mig.conf").read_bytes() == own
    assert not (tmp_path / "gpushare-mig-gres.conf").exists()


def test_a_glob_include_counts(tmp_path: Path) -> None:
    site, gres = _site(tmp_path)
    site.write_text(site.read_text().replace(f"{tmp_path}/gpushare-mig.conf", f"{tmp_path}/gpushare-*.conf"))
    assert rewrite_site_node_gres(site, gres, "n1", NEW, "gpu:3g.20gb:1")


def test_doctor_names_a_missing_include_and_accepts_the_documented_setup(tmp_path: Path) -> None:
    from gpushare.config import parse_config
    from gpushare.slurm_plugins.controller_doctor import mig_files_check

    site, _ = _site(tmp_path)
    cfg = parse_config({"slurm": {"conf": str(site)}, "nodes": [{"names": "n1", "gpu": "a100-40gb", "mig": True}]})
    check = mig_files_check(cfg, str(site))
    assert check is not None and check.status == "ok", check
    site.write_text(site.read_text().replace("Include", "#Include"))
    check = mig_files_check(cfg, str(site))
    assert check is not None and check.status != "ok" and "has no line 'Include" in check.detail, check
