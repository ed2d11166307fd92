"""The approval gate (harness chapter, "Approval Gates"): escrow for irreversible calls.

A held call leaves AWAITING_APPROVAL for dispatch only through an approval bound to its digest that passes
the re-check (digest, grant, budget) before dispatch. Denial, expiry (silence is denial), a stale digest or
a failed quorum end the same way: the call is discarded and a structured REFUSED observation goes to the
model, and the trajectory returns to READY.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from runtime.budget import BudgetStage
from runtime.events import (
    ApprovalDecided,
    ApprovalRechecked,
    ControlApplied,
    ObservationAppended,
    ObservationKind,
    StateChanged,
)
from runtime.fingerprint import call_digest
from runtime.record import ApprovalDecision, ControlAction, PendingControl
from runtime.states import ExitReason, TrajectoryState

if TYPE_CHECKING:
    from runtime.harness import Harness

__all__ = ["ApprovalGate"]

S = TrajectoryState


class ApprovalGate:
    """Waits for and applies approval decisions for one harness."""

    def __init__(self, harness: Harness) -> None:
        self.h = harness

    async def wait_for_decision(self) -> bool:
        """AWAITING_APPROVAL: approve / deny / expiry decide; kill and cancel finalize. False to hibernate."""
        while True:
            held = self.h.record.held
            if held is None:  # defensive: nothing held means nothing to wait for
                await self.h._append(StateChanged(S.AWAITING_APPROVAL, S.READY, "nothing held"))
                return True
            for req in list(self.h.record.pending_control):
                if req.action in (ControlAction.KILL, ControlAction.CANCEL):
                    reason = ExitReason.KILLED if req.action is ControlAction.KILL else ExitReason.CANCELED
                    await self.h._append(ControlApplied(req.message_id))
                    await self.h._enter_finalizing(
                        reason, f"{req.action.value} by {req.issuer}: {req.reason}"
                    )
                    return True
                if req.action in (ControlAction.APPROVE, ControlAction.DENY):
                    await self._decide(req)
                    return True
            now = self.h.ports.clock.wall()
            if now >= held.expires_at:
                await self._refuse_held(
                    ApprovalDecision.EXPIRED,
                    (),
                    "APPROVAL_EXPIRED",
                    "No approval was recorded before the request expired.",
                )
                return True
            timeout = held.expires_at - now
            if self.h.config.idle_hibernate_s is not None:
                timeout = min(timeout, self.h.config.idle_hibernate_s)
            arrived = await self.h._wait_for_control(timeout)
            if (
                not arrived
                and self.h.config.idle_hibernate_s is not None
                and self.h.ports.clock.wall() < held.expires_at
            ):
                return False

    async def _decide(self, req: PendingControl) -> None:
        held = self.h.record.held
        assert held is not None
        payload = req.payload if isinstance(req.payload, Mapping) else {}
        # the wire format names it ``call_digest``; an approval binds to exactly one call
        digest = payload.get("call_digest", payload.get("digest"))
        issuers = payload.get("issuers")
        names = (
            tuple(str(i) for i in issuers) if isinstance(issuers, list | tuple) and issuers else (req.issuer,)
        )
        await self.h._append(ControlApplied(req.message_id))
        now = self.h.ports.clock.wall()
        if req.action is ControlAction.DENY:
            await self._refuse_held(
                ApprovalDecision.DENIED,
                names,
                "APPROVAL_DENIED",
                f"Denied by {', '.join(names)}: {req.reason}",
            )
            return
        if digest is None:
            await self._refuse_held(
                ApprovalDecision.DENIED, names, "MISSING_DIGEST", "An approval must name the call's digest."
            )
            return
        if digest != held.digest:
            await self._refuse_held(
                ApprovalDecision.DENIED, names, "STALE_DIGEST", "The approval was for a different call."
            )
            return
        if now > held.expires_at:
            await self._refuse_held(
                ApprovalDecision.EXPIRED,
                (),
                "APPROVAL_EXPIRED",
                "The approval arrived after the request expired.",
            )
            return
        if len(set(names)) < self.h.config.approval_quorum:
            await self._refuse_held(
                ApprovalDecision.DENIED,
                names,
                "QUORUM_NOT_MET",
                f"{self.h.config.approval_quorum} distinct approvers are required.",
            )
            return
        await self.h._append(
            ApprovalDecided(
                held.digest, ApprovalDecision.APPROVED, tuple(dict.fromkeys(names)), req.reason, now
            )
        )
        # re-check before dispatch: digest still matches the held call, the grant and budget still allow it
        failed = None
        if call_digest(held.tool, held.arguments) != held.digest:
            failed = "digest"
        elif not self.h.record.grants.allows(held.tool):
            failed = "grant"
        elif self.h.record.budget_stage is BudgetStage.HALT:
            failed = "budget"
        await self.h._append(
            ApprovalRechecked(held.digest, failed is None, failed, self.h.ports.clock.wall())
        )
        if failed is not None:
            await self.h._append(
                ObservationAppended(
                    ObservationKind.REFUSAL,
                    json.dumps(
                        {"status": "REFUSED", "reason": f"RECHECK_FAILED_{failed.upper()}", "call": held.tool}
                    ),
                    call_id=held.call_id,
                )
            )
            await self.h._append(StateChanged(S.AWAITING_APPROVAL, S.READY, f"re-check failed: {failed}"))
            return
        await self.h._append(
            StateChanged(S.AWAITING_APPROVAL, S.WAITING_TOOL, "approved", approval_digest=held.digest)
        )
        await self._dispatch_one_approved(held.call_id, held.tool, dict(held.arguments), held.digest)

    async def _dispatch_one_approved(
        self, call_id: str, tool: str, args: dict[str, Any], digest: str
    ) -> None:
        task = self.h._spawn(self.h._tools.run_operation(call_id, tool, args, digest))
        await self.h._tools.wait({call_id: task})

    async def _refuse_held(
        self, decision: ApprovalDecision, issuers: tuple[str, ...], reason: str, message: str
    ) -> None:
        held = self.h.record.held
        assert held is not None
        await self.h._append(
            ApprovalDecided(held.digest, decision, issuers, reason, self.h.ports.clock.wall())
        )
        call = f"{held.tool}({json.dumps(dict(held.arguments), sort_keys=True, default=str)})"
        body = {"status": "REFUSED", "reason": reason, "call": call, "message": message}
        await self.h._append(
            ObservationAppended(ObservationKind.REFUSAL, json.dumps(body), call_id=held.call_id)
        )
        await self.h._append(StateChanged(S.AWAITING_APPROVAL, S.READY, reason.lower()))
