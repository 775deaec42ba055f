"""Re-create the public-scripts corpus folder from pinned copies, and make each case's local data.

The repository keeps only the list of cases (benchmarks/public_scripts/cases/<family>.toml: repository,
commit, files and their git blob hashes, licence, the README's command) and the generators of local data
and random-weight "pretrained" models (benchmarks/public_scripts/fixtures/<family>.py). This script builds
the corpus folder (git-ignored; default /var/tmp/gpushare-public-scripts) from them:

- ``<corpus>/src/<case>/<path>``: every file of the case, copied from a local git mirror (``--mirror DIR``:
  ``DIR/owner+name`` is a bare git directory, or holds one as ``repo/``) or downloaded from
  raw.githubusercontent.com/<repo>/<commit>/<path>. Each copy's ``git hash-object`` must equal the listed
  blob; a mismatch or a missing file is one line on stderr and the exit status is 1 (the case is not
  used). Cases whose command a package ships (``repo = "pypi:<package>"``) have no files.
- ``<corpus>/fixtures/<module>.<function>/``: what each fixture function made, once (a stamp holds the
  hash of the function's source; an edited function is made again).
- ``<corpus>/work/<case>/``: the case's working folder (its command runs there; emptied when one of its
  fixtures is made again, so no cache of the old data outlives it), with links to what its fixtures made:
  ``models/X`` of a fixture is ``work/<case>/models/X`` (a link), so several fixtures can fill one top-level
  folder.

Fixtures run in the stack's interpreter (``--python``, default /var/tmp/pubcorpus-venv/bin/python), offline.

    python benchmarks/public_scripts/recreate.py [--corpus DIR] [--mirror /work/.mirror] [--only REGEX]
                                                 [--python PY] [--no-fixtures]
"""

from __future__ import annotations

import argparse
import ast
import fcntl
import hashlib
import importlib
import os
import re
import shutil
import subprocess
import sys
import tomllib
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
CASES_DIR = HERE / "cases"
FIXTURES_DIR = HERE / "fixtures"
DEFAULT_CORPUS = Path(os.environ.get("GPUSHARE_PUBLIC_SCRIPTS", "/var/tmp/gpushare-public-scripts"))
DEFAULT_PYTHON = "/var/tmp/pubcorpus-venv/bin/python"
RAW_URL = "https://raw.githubusercontent.com/{repo}/{commit}/{path}"
# Every fixture and every case runs offline: models and data come from the fixtures, never from a hub.
OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
    "WANDB_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false", "MPLBACKEND": "Agg",
    "PYTHONUNBUFFERED": "1", "HF_HUB_DISABLE_TELEMETRY": "1", "DO_NOT_TRACK": "1",
}
REQUIRED = {"name": str, "repo": str, "commit": str, "files": list, "blobs": list, "licence": str,
            "command": list, "fixtures": list, "packages": list, "timeout": int, "why": str}
HEX40 = re.compile(r"^[0-9a-f]{40}$")


class CaseError(ValueError):
    """A case file that cannot be used as written (one line for the user)."""


@dataclass
class Case:
    name: str
    family: str
    repo: str
    commit: str
    files: list[str]
    blobs: list[str]
    licence: str
    command: list[str]
    fixtures: list[str]
    packages: list[str]
    timeout: int
    why: str
    env: dict[str, str] = field(default_factory=dict)
    cwd: str = "{work}"

    @property
    def from_package(self) -> bool:
        return self.repo.startswith("pypi:")

    def src(self, corpus: Path) -> Path:
        return corpus / "src" / self.name

    def work(self, corpus: Path) -> Path:
        return corpus / "work" / self.name

    def expand(self, text: str, corpus: Path) -> str:
        return text.replace("{src}", str(self.src(corpus))).replace("{work}", str(self.work(corpus)))


def _case(raw: dict, family: str, where: str) -> Case:
    for key, kind in REQUIRED.items():
        if key not in raw:
            raise CaseError(f"{where}: missing '{key}'")
        if not isinstance(raw[key], kind):
            raise CaseError(f"{where}: '{key}' must be a {kind.__name__}")
    unknown = set(raw) - set(REQUIRED) - {"env", "cwd"}
    if unknown:
        raise CaseError(f"{where}: unknown keys {sorted(unknown)}")
    name = raw["name"]
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name):
        raise CaseError(f"{where}: name {name!r} must be a plain folder name")
    if raw["repo"].startswith("pypi:"):
        if raw["files"] or raw["blobs"]:
            raise CaseError(f"{where}: a command shipped by a package has files = [] and blobs = []")
    else:
        if not re.fullmatch(r"[\w.-]+/[\w.-]+", raw["repo"]):
            raise CaseError(f"{where}: repo {raw['repo']!r} is not owner/name")
        if not HEX40.match(raw["commit"]):
            raise CaseError(f"{where}: commit {raw['commit']!r} is not 40 hex digits")
        if len(raw["files"]) != len(raw["blobs"]) or not raw["files"]:
            raise CaseError(f"{where}: files and blobs must be non-empty lists of the same length")
        for blob in raw["blobs"]:
            if not HEX40.match(blob):
                raise CaseError(f"{where}: blob {blob!r} is not 40 hex digits")
        for path in raw["files"]:
            if path.startswith("/") or ".." in Path(path).parts:
                raise CaseError(f"{where}: file path {path!r} must be relative, inside the repository")
    if not raw["command"] or not all(isinstance(a, str) for a in raw["command"]):
        raise CaseError(f"{where}: command must be a non-empty list of strings")
    for spec in raw["fixtures"]:
        if not re.fullmatch(r"[A-Za-z_]\w*:[A-Za-z_]\w*", spec):
            raise CaseError(f"{where}: fixture {spec!r} is not module:function")
    return Case(family=family, env=dict(raw.get("env", {})), cwd=raw.get("cwd", "{work}"),
                **{k: raw[k] for k in REQUIRED})


def load_cases(cases_dir: Path = CASES_DIR, only: str | None = None) -> list[Case]:
    """Every case of every family file, in file then listed order; names are unique across files."""
    cases: list[Case] = []
    seen: dict[str, str] = {}
    for path in sorted(cases_dir.glob("*.toml")):
        with open(path, "rb") as f:
            doc = tomllib.load(f)
        for i, raw in enumerate(doc.get("case", [])):
            case = _case(raw, path.stem, f"{path.name} case {i + 1} ({raw.get('name', '?')})")
            if case.name in seen:
                raise CaseError(f"{path.name}: case {case.name} is also in {seen[case.name]}")
            seen[case.name] = path.name
            cases.append(case)
    if only:
        cases = [c for c in cases if re.search(only, c.name)]
    return cases


def git_blob_hash(data: bytes) -> str:
    """``git hash-object`` of these bytes."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def mirror_git_dir(mirror: Path, repo: str) -> Path | None:
    base = mirror / repo.replace("/", "+")
    for candidate in (base / "repo", base):
        if (candidate / "objects").is_dir() and (candidate / "HEAD").exists():
            return candidate
    return None


def read_pinned(repo: str, commit: str, path: str, mirror: Path | None) -> bytes:
    """The file at the commit, from the mirror when it has the repository, else from GitHub."""
    if mirror is not None:
        git_dir = mirror_git_dir(mirror, repo)
        if git_dir is not None:
            r = subprocess.run(["git", "--git-dir", str(git_dir), "cat-file", "blob", f"{commit}:{path}"],
                               capture_output=True)
            if r.returncode != 0:
                raise FileNotFoundError(f"not in the mirror {git_dir}: {r.stderr.decode(errors='replace').strip()}")
            return r.stdout
    url = RAW_URL.format(repo=repo, commit=commit, path=path)
    try:
        with urllib.request.urlopen(url, timeout=60) as resp:
            return resp.read()
    except OSError as e:
        raise FileNotFoundError(f"download of {url} failed: {e}") from e


def recreate_sources(case: Case, corpus: Path, mirror: Path | None) -> list[str]:
    """Copy the case's files into its src folder; the problems, one line each (empty when all is well)."""
    problems = []
    src = case.src(corpus)
    for path, blob in zip(case.files, case.blobs):
        dest = src / path
        if dest.is_file() and git_blob_hash(dest.read_bytes()) == blob:
            continue
        try:
            data = read_pinned(case.repo, case.commit, path, mirror)
        except FileNotFoundError as e:
            problems.append(f"{case.name}: {case.repo}@{case.commit[:12]}:{path}: missing ({e})")
            continue
        got = git_blob_hash(data)
        if got != blob:
            problems.append(f"{case.name}: {case.repo}@{case.commit[:12]}:{path}: blob {got} is not the listed {blob}")
            continue
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(dest.name + ".part")
        tmp.write_bytes(data)
        os.replace(tmp, dest)
    return problems


def fixture_stamp(spec: str) -> str:
    """The hash of the fixture function's own source: editing one function remakes only its fixture
    (delete ``<corpus>/fixtures/<module>.<function>/`` to remake one after a shared helper changed)."""
    module, fn = spec.split(":")
    text = (FIXTURES_DIR / f"{module}.py").read_text()
    for node in ast.parse(text).body:
        if isinstance(node, ast.FunctionDef) and node.name == fn:
            segment = ast.get_source_segment(text, node) or ""
            return hashlib.sha256(spec.encode() + b"\0" + segment.encode()).hexdigest()
    raise CaseError(f"fixture {spec}: no function {fn} in fixtures/{module}.py")


def make_fixture(spec: str, corpus: Path, python: str) -> str | None:
    """Run one fixture into its own folder, unless its stamp says it is there; None or the problem
    (``remade`` collects the fixtures made in this run)."""
    out = corpus / "fixtures" / spec.replace(":", ".")
    out.parent.mkdir(parents=True, exist_ok=True)
    # One maker at a time per fixture: a second recreate.py waits, then finds the stamp.
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _make_fixture_locked(spec, out, python)


def _make_fixture_locked(spec: str, out: Path, python: str) -> str | None:
    stamp = out / ".fixture-done"
    want = fixture_stamp(spec)
    if stamp.is_file() and stamp.read_text() == want:
        return None
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    env = dict(os.environ, **OFFLINE_ENV)
    print(f"recreate: fixture {spec} -> {out}", flush=True)
    r = subprocess.run(["nice", "-n", "10", python, str(Path(__file__).resolve()), "--run-fixture", spec, str(out)],
                       env=env)
    if r.returncode != 0:
        return f"fixture {spec} failed (exit {r.returncode})"
    stamp.write_text(want)
    remade.add(spec)
    return None


remade: set[str] = set()  # fixtures made (again) by this run: their cases' work folders start afresh


def link_fixtures(case: Case, corpus: Path) -> list[str]:
    """Link what the case's fixtures made into its work folder: a top-level folder of a fixture becomes a
    real folder there, holding a link to each of its entries (so two fixtures can both fill ``models/``);
    a top-level file becomes a link. The same name from two fixtures is a problem."""
    work = case.work(corpus)
    if work.exists() and remade.intersection(case.fixtures):
        shutil.rmtree(work)  # links, outputs and caches (datasets' cache of the old files) of the old fixture
    work.mkdir(parents=True, exist_ok=True)
    problems = []

    def link(entry: Path, at: Path) -> None:
        if at.is_symlink():
            if Path(os.readlink(at)) != entry:
                problems.append(f"{case.name}: {at.relative_to(work)} is made by two fixtures "
                                f"({os.readlink(at)}, {entry})")
        elif at.exists():
            problems.append(f"{case.name}: {at} exists and is not a fixture's link")
        else:
            at.symlink_to(entry)

    for spec in case.fixtures:
        made = corpus / "fixtures" / spec.replace(":", ".")
        for entry in sorted(made.iterdir()):
            if entry.name == ".fixture-done":
                continue
            if entry.is_dir() and not entry.is_symlink():
                folder = work / entry.name
                folder.mkdir(exist_ok=True)
                for inner in sorted(entry.iterdir()):
                    link(inner, folder / inner.name)
            else:
                link(entry, work / entry.name)
    return problems


def run_fixture(spec: str, out: str) -> None:
    """In the stack's interpreter: import fixtures.<module> and call its function on the folder."""
    sys.path.insert(0, str(HERE))
    module_name, fn_name = spec.split(":")
    module = importlib.import_module(f"fixtures.{module_name}")
    getattr(module, fn_name)(Path(out))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS, help="corpus folder (default %(default)s)")
    ap.add_argument("--mirror", type=Path, help="folder of bare git mirrors, DIR/owner+name (else GitHub)")
    ap.add_argument("--only", help="regex on case names")
    ap.add_argument("--python", default=DEFAULT_PYTHON if os.path.exists(DEFAULT_PYTHON) else sys.executable,
                    help="the stack's interpreter, which runs the fixtures (default %(default)s)")
    ap.add_argument("--no-fixtures", action="store_true", help="copy the sources only")
    ap.add_argument("--run-fixture", nargs=2, metavar=("SPEC", "DIR"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.run_fixture:
        run_fixture(*a.run_fixture)
        return 0
    try:
        cases = load_cases(only=a.only)
    except (CaseError, tomllib.TOMLDecodeError) as e:
        print(f"recreate: {e}", file=sys.stderr)
        return 2
    corpus = a.corpus.resolve()
    problems: list[str] = []
    for case in cases:
        problems += recreate_sources(case, corpus, a.mirror)
    if not a.no_fixtures:
        done: dict[str, str | None] = {}
        for case in cases:
            for spec in case.fixtures:
                if spec not in done:
                    done[spec] = make_fixture(spec, corpus, a.python)
                if done[spec]:
                    problems.append(f"{case.name}: {done[spec]}")
            if not any(done[s] for s in case.fixtures):
                problems += link_fixtures(case, corpus)
    for line in problems:
        print(f"recreate: {line}", file=sys.stderr)
    bad = {line.split(":")[0] for line in problems}
    print(f"recreate: {len(cases) - len(bad)}/{len(cases)} cases ready in {corpus}", flush=True)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
