"""Command line of the simulated provider.

``python -m testbed.provider --host 127.0.0.1 --port PORT --tpm N --rpm N [--ttft-ms X] [--tokens-per-s Y]
[--limiter sliding_window|token_bucket] [--sub-window-s S] [--sub-window-tokens] [--no-count-rejected]
[--port-file PATH]``

``--port 0`` lets the OS pick a free port; ``--port-file`` names a file the bound port is written to once the
server listens (written whole, by rename), so a parent learns the port without racing another process for it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
from pathlib import Path

from pydantic import ValidationError

from testbed.provider.config import ProviderConfig
from testbed.provider.limits import LimiterMode
from testbed.provider.server import ProviderServer


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m testbed.provider", description="Simulated OpenAI-compatible provider."
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True, help="TCP port (0 = any free port)")
    p.add_argument("--port-file", type=Path, default=None, help="write the bound port here once listening")
    p.add_argument("--tpm", type=int, default=0, help="tokens per minute, 0 = unlimited")
    p.add_argument("--rpm", type=int, default=0, help="requests per minute, 0 = unlimited")
    p.add_argument("--ttft-ms", type=float, default=0.0, help="time to first token in milliseconds")
    p.add_argument("--tokens-per-s", type=float, default=0.0, help="output tokens per second, 0 = instant")
    p.add_argument("--window-s", type=float, default=60.0, help="rate-limit window length in seconds")
    p.add_argument(
        "--limiter",
        choices=[m.value for m in LimiterMode],
        default=LimiterMode.SLIDING_WINDOW.value,
        help="sliding_window (OpenAI-like) or token_bucket (Anthropic-like)",
    )
    p.add_argument(
        "--sub-window-s",
        type=float,
        default=None,
        help="sliding_window: shorter enforcement period (default window/60, 0 = off)",
    )
    p.add_argument(
        "--sub-window-tokens",
        action="store_true",
        help="sliding_window: enforce the token limit per sub-window too",
    )
    p.add_argument(
        "--no-count-rejected",
        dest="count_rejected",
        action="store_false",
        help="a 429 costs nothing (by default it costs one request and its prompt tokens)",
    )
    p.add_argument("--default-max-tokens", type=int, default=1024)
    p.add_argument(
        "--model", action="append", dest="models", help="model id listed by /v1/models (repeatable)"
    )
    p.add_argument("--api-key", default=None, help="require this bearer key")
    return p


def _write_port_file(path: Path, port: int) -> None:
    """``port`` into ``path`` whole: a reader sees no file or the full number, never a part of it."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(f"{port}\n")
    partial.replace(path)


async def _serve(server: ProviderServer, port_file: Path | None = None) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    await server.start()
    if port_file is not None:
        _write_port_file(port_file, server.port)
    print(f"simulated provider listening on {server.base_url}", flush=True)
    try:
        await stop.wait()
    finally:
        await server.stop()


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        config = ProviderConfig(
            rpm=args.rpm,
            tpm=args.tpm,
            ttft_ms=args.ttft_ms,
            tokens_per_s=args.tokens_per_s,
            window_s=args.window_s,
            limiter=LimiterMode(args.limiter),
            sub_window_s=args.sub_window_s,
            sub_window_tokens=args.sub_window_tokens,
            count_rejected=args.count_rejected,
            default_max_tokens=args.default_max_tokens,
            models=tuple(args.models) if args.models else ("tether-sim",),
            api_key=args.api_key,
        )
    except ValidationError as e:
        print(f"invalid provider options: {e}", file=sys.stderr)
        return 2
    try:
        asyncio.run(_serve(ProviderServer(config, host=args.host, port=args.port), args.port_file))
    except OSError as e:
        print(f"simulated provider could not listen on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
