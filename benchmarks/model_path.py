"""The CPU one model call costs the process that makes it, by prompt length: Tether's adapter beside the SDK's
typed method and a bare HTTP client, in the same run.

Every trajectory's model calls on a node go through one process (the node's model client actor,
``actors.model_client``), so what a call costs that process's CPU bounds how many trajectories a node can
serve; and a prompt grows with its trajectory, so the cost is measured by prompt length. Each call streams
one completion from the testbed provider (a subprocess: its CPU is not counted), with a prompt of a system
message, a goal and ``R`` rounds of an assistant tool call and its result, and three tool specs:

- ``tether``: ``actors.model_openai.OpenAIModel.complete``, the product's path (the ``openai`` client's
  ``post``, the SDK's stream with each chunk as its parsed JSON, every field read type-checked, usage and
  rate-limit headers parsed, the reply assembled);
- ``sdk_create``: the same client's typed ``chat.completions.with_streaming_response.create`` and a read of
  every chunk's delta from the SDK's chunk objects: what the adapter did before it posted its body itself
  (``4967dbc``) and read the chunks as JSON (``96dfe55``);
- ``aiohttp_floor``: ``aiohttp`` posting the same JSON and ``json.loads`` of every SSE line, no SDK: the
  floor of HTTP and JSON in Python.

Calls are sequential (one at a time, so the CPU per call is the process's CPU time over the calls), the
three paths alternate within each run in a rotating order, and each run repeats every prompt length.

    .venv/bin/python -m benchmarks.model_path [--quick] [--runs 3] [--calls N]

Writes ``benchmarks/results/model_path.json`` (``--quick``: ``model_path.quick.json``) and a PNG.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
import openai

from actors.model_openai import TRAJECTORY_HEADER, OpenAIModel
from benchmarks._common import MIN_RUNS, calibration, provenance, result_path, spread, write_json
from runtime.clock import SystemClock
from runtime.ports import CancelToken, ModelRequest
from testbed.provider import ProviderConfig, start_provider_subprocess

NAME = "model_path"
PATHS = ("tether", "sdk_create", "aiohttp_floor")
MODEL = "tether-sim"
API_KEY = "sk-model-path-bench"


@dataclass(frozen=True)
class Settings:
    rounds: tuple[int, ...] = (2, 10, 50, 200)  # tool rounds in the prompt (2 messages each)
    calls: int = 40  # per path, prompt length and run
    max_tokens: int = 16  # streamed tokens per reply: the same for every prompt length
    runs: int = MIN_RUNS
    quick: bool = False


QUICK = Settings(rounds=(2, 50), calls=8, quick=True)


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def messages(rounds: int) -> list[dict[str, Any]]:
    """A prompt of a system message, a goal and ``rounds`` tool calls with their results."""
    out: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a careful software agent. " * 8},
        {"role": "user", "content": "Fix the failing tests in the payments service. " * 10},
    ]
    for i in range(rounds):
        arguments = json.dumps({"suite": f"unit-{i}", "verbose": i % 2 == 0})
        call = {
            "id": f"call_{i}",
            "type": "function",
            "function": {"name": "run_tests", "arguments": arguments},
        }
        out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        result = {"step": i, "passed": 40 + i, "failed": 1, "log": "ok " * 20}
        out.append({"role": "tool", "tool_call_id": f"call_{i}", "content": json.dumps(result)})
    return out


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": f"{name} in the workspace",
            "parameters": {
                "type": "object",
                "properties": {"suite": {"type": "string"}, "verbose": {"type": "boolean"}},
                "required": ["suite"],
                "additionalProperties": False,
            },
        },
    }
    for name in ("run_tests", "read_file", "edit_file")
]


def request(rounds: int, max_tokens: int, n: int) -> ModelRequest:
    return ModelRequest(
        trajectory_id=f"bench-{rounds}-{n}",
        model=MODEL,
        messages=messages(rounds),
        max_tokens=max_tokens,
        deadline=SystemClock().wall() + 120.0,
        tools=TOOLS,
    )


Call = Callable[[ModelRequest], Awaitable[int]]  # returns the chunks it read
Body = Callable[[ModelRequest], dict[str, Any]]  # every path sends the body the adapter builds


def tether_path(model: OpenAIModel) -> Call:
    async def call(req: ModelRequest) -> int:
        reply = await model.complete(req, CancelToken())
        return reply.usage.output

    return call


def sdk_create_path(client: openai.AsyncOpenAI, body_of: Body) -> Call:
    async def call(req: ModelRequest) -> int:
        headers = {TRAJECTORY_HEADER: req.trajectory_id}
        kwargs: dict[str, Any] = {**body_of(req), "timeout": 120.0, "extra_headers": headers}
        chunks = 0
        async with client.chat.completions.with_streaming_response.create(**kwargs) as response:
            stream = await response.parse()
            async for chunk in stream:
                for choice in chunk.choices or ():
                    if choice.delta.content or choice.delta.tool_calls:
                        chunks += 1
        return chunks

    return call


def floor_path(session: aiohttp.ClientSession, base_url: str, body_of: Body) -> Call:
    url = f"{base_url}/chat/completions"

    async def call(req: ModelRequest) -> int:
        body = body_of(req)
        headers = {"Authorization": f"Bearer {API_KEY}", TRAJECTORY_HEADER: req.trajectory_id}
        chunks = 0
        async with session.post(url, json=body, headers=headers) as response:
            response.raise_for_status()
            async for line in response.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                for choice in json.loads(line[6:]).get("choices") or ():
                    delta = choice.get("delta") or {}
                    if delta.get("content") or delta.get("tool_calls"):
                        chunks += 1
        return chunks

    return call


async def measure(
    calls: dict[str, Call], rounds: int, s: Settings, run_no: int
) -> dict[str, dict[str, float]]:
    """Each path's CPU ms and wall ms per call at one prompt length; the paths take turns, call by call."""
    cpu = dict.fromkeys(calls, 0.0)
    walls: dict[str, list[float]] = {path: [] for path in calls}
    chunks: dict[str, list[int]] = {path: [] for path in calls}
    order = list(calls)
    for n in range(s.calls + 2):  # the first two of each path are a warm-up, not counted
        shift = (n + run_no) % len(order)
        for path in order[shift:] + order[:shift]:
            req = request(rounds, s.max_tokens, n)
            cpu_before, wall_before = time.process_time(), time.perf_counter()
            got = await calls[path](req)
            cpu_used, wall = time.process_time() - cpu_before, time.perf_counter() - wall_before
            if n >= 2:
                cpu[path] += cpu_used
                walls[path].append(wall)
                chunks[path].append(got)
    return {
        path: {
            "cpu_ms_per_call": round(1000 * cpu[path] / s.calls, 3),
            "wall_ms_p50": round(1000 * statistics.median(walls[path]), 2),
            "chunks_per_call": statistics.median(chunks[path]),
        }
        for path in calls
    }


async def run_all(s: Settings, base_url: str) -> list[dict[str, Any]]:
    client = openai.AsyncOpenAI(base_url=base_url, api_key=API_KEY, max_retries=0)
    model = OpenAIModel(base_url=base_url, client=client)
    session = aiohttp.ClientSession()
    calls = {
        "tether": tether_path(model),
        "sdk_create": sdk_create_path(client, model.body),
        "aiohttp_floor": floor_path(session, base_url, model.body),
    }
    runs: list[dict[str, Any]] = []
    try:
        for run_no in range(s.runs):
            per_rounds: dict[str, Any] = {}
            for rounds in s.rounds:
                progress(f"run {run_no + 1}/{s.runs}: {rounds} tool rounds ({2 * rounds + 2} messages)")
                per_rounds[str(rounds)] = await measure(calls, rounds, s, run_no)
            runs.append(per_rounds)
    finally:
        await session.close()
        await client.close()
    return runs


def summarise(runs: list[dict[str, Any]], s: Settings) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for rounds in s.rounds:
        key = str(rounds)
        row: dict[str, Any] = {"messages": 2 * rounds + 2}
        for path in PATHS:
            row[path] = {
                metric: spread([r[key][path][metric] for r in runs], 3)
                for metric in ("cpu_ms_per_call", "wall_ms_p50", "chunks_per_call")
            }
        tether = row["tether"]["cpu_ms_per_call"]["median"]
        row["sdk_create_over_tether_cpu"] = round(row["sdk_create"]["cpu_ms_per_call"]["median"] / tether, 2)
        row["tether_over_floor_cpu"] = round(tether / row["aiohttp_floor"]["cpu_ms_per_call"]["median"], 2)
        out[key] = row
    return out


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_rounds = result["by_rounds"]
    xs = [by_rounds[k]["messages"] for k in by_rounds]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name in PATHS:
        med = [by_rounds[k][name]["cpu_ms_per_call"]["median"] for k in by_rounds]
        lo = [by_rounds[k][name]["cpu_ms_per_call"]["min"] for k in by_rounds]
        hi = [by_rounds[k][name]["cpu_ms_per_call"]["max"] for k in by_rounds]
        ax.plot(xs, med, marker="o", label=name)
        ax.fill_between(xs, lo, hi, alpha=0.2)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("messages in the prompt")
    ax.set_ylabel("CPU ms per call (calling process)")
    ax.set_title(f"model call CPU by prompt length ({result['runs']} runs, min-max shaded)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="two prompt lengths, few calls")
    parser.add_argument("--runs", type=int, default=None, help=f"repetitions (at least {MIN_RUNS})")
    parser.add_argument("--calls", type=int, default=None, help="calls per path, prompt length and run")
    args = parser.parse_args(argv)
    s = QUICK if args.quick else Settings()
    if args.runs is not None:
        s = Settings(**{**asdict(s), "runs": max(MIN_RUNS, args.runs)})
    if args.calls is not None:
        s = Settings(**{**asdict(s), "calls": max(1, args.calls)})
    before = calibration()
    provider = start_provider_subprocess(ProviderConfig(api_key=API_KEY, models=(MODEL,)))
    try:
        runs = asyncio.run(run_all(s, provider.base_url))
    finally:
        provider.stop()
    result = {
        "runs": s.runs,
        "by_rounds": summarise(runs, s),
        "per_run": runs,
        **provenance(asdict(s), before),
    }
    out = result_path(NAME, s.quick)
    write_json(out.stem, result, out.parent)
    plot(result, out.with_suffix(".png"))
    print(out)
    for row in result["by_rounds"].values():
        cpu = {p: row[p]["cpu_ms_per_call"]["median"] for p in PATHS}
        print(f"{row['messages']:4d} messages: CPU ms per call {cpu}")


if __name__ == "__main__":
    main()
