"""One request to ``gpushare-submitd`` from our own Python hooks: the Lua shim's counterpart.

Why a module of its own in the core package: the EpilogSlurmctld asks the service to write the user's note
and keep the job's logs (op ``note``), and it needs only this small client, not the submit service's
request decoder and decision code (gpushare.slurm_plugins.protocol holds the wire format; this side sends
one JSON line and reads the ``key=value`` lines up to ``end``).
"""

from __future__ import annotations

import json
import socket
from typing import Any

MAX_REPLY_BYTES = 65536


def ask(socket_path: str, request: dict[str, Any], timeout_s: float = 5.0) -> dict[str, str]:
    """Send ``request`` and return the reply's ``key=value`` lines. Raises OSError when the service cannot be
    reached or answers no ``end``."""
    payload = (json.dumps(request, ensure_ascii=True) + "\n").encode("ascii")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(timeout_s)
        conn.connect(socket_path)
        conn.sendall(payload)
        data = b""
        while not data.endswith(b"end\n") and len(data) < MAX_REPLY_BYTES:
            chunk = conn.recv(4096)
            if not chunk:
                break
            data += chunk
    if not data.endswith(b"end\n"):
        raise OSError(f"{socket_path}: no complete answer")
    lines = data.decode("utf-8", "replace").splitlines()[:-1]
    return dict(line.split("=", 1) for line in lines if "=" in line)
