"""The TaskEpilog's OOM report (gpushare.epilog.task_epilog) and how the controller's epilog takes it."""

from __future__ import annotations

from gpushare.epilog import task_epilog
from gpushare.policy.oom_recovery import JobFacts, OomVerdict
from gpushare.slurm.gres_request import GresRequest
from gpushare.epilog.oom_evidence import reported_from_node

LINE = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB."


def facts(comment: str, restarts: int = 0) -> JobFacts:
    return JobFacts(job_id="7", state="FAILED", exit_code=1, exit_signal=0, restarts=restarts,
                    gres=GresRequest.parse("gres:shard:5"), node="gpu1", uid=1000, gid=1000, log_paths=("/tmp/job-7.out",),
                    record=None, comment=comment)


def test_a_report_keeps_the_users_own_comment_and_replaces_an_earlier_report():
    first = task_epilog.render("pytorch", LINE, "/tmp/job-7.out", 0)
    assert task_epilog.merged("", first) == first
    mine = task_epilog.merged("run 12 of my sweep", first)
    assert mine.startswith("run 12 of my sweep ") and task_epilog.parse(mine)["line"] == LINE
    second = task_epilog.render("pytorch", LINE, "/tmp/job-7.out", 1)
    again = task_epilog.merged(mine, second)
    assert again.count("gpushare-oom:") == 1 and task_epilog.parse(again)["restarts"] == 1
    assert len(task_epilog.merged("x" * 5000, second)) <= task_epilog.MAX_COMMENT_CHARS


def test_the_report_is_the_users_text_and_is_checked():
    for forged in ('gpushare-oom:{"v":1,"family":"Py Torch!","line":"x","source":"/a","restarts":0}',
                   'gpushare-oom:{"v":2,"family":"pytorch","line":"x","source":"/a","restarts":0}',
                   'gpushare-oom:{"v":1,"family":"pytorch","line":"x","source":"/a","restarts":true}',
                   'gpushare-oom:{"v":1,"family":"pytorch","line":"x\\u0007","source":"/a","restarts":0}',
                   'gpushare-oom:{"v":1,"family":"pytorch","line":"x","source":"/a","restarts":0} trailing'):
        assert task_epilog.parse(forged) is None, forged


def test_the_controller_takes_a_report_only_for_the_run_that_wrote_it_and_only_without_a_log_verdict():
    unread = OomVerdict(False, "failed (exit 1) and no log could be read", unread=True)
    report = task_epilog.render("pytorch", LINE, "/tmp/job-7.out", 0)
    taken = reported_from_node(facts(report), unread)
    assert taken.is_oom and taken.family == "pytorch" and taken.message == LINE
    assert "gpu1" in taken.reason and "TaskEpilog" in taken.reason
    assert not reported_from_node(facts(report, restarts=1), unread).is_oom  # an earlier run's message
    assert not reported_from_node(facts("my own words"), unread).is_oom
    from_log = OomVerdict(True, "GPU out of memory (nccl) in /a", "nccl", "NCCL failure", "/a")
    assert reported_from_node(facts(report), from_log) is from_log


def test_the_hook_does_nothing_outside_a_gpu_jobs_batch_step():
    assert task_epilog.report({"SLURM_STEP_ID": "0", "SLURM_JOB_ID": "7", "SLURM_JOB_GPUS": "0"}) == "not the batch step"
    assert task_epilog.report({"SLURM_STEP_ID": "", "SLURM_JOB_ID": "7"}) == "no GPU"
    assert task_epilog.main() == 0  # no job here: exits 0, prints nothing
