"""MCP answers -> settlement and outcome class (issue 17): what the breaker counts and what is known about
the effect, for every kind of answer an MCP server (or its absence) gives."""

from __future__ import annotations

import mcp_types as types
import pytest

from actors.tools_mcp.outcomes import not_sent, outcome_of_error, outcome_of_result
from runtime.ports import OutcomeClass, Settlement

OK = (Settlement.ESTABLISHED, OutcomeClass.SUCCESS)
REJECTED = (Settlement.ESTABLISHED_ABSENT, OutcomeClass.CLIENT_REJECTION)
IN_DOUBT = (Settlement.UNKNOWN, OutcomeClass.INFRASTRUCTURE_FAILURE)
DOWN = (Settlement.ESTABLISHED_ABSENT, OutcomeClass.INFRASTRUCTURE_FAILURE)


def _text(text: str, *, error: bool = False, structured: object = None) -> types.CallToolResult:
    return types.CallToolResult(
        content=[types.TextContent(type="text", text=text)], is_error=error, structured_content=structured
    )


@pytest.mark.parametrize(
    ("outcome", "expected"),
    [
        (outcome_of_result(_text("committed abc123")), OK),
        (outcome_of_result(_text("No changes staged", error=True)), REJECTED),
        (outcome_of_error(types.INVALID_PARAMS, "Unknown tool: x"), REJECTED),
        (outcome_of_error(types.METHOD_NOT_FOUND, "tools/call"), REJECTED),
        (outcome_of_error(types.INVALID_REQUEST, "bad"), REJECTED),
        (outcome_of_error(types.PARSE_ERROR, "bad"), REJECTED),
        (outcome_of_error(types.REQUEST_TIMEOUT, "timed out"), IN_DOUBT),  # a timeout settles nothing
        (outcome_of_error(types.CONNECTION_CLOSED, "closed"), IN_DOUBT),
        (outcome_of_error(types.INTERNAL_ERROR, "crash"), IN_DOUBT),
        (outcome_of_error(-32099, "server-defined"), IN_DOUBT),
        (not_sent("server did not start"), DOWN),
    ],
)
def test_each_answer_settles_and_counts(outcome: object, expected: tuple[Settlement, OutcomeClass]) -> None:
    # Given an MCP answer, When classified, Then settlement and breaker class are the table's
    assert (outcome.settlement, outcome.outcome_class) == expected  # type: ignore[attr-defined]


def test_structured_results_are_bindable_and_text_is_kept() -> None:
    # Given a result with structured content (e.g. a created resource's id) and text
    outcome = outcome_of_result(_text("created", structured={"env_id": "e-1"}))
    # When classified, Then the structured fields are the result's fields (a compensation binds them)
    assert outcome.result == {"env_id": "e-1", "text": "created"}
    # And a tool error carries the server's text for the model
    assert "No changes staged" in (outcome_of_result(_text("No changes staged", error=True)).error or "")
