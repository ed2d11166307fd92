"""Run the simulated provider for tests and benchmarks: in a subprocess or in a background thread.

Both handles expose the same surface: ``base_url``, ``url``, ``stats()``, ``reset()``,
``configure(**patch)`` and ``stop()``, and work as context managers. Use :class:`ProviderServer`
directly when the caller already runs an event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from runtime.errors import DependencyError
from testbed.provider.config import ConfigPatch, ProviderConfig
from testbed.provider.server import ProviderServer

__all__ = [
    "ProviderHandle",
    "ProviderProcess",
    "ProviderThread",
    "start_provider_subprocess",
    "start_provider_thread",
]


class ProviderHandle:
    """HTTP control of a running provider at ``url`` (stdlib only, usable from sync code)."""

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def base_url(self) -> str:
        """The OpenAI ``base_url``: ``http://HOST:PORT/v1``."""
        return self.url + "/v1"

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None, timeout: float = 5.0) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.url + path, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())

    def stats(self) -> dict[str, Any]:
        """``GET /testbed/stats`` (shape documented in :mod:`testbed.provider.stats`)."""
        return dict(self._call("GET", "/testbed/stats"))

    def reset(self) -> None:
        self._call("POST", "/testbed/reset", {})

    def configure(self, **patch: Any) -> dict[str, Any]:
        """``POST /testbed/config`` with a :class:`ConfigPatch` (validated here first)."""
        body = ConfigPatch.model_validate(patch).model_dump(exclude_none=True)
        return dict(self._call("POST", "/testbed/config", body))

    def ready(self) -> bool:
        try:
            self._call("GET", "/v1/models", timeout=1.0)
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            return False
        return True


class ProviderProcess(ProviderHandle):
    """A provider running as ``python -m testbed.provider`` in a child process."""

    def __init__(self, host: str, port: int, process: subprocess.Popen[bytes]) -> None:
        super().__init__(host, port)
        self.process = process

    @property
    def pid(self) -> int:
        return self.process.pid

    def stop(self, timeout: float = 5.0) -> None:
        """Terminate the child (SIGTERM, then SIGKILL after ``timeout``) and reap it."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout)

    def __enter__(self) -> ProviderProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _cli_args(config: ProviderConfig) -> list[str]:
    return [
        f"--tpm={config.tpm}",
        f"--rpm={config.rpm}",
        f"--ttft-ms={config.ttft_ms}",
        f"--tokens-per-s={config.tokens_per_s}",
        f"--window-s={config.window_s}",
        f"--limiter={config.limiter.value}",
        *([f"--sub-window-s={config.sub_window_s}"] if config.sub_window_s is not None else []),
        *(["--sub-window-tokens"] if config.sub_window_tokens else []),
        *([] if config.count_rejected else ["--no-count-rejected"]),
        f"--default-max-tokens={config.default_max_tokens}",
        *(f"--model={m}" for m in config.models),
        *([f"--api-key={config.api_key}"] if config.api_key else []),
    ]


def start_provider_subprocess(
    config: ProviderConfig | None = None,
    *,
    host: str = "127.0.0.1",
    port: int | None = None,
    startup_timeout: float = 20.0,
    log_path: Path | None = None,
    python: str = sys.executable,
) -> ProviderProcess:
    """Start the provider in a child process on ``port`` (None: the child binds any free port); wait until
    it listens and answers.

    The port is learnt from the child itself (``--port-file``, written once it listens), never guessed: a
    port picked here and handed over could be taken by another process first, and a readiness check
    would then be answered by that process's server. For the same reason a port the caller chose counts
    as ready only once the child has bound it; if another process holds it, the child exits and the start
    fails with its exit code.
    """
    config = config or ProviderConfig()
    with tempfile.TemporaryDirectory(prefix="tether-provider-") as scratch:
        port_file = Path(scratch) / "port"
        command = [
            python, "-m", "testbed.provider", "--host", host, "--port", str(port or 0),
            "--port-file", str(port_file), *_cli_args(config),
        ]  # fmt: skip
        log = open(log_path, "ab") if log_path is not None else subprocess.DEVNULL  # noqa: SIM115
        try:
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        finally:
            if log_path is not None:
                log.close()  # type: ignore[union-attr]
        deadline = time.monotonic() + startup_timeout
        bound = _wait_for_port_file(port_file, process, deadline, command)
    handle = ProviderProcess(host, bound, process)
    while not handle.ready():
        if process.poll() is not None:
            raise DependencyError(
                f"simulated provider exited with {process.returncode} while starting: {command}"
            )
        if time.monotonic() > deadline:
            handle.stop()
            raise DependencyError(
                f"simulated provider did not answer on {handle.url} within {startup_timeout}s"
            )
        time.sleep(0.05)
    return handle


def _wait_for_port_file(
    port_file: Path, process: subprocess.Popen[bytes], deadline: float, command: list[str]
) -> int:
    """The port the child wrote once it listened; a child that exits or stays silent fails the start."""
    while True:
        with contextlib.suppress(FileNotFoundError):
            return int(port_file.read_text())
        if process.poll() is not None:
            raise DependencyError(
                f"simulated provider exited with {process.returncode} while starting"
                f" (port taken, or bad options; its output goes to the log): {command}"
            )
        if time.monotonic() > deadline:
            process.kill()
            process.wait()
            raise DependencyError(f"simulated provider did not listen in time: {command}")
        time.sleep(0.02)


class ProviderThread(ProviderHandle):
    """A provider served by its own event loop in a daemon thread of this process (for sync callers)."""

    def __init__(self, config: ProviderConfig, host: str, port: int) -> None:
        super().__init__(host, port)
        self._loop = asyncio.new_event_loop()
        self.server = ProviderServer(config, host=host, port=port)
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="tether-sim-provider", daemon=True
        )
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self.server.start(), self._loop).result(timeout=10)
        self.port = self.server.port

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the server, the loop and the thread."""
        if not self._thread.is_alive():
            return
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(self.server.stop(), self._loop).result(timeout=timeout)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout)
        self._loop.close()

    def __enter__(self) -> ProviderThread:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_provider_thread(
    config: ProviderConfig | None = None, *, host: str = "127.0.0.1", port: int = 0
) -> ProviderThread:
    """Start the provider in a background thread of this process (``port=0``: the OS picks one)."""
    return ProviderThread(config or ProviderConfig(), host, port)
