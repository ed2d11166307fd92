"""Start and stop a private ``redis-server`` (the embedded default and the test fixture).

Tether's own Redis runs with AOF and ``appendfsync always`` by default: every intent appended to a
trajectory log is on disk before the effect it announces (ARCHITECTURE.md, durability contract).

Streams use 2 KB listpack nodes (``stream-node-max-bytes 2048``; Redis's default is 4 KB): a stream node
is allocated whole, so a small stream (a hibernated trajectory's log compacted to one snapshot entry) costs
at least one node. Measured on Redis 7.0: a log of one 2.2 KB snapshot entry 3,200 B instead of 4,736 B,
a running log of 75 entries 18.5 KB instead of 19.0 KB. Another Redis can be given the same setting.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from runtime.errors import DependencyError

__all__ = ["STREAM_NODE_MAX_BYTES", "RedisServer", "free_port", "redis_server_binary"]

STREAM_NODE_MAX_BYTES = 2048
PORT_ATTEMPTS = 5  # free ports tried when the one picked is taken before the server binds it
ADDRESS_IN_USE = "Address already in use"  # redis-server's log line when it cannot bind its port


class _PortTaken(DependencyError):
    """redis-server could not bind the port picked for it."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on ``host``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def redis_server_binary() -> str:
    """Path of ``redis-server``, or a clear error saying how to install it."""
    path = shutil.which("redis-server")
    if path is None:
        raise DependencyError(
            "redis-server is not installed: run `make setup` (as root it installs it with apt-get) "
            "or `sudo apt-get install redis-server`, or set TETHER_REDIS_URL to an existing Redis",
            non_retryable=True,
        )
    return path


@dataclass
class RedisServer:
    """A ``redis-server`` child process on a loopback port with its data under ``data_dir``."""

    data_dir: Path
    port: int = 0
    appendfsync: str = "always"
    password: str | None = None
    host: str = "127.0.0.1"
    _proc: subprocess.Popen[bytes] | None = field(default=None, init=False, repr=False)

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}{self.host}:{self.port}/0"

    def start(self, timeout: float = 10.0) -> RedisServer:
        """Start the server and wait until it answers PING.

        With no port given, it takes a free one; if another process binds that port between the check and
        the server's own bind (two test workers, or a client's ephemeral port), it tries another, up to
        ``PORT_ATTEMPTS`` times. A port the caller chose is used as is."""
        if self.appendfsync not in ("always", "everysec", "no"):
            raise ValueError(f"appendfsync must be always, everysec or no, not {self.appendfsync!r}")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        chosen = not self.port
        for attempt in range(1, PORT_ATTEMPTS + 1):
            if chosen:
                self.port = free_port(self.host)
            try:
                return self._start(timeout)
            except _PortTaken:
                if not chosen or attempt == PORT_ATTEMPTS:
                    raise
        raise AssertionError("unreachable")

    def _start(self, timeout: float) -> RedisServer:
        # redis-server chdirs into --dir before it opens --logfile: a relative data dir (the default
        # ".tether/redis") would put the log path under itself, and the server would exit at start.
        data_dir = self.data_dir.resolve()
        args = [
            redis_server_binary(),
            "--port",
            str(self.port),
            "--bind",
            self.host,
            "--dir",
            str(data_dir),
            "--appendonly",
            "yes",
            "--appendfsync",
            self.appendfsync,
            "--save",
            "",
            "--stream-node-max-bytes",
            str(STREAM_NODE_MAX_BYTES),
            "--daemonize",
            "no",
            "--protected-mode",
            "no",
            "--logfile",
            str(data_dir / "redis.log"),
        ]
        if self.password:
            args += ["--requirepass", self.password]
        log = data_dir / "redis.log"
        logged = log.stat().st_size if log.exists() else 0  # a restart appends to the same log
        self._proc = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                said = ""
                if log.exists():  # not when it exits before opening its log (a bad argument)
                    with log.open("rb") as f:
                        f.seek(logged)
                        said = f.read().decode(errors="replace")
                error = _PortTaken if ADDRESS_IN_USE in said else DependencyError
                raise error(f"redis-server exited at start (code {self._proc.returncode}): {said[-800:]}")
            # the pid check: while ours has not yet failed to bind, a server someone else started on the
            # same port would answer PING
            if self._answering_pid() == self._proc.pid:
                return self
            time.sleep(0.02)
        self.stop()
        raise DependencyError(f"redis-server on port {self.port} did not answer PING within {timeout}s")

    def _answering_pid(self) -> int | None:
        """The process id of the server answering PING on ``host:port`` (from ``INFO server``), or None
        (nobody listening, or a server still loading its AOF: it answers PING with ``-LOADING``)."""
        try:
            with socket.create_connection((self.host, self.port), timeout=0.2) as s:
                if self.password:
                    s.sendall(f"AUTH {self.password}\r\n".encode())
                    s.recv(64)
                s.sendall(b"PING\r\nINFO server\r\n")
                reply = b""
                while not re.search(rb"process_id:\d+\r\n", reply):
                    chunk = s.recv(4096)
                    if not chunk:
                        return None
                    reply += chunk
                    if reply.startswith(b"-"):  # -LOADING, -NOAUTH: not ready, or not ours
                        return None
        except OSError:
            return None
        match = re.search(rb"process_id:(\d+)\r\n", reply)
        return int(match.group(1)) if reply.startswith(b"+PONG") and match else None

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 5 s)."""
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)

    def kill(self) -> None:
        """SIGKILL the server (a crash: no shutdown, no final AOF rewrite) and wait until it is gone.

        The port and data directory are kept, so ``start()`` brings the same server back: it replays
        its AOF and listens where clients expect it."""
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.kill()
        proc.wait(timeout=10)

    def restart(self, timeout: float = 10.0) -> RedisServer:
        """Start the server again on the same port and data directory (after ``kill``/``stop``)."""
        if self._proc is not None and self._proc.poll() is None:
            raise RuntimeError(f"redis-server on port {self.port} is still running")
        return self.start(timeout)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _default_data_dir() -> Path:
    return Path(os.environ.get("TETHER_HOME", ".tether")) / "redis"
