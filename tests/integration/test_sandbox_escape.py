"""Nothing a sandboxed command starts escapes the sandbox: ``setsid``, a double fork, ``nohup`` and a
daemonising child are all gone after the command ends, after a kill, and after the death of the process
that hosted the sandbox; the root is read-only, only the workspace is writable, there is no network, and
teardown removes the workspace.

The judge is the host's process table, searched for a marker carried in each escapee's argv (a daemon
changes its directory, session and parent, but not its argv), never the sandbox's own bookkeeping.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from actors.sandbox import Sandbox, probe_isolation

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not probe_isolation().pid_namespace, reason=probe_isolation().reason),
]

PY = sys.executable


def processes_carrying(marker: str, *, exact: bool = False) -> list[int]:
    """Host pids whose command line contains ``marker`` (zombies have none and are not counted);
    ``exact``: only those with ``marker`` as an argument of its own (the escapee, not a shell naming it)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if (marker.encode() in cmdline.split(b"\0")) if exact else (marker.encode() in cmdline):
            found.append(int(entry.name))
    return found


def escapee_started(marker: str) -> bool:
    return bool(processes_carrying(marker, exact=True))


async def until(predicate: object, timeout_s: float = 10.0) -> bool:
    """Poll ``predicate()`` until true or ``timeout_s`` passes (bounded: the bound only turns a hang into a
    failure)."""
    assert callable(predicate)
    give_up = time.monotonic() + timeout_s
    while time.monotonic() < give_up:
        if predicate():
            return True
        await asyncio.sleep(0.02)
    return bool(predicate())


def sleeper(marker: str) -> str:
    """A shell word that runs a long sleep whose argv carries ``marker``."""
    return f"{PY} -c 'import time; time.sleep(600)' {marker}"


DAEMON = textwrap.dedent(
    """
    import os, sys, time
    if os.fork():
        sys.exit(0)
    os.setsid()
    if os.fork():
        sys.exit(0)
    os.chdir("/")
    for fd in (0, 1, 2):
        os.close(fd)
    time.sleep(600)
    """
)


def escapes(marker: str) -> dict[str, list[str]]:
    """Commands that each leave a process carrying ``marker`` behind, by a different escape route."""
    sleep = sleeper(marker)
    return {
        "setsid": ["sh", "-c", f"setsid {sleep} >/dev/null 2>&1 < /dev/null &"],
        "double-fork": ["sh", "-c", f"( {sleep} >/dev/null 2>&1 & ) ; exit 0"],
        "nohup": ["sh", "-c", f"nohup {sleep} >/dev/null 2>&1 &"],
        "daemon": [PY, "-c", DAEMON, marker],
    }


ROUTES = ["setsid", "double-fork", "nohup", "daemon"]


@pytest.fixture
async def sandbox(tmp_path: Path) -> AsyncIterator[Sandbox]:
    box = Sandbox("t-escape", tmp_path / "workspaces", require_isolation=True)
    try:
        yield box
    finally:
        await box.kill_all()


@pytest.fixture
def marker() -> Iterator[str]:
    mark = f"tether-escape-{uuid.uuid4().hex}"
    yield mark
    for pid in processes_carrying(mark):  # never leave one behind, even when a test fails
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("route", ROUTES)
async def test_nothing_a_finished_command_started_survives_it(
    sandbox: Sandbox, marker: str, route: str
) -> None:
    # Given a command that starts an escapee and exits at once
    # When the command returns
    result = await sandbox.run(escapes(marker)[route], timeout=30)
    # Then the escapee is gone with it
    assert result.exit_code == 0 and result.isolated
    assert processes_carrying(marker) == []


@pytest.mark.parametrize("route", ROUTES)
async def test_nothing_survives_a_trajectory_kill(sandbox: Sandbox, marker: str, route: str) -> None:
    # Given a command that started an escapee and then keeps running
    command = escapes(marker)[route]
    command = ["sh", "-c", f"{' '.join(_quote(c) for c in command)}; sleep 600"]
    run = asyncio.ensure_future(sandbox.run(command, timeout=600))
    assert await until(lambda: escapee_started(marker)), "the escapee never started"
    # When the trajectory is killed
    await sandbox.kill_all()
    result = await asyncio.wait_for(run, 30)
    # Then the command and the escapee are gone, and the run says it was killed
    assert result.killed
    assert processes_carrying(marker) == []


def _quote(word: str) -> str:
    return "'" + word.replace("'", "'\"'\"'") + "'"


HOST = textwrap.dedent(
    """
    import asyncio, sys
    from pathlib import Path
    from actors.sandbox import Sandbox

    async def main() -> None:
        box = Sandbox("t-host", Path(sys.argv[1]), require_isolation=True)
        command = ["sh", "-c", sys.argv[2]]
        run = asyncio.ensure_future(box.run(command, timeout=600))
        await asyncio.sleep(600)

    asyncio.run(main())
    """
)


@pytest.mark.parametrize("route", ROUTES)
async def test_nothing_survives_the_death_of_the_process_hosting_the_sandbox(
    tmp_path: Path, marker: str, route: str
) -> None:
    # Given a process (an actor, say) whose sandbox runs a command that started an escapee
    command = " ".join(_quote(c) for c in escapes(marker)[route]) + "; sleep 600"
    repo = Path(__file__).resolve().parents[2]
    host = subprocess.Popen(
        [PY, "-c", HOST, str(tmp_path / "workspaces"), command],
        cwd=repo,
        env={**os.environ, "PYTHONPATH": str(repo)},
        start_new_session=True,
    )
    try:
        assert await until(lambda: escapee_started(marker), 20), "the escapee never started"
        # When that process is SIGKILLed, with no chance to tear anything down
        os.kill(host.pid, signal.SIGKILL)
        host.wait(10)
        # Then the escapee dies with it (the sandbox dies with its parent, and its namespace with it)
        assert await until(lambda: processes_carrying(marker) == [], 10), processes_carrying(marker)
    finally:
        if host.poll() is None:
            host.kill()
            host.wait(10)


async def test_a_command_cancelled_while_its_sandbox_is_still_starting_leaves_nothing(
    sandbox: Sandbox, marker: str
) -> None:
    # Given commands cancelled at moments spread over the sandbox's own setup (the window where the
    # wrapper is killed before its namespace learned to die with it)
    command = ["sh", "-c", f"{sleeper(marker)} & sleep 600"]
    for attempt in range(30):
        run = asyncio.ensure_future(sandbox.run(command, timeout=600))
        await asyncio.sleep((attempt % 10) * 0.001)
        # When the caller gives up on it
        run.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(run, 30)
    # Then nothing of any of them is left
    assert processes_carrying(marker) == []


async def test_the_root_is_read_only_and_only_the_workspace_is_writable(
    sandbox: Sandbox, tmp_path: Path
) -> None:
    # Given a file outside the workspace, on the host
    outside = tmp_path / "outside.txt"
    outside.write_text("host\n")
    # When a command tries to write inside its workspace, beside it, and in the host's /etc
    script = f"echo mine > made.txt; echo theirs > {outside} ; echo x > /etc/tether-escape-test ; exit 0"
    result = await sandbox.run(["sh", "-c", script], timeout=10)
    # Then only the workspace write landed
    assert (sandbox.workspace / "made.txt").read_text() == "mine\n"
    assert outside.read_text() == "host\n"
    assert not Path("/etc/tether-escape-test").exists()
    assert result.stderr.count("Read-only file system") == 2, result.stderr


@pytest.fixture
def listener() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        yield s.getsockname()[1]


async def test_there_is_no_network_from_inside(sandbox: Sandbox, listener: int) -> None:
    # When a command tries the host's loopback and lists its network interfaces
    code = (
        "import socket, sys\n"
        "print(sorted(line.split(':')[0].strip() for line in open('/proc/net/dev').readlines()[2:]))\n"
        "try:\n"
        "    socket.create_connection(('127.0.0.1', int(sys.argv[1])), timeout=3)\n"
        "    print('connected')\n"
        "except OSError as e:\n"
        "    print('refused', e.errno)\n"
    )
    result = await sandbox.run([PY, "-c", code, str(listener)], timeout=10)
    # Then it has only a loopback of its own and reaches nothing
    interfaces, outcome = result.stdout.splitlines()
    assert result.network_isolated
    assert "connected" not in outcome and outcome.startswith("refused")
    assert interfaces == "['lo']"


async def test_teardown_removes_the_workspace_and_a_daemon_cannot_bring_it_back(
    sandbox: Sandbox, marker: str
) -> None:
    # Given a daemon that keeps writing into the workspace
    writer = f'{PY} -c \'import time\nwhile True:\n  open("log", "a").write("x"); time.sleep(0.01)\' {marker}'
    run = asyncio.ensure_future(
        sandbox.run(["sh", "-c", f"setsid sh -c {_quote(writer)} & sleep 600"], timeout=600)
    )
    assert await until(lambda: (sandbox.workspace / "log").exists()), "the writer never wrote"
    # When the sandbox is torn down
    await sandbox.teardown()
    await asyncio.wait_for(run, 30)
    # Then the workspace is gone and stays gone: nothing is left to write into it
    assert not sandbox.workspace.exists()
    assert processes_carrying(marker) == []
    await asyncio.sleep(0.2)  # longer than the writer's period: a survivor would have recreated the file
    assert not sandbox.workspace.exists()
