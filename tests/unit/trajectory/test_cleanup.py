"""Cleanup that always runs (issue 11): compensation on every exit, the cleanup graph, verified evidence,
leases, the finalization reserve, handoff, and operators — through ``runtime.decide`` on the in-memory
interpreter, judged by the environment service's own record (``SimTools.allocated`` / ``deliveries``).

Control runs: each exit is also run with the compensation removed from the contract (the protection off),
and the environment must then stay allocated — so the "no orphan" judge can fail.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest

from runtime import _decide_cleanup as cleanup
from runtime._decide_cleanup import ADMISSION_ASKS, FORWARD_PROBE_ASKS
from runtime._decide_recover import RECOVERY
from runtime.clock import FakeClock
from runtime.decider import decide
from runtime.effects import AcquirePermit
from runtime.events import CleanupDispatched, ObligationRegistered, ToolDispatchIntent
from runtime.fold import fold
from runtime.inputs import ControlReceived, PermitRefused
from runtime.obligations import ObligationState
from runtime.ports import OutcomeClass, ProbeResult, Settlement, ToolInvocation, ToolOutcome
from runtime.record import ControlAction, LeaseKind
from runtime.retry import RetryPolicy
from runtime.states import ExitReason, TrajectoryState
from runtime.tools import Compensation, RepeatContract, SideEffect, ToolContract

from .sim import (
    HOLD,
    ReleaseArgs,
    Sim,
    SimTools,
    call,
    created,
    done,
    env_service,
    policy,
    provision_contracts,
    registry,
    tool_results,
)

S = TrajectoryState
OB = ObligationState
ENV_TOOLS = frozenset({"provision_env", "release_env", "run_tests"})


def provisioner(then: str = "done", n: int = 1):  # type: ignore[no-untyped-def]
    """Provision ``n`` environments, then end (``done``) or keep running tests forever (``loop``)."""

    def script(messages):  # type: ignore[no-untyped-def]
        k = tool_results(messages)
        if k < n:
            return call("provision_env", {"name": f"e{k}"}, k)
        if then == "loop":
            return call("run_tests", {"suite": f"s{k}"}, k)
        return done()

    return script


def env_sim(script: Any, *, compensated: bool = True, hold_after: int | None = None, **settings: Any) -> Sim:
    contracts = provision_contracts(**settings.pop("contract", {}))
    if not compensated:  # the control: the same tool with no compensation declared
        forward = contracts[0]
        contracts[0] = ToolContract(
            name=forward.name,
            description=forward.description,
            arguments=forward.arguments,
            side_effect=SideEffect.READ_ONLY,
            repeat=forward.repeat,
            probe=forward.probe,
            dependency_scope=forward.dependency_scope,
        )
    clock = FakeClock()
    settings.setdefault("tool_timeout_s", 5.0)
    sim = Sim(script, clock, pol=policy(registry(*contracts), **settings))
    env_service(sim.tools)
    return sim


def start(sim: Sim, **kw: Any) -> None:
    kw.setdefault("check", "always")
    kw.setdefault("tools", ENV_TOOLS)
    sim.start(created(sim.clock, **kw))


# --------------------------------------------------------------------------- every exit runs compensation


@pytest.mark.parametrize("compensated", [True, False], ids=["protected", "control-no-compensation"])
@pytest.mark.parametrize("exit_kind", ["kill", "cancel", "budget", "deadline", "check_failed"])
def test_every_exit_releases_what_the_trajectory_provisioned(exit_kind: str, compensated: bool) -> None:
    # Given a trajectory that provisioned an environment and keeps working
    settings: dict[str, Any] = {}
    kw: dict[str, Any] = {}
    if exit_kind == "budget":
        kw["ceilings"] = {"turns": 3, "tokens": 1e6, "dollars": 10}
    if exit_kind == "deadline":
        kw["deadline_s"] = 120.0
        settings["reserve"] = _reserve(30.0)
    if exit_kind == "check_failed":
        kw["check"] = "never"
    script = provisioner("done" if exit_kind == "check_failed" else "loop")
    sim = env_sim(script, compensated=compensated, **settings)
    if exit_kind in ("kill", "cancel"):
        sim.hold_model = True
    start(sim, **kw)
    if exit_kind in ("kill", "cancel"):
        sim.run()
        sim.release_model()
        sim.run()  # provisioned, then the next model call is in flight
        assert sim.tools.allocated
        action = ControlAction.KILL if exit_kind == "kill" else ControlAction.CANCEL
        sim.control("c1", action)
        sim.hold_model = False
    rec = sim.run()
    # Then it ended, and on its way out the environment was released (the service's own record)
    assert rec.is_terminal
    if compensated:
        assert sim.tools.allocated == set() and len(sim.tools.released) == 1
        (ob,) = rec.obligations.values()
        assert ob.state is OB.DISCHARGED and "verified by the endpoint's record" in ob.evidence[-1]
        assert rec.handoff is not None and rec.handoff["pending"]["obligations"] == []
    else:  # control: without the protection the environment is orphaned
        assert len(sim.tools.allocated) == 1


def _reserve(seconds: float) -> Any:
    from runtime.deadline import FinalizationReserve

    return FinalizationReserve(seconds=seconds)


def test_a_completed_task_releases_a_temporary_resource_and_keeps_a_lasting_one() -> None:
    temporary = env_sim(provisioner("done"))
    start(temporary)
    rec = temporary.run()
    assert rec.state is S.COMPLETED and temporary.tools.allocated == set() and rec.handoff is None
    lasting = env_sim(provisioner("done"), contract={"on_completion": False})
    start(lasting)
    rec = lasting.run()
    (ob,) = rec.obligations.values()
    assert rec.state is S.COMPLETED and ob.state is OB.COMMITTED and len(lasting.tools.allocated) == 1


def test_the_template_is_registered_in_the_same_batch_as_the_intent_before_dispatch() -> None:
    sim = env_sim(provisioner("done"))
    start(sim)
    sim.run()
    batch = next(d for _, d in sim.decisions if any(isinstance(e, ToolDispatchIntent) for e in d.events))
    kinds = [type(e) for e in batch.events]
    assert kinds.index(ToolDispatchIntent) < kinds.index(ObligationRegistered)  # one durable batch
    registered = next(e for e in batch.events if isinstance(e, ObligationRegistered))
    assert registered.unbound == ("env_id",) and registered.tool == "release_env"


# --------------------------------------------------------------------------- lost replies and probes


def test_a_lost_provisioning_reply_is_bound_by_the_probe_and_released_on_the_way_out() -> None:
    # Given a provisioning call whose reply is lost (applied, never answered), then a kill
    sim = env_sim(provisioner("loop"))
    allocate = sim.tools.behaviour["provision_env"]

    def lost(inv):  # type: ignore[no-untyped-def]
        outcome = allocate(inv)
        sim.tools.applied[inv.effect_key] += 1
        sim.tools.results[inv.effect_key] = outcome.result
        return None  # the reply never arrives

    sim.tools.behaviour["provision_env"] = lost
    start(sim)
    sim.run(until=sim.clock.wall() + 1)
    assert sim.rec.state is S.WAITING_TOOL and len(sim.tools.allocated) == 1
    sim.control("k1", ControlAction.KILL)
    rec = sim.run()
    # Then the probe's stored reply bound the release, which ran: nothing orphaned, nothing provisioned twice
    assert sim.tools.allocated == set() and sim.tools.delivered("provision_env") == 1
    (ob,) = rec.obligations.values()
    assert ob.state is OB.DISCHARGED and any("probe" in e for e in ob.evidence)


def test_a_lost_release_reply_is_not_clean_until_the_endpoint_shows_it_released() -> None:
    # Given a release whose first reply is lost; the service applied it anyway
    sim = env_sim(provisioner("done"))
    release = sim.tools.behaviour["release_env"]
    first = [True]

    def lost_once(inv):  # type: ignore[no-untyped-def]
        outcome = release(inv)
        if first[0]:
            first[0] = False
            sim.tools.applied[inv.effect_key] += 1
            sim.tools.results[inv.effect_key] = outcome.result
            return ToolOutcome(Settlement.UNKNOWN, OutcomeClass.INFRASTRUCTURE_FAILURE, error="reply lost")
        return outcome

    sim.tools.behaviour["release_env"] = lost_once
    start(sim)
    rec = sim.run()
    # Then the unknown outcome was retried (idempotent) and verified before the obligation was discharged
    (ob,) = rec.obligations.values()
    assert ob.state is OB.DISCHARGED and sim.tools.allocated == set()
    assert sim.tools.delivered("release_env") == 2 and "verified" in ob.evidence[-1]


@pytest.mark.parametrize("lost", [1, 99], ids=["answer-lost-once", "never-answered"])
@pytest.mark.parametrize("watched", [True, False], ids=["protected", "control-unwatched-verification"])
def test_an_unanswered_verification_is_asked_again_and_never_holds_finalizing(
    lost: int, watched: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a release whose verification probes are asked and never answered (the chaos run's stuck
    # FINALIZING: two answers lost, nothing watching them), and a deadline an hour away
    if not watched:  # the control: a compensation's timeout ignores a verification in flight
        import runtime._decide_tools as tools_rules

        original = tools_rules.cleanup_timed_out

        def unwatched(step: Any, call_id: str) -> None:
            ob = step.record.obligations.get(call_id.removeprefix("cleanup:"))
            if ob is None or ob.state is not OB.VERIFYING:
                original(step, call_id)

        monkeypatch.setattr(tools_rules, "cleanup_timed_out", unwatched)
    sim = env_sim(provisioner("done"))
    sim.tools.unanswered_probes["release_env"] = lost
    start(sim, deadline_s=3600.0)
    began = sim.clock.wall()
    rec = sim.run()
    (ob,) = rec.obligations.values()
    took = sim.clock.wall() - began
    assert rec.is_terminal
    if not watched:
        # only the trajectory's own deadline ended the wait, an hour later, with the obligation stuck
        assert took >= 3600.0 and ob.state is OB.HANDED_OFF
        return
    # Then it is asked again after the probe's deadline; an answer that comes settles it on evidence
    assert took < 3 * (sim.policy.probe_timeout_s + 10.0)
    if lost == 1:
        assert ob.state is OB.DISCHARGED and len(sim.tools.probes) == 2
        assert "verified" in ob.evidence[-1]
    else:
        # and one never answered is asked three times, then handed off with that evidence, never clean
        assert ob.state is OB.HANDED_OFF and len(sim.tools.probes) == 3
        assert any("not answered by its deadline (3 times)" in e for e in ob.evidence)
    assert sim.tools.allocated == set()  # the release itself went through (the service's own record)


# --------------------------------------------------------------------------- no evidence, no clean


def test_a_compensation_nothing_can_verify_is_handed_off_not_recorded_clean() -> None:
    # Given a release with neither a probe nor a declared postcondition
    sim = env_sim(provisioner("done"), contract={"release_probe": False, "postcondition": {}})
    start(sim)
    rec = sim.run()
    (ob,) = rec.obligations.values()
    # the release ran (the environment is gone), but nothing showed it: owned by a person, with evidence
    assert sim.tools.allocated == set()
    assert ob.state is OB.HANDED_OFF and ob.owner == "operator"
    assert "nothing verifies its postcondition" in " ".join(ob.evidence)
    assert rec.handoff is not None
    assert [o["obligation_id"] for o in rec.handoff["pending"]["obligations"]] == [ob.obligation_id]


def test_a_declared_postcondition_in_the_reply_is_evidence_when_there_is_no_probe() -> None:
    sim = env_sim(provisioner("done"), contract={"release_probe": False})
    start(sim)
    rec = sim.run()
    (ob,) = rec.obligations.values()
    assert ob.state is OB.DISCHARGED and "postcondition" in ob.evidence[-1] and rec.handoff is None


def flaky_release_probe(sim: Sim, inconclusive: int):  # type: ignore[no-untyped-def]
    """The release's verification probe cannot tell ``inconclusive`` times (a busy node: its deadline passed
    before it was sent), then answers from the service's record."""
    answers = sim.tools.probe
    seen = {"n": 0}

    def probe(tool: str, effect_key: str) -> ProbeResult:
        if tool == "release_env":
            seen["n"] += 1
            if seen["n"] <= inconclusive:
                return ProbeResult(Settlement.UNKNOWN, None, "probe failed: DeadlinePassed: not sent")
        return answers(tool, effect_key)

    sim.tools.probe = probe  # type: ignore[method-assign]


def test_an_inconclusive_verification_is_asked_again_after_a_pause() -> None:
    sim = env_sim(provisioner("done"))
    flaky_release_probe(sim, inconclusive=2)
    start(sim)
    rec = sim.run()
    (ob,) = rec.obligations.values()
    assert ob.state is OB.DISCHARGED and sim.tools.allocated == set(), ob.evidence
    assert sum(1 for e in ob.evidence if e.startswith("verification inconclusive")) == 2


def test_a_verification_that_never_concludes_is_handed_off_after_bounded_asks() -> None:
    sim = env_sim(provisioner("done"))
    flaky_release_probe(sim, inconclusive=10_000)
    start(sim)
    rec = sim.run()
    (ob,) = rec.obligations.values()
    assert ob.state is OB.HANDED_OFF and f"({cleanup.VERIFY_ASKS} times)" in " ".join(ob.evidence)


def test_a_release_whose_every_attempt_timed_out_is_verified_before_it_is_given_up() -> None:
    # Given a release that is applied but never answers in time (a busy node), every attempt of its budget
    sim = env_sim(provisioner("done"))
    release = sim.tools.behaviour["release_env"]

    def applied_unanswered(inv: ToolInvocation) -> ToolOutcome:
        applied = release(inv)
        assert applied is not None
        # the service stores its reply (what a probe returns); the caller never receives it
        stored = applied.result
        return ToolOutcome(Settlement.UNKNOWN, OutcomeClass.INFRASTRUCTURE_FAILURE, stored, error="timed out")

    sim.tools.behaviour["release_env"] = applied_unanswered
    start(sim)
    rec = sim.run()
    # Then, its attempts spent, the endpoint was asked: its record shows the release, so it is discharged
    (ob,) = rec.obligations.values()
    budget = sim.policy.cleanup_retry.max_attempts
    assert sim.tools.allocated == set() and sim.tools.delivered("release_env") == budget
    assert ob.state is OB.DISCHARGED and "no attempts left" in " ".join(ob.evidence), ob.evidence


@pytest.mark.parametrize("budget", ["own-budget", "control-forward-budget"])
def test_a_release_lost_on_the_way_three_times_is_tried_again_on_the_compensations_own_budget(
    budget: str,
) -> None:
    # Given a release whose first three attempts never reach the service (dropped on the way: the endpoint's
    # record shows none of them), then one that does: chaos seed 11 at 1f34557 handed such a release off
    # with its environment still allocated, its budget the forward calls' 3 attempts
    settings: dict[str, Any] = {}
    if budget == "control-forward-budget":
        settings["cleanup_retry"] = RetryPolicy(max_attempts=3)
    sim = env_sim(provisioner("done"), **settings)
    sim.tools.lost_on_the_way["release_env"] = 3
    start(sim)
    rec = sim.run()
    (ob,) = rec.obligations.values()
    if budget == "control-forward-budget":
        # the control: the forward budget is spent and the environment is handed off, still billed
        assert ob.state is OB.HANDED_OFF and sim.tools.allocated, ob.evidence
        assert "attempt budget of 3 used" in " ".join(ob.evidence), ob.evidence
        assert sim.tools.delivered("release_env") == 0
        return
    # Then the fourth attempt released it: discharged, the one delivery the service saw applied
    assert ob.state is OB.DISCHARGED and sim.tools.allocated == set(), ob.evidence
    assert sim.tools.delivered("release_env") == 1 and sim.tools.released == {"env-1"}


def test_a_retry_after_an_absent_probe_that_creates_the_resource_still_gets_it_released() -> None:
    # Given a provisioning whose first attempt is lost before it reached the service (the probe says absent)
    # and whose retry, under the probe-then-retry contract, creates the environment
    sim = env_sim(provisioner("done"))
    provision = sim.tools.behaviour["provision_env"]
    calls = {"n": 0}

    def lost_then_applied(inv: ToolInvocation) -> ToolOutcome | None:
        calls["n"] += 1
        if calls["n"] == 1:
            return ToolOutcome(Settlement.UNKNOWN, OutcomeClass.INFRASTRUCTURE_FAILURE, error="connect reset")
        return provision(inv)

    answers = sim.tools.probe

    def probe(tool: str, effect_key: str) -> ProbeResult:
        if tool == "provision_env" and calls["n"] == 1:
            sim.tools.probes.append(effect_key)
            return ProbeResult(Settlement.ESTABLISHED_ABSENT, None, "never applied")
        return answers(tool, effect_key)

    sim.tools.behaviour["provision_env"] = lost_then_applied
    sim.tools.probe = probe  # type: ignore[method-assign]
    start(sim)
    rec = sim.run()
    # Then the absent first attempt did not discharge the obligation: the retry's result bound it, and the
    # environment was released on the way out (chaos: 4 environments stayed billed before this rule)
    (ob,) = rec.obligations.values()
    assert sim.tools.delivered("provision_env") == 2 and sim.tools.allocated == set(), ob.evidence
    assert ob.state is OB.DISCHARGED and sim.tools.delivered("release_env") == 1


def test_a_refused_compensation_stays_owned_and_is_handed_off_with_the_packet() -> None:
    sim = env_sim(provisioner("done"))
    sim.tools.behaviour["release_env"] = lambda inv: ToolOutcome(
        Settlement.ESTABLISHED_ABSENT, OutcomeClass.CLIENT_REJECTION, error="PERMISSION_DENIED"
    )
    start(sim)
    rec = sim.run()
    (ob,) = rec.obligations.values()
    assert ob.state is OB.HANDED_OFF and len(sim.tools.allocated) == 1
    packet = rec.handoff
    assert packet is not None and packet["goal"] == "Make the tests pass."
    assert packet["done"][0]["tool"] == "provision_env" and packet["done"][0]["result"] == {"env_id": "env-1"}
    assert any("tether settle" in d for d in packet["decision_needed"])


def breaker_open_for(refusals: int):  # type: ignore[no-untyped-def]
    """A guard whose breaker refuses the release ``refusals`` times ("retry in 2s"), then admits it."""
    seen = {"n": 0}

    def guard(effect: AcquirePermit) -> PermitRefused | None:
        if effect.call_id.startswith("cleanup:"):
            seen["n"] += 1
            if seen["n"] <= refusals:
                return PermitRefused(effect.call_id, effect.request_id, "BreakerOpen", "open", 2.0)
        return None

    return guard


def test_a_compensation_refused_by_an_open_breaker_waits_and_runs() -> None:
    # Given the release's dependency breaker open for its first three permit requests (chaos: the
    # provisioner's replies were dropped, so its breaker opened just as trajectories finished)
    sim = env_sim(provisioner("done"))
    sim.guard = breaker_open_for(3)
    start(sim)
    rec = sim.run()
    # Then the release waited out each refusal (at least the breaker's retry hint) and ran: nothing orphaned
    (ob,) = rec.obligations.values()
    assert ob.state is OB.DISCHARGED and sim.tools.allocated == set()
    waits = [e for e in ob.evidence if e.startswith("the compensation was not admitted")]
    assert len(waits) == 3 and all("asking again in" in e for e in waits)
    assert rec.state is S.COMPLETED


@pytest.mark.parametrize("readmit", [True, False], ids=["asked-again", "control-not-asked"])
def test_a_restart_while_a_compensation_waits_for_its_permit_asks_for_it_again(
    readmit: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a trajectory that finished its task and whose release waits in its dependency's bulkhead queue
    # when its actor dies (chaos: three releases waited for the deadline, their environments still billed)
    sim = env_sim(provisioner("done"))
    sim.guard = lambda effect: HOLD if effect.call_id.startswith("cleanup:") else None
    start(sim)
    sim.run(until=sim.clock.wall() + 60)
    (ob,) = sim.rec.obligations.values()
    assert sim.rec.state is S.FINALIZING and ob.state is OB.ADMITTING and sim.parked_permits
    if not readmit:  # the control: recovery in FINALIZING as it was, doing nothing
        monkeypatch.setitem(RECOVERY, S.FINALIZING, lambda step: None)
    # When a new incarnation folds the log (the parked request died with the old one) and the queue has room
    sim.guard = None
    sim.restart()
    rec = sim.run()
    (ob,) = rec.obligations.values()
    if readmit:  # Then the release asked again, ran, and the environment is gone before the deadline
        assert rec.state is S.COMPLETED and ob.state is OB.DISCHARGED
        assert sim.tools.allocated == set() and sim.tools.delivered("release_env") == 1
    else:  # without it the release waits for the deadline and is handed off, the environment still billed
        assert ob.state is OB.HANDED_OFF and any("deadline passed" in e for e in ob.evidence)
        assert len(sim.tools.allocated) == 1 and sim.tools.delivered("release_env") == 0


def test_a_compensation_the_breaker_never_admits_is_handed_off_after_bounded_asks() -> None:
    sim = env_sim(provisioner("done"))
    sim.guard = breaker_open_for(10_000)
    start(sim)
    rec = sim.run()
    (ob,) = rec.obligations.values()
    assert ob.state is OB.HANDED_OFF and len(sim.tools.allocated) == 1
    assert sum(1 for e in ob.evidence if e.startswith("the compensation was not admitted")) == ADMISSION_ASKS


@pytest.mark.parametrize("asks", [FORWARD_PROBE_ASKS, 0], ids=["asked-again", "control-not-asked"])
def test_an_environment_whose_reply_was_lost_is_asked_about_again_at_the_exit(
    asks: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a provisioning whose reply is lost after the environment was allocated, and probes that cannot
    # tell while the trajectory works (chaos: the provisioner's guard restarting), so it goes on and ends
    monkeypatch.setattr(cleanup, "FORWARD_PROBE_ASKS", asks)
    sim = env_sim(provisioner("done"))
    provision = sim.tools.behaviour["provision_env"]
    stored: dict[str, Any] = {}  # the provisioner's own record of what each effect key created

    def allocated_reply_lost(inv: ToolInvocation) -> ToolOutcome:
        outcome = provision(inv)
        assert outcome is not None
        stored[inv.effect_key] = outcome.result
        return ToolOutcome(Settlement.UNKNOWN, OutcomeClass.INFRASTRUCTURE_FAILURE, error="reply lost")

    answers = sim.tools.probe

    def probe(tool: str, effect_key: str) -> ProbeResult:
        if tool != "provision_env":
            return answers(tool, effect_key)
        sim.tools.probes.append(effect_key)
        if sim.rec.state is not S.FINALIZING:
            return ProbeResult(Settlement.UNKNOWN, None, "guard unavailable")
        return ProbeResult(Settlement.ESTABLISHED, stored[effect_key], "applied")

    sim.tools.behaviour["provision_env"] = allocated_reply_lost
    sim.tools.probe = probe  # type: ignore[method-assign]
    start(sim, check="never")
    rec = sim.run()
    # Then at the exit the runtime asked the endpoint again, bound the release and the environment is gone
    (ob,) = rec.obligations.values()
    if asks == 0:  # (control) given up at once: the environment stays billed
        assert ob.state is OB.HANDED_OFF and len(sim.tools.allocated) == 1
        return
    assert ob.state is OB.DISCHARGED and sim.tools.allocated == set(), ob.evidence
    assert sim.tools.delivered("provision_env") == 1 and sim.tools.delivered("release_env") == 1


def test_an_unknown_forward_outcome_binds_nothing_and_guesses_nothing() -> None:
    # Given a provisioning call that cannot be probed and never answers, then a kill
    sim = env_sim(provisioner("loop"), contract={}, tool_timeout_s=600.0)
    sim.policy.registry.get("provision_env")  # (probe-able by default: make it hang and refuse probes)
    sim.tools.behaviour["provision_env"] = lambda inv: None
    sim.tools.probe_answers["provision_env"] = ProbeResult(Settlement.UNKNOWN, None, "still running")
    start(sim)
    sim.run(until=sim.clock.wall() + 1)
    sim.control("k1", ControlAction.KILL)
    rec = sim.run()
    (ob,) = rec.obligations.values()
    # no release was sent for an environment nobody knows exists; the obligation is owned and handed off
    assert sim.tools.delivered("release_env") == 0
    assert ob.state is OB.HANDED_OFF and "unknown" in " ".join(ob.evidence)
    (op,) = [o for o in rec.operations.values() if o.tool == "provision_env"]
    assert not op.settled and op.owner == "operator"


# --------------------------------------------------------------------------- the cleanup graph


class StopArgs(ReleaseArgs):
    pass


def graph_contracts(stop_fails: bool = False) -> list[ToolContract]:
    """start_test(env_id) is compensated by stop_test; release_env must wait for stop_test."""
    env = provision_contracts(after=("start_test",))
    start_test = ToolContract(
        name="start_test",
        description="Start a long test on an environment.",
        arguments=ReleaseArgs,
        side_effect=SideEffect.REVERSIBLE,
        repeat=RepeatContract.IDEMPOTENT,
        dependency_scope="test-service",
        compensation=Compensation(
            "stop_test", from_args={"env_id": "env_id"}, postcondition={"stopped": True}
        ),
    )
    stop_test = ToolContract(
        name="stop_test",
        description="Stop a test.",
        arguments=StopArgs,
        side_effect=SideEffect.IRREVERSIBLE,
        needs_approval=False,
        repeat=RepeatContract.IDEMPOTENT,
        dependency_scope="test-service",
    )
    return [*env, start_test, stop_test]


def _graph_sim(stop_fails: bool) -> Sim:
    def script(messages):  # type: ignore[no-untyped-def]
        k = tool_results(messages)
        if k == 0:
            return call("provision_env", {"name": "e"}, 0)
        if k == 1:
            return call("start_test", {"env_id": "env-1"}, 1)
        return call("run_tests", {"suite": f"s{k}"}, k)

    clock = FakeClock()
    sim = Sim(script, clock, pol=policy(registry(*graph_contracts())))
    env_service(sim.tools)
    order: list[str] = []

    def stop(inv):  # type: ignore[no-untyped-def]
        order.append("stop_test")
        if stop_fails:
            return ToolOutcome(
                Settlement.ESTABLISHED_ABSENT, OutcomeClass.CLIENT_REJECTION, error="cannot stop"
            )
        return ToolOutcome(Settlement.ESTABLISHED, OutcomeClass.SUCCESS, {"stopped": True})

    release = sim.tools.behaviour["release_env"]

    def traced_release(inv):  # type: ignore[no-untyped-def]
        order.append("release_env")
        return release(inv)

    sim.tools.behaviour["stop_test"] = stop
    sim.tools.behaviour["release_env"] = traced_release
    sim.order = order  # type: ignore[attr-defined]
    sim.hold_model = True
    sim.start(created(clock, check="always", tools=frozenset({*ENV_TOOLS, "start_test", "stop_test"})))
    for _ in range(2):
        sim.run()
        sim.release_model()
    sim.run()
    sim.control("k1", ControlAction.KILL)
    sim.hold_model = False
    return sim


def test_the_cleanup_graph_stops_the_test_before_releasing_its_environment() -> None:
    sim = _graph_sim(stop_fails=False)
    rec = sim.run()
    assert sim.order == ["stop_test", "release_env"]  # type: ignore[attr-defined]
    assert {o.tool: o.state for o in rec.obligations.values()} == {
        "release_env": OB.DISCHARGED,
        "stop_test": OB.DISCHARGED,
    }


def test_a_failed_cleanup_node_blocks_only_what_depends_on_it() -> None:
    sim = _graph_sim(stop_fails=True)
    rec = sim.run()
    # the environment is not released under a test that may still run: both handed off, with the reason
    assert sim.order == ["stop_test"]  # type: ignore[attr-defined]
    states = {
        o.tool: (o.state, o.evidence[-2] if len(o.evidence) > 1 else "") for o in rec.obligations.values()
    }
    assert states["release_env"][0] is OB.HANDED_OFF and "blocked" in states["release_env"][1]
    assert states["stop_test"][0] is OB.HANDED_OFF


def test_independent_obligations_unwind_together() -> None:
    sim = env_sim(provisioner("loop", n=2))
    sim.hold_model = True
    start(sim)
    for _ in range(2):
        sim.run()
        sim.release_model()
    sim.run()
    sim.control("k1", ControlAction.KILL)
    sim.hold_model = False
    sim.run()
    # both releases were admitted by one decision (parallel unwinding), and both ran
    admitted = [
        [e for e in d.effects if isinstance(e, AcquirePermit) and e.call_id.startswith("cleanup:")]
        for _, d in sim.decisions
    ]
    assert max(len(a) for a in admitted) == 2
    assert sim.tools.allocated == set() and len(sim.tools.released) == 2


def test_cyclic_cleanup_dependencies_are_refused_with_the_cycle_named() -> None:
    from runtime.tools import ToolContractError

    contracts = graph_contracts()
    start_test = contracts[2]
    looped = ToolContract(
        name=start_test.name,
        description=start_test.description,
        arguments=start_test.arguments,
        side_effect=start_test.side_effect,
        repeat=start_test.repeat,
        dependency_scope=start_test.dependency_scope,
        compensation=Compensation("stop_test", from_args={"env_id": "env_id"}, after=("provision_env",)),
    )
    reg = registry(contracts[0], contracts[1], looped, contracts[3])
    with pytest.raises(ToolContractError, match="cycle: provision_env -> start_test -> provision_env"):
        reg.check_references()


def test_two_obligations_on_one_resource_release_it_once() -> None:
    # Given two provisioning calls the service answers with the same environment (a shared resource)
    sim = env_sim(provisioner("done", n=2))
    sim.tools.behaviour["provision_env"] = lambda inv: (
        sim.tools.allocated.add("env-shared"),
        ToolOutcome(Settlement.ESTABLISHED, OutcomeClass.SUCCESS, {"env_id": "env-shared"}),
    )[1]
    start(sim)
    rec = sim.run()
    assert sim.tools.delivered("release_env") == 1 and sim.tools.allocated == set()
    assert sorted(o.state for o in rec.obligations.values()) == [OB.DISCHARGED, OB.DISCHARGED]


# --------------------------------------------------------------------------- deadline, reserve, leases


def test_the_reserve_funds_cleanup_after_forward_work_stops() -> None:
    # Given a 100 s deadline with a 20 s finalization reserve, and a model that never stops
    sim = env_sim(provisioner("loop"), reserve=_reserve(20.0))
    sim.tools.behaviour["run_tests"] = lambda inv: (
        sim.clock.advance(15.0),
        ToolOutcome(Settlement.ESTABLISHED, OutcomeClass.SUCCESS, {"ok": True}),
    )[1]
    start(sim, deadline_s=100.0)
    rec = sim.run()
    # Then forward work stopped at the reserve, and the release ran inside it, before the hard deadline
    assert rec.exit_reason is ExitReason.DEADLINE_EXCEEDED and sim.tools.allocated == set()
    cleanup = next(e for e in sim.log if isinstance(e, CleanupDispatched))
    assert cleanup.deadline <= created(FakeClock()).created_at + 100.0
    dispatches = [e for e in sim.log if isinstance(e, ToolDispatchIntent)]
    assert all(e.deadline <= created(FakeClock()).created_at + 80.0 for e in dispatches)


def test_when_the_hard_deadline_passes_during_cleanup_what_is_left_is_handed_off() -> None:
    sim = env_sim(provisioner("loop"), reserve=_reserve(10.0), tool_timeout_s=600.0)
    sim.tools.behaviour["release_env"] = lambda inv: None  # the release hangs
    start(sim, deadline_s=60.0)
    rec = sim.run()
    (ob,) = rec.obligations.values()
    assert rec.is_terminal and ob.state is OB.HANDED_OFF and "deadline" in " ".join(ob.evidence)
    assert sim.clock.wall() <= created(FakeClock()).created_at + 60.0  # it ended by its hard deadline


def test_workspace_and_credential_leases_are_acquired_and_released_in_finalizing() -> None:
    sim = env_sim(provisioner("done"), workspace="/ws/t1", credentials=("deploy-token",))
    start(sim)
    first = sim.rec.leases
    assert {lease.kind for lease in first.values()} == {LeaseKind.WORKSPACE, LeaseKind.CREDENTIAL}
    rec = sim.run()
    assert rec.leases == {} and sorted(lease.resource for lease in sim.released_leases) == [
        "/ws/t1",
        "deploy-token",
    ]


# --------------------------------------------------------------------------- operators


def test_an_operator_settles_a_stuck_obligation_as_accepted_risk_never_as_clean() -> None:
    sim = env_sim(provisioner("done"))
    sim.tools.behaviour["release_env"] = lambda inv: ToolOutcome(
        Settlement.ESTABLISHED_ABSENT, OutcomeClass.CLIENT_REJECTION, error="PERMISSION_DENIED"
    )
    start(sim)
    rec = sim.run()
    (ob,) = rec.obligations.values()
    assert rec.is_terminal and ob.state is OB.HANDED_OFF
    # When an operator settles it after releasing the environment by hand (the trajectory has ended)
    payload: Mapping[str, Any] = {
        "target": ob.obligation_id,
        "settlement": "established",
        "evidence": "by hand",
    }
    answer = sim.feed(ControlReceived("s1", ControlAction.SETTLE, "carol", "released by hand", payload)).reply
    (after,) = sim.rec.obligations.values()
    assert answer == "recorded" and after.state is OB.DISCHARGED and after.accepted_risk
    assert after.owner == "carol" and "without verified evidence" in after.evidence[-1]
    # and an unknown target is refused and audited
    bad = sim.feed(ControlReceived("s2", ControlAction.SETTLE, "carol", "x", {"target": "op-nope"})).reply
    assert bad == "rejected" and sim.rec.audit[-1].reason == "UNKNOWN_TARGET"


def test_an_operator_takes_custody_of_everything_still_owed() -> None:
    sim = env_sim(provisioner("done"), contract={"release_probe": False, "postcondition": {}})
    start(sim)
    sim.run()
    answer = sim.feed(ControlReceived("h1", ControlAction.HANDOFF, "dave", "mine now", {"to": "dave"})).reply
    (ob,) = sim.rec.obligations.values()
    assert answer == "recorded" and ob.owner == "dave" and ob.state is OB.HANDED_OFF


def test_the_log_folds_to_the_same_record_after_cleanup() -> None:
    sim = _graph_sim(stop_fails=True)
    rec = sim.run()
    assert fold(sim.log, sim.policy) == rec
    # and a decision replayed on the folded record is the same (pure)
    d1 = decide(rec, ControlReceived("x1", ControlAction.HANDOFF, "eve", "r", {"to": "eve"}), 5.0)
    d2 = decide(
        fold(sim.log, sim.policy),
        ControlReceived("x1", ControlAction.HANDOFF, "eve", "r", {"to": "eve"}),
        5.0,
    )
    assert d1 == d2


_ = SimTools  # the sim's tool service keeps the independent record these tests judge by
