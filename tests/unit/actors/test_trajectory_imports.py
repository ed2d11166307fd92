"""What a trajectory actor's process loads (issue 14, memory per live trajectory).

A trajectory actor's worker imports ``actors.trajectory`` and unpickles ``cluster.adapters.ClusterAdapters``
(its constructor argument). Neither may load the provider SDK (the node's model client actor holds it,
``actors.model_client``), gRPC (loaded only when the launch routes a tool to a gRPC service) or Ed25519
verification (loaded only when the process verifies a control message itself: one a relay delivers comes
with the relay's verdict, and decoding it needs no signature code): together about 37 MB RSS of every live
trajectory (``benchmarks/node_capacity.py``'s import ladder).

Checked in a fresh interpreter, since this test process has imported everything already.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
NOT_LOADED = ("openai", "grpc", "cryptography.hazmat.primitives.asymmetric.ed25519", "cluster.signing")


def loaded_by(*modules: str, then: str = "") -> set[str]:
    code = (
        "import importlib, json, sys\n"
        f"for m in {list(modules)!r}: importlib.import_module(m)\n"
        f"{then}\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True, timeout=120
    )
    return set(json.loads(out.stdout))


def test_a_trajectory_actor_process_loads_no_provider_sdk_no_grpc_and_no_signature_code() -> None:
    loaded = loaded_by("actors.trajectory", "cluster.adapters")
    assert "actors.trajectory" in loaded
    assert [m for m in NOT_LOADED if m in loaded] == []


def test_the_in_process_adapter_and_the_grpc_port_still_load_them_when_asked() -> None:
    # the control: the names checked above are the ones these modules really pull in (the in-process
    # adapter builds its openai client on its first call)
    first_call = (
        "from actors.model_openai import OpenAIModel; OpenAIModel(base_url='http://127.0.0.1:9')._api()"
    )
    loaded = loaded_by("actors.model_openai", "actors.tools_grpc", "cluster.signing", then=first_call)
    assert [m for m in NOT_LOADED if m not in loaded] == []


# a control message as a trajectory actor receives it (bytes), decoded the way it decodes one
_DECODE = (
    "from cluster.adapters import ClusterAdapters\n"
    "from cluster.control import ControlMessage, encode_message\n"
    "data = encode_message(ControlMessage.create('t-1', 'kill', 'alice', now=1.7e9))\n"
    "envelope = ClusterAdapters().decode_control(data)\n"
    "assert envelope.action == 'kill'\n"
)


def test_decoding_a_control_message_that_comes_with_a_verdict_loads_no_signature_code() -> None:
    loaded = loaded_by("actors.trajectory", "cluster.adapters", then=_DECODE)
    assert [m for m in NOT_LOADED if m in loaded] == []


def test_verifying_one_without_a_verdict_still_loads_it() -> None:
    # the control: the same message verified here (a caller that passed no verdict) loads the signature code
    verify = (
        "from runtime.errors import ControlError\n"
        "try:\n"
        "    ClusterAdapters().control_verifier('/nonexistent/keyring.yaml').verify("
        "envelope, 1.7e9, lambda _m, _n: False)\n"
        "except ControlError:\n"
        "    pass\n"
    )
    loaded = loaded_by("actors.trajectory", "cluster.adapters", then=_DECODE + verify)
    assert "cluster.signing" in loaded and "cryptography.hazmat.primitives.asymmetric.ed25519" in loaded
