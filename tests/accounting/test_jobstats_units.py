"""The stored record's writer against a stand-in for Slurm's tools, and jobstats' summary and advice (pure)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from gpushare.epilog import jobstats_cli, stored_record
from gpushare.slurm import record as record_format
from gpushare.slurm.client import SlurmError

RECORD = {"node": "n1", "ttfk_s": 1.5, "ttfk_source": "kernel", "end": 2_000_000_000.0, "exit_code": 0,
          "caps": {"mode": "mps", "mem_limit_mib": 9216},
          "gpus": {"0": {"energy_j": 100.0, "share_j": 50.0, "peak_bytes": 3 << 30}},
          "series": {"0": [[1.0, 0, 0, 0.5], [2.0, 0, 0, 0.3]]}}


class FakeDatabase:
    """sacct/sacctmgr as slurmdbd answers them: rows of one job (id, state, start, end, SystemComment,
    AdminComment); sacctmgr stores quotes as backticks."""

    def __init__(self, rows: list[list[str]], ended_after: int = 0, disabled: bool = False,
                 live: str | None = None) -> None:
        self.rows, self.ended_after, self.disabled, self.calls = rows, ended_after, disabled, []
        self.live = live  # slurmctld's in-memory AdminComment of the job; None: slurmctld no longer holds it

    def job(self, job_id: str) -> SimpleNamespace | None:
        self.calls.append(("job", job_id))
        return SimpleNamespace(admin_comment=self.live) if self.live is not None else None

    def run(self, tool: str, *args: str, **_: object) -> str:
        self.calls.append((tool, *args))
        if self.disabled:
            raise SlurmError("sacct: Slurm accounting storage is disabled")
        if tool == "sacct":
            assert "--delimiter=\x1f" in args
            if self.ended_after > 0:
                self.ended_after -= 1
                return "\x1f".join(["7", "RUNNING", "2033-05-18T03:00:00", "Unknown", *self.rows[-1][4:]]) + "\n"
            return "".join("\x1f".join(r) + "\n" for r in self.rows)
        assert tool == "sacctmgr" and args[:6] == ("-i", "modify", "job", "where", "jobid=7", "set")
        for item in args[6:]:
            key, _, value = item.partition("=")
            self.rows[-1][{"SystemComment": 4, "AdminComment": 5}[key]] = value.replace('"', "`")
        return ""


def row(comment: str, start: str = "2033-05-18T03:00:00", state: str = "COMPLETED", system: str = "") -> list[str]:
    return ["7", state, start, "2033-05-18T03:33:00", system, comment]


def test_store_waits_for_the_end_then_merges_into_the_stored_comment():
    db = FakeDatabase([row('gpushare:{"v":1,"decision":"shared","est_gib":8.0}')], ended_after=2)
    outcome = stored_record.store(db, "7", RECORD, wait_s=0)
    assert (outcome.result, outcome.reads, outcome.writes) == ("stored", 4, 1)
    assert db.rows[-1][4] == db.rows[-1][5]  # SystemComment, mirrored in the AdminComment that was ours
    stored = record_format.parse(db.rows[-1][4])
    assert "`" in db.rows[-1][4] and stored["decision"] == "shared" and stored["est_gib"] == 8.0
    assert stored["run"] == {"node": "n1", "ttfk_s": 1.5, "ttfk_src": "kernel", "energy_j": 100.0, "share_j": 50.0,
                             "peak_gib": 3.0, "exit": 0, "caps": "mps", "cap_gib": 9.0, "gpus": {"0": [3.0, 40.0]}, "fin": 1}


@pytest.mark.parametrize("db, result", [
    (FakeDatabase([], disabled=True), "no accounting database"),
    (FakeDatabase([row("site: do not touch", system="slurm: burst buffer")]), "the stored comments are not ours"),
    (FakeDatabase([row(""), row("", start="2040-01-01T00:00:00")]), "the newest run in the database is a later one"),
    (FakeDatabase([row("")], ended_after=99), "the database did not show the job ended after 3 reads"),
])
def test_store_leaves_alone_what_is_not_its_to_write(db, result):
    assert stored_record.store(db, "7", RECORD, tries=3, wait_s=0).result == result
    assert not [c for c in db.calls if c[0] == "sacctmgr"]


def test_a_site_summary_in_the_admin_comment_stays_and_ours_goes_to_the_system_comment():
    """Princeton's jobstats overwrites the database's AdminComment with ``JS1:<summary>``, before or after our
    Epilog: the run summary goes into SystemComment, the controller's keys come from slurmctld's copy, and a
    summary written over the AdminComment afterwards leaves ours readable."""
    js1 = "JS1:H4sIAAAAAAAAA6tWKkktLlGyUlAqS8wpTVWqBQB0WVd+EwAAAA=="
    db = FakeDatabase([row(js1)], live='gpushare:{"v":1,"decision":"shared","run":{"node":"n1","peak_gib":0.5}}')
    assert stored_record.store(db, "7", RECORD, wait_s=0).stored
    assert db.rows[-1][5] == js1
    found = record_format.parse(db.rows[-1][4])
    assert found["decision"] == "shared" and found["run"]["fin"] == 1 and found["run"]["peak_gib"] == 3.0
    db = FakeDatabase([row(js1)])  # slurmctld no longer holds the job: the run summary alone
    assert stored_record.store(db, "7", RECORD, wait_s=0).stored and ("job", "7") in db.calls
    assert set(record_format.parse(db.rows[-1][4])) == {"v", "run"} and db.rows[-1][5] == js1

    ours = 'gpushare:{"v":1,"decision":"shared","run":{"node":"n1"}}'
    db = FakeDatabase([row(ours)])
    assert stored_record.store(db, "7", RECORD, wait_s=0).stored
    db.rows[-1][5] = js1  # the site's EpilogSlurmctld, a few seconds later
    found = record_format.stored(db.rows[-1][5], db.rows[-1][4])
    assert found["decision"] == "shared" and found["run"]["fin"] == 1


def test_stored_reads_both_fields_and_old_records():
    old = 'gpushare:{"v":1,"decision":"shared","run":{"peak_gib":1.0}}'
    assert record_format.stored(old, "")["run"] == {"peak_gib": 1.0}  # a record stored before SystemComment
    final = 'gpushare:{`v`:1,`decision`:`shared`,`run`:{`peak_gib`:2.0,`fin`:1}}'
    newer = 'gpushare:{"v":1,"decision":"shared","oom":{"n":1},"run":{"peak_gib":1.0}}'
    found = record_format.stored(newer, final)
    assert found["run"] == {"peak_gib": 2.0, "fin": 1} and found["oom"] == {"n": 1}
    assert record_format.stored("JS1:abc", "") is None and record_format.stored("JS1:abc", final)["run"]["fin"] == 1


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
        return "\x1f".join(["104", "100_4", "alice", "COMPLETED", "0:0", "00:00:09", "n1", "gres/shard=3", "", ""]) + "\n"


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
    assert "RUNNING" in text and "running for 60 s" in text
    assert "its measurements so far are on its node: srun --jobid=10 --overlap gpushare jobstats 10" in text
    live = jobstats_cli.summarise([{"JobID": "10", "User": "alice", "State": "RUNNING", "ExitCode": "0:0",
                                    "Elapsed": "00:01:00", "NodeList": "n1", "AllocTRES": "gres/shard=14",
                                    "AdminComment": comment(decision="shared")}], live={"peak_gib": 3.5, "ttfk_s": 2.0})
    text = jobstats_cli.render(live)
    assert live["live"] and "(measured so far, live from the agent on its node)" in text
    assert "used at most 3.50 GiB (25 % of it)" in text


def test_an_observed_job_says_what_enforce_would_have_done():
    record = comment(decision="observe", would="shared", new="gres:shard:5", est_gib=4.0,
                     run={"peak_gib": 8.0, "would": {"cap_gib": 5.0, "stop": "backstop", "over_gib": 8.0}})
    doc = jobstats_cli.summarise([sacct_row(record, tres="gres/gpu=1,gres/gpu:a100-40gb=1")])
    assert doc["would"] == {"new": "shard:5", "cap_gib": 5.0, "stop": "backstop", "over_gib": 8.0}
    assert ("observe mode: it would have shared a GPU as shard:5 with a 5.00 GiB cap; the backstop would have "
            "stopped it at 8.00 GiB") in jobstats_cli.render(doc)
    assert jobstats_cli.summarise([sacct_row(comment(decision="shared", run={"peak_gib": 1.0}))])["would"] is None
