"""The layers of docs/architecture.md, checked from the code's own imports (lazy ones inside functions too).

core (gpushare) → slurm adapter and gres → policy and estimate → node (what the agent, the Prolog and the
Epilog share about a job) → estimator, MIG, agent → hooks (submit, prolog, epilog) → simulator. A module may
import its own package or any layer below it, never one above; between two packages of one layer only the
imports in ``PEERS`` are allowed, each with its reason (none today). The simulator replays the programs'
decisions from the low layers only, never from a program package. The test harness (devcluster) and the
tests are never imported by the package.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LAYERS = {
    "gpushare": 0,
    "gpushare.slurm": 1, "gpushare.gres": 1,
    "gpushare.policy": 2, "gpushare.estimate": 2,  # pure decisions and the estimate, shared by programs and simulator
    "gpushare.node": 3,  # a job on its node: store, caps, registration, comment, hook environment, hard cap
    "gpushare.estimator_cli": 4, "gpushare.mig_manager": 4, "gpushare.agent": 4,
    "gpushare.slurm_plugins": 5, "gpushare.prolog": 5, "gpushare.epilog": 5,
    "gpushare.simulator": 6,
}
# The only imports between two packages of one layer: (importer, imported) -> why. None: what two programs
# share lives in a layer below both.
PEERS: dict[tuple[str, str], str] = {}
PROGRAMS = {"gpushare.estimator_cli", "gpushare.mig_manager", "gpushare.agent",
            "gpushare.slurm_plugins", "gpushare.prolog", "gpushare.epilog"}
SUBPACKAGES = {name.split(".")[1] for name in LAYERS if "." in name}


def _package_dirs() -> dict[str, Path]:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return {name: ROOT / folder for name, folder in data["tool"]["setuptools"]["package-dir"].items()}


def _unit(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "gpushare":
        return None
    return f"gpushare.{parts[1]}" if len(parts) > 1 and parts[1] in SUBPACKAGES else "gpushare"


def _imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append(node.module)
        elif isinstance(node, ast.Import):
            found.extend(alias.name for alias in node.names)
    return found


def test_every_package_folder_is_installed_under_one_name() -> None:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = set(data["tool"]["setuptools"]["packages"])
    assert all(name == "gpushare" or name.startswith("gpushare.") for name in packages)
    for name, folder in _package_dirs().items():
        for init in folder.rglob("__init__.py"):
            relative = init.parent.relative_to(folder)
            dotted = ".".join([name, *relative.parts]) if relative.parts else name
            assert dotted in packages, f"{init.parent} is not listed in pyproject's packages"
    assert set(LAYERS) <= packages


def test_no_module_imports_upward_or_the_test_harness() -> None:
    problems = []
    for name, folder in _package_dirs().items():
        for path in folder.rglob("*.py"):
            relative = path.relative_to(folder)
            own = _unit(".".join([name, *relative.parts[:-1], relative.stem]))
            assert own is not None
            for module in _imports(path):
                if module.split(".")[0] in ("devcluster", "tests"):
                    problems.append(f"{path.relative_to(ROOT)} imports {module} (test harness)")
                target = _unit(module)
                if target is not None and LAYERS[target] > LAYERS[own]:
                    problems.append(f"{path.relative_to(ROOT)} ({own}) imports {module} ({target}): upward")
                elif target not in (None, own) and LAYERS[target] == LAYERS[own] and (own, target) not in PEERS:
                    problems.append(f"{path.relative_to(ROOT)} ({own}) imports {module} ({target}): a peer not in PEERS")
                elif own == "gpushare.simulator" and target in PROGRAMS:
                    problems.append(f"{path.relative_to(ROOT)} imports {module}: the simulator takes the programs' "
                                    "decisions from gpushare.policy and gpushare.estimate, not from a program")
    assert not problems, "\n".join(problems)


def test_every_error_class_of_ours_has_one_root() -> None:
    """Entry points tell our errors (one-line message, exit status) from bugs (traceback, fail open) by
    ``gpushare.errors.GpushareError``; a new error class must derive from it or from one that does."""
    ours: dict[str, list[str]] = {}
    for name, folder in _package_dirs().items():
        for path in folder.rglob("*.py"):
            if path.parent.name == "lane_site":
                continue  # runs in the job's own interpreter, standard library only; its errors never leave it
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ClassDef) and node.name.endswith(("Error", "Unavailable", "Gone", "Dependent")):
                    ours[node.name] = [base.id if isinstance(base, ast.Name) else ast.unparse(base) for base in node.bases]
    rooted = {"GpushareError"}
    changed = True
    while changed:
        changed = False
        for cls, bases in ours.items():
            if cls not in rooted and (rooted.intersection(bases) or any(b.endswith("ClickException") for b in bases)):
                rooted.add(cls)
                changed = True
    assert set(ours) <= rooted, f"not under GpushareError: {sorted(set(ours) - rooted)}"
