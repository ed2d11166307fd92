"""``AdmitWhenWarm``: the node's model client is warmed before a trajectory's first turn admission, once; a
warm that fails or overruns never keeps the turn from being admitted."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from actors.model_client import AdmitWhenWarm, RayModelClient
from runtime.ports import AdmissionPort, TurnGrant, TurnRequest


class _Scheduler:
    def __init__(self, events: list[str]) -> None:
        self.events = events
        self.settled: list[tuple[str, int]] = []

    async def admit_turn(self, request: TurnRequest) -> TurnGrant:
        self.events.append("admit")
        return TurnGrant(f"g{len(self.events)}", request.estimated_tokens, 0.0)

    async def settle_turn(self, grant_id: str, actual_tokens: int) -> None:
        self.settled.append((grant_id, actual_tokens))


class _Client:
    """Stands in for ``RayModelClient``: its warm takes ``delay`` seconds, or raises ``error``."""

    def __init__(self, events: list[str], delay: float = 0.0, error: Exception | None = None) -> None:
        self.events, self.delay, self.error = events, delay, error

    async def warm(self) -> None:
        self.events.append("warm start")
        await asyncio.sleep(self.delay)
        if self.error is not None:
            raise self.error
        self.events.append("warm done")


def _request() -> TurnRequest:
    return TurnRequest("t1", "interactive", "http://provider/v1|m", 100, 0.0)


def _port(events: list[str], client: _Client, timeout_s: float = 5.0) -> tuple[AdmitWhenWarm, _Scheduler]:
    scheduler = _Scheduler(events)
    fake: Any = client
    return AdmitWhenWarm(scheduler, fake, timeout_s, "t1"), scheduler


def test_it_is_an_admission_port_over_a_model_client() -> None:
    events: list[str] = []
    port, _ = _port(events, _Client(events))
    assert isinstance(port, AdmissionPort)
    assert hasattr(RayModelClient, "warm")


async def test_the_first_admission_waits_for_the_warm_and_later_ones_do_not_warm_again() -> None:
    events: list[str] = []
    port, scheduler = _port(events, _Client(events, delay=0.05))
    await port.admit_turn(_request())
    await port.admit_turn(_request())
    await port.settle_turn("g1", 42)
    assert events == ["warm start", "warm done", "admit", "admit"]
    assert scheduler.settled == [("g1", 42)]


async def test_a_failed_warm_is_logged_and_the_turn_admitted(caplog: pytest.LogCaptureFixture) -> None:
    events: list[str] = []
    port, _ = _port(events, _Client(events, error=RuntimeError("no node client")))
    with caplog.at_level(logging.WARNING, logger="actors.model_client"):
        grant = await port.admit_turn(_request())
    assert grant.grant_id and events == ["warm start", "admit"]
    assert "t1: the node's model client was not warmed" in caplog.text and "no node client" in caplog.text
    await port.admit_turn(_request())
    assert events == ["warm start", "admit", "admit"]  # not warmed again


async def test_a_warm_that_overruns_its_bound_is_given_up() -> None:
    events: list[str] = []
    port, _ = _port(events, _Client(events, delay=30.0), timeout_s=0.05)
    await asyncio.wait_for(port.admit_turn(_request()), 5.0)
    assert events == ["warm start", "admit"]


async def test_an_admission_cancelled_while_warming_warms_again_next_time() -> None:
    events: list[str] = []
    client = _Client(events, delay=30.0)
    port, _ = _port(events, client)
    first = asyncio.ensure_future(port.admit_turn(_request()))
    await asyncio.sleep(0.02)
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    client.delay = 0.0
    await port.admit_turn(_request())
    assert events == ["warm start", "warm start", "warm done", "admit"]
