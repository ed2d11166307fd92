"""What Tether needs to reach one MCP server, as it travels in a launch record (JSON, no secrets inline
beyond what the workload wrote): a stdio command or a streamable-HTTP URL.

Light on purpose: the workload validator and the launch record import this without the MCP SDK.
"""

from __future__ import annotations

import os
import shutil
import sys
from typing import Annotated, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

__all__ = ["McpRoute", "McpServerConfig", "resolve_command"]

Seconds = Annotated[float, Field(gt=0, allow_inf_nan=False)]


class McpServerConfig(BaseModel):
    """One MCP server: ``command`` (argv of a stdio server, with ``env`` and ``cwd``) or ``url`` (a
    streamable-HTTP endpoint, with ``headers``). ``connect_timeout_s`` bounds starting the server or
    connecting and the protocol handshake."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    command: tuple[Annotated[str, Field(min_length=1)], ...] = ()
    env: dict[str, str] = Field(default_factory=dict)
    cwd: str | None = None
    url: str | None = None
    headers: dict[str, str] = Field(default_factory=dict)
    connect_timeout_s: Seconds = 30.0

    @field_validator("url")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        if value is not None:
            parts = urlsplit(value)
            if parts.scheme not in ("http", "https") or not parts.netloc:
                raise ValueError(f"an MCP url is http(s)://host[:port]/path, got {value!r}")
        return value

    @model_validator(mode="after")
    def _one_transport(self) -> McpServerConfig:
        if bool(self.command) == bool(self.url):
            raise ValueError("give exactly one of `command` (a stdio server) or `url` (streamable HTTP)")
        if self.url and (self.env or self.cwd):
            raise ValueError("`env` and `cwd` are for a stdio server (command), not for a url")
        if self.command and self.headers:
            raise ValueError("`headers` are for a streamable-HTTP server (url), not for a command")
        return self

    @property
    def transport(self) -> Literal["stdio", "http"]:
        return "stdio" if self.command else "http"

    def describe(self) -> str:
        """A short human description (never the headers: they may carry credentials)."""
        return " ".join(self.command) if self.command else str(self.url)


class McpRoute(BaseModel):
    """Where a Tether tool name goes: ``server`` (the workload's name for it) and the ``remote`` tool name
    the server lists."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    server: str = Field(min_length=1)
    remote: str = Field(min_length=1)


def resolve_command(program: str) -> str:
    """The executable for ``program``: as given when it is a path, else found on ``PATH`` or beside this
    Python (a server installed into Tether's own environment is found even when that environment's
    ``bin`` is not on ``PATH``, as in a Ray worker started from ``.venv/bin/tether``)."""
    if os.sep in program:
        return program
    search = os.pathsep.join(p for p in (os.environ.get("PATH", ""), os.path.dirname(sys.executable)) if p)
    return shutil.which(program, path=search) or program
