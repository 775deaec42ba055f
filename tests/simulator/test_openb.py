"""Alibaba's GPU-sharing trace (cluster-trace-gpu-v2023): the reader, its one-line errors, and the
allocation and fragmentation measures, on a small generated trace in the published column layout."""

import random
from pathlib import Path

import pytest

from gpushare.simulator import occupancy, openb, trace
from gpushare.simulator.engine import SimConfig
from gpushare.simulator.runner import simulation

HEADER = "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time"


def generated(tasks: int, seed: int = 0) -> str:
    """A trace in the published layout: CPU-only, fractional, whole and 8-GPU tasks, some never scheduled."""
    rng = random.Random(seed)
    lines, now = [HEADER], 1000
    for i in range(tasks):
        now += rng.randint(0, 120)
        gpus = rng.choice([0, 1, 1, 1, 1, 2, 8])
        milli = rng.choice([230, 470, 500, 810, 1000]) if gpus == 1 else (1000 if gpus else 0)
        scheduled = "" if rng.random() < 0.05 else str(now + rng.randint(0, 30))
        deleted = (int(scheduled) if scheduled else now) + rng.randint(60, 4000)
        lines.append(f"openb-pod-{i:04d},4000,16384,{gpus},{milli},,LS,Running,{now},{deleted},{scheduled}")
    return "\n".join(lines) + "\n"


def test_tasks_become_jobs():
    text = HEADER + "\n" + "\n".join([
        "openb-pod-0001,6000,12288,1,460,,LS,Running,500,1700,600",
        "openb-pod-0000,12000,16384,1,1000,,LS,Running,100,900,100",
        "openb-pod-0002,88000,327680,8,1000,,Burstable,Succeeded,700,800,710",
        "openb-pod-0003,4000,8192,0,0,,BE,Running,800,900,800",
        "openb-pod-0004,4000,8192,1,1000,,BE,Pending,900,1000,",
    ]) + "\n"
    read = openb.parse(text, "o.csv", seed=1)
    assert [j.job_id for j in read.jobs] == ["openb-pod-0000", "openb-pod-0001", "openb-pod-0002"]
    first, shared, eight = read.jobs
    assert (first.submit_s, first.solo_s, first.gpus, first.mem_gib, first.util) == (0.0, 800.0, 1, 32.0, "heavy")
    assert (shared.submit_s, shared.solo_s, openb.share_of(shared), shared.util) == (400.0, 1100.0, 0.46, "medium")
    assert (eight.gpus, eight.solo_s) == (8, 90.0)
    assert (read.cpu_only, read.never_scheduled) == (1, 1)
    assert trace.parse(text, "o.csv", seed=1) == read.jobs  # the trace reader knows the layout by its header


@pytest.mark.parametrize("row, message", [
    ("p,1,1,one,500,,LS,Running,0,10,0", "o.csv:3: column num_gpu must be a whole number, got 'one'"),
    ("p,1,1,1,1500,,LS,Running,0,10,0", "o.csv:3: column gpu_milli must be from 1 to 1000, got 1500"),
    ("p,1,1,2,500,,LS,Running,0,10,0", "o.csv:3: column gpu_milli must be 1000 for a task of 2 GPUs, got 500"),
    ("p,1,1,1,500,,LS,Running,50,10,50", "o.csv:3: column deletion_time must be at least 50, got 10"),
    ("p,1,1,1,500,,LS,Running,50,100,20", "o.csv:3: column scheduled_time must be at least 50, got 20"),
    ("p,1,1,1,500,,LS,Running,-4,10,0", "o.csv:3: column creation_time must be at least 0, got -4"),
    (",1,1,1,500,,LS,Running,0,10,0", "o.csv:3: column name is empty"),
    ("p,1,1,1,500,,LS,Running,0,10", "o.csv:3: expected 11 columns, got 10"),
])
def test_a_bad_line_is_one_error_naming_file_line_and_column(row, message):
    good = "q,1,1,1,500,,LS,Running,0,10,0"
    with pytest.raises(trace.TraceError) as err:
        openb.parse(f"{HEADER}\n{good}\n{row}\n{good}\n", "o.csv")  # nothing returned, not even the good lines
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_a_missing_column_names_it(tmp_path: Path):
    path = tmp_path / "o.csv"
    path.write_text(HEADER.replace("gpu_milli", "gpu_mili") + "\np,1,1,1,500,,LS,Running,0,10,0\n")
    with pytest.raises(trace.TraceError, match=r"o.csv:1: column 'gpu_milli' missing from the header"):
        trace.read(path)


def test_fragmentation_counts_what_the_task_mix_cannot_use():
    # one node of 4 GPUs: one idle, one half used, one 0.8 used, one full
    used = [0.0, 0.5, 0.8, 1.0]
    # tasks of half a GPU: the 0.2 left on the 0.8 GPU is a fragment, the other halves are not
    assert occupancy._fragmentation(used, 4, [(1, 0.5, 1.0)]) == pytest.approx((0.2, 1.7))
    # tasks of 2 whole GPUs: only one GPU is wholly free, so all 1.7 free is a fragment to them
    assert occupancy._fragmentation(used, 4, [(2, 1.0, 1.0)]) == pytest.approx((1.7, 1.7))
    # a mix, weighted by popularity: 3/4 of the first, 1/4 of the second
    assert occupancy._fragmentation(used, 4, [(1, 0.5, 0.75), (2, 1.0, 0.25)]) == pytest.approx((0.575, 1.7))
    # an idle node has no fragment
    assert occupancy._fragmentation([0.0] * 4, 4, [(1, 0.5, 1.0), (2, 1.0, 1.0)]) == pytest.approx((0.0, 4.0))


def test_sharing_serves_the_same_demand_on_fewer_gpus_than_exclusive(tmp_path: Path):
    path = tmp_path / "openb_pod_list_generated.csv"
    path.write_text(generated(300))
    jobs = trace.read(path)
    out = {}
    for policy in ("exclusive", "slurm-shards-ll"):
        sim = simulation(jobs, SimConfig(nodes=2, gpus_per_node=8, gpu="v100-32gb", policy=policy)).run()
        assert all(j.state == "done" for j in sim.jobs.values())
        out[policy] = occupancy.measure(sim, lambda j: openb.share_of(j.spec), samples=50)
    for measured in out.values():
        assert 0.0 < measured["demand_served"] <= measured["allocation_ratio"] <= 1.0
        assert 0.0 <= measured["fragmented_of_all"] <= measured["fragmented_of_free"] <= 1.0
    # Exclusive hands a whole GPU to every fractional task: more allocated for the same demand served
    exclusive, shared = out["exclusive"], out["slurm-shards-ll"]
    assert exclusive["allocation_ratio"] - exclusive["demand_served"] > shared["allocation_ratio"] - shared["demand_served"]
