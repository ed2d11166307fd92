"""``tether run`` interrupted mid-run, by Ctrl-C (SIGINT) or by SIGTERM (``kill``, ``timeout``, a service
manager): it says so in one line, exits 130, and stops what it started. The judge of "stopped" is the
testbed provider's own count of requests: none arrives once the command has returned.

Before this, SIGTERM killed the command on the spot, and Ctrl-C ended with a screenful of tracebacks
(``_GatheringFuture exception was never retrieved``) after the one-line message.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from testbed.provider import ProviderConfig, ProviderProcess, start_provider_subprocess

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

WORKLOAD = """\
name: interrupted
provider: {{kind: openai_compatible, base_url: "{base_url}", model: tether-sim}}
tools: [{{name: noop, source: builtin}}]
scheduler: false
guard: local
trajectories:
  - id: loop
    count: 2
    scenario: "finish_after:100000"
    grants: [noop]
    budget: {{turns: 200000, tokens: 1000000000, wall_seconds: 3600, dollars: 100000}}
# the calls differ only in their step number: with the default windows the trivial-variation detector takes
# noop away after a few turns, the scripted model then answers, and the run ended on its own at turn 5,
# racing the signal (CI failed with exit 0 when the signal came after it)
supervision:
  watchdog: {{exact_window: 1000000, exact_limit: 1000000, coarse_window: 1000000, coarse_limit: 1000000}}
"""


@pytest.fixture
def provider(tmp_path: Path) -> Iterator[ProviderProcess]:
    process = start_provider_subprocess(ProviderConfig(), log_path=tmp_path / "provider.log")
    try:
        yield process
    finally:
        process.stop()


def requests_seen(provider: ProviderProcess) -> int:
    return int(provider.stats()["requests"])


def wait_for_calls(provider: ProviderProcess, proc: subprocess.Popen[bytes], log: Path) -> None:
    """Until both trajectories have called the provider a few times (bounded; the command must not end)."""
    deadline = time.monotonic() + 150
    while True:
        calls = provider.stats().get("trajectories", {})
        if len(calls) == 2 and all(int(c.get("requests", 0)) >= 3 for c in calls.values()):
            return
        assert proc.poll() is None, f"tether run ended first: {log.read_text(errors='replace')[-3000:]}"
        assert time.monotonic() < deadline, f"no calls in 150 s: {log.read_text(errors='replace')[-3000:]}"
        time.sleep(0.5)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_an_interrupted_run_says_so_exits_130_and_nothing_it_started_calls_on(
    sig: signal.Signals,
    no_shared_ray: None,
    redis_url: str,
    provider: ProviderProcess,
    tmp_path: Path,
) -> None:
    # Given a run of two trajectories that would call the model for hours, on a Ray of its own
    workload = tmp_path / "interrupted.yaml"
    workload.write_text(WORKLOAD.format(base_url=provider.base_url))
    env = {**os.environ, "TETHER_REDIS_URL": redis_url, "TETHER_HOME": str(tmp_path / "home")}
    tether = Path(sys.executable).with_name("tether")
    log = tmp_path / "run.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [str(tether), "run", str(workload), "--run-id", "int"],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            # as an interactive shell leaves it: a background job of a script would inherit SIGINT ignored
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        try:
            wait_for_calls(provider, proc, log)
            # When the command (only it, not its process group) gets the signal
            proc.send_signal(sig)
            code = proc.wait(timeout=90)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    output = log.read_text(errors="replace")
    # Then it exits 130 with the one line that says what happened, and no traceback
    assert code == 130, output[-3000:]
    assert "tether run: interrupted; everything it started was stopped" in output
    assert "Traceback" not in output and "never retrieved" not in output, output[-3000:]
    # And nothing it started calls the provider any more (the trajectories' actors are gone with its Ray)
    after = requests_seen(provider)
    time.sleep(3.0)
    assert requests_seen(provider) == after
