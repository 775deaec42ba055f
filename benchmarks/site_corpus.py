"""Re-create the corpus of real sites' Slurm files that benchmarks/site_corpus.json pins.

Each file is taken at its pinned commit, from a local git mirror of its repository when one is given
(``--mirrors DIR``: ``DIR/<owner>+<name>/repo``, ``DIR/<owner>+<name>.git``, ``DIR/<owner>/<name>`` or
``DIR/<owner>+<name>``, bare or a clone), else from raw.githubusercontent.com, and kept only if its git
blob hash is the pinned one. The folder it writes
(default /var/tmp/gpushare-site-corpus, outside the repository) holds ``<site>/<path as published>``;
nothing of it is committed.

    python benchmarks/site_corpus.py [DEST] [--mirrors DIR] [--site NAME ...]

Exit status 1 when a file cannot be had or its hash differs (each such file is named).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import urllib.request
from pathlib import Path

LIST = Path(__file__).resolve().with_name("site_corpus.json")
DEFAULT_DEST = Path("/var/tmp/gpushare-site-corpus")


def blob_hash(data: bytes) -> str:
    """git's object id of a file's bytes (``git hash-object``)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def load_list(path: Path = LIST) -> list[dict]:
    return json.loads(path.read_text())["sites"]


def _git_dir(mirrors: Path, repository: str) -> Path | None:
    owner, name = repository.split("/", 1)
    for candidate in (mirrors / f"{owner}+{name}" / "repo", mirrors / f"{owner}+{name}.git", mirrors / owner / name,
                      mirrors / f"{owner}+{name}"):
        if (candidate / ".git").is_dir():  # a clone with its work tree
            return candidate / ".git"
        if (candidate / "objects").is_dir():  # a bare mirror
            return candidate
    return None


def fetch(repository: str, commit: str, path: str, mirrors: Path | None) -> bytes:
    """The file's bytes at ``commit``: from the mirror when it has the commit, else from GitHub."""
    git_dir = _git_dir(mirrors, repository) if mirrors else None
    if git_dir is not None:
        found = subprocess.run(["git", "--git-dir", str(git_dir), "cat-file", "blob", f"{commit}:{path}"],
                               capture_output=True, timeout=60)
        if found.returncode == 0:
            return found.stdout
    url = f"https://raw.githubusercontent.com/{repository}/{commit}/{path}"
    with urllib.request.urlopen(url, timeout=60) as answer:  # noqa: S310 - a fixed https host
        return answer.read()


def recreate(dest: Path, mirrors: Path | None = None, only: set[str] | None = None) -> list[str]:
    """Write every pinned file under ``dest/<site>/``; returns one line per file that failed."""
    problems = []
    for site in load_list():
        if only and site["name"] not in only:
            continue
        for item in site["files"]:
            target = dest / site["name"] / item["path"]
            if target.exists() and blob_hash(target.read_bytes()) == item["blob"]:
                continue
            try:
                data = fetch(site["repository"], site["commit"], item["path"], mirrors)
            except (OSError, subprocess.SubprocessError) as exc:
                problems.append(f"{site['name']}: {site['repository']}@{site['commit'][:12]}:{item['path']}: {exc}")
                continue
            if blob_hash(data) != item["blob"]:
                problems.append(f"{site['name']}: {item['path']}: blob {blob_hash(data)}, pinned {item['blob']}")
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dest", nargs="?", type=Path, default=DEFAULT_DEST)
    parser.add_argument("--mirrors", type=Path, help="a folder of local git mirrors, tried before GitHub")
    parser.add_argument("--site", action="append", help="only this site (repeatable)")
    args = parser.parse_args(argv)
    problems = recreate(args.dest, args.mirrors, set(args.site) if args.site else None)
    for line in problems:
        print(line, file=sys.stderr)
    sites = [s for s in load_list() if not args.site or s["name"] in args.site]
    print(f"{sum(len(s['files']) for s in sites) - len(problems)} files of {len(sites)} sites in {args.dest}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
