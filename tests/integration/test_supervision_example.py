"""``examples/supervision.yaml`` through ``tether run``'s own services and driver on a local Ray (issue 12).

One run, driven as an operator would by hand (the example's header lists the same commands), with the
evidence collected once and judged per claim below:

- a looping trajectory reaches the hold and appears in ``tether escalations`` with its detector's evidence;
- an incident opened on a tool holds every trajectory using it, the artifacts they produced are quarantined
  and refused as another trajectory's input (judged by the testbed's own record of note reads), and their
  cleanup completes when they end (judged by the provisioner's own record of environments);
- a dependency outage moves trajectories to the constrained rung and their results say so;
- a parent delegates to three children and the sum of all spend never exceeds the parent's budget (each
  child's spend read from its own record);
- killing a parent ends all its children within a second or two, each through its own FINALIZING.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
import typer
from typer.testing import CliRunner

from cluster.cli_control import Target
from cluster.cli_supervise import SupervisionCli
from cluster.control_client import ControlClient, TrajectoryStatus
from cluster.runner import RunOptions, RunResult, Services, run_driver
from cluster.supervision_store import RedisSupervisionStore
from cluster.workload import load_workload
from testbed.tools.host import TestbedClient
from testbed.tools.ledger import LedgerSnapshot
from testbed.tools.services import note_id_of

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "supervision.yaml"
RUN = "sup"
NOTE_A = note_id_of("summary a", "pool fix for r18")
NOTE_B = note_id_of("summary b", "cache fix for r18")
ENDED = ("COMPLETED", "FAILED", "CANCELED")


def tid(name: str) -> str:
    return f"{RUN}.{name}"


@dataclass
class Evidence:
    """What the run left, collected once (the tests below judge it)."""

    escalations_listed: str = ""
    looper: TrajectoryStatus | None = None
    guard_escalation: dict[str, Any] = field(default_factory=dict)
    incident: dict[str, Any] = field(default_factory=dict)
    incident_opened: str = ""
    incident_closing: str = ""
    held_after_incident: dict[str, TrajectoryStatus] = field(default_factory=dict)
    quarantined: dict[str, str] = field(default_factory=dict)
    ledger_before_reader: LedgerSnapshot | None = None
    ledger_after_reader: LedgerSnapshot | None = None
    ledger_at_end: LedgerSnapshot | None = None
    children: dict[str, dict[str, Any]] = field(default_factory=dict)
    kill_to_children_ended_s: float = -1.0
    boss_children_after_kill: dict[str, TrajectoryStatus] = field(default_factory=dict)
    result: RunResult | None = None
    errors: list[str] = field(default_factory=list)


async def wait_for(what: str, check: Callable[[], Awaitable[bool]], timeout_s: float = 180.0) -> None:
    give_up = time.monotonic() + timeout_s
    while not await check():
        if time.monotonic() > give_up:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        await asyncio.sleep(0.1)


async def orchestrate(redis_url: str, testbed: str, keyring: Path, ev: Evidence) -> None:
    redis = aioredis.Redis.from_url(redis_url)
    control = ControlClient(redis, url=redis_url, keyring=keyring)
    store = RedisSupervisionStore(redis)
    ledger = TestbedClient(testbed)
    cli = SupervisionCli(resolve=lambda url: Target(redis_url, embedded=False))
    app = typer.Typer()
    cli.register(app)
    runner = CliRunner()

    async def status(name: str) -> TrajectoryStatus:
        return await control.status(name if "." in name else tid(name)) or TrajectoryStatus(
            trajectory_id=name
        )

    async def state_is(name: str, *states: str) -> bool:
        return (await status(name)).state in states

    try:
        # 1. the loop is held by its watchdog and queued for a person
        await wait_for("the looper's watchdog hold", lambda: _held(status("looper"), "watchdog"))
        ev.looper = await status("looper")
        ev.escalations_listed = await asyncio.to_thread(lambda: runner.invoke(app, ["escalations"]).output)
        ev.guard_escalation = next(
            (
                e
                for e in await store.escalations()
                if e["trajectory_id"] == tid("looper") and e["trigger"] == "guard"
            ),
            {},
        )
        # 2. the provisioners made their artifacts and wait; the reader waits for its approval
        for name in ("provisioner-a", "provisioner-b", "reader"):
            await wait_for(f"{name} awaiting approval", lambda n=name: state_is(n, "AWAITING_APPROVAL"))  # type: ignore[misc]
        ev.ledger_before_reader = await ledger.ledger()
        # 3. an incident on provision_env: every user of it is held at once, its artifacts quarantined
        opened = await asyncio.to_thread(
            lambda: runner.invoke(
                app,
                ["incident", "open", "--tool", "provision_env", "--reason", "fixture data seen in a note",
                 "--cause", "a poisoned README (unconfirmed)"],
            )
        )  # fmt: skip
        ev.incident_opened = opened.output
        incident_id = opened.output.split()[1].rstrip(":") if opened.exit_code == 0 else ""
        for name in ("provisioner-a", "provisioner-b"):
            await wait_for(f"{name} held by the incident", lambda n=name: _held(status(n), "incident"))  # type: ignore[misc]
            ev.held_after_incident[name] = await status(name)
        ev.quarantined = await store.quarantined([NOTE_A, NOTE_B])
        # 4. the reader, approved now, tries to read provisioner-a's note: refused at the dispatch boundary
        await control.approve(tid("reader"), issuer="operator")
        await wait_for("the reader to end", lambda: state_is("reader", *ENDED))
        ev.ledger_after_reader = await ledger.ledger()
        # 5. the delegator's three children ran and reported
        await wait_for("the delegator to end", lambda: state_is("delegator", *ENDED))
        for n in (1, 2, 3):
            raw = await redis.hgetall(f"tether:status:{tid('delegator')}.c{n}")
            ev.children[f"c{n}"] = {k.decode(): v.decode() for k, v in raw.items()}
        # 6. the boss's children wait for an approval; killing the boss ends them
        for n in (1, 2):
            await wait_for(
                f"boss child c{n} waiting", lambda n=n: state_is(f"{tid('boss')}.c{n}", "AWAITING_APPROVAL")
            )  # type: ignore[misc]
        killed_at = time.monotonic()
        await control.kill(tid("boss"), issuer="operator", reason="runaway delegation")
        await wait_for(
            "the boss's children to end",
            lambda: _all(state_is(f"{tid('boss')}.c{n}", *ENDED) for n in (1, 2)),
            timeout_s=60.0,
        )
        ev.kill_to_children_ended_s = time.monotonic() - killed_at
        for n in (1, 2):
            ev.boss_children_after_kill[f"c{n}"] = await status(f"{tid('boss')}.c{n}")
        # 7. the held provisioners are cancelled: their FINALIZING runs their registered cleanup
        for name in ("provisioner-a", "provisioner-b"):
            await control.cancel(tid(name), issuer="operator", reason="contained: end it")
        for name in ("provisioner-a", "provisioner-b"):
            await wait_for(f"{name} to end", lambda n=name: state_is(n, *ENDED))  # type: ignore[misc]
        ev.ledger_at_end = await ledger.ledger()
        # 8. the incident is released with its evidence and closed (the looper keeps the run going meanwhile,
        #    so the run's report sees the incident closed)
        if incident_id:
            released = await asyncio.to_thread(
                lambda: runner.invoke(
                    app, ["incident", "release", incident_id, "--evidence", "note reviewed"]
                )
            )
            closed = await asyncio.to_thread(
                lambda: runner.invoke(app, ["incident", "close", incident_id, "--resolution", "false alarm"])
            )
            ev.incident_closing = released.output + closed.output
            ev.incident = await store.incident(incident_id) or {}
        # 9. the looper, reviewed, is killed: the last trajectory ends and the run with it
        await control.kill(tid("looper"), issuer="operator", reason="loop reviewed")
        await wait_for("the looper to end", lambda: state_is("looper", *ENDED))
    except Exception as e:  # collected, so every judge below reports what it could see
        ev.errors.append(f"{type(e).__name__}: {e}")
        raise
    finally:
        await ledger.close()
        await redis.aclose()


async def _held(status: Awaitable[TrajectoryStatus], kind: str) -> bool:
    return (await status).hold == kind


async def _all(checks: Any) -> bool:
    return all([await c for c in checks])


@pytest.fixture(scope="module")
def evidence(ray_local: None, tmp_path_factory: pytest.TempPathFactory) -> Evidence:
    from cluster.redis_server import RedisServer

    home = tmp_path_factory.mktemp("home")
    server = RedisServer(data_dir=home / "redis").start()
    mp = pytest.MonkeyPatch()
    mp.setenv("TETHER_REDIS_URL", server.url)
    mp.setenv("TETHER_HOME", str(home))
    mp.setenv("TETHER_KEYRING", str(home / "keyring.yaml"))
    ev = Evidence()
    try:
        workload = load_workload(EXAMPLE)
        with Services(workload, RunOptions()) as services:
            assert services.testbed_address is not None and services.keyring_path is not None
            done: dict[str, Any] = {}

            def drive() -> None:
                try:
                    done["result"] = run_driver(workload, services, RunOptions(run_id=RUN, poll_s=0.2))
                except BaseException as e:  # reported by the test, not lost in the thread
                    done["error"] = e

            driver = threading.Thread(target=drive, name="supervision-driver")
            driver.start()
            try:
                asyncio.run(
                    orchestrate(services.redis_url, services.testbed_address, Path(services.keyring_path), ev)
                )
            finally:
                driver.join(timeout=420.0)
            if "error" in done:
                ev.errors.append(f"driver: {done['error']!r}")
            ev.result = done.get("result")
    finally:
        mp.undo()
        server.stop()
    return ev


# --------------------------------------------------------------------------- the judges


def test_a_looping_trajectory_is_held_and_queued_for_a_person_with_its_evidence(evidence: Evidence) -> None:
    assert evidence.looper is not None and evidence.looper.hold == "watchdog"
    assert evidence.looper.state == "READY"  # a watchdog hold withholds admission; it does not pause
    esc = evidence.guard_escalation
    assert esc["owner"] == "sre-oncall" and esc["due_at"] - esc["opened_at"] == 900
    assert esc["evidence"]["guard"] == "exact_repeat" and esc["evidence"]["rung"] == "hold"
    assert esc["evidence"]["fingerprints"] and esc["handoff"]["goal"]
    assert esc["escalation_id"] in evidence.escalations_listed and "sre-oncall" in evidence.escalations_listed


def test_an_incident_on_a_tool_holds_its_users_and_quarantined_artifacts_are_refused(
    evidence: Evidence,
) -> None:
    assert evidence.incident_opened.startswith("opened inc-"), evidence.incident_opened
    for name in ("provisioner-a", "provisioner-b"):
        held = evidence.held_after_incident[name]
        assert held.state == "PAUSED" and held.hold == "incident" and held.hold_incidents
    assert set(evidence.quarantined) == {NOTE_A, NOTE_B}
    before, after = evidence.ledger_before_reader, evidence.ledger_after_reader
    assert before is not None and after is not None
    # the judge counts reads: provisioner-a read its own note before the incident...
    assert len(before.reads_of(NOTE_A)) == 1
    # ...and the reader's read, after the quarantine, never reached the notes service
    assert len(after.reads_of(NOTE_A)) == 1
    reader = next(r for r in evidence.result.results if r.name == "reader")  # type: ignore[union-attr]
    assert any("read_note" in line and "QUARANTINED" in line for line in reader.result["not_done"])  # type: ignore[index]
    incident = evidence.incident
    assert incident["symptom"] != incident["suspected_cause"]
    assert set(incident["members"]) == {tid("provisioner-a"), tid("provisioner-b")}
    assert incident["releases"] and incident["releases"][0]["evidence"] == "note reviewed"
    assert incident["status"] == "closed", evidence.incident_closing


def test_the_held_trajectories_cleanup_still_completes(evidence: Evidence) -> None:
    # the incident revoked provision_env from both, not release_env; ending them ran their registered
    # cleanup although they were held: the provisioner's own record shows nothing left allocated
    ledger = evidence.ledger_at_end
    assert ledger is not None
    ours = [e for e in ledger.environments if e.tenant == "acme"]
    assert len(ours) == 2 and ledger.orphaned_environments() == []


def test_a_dependency_outage_moves_trajectories_to_the_constrained_rung_and_their_results_say_so(
    evidence: Evidence,
) -> None:
    result = evidence.result
    assert result is not None
    for row in (r for r in result.results if r.name.startswith("outage")):
        assert row.state == "COMPLETED" and row.rung == "constrained", row.row()
        assert row.result is not None and row.result["status"] == "partial"
        assert any(line.startswith("search_packages") for line in row.result["not_done"])


def test_a_parent_and_its_three_children_never_spend_more_than_the_parent_has(evidence: Evidence) -> None:
    result = evidence.result
    assert result is not None
    parent = next(r for r in result.results if r.name == "delegator")
    assert parent.state == "COMPLETED" and len(parent.children) == 3
    assert all(c["status"] == "settled" and c["verified"] for c in parent.children.values())
    ceilings = {"turns": 20, "tokens": 40000, "dollars": 0.06}
    children_spent = {
        dim: sum(float(c[dim]) for c in evidence.children.values()) for dim in ("turns", "tokens", "dollars")
    }
    own = {dim: parent.spend.get(dim, 0.0) - sum(c["spent"].get(dim, 0.0) for c in parent.children.values())
           for dim in ceilings}  # fmt: skip
    for dim, ceiling in ceilings.items():
        print(f"\n{dim}: parent own {own[dim]:g} + children {children_spent[dim]:g} <= ceiling {ceiling:g}")
        assert own[dim] + children_spent[dim] <= ceiling, (dim, own[dim], children_spent[dim])
    # the parent was charged what its children really spent, read from their own records
    # (the snapshots round dollars to 6 places)
    assert parent.spend["dollars"] == pytest.approx(own["dollars"] + children_spent["dollars"], abs=1e-5)


def test_killing_a_parent_ends_all_its_children_within_seconds(evidence: Evidence) -> None:
    print(f"\nkill of the parent -> both children ended: {evidence.kill_to_children_ended_s:.2f} s")
    assert 0 <= evidence.kill_to_children_ended_s < 3.0, evidence.kill_to_children_ended_s
    for child in evidence.boss_children_after_kill.values():
        assert child.state == "FAILED" and child.exit_reason == "KILLED"


def test_the_report_carries_exit_reasons_rungs_escalations_and_incidents(evidence: Evidence) -> None:
    assert not evidence.errors, evidence.errors
    assert evidence.result is not None
    report = evidence.result.report()
    summary = report["summary"]
    assert summary["rungs"]["constrained"] == 2 and summary["degraded_result_rate"] > 0
    assert summary["exit_reasons"]["KILLED"] >= 2 and summary["exit_reasons"]["CANCELED"] == 2
    supervision = report["supervision"]
    assert supervision["escalations"]["by_trigger"]["guard"] == 1
    assert {i["status"] for i in supervision["incidents"]} == {"closed"}
    assert supervision["quarantined_artifacts"] == 0  # released
    rows = {r["id"]: r for r in report["trajectories"]}
    assert (
        rows[tid("outage-0")]["rung"] == "constrained"
        and rows[tid("outage-0")]["result"]["status"] == "partial"
    )
