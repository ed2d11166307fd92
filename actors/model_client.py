"""Model calls carried out by one client actor per node: trajectory processes never load the ``openai`` SDK.

The ``openai`` SDK and its HTTP stack are about 21 MB of private memory in every process that imports them
(``benchmarks/node_capacity.py``'s import ladder), and a trajectory actor would otherwise be such a process.
Here the guard-actor pattern is applied to the model path: each node has one ``ModelClientActor``
(``model-client:<node id>`` in namespace ``tether``, found or created with ``get_if_exists``, detached so it
outlives the trajectory that happened to create it) holding one ``actors.model_openai.OpenAIModel``, and with
it one connection pool, per target (base URL, API key variable, tally). A trajectory talks to it through
``RayModelClient``, a :class:`runtime.ports.ModelPort` with the in-process adapter's contract:

- one actor call per model call (the stream is consumed in the client actor; the trajectory needs the
  assembled reply, never the chunks), plus one ``cancel`` call when the trajectory cancels;
- cancellation: when the trajectory's ``CancelToken`` fires, the handle asks the client to fire the call's
  own token; the client closes the stream mid-way and answers ``ModelCallCancelled`` with the usage it saw
  (the provider's report, or the estimate): the same billing as in process. When the coroutine awaiting
  ``complete`` is itself cancelled (the actor closing, recovery), the handle cancels the client's call too;
- errors: the client's outcome crosses the hop as plain data (``_Failure``), and the handle raises the same
  types the in-process adapter raises (``ModelRateLimited`` with its ``Retry-After`` and limits,
  ``ModelCallFailed`` with status, retryability, usage and whether it was estimated,
  ``ModelCallCancelled``); a client actor that dies or is unreachable mid-call is a retryable
  ``ModelCallFailed`` naming it (usage unknown: nothing is billed on the trajectory's side);
- usage is metered from the provider's report, by the same adapter code; the provider tally
  (``actors.provider_tally``) is written by the client actor, per trajectory, as before;
- the trajectory stays the only writer of its record: the client actor holds no record and writes no log.

A client retires when its node has made no model call for ``idle_exit_s`` (default 30 s): an actor on a node
keeps the Ray autoscaler from removing it, and a node whose trajectories are gone must be able to go. It
retires only with no call in flight, answers ``_RETIRED`` to a call that arrives meanwhile (before touching
the provider), and exits with ``exit_actor``; the handle then finds or creates the node's client again and
sends the call there. Both ways a retired client says no (``_RETIRED``, or Ray's "died" error naming an
intended exit) mean the call never started, so sending it again cannot double it.

A trajectory killed with ``SIGKILL`` cannot send the cancel: its call in the client actor runs on to its
reply or its deadline (``max_tokens`` and the call deadline bound it), and its outcome is simply not heard
(the restarted trajectory's decider settles it as for any lost reply).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import ray
import ray.exceptions
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from actors.model_outcomes import ModelCallFailed, ModelRateLimited
from runtime.clock import Clock, SystemClock
from runtime.errors import ModelCallCancelled
from runtime.ports import (
    AdmissionPort,
    CancelToken,
    ForwardingAdmission,
    ModelReply,
    ModelRequest,
    RateLimitInfo,
    TurnGrant,
    TurnRequest,
    Usage,
)

if TYPE_CHECKING:
    from actors.model_openai import OpenAIModel
    from actors.provider_tally import RedisProviderTally

__all__ = [
    "NAMESPACE",
    "AdmitWhenWarm",
    "ModelClientActor",
    "ModelTarget",
    "RayModelClient",
    "client_actor_name",
]

NAMESPACE = "tether"
_EARLY_CANCELS = 4_096  # cancels that arrived before their call (bounded: one that never comes is dropped)
_HOP_GRACE_S = 30.0  # the handle's backstop beyond the deadline the client enforces itself
IDLE_EXIT_S = 30.0  # a client with no call for this long retires (its node may then scale in)
_RETIRED = "retired"  # a retiring client's answer to a call it did not start
_WARM_TRIES = 20  # retiring clients met while warming before the first call finds its own way
_REFIND_PAUSE_S = 0.1  # between finding a retired client's successor and asking it (the name frees on exit)
_log = logging.getLogger(__name__)


def client_actor_name(node_id: str) -> str:
    """The Ray actor name of a node's model client."""
    if not node_id:
        raise ValueError("a node id is required")
    return f"model-client:{node_id}"


@dataclass(frozen=True, slots=True)
class ModelTarget:
    """Which provider a call goes to, and where its calls are counted.

    ``api_key_env`` names the environment variable the client actor reads the key from (the key itself never
    crosses the object store); ``tally_redis_url`` is where the provider tally is written (None: not
    counted); ``scope`` names the provider in errors (default: ``base_url``).
    """

    base_url: str
    api_key_env: str = "OPENAI_API_KEY"
    tally_redis_url: str | None = None
    scope: str | None = None


@dataclass(frozen=True, slots=True)
class _Failure:
    """A call's error as plain data (exceptions with keyword-only fields do not survive pickling)."""

    kind: str  # "rate_limited" | "failed" | "cancelled"
    message: str
    scope: str | None = None
    usage: Usage = field(default_factory=Usage)
    retry_after: float | None = None
    remaining: tuple[tuple[str, float], ...] = ()
    rate_limit: RateLimitInfo | None = None
    non_retryable: bool = False
    status: int | None = None
    usage_estimated: bool = False


def _failure_of(error: Exception, scope: str) -> _Failure:
    if isinstance(error, ModelCallCancelled):
        usage = error.usage if isinstance(error.usage, Usage) else Usage()
        return _Failure("cancelled", error.reason, usage=usage)
    if isinstance(error, ModelRateLimited):
        return _Failure(
            "rate_limited",
            str(error),
            scope=error.scope,
            retry_after=error.retry_after,
            remaining=tuple(error.remaining.items()),
            rate_limit=error.rate_limit if isinstance(error.rate_limit, RateLimitInfo) else None,
        )
    if isinstance(error, ModelCallFailed):
        return _Failure(
            "failed",
            str(error),
            scope=error.scope,
            usage=error.usage,
            rate_limit=error.rate_limit,
            non_retryable=error.non_retryable,
            status=error.status,
            usage_estimated=error.usage_estimated,
        )
    # the adapter lets nothing else out; if it ever did, the trajectory still gets a failed call
    return _Failure("failed", f"model client error: {type(error).__name__}: {error}", scope=scope)


def _raise(failure: _Failure) -> None:
    if failure.kind == "cancelled":
        raise ModelCallCancelled(failure.message, failure.usage)
    if failure.kind == "rate_limited":
        raise ModelRateLimited(
            failure.message,
            scope=failure.scope,
            retry_after=failure.retry_after,
            remaining=dict(failure.remaining),
            rate_limit=failure.rate_limit,
        )
    raise ModelCallFailed(
        failure.message,
        scope=failure.scope,
        usage=failure.usage,
        non_retryable=failure.non_retryable,
        status=failure.status,
        usage_estimated=failure.usage_estimated,
        rate_limit=failure.rate_limit,
    )


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=0)
class ModelClientActor:
    """Carries out the model calls of every trajectory on its node (see the module docstring).

    Restarts after a crash, never re-runs a call (``max_task_retries=0``): the runtime is the single retry
    owner.
    """

    def __init__(self, idle_exit_s: float = IDLE_EXIT_S) -> None:
        self._idle_exit_s = idle_exit_s
        self._last_call = time.monotonic()
        self._retiring = False
        self._watch: asyncio.Task[None] | None = None
        self._models: dict[ModelTarget, OpenAIModel] = {}
        self._connecting: dict[ModelTarget, asyncio.Task[bool]] = {}  # one ``connect`` per target (warm)
        self._tallies: dict[str, RedisProviderTally] = {}
        self._tokens: dict[str, CancelToken] = {}
        self._early: OrderedDict[str, str] = OrderedDict()  # call id -> reason, for a cancel before its call
        self._chunks = 0  # content-bearing chunks received, all calls together (progress, for tests)

    def _model(self, target: ModelTarget) -> OpenAIModel:
        model = self._models.get(target)
        if model is None:
            from actors.model_openai import OpenAIModel
            from actors.provider_tally import RedisProviderTally

            observer = None
            if target.tally_redis_url is not None:
                observer = self._tallies.get(target.tally_redis_url)
                if observer is None:
                    observer = RedisProviderTally.from_url(target.tally_redis_url)
                    self._tallies[target.tally_redis_url] = observer
            model = self._models[target] = OpenAIModel(
                base_url=target.base_url,
                api_key=os.environ.get(target.api_key_env) or "tether-unused",
                scope=target.scope,
                observer=observer,
                on_chunk=self._on_chunk,
            )
        return model

    async def complete(self, target: ModelTarget, request: ModelRequest, call_id: str) -> Any:
        """The reply, or the call's ``_Failure`` (``_RETIRED``: not started, this client is retiring)."""
        if self._retiring:
            return _RETIRED
        if self._watch is None:
            self._watch = asyncio.get_running_loop().create_task(self._watch_idle())
        token = CancelToken()
        early = self._early.pop(call_id, None)
        if early is not None:
            token.cancel(early)
        self._tokens[call_id] = token
        try:
            model = self._model(target)
            outcome: Any
            try:
                outcome = await model.complete(request, token)
            except Exception as e:
                outcome = _failure_of(e, model.scope)
            # the call is in the tally before the trajectory hears of it: a run's report, read as soon as its
            # last trajectory ends, counts every call (a fresh client's first write waits for a connection)
            tally = self._tallies.get(target.tally_redis_url) if target.tally_redis_url else None
            if tally is not None:
                await tally.drain()
            return outcome
        finally:
            del self._tokens[call_id]
            self._last_call = time.monotonic()

    async def warm(self, target: ModelTarget) -> bool:
        """Build ``target``'s adapter (the ``openai`` import, its HTTP client) and open a connection to the
        provider (``OpenAIModel.connect``, once per target) ahead of the first call; False: this client is
        retiring. A trajectory warms its node's client before it asks for its first admission,
        so the calls admitted while this actor started (or imported ``openai``, which holds its event loop)
        do not queue here and reach the provider together: a burst the scheduler spaced out, which a
        provider's sub-minute window refuses (429s at the start of a run)."""
        if self._retiring:
            return False
        model = self._model(target)
        model.warm()
        connecting = self._connecting.get(target)
        if connecting is None:
            connecting = self._connecting[target] = asyncio.get_running_loop().create_task(model.connect())
        await asyncio.shield(connecting)
        self._last_call = time.monotonic()
        return True

    async def _watch_idle(self) -> None:
        while True:
            await asyncio.sleep(max(0.05, self._idle_exit_s / 4))
            if not self._tokens and time.monotonic() - self._last_call >= self._idle_exit_s:
                self._retiring = True  # from here on no call starts
                ray.get_runtime_context().current_actor.retire.remote()
                return

    async def retire(self) -> None:
        """Exit (the watcher decided the node's model calls are over; none is in flight)."""
        if self._retiring and not self._tokens:
            ray.actor.exit_actor()  # type: ignore[no-untyped-call]

    async def cancel(self, call_id: str, reason: str) -> bool:
        """Fire the call's token (True), or remember the cancel for a call that has not started (False)."""
        token = self._tokens.get(call_id)
        if token is not None:
            token.cancel(reason)
            return True
        self._early[call_id] = reason
        while len(self._early) > _EARLY_CANCELS:
            self._early.popitem(last=False)
        return False

    def _on_chunk(self, _n: int) -> None:
        self._chunks += 1

    async def chunks_received(self) -> int:
        """Content-bearing chunks received so far, every call together."""
        return self._chunks

    async def in_flight(self) -> int:
        """How many calls are being carried out now."""
        return len(self._tokens)

    async def pid(self) -> int:
        return os.getpid()


class _ClientRetired(Exception):
    """The node's client retired before starting the call (the handle sends it to its successor)."""


def _retired_exit(error: Exception) -> bool:
    """Whether Ray's error says the client exited on purpose (``exit_actor``): it retires only idle, so a
    call that met the exit was never carried out."""
    return "INTENDED_USER_EXIT" in str(error)


def node_client(node_id: str | None = None, idle_exit_s: float = IDLE_EXIT_S) -> Any:
    """The model client actor of ``node_id`` (default: this process's node), created if nobody has yet."""
    node = node_id or ray.get_runtime_context().get_node_id()
    actor_class: Any = ModelClientActor
    return actor_class.options(
        name=client_actor_name(node),
        namespace=NAMESPACE,
        get_if_exists=True,
        lifetime="detached",
        max_concurrency=10_000,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False),
    ).remote(idle_exit_s)


class RayModelClient:
    """A :class:`runtime.ports.ModelPort` whose calls run in the node's ``ModelClientActor``.

    ``actor`` may be injected (tests); otherwise this node's client is found or created on the first call.
    ``clock`` times only the handle's backstop (the client enforces the call's deadline itself).
    """

    def __init__(self, target: ModelTarget, *, actor: Any = None, clock: Clock | None = None) -> None:
        self.target = target
        self.scope = target.scope or target.base_url
        self._actor = actor
        self._clock: Clock = clock or SystemClock()

    def actor(self) -> Any:
        if self._actor is None:
            self._actor = node_client()
        return self._actor

    async def aclose(self) -> None:
        """Nothing to close: the client actor belongs to the node, not to this trajectory."""

    async def warm(self) -> None:
        """Have the node's client ready for this target before the first call (``ModelClientActor.warm``):
        it is found or created and its adapter built; a retiring client's successor is found instead."""
        for _ in range(_WARM_TRIES):
            if await self.actor().warm.remote(self.target):
                return
            self._actor = None
            await self._clock.sleep(_REFIND_PAUSE_S)

    async def complete(self, request: ModelRequest, cancel: CancelToken) -> ModelReply:
        """As ``OpenAIModel.complete``, one actor call away (module docstring). A retired client did not
        start the call: it goes to the node's client found (or created) again, until the call's deadline."""
        while True:
            try:
                return await self._complete_once(request, cancel)
            except _ClientRetired:
                self._actor = None
                if self._clock.wall() >= request.deadline:
                    raise ModelCallFailed(
                        f"model call to {self.scope}: the node's model client kept retiring until the "
                        "call's deadline",
                        scope=self.scope,
                        usage=Usage(),
                    ) from None
                await self._clock.sleep(_REFIND_PAUSE_S)

    async def _complete_once(self, request: ModelRequest, cancel: CancelToken) -> ModelReply:
        if cancel.cancelled:
            raise ModelCallCancelled(cancel.reason or "cancelled", Usage())
        call_id = uuid.uuid4().hex
        actor = self.actor()
        ref = actor.complete.remote(self.target, request, call_id)
        answer = asyncio.ensure_future(ref)
        cancelled = asyncio.create_task(cancel.wait())
        backstop = asyncio.create_task(
            self._clock.sleep(max(0.0, request.deadline - self._clock.wall()) + _HOP_GRACE_S)
        )
        try:
            await asyncio.wait({answer, cancelled, backstop}, return_when=asyncio.FIRST_COMPLETED)
            if not answer.done():
                # stop the client's stream: it answers with what it billed (ModelCallCancelled), or with the
                # outcome that raced the cancel
                reason = (cancel.reason or "cancelled") if cancel.cancelled else "deadline"
                actor.cancel.remote(call_id, reason)
                await asyncio.wait({answer}, timeout=_HOP_GRACE_S)
                if not cancel.cancelled:  # the backstop: the client overran the deadline it enforces
                    raise self._overran(answer)
                if not answer.done():
                    answer.cancel()
                    raise ModelCallCancelled(reason, Usage())
        except asyncio.CancelledError:
            actor.cancel.remote(call_id, "the caller stopped waiting")
            answer.cancel()
            raise
        finally:
            for task in (cancelled, backstop):
                task.cancel()
        return self._outcome(answer, cancel)

    def _overran(self, answer: asyncio.Future[Any]) -> ModelCallFailed:
        usage = Usage()
        if answer.done() and not answer.cancelled() and answer.exception() is None:
            outcome = answer.result()
            if isinstance(outcome, _Failure):
                usage = outcome.usage
        answer.cancel()
        return ModelCallFailed(
            f"model call to {self.scope} got no answer from the model client by its deadline",
            scope=self.scope,
            usage=usage,
        )

    def _outcome(self, answer: asyncio.Future[Any], cancel: CancelToken) -> ModelReply:
        try:
            outcome = answer.result()
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as e:
            if _retired_exit(e):
                raise _ClientRetired from e  # exited idle, with no call in flight: this one never started
            if cancel.cancelled:
                raise ModelCallCancelled(cancel.reason or "cancelled", Usage()) from e
            raise ModelCallFailed(
                f"the model client for {self.scope} died or is unreachable: {e}",
                scope=self.scope,
                usage=Usage(),
            ) from e
        except ray.exceptions.RayError as e:
            raise ModelCallFailed(
                f"the model client for {self.scope} failed: {e}", scope=self.scope, usage=Usage()
            ) from e
        if outcome == _RETIRED:
            raise _ClientRetired
        if isinstance(outcome, _Failure):
            _raise(outcome)
        if not isinstance(outcome, ModelReply):
            raise ModelCallFailed(
                f"the model client for {self.scope} answered {type(outcome).__name__}, not a reply",
                scope=self.scope,
                usage=Usage(),
            )
        return outcome


class AdmitWhenWarm(ForwardingAdmission):
    """A trajectory's :class:`runtime.ports.AdmissionPort` that has the node's model client ready before it
    asks for its first turn.

    The scheduler spaces admissions so that the provider's windows hold, down to its per-second share of a
    per-minute limit; but it dates an admission when it grants it, the provider when the call arrives. At the
    start of a run the node's client actor is still being created (a new worker process, the ``openai``
    import): the calls granted meanwhile queue in front of it and reach the provider together, a burst its
    sub-second window refuses (10 x 429 in the first second of two 10-trajectory jobs). So the first
    ``admit_turn`` of an incarnation warms the client (``RayModelClient.warm``) before it asks, bounded by
    ``timeout_s``; a warm that fails or overruns is logged and the admission asked anyway (the call path
    finds or creates the client itself). Everything else passes straight through.
    """

    def __init__(
        self, inner: AdmissionPort, client: RayModelClient, timeout_s: float, name: str = "trajectory"
    ) -> None:
        super().__init__(inner)
        self._client = client
        self._timeout_s = timeout_s
        self._name = name
        self._warmed = False

    async def admit_turn(self, request: TurnRequest) -> TurnGrant:
        if not self._warmed:
            try:
                await asyncio.wait_for(self._client.warm(), self._timeout_s)
            except Exception as e:  # warming only spaces the first calls: never a reason not to admit
                _log.warning("%s: the node's model client was not warmed: %r", self._name, e)
            self._warmed = True  # a cancelled warm (the trajectory stopping) leaves it for the next turn
        return await self.inner.admit_turn(request)
