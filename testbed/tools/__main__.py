"""``python -m testbed.tools --port PORT [--services a,b] [--faults JSON] [--provision-s S]
[--effect-keys ignore|honour]``

Serves the testbed tool services (ToolService + LedgerService + FaultControl) until SIGTERM/SIGINT.
Prints ``ready HOST:PORT`` on stdout once bound.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys

from runtime.errors import InputError
from testbed.tools.faults import EffectKeys
from testbed.tools.host import parse_fault_plans, start_testbed
from testbed.tools.services import SERVICES


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m testbed.tools", description=__doc__)
    p.add_argument("--port", type=int, required=True, help="TCP port (0 = any free port)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--services", default=",".join(SERVICES), help=f"comma list of: {', '.join(SERVICES)}")
    p.add_argument(
        "--faults", default="{}", help='JSON {"service": {"mode": "drop_reply", ...}}; "" = every service'
    )
    p.add_argument("--provision-s", type=float, default=0.0, help="simulated provisioning time")
    p.add_argument(
        "--effect-keys",
        choices=[m.value for m in EffectKeys],
        default=EffectKeys.IGNORE.value,
        help="ignore: apply every delivery (default); honour: answer a repeated effect key from the first",
    )
    return p


async def _serve(args: argparse.Namespace) -> None:
    testbed = await start_testbed(
        args.port,
        host=args.host,
        services=[s for s in args.services.split(",") if s],
        faults=parse_fault_plans(args.faults),
        provision_s=args.provision_s,
        effect_keys=EffectKeys(args.effect_keys),
    )
    print(f"ready {testbed.address}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await testbed.stop()


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(_serve(args))
    except (InputError, OSError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
