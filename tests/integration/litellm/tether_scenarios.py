"""A LiteLLM proxy callback for Tether's LiteLLM test: per-trajectory behaviour and an independent ledger.

Loaded by the proxy itself (``litellm_settings.callbacks: tether_scenarios.handler`` in the test's config),
so it runs in the proxy's own environment (LiteLLM installed by the test, not a dependency of Tether).
The trajectory is named by the ``X-Tether-Trajectory`` header Tether's adapter sends; its id
(``<run>.<name>-<n>``) says how the mock model behaves:

- ``plain``: the deployment's ``mock_response`` text, streamed (the router's rpm limit applies);
- ``tools``: a call to ``noop`` until a tool result is in the conversation, then the text;
- ``flaky``: HTTP 500 until one 500 was delivered, then the text;
- ``broken``: the stream breaks after two chunks (after the 200 and its headers) until one broke, then
  the text;
- ``down``: HTTP 500 every time.

Every request and every error the proxy answered is appended to the JSON-lines ledger named by
``TETHER_LITELLM_LEDGER``: the provider's side of the story, which the test judges by.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from litellm.integrations.custom_logger import CustomLogger
from litellm.types.utils import ChatCompletionMessageToolCall, Choices, Function, Message, ModelResponse


def _trajectory(data: dict[str, Any]) -> str:
    headers = (data.get("proxy_server_request") or {}).get("headers") or {}
    return next((v for k, v in headers.items() if k.lower() == "x-tether-trajectory"), "")


def _kind(trajectory: str) -> str:
    name = trajectory.rsplit(".", 1)[-1]
    return name.rsplit("-", 1)[0]


def _record(**entry: Any) -> None:
    path = os.environ.get("TETHER_LITELLM_LEDGER")
    if path:
        with open(path, "a", encoding="utf-8") as ledger:
            ledger.write(json.dumps({"t": time.time(), **entry}) + "\n")


def _tool_call_reply() -> ModelResponse:
    call = ChatCompletionMessageToolCall(
        id=f"call_{time.monotonic_ns()}", type="function", function=Function(name="noop", arguments="{}")
    )
    message = Message(role="assistant", content=None, tool_calls=[call])
    return ModelResponse(choices=[Choices(index=0, finish_reason="tool_calls", message=message)])


class TetherScenarios(CustomLogger):
    def __init__(self) -> None:
        super().__init__()
        self.failed_once: set[str] = set()
        self.broken_once: set[str] = set()

    async def async_pre_call_hook(
        self, user_api_key_dict: Any, cache: Any, data: dict, call_type: Any
    ) -> Any:
        trajectory = _trajectory(data)
        kind = _kind(trajectory)
        _record(event="request", trajectory=trajectory)
        has_tool_result = any(m.get("role") == "tool" for m in data.get("messages", []))
        if kind == "tools" and not has_tool_result:
            data["mock_response"] = _tool_call_reply()
        elif kind == "down" or (kind == "flaky" and trajectory not in self.failed_once):
            data["mock_response"] = "litellm.InternalServerError"
        return data

    async def async_post_call_failure_hook(
        self,
        request_data: dict,
        original_exception: Exception,
        user_api_key_dict: Any,
        traceback_str: Any = None,
    ) -> Any:
        trajectory = _trajectory(request_data)
        status = getattr(original_exception, "status_code", None) or getattr(original_exception, "code", None)
        _record(
            event="error", trajectory=trajectory, status=int(status) if str(status).isdigit() else str(status)
        )
        if str(status) == "500":
            self.failed_once.add(trajectory)
        return None

    async def async_post_call_streaming_iterator_hook(
        self, user_api_key_dict: Any, response: Any, request_data: dict
    ) -> Any:
        trajectory = _trajectory(request_data)
        breaking = _kind(trajectory) == "broken" and trajectory not in self.broken_once
        sent = 0
        async for item in response:
            if breaking and sent == 2:
                self.broken_once.add(trajectory)
                _record(event="broken", trajectory=trajectory, after_chunks=sent)
                raise ConnectionResetError("tether test: the upstream stream broke mid-way")
            sent += 1
            yield item


handler = TetherScenarios()
