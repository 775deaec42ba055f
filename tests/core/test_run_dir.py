"""gpushare.run_dir: the node's runtime folders are made searchable by every user, whatever the umask and
whoever comes first (the hard cap shim reads its limits below them as the job's user)."""
from __future__ import annotations

import os
import shutil
import stat
import tempfile
from pathlib import Path

import pytest

from gpushare.run_dir import make_run_dir, reachable_by_others


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_folders_are_made_0755_under_a_tight_umask(tmp_path: Path) -> None:
    old = os.umask(0o077)
    try:
        made = make_run_dir(tmp_path / "run" / "gpushare" / "hardcap")
    finally:
        os.umask(old)
    assert made == tmp_path / "run" / "gpushare" / "hardcap"
    assert [mode(p) for p in (made.parent.parent, made.parent, made)] == [0o755] * 3


def test_an_own_folder_others_cannot_search_is_opened_and_others_left_alone(tmp_path: Path) -> None:
    shut = tmp_path / "shut"
    shut.mkdir()
    os.chmod(shut, 0o700)
    make_run_dir(shut)
    assert mode(shut) == 0o755
    sticky = tmp_path / "sticky"  # like /tmp: searchable, so not touched (its sticky and write bits kept)
    sticky.mkdir()
    os.chmod(sticky, 0o1777)
    make_run_dir(sticky)
    assert stat.S_IMODE(os.stat(sticky).st_mode) == 0o1777
    inside = tmp_path / "shut2" / "inside"  # an existing parent is not the caller's to change
    inside.parent.mkdir()
    os.chmod(inside.parent, 0o700)
    make_run_dir(inside)
    assert mode(inside.parent) == 0o700 and mode(inside) == 0o755


def test_a_link_or_a_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(NotADirectoryError):
        make_run_dir(tmp_path / "link")
    (tmp_path / "file").write_text("")
    with pytest.raises(NotADirectoryError):
        make_run_dir(tmp_path / "file")


def test_reachable_by_others_names_the_first_folder_that_is_not() -> None:
    base = Path(tempfile.mkdtemp(dir="/tmp"))
    try:
        os.chmod(base, 0o755)
        run = base / "run"
        run.mkdir()
        os.chmod(run, 0o700)
        assert reachable_by_others(run / "hardcap" / "job_1") == (False, str(run))
        os.chmod(run, 0o711)
        assert reachable_by_others(run / "hardcap" / "job_1") == (True, str(run))
    finally:
        shutil.rmtree(base)
