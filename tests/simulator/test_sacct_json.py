"""``sacct --json`` of each supported release, and measured peaks from gpushare's AdminComment record."""

import json

import pytest
from click.testing import CliRunner

from gpushare.simulator import sacct, trace
from gpushare.simulator.cli import command

RUN = 'gpushare:{"v":1,"decision":"shard","run":{"peak_gib":5.25,"ttfk_s":31.0}}'


def _wrapped(n):
    return {"set": True, "infinite": False, "number": n}


def _jobs(shape):
    """Three GPU jobs and two others as each release prints them (22.05: plain numbers and a state string;
    23.02+: a state list; 24.11+/26.05: numbers wrapped as {set, infinite, number})."""
    num = _wrapped if shape == "24.11" else (lambda n: n)
    state = (lambda s: {"current": [s], "reason": "None"}) if shape != "22.05" else (lambda s: {"current": s})

    def job(job_id, submit, start, end, tres, comment=None, current="COMPLETED"):
        record = {"job_id": job_id, "state": state(current),
                  "time": {"submission": num(submit), "start": num(start), "end": num(end), "elapsed": num(end - start)},
                  "tres": {"allocated": [{"type": "cpu", "name": None, "id": 1, "count": num(2)}] +
                           [{"type": "gres", "name": n, "id": 1001, "count": num(c)} for n, c in tres]}}
        if shape == "22.05":
            record["comment"] = {"administrator": comment, "job": None, "system": None}
        else:
            record["admin_comment"] = comment or ""
        return record

    t = 1_795_000_000
    return json.dumps({"meta": {}, "errors": [], "jobs": [
        job(201, t, t + 60, t + 3660, [("gpu", 2)]),
        job(202, t + 300, t + 360, t + 2160, [("shard", 12)], comment=RUN),
        job(203, t + 400, t + 400, t + 1000, [("gpu:a100", 1)], comment="a note from an admin"),
        job(204, t + 500, 0, 0, [("gpu", 1)], current="PENDING"),
        job(205, t + 600, t + 600, t + 660, []),
    ]})


@pytest.mark.parametrize("shape", ["22.05", "23.02", "24.11"])
def test_sacct_json_of_every_release_converts(shape):
    text = sacct.convert(_jobs(shape), "jobs.json", mem_gib=6)
    assert text.splitlines() == [
        "job_id,submit_s,gpus,duration_s,mem_gib,util",
        "201,0,2,3600,6,medium",      # 2 GPUs, no record -> --mem-gib
        "202,300,1,1800,5.25,medium",  # shard=12, but the run record measured 5.25 GiB
        "203,400,1,600,6,medium",      # typed GPU, a foreign comment is not ours
    ]  # 204 never ran, 205 had no GPU


def test_parsable2_takes_the_measured_peak_too():
    text = ("JobID|Submit|Start|End|AllocTRES|State|AdminComment\n"
            f"7|2026-11-20T10:00:00|2026-11-20T10:01:00|2026-11-20T11:01:00|gres/shard=12|COMPLETED|{RUN}\n")
    assert sacct.convert(text, "jobs.txt").splitlines()[1] == "7,0,1,3600,5.25,medium"


def test_bad_json_is_one_line_error():
    with pytest.raises(trace.TraceError, match="jobs.json: no 'jobs' list"):
        sacct.convert('{"meta": {}}', "jobs.json")
    with pytest.raises(trace.TraceError, match="jobs.json: not valid JSON"):
        sacct.convert("{not json", "jobs.json")


def test_live_stack_replays_an_imported_export(tmp_path):
    path = tmp_path / "trace.csv"
    path.write_text(sacct.convert(_jobs("24.11"), "jobs.json"))
    result = CliRunner().invoke(command, ["--trace", str(path), "--policy", "live", "--slurm", "24.11",
                                          "--gpus-per-node", "2", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["summary"]["completed"] == 3
