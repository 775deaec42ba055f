"""benchmarks/site_corpus.json and its re-creation script: the list pins what it says, and a file whose bytes
are not the pinned blob is refused (tested on a git repository the test makes, the way a mirror is read)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import site_corpus  # noqa: E402

HEX40 = re.compile(r"^[0-9a-f]{40}$")


def test_the_list_pins_six_sites_each_file_by_commit_and_blob() -> None:
    sites = site_corpus.load_list()
    assert len(sites) >= 6 and len({s["repository"] for s in sites}) == len(sites)
    for site in sites:
        assert HEX40.match(site["commit"]) and site["licence"] and site["site"], site["name"]
        for item in site["files"]:
            assert HEX40.match(item["blob"]) and item["install"] and int(item["mode"], 8) in (0o644, 0o755), item
        if "lua" in site:
            assert any(i["install"] == site["lua"]["file"] for i in site["files"])
    patterns = " ".join(p for s in sites for p in s["patterns"])
    for needed in ("glob", "EpilogSlurmctld", "QoS", "partition"):  # what the issue asked the corpus to hold
        assert needed in patterns, needed


def test_blob_hash_is_gits(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"#!/bin/sh\nexit 0\n")
    ours = site_corpus.blob_hash(path.read_bytes())
    assert ours == subprocess.run(["git", "hash-object", str(path)], capture_output=True, text=True,
                                  check=True).stdout.strip()


def test_recreate_from_a_mirror_checks_each_blob(tmp_path: Path, monkeypatch) -> None:
    repo = tmp_path / "mirrors" / "site+hooks"
    repo.mkdir(parents=True)
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@example.org"]
    subprocess.run([*git, "init", "-q"], check=True)
    (repo / "prolog.d").mkdir()
    (repo / "prolog.d" / "a.sh").write_text("#!/bin/sh\necho site\n")
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "x"], check=True)
    commit = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    blob = site_corpus.blob_hash((repo / "prolog.d" / "a.sh").read_bytes())
    listing = tmp_path / "list.json"

    def pin(blob_pinned: str) -> None:
        listing.write_text(json.dumps({"sites": [{"name": "s", "repository": "site/hooks", "commit": commit,
                                                   "files": [{"path": "prolog.d/a.sh", "blob": blob_pinned}]}]}))

    monkeypatch.setattr(site_corpus, "LIST", listing)
    monkeypatch.setattr(site_corpus, "load_list", lambda path=listing: json.loads(path.read_text())["sites"])
    pin(blob)
    dest = tmp_path / "corpus"
    assert site_corpus.recreate(dest, tmp_path / "mirrors") == []
    assert (dest / "s" / "prolog.d" / "a.sh").read_text() == "#!/bin/sh\necho site\n"
    pin("0" * 40)
    (dest / "s" / "prolog.d" / "a.sh").unlink()
    [problem] = site_corpus.recreate(dest, tmp_path / "mirrors")
    assert f"blob {blob}, pinned {'0' * 40}" in problem and not (dest / "s" / "prolog.d" / "a.sh").exists()
