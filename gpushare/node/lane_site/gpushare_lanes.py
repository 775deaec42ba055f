"""Job side of gpushare lanes: the client of the agent's lanes socket and PyTorch's optimizer hooks.

Loaded by this directory's ``sitecustomize.py`` only in a lane job (``GPUSHARE_LANES=1``, exported by the
TaskProlog) and only once the script imports torch. Standard library only, because it runs inside the
user's interpreter, which need not have gpushare installed.

Turn boundaries (Salus' iteration granularity): the turn is taken before the first forward of any module
(a global forward pre-hook, removed once used) or, failing that, before the first ``optimizer.step()``;
after every ``optimizer.step()`` the job frees its cached ephemeral memory (``torch.cuda.empty_cache()``
when CUDA is initialised), gives the turn back and waits for its next one, in one request
(``"again": true``) so the agent's turn policy weighs it against the jobs already waiting.

An agent restart drops every lane session (the agent keeps lanes in memory only): the session notices the
closed connection, reconnects and joins its lane again, retrying for up to ``RECONNECT_S`` while the new
agent comes up, then asks for its turn as before. Any other problem (socket missing at the start, a
refusal, no agent within ``RECONNECT_S``) switches lanes off for the rest of the run, with one line on
standard error: the job then runs ungated, as it would without lanes.
"""

from __future__ import annotations

import importlib
import json
import os
import socket
import sys
import time
from typing import Any

WAIT_S = 30.0
RECONNECT_S = 60.0  # how long a dropped session tries to reach a restarted agent before lanes go off
RECONNECT_EVERY_S = 0.5


class LaneError(RuntimeError):
    """The agent refused or could not be reached."""


class LaneUnreachable(LaneError):
    """The lanes socket cannot be reached, or a joined session's connection broke (the agent stopped or
    restarted): worth trying again, unlike a refusal."""


class LaneSession:
    """One connection to the lanes socket for one job: join, then turns and releases; rejoins once the
    connection is lost (``rejoin``)."""

    def __init__(self, path: str, job: str, connect_timeout_s: float = 5.0,
                 reconnect_s: float = RECONNECT_S) -> None:
        self.path = path
        self.job = job
        self.connect_timeout_s = connect_timeout_s
        self.reconnect_s = reconnect_s
        self.rejoins = 0
        self.joined = self._open()

    def _open(self) -> dict[str, Any]:
        """Connect and join; LaneError when the socket cannot be reached or the join is refused."""
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.connect_timeout_s)
        try:
            self.sock.connect(self.path)
        except OSError as exc:
            self.sock.close()
            raise LaneUnreachable(f"lanes socket {self.path}: {exc}") from exc
        self.sock.settimeout(WAIT_S + 30.0)  # a turn wait answers within WAIT_S
        self.reader = self.sock.makefile("rb")
        try:
            return self.call({"op": "lane_join", "job": self.job})
        except LaneError:
            self.close()
            raise

    def call(self, request: dict[str, Any]) -> dict[str, Any]:
        try:
            self.sock.sendall((json.dumps(request) + "\n").encode())
            line = self.reader.readline(65536)
        except OSError as exc:
            raise LaneUnreachable(f"lanes socket: {exc}") from exc
        if not line:
            raise LaneUnreachable("the agent closed the lanes session")
        reply = json.loads(line)
        if not isinstance(reply, dict) or not reply.get("ok"):
            raise LaneError(str(reply.get("error") if isinstance(reply, dict) else reply))
        return reply

    def rejoin(self) -> None:
        """Reconnect and join again after a lost connection, retrying while the socket is missing or not
        yet answering (a restarting agent) for up to ``reconnect_s``. A refusal ends it at once (the job
        is no longer a lane job there, or its Epilog closed it): LaneError."""
        self.close()
        deadline = time.monotonic() + self.reconnect_s
        while True:
            try:
                self.joined = self._open()
                self.rejoins += 1
                sys.stderr.write("gpushare lanes: the agent's session was lost; joined the lane again\n")
                return
            except LaneUnreachable:
                pass  # not up yet; a refusal (LaneError) ends the rejoin
            if time.monotonic() >= deadline:
                raise LaneError(f"the agent did not come back within {self.reconnect_s:g} s")
            time.sleep(RECONNECT_EVERY_S)

    def turn(self) -> dict[str, Any]:
        """Block until this job holds its lane's turn (rejoining first if the agent restarted)."""
        while True:
            try:
                reply = self.call({"op": "lane_turn", "wait_s": WAIT_S})
            except LaneUnreachable:
                self.rejoin()
                continue
            if reply.get("granted"):
                return reply

    def release(self, again: bool = False) -> dict[str, Any]:
        """Give the turn back (``again``: and ask for the next one in the same request). After a lost
        connection there is nothing to give back: the restarted agent never granted this session a turn."""
        try:
            return self.call({"op": "lane_release", "again": again})
        except LaneUnreachable:
            self.rejoin()
            return {"ok": True, "released": True, "rejoined": True}

    def close(self) -> None:
        try:
            self.reader.close()
            self.sock.close()
        except (OSError, AttributeError):
            pass


class TorchLanes:
    """The optimizer hooks of one process; ``holding`` is whether it believes it has the turn."""

    def __init__(self, torch: Any, path: str, job: str) -> None:
        self.torch = torch
        self.path = path
        self.job = job
        self.session: LaneSession | None = None
        self.holding = False
        self.off = False
        self._forward_hook: Any = None

    def install(self) -> None:
        optimizer = importlib.import_module("torch.optim.optimizer")
        module = importlib.import_module("torch.nn.modules.module")
        optimizer.register_optimizer_step_pre_hook(self._pre_step)
        optimizer.register_optimizer_step_post_hook(self._post_step)
        self._forward_hook = module.register_module_forward_pre_hook(self._first_forward)

    def _first_forward(self, module: Any, args: Any) -> None:
        if self._forward_hook is not None:
            self._forward_hook.remove()
            self._forward_hook = None
        self._acquire()

    def _pre_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._acquire()

    def _post_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.off:
            return
        try:
            cuda = self.torch.cuda
            if cuda.is_available() and cuda.is_initialized():
                cuda.empty_cache()  # ephemeral memory back to the lane before the turn goes
        except Exception:  # noqa: BLE001 - a failed cache release must not end the job
            pass
        self._release(again=True)
        self._acquire()

    def _acquire(self) -> None:
        if self.off or self.holding:
            return
        try:
            if self.session is None:
                self.session = LaneSession(self.path, self.job)
            self.session.turn()
            self.holding = True
        except (LaneError, ValueError) as exc:
            self._switch_off(exc)

    def _release(self, again: bool = False) -> None:
        if self.off or not self.holding or self.session is None:
            return
        self.holding = False
        try:
            reply = self.session.release(again)
            if not reply.get("released"):
                sys.stderr.write("gpushare lanes: this job held its turn past the limit and was demoted\n")
        except (LaneError, ValueError) as exc:
            self._switch_off(exc)

    def _switch_off(self, exc: Exception) -> None:
        self.off, self.holding = True, False
        sys.stderr.write(f"gpushare lanes: off for this run ({exc}); the job runs without turns\n")
        if self.session is not None:
            self.session.close()
            self.session = None


def on_torch_imported(torch: Any) -> None:
    """Called once ``import torch`` finished in a lane job: install the hooks."""
    path = os.environ.get("GPUSHARE_LANE_SOCKET", "")
    job = os.environ.get("SLURM_JOB_ID", "")
    if not path or not job.isdigit():
        return
    try:
        TorchLanes(torch, path, job).install()
    except AttributeError as exc:  # a PyTorch without global optimizer hooks (< 2.0)
        sys.stderr.write(f"gpushare lanes: not available with this PyTorch ({exc})\n")
