"""Controller coordination without a cluster: the node-record texts, who decides, and the exchange through Slurm.

Slurm's command line is played by :class:`FakeScontrol` (node records with State, Gres, Reason, Comment and
Extra; ``scontrol reconfigure`` applies slurm.conf's ``Gres=`` as 24.11+ does; squeue's jobs); our own
code — executor, node-side actions, controller pass, file surgery — is the real thing. The real-Slurm
version of the exchange is test_mig_controller_slurm.py.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gpushare.config import parse_config
from gpushare.mig_manager.coordination import RecordSlurmActions, controller_pass
from gpushare.mig_manager.executor import Executor
from gpushare.mig_manager.journal import JournalStore
from gpushare.policy.layout import Instance
from gpushare.mig_manager.node_record import (MAX_CHARS, RecordError, Report, Target, parse_report, parse_target,
                                              read_records)
from gpushare.mig_manager.reshape import follow_controller, settings
from gpushare.slurm.client import SlurmError
from gpushare.slurm.jobs import Job
from gpushare.slurm.version import SlurmVersion
from mig_exec_fakes import sim_gpu
from test_demand import job

LINE = "Name=gpu~Type=3g.20gb~MultipleFiles=/dev/nvidia0,/dev/nvidia-caps/nvidia-cap21,/dev/nvidia-caps/nvidia-cap22"


def test_texts_round_trip_and_carry_no_spaces() -> None:
    target = Target("ab12cd34", {0: "3g.20gb@4,2g.10gb@2", 1: "empty"}, "-")
    assert parse_target(target.encode(), "n1") == target
    report = Report("ab12cd34", "files", {0: ("a100-40gb", "3g.20gb@4")}, "gpu:3g.20gb:1",
                    (LINE.replace("~", " "),), "ff00aa11")
    text = report.encode()
    assert " " not in text and parse_report(text, "n1") == report
    assert report.node_lines("n1") == [f"NodeName=n1 {LINE.replace('~', ' ')}"]
    assert parse_report("", "n1") is None and parse_target("(null)", "n1") is None


@pytest.mark.parametrize("text, match", [
    ("disk replaced 2026-01-02", "not a gpushare-mig record"),
    ("gpushare-mig|v1|run=ab|target=0:3g.20gb@4", "expected keys"),
    ("gpushare-mig|v1|run=AB;rm|target=0:3g.20gb@4|written=-", "bad run id"),
    ("gpushare-mig|v1|run=ab|target=0:3g.20gb@4;rm -rf|written=-", "bad layout"),
    ("gpushare-mig|v1|run=ab|target=99:3g.20gb@4|written=-", "bad GPU index"),
    ("gpushare-mig|v1|run=ab|target=0:9g.1gb@9|written=-", "bad layout"),
])
def test_a_target_that_is_not_ours_or_malformed_is_refused_by_name(text: str, match: str) -> None:
    with pytest.raises(RecordError, match=match) as info:
        parse_target(text, "n1")
    assert "node n1 Extra" in str(info.value)


@pytest.mark.parametrize("field, value, match", [
    ("state", "pwned", "unknown state"),
    ("gres", "gpu:1 State=DOWN", "bad Gres"),
    ("lines", "Name=gpu~Type=x~File=/dev/nvidia0~Flags=nvml", "bad gres.conf line"),
    ("lines", "NodeName=n2~Name=gpu~File=/dev/nvidia0", "bad gres.conf line"),
    ("lines", "Name=gpu~File=relative/nvidia0", "bad gres.conf line"),
    ("gpus", "0:a100-40gb:3g.20gb@1;x", "bad GPU entry"),
])
def test_a_report_is_parsed_strictly_before_the_controller_writes_it_into_gres_conf(field: str, value: str,
                                                                                    match: str) -> None:
    parts = {"run": "ab", "state": "files", "files": "cd", "answered": "-", "gres": "gpu:3g.20gb:1",
             "gpus": "0:a100-40gb:3g.20gb@4",
             "lines": LINE}
    parts[field] = value
    text = "gpushare-mig|v1|" + "|".join(f"{k}={v}" for k, v in parts.items())
    with pytest.raises(RecordError, match=match):
        parse_report(text, "n1")


def test_texts_stay_under_the_measured_length() -> None:
    assert MAX_CHARS < 60000  # measured round-trip length on every release (node_record docstring)
    with pytest.raises(RecordError, match="max"):
        Report("ab", "idle", {}, "", ("Name=gpu File=/dev/nvidia0",) * 800).encode()
    with pytest.raises(RecordError, match="max"):
        parse_report("gpushare-mig|v1|" + "x" * MAX_CHARS, "n1")


SLURM_CONF = """ClusterName=x
NodeName={a} CPUs=2 Gres=gpu:7g.40gb:1 State=UNKNOWN
NodeName={b} CPUs=2 Gres=gpu:7g.40gb:1 State=UNKNOWN
PartitionName=gpu Nodes={a},{b} Default=YES
"""


class FakeScontrol:
    """Slurm's CLI for a few nodes: records, admin updates, reconfigure, ping, squeue's jobs."""

    def __init__(self, conf: Path, nodes: tuple[str, ...], release: str = "24.11.5") -> None:
        self.conf = conf
        self.version = SlurmVersion.parse(release)
        self.nodes = {n: {"State": "IDLE", "Gres": "gpu:7g.40gb:1", "Reason": "", "Comment": "", "Extra": ""}
                      for n in nodes}
        self.pending: list[Job] = []
        self.calls: list[str] = []

    def jobs(self) -> list[Job]:
        return list(self.pending)

    def _line(self, name: str) -> str:
        rec = self.nodes[name]
        reason = f" Reason={rec['Reason']} [root@2026-01-01T00:00:00]" if rec["Reason"] else ""
        return (f"NodeName={name} Arch=x86_64 State={rec['State']} Gres={rec['Gres'] or '(null)'}{reason} "
                f"Comment={rec['Comment'] or '(null)'} Extra={rec['Extra'] or '(null)'}")

    def run(self, tool: str, *args: str, **_: object) -> str:
        self.calls.append(" ".join((tool, *args))[:60])
        if args[:3] == ("show", "node", "-o"):
            names = args[3:] or tuple(self.nodes)
            if any(n not in self.nodes for n in names):
                return ""
            return "\n".join(self._line(n) for n in names) + "\n"
        if args[:1] == ("update",):
            name = args[1].split("=", 1)[1]
            rec = self.nodes[name]
            for item in args[2:]:
                key, _, value = item.partition("=")
                if key == "state" and value == "drain":
                    rec["State"] = "IDLE+DRAIN"
                elif key == "state" and value == "resume":
                    rec["State"], rec["Reason"] = "IDLE", ""
                else:
                    rec[{"reason": "Reason", "comment": "Comment", "extra": "Extra"}[key]] = value
            return ""
        if args == ("reconfigure",):  # 24.11+: slurmctld takes each node's Gres= from slurm.conf
            for line in self.conf.read_text().splitlines():
                match = re.match(r"NodeName=(\S+) .*Gres=(\S+)", line)
                if match and match.group(1) in self.nodes:
                    self.nodes[match.group(1)]["Gres"] = match.group(2)
            return ""
        if args == ("ping",):
            return "Slurmctld(primary) at ctl is UP\n"
        raise SlurmError(f"fake scontrol: {tool} {args}")


def _cfgs(tmp_path: Path, node: str) -> tuple:
    common = {"coordination": "controller", "poll_s": 0.01, "verify_timeout_s": 5, "wait_timeout_s": 1,
              "demand_min_age_s": 0}
    node_cfg = parse_config({"mig": {**common, "journal_dir": str(tmp_path / f"journal-{node}"),
                                     "gres_conf": str(tmp_path / "no-such-dir" / "gres.conf")}})
    # the controller's files: the site's (site/slurm.conf, site/gres.conf) include gpushare's own, here
    # tmp_path/slurm.conf and tmp_path/gres.conf, the only two it writes
    ctl_cfg = parse_config({"mig": {**common, "journal_dir": str(tmp_path / "controller"),
                                    "gres_conf": str(tmp_path / "site" / "gres.conf"),
                                    "slurm_include": str(tmp_path / "slurm.conf"),
                                    "gres_include": str(tmp_path / "gres.conf")}})
    return node_cfg, ctl_cfg


_GPUS: dict[tuple[Path, str], object] = {}  # one simulated GPU per node and test, across executor instances


def _node(tmp_path: Path, slurm: FakeScontrol, node: str, on_wait, hook=None) -> Executor:  # type: ignore[no-untyped-def]
    node_cfg, _ = _cfgs(tmp_path, node)
    backend = _GPUS.setdefault((tmp_path, node), sim_gpu())
    store = JournalStore(node_cfg.mig.journal_dir)
    actions = RecordSlurmActions(slurm, node, backend, node_cfg.gpus, store, "/dev", True,  # type: ignore[arg-type]
                                 restart=lambda n: slurm.calls.append(f"restart slurmd {n}"), wait_s=5, poll_s=0.01,
                                 sleep=lambda s: on_wait())
    return Executor(node, backend, actions, store, settings(node_cfg), sleep=lambda s: None, hook=hook)


def _setup(tmp_path: Path, release: str = "24.11.5") -> tuple:
    conf = tmp_path / "slurm.conf"
    conf.write_text(SLURM_CONF.format(a="a1", b="b1"))
    (tmp_path / "gres.conf").write_text(
        "NodeName=a1 Name=gpu Type=7g.40gb MultipleFiles=/dev/nvidia0,/dev/nvidia-caps/nvidia-cap3\n"
        "NodeName=b1 Name=gpu Type=7g.40gb MultipleFiles=/dev/nvidia0,/dev/nvidia-caps/nvidia-cap3\n")
    (tmp_path / "site").mkdir(exist_ok=True)
    (tmp_path / "site" / "slurm.conf").write_text(f"ClusterName=x\nInclude {conf}\n")
    (tmp_path / "site" / "gres.conf").write_text(f"Include {tmp_path / 'gres.conf'}\n")
    slurm = FakeScontrol(conf, ("a1", "b1"), release)
    _, ctl_cfg = _cfgs(tmp_path, "ctl")
    restarts: list[str] = []

    def restart_ctld() -> None:  # what a slurmctld restart does: read the files (the only way on 22.05)
        restarts.append("slurmctld")
        slurm.run("scontrol", "reconfigure")

    def control() -> list[str]:
        return controller_pass(ctl_cfg, slurm, tmp_path / "site" / "slurm.conf", tmp_path / "site" / "gres.conf",
                               restart_ctld)  # type: ignore[arg-type]
    return slurm, control, restarts


def test_each_pending_want_goes_to_one_node_only(tmp_path: Path) -> None:
    slurm, control, _ = _setup(tmp_path)
    executors = {n: _node(tmp_path, slurm, n, control) for n in ("a1", "b1")}
    for name, executor in executors.items():  # first runs: each node reports its layout
        node_cfg, _ = _cfgs(tmp_path, name)
        assert follow_controller(node_cfg, executor, slurm)[0].outcome == "nothing"  # type: ignore[arg-type]
    slurm.pending = [job(i, "gres:gpu:3g.20gb:1") for i in range(1, 4)]  # three 3g: two fit a GPU
    control()
    targets = {n: parse_target(slurm.nodes[n]["Extra"], n) for n in ("a1", "b1")}
    assert targets["a1"].layouts == {0: "3g.20gb@0,3g.20gb@4"} and targets["b1"].layouts == {0: "3g.20gb@4"}
    # a second pass changes nothing: both targets are still unanswered
    control()
    assert {n: parse_target(slurm.nodes[n]["Extra"], n) for n in ("a1", "b1")} == targets


def test_node_changes_gpus_controller_writes_files_and_reconfigures(tmp_path: Path) -> None:
    slurm, control, restarts = _setup(tmp_path)
    waits: list[str] = []

    def on_wait() -> None:  # the node waits for the controller: the controller's timer fires
        waits.append(slurm.nodes["a1"]["Comment"].split("|")[3])
        control()
    executor = _node(tmp_path, slurm, "a1", on_wait)
    node_cfg, _ = _cfgs(tmp_path, "a1")
    follow_controller(node_cfg, executor, slurm)  # type: ignore[arg-type]
    slurm.pending = [job(1, "gres:gpu:3g.20gb:1"), job(2, "gres:gpu:1g.5gb:2")]
    before_b1 = [line for line in (tmp_path / "gres.conf").read_text().splitlines() if "b1" in line]
    notes = control()
    target = parse_target(slurm.nodes["a1"]["Extra"], "a1")
    assert target is not None and "a1: target" in " ".join(notes)
    result, _ = follow_controller(node_cfg, executor, slurm)  # type: ignore[arg-type]
    assert result.outcome == "applied", result
    assert waits == ["state=files"]  # the node waited for the controller once, with its files published
    report = parse_report(slurm.nodes["a1"]["Comment"], "a1")
    assert (report.state, report.run) == ("done", target.run)
    gres_lines = (tmp_path / "gres.conf").read_text().splitlines()
    assert sorted(re.search(r"Type=(\S+)", line).group(1) for line in gres_lines if line.startswith("NodeName=a1 ")
                  ) == ["1g.5gb", "1g.5gb", "3g.20gb"]
    assert [line for line in gres_lines if "b1" in line] == before_b1  # the other node's lines untouched
    assert "NodeName=a1 CPUs=2 Gres=gpu:3g.20gb:1,gpu:1g.5gb:2" in (tmp_path / "slurm.conf").read_text() or \
        "NodeName=a1 CPUs=2 Gres=gpu:1g.5gb:2,gpu:3g.20gb:1" in (tmp_path / "slurm.conf").read_text()
    assert not (tmp_path / "no-such-dir").exists() and restarts == []  # 24.11: reconfigure, no restart
    assert "scontrol reconfigure" in slurm.calls and slurm.nodes["a1"]["State"] == "IDLE"
    assert not any(c.startswith("restart slurmd") for c in slurm.calls)


def test_on_22_05_controller_restarts_slurmctld_and_node_its_slurmd(tmp_path: Path) -> None:
    slurm, control, restarts = _setup(tmp_path, "22.05.8")
    executor = _node(tmp_path, slurm, "a1", control)
    node_cfg, _ = _cfgs(tmp_path, "a1")
    follow_controller(node_cfg, executor, slurm)  # type: ignore[arg-type]
    slurm.pending = [job(1, "gres:gpu:4g.20gb:1")]
    control()
    slurm.calls.clear()
    assert follow_controller(node_cfg, executor, slurm)[0].outcome == "applied"  # type: ignore[arg-type]
    assert restarts == ["slurmctld"] and "restart slurmd a1" in slurm.calls
    assert slurm.calls.index("restart slurmd a1") > slurm.calls.index("scontrol reconfigure")  # after the controller


def test_a_node_killed_while_waiting_for_the_controller_picks_the_wait_up_in_reconcile(tmp_path: Path) -> None:
    slurm, control, _ = _setup(tmp_path)

    class Killed(BaseException):
        pass

    def crash(label: str) -> None:
        if label == "gres_written":
            raise Killed(label)
    node_cfg, _ = _cfgs(tmp_path, "a1")
    follow_controller(node_cfg, _node(tmp_path, slurm, "a1", control), slurm)  # type: ignore[arg-type]
    slurm.pending = [job(1, "gres:gpu:2g.10gb:1")]
    control()
    with pytest.raises(Killed):
        follow_controller(node_cfg, _node(tmp_path, slurm, "a1", control, hook=crash), slurm)  # type: ignore[arg-type]
    assert parse_report(slurm.nodes["a1"]["Comment"], "a1").state == "files"
    assert "DRAIN" in slurm.nodes["a1"]["State"] and "2g.10gb" not in slurm.nodes["a1"]["Gres"]
    # meanwhile the controller's timer writes the files and acknowledges; the pending job is not re-planned
    notes = control()
    assert "a1: reshape" in " ".join(notes) and "2g.10gb" in slurm.nodes["a1"]["Gres"]
    result, _ = follow_controller(node_cfg, _node(tmp_path, slurm, "a1", control), slurm)  # type: ignore[arg-type]
    assert result.outcome == "nothing"  # reconcile finished the run; the target is answered
    report = parse_report(slurm.nodes["a1"]["Comment"], "a1")
    assert report.state == "done" and slurm.nodes["a1"]["State"] == "IDLE"
    assert "2g.10gb@" in report.gpus[0][1] and "7g.40gb" not in report.gpus[0][1]


def test_controller_leaves_foreign_fields_alone_and_says_so(tmp_path: Path) -> None:
    slurm, control, _ = _setup(tmp_path)
    node_cfg, _ = _cfgs(tmp_path, "a1")
    follow_controller(node_cfg, _node(tmp_path, slurm, "a1", control), slurm)  # type: ignore[arg-type]
    slurm.nodes["a1"]["Extra"] = "rack=7"  # a site's own use of the field
    slurm.pending = [job(1, "gres:gpu:3g.20gb:1")]
    notes = control()
    assert any("not a gpushare-mig record" in n and "a1" in n for n in notes)
    assert slurm.nodes["a1"]["Extra"] == "rack=7"
    with pytest.raises(RecordError, match="node a1 Extra"):
        follow_controller(node_cfg, _node(tmp_path, slurm, "a1", control), slurm)  # type: ignore[arg-type]


def test_controller_plans_nothing_for_a_drained_node_or_busy_instances(tmp_path: Path) -> None:
    slurm, control, _ = _setup(tmp_path)
    for name in ("a1", "b1"):
        node_cfg, _ = _cfgs(tmp_path, name)
        follow_controller(node_cfg, _node(tmp_path, slurm, name, control), slurm)  # type: ignore[arg-type]
    slurm.nodes["a1"]["State"] = "IDLE+DRAIN"
    running = job(9, "gres:gpu:7g.40gb:1", state="RUNNING", reason="None")
    slurm.pending = [running, job(1, "gres:gpu:3g.20gb:1")]
    object.__setattr__(running, "nodes", "b1")
    notes = control()
    assert slurm.nodes["a1"]["Extra"] == "" and slurm.nodes["b1"]["Extra"] == ""
    assert any(n.startswith("a1: DRAIN") for n in notes) and any("busy 7g.40gb@0" in n for n in notes), notes
    assert read_records(slurm, "a1")[0].state == "IDLE+DRAIN"  # type: ignore[arg-type]


def test_a_node_whose_lines_cannot_be_edited_alone_is_named_and_not_acknowledged(tmp_path: Path) -> None:
    slurm, control, _ = _setup(tmp_path)
    conf = tmp_path / "slurm.conf"
    conf.write_text(conf.read_text().replace("NodeName=a1 CPUs=2", "NodeName=a[1-2] CPUs=2"))
    report = Report("ab", "files", {0: ("a100-40gb", "3g.20gb@4")}, "gpu:3g.20gb:1", (LINE.replace("~", " "),), "cd")
    slurm.nodes["a1"]["Comment"] = report.encode()
    slurm.nodes["b1"]["Comment"] = Report("ef", "files", {0: ("a100-40gb", "3g.20gb@4")}, "gpu:3g.20gb:1",
                                          (LINE.replace("~", " "),), "ab").encode()
    notes = control()
    assert any(n.startswith("a1: ") and "no line of its own" in n for n in notes), notes
    assert slurm.nodes["a1"]["Extra"] == "" and parse_target(slurm.nodes["b1"]["Extra"], "b1").written == "ab"
    assert "NodeName=b1 CPUs=2 Gres=gpu:3g.20gb:1" in conf.read_text()


def test_a_controller_pass_killed_before_its_acknowledgement_reloads_again_next_time(tmp_path: Path) -> None:
    slurm, control, restarts = _setup(tmp_path, "22.05.8")
    slurm.nodes["a1"]["Comment"] = Report("ab", "files", {0: ("a100-40gb", "3g.20gb@4")}, "gpu:3g.20gb:1",
                                          (LINE.replace("~", " "),), "cd").encode()
    _, ctl_cfg = _cfgs(tmp_path, "ctl")

    def dies() -> None:
        raise SlurmError("systemctl restart slurmctld: exit 1")
    with pytest.raises(SlurmError):
        controller_pass(ctl_cfg, slurm, tmp_path / "site" / "slurm.conf", tmp_path / "site" / "gres.conf",
                        dies)  # type: ignore[arg-type]
    assert "Gres=gpu:3g.20gb:1" in (tmp_path / "slurm.conf").read_text() and slurm.nodes["a1"]["Extra"] == ""
    notes = control()  # the files are already there, but Slurm has not read them: reload, then acknowledge
    assert any("already there" in n for n in notes) and restarts == ["slurmctld"]
    assert parse_target(slurm.nodes["a1"]["Extra"], "a1").written == "cd"
    assert slurm.nodes["a1"]["Gres"] == "gpu:3g.20gb:1"
    control()
    assert restarts == ["slurmctld"]  # acknowledged: nothing to reload any more


def test_a_refused_create_rolls_back_and_the_controller_writes_the_rolled_back_lines(tmp_path: Path) -> None:
    from gpushare.gres.errors import GpuError, NvmlCode

    slurm, control, _ = _setup(tmp_path)

    def refuse(label: str) -> None:  # the driver refuses the second op (after the destroy)
        if label == "op1":
            raise GpuError(NvmlCode.INSUFFICIENT_RESOURCES, "simulated refusal")
    node_cfg, _ = _cfgs(tmp_path, "a1")
    follow_controller(node_cfg, _node(tmp_path, slurm, "a1", control), slurm)  # type: ignore[arg-type]
    slurm.pending = [job(1, "gres:gpu:3g.20gb:2")]
    control()
    result, _ = follow_controller(node_cfg, _node(tmp_path, slurm, "a1", control, hook=refuse),  # type: ignore[arg-type]
                                  slurm)
    assert result.outcome == "rolled_back" and "simulated refusal" in result.detail
    report = parse_report(slurm.nodes["a1"]["Comment"], "a1")
    assert (report.state, report.gpus[0][1]) == ("rolled_back", "7g.40gb@0")
    lines = [line for line in (tmp_path / "gres.conf").read_text().splitlines() if line.startswith("NodeName=a1 ")]
    assert len(lines) == 1 and "Type=7g.40gb" in lines[0]  # the files follow the GPU, written by the controller
    assert lines[0] != "NodeName=a1 Name=gpu Type=7g.40gb MultipleFiles=/dev/nvidia0,/dev/nvidia-caps/nvidia-cap3"
    assert slurm.nodes["a1"]["State"] == "IDLE" and slurm.nodes["a1"]["Gres"] == "gpu:7g.40gb:1"


def test_a_layout_set_by_hand_on_the_node_is_not_undone_by_an_old_target(tmp_path: Path) -> None:
    slurm, control, _ = _setup(tmp_path)
    node_cfg, _ = _cfgs(tmp_path, "a1")
    follow_controller(node_cfg, _node(tmp_path, slurm, "a1", control), slurm)  # type: ignore[arg-type]
    slurm.pending = [job(1, "gres:gpu:4g.20gb:1")]
    control()
    assert follow_controller(node_cfg, _node(tmp_path, slurm, "a1", control), slurm)[0].outcome == "applied"  # type: ignore[arg-type]
    slurm.pending = []
    by_hand = _node(tmp_path, slurm, "a1", control).apply({0: (Instance("7g.40gb", 0),)})  # gpushare mig apply --target
    assert by_hand.outcome == "applied"
    result, _ = follow_controller(node_cfg, _node(tmp_path, slurm, "a1", control), slurm)  # type: ignore[arg-type]
    assert result.outcome == "nothing"
    assert parse_report(slurm.nodes["a1"]["Comment"], "a1").gpus[0][1] == "7g.40gb@0"
    assert slurm.nodes["a1"]["Gres"] == "gpu:7g.40gb:1"


def test_node_status_retries_only_after_slurm_has_answered(tmp_path: Path) -> None:
    slurm, _, _ = _setup(tmp_path)
    node_cfg, _ = _cfgs(tmp_path, "a1")
    actions = RecordSlurmActions(slurm, "a1", sim_gpu(), node_cfg.gpus, JournalStore(tmp_path / "j"),  # type: ignore[arg-type]
                                 "/dev", True, restart=lambda n: None, wait_s=5, poll_s=0.01, sleep=lambda s: None)
    real_run, failures = slurm.run, []

    def flaky(tool: str, *args: str, **kw: object) -> str:
        if failures:
            failures.pop()
            raise SlurmError("scontrol: error: resolve_ctls_from_dns_srv: res_nsearch error")
        return real_run(tool, *args, **kw)
    slurm.run = flaky  # type: ignore[method-assign]
    failures.append(1)
    with pytest.raises(SlurmError):  # never answered yet (a configless node before slurmd): fail at once
        actions.status("a1")
    assert actions.status("a1").state == "IDLE"
    failures.extend([1, 1])  # slurmd restarting: asked again
    assert actions.status("a1").state == "IDLE" and not failures
