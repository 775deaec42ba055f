"""``gpushare jobstats --format csv|json|xdmod`` on sacct rows (pure): each ended GPU job's run with the fraction
of a GPU it held and its GPU-hours, as a site's reporting reads them (docs/agent.md)."""

from __future__ import annotations

import csv
import io
import json

import pytest
from click.testing import CliRunner

from gpushare.epilog import jobstats_cli, jobstats_export
from gpushare.gpus import BUILTIN_GPUS

SEP = "\x1f"
SHARED = 'gpushare:{"v":1,"decision":"shared","est_gib":6.0,"run":{"peak_gib":5.5,"share_j":7200.0,"exit":0}}'


def line(job: str, state: str, alloc: str, elapsed: str = "02:00:00", node: str = "g1", comment: str = "",
         name: str = "train") -> str:
    values = {"JobID": job, "JobIDRaw": job, "Cluster": "c", "Partition": "gpu", "QOS": "normal", "Account": "lab",
              "Group": "users", "GID": "100", "User": "alice", "UID": "1000", "Submit": "2033-05-18T01:00:00",
              "Eligible": "2033-05-18T01:00:00", "Start": "2033-05-18T01:00:00", "End": "2033-05-18T03:00:00",
              "Elapsed": elapsed, "ExitCode": "0:0", "State": state, "NNodes": "1", "NCPUS": "4", "ReqCPUS": "4",
              "ReqMem": "8G", "ReqTRES": "cpu=4", "AllocTRES": alloc, "Timelimit": "1-00:00:00", "NodeList": node,
              "JobName": name, "SystemComment": "", "AdminComment": comment}
    return SEP.join(values[k] for k in jobstats_export.FIELDS)


ROWS = "\n".join([
    line("11", "COMPLETED", "billing=4,cpu=4,gres/shard=20,mem=8G,node=1", comment=SHARED, name="a|b"),
    line("12", "COMPLETED", "billing=4,cpu=4,gres/gpu:a100-40gb=2,gres/gpu=2,mem=8G,node=1", elapsed="1-00:30:00"),
    line("13", "REQUEUED", "cpu=4,gres/shard=10,mem=8G,node=1", node="g9"),  # an ended run; g9's model unknown
    line("14", "RUNNING", "cpu=4,gres/shard=10,mem=8G,node=1"),  # not ended: not exported
    line("15", "COMPLETED", "cpu=4,mem=8G,node=1"),  # no GPU
    line("16", "COMPLETED", "cpu=8,gres/shard=8,mem=8G,node=2", node="g[1-2]"),
]) + "\n"
NODES = {"g1": "a100-80gb", "g2": "a100-80gb"}


def rows() -> list[dict[str, str]]:
    return jobstats_export.parse_rows(ROWS, SEP)


def test_each_ended_gpu_run_gets_its_fraction_of_a_gpu_and_gpu_hours():
    doc = json.loads(jobstats_export.export(rows(), "json", BUILTIN_GPUS, NODES))
    by = {job["job"]: job for job in doc["jobs"]}
    assert sorted(by) == ["11", "12", "13", "16"]
    shared = by["11"]  # shard:20 of an A100-80GB (80 shards, from its node's [[nodes]] group): a quarter
    assert (shared["gpu_type"], shared["basis"], shared["gpu_fraction"], shared["gpu_hours"]) == \
        ("a100-80gb", "shards", 0.25, 0.5)
    assert (shared["decision"], shared["est_gib"], shared["peak_gib"], shared["energy_share_j"]) == \
        ("shared", 6.0, 5.5, 7200.0)
    assert (by["12"]["basis"], by["12"]["gpu_fraction"], by["12"]["gpu_hours"]) == ("gres/gpu", 2.0, 49.0)
    assert (by["13"]["basis"], by["13"]["gpu_fraction"], by["13"]["gpu_hours"]) == ("unknown", None, None)
    assert by["16"]["gpu_fraction"] == 0.1  # a node list: its first node's model
    assert doc["gpu_hours"] == pytest.approx(0.5 + 49.0 + 0.2) and doc["v"] == 1


def test_csv_has_a_header_and_one_line_per_run():
    text = jobstats_export.export(rows(), "csv", BUILTIN_GPUS, NODES)
    table = list(csv.DictReader(io.StringIO(text)))
    assert tuple(table[0]) == jobstats_export.COLUMNS and len(table) == 4
    assert (table[0]["gpu_fraction"], table[0]["gpu_hours"], table[2]["gpu_fraction"]) == ("0.25", "0.5", "")


def test_xdmod_lines_are_its_26_fields_with_the_shared_jobs_fraction_where_it_counts_gpus():
    lines = jobstats_export.export(rows(), "xdmod", BUILTIN_GPUS, NODES).splitlines()
    fields = [text.split("|") for text in lines]
    assert len(lines) == 4 and all(len(f) == 26 for f in fields)
    shared, whole, unknown, _ = fields
    assert shared[22] == "billing=4,cpu=4,gres/shard=20,mem=8G,node=1,gres/gpu=0.25" and shared[25] == "a_b"
    assert whole[22] == "billing=4,cpu=4,gres/gpu:a100-40gb=2,gres/gpu=2,mem=8G,node=1"  # as Slurm has it
    assert "gres/gpu" not in unknown[22]  # no model, no guess
    assert (shared[0], shared[1], shared[14], shared[16]) == ("11", "11", "02:00:00", "COMPLETED")


def test_the_cli_asks_sacct_for_the_period_or_the_jobs(monkeypatch):
    calls = []

    class Client:
        def run(self, *args: str) -> str:
            calls.append(args)
            return ROWS

    monkeypatch.setattr(jobstats_cli, "_client", lambda _: Client())
    monkeypatch.setattr(jobstats_cli, "_node_models", lambda _: NODES)
    done = CliRunner().invoke(jobstats_cli.command, ["--format", "csv", "--since", "7d", "--partition", "gpu"])
    assert done.exit_code == 0, done.output
    # stdout only: a configuration warning on stderr (no gpushare.toml on this host) is not part of the export
    assert done.stdout.splitlines()[0].startswith("job,job_id_raw,") and len(done.stdout.splitlines()) == 5
    args = calls[-1]
    assert args[:6] == ("sacct", "-n", "-P", f"--delimiter={SEP}", "-X", "-D") and "-a" in args and "-S" in args
    assert args[args.index("-r") + 1] == "gpu" and args[args.index("-o") + 1].startswith("JobID,JobIDRaw,Cluster,")
    done = CliRunner().invoke(jobstats_cli.command, ["--format", "xdmod", "11", "12"])
    assert done.exit_code == 0 and calls[-1][-2:] == ("-j", "11,12") and "-a" not in calls[-1]
    assert CliRunner().invoke(jobstats_cli.command, ["11", "12"]).exit_code == 2  # one job without --format
    assert CliRunner().invoke(jobstats_cli.command, ["--format", "json", "--json"]).exit_code == 2
