"""Start the testbed tool services: in-process (``start_testbed``) or as a subprocess
(``TestbedProcess``, the same thing ``python -m testbed.tools`` runs), and read them
(``TestbedClient``: ledger query and fault control over gRPC).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import grpc

from actors.tools_grpc import tether_tools_pb2 as pb
from actors.tools_grpc.client import CHANNEL_OPTIONS
from actors.tools_grpc.codec import ToolCall
from actors.tools_grpc.effects import EffectState
from actors.tools_grpc.server import Disposition, ServerHooks, ToolContext, ToolServer
from runtime.clock import Clock
from runtime.errors import DependencyError, InputError
from testbed.tools import testbed_tools_pb2 as tpb
from testbed.tools import testbed_tools_pb2_grpc as tpb_grpc
from testbed.tools.faults import EffectKeys, FaultInjector, FaultPlan
from testbed.tools.ledger import Ledger, LedgerSnapshot
from testbed.tools.services import SERVICES, TOOL_SERVICES, TestbedTools

__all__ = ["Testbed", "TestbedClient", "TestbedProcess", "parse_fault_plans", "start_testbed"]

_add_ledger: Callable[[Any, grpc.aio.Server], None] = tpb_grpc.add_LedgerServiceServicer_to_server
_add_faults: Callable[[Any, grpc.aio.Server], None] = tpb_grpc.add_FaultControlServicer_to_server
_ledger_stub: Callable[[grpc.aio.Channel], Any] = tpb_grpc.LedgerServiceStub
_faults_stub: Callable[[grpc.aio.Channel], Any] = tpb_grpc.FaultControlStub


def parse_fault_plans(text: str) -> dict[str, list[FaultPlan]]:
    """``{"service": plan | [plan, ...], ...}`` JSON -> validated rules (``""`` as a key = every service)."""
    try:
        raw = json.loads(text)
    except ValueError as e:
        raise InputError(f"not JSON: {e}", where="--faults") from e
    if not isinstance(raw, dict):
        raise InputError("must be a JSON object mapping service name -> fault plan(s)", where="--faults")
    plans: dict[str, list[FaultPlan]] = {}
    for service, given in raw.items():
        rules = given if isinstance(given, list) else [given]
        plans[service] = []
        for i, plan in enumerate(rules):
            where = f"--faults.{service}" + (f"[{i}]" if isinstance(given, list) else "")
            try:
                plans[service].append(FaultPlan.model_validate(plan))
            except ValueError as e:
                raise InputError(str(e), where=where) from e
    return plans


class _TestbedHooks(ServerHooks):
    """The server hooks of the testbed: every delivery into the ledger, faults from the injector."""

    def __init__(self, injector: FaultInjector, ledger: Ledger) -> None:
        self._injector = injector
        self._ledger = ledger

    def arrived(self, call: ToolCall, prior: EffectState | None) -> object:
        return self._ledger.arrived(
            tool=call.tool,
            effect_key=call.effect_key,
            call_id=call.call_id,
            attempt_id=call.attempt_id,
            operation_id=call.operation_id,
            trajectory_id=call.trajectory_id,
            prior="new" if prior is None else prior.value,
            deadline=call.deadline_epoch_s,
        )

    def disposed(self, token: object, disposition: Disposition, reply: str) -> None:
        assert isinstance(token, int)
        self._ledger.disposed(token, disposition.value, reply)

    def honour_effect_keys(self, call: ToolCall) -> bool | None:
        return self._injector.honour_effect_keys(call)

    def deliveries(self, call: ToolCall) -> int:
        return self._injector.deliveries(call)

    async def before_effect(self, call: ToolCall, ctx: ToolContext) -> None:
        await self._injector.before_effect(call, ctx)

    async def after_effect(
        self, call: ToolCall, ctx: ToolContext, reply: pb.InvokeReply
    ) -> pb.InvokeReply | None:
        return await self._injector.after_effect(call, ctx, reply)


class _LedgerServicer(tpb_grpc.LedgerServiceServicer):
    def __init__(self, ledger: Ledger) -> None:
        self._ledger = ledger

    async def Query(
        self, request: tpb.LedgerRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> tpb.LedgerReply:
        return self._ledger.to_proto()


class _FaultServicer(tpb_grpc.FaultControlServicer):
    def __init__(self, injector: FaultInjector) -> None:
        self._injector = injector

    async def SetFaults(
        self, request: tpb.SetFaultsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> tpb.SetFaultsReply:
        try:
            plan = FaultPlan.model_validate_json(request.plan_json or "{}")
            self._injector.set_plan(request.service, plan)
        except (ValueError, InputError) as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"SetFaults: {e}")
            raise AssertionError("unreachable: abort raises") from e
        return tpb.SetFaultsReply(applied_json=plan.model_dump_json())


@dataclass
class Testbed:
    """A running in-process testbed: its gRPC server, ledger and fault injector."""

    __test__ = False  # not a pytest class despite the name

    server: ToolServer
    ledger: Ledger
    faults: FaultInjector

    @property
    def address(self) -> str:
        return self.server.address

    def routes(self) -> dict[str, str]:
        """tool -> address, ready for ``GrpcToolPort(routes)``."""
        return dict.fromkeys(self.server.tools, self.address)

    async def stop(self) -> None:
        await self.server.stop()

    async def __aenter__(self) -> Testbed:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()


async def start_testbed(
    port: int = 0,
    *,
    host: str = "127.0.0.1",
    services: Iterable[str] = SERVICES,
    faults: Mapping[str, FaultPlan | Sequence[FaultPlan]] | None = None,
    effect_keys: EffectKeys = EffectKeys.IGNORE,
    provision_s: float = 0.0,
    clock: Clock | None = None,
) -> Testbed:
    """Start the testbed services in this process on ``host:port`` (0 = a free port).

    ``effect_keys``: by default every delivery is applied, repeated key or not (see ``EffectKeys``).
    """
    chosen = tuple(services)
    unknown = sorted(set(chosen) - set(SERVICES))
    if unknown:
        raise InputError(f"unknown services {unknown}; known: {list(SERVICES)}", where="services")
    mode = EffectKeys(effect_keys)
    ledger = Ledger(clock, effect_keys=mode.value)
    tools = TestbedTools(ledger, provision_s=provision_s)
    injector = FaultInjector({t: s for t, s in TOOL_SERVICES.items() if s in chosen}, faults)
    server = ToolServer(
        tools.specs(chosen),
        dedupe_effect_keys=mode is EffectKeys.HONOUR,
        hooks=_TestbedHooks(injector, ledger),
        clock=clock,
        extra_servicers=(
            lambda srv: _add_ledger(_LedgerServicer(ledger), srv),
            lambda srv: _add_faults(_FaultServicer(injector), srv),
        ),
    )
    await server.start(port, host)
    return Testbed(server, ledger, injector)


class TestbedClient:
    """Reads the testbed's ledger and sets its faults over gRPC (works for in-process and subprocess)."""

    __test__ = False

    def __init__(self, address: str, *, timeout_s: float = 5.0) -> None:
        self.address = address
        self._timeout_s = timeout_s
        self._channel: grpc.aio.Channel | None = None

    def _open(self) -> grpc.aio.Channel:
        if self._channel is None:
            self._channel = grpc.aio.insecure_channel(self.address, options=list(CHANNEL_OPTIONS))
        return self._channel

    async def ledger(self) -> LedgerSnapshot:
        """The independent ledger, now."""
        try:
            reply = await _ledger_stub(self._open()).Query(tpb.LedgerRequest(), timeout=self._timeout_s)
        except grpc.aio.AioRpcError as e:
            raise DependencyError(
                f"ledger query at {self.address} failed: {e.code().name}: {e.details()}"
            ) from e
        return LedgerSnapshot.from_proto(reply)

    async def set_faults(self, plan: FaultPlan, service: str = "") -> FaultPlan:
        """Replace the fault plan of ``service`` ("" = every service); returns the plan in force."""
        request = tpb.SetFaultsRequest(service=service, plan_json=plan.model_dump_json())
        try:
            reply = await _faults_stub(self._open()).SetFaults(request, timeout=self._timeout_s)
        except grpc.aio.AioRpcError as e:
            raise DependencyError(
                f"SetFaults at {self.address} failed: {e.code().name}: {e.details()}"
            ) from e
        return FaultPlan.model_validate_json(reply.applied_json)

    async def wait_ready(self, timeout_s: float) -> None:
        """Wait until the server accepts connections."""
        try:
            await asyncio.wait_for(self._open().channel_ready(), timeout_s)
        except TimeoutError as e:
            raise DependencyError(f"testbed at {self.address} not ready after {timeout_s}s") from e

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    async def __aenter__(self) -> TestbedClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()


def _bound_port(ready_line: str) -> int | None:
    """The port in the child's ``ready HOST:PORT`` line; None for any other line (it failed to start)."""
    if not ready_line.startswith("ready "):
        return None
    _, _, port = ready_line.strip().rpartition(":")
    return int(port) if port.isdigit() else None


class TestbedProcess:
    """``python -m testbed.tools`` as a child process.

    ``port=0`` (the default) lets the child bind any free port; ``start()`` returns once the child printed
    its ready line, and :attr:`port` / :attr:`address` are then the ones it bound. Learning the port from
    the child, instead of picking one here and handing it over, leaves no moment in which another process
    could take it. A chosen port that another process holds fails the start (the server does not share
    ports: ``so_reuseport`` is off). ``stop()`` terminates the child (SIGTERM, then SIGKILL after
    ``grace_s``).
    """

    __test__ = False

    def __init__(
        self,
        port: int = 0,
        *,
        faults: Mapping[str, FaultPlan | Sequence[FaultPlan]] | None = None,
        services: Iterable[str] = SERVICES,
        provision_s: float = 0.0,
        effect_keys: EffectKeys = EffectKeys.IGNORE,
        python: str = sys.executable,
    ) -> None:
        self.port = port
        self.address = f"127.0.0.1:{port}"
        self._argv = [python, "-m", "testbed.tools", "--port", str(port), "--services", ",".join(services)]
        if faults:
            plans = {
                name: [p.model_dump(mode="json") for p in ([plan] if isinstance(plan, FaultPlan) else plan)]
                for name, plan in faults.items()
            }
            self._argv += ["--faults", json.dumps(plans)]
        if provision_s:
            self._argv += ["--provision-s", str(provision_s)]
        self._argv += ["--effect-keys", EffectKeys(effect_keys).value]
        self._proc: subprocess.Popen[str] | None = None

    def start(self, timeout_s: float = 20.0) -> TestbedProcess:
        repo_root = Path(__file__).resolve().parents[2]
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(repo_root), os.environ.get("PYTHONPATH")])),
        }
        self._proc = subprocess.Popen(
            self._argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=repo_root
        )
        assert self._proc.stdout is not None
        # The child prints one line once bound; readline blocks at most until the child exits.
        line = self._proc.stdout.readline()
        bound = _bound_port(line)
        if bound is None:
            err = self._reap_failed_start()
            raise DependencyError(
                f"testbed process did not start on port {self.port or 'any'}: {line!r} {err[-2000:]}"
            )
        self.port = bound
        self.address = f"127.0.0.1:{bound}"
        return self

    def _reap_failed_start(self, grace_s: float = 5.0) -> str:
        """Stop a child that did not print its ready line and return what it wrote on stderr."""
        assert self._proc is not None
        if self._proc.poll() is None:
            self._proc.terminate()
        try:
            _, err = self._proc.communicate(timeout=grace_s)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            _, err = self._proc.communicate()
        return err or ""

    @property
    def pid(self) -> int:
        """The child's process id (a test stops and continues it to play a host that does not schedule
        the server)."""
        if self._proc is None:
            raise RuntimeError("the testbed process is not started")
        return self._proc.pid

    def stop(self, grace_s: float = 5.0) -> None:
        if self._proc is None or self._proc.poll() is not None:
            return
        self._proc.terminate()
        try:
            self._proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        for stream in (self._proc.stdout, self._proc.stderr):
            if stream is not None:
                stream.close()

    def __enter__(self) -> TestbedProcess:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
