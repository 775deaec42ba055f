"""benchmarks/public_scripts: the case list is well formed, and the corpus is re-created only from copies
that match their pinned blobs (a real git mirror made here), with what the fixtures made linked per case."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "public_scripts"))

import recreate  # noqa: E402


def test_every_case_file_of_the_repository_loads():
    cases = recreate.load_cases()
    assert cases, "no cases under benchmarks/public_scripts/cases"
    for case in cases:
        for spec in case.fixtures:
            module, fn = spec.split(":")
            path = recreate.FIXTURES_DIR / f"{module}.py"
            assert path.is_file(), f"{case.name}: fixture module {path} is missing"
            assert f"def {fn}(" in path.read_text(), f"{case.name}: {spec} is not defined"


def _git(*args: str, cwd: Path) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def mirror(tmp_path: Path) -> tuple[Path, str, dict[str, str]]:
    """A bare mirror of a two-file repository, laid out as DIR/owner+name/repo."""
    work = tmp_path / "upstream"
    (work / "examples").mkdir(parents=True)
    (work / "examples" / "train.py").write_text("print('train')\n")
    (work / "examples" / "helpers.py").write_text("X = 1\n")
    _git("init", "-q", cwd=work)
    _git("add", ".", cwd=work)
    _git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "one", cwd=work)
    commit = _git("rev-parse", "HEAD", cwd=work)
    blobs = {p: _git("rev-parse", f"HEAD:{p}", cwd=work) for p in ("examples/train.py", "examples/helpers.py")}
    mirrors = tmp_path / "mirrors"
    subprocess.run(["git", "clone", "-q", "--bare", str(work), str(mirrors / "someone+proj" / "repo")], check=True)
    return mirrors, commit, blobs


def _case(commit: str, files: list[str], blobs: list[str]) -> recreate.Case:
    return recreate.Case(name="c1", family="f", repo="someone/proj", commit=commit, files=files, blobs=blobs,
                         licence="MIT", command=["python", "{src}/examples/train.py"], fixtures=[], packages=[],
                         timeout=60, why="test")


def test_sources_are_copied_when_their_blobs_match(tmp_path, mirror):
    mirrors, commit, blobs = mirror
    case = _case(commit, list(blobs), list(blobs.values()))
    assert recreate.recreate_sources(case, tmp_path / "corpus", mirrors) == []
    copied = tmp_path / "corpus" / "src" / "c1" / "examples" / "train.py"
    assert copied.read_text() == "print('train')\n"
    assert recreate.git_blob_hash(copied.read_bytes()) == _git("hash-object", str(copied), cwd=tmp_path)
    assert case.expand("{src}/examples/train.py", tmp_path / "corpus") == str(copied)


def test_a_wrong_blob_or_a_missing_file_is_one_line_each_and_nothing_is_copied(tmp_path, mirror):
    mirrors, commit, blobs = mirror
    wrong = "0" * 40
    case = _case(commit, ["examples/train.py", "examples/absent.py"], [wrong, wrong])
    problems = recreate.recreate_sources(case, tmp_path / "corpus", mirrors)
    assert len(problems) == 2
    assert "examples/train.py" in problems[0] and f"is not the listed {wrong}" in problems[0]
    assert "examples/absent.py" in problems[1] and "missing" in problems[1]
    assert not (tmp_path / "corpus" / "src" / "c1" / "examples" / "train.py").exists()


def test_two_fixtures_fill_one_models_folder_and_a_clash_is_reported(tmp_path):
    corpus = tmp_path / "corpus"
    for spec, inner in (("m.a", "A"), ("m.b", "B"), ("m.c", "A")):
        (corpus / "fixtures" / spec / "models" / inner).mkdir(parents=True)
    case = _case("1" * 40, ["x.py"], ["2" * 40])
    case.fixtures = ["m:a", "m:b"]
    assert recreate.link_fixtures(case, corpus) == []
    models = corpus / "work" / "c1" / "models"
    assert models.is_dir() and not models.is_symlink()
    assert sorted(p.name for p in models.iterdir()) == ["A", "B"]
    assert (models / "A").resolve() == (corpus / "fixtures" / "m.a" / "models" / "A").resolve()
    case.fixtures = ["m:a", "m:c"]
    problems = recreate.link_fixtures(case, corpus)
    assert len(problems) == 1 and "models/A is made by two fixtures" in problems[0]


def test_case_files_are_checked_before_anything_runs(tmp_path):
    (tmp_path / "bad.toml").write_text('[[case]]\nname = "x"\nrepo = "a/b"\ncommit = "abc"\n')
    with pytest.raises(recreate.CaseError, match="missing"):
        recreate.load_cases(tmp_path)


def test_a_remade_fixture_empties_its_cases_work_folder(tmp_path, monkeypatch):
    corpus = tmp_path / "corpus"
    (corpus / "fixtures" / "m.a" / "data" / "clips").mkdir(parents=True)
    case = _case("1" * 40, ["x.py"], ["2" * 40])
    case.fixtures = ["m:a"]
    stale = corpus / "work" / "c1" / ".hf-home" / "datasets" / "old.arrow"
    stale.parent.mkdir(parents=True)
    stale.write_text("cache of the old data")
    monkeypatch.setattr(recreate, "remade", set())
    assert recreate.link_fixtures(case, corpus) == [] and stale.exists()  # nothing remade: outputs kept
    monkeypatch.setattr(recreate, "remade", {"m:a"})
    assert recreate.link_fixtures(case, corpus) == []
    assert not stale.exists() and (corpus / "work" / "c1" / "data" / "clips").is_symlink()
