"""A real Prometheus server scraping a cluster's node agents, for the integration tests and the demo.

Debian's own ``prometheus`` binary (package ``prometheus``, in the Makefile's DEBS) runs with a generated
configuration: one scrape job, ``gpushare``, whose targets are the agents' ``address:port`` (each target
carries a ``node`` label with its Slurm node name, which the dashboard in etc/grafana/ selects on), a short
scrape interval so a test sees series within seconds, a storage directory of its own and a free listen port.
Every process is started through ``wrap`` (argv in, argv out; identity by default), so a harness whose
controller is another host can run the server there (``ssh``, a container's exec) and still drive it from here.

The client is the HTTP API's ``/api/v1/query`` and ``/api/v1/targets`` over stdlib urllib: the tests need
nothing more, and no dependency is added for it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

JOB_NAME = "gpushare"
Wrap = Callable[[list[str]], list[str]]


class PrometheusError(RuntimeError):
    pass


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on at ``host`` now (the server binds it moments later)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def scrape_config(targets: Mapping[str, str], interval_s: float = 1.0) -> dict[str, Any]:
    """Prometheus's configuration for ``targets`` (node name -> ``address:port`` of its agent).

    Written as JSON, which is YAML too: no YAML library needed. The scrape timeout equals the interval
    (Prometheus refuses a longer one)."""
    interval = f"{max(1, round(interval_s * 1000))}ms"
    return {"global": {"scrape_interval": interval, "scrape_timeout": interval, "evaluation_interval": interval},
            "scrape_configs": [{"job_name": JOB_NAME, "metrics_path": "/metrics",
                                "static_configs": [{"targets": [address], "labels": {"node": node}}
                                                   for node, address in sorted(targets.items())]}]}


def _identity(argv: list[str]) -> list[str]:
    return argv


@dataclass
class Prometheus:
    """One server under ``base``: ``start()``, ``query(...)``, ``stop()``.

    ``host``/``port``: where it listens and where the client reaches it (port 0: a free one is chosen
    here, which only means something when ``wrap`` runs it on this host)."""

    base: Path
    targets: dict[str, str]
    wrap: Wrap = _identity
    binary: str = "prometheus"
    host: str = "127.0.0.1"
    port: int = 0
    interval_s: float = 1.0
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def config_file(self) -> Path:
        return self.base / "prometheus.yml"

    def argv(self) -> list[str]:
        return [self.binary, f"--config.file={self.config_file}", f"--storage.tsdb.path={self.base / 'data'}",
                f"--web.listen-address={self.host}:{self.port}", "--storage.tsdb.retention.time=1d"]

    def start(self, timeout_s: float = 30.0) -> "Prometheus":
        self.base.mkdir(parents=True, exist_ok=True)
        (self.base / "data").mkdir(exist_ok=True)
        if not self.port:
            self.port = free_port(self.host)
        self.config_file.write_text(json.dumps(scrape_config(self.targets, self.interval_s), indent=1) + "\n")
        log = open(self.base / "prometheus.log", "ab")
        try:
            self.proc = subprocess.Popen(self.wrap(self.argv()), stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True, close_fds=True)
        except OSError as exc:
            raise PrometheusError(f"cannot start {self.binary}: {exc} (Debian package prometheus)") from exc
        finally:
            log.close()
        deadline = time.monotonic() + timeout_s
        while not self.ready():
            if self.proc.poll() is not None:
                raise PrometheusError(f"{self.binary} exited with {self.proc.returncode}; "
                                      f"log {self.base / 'prometheus.log'}: {self.log_tail()}")
            if time.monotonic() > deadline:
                raise PrometheusError(f"{self.binary} not ready within {timeout_s:.0f} s; log {self.base / 'prometheus.log'}")
            time.sleep(0.2)
        return self

    def log_tail(self, lines: int = 5) -> str:
        try:
            return " | ".join((self.base / "prometheus.log").read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as response:
                return bool(response.status == 200)
        except (OSError, urllib.error.URLError):
            return False

    def stop(self) -> None:
        """SIGTERM the process group it was started in (the wrapper and what it ran), SIGKILL after 10 s."""
        if self.proc is None:
            return
        for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
        self.proc = None

    # --- client -----------------------------------------------------------------------------------
    def api(self, path: str, params: Mapping[str, str] | None = None) -> Any:
        """``data`` of a GET on the HTTP API; PrometheusError with the server's own message on failure."""
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        try:
            with urllib.request.urlopen(f"{self.url}{path}{query}", timeout=10) as response:
                body = json.load(response)
        except urllib.error.HTTPError as exc:  # 400/422: a bad expression; the body says why
            try:
                body = json.load(exc)
            except ValueError:
                raise PrometheusError(f"{path}: HTTP {exc.code}") from exc
        except (OSError, ValueError) as exc:
            raise PrometheusError(f"{path}: {exc}") from exc
        if body.get("status") != "success":
            raise PrometheusError(f"{path} {dict(params or {})}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """The instant vector (or scalar, as one element) of ``expr`` now: ``[{"metric": {...}, "value": [t, "v"]}]``."""
        data = self.api("/api/v1/query", {"query": expr})
        if data["resultType"] in ("scalar", "string"):
            return [{"metric": {}, "value": data["result"]}]
        return list(data["result"])

    def target_health(self) -> dict[str, str]:
        """``node`` label -> health (``up``, ``down``, ``unknown``) of every active target."""
        data = self.api("/api/v1/targets", {"state": "active"})
        return {t["labels"].get("node", t["scrapeUrl"]): t["health"] for t in data["activeTargets"]}

    def wait_for(self, expr: str, predicate: Callable[[list[dict[str, Any]]], bool], timeout_s: float) -> list[dict[str, Any]]:
        """Poll ``expr`` until ``predicate(result)``; the last result, or PrometheusError naming the expression."""
        deadline = time.monotonic() + timeout_s
        while True:
            result = self.query(expr)
            if predicate(result):
                return result
            if time.monotonic() > deadline:
                raise PrometheusError(f"{expr!r} not as expected within {timeout_s:.0f} s: {result!r:.300}")
            time.sleep(0.5)


def nodes_of(result: Sequence[Mapping[str, Any]]) -> set[str]:
    """The ``node`` labels of a query result."""
    return {str(item["metric"].get("node")) for item in result if "node" in item["metric"]}
