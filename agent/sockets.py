"""The one socket server behind the agent's three Unix sockets (``agent.sock``, ``lanes.sock``, ``live.sock``).

Why one server with hard bounds: two of the sockets are open to every local user (0666), and whatever a
client does there must cost the agent a bounded amount, or a user holding connections open starves the
agent of threads (a systemd unit's ``TasksMax`` counts them): the root API then fails, the Prolog cannot
register jobs, and a backstop that cannot attribute memory is tempted to stop the wrong process. Each
server here holds, whatever its clients do (docs/security.md, *Agent sockets*):

* **a whole-request deadline**: a request line must be complete within ``deadline_s`` of the connection's
  accept (of the first byte of a later line, in a session), on the monotonic clock, however its bytes
  trickle in; past it the client gets one error line and the connection is closed;
* **caps on connections**, per peer uid (the kernel's ``SO_PEERCRED``, not the request's word) and in all;
  past either the client is answered at once with one line, ``{"ok": false, "busy": true, "error":
  "busy: ..."}``, and the connection closed (:func:`gpushare.node.api.call` retries a busy answer within
  its own deadline). Uids in ``reserved_uids`` (root by default) are not counted against the total: a full
  socket still takes root's connections up to root's own cap;
* **no thread per connection**: one selector thread accepts, reads request lines and keeps idle sessions;
  complete requests go to at most ``workers`` threads (started as needed, then kept), taken round-robin by
  uid, so one uid's requests never queue ahead of another's by more than one each. A thread that cannot be
  started leaves the request queued for the workers already running (or, with none, answers busy) and is
  reported through ``on_trouble`` (the agent's backstop then holds its hand, ``gpushare.agent.failsafe``).

Protocol: one JSON object per line. A one-shot server (``session=False``) answers one request and closes; a
session server keeps the connection while its handler says so (the lanes socket: one connection per lane
member, idle between requests without a thread).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import selectors
import socket
import struct
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

log = logging.getLogger("gpushare.agent.sockets")
BACKLOG = 256  # an AF_UNIX connect beyond the backlog fails at once with EAGAIN (api.call retries it)


@dataclass(frozen=True)
class Bounds:
    """What one socket serves at most (module docstring)."""

    deadline_s: float  # a request line, complete, within this of its start
    max_line: int  # bytes of one request line, newline included
    per_uid: int  # open connections of one peer uid
    total: int  # open connections of all uids not in reserved_uids
    workers: int  # threads running handlers
    reserved_uids: frozenset[int] = frozenset({0})


def peer_creds(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the peer, as the kernel recorded them at connect time (SO_PEERCRED)."""
    data = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", data)
    return pid, uid, gid


def bind(path: Path, mode: int, dir_mode: int) -> socket.socket:
    """A listening, non-blocking Unix socket at ``path`` (its folder ``dir_mode``, itself ``mode``; created
    under a umask that leaves no window in which it is more open than that)."""
    path.parent.mkdir(mode=dir_mode, parents=True, exist_ok=True)
    os.chmod(path.parent, dir_mode)
    path.unlink(missing_ok=True)  # a stale socket from a killed agent
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o177)
    try:
        listener.bind(str(path))
    finally:
        os.umask(old_umask)
    os.chmod(path, mode)
    listener.listen(BACKLOG)
    listener.setblocking(False)
    return listener


def busy_reply(detail: str) -> dict[str, Any]:
    return {"ok": False, "busy": True, "error": f"busy: {detail}; try again shortly"}


def encode(reply: dict[str, Any]) -> bytes:
    return (json.dumps(reply, default=str, separators=(",", ":")) + "\n").encode()


def answer_now(sock: socket.socket, reply: dict[str, Any]) -> None:
    """One line into a fresh connection's empty send buffer (never blocks), then close it."""
    try:
        sock.send(encode(reply))
    except OSError:
        pass
    sock.close()


@dataclass(eq=False)
class Connection:
    """One client connection: its peer's credentials, its unread bytes, and what its handler keeps."""

    sock: socket.socket
    pid: int
    uid: int
    deadline: float | None = None  # monotonic; None: an idle session (no line started)
    buffer: bytearray = field(default_factory=bytearray)
    state: dict[str, Any] = field(default_factory=dict)  # the handler's, for a session
    closed: bool = False

    def alive(self) -> bool:
        """False once the client closed its end (or died): a peek sees end-of-file."""
        try:
            return self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
        except BlockingIOError:
            return True
        except OSError:
            return False


# (connection, request) -> (reply, keep the session open); one-shot servers close after every reply
Handler = Callable[[Connection, dict[str, Any]], tuple[dict[str, Any], bool]]


class Admission:
    """Open connections per uid and in all, against :class:`Bounds`; thread-safe."""

    def __init__(self, bounds: Bounds) -> None:
        self.bounds = bounds
        self.count: Counter[int] = Counter()
        self.lock = threading.Lock()

    def enter(self, uid: int) -> str | None:
        """Count a new connection of ``uid``; the busy reason instead when a cap is reached."""
        with self.lock:
            if self.count[uid] >= self.bounds.per_uid:
                return f"{self.count[uid]} connections of uid {uid} open (at most {self.bounds.per_uid} per uid)"
            if uid not in self.bounds.reserved_uids and self.unreserved() >= self.bounds.total:
                return f"{self.bounds.total} connections open (at most)"
            self.count[uid] += 1
            return None

    def leave(self, uid: int) -> None:
        with self.lock:
            self.count[uid] -= 1
            if self.count[uid] <= 0:
                del self.count[uid]

    def unreserved(self) -> int:
        return sum(n for uid, n in self.count.items() if uid not in self.bounds.reserved_uids)


class SocketServer:
    """Serve ``handler`` on the Unix socket ``path`` within ``bounds`` until :meth:`stop`.

    ``allowed_uids``: only these peers are served (others get ``refusal`` and are not counted); None: all.
    ``on_close(connection)``: called once for every admitted connection when it closes, on any thread.
    ``on_trouble(detail)``: a worker thread could not be started."""

    def __init__(self, path: str | os.PathLike[str], handler: Handler, bounds: Bounds, *, name: str,
                 mode: int = 0o600, dir_mode: int = 0o700, session: bool = False,
                 allowed_uids: frozenset[int] | None = None, refusal: str = "permission denied",
                 on_close: Callable[[Connection], None] | None = None,
                 on_trouble: Callable[[str], None] | None = None) -> None:
        self.path = Path(path)
        self.handler = handler
        self.bounds = bounds
        self.name = name
        self.mode, self.dir_mode, self.session = mode, dir_mode, session
        self.allowed_uids, self.refusal = allowed_uids, refusal
        self.on_close, self.on_trouble = on_close, on_trouble
        self.admission = Admission(bounds)
        self.counters: Counter[str] = Counter()  # busy, refused, deadline, served, thread_errors
        self._cv = threading.Condition()  # guards _open, _resume and _stopping
        self._pool = Pool(bounds.workers, name, self._run, self._trouble)
        self._resume: list[Connection] = []  # sessions handed back by workers, to read again
        self._open: set[Connection] = set()
        self._stopping = False
        self._listener: socket.socket | None = None
        self._selector: selectors.BaseSelector | None = None
        self._wake_r: socket.socket | None = None
        self._wake_w: socket.socket | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> "SocketServer":
        self._listener = listener = bind(self.path, self.mode, self.dir_mode)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(listener, selectors.EVENT_READ, "accept")
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._thread = threading.Thread(target=self._loop, name=f"gpushare-{self.name}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving: every open connection is shut down (a session's client sees it close), the
        socket file removed; handlers still running finish on their own."""
        if self._thread is None:
            return
        with self._cv:
            self._stopping = True
            connections = list(self._open)
        self._pool.stop()
        for connection in connections:
            try:
                connection.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._wake()
        self._thread.join(10)
        self._thread = None
        self.path.unlink(missing_ok=True)

    def _wake(self) -> None:
        try:
            if self._wake_w is not None:
                self._wake_w.send(b"x")
        except OSError:
            pass  # full: a wake-up is already pending

    # -- the selector thread -----------------------------------------------------------------------
    def _loop(self) -> None:
        assert self._selector is not None and self._listener is not None
        try:
            while not self._stopping:
                for key, _ in self._selector.select(self._timeout()):
                    if key.data == "accept":
                        self._accept()
                    elif key.data == "wake":
                        try:
                            while self._wake_r is not None and self._wake_r.recv(4096):
                                pass
                        except OSError:
                            pass
                    else:
                        self._read(key.data)
                with self._cv:
                    resumed, self._resume = self._resume, []
                for connection in resumed:
                    self._watch(connection)
                self._expire(time.monotonic())
        except Exception:  # noqa: BLE001 - said loudly; the agent's other sockets go on
            log.exception("%s: socket server stopped", self.name)
        finally:
            self._pool.stop()
            with self._cv:
                left = list(self._open)  # read by the selector, queued, or with a worker (which sees it closed)
            for connection in left:
                self._close(connection)
            self._selector.close()
            for sock in (self._listener, self._wake_r, self._wake_w):
                if sock is not None:
                    sock.close()

    def _pending(self) -> list[Connection]:
        """The connections being read with a request under way (their deadline running)."""
        assert self._selector is not None
        return [key.data for key in self._selector.get_map().values()
                if isinstance(key.data, Connection) and key.data.deadline is not None]

    def _timeout(self) -> float:
        deadlines = [connection.deadline for connection in self._pending() if connection.deadline is not None]
        return min(1.0, max(0.0, min(deadlines) - time.monotonic())) if deadlines else 1.0

    def _accept(self) -> None:
        assert self._listener is not None
        for _ in range(BACKLOG):  # then let the other connections be read
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of file descriptors: the next round tries again
                if exc.errno in (errno.EMFILE, errno.ENFILE):
                    self._trouble(f"cannot accept a connection ({exc.strerror})")
                    time.sleep(0.05)
                return
            try:
                pid, uid, _ = peer_creds(sock)
            except OSError:
                sock.close()
                continue
            sock.setblocking(False)
            if self.allowed_uids is not None and uid not in self.allowed_uids:
                self.counters["refused"] += 1
                log.warning("%s: refused a connection from uid %d", self.name, uid)
                answer_now(sock, {"ok": False, "error": self.refusal})
                continue
            busy = self.admission.enter(uid)
            if busy is not None:
                self.counters["busy"] += 1
                if self.counters["busy"] in (1, 10, 100) or self.counters["busy"] % 1000 == 0:
                    log.warning("%s: %s: answered busy (%d so far)", self.name, busy, self.counters["busy"])
                answer_now(sock, busy_reply(busy))
                continue
            connection = Connection(sock, pid, uid, deadline=time.monotonic() + self.bounds.deadline_s)
            with self._cv:
                self._open.add(connection)
            self._selector_register(connection)

    def _selector_register(self, connection: Connection) -> None:
        assert self._selector is not None
        try:
            self._selector.register(connection.sock, selectors.EVENT_READ, connection)
        except (OSError, ValueError):
            self._close(connection)

    def _watch(self, connection: Connection) -> None:
        """A session back from its handler: read its next line (perhaps already here)."""
        if connection.closed:
            return
        if connection.buffer:
            connection.deadline = time.monotonic() + self.bounds.deadline_s
            if self._take_line(connection):
                return
        self._selector_register(connection)

    def _read(self, connection: Connection) -> None:
        try:
            data = connection.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._unwatch(connection)
            self._close(connection)
            return
        if not connection.buffer and connection.deadline is None:
            connection.deadline = time.monotonic() + self.bounds.deadline_s  # a session's next line starts
        connection.buffer += data
        if b"\n" in data or len(connection.buffer) > self.bounds.max_line:
            self._unwatch(connection)
            if not self._take_line(connection):
                self._selector_register(connection)

    def _take_line(self, connection: Connection) -> bool:
        """Hand a complete line to the workers (or refuse an overlong one); False: none complete yet."""
        end = connection.buffer.find(b"\n")
        if end < 0 and len(connection.buffer) <= self.bounds.max_line:
            return False
        if end < 0 or end + 1 > self.bounds.max_line:
            self._fail(connection, {"ok": False, "error": f"request too long or not a line (at most "
                                                          f"{self.bounds.max_line} bytes)"})
            return True
        line = bytes(connection.buffer[:end + 1])
        del connection.buffer[:end + 1]
        connection.deadline = None
        self._submit(connection, line)
        return True

    def _unwatch(self, connection: Connection) -> None:
        assert self._selector is not None
        try:
            self._selector.unregister(connection.sock)
        except (KeyError, ValueError, OSError):
            pass

    def _expire(self, now: float) -> None:
        for connection in [c for c in self._pending() if c.deadline is not None and c.deadline <= now]:
            self.counters["deadline"] += 1
            self._unwatch(connection)
            self._fail(connection, {"ok": False, "error": f"request not complete within "
                                                          f"{self.bounds.deadline_s:g} s; connection closed"})

    def _fail(self, connection: Connection, reply: dict[str, Any]) -> None:
        try:
            connection.sock.send(encode(reply))
        except OSError:
            pass
        self._close(connection)

    def _close(self, connection: Connection) -> None:
        with self._cv:
            if connection.closed:
                return
            connection.closed = True
            self._open.discard(connection)
        try:
            connection.sock.close()
        except OSError:
            pass
        self.admission.leave(connection.uid)
        if self.on_close is not None:
            try:
                self.on_close(connection)
            except Exception:  # noqa: BLE001
                log.exception("%s: closing a connection failed", self.name)

    def _trouble(self, detail: str) -> None:
        self.counters["thread_errors"] += 1
        log.error("%s: %s", self.name, detail)
        if self.on_trouble is not None:
            self.on_trouble(detail)

    # -- the workers -------------------------------------------------------------------------------
    def _submit(self, connection: Connection, line: bytes) -> None:
        if not self._pool.submit(connection, line):  # no worker running, none could be started
            self.counters["busy"] += 1
            self._fail(connection, busy_reply("the agent cannot start a thread now"))

    def _run(self, connection: Connection, line: bytes) -> None:
        """A worker's turn at one request: serve it, then close the connection or hand the session back."""
        if connection.closed:
            return
        keep = self._serve(connection, line)
        if keep and not self._stopping:
            try:
                connection.sock.setblocking(False)
            except OSError:
                self._close(connection)
                return
            with self._cv:
                self._resume.append(connection)
            self._wake()
        else:
            self._close(connection)

    def _serve(self, connection: Connection, line: bytes) -> bool:
        """Run the handler on one line and send its reply; whether the session goes on."""
        keep = False
        try:
            request = json.loads(line)
            if not isinstance(request, dict):
                raise ValueError("not an object")
        except ValueError as exc:
            reply: dict[str, Any] = {"ok": False, "error": f"bad request: one JSON object on one line ({exc})"[:200]}
        else:
            try:
                reply, keep = self.handler(connection, request)
            except Exception as exc:  # noqa: BLE001 - a handler bug must not end the worker
                log.exception("%s: handler failed", self.name)
                reply = {"ok": False, "error": f"agent error: {exc.__class__.__name__}"}
        self.counters["served"] += 1
        return self._reply(connection, reply) and keep and self.session

    def _reply(self, connection: Connection, reply: dict[str, Any]) -> bool:
        """Send the reply within the deadline (a client that does not read it loses it)."""
        try:
            connection.sock.settimeout(self.bounds.deadline_s)
            connection.sock.sendall(encode(reply))
            return True
        except OSError:
            return False


class Pool:
    """At most ``size`` worker threads, started as needed and then kept, running ``run(connection, line)``
    on queued requests taken round-robin by uid (one uid's queue never delays another's by more than one)."""

    def __init__(self, size: int, name: str, run: Callable[[Connection, bytes], None],
                 trouble: Callable[[str], None]) -> None:
        self.size, self.name, self.run, self.trouble = size, name, run, trouble
        self._cv = threading.Condition()
        self._queues: dict[int, deque[tuple[Connection, bytes]]] = {}  # uid -> complete requests
        self._rotation: deque[int] = deque()  # uids with queued requests, in turn
        self._workers = 0
        self._idle = 0
        self._stopping = False

    def submit(self, connection: Connection, line: bytes) -> bool:
        """Queue a request; False when no worker runs and none could be started (the caller answers busy)."""
        with self._cv:
            queue = self._queues.get(connection.uid)
            if queue is None:
                queue = self._queues[connection.uid] = deque()
                self._rotation.append(connection.uid)
            queue.append((connection, line))
            waiting = sum(len(q) for q in self._queues.values())
            grow = waiting > self._idle and self._workers < self.size
            if grow:
                self._workers += 1
            self._cv.notify()
        if not grow:
            return True
        try:
            threading.Thread(target=self._work, name=f"gpushare-{self.name}-worker", daemon=True).start()
            return True
        except RuntimeError as exc:  # the task limit: the workers already running serve the queue
            self.trouble(f"cannot start a worker thread ({exc})")
            with self._cv:
                self._workers -= 1
                if self._workers:
                    return True
                self._queues[connection.uid] = deque(i for i in self._queues[connection.uid] if i[0] is not connection)
                return False

    def stop(self) -> list[Connection]:
        """Let the workers end once their request is done; the connections still queued."""
        with self._cv:
            self._stopping = True
            left = [connection for queue in self._queues.values() for connection, _ in queue]
            self._queues.clear()
            self._rotation.clear()
            self._cv.notify_all()
        return left

    def _next(self) -> tuple[Connection, bytes] | None:
        with self._cv:
            self._idle += 1
            try:
                while not self._stopping:
                    while self._rotation:
                        uid = self._rotation.popleft()
                        queue = self._queues.get(uid)
                        if not queue:
                            self._queues.pop(uid, None)
                            continue
                        item = queue.popleft()
                        if queue:
                            self._rotation.append(uid)
                        else:
                            del self._queues[uid]
                        return item
                    self._cv.wait()
                return None
            finally:
                self._idle -= 1

    def _work(self) -> None:
        while (item := self._next()) is not None:
            self.run(*item)
