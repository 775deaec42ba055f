"""Trace formats: Philly arrivals, the rich CSV, and one-line errors with line numbers."""

import pytest

from gpushare.simulator import trace, workload


def test_philly_arrivals_are_cumulative_and_mapped():
    jobs = trace.parse("0,1\n600,1\n# comment\n\n30,2\n", "p.csv", seed=1)
    assert [j.submit_s for j in jobs] == [0, 600, 630]
    assert jobs[2].gpus >= 2
    for job in jobs:
        row = workload.lookup(job.model, job.batch)
        assert job.mem_gib == row.mem_gib and job.solo_s in {row.solo_seconds(e) for e in row.epochs}


def test_mapping_follows_carma_mix_roughly():
    rows = [workload.draw(__import__("random").Random(s))[0].group for s in range(2000)]
    assert 0.25 < rows.count("light") / 2000 < 0.35
    assert 0.07 < rows.count("heavy2") / 2000 < 0.13


def test_rich_format_with_model_and_overrides():
    jobs = trace.parse("job_id,submit_s,model,batch,duration_s\nx,5,resnet50,64,120\ny,1,DLRM,,\n", "r.csv")
    assert [j.job_id for j in jobs] == ["y", "x"]  # sorted by submission
    assert jobs[1].mem_gib == 7.11 and jobs[1].solo_s == 120
    assert jobs[0].solo_s == pytest.approx(25.24 * 60)


@pytest.mark.parametrize("text, message", [
    ("0,1\n600,x\n", "t.csv:2: num_tasks must be a number, got 'x'"),
    ("0,1\n\n600\n", "t.csv:3: expected 'wait_seconds,num_tasks', got '600'"),
    ("0,1\n-5,1\n", "t.csv:2: wait_seconds must not be negative"),
    ("0,0\n", "t.csv:1: num_tasks must be at least 1"),
    ("submit_s,gpu\n0,1\n", "t.csv:1: unknown column 'gpu'"),
    ("gpus\n1\n", "t.csv:1: header must name a submit_s column"),
    ("submit_s,mem_gib\n0,4\n", "t.csv:2: duration_s is required when no known model is given"),
    ("submit_s,model\n0,alexnet\n", "t.csv:2: no workload 'alexnet'"),
    ("submit_s,model\n0,resnet50\n", "t.csv:2: model 'resnet50' needs a batch size"),
    ("submit_s,duration_s,mem_gib,util\n0,1,1,huge\n", "t.csv:2: util must be one of light, medium, heavy"),
    ("submit_s,duration_s\n0,1,2\n", "t.csv:2: expected 2 fields"),
])
def test_bad_lines_give_one_line_errors(text, message):
    with pytest.raises(trace.TraceError) as info:
        trace.parse(text, "t.csv")
    assert str(info.value).startswith(message)
    assert "\n" not in str(info.value)


def test_missing_file(tmp_path):
    with pytest.raises(trace.TraceError, match="cannot read trace"):
        trace.read(tmp_path / "nope.csv")
