"""Start and stop a private Ray head on this machine, optionally as a fake multi-node autoscaling cluster.

Two things make a local ``ray start --head`` awkward in tests on a shared machine; this module handles both:

* Isolation. ``ray start`` defaults to GCS port 6379, ray-client port 10001, dashboard agent port 52365
  and ``/tmp/ray``; another Ray on the machine would collide. Every port here is chosen free, and the
  session lives under its own short temp dir (Unix socket paths are limited to ~107 bytes, so pytest's
  long tmp paths are not usable).
* Scoped shutdown. ``ray stop`` kills every Ray process on the host, and the fake provider's worker nodes
  are children of the autoscaler's monitor that ``ray start`` does not track. ``ray start`` runs here as
  the leader of a new POSIX session; every daemon, worker node and worker process it leads to inherits
  that session id, so :meth:`RayHead.stop` signals exactly that session and nothing else.

The fake multi-node cluster renders ``cluster/autoscaler/fake_multinode.yaml`` with the GCS address it picked
and starts the head with ``RAY_FAKE_CLUSTER=1`` (see docs/operations.md).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import yaml

from runtime.errors import DependencyError, InputError

__all__ = [
    "FAKE_MULTINODE_CONFIG",
    "TRAJECTORY_RESOURCE",
    "FakeMultiNodeCluster",
    "RayHead",
    "free_tcp_port",
    "load_autoscaling_config",
    "prewarm",
    "session_pids",
]

FAKE_MULTINODE_CONFIG = Path(__file__).resolve().parent / "autoscaler" / "fake_multinode.yaml"
"""The shipped fake multi-node autoscaler config."""

TRAJECTORY_RESOURCE = "tether_trajectory"
LOOPBACK = "127.0.0.1"
"""Custom resource a trajectory actor requests; node types declare how many trajectories they hold."""

_REQUIRED_KEYS = ("cluster_name", "provider", "available_node_types", "head_node_type")
_FAKE_HEAD_TYPE = "ray.head.default"  # the fake provider hard-codes the head's node type name


def free_tcp_port() -> int:
    """A TCP port free on all interfaces a moment ago (Ray binds the node IP, not just loopback)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def _ray_cli() -> str:
    candidate = Path(sys.executable).parent / "ray"
    found = str(candidate) if candidate.exists() else shutil.which("ray")
    if found is None:
        raise DependencyError("the `ray` command is not installed in this environment", non_retryable=True)
    return found


def session_pids(session_id: int) -> list[int]:
    """PIDs of live processes whose POSIX session id is ``session_id`` (Linux ``/proc``)."""
    pids: list[int] = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # the process exited while we looked
            continue
        # Field 2 (comm) may contain spaces and parentheses; everything after the last ')' is positional:
        # state, ppid, pgrp, session, ...
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[3]) == session_id and fields[0] != "Z":
            pids.append(int(entry.name))
    return pids


def load_autoscaling_config(path: Path) -> dict[str, Any]:
    """Read a Ray cluster (autoscaler) YAML and check the keys every provider needs."""
    try:
        config = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise InputError(f"autoscaling config {path}: cannot read it as YAML: {e}") from e
    if not isinstance(config, dict):
        raise InputError(f"autoscaling config {path}: expected a mapping at the top level")
    missing = [key for key in _REQUIRED_KEYS if key not in config]
    if missing:
        raise InputError(f"autoscaling config {path}: missing required key(s) {', '.join(missing)}")
    head_type = config["head_node_type"]
    if head_type not in config["available_node_types"]:
        raise InputError(
            f"autoscaling config {path}: head_node_type {head_type!r} is not in available_node_types"
        )
    return config


@dataclass
class RayHead:
    """A ``ray start --head`` on free ports, in its own temp dir and POSIX session.

    ``start()`` returns once the head is up (``ray start`` without ``--block`` exits after its daemons are
    running); ``stop()`` terminates every process of the session, waits, then kills stragglers.
    """

    num_cpus: int = 1
    resources: Mapping[str, float] = field(default_factory=dict)
    # A small object store: test heads share one machine's /dev/shm with other sessions.
    object_store_memory: int = 200 * 1024 * 1024
    include_dashboard: bool = False
    autoscaling_config: Path | None = None
    metrics_export_port: int | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    temp_dir: Path | None = None
    port: int = 0
    dashboard_port: int = 0
    _session_id: int | None = field(default=None, init=False, repr=False)
    _own_temp_dir: bool = field(default=False, init=False, repr=False)
    _ip: str = field(default="", init=False, repr=False)

    @property
    def gcs_address(self) -> str:
        """``HOST:PORT`` of the head's GCS, what ``ray.init(address=...)`` takes."""
        return f"{self._ip}:{self.port}"

    @property
    def dashboard_url(self) -> str:
        """``http://HOST:PORT`` of the dashboard (the job submission API)."""
        return f"http://127.0.0.1:{self.dashboard_port}"

    @property
    def running(self) -> bool:
        return self._session_id is not None

    def _prepare(self) -> None:
        # Loopback only: Ray would otherwise pick the machine's routable address, and every test and
        # local cluster here must keep its traffic on this machine's loopback interface.
        self._ip = LOOPBACK
        if not self.port:
            self.port = free_tcp_port()
        if not self.dashboard_port:
            # Even without the dashboard UI, Ray's head runs its dashboard process on this port (8265 by
            # default): a free one, so two heads, or another service on 8265, never collide.
            self.dashboard_port = free_tcp_port()
        if self.temp_dir is None:
            self.temp_dir = Path(tempfile.mkdtemp(prefix="tether-ray-", dir="/tmp"))
            self._own_temp_dir = True

    def _command(self) -> list[str]:
        assert self.temp_dir is not None
        args = [
            _ray_cli(),
            "start",
            "--head",
            f"--port={self.port}",
            f"--node-ip-address={LOOPBACK}",
            f"--num-cpus={self.num_cpus}",
            f"--temp-dir={self.temp_dir}",
            f"--object-store-memory={self.object_store_memory}",
            f"--ray-client-server-port={free_tcp_port()}",
            f"--dashboard-agent-listen-port={free_tcp_port()}",
            "--disable-usage-stats",
            f"--include-dashboard={'true' if self.include_dashboard else 'false'}",
        ]
        args += ["--dashboard-host=127.0.0.1", f"--dashboard-port={self.dashboard_port}"]
        if self.resources:
            args.append(f"--resources={json.dumps(dict(self.resources))}")
        if self.metrics_export_port is not None:
            args.append(f"--metrics-export-port={self.metrics_export_port}")
        if self.autoscaling_config is not None:
            args.append(f"--autoscaling-config={self.autoscaling_config}")
        return args

    def start(self, timeout: float = 90.0) -> Self:
        """Start the head and return once ``ray start`` reports it running."""
        if self.running:
            raise RuntimeError("this Ray head is already running")
        self._prepare()
        env = {
            **os.environ,
            # Jobs' entrypoints (`tether run ...`, `python ...`) resolve in the head's environment: this venv.
            "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
            "RAY_USAGE_STATS_ENABLED": "0",
            "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
            # Explicit, not inherited: Ray turns token auth on for a head whenever ~/.ray/auth_token exists
            # (any earlier local ray.init() creates it), while drivers connecting by address stay in
            # "disabled" mode and are refused. These heads are private and disposable; pass
            # env={"RAY_AUTH_MODE": "token", ...} to run one with token auth.
            "RAY_AUTH_MODE": "disabled",
            **self.env,
        }
        # A new session: the session id is the pid of `ray start`, inherited by everything it spawns.
        proc = subprocess.Popen(
            self._command(),
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self._session_id = proc.pid
        try:
            output, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise DependencyError(f"`ray start --head` did not finish within {timeout:.0f}s") from None
        if proc.returncode != 0:
            self.stop()
            tail = output.decode(errors="replace")[-4000:]
            raise DependencyError(f"`ray start --head` failed (exit {proc.returncode}):\n{tail}")
        return self

    def stop(self, grace: float = 3.0) -> None:
        """Terminate every process of this head's session (SIGTERM, then SIGKILL after ``grace`` seconds).

        The grace is short on purpose: with every daemon signalled at once, gcs_server and the raylets wait on
        each other for a graceful shutdown that does not come, and the session is being discarded anyway.
        """
        if self._session_id is None:
            return
        session = self._session_id
        self._signal_all(session, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while session_pids(session) and time.monotonic() < deadline:
            time.sleep(0.2)
        self._signal_all(session, signal.SIGKILL)
        deadline = time.monotonic() + grace
        while session_pids(session) and time.monotonic() < deadline:
            time.sleep(0.1)
        self._session_id = None
        if self._own_temp_dir and self.temp_dir is not None:
            shutil.rmtree(self.temp_dir, ignore_errors=True)
            self.temp_dir = None
            self._own_temp_dir = False

    @staticmethod
    def _signal_all(session: int, sig: signal.Signals) -> None:
        for pid in session_pids(session):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


@dataclass
class FakeMultiNodeCluster:
    """A Ray head with the ``fake_multinode`` autoscaler: worker nodes are local raylets it adds and removes.

    The head's CPU count is taken from the config's ``ray.head.default`` node type so the autoscaler's view of
    the head matches what was started.
    """

    config_path: Path = FAKE_MULTINODE_CONFIG
    update_interval_s: int = 1
    overrides: Mapping[str, Any] = field(default_factory=dict)
    head: RayHead = field(default_factory=RayHead, init=False)

    @property
    def address(self) -> str:
        """The GCS address to pass to ``ray.init``."""
        return self.head.gcs_address

    def start(self, timeout: float = 90.0) -> Self:
        config = {**load_autoscaling_config(self.config_path), **self.overrides}
        if config["provider"].get("type") != "fake_multinode":
            raise InputError(f"autoscaling config {self.config_path}: provider.type must be fake_multinode")
        if config["head_node_type"] != _FAKE_HEAD_TYPE:
            raise InputError(
                f"autoscaling config {self.config_path}: "
                f"the fake provider needs head_node_type {_FAKE_HEAD_TYPE!r}"
            )
        head_resources = dict(config["available_node_types"][_FAKE_HEAD_TYPE].get("resources", {}))
        num_cpus = int(head_resources.pop("CPU", 1))
        self.head = RayHead(
            num_cpus=num_cpus,
            resources=head_resources,
            env={"RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": str(self.update_interval_s)},
        )
        self.head._prepare()
        assert self.head.temp_dir is not None
        # Worker nodes join the GCS the provider is told about; point it at the port we picked.
        config["provider"] = {**config["provider"], "gcs_address": self.head.gcs_address}
        rendered = self.head.temp_dir / "autoscaling.yaml"
        rendered.write_text(yaml.safe_dump(config, sort_keys=False))
        self.head.autoscaling_config = rendered
        self.head.start(timeout=timeout)
        return self

    def stop(self) -> None:
        """Stop the head, the autoscaler and every worker node it launched."""
        self.head.stop()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def prewarm(trajectories: int, per_trajectory: Mapping[str, float] | None = None) -> None:
    """Ask the autoscaler for room for ``trajectories`` trajectory actors now, before they are created.

    Replaces any earlier request from this driver (``request_resources`` is declarative); ``prewarm(0)``
    withdraws it. Needs a connected Ray driver (``ray.init(address=...)``).
    """
    if trajectories < 0:
        raise InputError(f"prewarm: trajectories must be >= 0, got {trajectories}")
    from ray.autoscaler.sdk import request_resources

    bundle = dict(per_trajectory or {TRAJECTORY_RESOURCE: 1.0})
    request_resources(bundles=[bundle] * trajectories)
