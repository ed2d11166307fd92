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


# ``actors/__init__`` imports redis without the OpenTelemetry SDK only in a Ray worker; a plain interpreter
# is a driver. These run the same function the package runs in a worker, in a fresh interpreter each.
_OTEL_STATE = (
    "import redis.observability.providers as p\n"
    "state = {'redis_otel': p.OTEL_AVAILABLE, 'sdk_loaded': 'opentelemetry.sdk' in sys.modules}\n"
    "import opentelemetry.sdk.metrics\n"  # importable again once redis is in
    "print(json.dumps(state))\n"
)


def otel_state(setup: str) -> dict[str, bool]:
    code = f"import json, sys\n{setup}\n{_OTEL_STATE}"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True, timeout=120
    )
    state: dict[str, bool] = json.loads(out.stdout)
    return state


def test_a_worker_imports_redis_without_the_opentelemetry_sdk_and_the_sdk_stays_importable() -> None:
    setup = (
        "from actors._worker_imports import import_redis_without_otel_sdk\n"
        "assert import_redis_without_otel_sdk() is True\n"
        "assert import_redis_without_otel_sdk() is False  # once: redis is in\n"
    )
    assert otel_state(setup) == {"redis_otel": False, "sdk_loaded": False}


def test_a_driver_keeps_redis_opentelemetry_support() -> None:
    # the control: the SDK is installed here, so plain redis loads it and would export metrics if asked;
    # importing the actors package outside a Ray worker changes nothing
    assert otel_state("import actors") == {"redis_otel": True, "sdk_loaded": True}
    assert otel_state("from actors._worker_imports import in_ray_worker\nassert not in_ray_worker()") == {
        "redis_otel": True,
        "sdk_loaded": True,
    }
