"""Controls for the fault tests: the product with one protection switched off, so each judge is shown to fail.

A fault test through the product runs real trajectory actors on Ray. Its control runs the same trajectory
with one protection of the runtime removed, by a *mutation* applied inside the actor's own worker process:
``MutatedAdapters`` is the cluster layer's port object (``actors.ports.ClusterPorts``) that every trajectory
actor receives in its constructor. When the worker unpickles it (before the actor is constructed, and again
in a restarted worker) it applies the named patch in that process, once; its ``open_log`` may wrap the log
store and its ``supervision_store`` the quarantine. Nothing in the product knows about it.

Each mutation names the rule it removes. The actor's constructor and ``open_log`` are stable; a mutation
that patches a name inside the decider (``no-budget-halt``, ``trusting-cleanup``, ``unbound-probe``,
``trusting-parent``, ``no-disclosure-rule``, ``no-cleanup``, ``stale-evidence``) has to follow that name when
it moves
(``test_mutations.py`` applies every patch in a fresh interpreter: a module that moved fails there first; an
attribute assigned on a module that no longer reads it does not, which is why each control asserts the
judge's own failure).
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
import time
import types
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import ray.cloudpickle

from cluster.adapters import ClusterAdapters

__all__ = ["MUTATIONS", "MutatedAdapters"]

# The workers cannot import ``tests``: this module travels with the pickled adapters instead.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # type: ignore[no-untyped-call]


class ForgetfulLog:
    """A log store that never finds an earlier log: a runtime without checkpoints, which starts every
    incarnation over (its writes still land, so the judge can read what happened)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    async def append(self, trajectory_id: str, payload: bytes) -> str:
        result: str = await self._inner.append(trajectory_id, payload)
        return result

    async def append_many(self, trajectory_id: str, payloads: Sequence[bytes]) -> list[str]:
        result: list[str] = await self._inner.append_many(trajectory_id, payloads)
        return result

    async def read(self, trajectory_id: str, after: str | None = None) -> list[tuple[str, bytes]]:
        return []

    async def exists(self, trajectory_id: str) -> bool:
        return False

    async def close(self) -> None:
        await self._inner.close()


class UnacknowledgedLog(ForgetfulLog):
    """A log store that does not wait for the store's acknowledgement: an append that fails (Redis down)
    is reported as done, so the runtime goes on to the effect the lost intent announced."""

    async def append(self, trajectory_id: str, payload: bytes) -> str:
        return (await self.append_many(trajectory_id, [payload]))[0]

    async def append_many(self, trajectory_id: str, payloads: Sequence[bytes]) -> list[str]:
        try:
            return await self._inner._append_batch(  # type: ignore[no-any-return]
                _key(trajectory_id), "unacked", [bytes(p) for p in payloads], 0
            )
        except Exception:
            now = int(time.time() * 1000)
            return [f"{now}-{i}" for i in range(len(payloads))]

    async def read(self, trajectory_id: str, after: str | None = None) -> list[tuple[str, bytes]]:
        result: list[tuple[str, bytes]] = await self._inner.read(trajectory_id, after)
        return result

    async def exists(self, trajectory_id: str) -> bool:
        result: bool = await self._inner.exists(trajectory_id)
        return result


class CarelessQuarantine:
    """A supervision store whose quarantine, when it cannot be consulted, answers "nothing held" (fail
    open). With ``UnacknowledgedLog`` it makes a runtime that goes on without its store: the quarantine at
    the dispatch boundary reads the same Redis and otherwise refuses every call during the outage."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def quarantined(self, values: Sequence[str]) -> dict[str, str]:
        try:
            result: dict[str, str] = await self._inner.quarantined(values)
        except Exception:
            return {}
        return result


def _at_least_once_log(store: Any) -> Any:
    """A log store whose retry of a batch cannot recognise its own earlier write (a fresh batch id per
    attempt): an append whose reply was lost is appended again, an at-least-once log."""
    original = store._append_batch

    async def append_batch(key: str, batch: str, payloads: list[bytes], lookback: int) -> list[str]:
        return await original(key, uuid.uuid4().hex, payloads, lookback)  # type: ignore[no-any-return]

    store._append_batch = append_batch
    return store


def _key(trajectory_id: str) -> str:
    from cluster.log_store import log_key

    return log_key(trajectory_id)


def _blind_retry() -> None:
    """The tool client sends a call again, under the same effect key, when its outcome is unknown: the
    pitfall "a timeout is permission to try again", hidden below the single retry owner."""
    from actors.tools_grpc.client import GrpcToolPort
    from runtime.ports import Settlement

    original = GrpcToolPort.invoke

    async def invoke(self: GrpcToolPort, invocation: Any) -> Any:
        outcome = await original(self, invocation)
        if outcome.settlement is Settlement.UNKNOWN:
            again = dataclasses.replace(
                invocation, attempt_id=invocation.attempt_id + "-again", deadline=time.time() + 5.0
            )
            outcome = await original(self, again)
        return outcome

    GrpcToolPort.invoke = invoke  # type: ignore[method-assign]


def _trusting_parser() -> None:
    """The tool client takes a reply it cannot parse as the result itself (no schema check on replies)."""
    client: Any = importlib.import_module("actors.tools_grpc.client")
    client.parse_json = lambda text, *, where: text


def _no_deadline_on_the_wire() -> None:
    """The tool client sends calls with a deadline 5 s later than the call's own: the endpoint is not told
    when the caller stops waiting, so its work outlives the call. (5 s, not more: the testbed's teardown
    lets every held call run out its deadline, and a minute of that was the suite's slowest teardown.)"""
    from actors.tools_grpc.client import GrpcToolPort

    original = GrpcToolPort.invoke

    async def invoke(self: GrpcToolPort, invocation: Any) -> Any:
        return await original(self, dataclasses.replace(invocation, deadline=invocation.deadline + 5.0))

    GrpcToolPort.invoke = invoke  # type: ignore[method-assign]


def _one_scope() -> None:
    """Every testbed tool in one dependency scope: one breaker and one bulkhead guard them all, so a
    degraded dependency takes the healthy ones down with it."""
    contracts: Any = importlib.import_module("actors.contracts")
    wiring: Any = importlib.import_module("actors.wiring")
    original = contracts.testbed_contracts

    def shared() -> list[Any]:
        return [dataclasses.replace(c, dependency_scope="testbed") for c in original()]

    contracts.testbed_contracts = shared
    wiring.testbed_contracts = shared


def _no_budget_halt() -> None:
    """Budget assessment always answers "nominal": the steer/restrict/halt ladder never acts. The decider
    assesses the budget at each turn boundary (``runtime._decide_turn``) and when the meter halts
    (``runtime._decide_finalize``); both read ``assess`` from their own module."""
    from runtime.budget import BudgetAssessment, BudgetStage

    for name in ("runtime._decide_turn", "runtime._decide_finalize"):
        module: Any = importlib.import_module(name)
        original = module.assess

        def assess(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
            real = _original(*args, **kwargs)
            return (
                dataclasses.replace(real, stage=BudgetStage.NOMINAL)
                if isinstance(real, BudgetAssessment)
                else real
            )

        module.assess = assess


def _trusting_cleanup() -> None:
    """A compensation whose outcome is unknown (its reply lost, its deadline passed) is recorded done: the
    pitfall "it was sent, so it is clean" (recovery chapter §12.3: retire an obligation only on evidence)."""
    cleanup: Any = importlib.import_module("runtime._decide_cleanup")
    from runtime.obligations import ObligationState
    from runtime.ports import Settlement

    original = cleanup._after_attempt

    def after_attempt(step: Any, ob: Any, settlement: Any, *args: Any, **kwargs: Any) -> None:
        if settlement is Settlement.UNKNOWN:
            cleanup._update(step, ob, ObligationState.DISCHARGED, "the compensation was sent")
            return
        original(step, ob, settlement, *args, **kwargs)

    cleanup._after_attempt = after_attempt


def _unbound_probe() -> None:
    """A probe that recovers an outcome settles the operation but binds nothing: the compensation never
    learns the environment id the probe saw (issue 11's finding: environments ESTABLISHED "without its
    result" stayed billed)."""
    tools: Any = importlib.import_module("runtime._decide_tools")
    original = tools.on_forward_settled

    def on_forward_settled(step: Any, operation_id: str, settlement: Any, result: Any, evidence: str) -> None:
        if evidence != "a probe":
            original(step, operation_id, settlement, result, evidence)

    tools.on_forward_settled = on_forward_settled


def _trusting_parent() -> None:
    """A parent that takes its child's report at its word: the child's own claim of success is the check
    (the pitfall of §11.3, "the agent is also the reporter")."""
    children: Any = importlib.import_module("runtime._decide_children")

    def verify(check: Any, evidence: Any) -> tuple[bool, str]:
        return "done" in evidence.claim.lower() or "pass" in evidence.claim.lower(), "the child says so"

    children.verify = verify


def _no_disclosure_rule() -> None:
    """Disclosure rules are never consulted: a call carrying a forbidden data class goes out."""
    supervise: Any = importlib.import_module("runtime._decide_supervise")
    supervise.find_disclosure = lambda rules, tool, arguments: None


def _no_cleanup() -> None:
    """The cleanup graph never unwinds: FINALIZING hands every open obligation off without running it (the
    first version's behaviour: compensation registered, never executed)."""
    cleanup: Any = importlib.import_module("runtime._decide_cleanup")
    cleanup.unwind = lambda step: True


def _stale_evidence() -> None:
    """Evidence loses its scope: the completion check counts a check of any revision for the current one
    (the pitfall of §12.4: "previous test passes ... cannot certify altered code")."""
    completion: Any = importlib.import_module("runtime.completion")
    from runtime.record import Revision

    original = completion.CHECKS["candidate_checked"]

    def merged(check: Any, record: Any, events: Any) -> Any:
        every = tuple(c for r in record.revisions for c in r.checks)
        one = (Revision(0, None, None, checks=every),)
        return original(check, dataclasses.replace(record, revisions=one), events)

    completion.CHECKS["candidate_checked"] = merged


# name -> (what it does in the worker, how it wraps the log store)
MUTATIONS: dict[str, tuple[Callable[[], None] | None, Callable[[Any], Any] | None]] = {
    "forgetful-log": (None, ForgetfulLog),
    "unacknowledged-log": (None, UnacknowledgedLog),
    "at-least-once-log": (None, _at_least_once_log),
    "blind-retry": (_blind_retry, None),
    "trusting-parser": (_trusting_parser, None),
    "no-deadline-on-the-wire": (_no_deadline_on_the_wire, None),
    "no-budget-halt": (_no_budget_halt, None),
    "one-scope": (_one_scope, None),
    "trusting-cleanup": (_trusting_cleanup, None),  # issue 11
    "unbound-probe": (_unbound_probe, None),  # issue 11
    "trusting-parent": (_trusting_parent, None),  # issue 12
    "no-disclosure-rule": (_no_disclosure_rule, None),  # issue 12
    "no-cleanup": (_no_cleanup, None),  # issue 11
    "stale-evidence": (_stale_evidence, None),  # issue 11, table 10 row 5
}


# name -> how it wraps the supervision store (escalations, incidents, the quarantine)
SUPERVISION_WRAPS: dict[str, Callable[[Any], Any]] = {"unacknowledged-log": CarelessQuarantine}


def _applied() -> set[str]:
    """The mutations applied in this process (kept outside this module: it arrives pickled by value, once
    per object that refers to it, and would forget)."""
    holder: Any = sys.modules.setdefault("tether_test_mutations", types.ModuleType("tether_test_mutations"))
    if not hasattr(holder, "applied"):
        holder.applied = set()
    applied: set[str] = holder.applied
    return applied


def _mutated(mutation: str) -> MutatedAdapters:
    """Unpickling ``MutatedAdapters`` (in the actor's worker): apply the patch, once per process."""
    patch, _ = MUTATIONS[mutation]
    if patch is not None and mutation not in _applied():
        patch()
        _applied().add(mutation)
    return MutatedAdapters(mutation=mutation)


@dataclass(frozen=True, slots=True)
class MutatedAdapters(ClusterAdapters):
    """``ClusterAdapters`` that apply ``mutation`` in the trajectory actor's worker process."""

    mutation: str = ""

    def __post_init__(self) -> None:
        if self.mutation not in MUTATIONS:
            raise ValueError(f"unknown mutation {self.mutation!r}; known: {sorted(MUTATIONS)}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (_mutated, (self.mutation,))

    def open_log(self, redis_url: str) -> Any:
        _, wrap = MUTATIONS[self.mutation]
        store = ClusterAdapters.open_log(self, redis_url)
        return wrap(store) if wrap is not None else store

    def supervision_store(self, redis_url: str) -> Any:
        store = ClusterAdapters.supervision_store(self, redis_url)
        wrap = SUPERVISION_WRAPS.get(self.mutation)
        return wrap(store) if wrap is not None else store
