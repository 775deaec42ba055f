"""The one way our code makes a folder under the node's runtime directory (``/run/gpushare`` and below).

Why: several writers share ``/run/gpushare`` (the agent's sockets, the Prolog's caps and hard cap limits,
the AdminComment lock), and the first to run creates it. It was once created 0700 by the AdminComment lock:
after that no job could reach ``/run/gpushare/hardcap``, and the hard cap shim, which reads its limits from
inside the job as the job's user, printed "cannot open limits file (Permission denied)" and capped nothing.
So every writer creates these folders here, 0755 whatever the umask (what ``RuntimeDirectoryMode=`` gives
the shipped units): readable and traversable by every user, writable only by their owner. A folder we own
that others cannot traverse (made 0700 by an older release, or by hand) is opened to them (read and search
added, nothing else changed); one owned by another user is left alone and reported by the caller's own
checks (and by ``gpushare doctor`` for the hard cap's folder).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

MODE = 0o755
# Where the Prolog writes each job's hard cap limits and the shim reads them: compiled into the shim
# (HARDCAP_DIR in gres/hardcap/hardcap.c), read by the Prolog and by the doctor's check.
HARDCAP_DIR = "/run/gpushare/hardcap"


def make_run_dir(path: str | os.PathLike[str]) -> Path:
    """Create ``path`` (and any missing parent) with mode 0755; return it.

    An existing ``path`` owned by this user that shuts others out (no search bit for group or others) gets
    read and search for them added; parents that exist are left as they are. A symbolic link or anything
    else that is not a directory is refused (``NotADirectoryError``)."""
    target = Path(path)
    missing = []
    walk = target
    while not os.path.lexists(walk):
        missing.append(walk)
        if walk.parent == walk:
            break
        walk = walk.parent
    for folder in reversed(missing):
        try:
            os.mkdir(folder, MODE)
        except FileExistsError:
            pass  # made meanwhile by another writer: checked below like any existing folder
        else:
            os.chmod(folder, MODE)  # mkdir's mode is masked by the umask
    info = os.lstat(target)
    if not stat.S_ISDIR(info.st_mode):
        raise NotADirectoryError(f"{target} is not a directory")
    mode = stat.S_IMODE(info.st_mode)
    if info.st_uid == os.geteuid() and mode & 0o011 != 0o011:
        os.chmod(target, mode | 0o055)
    return target


def reachable_by_others(path: str | os.PathLike[str]) -> tuple[bool, str]:
    """Whether a user other than the owners can reach ``path`` (or, where it does not exist yet, its
    nearest existing parent): every existing folder on the way searchable by others. Returns (ok, the
    first folder that is not, or the deepest one checked)."""
    target = Path(os.path.abspath(path))
    folders = [p for p in [target, *target.parents] if os.path.lexists(p)]
    for folder in reversed(folders):
        info = os.stat(folder)
        if stat.S_ISDIR(info.st_mode) and not info.st_mode & stat.S_IXOTH:
            return False, str(folder)
    return True, str(folders[0]) if folders else "/"
