"""``gpushare-submitd``: the decision service behind ``job_submit.lua``.

Why a service: slurmctld holds its job write lock while job_submit runs, so the hook must cost
milliseconds; starting Python per job (``io.popen``) costs ~90 ms, a unix-socket round trip ~4 ms
(docs/compatibility.md). Why it may fail: it may; the shim then accepts the job unchanged after its deadline,
and this process accepts the job unchanged whenever its own logic raises (fail open, log loudly).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import socketserver
import struct
import sys
import threading
import time
from pathlib import Path

import click

from gpushare.logs import setup_logging
from gpushare.config import Config, ConfigError, installed_version, load_config
from gpushare.errors import GpushareError
from gpushare.slurm_plugins.controller_account import controller_account, prepare_hook_paths, socket_gid
from gpushare.slurm.client import SlurmClient
from gpushare.slurm_plugins.decision import Decision, Queue, SubmitRequest, decide
from gpushare.estimate.directives import parse_directives
from gpushare.estimate.source import EstimateUnavailable, find_estimate
from gpushare.slurm_plugins.estimation_process import Supervisor
from gpushare.slurm_plugins.job_notes import write_note
from gpushare.slurm_plugins.protocol import ProtocolError, decode_request, encode_reply
from gpushare.slurm_plugins.queue_view import QueueView
from gpushare.slurm_plugins.scope import observed, out_of_scope, outside
from gpushare.slurm_plugins.submit_metrics import SubmitMetrics
from gpushare.slurm_plugins.submit_metrics import start as start_metrics

log = logging.getLogger("gpushare.submitd")


def cluster_gpu_names(cfg: Config) -> list[str]:
    return [group.gpu for group in cfg.nodes] or [name.partition(":")[0] for name in cfg.estimator.gpus]


def handle_submit(cfg: Config, request: SubmitRequest, work_dir: str | None, view: QueueView | None = None) -> Decision:
    """Directives → estimate → decision, then scope and mode (slurm_plugins/scope.py). Problems with a named
    estimate count as bad directives. ``[policy] mode = "off"``: nothing is read, every job passes untouched.
    ``view``: the queue as last seen (``[policy] share_when = "queued"``); read here, never refreshed here."""
    if cfg.policy.mode == "off":
        return Decision(action="accept")
    directives = parse_directives(request.script, cfg.submit.max_script_bytes)
    estimate = None
    if not directives.problems:
        try:
            estimate = find_estimate(cfg, directives, request.script, work_dir, request.user_id,
                                     cluster_gpu_names(cfg))
        except EstimateUnavailable as exc:
            directives.problems.append((directives.lines.get("estimate", 0), str(exc)))
    queue = Queue(*view.pressure(request.partition, request.default_partition)) if view is not None else None
    decision = decide(request, directives, estimate, cfg, queue)
    if decision.record or decision.action != "accept":  # a GPU job: is it ours to change here?
        why = out_of_scope(request, cfg)
        if why:
            decision = outside(request, why)
    if view is not None and decision.record.get("decision") == "idle-gpus" and cfg.policy.mode == "enforce":
        view.claim(request.partition, request.default_partition)  # it will take one of the idle GPUs
    if cfg.policy.mode == "observe":
        decision = observed(decision)
    if decision.record:  # the controller's configuration, for the node's Prolog to compare with its own
        decision.record["cfg"] = cfg.sha256[:12]
    return decision


class _Handler(socketserver.StreamRequestHandler):
    timeout = 5.0  # a stuck client must not pin a thread forever

    def handle(self) -> None:
        server: SubmitServer = self.server  # type: ignore[assignment]
        started = time.perf_counter()
        peer = peer_uid(self.request)
        if peer not in server.peer_uids:
            log.warning("connection from uid %s refused: only slurmctld's user (uids %s) may ask", peer,
                        sorted(server.peer_uids))
            return
        try:
            line = self.rfile.readline(server.max_request_bytes)
        except (OSError, socket.timeout):
            return
        decision, job = server.decide_line(line)
        if server.metrics is not None:
            server.metrics.decided(decision, server.cfg.policy.mode)
        try:
            self.wfile.write(encode_reply(decision))
        except OSError:
            return
        log.info("%s", json.dumps({"job": job, "action": decision.action,
                                   "record": decision.record or None,
                                   "ms": round((time.perf_counter() - started) * 1000, 2)}))


def peer_uid(conn: socket.socket) -> int | None:
    """The uid of the process at the other end of a unix socket (SO_PEERCRED: the kernel's word)."""
    try:
        _pid, uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                              struct.calcsize("3i")))
    except OSError:
        return None
    return uid


MAX_WORKERS = 8  # concurrent decisions; slurmctld serialises job_submit, so more only means an attack
_SHED_REPLY = encode_reply(Decision(action="accept"))


class SubmitServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    """One thread per connection, at most ``MAX_WORKERS`` at once.

    Why a bound: every request may carry 64 KiB of hostile script and each thread costs memory; past the
    bound a connection is answered "accept unchanged" at once from the accepting thread (load shed: the
    shim fails open without waiting for its deadline) and counted in ``shed``.
    """

    daemon_threads = True
    allow_reuse_address = True
    metrics: SubmitMetrics | None = None  # [submit] metrics_port (slurm_plugins/submit_metrics.py)
    request_queue_size = 256  # beyond the backlog an AF_UNIX connect fails at once (EAGAIN), not waits

    def __init__(self, socket_path: str, cfg: Config, max_workers: int = MAX_WORKERS) -> None:
        self.cfg = cfg
        self._slots = threading.BoundedSemaphore(max_workers)
        self.shed = 0
        self.max_request_bytes = cfg.submit.max_script_bytes * 6 + 65536  # \u00XX escapes: 6 bytes a byte
        self._lock = threading.Lock()
        self.estimation: Supervisor | None = None  # the async-estimation process, when enabled
        self.view: QueueView | None = None  # [policy] share_when = "queued": the queue as last seen
        # who may ask: root, this service's own user, slurmctld's (SlurmUser), and [submit] peer_uids
        account = controller_account(cfg)
        self.peer_uids = {0, os.geteuid(), *(int(u) for u in cfg.submit.peer_uids),
                          *((account.uid,) if account else ())}
        prepare_hook_paths(cfg, account)
        path = Path(socket_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.is_socket():
            path.unlink()
        old_umask = os.umask(0o117)  # the socket is born 0660: no window in which others may connect
        try:
            super().__init__(str(path), _Handler)
        finally:
            os.umask(old_umask)
        gid = socket_gid(cfg, account)
        if gid is not None and os.geteuid() == 0:
            os.chown(path, -1, gid)  # slurmctld's group: the shim connects as SlurmUser, not as root
        os.chmod(path, 0o660)  # this service's user (owner) and slurmctld's group only

    def process_request(self, request: socket.socket, client_address: object) -> None:  # type: ignore[override]
        if not self._slots.acquire(blocking=False):
            self.shed += 1
            if self.shed == 1 or self.shed % 100 == 0:
                log.warning("busy: %d workers; %d requests answered 'accept unchanged' so far", MAX_WORKERS,
                            self.shed)
            try:
                request.settimeout(0.05)
                request.sendall(_SHED_REPLY)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        thread = threading.Thread(target=self._work, args=(request, client_address), daemon=True)
        thread.start()

    def _work(self, request: socket.socket, client_address: object) -> None:
        try:
            self.process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def reload(self, cfg: Config) -> None:
        with self._lock:
            self.cfg = cfg
            if self.estimation is not None:
                self.estimation.reload()

    def decide_line(self, line: bytes) -> tuple[Decision, str]:
        job = "?"
        try:
            op, request, fields = decode_request(line.rstrip(b"\n"))
            job = str(fields.get("name") or "")[:64] + f" uid={request.user_id}"
            if op == "note":  # EpilogSlurmctld, as SlurmUser, asks for a line in a job's log (job_notes.py)
                job = f"note for job {str(fields.get('job_id'))[:12]}"
                try:
                    outcome = write_note(self.cfg, fields)
                except (OSError, GpushareError) as exc:
                    outcome = f"not written: {exc}"[:200]
                    log.warning("%s: %s", job, outcome)
                return Decision(action="accept", user_message=outcome), job
            if op != "submit":
                return Decision(action="accept"), job
            return handle_submit(self.cfg, request, fields.get("work_dir"), self.view), job
        except ProtocolError as exc:
            log.error("bad request, job accepted unchanged: %s", exc)
            if self.metrics is not None:
                self.metrics.failed_open("bad-request")
        except Exception:  # noqa: BLE001 - fail open: our bug must never block a user's job
            log.exception("decision failed, job accepted unchanged")
            if self.metrics is not None:
                self.metrics.failed_open("error")
        return Decision(action="accept"), job


def serve(socket_path: str, cfg: Config, config_path: str | None) -> int:
    server = SubmitServer(socket_path, cfg)
    server.metrics, metrics_server = start_metrics(cfg)

    def _start_estimation_if_needed(current: Config) -> None:
        # held jobs need the process that releases them; once started it stays (jobs held before a
        # switch away from async must still be released). Its own process: its squeue parses never
        # stall submit answers.
        if current.policy.without_estimate == "async" and server.estimation is None:
            server.estimation = Supervisor(config_path).start()

    def _reload(signum: int, frame: object) -> None:
        try:
            new = load_config(config_path, require=cfg.from_file)  # a file that vanished: keep the old one
            server.reload(new)
            _start_estimation_if_needed(new)
            _start_view_if_needed(new)
            log.info("configuration reloaded: %s (sha256 %s), [policy] mode = %s", new.source, new.sha256[:12],
                     new.policy.mode)
        except ConfigError as exc:
            log.error("configuration not reloaded: %s", exc)

    def _stop(signum: int, frame: object) -> None:
        threading.Thread(target=server.shutdown, daemon=True).start()

    def _start_view_if_needed(current: Config) -> None:
        # off the submit path: a thread of its own asks Slurm every queue_view_s; once started it stays
        # (a reload to "always" only stops it being read)
        if current.policy.share_when == "queued" and server.view is None:
            client = SlurmClient.from_config(current, timeout_s=max(5.0, current.policy.queue_view_s))
            server.view = QueueView(client.run, current.policy.queue_view_s).start()

    signal.signal(signal.SIGHUP, _reload)
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    _start_estimation_if_needed(cfg)
    _start_view_if_needed(cfg)
    log.info("listening on %s", socket_path)
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        if server.estimation is not None:
            server.estimation.stop()
        if server.view is not None:
            server.view.stop()
        if metrics_server is not None:
            metrics_server.shutdown()
        server.server_close()
        try:
            os.unlink(socket_path)
        except FileNotFoundError:
            pass
    return 0


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--config", "config_path", envvar="GPUSHARE_CONFIG", help="gpushare.toml to read.")
@click.option("--socket", "socket_path", help="Unix socket to listen on (default: [submit] socket).")
@click.option("--log-level", default="INFO", show_default=True,
              type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"]))
@click.option("--defaults", is_flag=True, help="Run on the built-in defaults when no gpushare.toml is found "
              "(without it the service refuses to start: decisions on defaults disagree silently with the nodes).")
def cli(config_path: str | None, socket_path: str | None, log_level: str, defaults: bool) -> int:
    """Serve job_submit decisions on a unix socket."""
    cfg = load_config(config_path, require=not defaults, warn=False)
    setup_logging("gpushare-submitd", cfg.submit.log_file, log_level)
    if cfg.missing_line():
        log.warning("%s", cfg.missing_line())
    log.info("slurm-gpushare %s; configuration %s (sha256 %s), [policy] mode = %s", installed_version(), cfg.source,
             cfg.sha256, cfg.policy.mode)  # the release: which one runs after an upgrade or a rollback
    return serve(socket_path or cfg.submit.socket, cfg, config_path)


def main(argv: list[str] | None = None) -> int:
    try:
        return cli.main(args=argv, prog_name="gpushare-submitd", standalone_mode=False) or 0
    except ConfigError as exc:
        print(f"gpushare-submitd: {exc}", file=sys.stderr)
        return 2
    except click.ClickException as exc:
        exc.show()
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())
