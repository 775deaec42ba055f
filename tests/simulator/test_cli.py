"""`gpushare simulate` end to end: determinism per seed, JSON, plots, errors; sacct conversion; MIG mix."""

import json

import pytest
from click.testing import CliRunner

from gpushare.gpus import BUILTIN_GPUS
from gpushare.simulator import sacct, trace
from gpushare.simulator.cli import command, data_dir
from gpushare.simulator.mig import run_mix

DATA = data_dir(None)


def simulate(*args):
    result = CliRunner().invoke(command, list(args))
    return result


def test_same_seed_same_result_other_seed_other_result():
    first = simulate("--policy", "magm", "--estimator", "none", "--seed", "4", "--json")
    again = simulate("--policy", "magm", "--estimator", "none", "--seed", "4", "--json")
    other = simulate("--policy", "magm", "--estimator", "none", "--seed", "5", "--json")
    assert first.exit_code == 0, first.output
    assert first.output == again.output
    assert json.loads(first.output)["summary"] != json.loads(other.output)["summary"]


def test_the_calibrated_utilisation_is_the_default():
    """docs/benchmarks.md's figures are made under --util carma-fit: the default, in the CLI and the API."""
    from gpushare.simulator.engine import SimConfig

    assert SimConfig().util == "carma-fit"
    runs = {util: simulate("--policy", "lug", "--estimator", "none", "--json", *util) for util in
            ((), ("--util", "carma-fit"), ("--util", "classes"))}
    assert all(r.exit_code == 0 for r in runs.values()), [r.output for r in runs.values()]
    summary = {util: json.loads(r.output)["summary"] for util, r in runs.items()}
    assert summary[()] == summary[("--util", "carma-fit")]
    assert summary[()] != summary[("--util", "classes")]  # the assumed classes stay selectable


def test_json_document_and_plots(tmp_path):
    result = simulate("--policy", "lug", "--json", "--plot", str(tmp_path))
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["version"] == 1 and doc["summary"]["jobs"] == 60 and len(doc["jobs"]) == 60
    assert doc["summary"]["interference_measured"] is True
    assert [g["index"] for g in doc["gpus"]] == [0, 1, 2] and doc["gpus"][0]["steps"][0][0] == 0
    for name in ("memory.png", "utilisation.png", "jobs.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"


def test_json_document_is_written_one_row_per_line_and_holds_what_the_records_hold():
    """``--json`` streams its document (a large run's rows are not all built and then joined): one line per
    job and per GPU, the same content as the records the report functions return."""
    from gpushare.simulator import report
    from gpushare.simulator.engine import SimConfig
    from gpushare.simulator.runner import simulation

    sim = simulation(trace.read(DATA / "carma_trace1.csv", seed=0),
                     SimConfig(nodes=1, gpus_per_node=3, gpu="a100-40gb", policy="lug", estimator="none")).run()
    text = report.to_json(sim)
    lines = text.splitlines()
    assert len(lines) == 4 + len(sim.jobs) + len(sim.gpus) and lines[0] == '{"version":1,'
    doc = json.loads(text)
    assert doc == report.clean({"version": 1, "summary": report.summarise(sim), "jobs": report.job_records(sim),
                                "gpus": report.gpu_timelines(sim)})
    assert simulate("--policy", "lug", "--json").stdout.splitlines()[2] == '"jobs":['  # the command streams it
    sim.jobs[min(sim.jobs)].exec_s = float("nan")  # not JSON: written as null
    assert json.loads(report.to_json(sim))["jobs"][0]["exec_s"] is None


def test_bad_trace_line_is_one_line_error(tmp_path):
    bad = tmp_path / "t.csv"
    bad.write_text("0,1\n600,one\n")
    result = simulate("--trace", str(bad))
    assert result.exit_code == 1
    assert result.output.strip() == f"Error: {bad}:2: num_tasks must be a number, got 'one'"


def test_bad_policy_and_estimator(tmp_path):
    good = tmp_path / "t.csv"
    good.write_text("0,1\n")
    assert "unknown policy" in simulate("--trace", str(good), "--policy", "best").output
    assert "noisy:SIGMA" in simulate("--trace", str(good), "--estimator", "noisy:x").output


def test_text_report_without_measured_data(tmp_path):
    good = tmp_path / "t.csv"
    good.write_text("0,1\n10,1\n")
    result = simulate("--trace", str(good), "--data-dir", str(tmp_path), "--policy", "ff", "--estimator", "gpu-estimate")
    assert result.exit_code == 0, result.output
    assert "jobs 2: 2 completed" in result.output and "fallback model only" in result.output


SACCT = """JobID|Submit|Start|End|AllocTRES|State
101|2026-11-20T10:00:00|2026-11-20T10:00:05|2026-11-20T11:00:05|billing=1,cpu=4,gres/gpu=2,node=1|COMPLETED
101.batch|2026-11-20T10:00:05|2026-11-20T10:00:05|2026-11-20T11:00:05|cpu=4|COMPLETED
102|2026-11-20T10:05:00|2026-11-20T10:06:00|2026-11-20T10:36:00|cpu=2,gres/shard=12,node=1|COMPLETED
103|2026-11-20T10:06:00|Unknown|Unknown|cpu=2,gres/gpu=1|PENDING
104|2026-11-20T10:07:00|2026-11-20T10:07:00|2026-11-20T10:08:00|cpu=2,mem=4G|COMPLETED
"""


def test_sacct_export_converts_to_a_trace():
    text = sacct.convert(SACCT, "jobs.txt", mem_gib=6)
    assert text.splitlines() == [
        "job_id,submit_s,gpus,duration_s,mem_gib,util",
        "101,0,2,3600,6,medium",     # 2 GPUs, 1 h, no shards -> --mem-gib
        "102,300,1,1800,12,medium",  # shard=12 -> one GPU, 12 GiB
    ]  # 103 never ran, 104 had no GPU, 101.batch is a step
    jobs = trace.parse(text, "trace.csv")
    assert [j.gpus for j in jobs] == [2, 1]


def test_sacct_export_without_needed_columns():
    with pytest.raises(trace.TraceError, match="lacks Start, End"):
        sacct.convert("JobID|Submit|AllocTRES\n1|2026-11-20T10:00:00|gres/gpu=1\n", "x")


def test_mig_mix_scheme_a_reconfigures_less_and_beats_sequential():
    jobs = trace.parse("job_id,submit_s,model,batch\n" + "".join(
        f"s{i},0,resnet18,32\nm{i},0,mobilenet_v2,32\nl{i},0,vgg16,64\n" for i in range(4)), "mix.csv")
    out = run_mix(BUILTIN_GPUS["a100-40gb"], jobs, gpus=1)
    base, a, b = out["baseline"], out["scheme_A"], out["scheme_B"]
    assert base["makespan_s"] == pytest.approx(sum(j.solo_s for j in jobs))
    assert a["reconfigurations"] <= b["reconfigurations"]
    assert a["throughput_jobs_per_h"] > base["throughput_jobs_per_h"]
    assert not a["unschedulable"]


def test_cli_mig_policy(tmp_path):
    mix = tmp_path / "mix.csv"
    mix.write_text("submit_s,model,batch\n0,resnet50,32\n0,DLRM,8\n")
    result = simulate("--trace", str(mix), "--policy", "mig-b", "--gpus-per-node", "1")
    assert result.exit_code == 0, result.output
    assert "reconfigurations" in result.output
    assert simulate("--trace", str(mix), "--policy", "mig-a", "--gpu", "l40s-48gb").exit_code == 2


def test_several_policies_and_seeds_run_in_processes_in_order():
    result = simulate("--policy", "exclusive,magm", "--seeds", "0-1", "--workers", "2", "--json", "--no-progress")
    assert result.exit_code == 0, result.output
    runs = json.loads(result.stdout)["runs"]
    assert [(r["policy"], r["seed"]) for r in runs] == [("exclusive", 0), ("exclusive", 1), ("magm", 0), ("magm", 1)]
    alone = json.loads(simulate("--policy", "magm", "--seed", "1", "--json").output)["summary"]
    assert runs[3] == alone  # a worker process gives what a single run gives
    text = simulate("--policy", "exclusive,magm", "--seeds", "0,1", "--workers", "1", "--progress")
    assert text.exit_code == 0, text.output
    assert "| magm | oracle | mean of 2 |" in text.output and "2/4 runs" in text.output  # the bar (stderr mixed in)


def test_bad_seed_list_is_one_line_error():
    result = simulate("--policy", "magm", "--seeds", "0-x")
    assert result.exit_code == 2 and "--seeds" in result.output and "0-x" in result.output
