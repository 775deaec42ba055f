"""The warm worker's learned preloads (estimator_cli/preload.py): only known frameworks, merged, loaded
once per change of the list."""

from __future__ import annotations

import json
import sys

import pytest

from gpushare.estimator_cli import preload

pytestmark = pytest.mark.torch  # starts gpu-estimate captures: torch in a child process or the warm worker


def test_only_framework_modules_are_reported():
    before = set(sys.modules) - {"json"}
    sys.modules.setdefault("transformers_fake_probe", sys)  # not a framework: ignored
    found = preload.framework_modules(before)
    assert "json" not in found and "transformers_fake_probe" not in found


def test_remember_merges_and_the_worker_loads_once(tmp_path, monkeypatch):
    sock = tmp_path / "estimate-abc.sock"
    preload.remember(sock, ["PIL", "PIL.Image"])
    preload.remember(sock, ["PIL.Image", "not_a_framework"])
    listed = json.loads(preload.preload_file(sock).read_text())
    assert listed == ["PIL", "PIL.Image", "not_a_framework"]
    imported = []
    monkeypatch.setattr(preload.importlib, "import_module", lambda name: imported.append(name))
    monkeypatch.setattr(preload.sys, "modules", {})
    state: dict[str, int] = {}
    assert preload.load_remembered(sock, state) == 2  # the unknown name is never imported
    assert imported == ["PIL", "PIL.Image"]
    assert preload.load_remembered(sock, state) == 0  # unchanged list: nothing to do
