"""The stored record's writer against a stand-in for Slurm's tools, and jobstats' summary and advice (pure)."""

from __future__ import annotations

import json

import pytest

from gpushare.epilog import jobstats_cli, stored_record
from gpushare.slurm import record as record_format
from gpushare.slurm.client import SlurmError

RECORD = {"node": "n1", "ttfk_s": 1.5, "ttfk_source": "kernel", "end": 2_000_000_000.0, "exit_code": 0,
          "caps": {"mode": "mps", "mem_limit_mib": 9216},
          "gpus": {"0": {"energy_j": 100.0, "share_j": 50.0, "peak_bytes": 3 << 30}},
          "series": {"0": [[1.0, 0, 0, 0.5], [2.0, 0, 0, 0.3]]}}


class FakeDatabase:
    """sacct/sacctmgr as slurmdbd answers them: rows of one job; sacctmgr stores quotes as backticks."""

    def __init__(self, rows: list[list[str]], ended_after: int = 0, disabled: bool = False) -> None:
        self.rows, self.ended_after, self.disabled, self.calls = rows, ended_after, disabled, []

    def run(self, tool: str, *args: str, **_: object) -> str:
        self.calls.append((tool, *args))
        if self.disabled:
            raise SlurmError("sacct: Slurm accounting storage is disabled")
        if tool == "sacct":
            if self.ended_after > 0:
                self.ended_after -= 1
                return "7|RUNNING|2033-05-18T03:00:00|Unknown|" + self.rows[-1][4] + "\n"
            return "".join("|".join(r) + "\n" for r in self.rows)
        assert tool == "sacctmgr" and args[:5] == ("-i", "modify", "job", "where", "jobid=7")
        self.rows[-1][4] = args[-1].removeprefix("AdminComment=").replace('"', "`")
        return ""


def row(comment: str, start: str = "2033-05-18T03:00:00", state: str = "COMPLETED") -> list[str]:
    return ["7", state, start, "2033-05-18T03:33:00", comment]


def test_store_waits_for_the_end_then_merges_into_the_stored_comment():
    db = FakeDatabase([row('gpushare:{"v":1,"decision":"shared","est_gib":8.0}')], ended_after=2)
    outcome = stored_record.store(db, "7", RECORD, wait_s=0)
    assert (outcome.result, outcome.reads, outcome.writes) == ("stored", 4, 1)
    stored = record_format.parse(db.rows[-1][4])
    assert "`" in db.rows[-1][4] and stored["decision"] == "shared" and stored["est_gib"] == 8.0
    assert stored["run"] == {"node": "n1", "ttfk_s": 1.5, "ttfk_src": "kernel", "energy_j": 100.0, "share_j": 50.0,
                             "peak_gib": 3.0, "exit": 0, "caps": "mps", "cap_gib": 9.0, "gpus": {"0": [3.0, 40.0]}, "fin": 1}


@pytest.mark.parametrize("db, result", [
    (FakeDatabase([], disabled=True), "no accounting database"),
    (FakeDatabase([row("site: do not touch")]), "the stored AdminComment is not ours"),
    (FakeDatabase([row(""), row("", start="2040-01-01T00:00:00")]), "the newest run in the database is a later one"),
    (FakeDatabase([row("")], ended_after=99), "the database did not show the job ended after 3 reads"),
])
def test_store_leaves_alone_what_is_not_its_to_write(db, result):
    assert stored_record.store(db, "7", RECORD, tries=3, wait_s=0).result == result
    assert not [c for c in db.calls if c[0] == "sacctmgr"]


def test_the_database_copy_reads_back_even_lowercased_by_22_05():
    text = record_format.render({"why": "it's `GiB`", "run": {"peak_gib": 2.5}})
    assert "`" not in text and "'" not in text
    assert record_format.parse(text.replace('"', "`"))["why"] == "it's `GiB`"
    assert record_format.parse(text.replace('"', "`").lower())["run"] == {"peak_gib": 2.5}


def sacct_row(comment: str, tres: str = "billing=1,cpu=1,gres/shard=9,mem=100M,node=1", state: str = "COMPLETED",
              ) -> dict[str, str]:
    return {"JobIDRaw": "7", "User": "alice", "State": state, "ExitCode": "0:0", "Elapsed": "00:01:05",
            "NodeList": "n1", "AllocTRES": tres, "AdminComment": comment}


def comment(**fields: object) -> str:
    return (record_format.render(fields) or "").replace('"', "`")


def test_advice_for_a_generous_share_a_fitting_one_and_no_record():
    doc = jobstats_cli.summarise([sacct_row(comment(decision="shared", est_gib=8.0, run={"peak_gib": 2.93}))])
    assert (doc["share_gib"], doc["elapsed_s"], doc["gres"]) == (9.0, 65.0, "shard:9")
    assert doc["advice"] == "this job peaked at 2.93 GiB of its 9 GiB share: next time `#GPUSHARE mem=3G`"
    fitted = jobstats_cli.summarise([sacct_row(comment(run={"peak_gib": 8.1}))])
    assert fitted["advice"] == "its share fitted: it peaked at 8.1 GiB of 9 GiB"
    bare = jobstats_cli.summarise([sacct_row("", tres="cpu=1")])
    assert bare["advice"].startswith("no GPU measurement is stored") and not bare["recorded"]
    json.dumps(bare)  # the --json document is plain JSON


def test_advice_for_a_recovered_oom_and_for_an_exclusive_job():
    oom = {"fam": "pytorch", "from": "gres/shard:5", "to": "gres/gpu:1", "n": 1, "max": 1}
    runs = [sacct_row(comment(oom=oom), state="REQUEUED"),
            sacct_row(comment(oom=oom, run={"peak_gib": 4.2}), tres="gres/gpu=1,gres/gpu:a100-40gb=1")]
    doc = jobstats_cli.summarise(runs)
    assert doc["runs"] == 2 and doc["advice"] == ("an OOM was recovered: the learned floor is now 7.5 GiB; "
                                                  "the rerun peaked at 4.2 GiB")
    whole = jobstats_cli.summarise([sacct_row(comment(decision="exclusive", run={"peak_gib": 4.88}),
                                              tres="gres/gpu=1,gres/gpu:a100-40gb=1")])
    assert whole["advice"] == ("this job peaked at 4.88 GiB of a whole 40 GiB GPU: next time `#GPUSHARE mem=5G` "
                               "lets it share; a 2g.10gb slice would have held it")
    assert "Advice: this job peaked" in jobstats_cli.render(whole)


class FakeSacct:
    """sacct's -P answer for an array task: JobIDRaw 104, JobID 100_4."""

    def run(self, tool: str, *args: str, **_: object) -> str:
        assert tool == "sacct" and args[args.index("-j") + 1] == "100_4"
        return "104|100_4|alice|COMPLETED|0:0|00:00:09|n1|gres/shard=3|\n"


def test_an_array_task_is_found_by_its_array_name():
    runs = jobstats_cli.from_sacct(FakeSacct(), "100_4")
    assert [(r["JobIDRaw"], r["JobID"], r["AllocTRES"]) for r in runs] == [("104", "100_4", "gres/shard=3")]


def test_render_speaks_shares_percent_and_kwh() -> None:
    doc = jobstats_cli.summarise([{
        "JobID": "9", "User": "alice", "State": "COMPLETED", "ExitCode": "0:0", "Elapsed": "00:10:00",
        "NodeList": "n1", "AllocTRES": "cpu=1,gres/shard=14",
        "AdminComment": comment(decision="shared", est_gib=12.0, margin_gib=1.2,
                                run={"node": "n1", "peak_gib": 7.0, "energy_j": 720000.0, "share_j": 360000.0,
                                     "ttfk_s": 2.0})}])
    text = jobstats_cli.render(doc)
    assert "a 14.0 GiB share of a GPU (other jobs, possibly other users', could use the rest)" in text
    assert "used at most 7.00 GiB (50 % of it)" in text
    assert "energy 0.1 kWh this job's part, 0.2 kWh the whole GPU" in text
    running = jobstats_cli.summarise([{"JobID": "10", "User": "alice", "State": "RUNNING", "ExitCode": "0:0",
                                       "Elapsed": "00:01:00", "NodeList": "n1", "AllocTRES": "gres/shard=14",
                                       "AdminComment": comment(decision="shared")}])
    text = jobstats_cli.render(running)
    assert "RUNNING" in text and "running for 60 s" in text and "measurements are stored when the job ends" in text
