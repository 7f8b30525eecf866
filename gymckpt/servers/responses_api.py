"""The policy model's ``/v1/responses`` reply as a whole OpenAI Responses API object.

What a Responses API client validates (NeMo Gym's agents parse every reply as OpenAI's
``Response``): ``created_at``, ``parallel_tool_calls``, ``tool_choice``, ``tools``, a full
``usage`` (input, output and total tokens with their details), and output items with their
``id`` and ``status`` (a message's text parts with ``annotations``). All of it derives from
the request and the deterministic reply, so the same input still gives the same bytes.

A tool that declares its ``parameters`` (a JSON schema) gets arguments of that shape: the
policy's number goes to the first required integer (or number) property, so NeMo Gym's
``increment_counter`` (``{"count": int}``) is called as it expects; a tool without declared
parameters gets the policy's arguments unchanged.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable

    from gymckpt.servers.model import ResponsesRequest

__all__ = ["fit_arguments", "responses_api_reply"]

_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "integer": (int,),
    "number": (int, float),
    "string": (str,),
    "boolean": (bool,),
}


def _parameters(tool: dict[str, Any]) -> dict[str, Any] | None:
    schema = tool.get("parameters")
    if schema is None and isinstance(tool.get("function"), dict):
        schema = tool["function"].get("parameters")
    return schema if isinstance(schema, dict) and isinstance(schema.get("properties"), dict) else None


def fit_arguments(arguments: dict[str, Any], tool: dict[str, Any] | None) -> dict[str, Any]:
    """``arguments`` in the shape ``tool``'s parameters declare (unchanged when they fit or none are declared)."""
    schema = _parameters(tool) if tool is not None else None
    if schema is None:
        return arguments
    properties: dict[str, Any] = schema["properties"]
    if set(arguments) <= set(properties):
        return arguments
    values = [value for value in arguments.values() if not isinstance(value, bool)]
    fitted: dict[str, Any] = {}
    for name in schema.get("required") or list(properties):
        kind = (properties.get(name) or {}).get("type")
        accepted = _JSON_TYPES.get(kind) if isinstance(kind, str) else None
        value = next((value for value in values if accepted and isinstance(value, accepted)), None)
        if value is not None:
            fitted[name] = value
            values.remove(value)
    return fitted


def _tool_named(tools: list[dict[str, Any]], name: str) -> dict[str, Any] | None:
    for tool in tools:
        named = tool.get("name") or (tool.get("function") or {}).get("name")
        if named == name:
            return tool
    return None


def _output_item(item: dict[str, Any], index: int, reply_id: str, tools: list[dict[str, Any]]) -> dict[str, Any]:
    suffix = reply_id.removeprefix("resp_")
    if item.get("type") == "function_call":
        arguments = json.loads(item["arguments"])
        fitted = (
            fit_arguments(arguments, _tool_named(tools, item["name"])) if isinstance(arguments, dict) else arguments
        )
        return {
            **item,
            "arguments": json.dumps(fitted),
            "id": f"fc_{suffix}_{index}",
            "status": "completed",
        }
    if item.get("type") == "message":
        content = [
            {**part, "annotations": part.get("annotations", [])} if part.get("type") == "output_text" else part
            for part in item.get("content", [])
        ]
        return {**item, "content": content, "id": f"msg_{suffix}_{index}", "status": "completed"}
    return item


def responses_api_reply(request: ResponsesRequest) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """The shape of ``request``'s reply: the policy's reply completed to a Responses API object."""
    extra = request.model_extra or {}

    def shape(reply: dict[str, Any]) -> dict[str, Any]:
        output_tokens = int((reply.get("usage") or {}).get("output_tokens", 0))
        return {
            **reply,
            "created_at": 0,
            "output": [
                _output_item(item, index, reply["id"], request.tools) for index, item in enumerate(reply["output"])
            ],
            "parallel_tool_calls": bool(extra.get("parallel_tool_calls", False)),
            "tool_choice": extra.get("tool_choice", "auto"),
            "tools": request.tools,
            "usage": {
                **(reply.get("usage") or {}),
                "input_tokens": 0,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": output_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": output_tokens,
            },
        }

    return shape
