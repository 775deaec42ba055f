"""Slurm's text formats are parsed in gpushare/slurm only: ``scontrol show node`` records, ``sinfo``'s
GresUsed and ``%G`` columns, and a job's AllocTRES. A new release that prints them differently is then met in
one package (docs/architecture.md, "Single homes")."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

from gpushare.slurm.nodes import gpu_types, show_node
from gpushare.slurm.tres import gpu_tres, gpu_tres_counts

ROOT = Path(__file__).resolve().parents[2]
HOME = ROOT / "gpushare" / "slurm"
# Left where they are, each with its reason.
LEFT: dict[str, str] = {}


def _package_files() -> list[Path]:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return sorted(p for folder in data["tool"]["setuptools"]["package-dir"].values()
                  for p in (ROOT / folder).rglob("*.py") if "__pycache__" not in p.parts)


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the docstring constants (words about a format are not a parser of it)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def _raw_formats(tree: ast.AST) -> list[tuple[int, str]]:
    docs = _docstrings(tree)
    hits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            args = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            if any(args[i:i + 2] == ["show", "node"] for i in range(len(args))):
                hits.append((node.lineno, "scontrol show node"))
            if args[:1] == ["sinfo"] and any("%G" in a for a in args):
                hits.append((node.lineno, "sinfo %G"))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            if "GresUsed" in node.value:
                hits.append((node.lineno, "sinfo GresUsed"))
            if "gres/(gpu" in node.value or ("gres/gpu" in node.value and "(" in node.value):
                hits.append((node.lineno, "an AllocTRES pattern"))
    return hits


def test_slurm_text_is_parsed_under_gpushare_slurm_only():
    found = []
    for path in _package_files():
        rel = path.relative_to(ROOT).as_posix()
        if HOME in path.parents or rel in LEFT:
            continue
        found += [f"{rel}:{line}: {what}" for line, what in _raw_formats(ast.parse(path.read_text(), rel))]
    assert not found, f"Slurm text parsed outside gpushare/slurm: {found}"


def test_the_scan_sees_each_format():
    code = '''
out = client.run("scontrol", "show", "node", "-o", node)
other = client.run("sinfo", "-h", "-o", "%G")
ARGS = ("-h", "-N", "-O", "NodeList:|,GresUsed:")
TRES = re.compile(r"gres/(gpu|shard)=(\\d+)")
'''
    assert sorted(what for _, what in _raw_formats(ast.parse(code))) == [
        "an AllocTRES pattern", "scontrol show node", "sinfo %G", "sinfo GresUsed"]


class _Scontrol:
    def __init__(self, text: str) -> None:
        self.text, self.calls = text, []

    def run(self, tool: str, *args: str) -> str:
        self.calls.append((tool, *args))
        return self.text


def test_the_shared_readers():
    client = _Scontrol("NodeName=n1 State=IDLE Gres=gpu:3g.20gb:1 Comment=(null)\n\nnot a record\n")
    assert show_node(client, "n1") == [{"NodeName": "n1", "State": "IDLE", "Gres": "gpu:3g.20gb:1",
                                        "Comment": "(null)"}]
    assert client.calls == [("scontrol", "show", "node", "-o", "n1")]
    assert gpu_types("gpu:3g.20gb:2(S:0),gpu:1g.5gb:1,shard:a100:40\n(null)\n") == {"3g.20gb", "1g.5gb"}
    tres = "billing=1,cpu=1,gres/gpu=2,gres/gpu:a100-40gb=2,gres/shard=9,mem=1G"
    assert gpu_tres(tres) == {"gpu": 2, "type": "a100-40gb", "shard": 9}
    assert gpu_tres_counts("gres/gpu:a100-40gb=1") == {"gpu": 1} and gpu_tres("gres/gpu:a100-40gb=1") == {
        "type": "a100-40gb"}
