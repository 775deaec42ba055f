"""What a site's admin does by hand with the lines ``gpushare slurm-config`` prints, as plain text edits of
slurm.conf: paste the printed hook lines in (``--install-chains``/``--install-hooks``), and follow the
``--uninstall`` output back out. The uninstall test (tests/submit/test_uninstall.py) and the acceptance run
beside real sites' files (benchmarks/site_acceptance.py) both edit a site's file this way, so each checks the
same reading of the printed text that docs/deployment.md tells an admin to follow."""

from __future__ import annotations

import re


def paste(conf: str, printed: list[str]) -> str:
    """A printed hook line replaces every line of its key (at the first), or is added."""
    lines = conf.splitlines()
    for new in printed:
        key = new.split("=", 1)[0]
        at = [i for i, line in enumerate(lines) if line.split("=", 1)[0] == key]
        if at:
            lines[at[0]] = new
            lines = [line for i, line in enumerate(lines) if i not in at[1:]]
        else:
            lines.append(new)
    return "\n".join(lines) + "\n"


def apply_uninstall(conf: str, out: str) -> str:
    """The uninstall output followed by hand: each 'instead of' line replaced, each 'remove' line deleted."""
    lines = conf.splitlines()
    blocks = re.findall(r"^# instead of (\S+), the site's own line\(s\):\n((?:[A-Za-z]+=.*\n)+)", out, re.M)
    for ours, site in blocks:
        at = lines.index(ours)
        lines[at:at + 1] = site.splitlines()
    removed = set(re.findall(r"^# remove: (\S+)$", out, re.M))
    return "\n".join(line for line in lines if line not in removed) + "\n"
