"""The private ``redis-server`` (``cluster.redis_server``): a port picked for it that another process takes.

``free_port`` hands out a port that was free a moment ago; between that and the server's own bind another
process can take it (another test worker's server, a client's ephemeral port). Judged by who answers on the
server's URL: the process id in ``INFO server`` against the child ``RedisServer`` started.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

import cluster.redis_server as redis_server_module
from cluster.redis_server import RedisServer, free_port
from runtime.errors import DependencyError


def _server_pid(url: str) -> int:
    client = redis.Redis.from_url(url, socket_timeout=5.0)
    try:
        return int(client.info("server")["process_id"])
    finally:
        client.close()


def _hand_out_first(monkeypatch: pytest.MonkeyPatch, port: int) -> None:
    """``free_port`` hands out ``port`` first, then truly free ones."""

    def ports() -> Iterator[int]:
        yield port
        while True:
            yield free_port()

    handed = ports()
    monkeypatch.setattr(redis_server_module, "free_port", lambda host="127.0.0.1": next(handed))


@pytest.fixture
def listening() -> Iterator[int]:
    """A port some other process holds: a bound, listening socket that never answers."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield int(s.getsockname()[1])


def test_a_picked_port_taken_before_the_server_binds_it_is_replaced(
    tmp_path: Path, listening: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given free_port first hands out a port that is taken by the time the server binds it
    _hand_out_first(monkeypatch, listening)
    # When the server starts
    with RedisServer(data_dir=tmp_path / "redis") as server:
        # Then it runs on another port, and the server answering there is the one it started
        assert server.port != listening
        assert _server_pid(server.url) == server.pid


def test_a_port_the_caller_chose_is_not_replaced(tmp_path: Path, listening: int) -> None:
    server = RedisServer(data_dir=tmp_path / "redis", port=listening)
    with pytest.raises(DependencyError, match="Address already in use"):
        server.start()
    assert server.port == listening


def test_without_retries_the_taken_port_fails_the_start(
    tmp_path: Path, listening: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the control of the first test: the same taken port with one attempt fails, so it was really taken
    _hand_out_first(monkeypatch, listening)
    monkeypatch.setattr(redis_server_module, "PORT_ATTEMPTS", 1)
    with pytest.raises(DependencyError, match="Address already in use"):
        RedisServer(data_dir=tmp_path / "redis").start()


def _pong_only(self: RedisServer) -> int | None:
    """The check before this change: any server answering PING on the port counted as the one started."""
    try:
        with socket.create_connection((self.host, self.port), timeout=0.2) as s:
            s.sendall(b"PING\r\n")
            if s.recv(64).startswith(b"+PONG"):
                return self.pid
    except OSError:
        pass
    return None


@pytest.mark.parametrize("check", ["pid", "control-any-pong"])
def test_a_server_already_on_the_picked_port_is_never_taken_for_ours(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, check: str
) -> None:
    # Given another worker's Redis already runs on the port free_port hands out first
    with RedisServer(data_dir=tmp_path / "other") as other:
        if check == "control-any-pong":
            monkeypatch.setattr(RedisServer, "_answering_pid", _pong_only)
        # When servers are started on it (a few: without the pid check, whether ours has failed its bind
        # before the first PING is a race)
        started_answered: list[tuple[int | None, int]] = []
        for attempt in range(5):
            _hand_out_first(monkeypatch, other.port)
            server = RedisServer(data_dir=tmp_path / f"ours-{attempt}").start()
            try:
                started_answered.append((server.pid, _server_pid(server.url)))
            finally:
                server.stop()
            if check == "control-any-pong" and started_answered[-1][1] == other.pid:
                break
        # Then every URL handed out reaches the server that start() started, never the other one
        if check == "pid":
            assert all(started == answered for started, answered in started_answered), started_answered
        else:
            assert started_answered[-1][1] == other.pid, started_answered
