"""``sitecustomize`` of gpushare lane jobs (the TaskProlog puts this directory first on ``PYTHONPATH``).

Why an import hook: nothing heavy may be imported in a process that never uses torch (shell helpers,
data-loader workers of other frameworks). This only adds a finder that notices the script's own
``import torch`` and, when that import has finished, installs the optimizer hooks from ``gpushare_lanes``.
Another ``sitecustomize`` later on the path (a distribution's, the user's) is still run afterwards.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from typing import Any, Sequence

_HERE = os.path.dirname(os.path.abspath(__file__))


class _TorchWatch(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the real loader of ``torch`` so the hooks go in once torch is loaded."""

    def find_spec(self, name: str, path: Sequence[str] | None, target: Any = None) -> Any:
        if name != "torch":
            return None
        sys.meta_path.remove(self)  # once: later imports of torch are cached in sys.modules
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(name, path, target) if find else None
            if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
                real = spec.loader.exec_module

                def exec_module(module: Any, real: Any = real) -> None:
                    real(module)
                    try:
                        import gpushare_lanes

                        gpushare_lanes.on_torch_imported(module)
                    except Exception as exc:  # noqa: BLE001 - lanes must never break the script
                        sys.stderr.write(f"gpushare lanes: not installed ({exc.__class__.__name__}: {exc})\n")

                spec.loader.exec_module = exec_module
                return spec
        return None


def _chain() -> None:
    """Run the next ``sitecustomize`` on the path, which ours shadows."""
    rest = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None or spec.origin == __file__:
        return
    try:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - as Python itself does for a failing sitecustomize
        sys.stderr.write(f"Error in sitecustomize ({spec.origin}): {exc}\n")


if os.environ.get("GPUSHARE_LANES") == "1" and "torch" not in sys.modules:
    sys.meta_path.insert(0, _TorchWatch())
_chain()
