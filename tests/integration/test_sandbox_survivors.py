"""The survivor scan behind a kill (``actors.sandbox._survivors``): processes carrying a run's id.

A namespaced run's survivors are looked for outside the host's PID namespace only (a run isolated in its own
namespace starts nothing in the host's). Judged with real processes: one in the host namespace and one in a
new PID namespace (bubblewrap), both carrying the run id in their environment.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator

import pytest

from actors.sandbox import RUN_ENV, _survivors
from actors.sandbox_isolation import namespace_of, probe_isolation

pytestmark = pytest.mark.integration


def _wait_for(predicate, what: str, timeout_s: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:  # it ended meanwhile
        return b""


@pytest.fixture
def run_id() -> str:
    return f"survivor-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def host_process(run_id: str) -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(["sleep", "30"], env={**os.environ, RUN_ENV: run_id})
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def test_a_host_process_with_the_run_id_is_found_unless_the_host_namespace_is_left_out(
    run_id: str, host_process: subprocess.Popen[bytes]
) -> None:
    _wait_for(lambda: host_process.pid in _survivors(run_id), "the process to show its environment")
    assert _survivors(run_id) == [host_process.pid]
    # the control: with the host's namespace left out it is not read at all
    assert _survivors(run_id, outside=namespace_of(os.getpid())) == []
    assert _survivors(f"other-{run_id}") == []


@pytest.mark.skipif(
    shutil.which("bwrap") is None or not probe_isolation().pid_namespace, reason="no PID namespaces here"
)
def test_a_process_in_another_namespace_is_found_with_the_host_namespace_left_out(run_id: str) -> None:
    argv = ["bwrap", "--die-with-parent", "--unshare-pid", "--ro-bind", "/", "/", "--proc", "/proc"]
    wrapper = subprocess.Popen(
        [*argv, "--dev", "/dev", "sleep", "30"],
        env={**os.environ, RUN_ENV: run_id},
    )
    inside: list[int] = []
    try:
        ours = namespace_of(os.getpid())

        # until `sleep` runs inside, bwrap is still forking there: a scan could see one process, the next two
        def sleeping_inside() -> bool:
            found = _survivors(run_id)
            return any(namespace_of(p) != ours and _cmdline(p).startswith(b"sleep\0") for p in found)

        _wait_for(sleeping_inside, "the namespaced process")
        inside = [p for p in _survivors(run_id) if namespace_of(p) != ours]
        assert inside and _survivors(run_id, outside=ours) == inside
    finally:
        wrapper.kill()
        wrapper.wait()
        for pid in inside:  # the namespace's own processes, whatever bwrap's parent-death signal did
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
