"""The "note" request EpilogSlurmctld sends gpushare-submitd when it runs as an unprivileged SlurmUser.

The service writes as the job's user to the log Slurm's record names; the request only names the job.
Anything else in it is refused with one line, and a note that cannot be written never breaks the answer.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpushare.config import parse_config
from gpushare.slurm_plugins.submitd import SubmitServer


@pytest.fixture
def server(tmp_path: Path):  # type: ignore[no-untyped-def]
    cfg = parse_config({"submit": {"socket": str(tmp_path / "s.sock"), "cache_dir": str(tmp_path / "cache")},
                        "oom": {"ledger_dir": str(tmp_path / "ledger")},
                        "slurm": {"conf": str(tmp_path / "slurm.conf"), "bin_dir": str(tmp_path / "no-slurm")}})
    (tmp_path / "slurm.conf").write_text("SlurmUser=root\n")
    srv = SubmitServer(str(tmp_path / "s.sock"), cfg)
    yield srv
    srv.server_close()


@pytest.mark.parametrize("job_id", ["١٢", "12 ", "-1", "1;id", "", "12345678901", None, 3.5])
def test_a_note_for_anything_but_a_job_id_is_refused(server: SubmitServer, job_id: object) -> None:
    line = json.dumps({"op": "note", "job_id": job_id, "message": "gpushare: requeued"}).encode() + b"\n"
    decision, _ = server.decide_line(line)
    assert decision.action == "accept" and decision.user_message.startswith("not written"), decision


def test_a_note_slurm_cannot_place_is_reported_not_raised(server: SubmitServer) -> None:
    line = json.dumps({"op": "note", "job_id": "42", "message": "gpushare: requeued"}).encode() + b"\n"
    decision, job = server.decide_line(line)  # no Slurm tools where [slurm] bin_dir points
    assert decision.action == "accept" and decision.user_message.startswith("not written"), decision
    assert job == "note for job 42"


@pytest.mark.parametrize("token", ["", "../../etc", "ABCDEF012345", "0123456789abc", None])
def test_a_copy_request_needs_a_copy_token_of_twelve_hex_digits(server: SubmitServer, token: object) -> None:
    """The token becomes part of file names the service creates or removes as the job's user."""
    for step in ("keep", "restore"):
        line = json.dumps({"op": "note", "job_id": "42", "run": 0, "step": step, "token": token}).encode() + b"\n"
        decision, _ = server.decide_line(line)
        assert decision.user_message.startswith("not written: note: token"), decision
