"""Wire conversions: canonical arguments, request round trip, probe states."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from actors.tools_grpc import tether_tools_pb2 as pb
from actors.tools_grpc.codec import (
    call_from_request,
    canonical_json,
    parse_json,
    probe_state_from_settlement,
    request_from_invocation,
    settlement_from_probe_state,
)
from runtime.errors import CodecError, InputError
from runtime.ports import Settlement, ToolInvocation

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)
json_objects = st.dictionaries(st.text(max_size=8), json_values, max_size=6)


def _invocation(arguments: dict[str, Any], deadline: float = 1_700_000_100.0) -> ToolInvocation:
    return ToolInvocation(
        trajectory_id="traj-1",
        call_id="call-1",
        tool="provision_env",
        arguments=arguments,
        effect_key="ek-1",
        operation_id="op-1",
        attempt_id="att-2",
        deadline=deadline,
    )


@given(json_objects)
def test_canonical_json_is_independent_of_key_order_and_round_trips(obj: dict[str, Any]) -> None:
    # Given the same object built in reverse key order
    reordered = dict(reversed(list(obj.items())))
    # When both are encoded
    text = canonical_json(obj)
    # Then the bytes are identical and decode back to the object
    assert canonical_json(reordered) == text
    assert json.loads(text) == obj


@given(json_objects)
def test_invocation_round_trips_through_the_wire_request(arguments: dict[str, Any]) -> None:
    # Given an invocation and a fence the client remembered
    invocation = _invocation(arguments)
    # When it is encoded, serialised, parsed and decoded on the server side
    wire = pb.InvokeRequest.FromString(request_from_invocation(invocation, fence=3).SerializeToString())
    call = call_from_request(wire)
    # Then every identity, the deadline and the arguments survive
    assert call.arguments == arguments
    assert (call.tool, call.effect_key, call.operation_id, call.attempt_id) == (
        "provision_env",
        "ek-1",
        "op-1",
        "att-2",
    )
    assert (call.trajectory_id, call.call_id, call.deadline_epoch_s, call.fence) == (
        "traj-1",
        "call-1",
        1_700_000_100.0,
        3,
    )


@pytest.mark.parametrize(
    ("arguments", "where"),
    [({"x": float("nan")}, "provision_env.arguments"), ({"x": object()}, "provision_env.arguments")],
)
def test_unencodable_arguments_are_an_input_error_naming_the_tool(
    arguments: dict[str, Any], where: str
) -> None:
    with pytest.raises(InputError, match=where):
        request_from_invocation(_invocation(arguments))


def test_infinite_deadline_is_rejected() -> None:
    with pytest.raises(InputError, match=r"invocation\.deadline"):
        request_from_invocation(_invocation({}, deadline=float("inf")))


@pytest.mark.parametrize(
    ("request_", "where"),
    [
        (pb.InvokeRequest(tool="", effect_key="k"), "InvokeRequest.tool"),
        (pb.InvokeRequest(tool="t", effect_key=""), "InvokeRequest.effect_key"),
        (pb.InvokeRequest(tool="t", effect_key="k", arguments_json="[1]"), "InvokeRequest.arguments_json"),
        (pb.InvokeRequest(tool="t", effect_key="k", arguments_json="{bad"), "InvokeRequest.arguments_json"),
    ],
)
def test_bad_requests_name_the_field(request_: pb.InvokeRequest, where: str) -> None:
    with pytest.raises(InputError, match=where):
        call_from_request(request_)


def test_parse_json_rejects_non_standard_constants() -> None:
    with pytest.raises(CodecError, match="reply"):
        parse_json('{"x": NaN}', where="reply")


@pytest.mark.parametrize("settlement", list(Settlement))
def test_probe_states_round_trip(settlement: Settlement) -> None:
    assert settlement_from_probe_state(probe_state_from_settlement(settlement)) is settlement


def test_unspecified_probe_state_settles_nothing() -> None:
    assert settlement_from_probe_state(pb.PROBE_STATE_UNSPECIFIED) is Settlement.UNKNOWN
