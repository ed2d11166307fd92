"""Helpers for the MCP tests (not a test module): a temporary Git repository whose commits can be made slow,
and the streamable-HTTP echo server as a subprocess."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Repo:
    """A Git repository in a temp dir, with one untracked file to stage and commit."""

    path: Path
    hook_started: Path  # touched by the pre-commit hook when it starts (the commit is then in flight)

    @classmethod
    def create(cls, where: Path, *, commit_takes_s: float = 0.0) -> Repo:
        path = where / "repo"
        path.mkdir(parents=True)
        git = ["git", "-C", str(path)]
        subprocess.run([*git, "init", "-q"], check=True)
        subprocess.run([*git, "config", "user.email", "test@tether.invalid"], check=True)
        subprocess.run([*git, "config", "user.name", "tether test"], check=True)
        (path / "notes.txt").write_text("first note\n")
        marker = where / "hook-started"
        if commit_takes_s > 0:
            hook = path / ".git" / "hooks" / "pre-commit"
            hook.write_text(f"#!/bin/sh\ntouch '{marker}'\nsleep {commit_takes_s}\n")
            hook.chmod(0o755)
        return cls(path, marker)

    def commits(self) -> list[str]:
        """Subjects of every commit, newest first (empty for an unborn branch): the repository's own word."""
        done = subprocess.run(
            ["git", "-C", str(self.path), "log", "--format=%s"], capture_output=True, text=True, check=False
        )
        return done.stdout.split("\n")[:-1] if done.returncode == 0 else []


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def echo_server(timeout_s: float = 60.0) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """The streamable-HTTP echo server (``mcp_http_server``) on a port it bound itself: yields its URL and
    process."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.integration.mcp_http_server"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        assert proc.stdout is not None
        ready: list[bytes] = []
        reader = threading.Thread(target=lambda: ready.append(proc.stdout.readline()), daemon=True)  # type: ignore[union-attr]
        reader.start()
        reader.join(timeout_s)
        line = ready[0].decode() if ready else ""
        if not line.startswith("listening "):
            raise AssertionError(f"the echo MCP server did not listen within {timeout_s}s: {line!r}")
        yield f"http://127.0.0.1:{int(line.split()[1])}/mcp", proc
    finally:
        stop(proc)
        if proc.stdout is not None:
            proc.stdout.close()


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
