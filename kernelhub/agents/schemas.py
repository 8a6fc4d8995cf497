"""Tool definitions and tool results in each LLM API's own shape, from one JSON schema.

Pure functions: :mod:`kernelhub.agents.tools` feeds them its pydantic models' schemas and
its results' text and images. The APIs disagree in ways that matter:

- OpenAI chat completions nests the function (``{"type": "function", "function": {...}}``);
  the Responses API's ``FunctionToolParam`` is flat and strict by default. Strict mode
  wants every property required and ``additionalProperties: false``, so an optional field
  becomes a required one that may be ``null`` (the pydantic model still treats null as
  "not given"), and keywords strict mode rejects (``minLength``, ``default``) are dropped:
  the runner validates the arguments with the model anyway.
- Anthropic takes plain JSON schema as ``input_schema``.
- Gemini takes an OpenAPI 3.0 subset: ``type`` as an enum name (``OBJECT``, ``STRING``),
  ``nullable`` instead of a null type, no ``additionalProperties``, no ``$ref``, and no
  ``parameters`` at all for a function without arguments.
- Images: chat completions tool messages carry text only (the images follow in a user
  message), Responses ``function_call_output`` and Anthropic ``tool_result`` carry image
  parts, Gemini's ``function_response`` carries them as inline-data ``parts``.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from typing import Any

__all__ = [
    "anthropic_tool",
    "anthropic_tool_result",
    "field",
    "gemini_function_declaration",
    "gemini_function_response",
    "gemini_schema",
    "openai_chat_messages",
    "openai_chat_tool",
    "openai_responses_output",
    "openai_responses_tool",
    "plain_schema",
    "strict_schema",
]

# (mime type, base64 data) of one image.
Image = tuple[str, str]

# What strict mode accepts besides the structure; anything else is dropped.
_STRICT_KEYWORDS = {
    "type",
    "description",
    "enum",
    "const",
    "pattern",
    "format",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "multipleOf",
    "minItems",
    "maxItems",
    "items",
}
_GEMINI_TYPES = {
    "string": "STRING",
    "number": "NUMBER",
    "integer": "INTEGER",
    "boolean": "BOOLEAN",
    "array": "ARRAY",
    "object": "OBJECT",
}


def _non_null(prop: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """A property without its ``anyOf [T, null]`` wrapping, and whether null was allowed."""
    prop = {k: v for k, v in prop.items() if k != "title"}
    options = prop.pop("anyOf", None)
    if options is None:
        return prop, False
    non_null = [o for o in options if o.get("type") != "null"]
    if len(non_null) != 1:
        raise ValueError(f"tool argument schemas take T or T | None, not a union: {options}")
    return {**non_null[0], **prop}, len(non_null) < len(options)


def plain_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """Pydantic's schema minus titles, ``anyOf [T, null]`` and null defaults: an optional
    field is simply not required (OpenAI chat completions, Anthropic)."""
    properties: dict[str, Any] = {}
    for name, raw in schema.get("properties", {}).items():
        prop, _ = _non_null(raw)
        if prop.get("default", 0) is None:
            del prop["default"]
        properties[name] = prop
    return {
        "type": "object",
        "properties": properties,
        "required": list(schema.get("required", [])),
        "additionalProperties": False,
    }


def strict_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema for OpenAI strict mode: every property required, optional ones nullable."""
    required = set(schema.get("required", []))
    properties: dict[str, Any] = {}
    for name, raw in schema.get("properties", {}).items():
        prop, nullable = _non_null(raw)
        prop = {k: v for k, v in prop.items() if k in _STRICT_KEYWORDS}
        if nullable or name not in required:
            prop["type"] = [prop["type"], "null"]
        properties[name] = prop
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }


def gemini_schema(schema: dict[str, Any]) -> dict[str, Any] | None:
    """The schema as a Gemini ``Schema`` (OpenAPI subset), or None for no arguments."""
    properties: dict[str, Any] = {}
    for name, raw in schema.get("properties", {}).items():
        prop, nullable = _non_null(raw)
        out: dict[str, Any] = {"type": _GEMINI_TYPES[prop["type"]]}
        for key in ("description", "minimum", "maximum", "enum"):
            if key in prop:
                out[key] = prop[key]
        # Gemini has no exclusive bounds; the runner's validation keeps them.
        if "exclusiveMinimum" in prop and "minimum" not in out:
            out["minimum"] = prop["exclusiveMinimum"]
        if "minLength" in prop:
            out["min_length"] = prop["minLength"]
        if nullable or name not in schema.get("required", []):
            out["nullable"] = True
        properties[name] = out
    if not properties:
        return None
    return {
        "type": "OBJECT",
        "properties": properties,
        "required": list(schema.get("required", [])),
    }


# -- tool definitions ----------------------------------------------------------------------


def openai_chat_tool(name: str, description: str, schema: dict[str, Any]) -> dict[str, Any]:
    """One ``tools=`` entry of chat completions (``ChatCompletionFunctionToolParam``)."""
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": plain_schema(schema)},
    }


def openai_responses_tool(
    name: str, description: str, schema: dict[str, Any], *, strict: bool = True
) -> dict[str, Any]:
    """One ``tools=`` entry of the Responses API (``FunctionToolParam``: flat)."""
    return {
        "type": "function",
        "name": name,
        "description": description,
        "parameters": strict_schema(schema) if strict else plain_schema(schema),
        "strict": strict,
    }


def anthropic_tool(name: str, description: str, schema: dict[str, Any]) -> dict[str, Any]:
    """One ``tools=`` entry of the Anthropic Messages API (``ToolParam``)."""
    return {"name": name, "description": description, "input_schema": plain_schema(schema)}


def gemini_function_declaration(
    name: str, description: str, schema: dict[str, Any]
) -> dict[str, Any]:
    """One Gemini ``FunctionDeclaration`` (put a list of them in ``Tool.function_declarations``)."""
    declaration: dict[str, Any] = {"name": name, "description": description}
    parameters = gemini_schema(schema)
    if parameters is not None:
        declaration["parameters"] = parameters
    return declaration


def field(obj: Any, name: str, *default: Any) -> Any:
    """``obj[name]`` of a tool call given as a dict, ``obj.name`` of one given as an SDK
    object (``ResponseFunctionToolCall``, ``ToolUseBlock``, ``FunctionCall``...)."""
    if isinstance(obj, dict):
        return obj.get(name, *default) if default else obj[name]
    return getattr(obj, name, *default)


# -- tool results --------------------------------------------------------------------------


def _data_url(image: Image) -> str:
    return f"data:{image[0]};base64,{image[1]}"


def openai_chat_messages(
    tool_call_id: str, text: str, images: Sequence[Image]
) -> list[dict[str, Any]]:
    """The ``role: tool`` message answering ``tool_call_id`` and, if there are images, a
    ``role: user`` message carrying them (chat completions tool messages are text only)."""
    if images:
        text += f"\n[{len(images)} image(s) follow in the next message]"
    messages: list[dict[str, Any]] = [
        {"role": "tool", "tool_call_id": tool_call_id, "content": text}
    ]
    if images:
        messages.append(
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Images produced by the previous tool call:"},
                    *({"type": "image_url", "image_url": {"url": _data_url(i)}} for i in images),
                ],
            }
        )
    return messages


def openai_responses_output(call_id: str, text: str, images: Sequence[Image]) -> dict[str, Any]:
    """The ``function_call_output`` input item answering ``call_id``: a string, or text
    and ``input_image`` parts when there are images."""
    output: str | list[dict[str, Any]] = text
    if images:
        output = [
            {"type": "input_text", "text": text},
            *({"type": "input_image", "image_url": _data_url(i), "detail": "auto"} for i in images),
        ]
    return {"type": "function_call_output", "call_id": call_id, "output": output}


def anthropic_tool_result(
    tool_use_id: str, text: str, images: Sequence[Image], *, is_error: bool
) -> dict[str, Any]:
    """The ``tool_result`` content block answering ``tool_use_id`` (text and images)."""
    content: list[dict[str, Any]] = [{"type": "text", "text": text}]
    content += [
        {"type": "image", "source": {"type": "base64", "media_type": mime, "data": data}}
        for mime, data in images
    ]
    return {
        "type": "tool_result",
        "tool_use_id": tool_use_id,
        "content": content,
        "is_error": is_error,
    }


def gemini_function_response(
    name: str, call_id: str | None, text: str, images: Sequence[Image], *, is_error: bool
) -> dict[str, Any]:
    """A Gemini ``Part`` with the ``function_response`` for a call of ``name``: the text under
    ``output`` (or ``error``), images as inline-data parts (raw bytes, as the SDK wants)."""
    response: dict[str, Any] = {
        "name": name,
        "response": {"error" if is_error else "output": text},
    }
    if call_id is not None:
        response["id"] = call_id
    if images:
        response["parts"] = [
            {"inline_data": {"mime_type": mime, "data": base64.b64decode(data)}}
            for mime, data in images
        ]
    return {"function_response": response}
