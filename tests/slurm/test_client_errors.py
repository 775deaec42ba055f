"""A failed Slurm command's error carries Slurm's words apart from the command line: the log line "AdminComment
not updated (...)" once showed the tail of the record being written instead of why Slurm refused it."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpushare.slurm.client import SlurmClient, SlurmError


def test_the_reason_is_slurms_words_without_the_arguments(tmp_path: Path) -> None:
    scontrol = tmp_path / "scontrol"
    scontrol.write_text("#!/bin/sh\necho 'slurm_update error: Job/step already completing or completed' >&2\nexit 1\n")
    scontrol.chmod(0o755)
    record = 'gpushare:{"run":{"peak_gib":[3.0,0.0]},"node":"n1"},"v":1}'
    with pytest.raises(SlurmError) as failed:
        SlurmClient(bin_dir=str(tmp_path)).update_job(7, admincomment=record)
    assert failed.value.reason == "scontrol update: slurm_update error: Job/step already completing or completed"
    assert record in str(failed.value)  # the whole command stays in the message itself
