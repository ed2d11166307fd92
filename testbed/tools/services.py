"""The simulated tool services: a test runner, an environment provisioner, a notifier, a read-only
package search, and a notes store (artifacts other trajectories read: what an incident quarantines).
Each tool validates its arguments (pydantic), applies its effect through
the ``Ledger`` and returns plain JSON data.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import grpc
from pydantic import BaseModel, ConfigDict, Field

from actors.tools_grpc.codec import canonical_json
from actors.tools_grpc.errors import ToolError
from actors.tools_grpc.server import ToolContext, ToolSpec
from testbed.tools.ledger import Ledger

__all__ = ["SERVICES", "TOOL_SERVICES", "TestbedTools", "note_id_of"]

TEST_RUNNER = "test-runner"
ENV_PROVISIONER = "env-provisioner"
NOTIFIER = "notifier"
PACKAGE_SEARCH = "package-search"
NOTES = "notes"

# tool -> service (dependency scope); the fault knobs and breakers work per service.
TOOL_SERVICES: Mapping[str, str] = {
    "run_tests": TEST_RUNNER,
    "provision_env": ENV_PROVISIONER,
    "release_env": ENV_PROVISIONER,
    "send_notification": NOTIFIER,
    "search_packages": PACKAGE_SEARCH,
    "write_note": NOTES,
    "read_note": NOTES,
    "delete_note": NOTES,
}
SERVICES: tuple[str, ...] = (TEST_RUNNER, ENV_PROVISIONER, NOTIFIER, PACKAGE_SEARCH, NOTES)

_CATALOGUE: tuple[tuple[str, str, str], ...] = (
    ("pytest", "8.3.2", "simple powerful testing with Python"),
    ("pytest-asyncio", "0.24.0", "pytest support for asyncio"),
    ("hypothesis", "6.112.0", "property-based testing"),
    ("requests", "2.32.3", "HTTP for humans"),
    ("httpx", "0.27.2", "a next-generation HTTP client"),
    ("aiohttp", "3.10.5", "async HTTP client and server"),
    ("pydantic", "2.9.2", "data validation using Python type hints"),
    ("sqlalchemy", "2.0.35", "database toolkit and ORM"),
    ("psycopg", "3.2.2", "PostgreSQL database adapter"),
    ("redis", "5.0.8", "Python client for Redis"),
    ("numpy", "2.1.1", "array computing"),
    ("pandas", "2.2.3", "data analysis and manipulation"),
)


class _Args(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class RunTestsArgs(_Args):
    suite: str = Field(min_length=1, max_length=200)
    commit: str = Field(default="HEAD", min_length=1, max_length=80)


class ProvisionArgs(_Args):
    tenant: str = Field(min_length=1, max_length=80)
    size: Literal["small", "medium", "large"] = "small"


class ReleaseArgs(_Args):
    env_id: str = Field(min_length=1, max_length=80)


class NotifyArgs(_Args):
    recipient: str = Field(min_length=1, max_length=200)
    message: str = Field(min_length=1, max_length=4000)


class SearchArgs(_Args):
    query: str = Field(min_length=1, max_length=200)
    limit: int = Field(default=10, ge=1, le=100)


class WriteNoteArgs(_Args):
    title: str = Field(min_length=1, max_length=200)
    body: str = Field(min_length=1, max_length=8000)


class NoteArgs(_Args):
    note_id: str = Field(min_length=1, max_length=80)


def note_id_of(title: str, body: str) -> str:
    """A note's id is its content's address: the same title and body are the same note."""
    return "note-" + hashlib.sha256(canonical_json({"title": title, "body": body}).encode()).hexdigest()[:12]


@dataclass
class TestbedTools:
    """The tool functions over one ``Ledger``. ``provision_s`` simulates provisioning work."""

    __test__ = False  # not a pytest class despite the name

    ledger: Ledger
    provision_s: float = 0.0

    def run_tests(self, arguments: Mapping[str, Any], ctx: ToolContext) -> dict[str, Any]:
        """Deterministic pass/fail from the arguments (read-only: runs leave nothing behind)."""
        args = RunTestsArgs.model_validate(arguments)
        digest = hashlib.sha256(canonical_json(args.model_dump()).encode()).digest()
        total = 5 + digest[0] % 20
        failed = 0 if digest[1] % 3 else 1 + digest[2] % total
        self.ledger.count_test_run()
        return {
            "suite": args.suite,
            "commit": args.commit,
            "total": total,
            "failed": failed,
            "passed": failed == 0,
        }

    async def provision_env(self, arguments: Mapping[str, Any], ctx: ToolContext) -> dict[str, Any]:
        """Allocate a billed environment. Commits in one step after its last await (cancellable)."""
        args = ProvisionArgs.model_validate(arguments)
        if self.provision_s > 0:
            await ctx.sleep(self.provision_s)
        ctx.check_deadline()
        env_id = self.ledger.allocate(args.tenant, ctx.call.effect_key)
        return {"env_id": env_id, "tenant": args.tenant, "size": args.size}

    async def release_env(self, arguments: Mapping[str, Any], ctx: ToolContext) -> dict[str, Any]:
        """Release an environment (compensation of ``provision_env``); releasing twice is harmless."""
        args = ReleaseArgs.model_validate(arguments)
        billed = self.ledger.release(args.env_id, ctx.call.effect_key)
        if billed is None:
            raise ToolError(grpc.StatusCode.NOT_FOUND, f"no environment {args.env_id!r}")
        return {"env_id": args.env_id, "released": True, "billed_seconds": round(billed, 3)}

    async def send_notification(self, arguments: Mapping[str, Any], ctx: ToolContext) -> dict[str, Any]:
        """Send a notification: irreversible, there is no unsend."""
        args = NotifyArgs.model_validate(arguments)
        ctx.check_deadline()
        return {"notification_id": self.ledger.notify(args.recipient, args.message, ctx.call.effect_key)}

    def search_packages(self, arguments: Mapping[str, Any], ctx: ToolContext) -> dict[str, Any]:
        """Read-only search over a fixed catalogue (name or summary contains the query)."""
        args = SearchArgs.model_validate(arguments)
        needle = args.query.lower()
        hits = [
            {"name": name, "version": version, "summary": summary}
            for name, version, summary in _CATALOGUE
            if needle in name or needle in summary.lower()
        ]
        self.ledger.count_search()
        return {"query": args.query, "packages": hits[: args.limit]}

    def write_note(self, arguments: Mapping[str, Any], ctx: ToolContext) -> dict[str, Any]:
        """Store a note (an artifact); its id is its content address, so writing it again is harmless."""
        args = WriteNoteArgs.model_validate(arguments)
        note_id = note_id_of(args.title, args.body)
        created = self.ledger.write_note(note_id, args.title, args.body, ctx.call.effect_key)
        return {"note_id": note_id, "created": created}

    def read_note(self, arguments: Mapping[str, Any], ctx: ToolContext) -> dict[str, Any]:
        """Read a note (read-only; the ledger records every read that reached the service)."""
        args = NoteArgs.model_validate(arguments)
        found = self.ledger.read_note(args.note_id, ctx.call.effect_key)
        if found is None:
            raise ToolError(grpc.StatusCode.NOT_FOUND, f"no note {args.note_id!r}")
        return {"note_id": args.note_id, "title": found[0], "body": found[1]}

    def delete_note(self, arguments: Mapping[str, Any], ctx: ToolContext) -> dict[str, Any]:
        """Delete a note (compensation of ``write_note``); deleting twice is harmless."""
        args = NoteArgs.model_validate(arguments)
        if not self.ledger.delete_note(args.note_id, ctx.call.effect_key):
            raise ToolError(grpc.StatusCode.NOT_FOUND, f"no note {args.note_id!r}")
        return {"note_id": args.note_id, "deleted": True}

    def specs(self, services: tuple[str, ...] = SERVICES) -> list[ToolSpec]:
        """The ``ToolSpec`` of every tool belonging to ``services``."""
        all_specs = [
            ToolSpec("run_tests", self.run_tests, description="run a test suite (read-only)"),
            ToolSpec("provision_env", self.provision_env, cancellable=True, description="allocate an env"),
            ToolSpec("release_env", self.release_env, description="release an env"),
            ToolSpec("send_notification", self.send_notification, description="notify (irreversible)"),
            ToolSpec("search_packages", self.search_packages, description="search packages (read-only)"),
            ToolSpec("write_note", self.write_note, description="store a note (content-addressed)"),
            ToolSpec("read_note", self.read_note, description="read a note (read-only)"),
            ToolSpec("delete_note", self.delete_note, description="delete a note"),
        ]
        return [s for s in all_specs if TOOL_SERVICES[s.name] in services]
