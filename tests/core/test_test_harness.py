"""The test harness's own rules (docs/testing.md): which Slurm tests rerun on the middle release, the deadlines
test waits stretch by on a loaded machine, and the one-line stop when the checkout is out of the Slurm
accounts' reach.

``make test`` runs every Slurm test on the oldest release (22.05) and the newest (26.05), and on 24.11 only
the tests marked ``version_sensitive``: a Slurm test whose code or expectations branch on the release must
carry that marker with its reason, or 24.11 would silently lose it.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from devcluster import processes
from devcluster.slurm_runtime import (SLURM_USER, checkout_out_of_reach, closed_folders, open_view_argv,
                                     unreachable_folder)
from gpushare.slurm.version import SlurmVersion

TESTS = Path(__file__).resolve().parents[1]
# A module starts real Slurm daemons when it says so or uses a fixture that does (tests/conftest.py).
SLURM_MODULE = re.compile(r"mark\.slurm|\b(slurm_cluster|make_cluster|job_dir|agent_cluster|est_cluster|"
                          r"multihost_cluster|missing_requirements)\b")
CAPABILITIES = sorted(name for name, value in vars(SlurmVersion).items() if isinstance(value, property)
                      and name != "release")
# What branches on the release: SlurmVersion's capabilities (read from the class, so a new one is covered),
# the harness's version helpers, and the running release itself.
VERSION_REFERENCE = re.compile(r"\b(" + "|".join(CAPABILITIES) + r")\b|slurm_at_least\(|\btres\(|"
                               r"requested_version\(|\bslurm_version\b|client\.version\b|GPUSHARE_TEST_SLURM")


def _is_version_sensitive(node: ast.expr) -> ast.Call | None:
    """The ``pytest.mark.version_sensitive(...)`` call ``node`` is, or None."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "version_sensitive":
        return node
    return None


def _marks(node: ast.AST) -> list[ast.Call]:
    return [call for sub in ast.walk(node) if isinstance(sub, ast.expr) and (call := _is_version_sensitive(sub))]


def _reason(call: ast.Call) -> str:
    values = [*call.args, *(k.value for k in call.keywords if k.arg == "reason")]
    return values[0].value.strip() if values and isinstance(values[0], ast.Constant) and isinstance(
        values[0].value, str) else ""


def _sensitive_functions(tree: ast.Module, source: str, inherited: set[str]) -> set[str]:
    """Names of the module's functions whose code references the release, directly or through another such
    function (here or in ``inherited``, the sensitive helpers it imports)."""
    functions = {n.name: ast.get_source_segment(source, n) or "" for n in tree.body
                 if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    sensitive = {name for name, text in functions.items() if VERSION_REFERENCE.search(text)}
    while True:
        known = sensitive | inherited
        more = {name for name, text in functions.items() if name not in sensitive
                and any(re.search(rf"\b{re.escape(k)}\(", text) for k in known)}
        if not more:
            return sensitive
        sensitive |= more


def version_sensitive_problems(root: Path = TESTS) -> list[str]:
    """Every Slurm test that branches on the release without the marker, and every marker without a reason."""
    helpers: set[str] = set()
    for path in sorted(root.rglob("*.py")):  # the tests' shared helper modules (oom_slurm_util, ...)
        if not path.name.startswith(("test_", "conftest")):
            source = path.read_text()
            helpers |= _sensitive_functions(ast.parse(source), source, set())
    problems = []
    for path in sorted(root.rglob("test_*.py")):
        if path == Path(__file__).resolve():  # this file's examples are text, not tests
            continue
        source = path.read_text()
        tree = ast.parse(source)
        name = path.relative_to(root.parent)
        for call in _marks(tree):
            if not _reason(call):
                problems.append(f"{name}:{call.lineno}: version_sensitive without a reason")
        if not SLURM_MODULE.search(source):
            continue
        module_marked = any(_marks(n) for n in tree.body if isinstance(n, ast.Assign)
                            and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in n.targets))
        sensitive = _sensitive_functions(tree, source, helpers)
        fixtures_sensitive = {n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in sensitive
                              and any("fixture" in ast.unparse(d) for d in n.decorator_list)}
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef) or not node.name.startswith("test_"):
                continue
            uses = node.name in sensitive or fixtures_sensitive.intersection(a.arg for a in node.args.args)
            if uses and not module_marked and not any(_marks(d) for d in node.decorator_list):
                problems.append(f"{name}::{node.name} branches on the Slurm release but is not marked "
                                "version_sensitive (24.11 would skip it)")
    return problems


def test_every_slurm_test_that_branches_on_the_release_is_marked_with_a_reason() -> None:
    assert version_sensitive_problems() == []


def test_the_check_sees_an_unmarked_branch_and_a_marker_without_reason(tmp_path: Path) -> None:
    (tmp_path / "helper_util.py").write_text(
        "def whole(cluster):\n    return 'gpu:1' if cluster.client.version.held_gres_across_names else 'shard:40'\n")
    (tmp_path / "test_x_slurm.py").write_text(
        "import pytest\npytestmark = pytest.mark.slurm\nfrom helper_util import whole\n\n"
        "def test_direct(slurm_cluster):\n    assert slurm_cluster.slurm_at_least('24.11')\n\n"
        "def test_through_helper(slurm_cluster):\n    assert whole(slurm_cluster)\n\n"
        "@pytest.mark.version_sensitive('the requeue path differs')\n"
        "def test_marked(slurm_cluster):\n    assert slurm_cluster.tres('gpu:1')\n\n"
        "@pytest.mark.version_sensitive(reason='')\n"
        "def test_no_reason(slurm_cluster):\n    pass\n\n"
        "def test_plain(slurm_cluster):\n    assert slurm_cluster\n")
    problems = "\n".join(version_sensitive_problems(tmp_path))
    assert "test_direct branches" in problems and "test_through_helper branches" in problems
    assert "version_sensitive without a reason" in problems
    assert "test_marked" not in problems and "test_plain" not in problems


def test_time_scale_follows_the_variable_else_the_load_per_core(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(processes.TIME_SCALE_VAR, "3")
    assert processes.time_scale() == 3.0 and processes.scaled(10) == 30.0
    monkeypatch.setenv(processes.TIME_SCALE_VAR, "0.5")  # never shorter than written
    assert processes.time_scale() == 1.0
    monkeypatch.setenv(processes.TIME_SCALE_VAR, "fast")
    with pytest.raises(ValueError, match="not a number"):
        processes.time_scale()
    monkeypatch.delenv(processes.TIME_SCALE_VAR)
    monkeypatch.setattr(os, "getloadavg", lambda: (10.0, 0.0, 0.0))
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert processes.time_scale() == 5.0  # load 10 on two cores
    monkeypatch.setattr(os, "getloadavg", lambda: (100.0, 0.0, 0.0))
    assert processes.time_scale() == processes.MAX_TIME_SCALE
    monkeypatch.setattr(os, "getloadavg", lambda: (0.3, 0.0, 0.0))
    assert processes.time_scale() == 1.0


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to ask as another account (runuser)")
def test_a_checkout_below_a_0700_folder_is_named_as_out_of_reach() -> None:
    """The session-start check names the folder that keeps the Slurm accounts out (a clone in root's 0700
    home gave 32 failures that each looked like a product bug) and passes a reachable path."""
    outer = Path(tempfile.mkdtemp(prefix="gpushare-0700-", dir="/tmp"))
    try:
        python = outer / "clone" / ".venv" / "bin" / "python"
        python.parent.mkdir(parents=True)
        python.write_text("#!/bin/sh\n")
        python.chmod(0o755)
        for folder in (outer / "clone", outer / "clone" / ".venv", python.parent):
            folder.chmod(0o755)
        outer.chmod(0o700)
        (outer / "clone").chmod(0o750)  # closed too, behind the first: named in the same line
        assert unreachable_folder(python, SLURM_USER) == outer
        line = checkout_out_of_reach([python], [SLURM_USER, "nobody"])
        assert line is not None and "\n" not in line
        assert f"{SLURM_USER} cannot pass {outer} to reach {python}" in line
        assert line.endswith(f"chmod o+x {outer} {outer / 'clone'}")
        (outer / "clone").chmod(0o755)
        outer.chmod(0o711)  # search only: enough
        assert unreachable_folder(python, SLURM_USER) is None
        assert checkout_out_of_reach([python, outer / "clone"], [SLURM_USER, "nobody"]) is None
        assert subprocess.run(["runuser", "-u", SLURM_USER, "--", "test", "-x", str(python)]).returncode == 0
    finally:
        subprocess.run(["rm", "-rf", str(outer)], check=False)


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="needs root and unshare (util-linux)")
def test_the_open_view_lets_the_slurm_account_through_and_leaves_the_disk_as_it_was() -> None:
    """What a Slurm session from a clone in a 0700 folder runs in: the closed folders searchable inside a
    private mount namespace, the checkout itself the real one (what is written there stays), and outside
    nothing changed and no scratch folder left."""
    outer = Path(tempfile.mkdtemp(prefix="gpushare-0700-", dir="/tmp"))
    try:
        clone = outer / "home" / "clone"
        clone.mkdir(parents=True)
        (clone / "hook").write_text("#!/bin/sh\necho reached\n")
        (clone / "hook").chmod(0o755)
        clone.chmod(0o755)
        (outer / "home").chmod(0o700)
        outer.chmod(0o700)
        closed = closed_folders(clone / "hook", SLURM_USER)
        assert closed == [outer, outer / "home"]
        before = set(Path("/tmp").glob("gpushare-open-view-*"))
        argv = open_view_argv(closed, [clone], ["sh", "-c", f"runuser -u {SLURM_USER} -- {clone}/hook && "
                                                            f"echo kept > {clone}/written"])
        assert argv is not None
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        assert (done.returncode, done.stdout) == (0, "reached\n"), done.stderr
        assert (clone / "written").read_text() == "kept\n"  # on disk: the checkout was the real one
        assert (outer.stat().st_mode & 0o777, (outer / "home").stat().st_mode & 0o777) == (0o700, 0o700)
        assert set(Path("/tmp").glob("gpushare-open-view-*")) == before
        assert unreachable_folder(clone / "hook", SLURM_USER) == outer  # outside the view: closed as before
    finally:
        subprocess.run(["rm", "-rf", str(outer)], check=False)


def test_test_sessions_side_by_side_hold_different_slots_and_multihost_addresses() -> None:
    """Two sessions (or pytest-xdist workers) at once: each holds a slot of its own, and a multi-host cluster
    puts its hosts on the slot's own loopback range, so two of them never bind the same address:port."""
    from devcluster import slots
    from devcluster.multihost import MultiHostCluster, read_description

    mine = slots.slot()
    assert slots.slot() == mine  # held, not taken again
    code = "from devcluster.slots import slot; print(slot())"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           cwd=Path(__file__).resolve().parents[2])
    assert int(other.stdout) != mine
    written = [h.address for h in read_description()]
    assert all(a.startswith("127.0.10.") for a in written)
    assert [h.address for h in MultiHostCluster(Path("/nonexistent"), slot=0).hosts] == written
    beside = [h.address for h in MultiHostCluster(Path("/nonexistent"), slot=3).hosts]
    assert beside == [a.replace("127.0.10.", "127.0.13.") for a in written]


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="needs root and unshare (util-linux)")
def test_a_multihost_clusters_leftovers_are_its_own_hosts_processes_never_another_sessions(tmp_path: Path) -> None:
    """Two test sessions side by side: stopping one cluster must not SIGKILL the other's daemons. A mount
    namespace's number is handed to the next namespace as soon as its last process exits (here: a one-shot
    command on one of our hosts, then another session's daemon), so a process is ours when it sees one of our
    hosts' own /etc/hosts, never because its namespace number was once ours."""
    from devcluster.multihost import MultiHostCluster

    ours, theirs = MultiHostCluster(tmp_path / "ours"), MultiHostCluster(tmp_path / "theirs")
    for cluster in (ours, theirs):
        for host in cluster.hosts:
            cluster.host_dir(host.name).mkdir(parents=True)
            (cluster.host_dir(host.name) / "hosts").write_text(f"{host.address} {host.name}\n")

    def on_host(cluster: MultiHostCluster, command: str) -> subprocess.Popen[str]:
        hosts = cluster.host_dir(cluster.hosts[0].name) / "hosts"
        return subprocess.Popen(["unshare", "--mount", "--propagation", "private", "--", "/bin/sh", "-c",
                                 f"mount --bind {hosts} /etc/hosts && readlink /proc/self/ns/mnt && {command}"],
                                stdout=subprocess.PIPE, text=True, start_new_session=True)

    one_shot = on_host(ours, "true")
    used = one_shot.communicate(timeout=30)[0].strip()
    daemon_of_theirs, daemon_of_ours = on_host(theirs, "exec sleep 60"), on_host(ours, "exec sleep 60")
    try:
        assert daemon_of_theirs.stdout is not None and daemon_of_ours.stdout is not None
        reused = daemon_of_theirs.stdout.readline().strip()
        daemon_of_ours.stdout.readline()
        found = ours.leftover_pids()
        assert daemon_of_ours.pid in found
        assert daemon_of_theirs.pid not in found, f"namespace {reused} (was ours: {used})"
        assert set(found) & set(theirs.leftover_pids()) == set()
    finally:
        for proc in (daemon_of_theirs, daemon_of_ours):
            proc.kill()
            proc.wait()
