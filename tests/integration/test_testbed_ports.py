"""The testbed's child processes (the simulated provider, the gRPC tool services) and their ports.

A port picked by the parent and handed to the child could be taken by another process in between (another
test worker's server, a client's ephemeral port), and a readiness check would then be answered by that
process. So the parent learns the port from the child, once the child has bound it. Judged by who answers on
the URL handed out: each provider lists its own model ids, and the squatter's are not the child's.
"""

from __future__ import annotations

import asyncio
import json
import socket
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import testbed.provider.launch as launch_module
from runtime.errors import DependencyError
from testbed.provider import ProviderConfig, ProviderThread, start_provider_subprocess, start_provider_thread
from testbed.tools import TestbedClient, TestbedProcess
from testbed.tools.host import _bound_port


def _model_ids(base_url: str) -> list[str]:
    with urllib.request.urlopen(base_url + "/models", timeout=5.0) as response:
        return [m["id"] for m in json.loads(response.read())["data"]]


@pytest.fixture
def squatter() -> Iterator[ProviderThread]:
    """Another process's provider, already listening on a port (it lists only the model ``squatter``)."""
    with start_provider_thread(ProviderConfig(models=("squatter",))) as other:
        yield other


def test_the_provider_child_binds_a_port_of_its_own_and_reports_it(squatter: ProviderThread) -> None:
    with start_provider_subprocess(ProviderConfig(models=("ours",))) as ours:
        assert ours.port not in (0, squatter.port)
        assert _model_ids(ours.base_url) == ["ours"]


def _trust_the_handed_port(port_file: Path, process: Any, deadline: float, command: list[str]) -> int:
    """The check before this change: the port handed to the child counted as its own at once, and the
    first answer on it as the child's readiness."""
    return int(command[command.index("--port") + 1])


@pytest.mark.parametrize("check", ["port-file", "control-any-answer"])
def test_a_provider_already_on_the_port_is_never_taken_for_ours(
    squatter: ProviderThread, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, check: str
) -> None:
    # Given another provider already listens on the port our child is handed
    if check == "control-any-answer":
        monkeypatch.setattr(launch_module, "_wait_for_port_file", _trust_the_handed_port)
    log = tmp_path / "provider.log"
    # When our provider is started on it
    try:
        ours = start_provider_subprocess(ProviderConfig(models=("ours",)), port=squatter.port, log_path=log)
    except DependencyError as e:
        started, error = None, str(e)
    else:
        started, error = ours, ""
    try:
        if check == "port-file":
            # Then the start fails with the child's exit, and the log says the port was taken
            assert started is None, "a URL was handed out for a port another process held"
            assert "exited with 2" in error
            assert f"could not listen on 127.0.0.1:{squatter.port}" in log.read_text()
        else:
            # (control) the handle's URL reaches the squatter: tests would talk to another server
            assert started is not None, error
            assert _model_ids(started.base_url) == ["squatter"]
    finally:
        if started is not None:
            started.stop()


def test_a_testbed_child_binds_a_port_of_its_own_and_reports_it() -> None:
    async def ledger_environments(address: str) -> tuple[Any, ...]:
        async with TestbedClient(address) as client:
            return tuple((await client.ledger()).environments)

    with TestbedProcess() as first, TestbedProcess() as second:
        assert 0 not in (first.port, second.port) and first.port != second.port
        assert first.address == f"127.0.0.1:{first.port}"
        assert asyncio.run(ledger_environments(first.address)) == ()


def test_a_testbed_on_a_port_another_process_holds_fails_its_start() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = int(held.getsockname()[1])
        with pytest.raises(DependencyError, match=f"did not start on port {port}"):
            TestbedProcess(port).start()


@pytest.mark.parametrize(
    ("line", "port"),
    [
        ("ready 127.0.0.1:40123\n", 40123),
        ("error: bad plan\n", None),
        ("ready 127.0.0.1:\n", None),
        ("", None),
    ],
)
def test_the_ready_line_gives_the_bound_port(line: str, port: int | None) -> None:
    assert _bound_port(line) == port
