"""Names bound in a "best so far" branch and read after it (docs/estimator.md, "GPU values in fake mode"):
a metric that is only output gets 1, and a host-only condition whose ``if`` branch alone binds a new name
takes that branch, so the script does not stop on a NameError a real run never meets."""

from __future__ import annotations

import textwrap

import pytest
from estimator_run import estimate

from gpushare.estimator_cli.cli import EXIT_OK, EXIT_UNSUPPORTED

pytestmark = pytest.mark.torch

HEAD = """
    import torch, torch.nn as nn, torch.nn.functional as F
    x, y = torch.randn(64, 16).cuda(), torch.randint(0, 4, (64,)).cuda()
    model = nn.Linear(16, 4).cuda()
    opt = torch.optim.Adam(model.parameters())
"""


def _line(source: str, needle: str) -> str:
    lines = textwrap.dedent(source).splitlines()
    return f"train.py:{next(i for i, text in enumerate(lines, 1) if needle in text)}"


def test_an_accuracy_that_is_only_output_beats_the_initial_best(capsys, tmp_path):
    """PyG's gat.py: the accuracies go only into a list that is returned and logged (bounded), and
    ``test_acc`` is first bound inside ``if val_acc > best_val_acc``; an accuracy of 0 never beat the
    initial 0 and the log line failed with NameError."""
    source = HEAD + """
    def test():
        pred = model(x).argmax(dim=-1)
        accs = []
        for part in (slice(0, 32), slice(32, 64)):
            accs.append(int((pred[part] == y[part]).sum()) / 32)
        return accs

    best_val_acc = final_test_acc = 0
    for epoch in range(10):
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        val_acc, tmp_test_acc = test()
        if val_acc > best_val_acc:
            best_val_acc = val_acc
            test_acc = tmp_test_acc
        print(epoch, val_acc, test_acc)
    """
    code, doc, err = estimate(capsys, tmp_path, source, "--mode", "fake")
    assert code == EXIT_OK, err
    assert doc["mode"] == "fake" and doc["iterations"] == 3
    read = f"int(tensor) at {_line(source, 'accs.append')} used only as output (assumed 1)"
    assert read in doc["value_reads"]["placeholder"], doc["value_reads"]


def test_a_host_only_condition_takes_the_branch_that_alone_binds_a_new_name(capsys, tmp_path):
    """A loss placeholder (``.item()`` of a value-free loss) compared with the best so far: the branch binds
    ``best_step``, which nothing bound before and the log line reads; ``best``, bound before the loop,
    does not count."""
    source = HEAD + """
    best = float("inf")
    for step in range(10):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        val = loss.item()
        if val < best:
            best = val
            best_step = step
        print(f"step {step}: best so far at {best_step}")
    """
    code, doc, err = estimate(capsys, tmp_path, source, "--mode", "fake")
    assert code == EXIT_OK, err
    assert doc["iterations"] == 3
    assumed = [w for w in doc["value_reads"]["placeholder"] if "assumed" in w]
    assert any(f"{_line(source, 'if val < best')} choosing between host-only branches (assumed true)" in w
               for w in assumed), assumed


def test_an_accuracy_returned_by_the_scripts_function_and_logged_stays_in_fake_mode(capsys, tmp_path):
    """PyG's mutag_gin.py: ``total_correct += int(...)`` then ``return total_correct / len(...)``; the
    callers only log the result through a logging function (PyG's ``log``, here the script's own). The
    return is followed to every call of the function; ``math.log`` of a read is still not output."""
    source = HEAD + """
    import math

    def log(**metrics):
        print(", ".join(f"{k}: {v}" for k, v in metrics.items()))

    def test(parts):
        total_correct = 0
        for part in parts:
            pred = model(x[part]).argmax(dim=-1)
            total_correct += int((pred == y[part]).sum())
        return total_correct / 64

    for epoch in range(10):
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        train_acc = test([slice(0, 32)])
        test_acc = test([slice(32, 64)])
        log(Epoch=epoch, Train=train_acc, Test=test_acc)
    """
    code, doc, err = estimate(capsys, tmp_path, source, "--mode", "fake")
    assert code == EXIT_OK, err
    assert doc["mode"] == "fake" and doc["iterations"] == 3
    read = f"int(tensor) at {_line(source, 'total_correct +=')} used only as output (assumed 1)"
    assert read in doc["value_reads"]["placeholder"], doc["value_reads"]
    ln = source.replace("def log(**metrics):", "def unused(**metrics):").replace("import math", "from math import log")
    ln = ln.replace("log(Epoch=epoch, Train=train_acc, Test=test_acc)", "print(log(1 + train_acc))")
    code, doc, err = estimate(capsys, tmp_path, ln, "--mode", "fake")
    assert code == EXIT_UNSUPPORTED and "may decide memory" in err, err
