"""Run ``gpu-estimate`` in-process on a script written from a string: what the script-pattern tests share."""

from __future__ import annotations

import json
import textwrap
from typing import Any

from gpushare.estimator_cli.cli import EXIT_OK, main


def estimate(capsys: Any, tmp_path: Any, source: str, *extra: str,
             script_args: tuple[str, ...] = ()) -> tuple[int, dict | None, str]:
    """(exit code, JSON document when it succeeded, standard error) of a cold, uncached estimate; ``extra``
    are gpu-estimate's options, ``script_args`` the script's own arguments."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(source))
    capsys.readouterr()
    code = main(["--json", "--no-cache", "--no-warm", "--gpu", "a100-40gb", *extra, str(script), *script_args])
    out, err = capsys.readouterr()
    return code, (json.loads(out) if code == EXIT_OK else None), err
