"""The tool definitions and results in each LLM API's shape, validated against the official
SDK types (openai, anthropic, google-genai; no network), and the schema rewrites with data."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest
from pydantic import TypeAdapter

from kernelhub.agents import schemas
from kernelhub.agents.tools import (
    TOOLS,
    Attachment,
    ExecutePythonArgs,
    ToolResult,
    ToolRunner,
    UploadFileArgs,
    anthropic_tools,
    gemini_tools,
    openai_responses_tools,
    openai_tools,
)

openai_responses = pytest.importorskip("openai.types.responses")
openai_chat = pytest.importorskip("openai.types.chat")
anthropic_types = pytest.importorskip("anthropic.types")
genai = pytest.importorskip("google.genai.types")

PNG_BYTES = b"\x89PNG\r\n\x1a\n fake"
PNG = base64.b64encode(PNG_BYTES).decode()
WITH_IMAGE = ToolResult(text="[stdout]\nhi", images=[Attachment("image/png", PNG)])
TEXT_ONLY = ToolResult(text="oops", is_error=True)


def strict_validate(adapter: TypeAdapter[Any], value: object) -> None:
    # TypedDicts ignore unknown keys unless told otherwise; a misspelt key must fail here.
    adapter.validate_python(value, strict=True, extra="forbid")


def walk(schema: Any) -> list[dict[str, Any]]:
    if isinstance(schema, dict):
        return [schema, *(n for v in schema.values() for n in walk(v))]
    if isinstance(schema, list):
        return [n for v in schema for n in walk(v)]
    return []


# -- definitions -------------------------------------------------------------------------


def test_responses_tools_are_flat_function_tool_params() -> None:
    adapter = TypeAdapter(openai_responses.FunctionToolParam)
    tools = openai_responses_tools()
    assert [t["name"] for t in tools] == list(TOOLS)
    for tool in tools:
        strict_validate(adapter, tool)
        assert tool["strict"] is True and "function" not in tool


def test_chat_completions_nesting_is_not_a_responses_tool() -> None:
    with pytest.raises(ValueError, match="name"):
        TypeAdapter(openai_responses.FunctionToolParam).validate_python(openai_tools()[0])


def test_strict_mode_rules_hold_for_every_tool() -> None:
    """OpenAI strict: every property required, additionalProperties false at every object,
    optionals nullable, no keywords strict rejects."""
    for tool in openai_responses_tools():
        for node in walk(tool["parameters"]):
            if node.get("type") == "object":
                assert node["additionalProperties"] is False
                assert sorted(node["required"]) == sorted(node["properties"])
            assert not {"default", "minLength", "title", "anyOf"} & set(node)


def test_strict_optionals_become_nullable_and_still_validate() -> None:
    execute = next(t for t in openai_responses_tools() if t["name"] == "execute_python")
    props = execute["parameters"]["properties"]
    assert props["code"]["type"] == "string"
    assert props["timeout"]["type"] == ["number", "null"]
    # What a strict model sends for "no timeout" is what the args model accepts.
    assert ExecutePythonArgs.model_validate({"code": "1", "timeout": None}).timeout is None
    upload = UploadFileArgs.model_validate({"path": "a", "text": "x", "content_base64": None})
    assert upload.text == "x"


def test_non_strict_responses_tools_keep_optionals_optional() -> None:
    adapter = TypeAdapter(openai_responses.FunctionToolParam)
    for tool in openai_responses_tools(strict=False):
        strict_validate(adapter, tool)
    execute = openai_responses_tools(strict=False)[0]["parameters"]
    assert execute["required"] == ["code"] and execute["properties"]["timeout"]["type"] == "number"


def test_chat_completions_and_anthropic_tools_validate() -> None:
    chat = TypeAdapter(openai_chat.ChatCompletionFunctionToolParam)
    for tool in openai_tools():
        strict_validate(chat, tool)
    anthropic = TypeAdapter(anthropic_types.ToolParam)
    for tool in anthropic_tools():
        anthropic.validate_python(tool)
        assert set(tool) == {"name", "description", "input_schema"}


def test_gemini_declarations_validate_and_use_the_openapi_subset() -> None:
    declarations = gemini_tools()
    tool = genai.Tool.model_validate({"function_declarations": declarations})
    assert [d.name for d in tool.function_declarations or []] == list(TOOLS)
    for declaration in declarations:
        for node in walk(declaration.get("parameters", {})):
            assert not {"additionalProperties", "$ref", "$defs", "anyOf", "title"} & set(node)
    execute = tool.function_declarations[0].parameters  # type: ignore[index]
    assert execute is not None and execute.type == genai.Type.OBJECT
    assert execute.required == ["code"]
    assert execute.properties["timeout"].nullable is True  # type: ignore[index]
    # A tool without arguments has no parameters (Gemini rejects an empty OBJECT).
    assert "parameters" not in next(d for d in declarations if d["name"] == "interrupt")


def test_gemini_schema_maps_types_and_bounds() -> None:
    schema = {
        "properties": {
            "n": {"type": "integer", "exclusiveMinimum": 0, "maximum": 9, "title": "N"},
            "s": {"anyOf": [{"type": "string", "minLength": 2}, {"type": "null"}], "default": None},
        },
        "required": ["n"],
    }
    assert schemas.gemini_schema(schema) == {
        "type": "OBJECT",
        "properties": {
            "n": {"type": "INTEGER", "maximum": 9, "minimum": 0},
            "s": {"type": "STRING", "min_length": 2, "nullable": True},
        },
        "required": ["n"],
    }
    assert schemas.gemini_schema({"properties": {}}) is None


def test_unions_are_refused_not_silently_mangled() -> None:
    union = {"properties": {"x": {"anyOf": [{"type": "string"}, {"type": "integer"}]}}}
    with pytest.raises(ValueError, match="not a union"):
        schemas.strict_schema(union)


# -- results -----------------------------------------------------------------------------


def test_responses_output_carries_input_image_parts() -> None:
    adapter = TypeAdapter(openai_responses.ResponseInputItemParam)
    item = WITH_IMAGE.to_responses_item("call_9")
    strict_validate(adapter, item)
    assert item["type"] == "function_call_output" and item["call_id"] == "call_9"
    text, image = item["output"]
    assert text == {"type": "input_text", "text": "[stdout]\nhi"}
    assert image["type"] == "input_image"
    assert image["image_url"] == f"data:image/png;base64,{PNG}"
    plain = TEXT_ONLY.to_responses_item("call_1")
    strict_validate(adapter, plain)
    assert plain["output"] == "oops"


def test_chat_completions_messages_put_images_in_a_user_message() -> None:
    adapter = TypeAdapter(openai_chat.ChatCompletionMessageParam)
    tool_message, user_message = WITH_IMAGE.to_openai_messages("call_1")
    for message in (tool_message, user_message):
        strict_validate(adapter, message)
    assert tool_message["role"] == "tool" and "1 image(s) follow" in tool_message["content"]
    assert user_message["content"][1]["image_url"]["url"].endswith(PNG)
    assert len(TEXT_ONLY.to_openai_messages("call_2")) == 1


def test_anthropic_tool_result_has_image_blocks() -> None:
    adapter = TypeAdapter(anthropic_types.ToolResultBlockParam)
    block = WITH_IMAGE.to_anthropic_block("toolu_1")
    strict_validate(adapter, block)
    assert [c["type"] for c in block["content"]] == ["text", "image"]
    assert TEXT_ONLY.to_anthropic_block("toolu_2")["is_error"] is True


def test_gemini_function_response_has_inline_image_parts() -> None:
    part = genai.Part.model_validate(WITH_IMAGE.to_gemini_part("execute_python", "fc_1"))
    response = part.function_response
    assert response is not None and response.name == "execute_python" and response.id == "fc_1"
    assert response.response == {"output": "[stdout]\nhi"}
    blob = response.parts[0].inline_data  # type: ignore[index]
    assert blob is not None and blob.mime_type == "image/png" and blob.data == PNG_BYTES
    error = genai.Part.model_validate(TEXT_ONLY.to_gemini_part("execute_python"))
    assert error.function_response is not None
    assert error.function_response.response == {"error": "oops"}


# -- the runner answers each API's call in that API's shape ------------------------------


class EchoSession:
    """Only upload is used: it answers with the size written."""

    async def upload(self, path: str, data: bytes) -> Any:
        from kernelhub.client import FileInfo

        return FileInfo(path=path, size=len(data))


@pytest.fixture
def runner() -> ToolRunner:
    return ToolRunner(EchoSession())  # type: ignore[arg-type]


async def test_runner_answers_sdk_objects_natively(runner: ToolRunner) -> None:
    args = json.dumps({"path": "a.txt", "text": "hello", "content_base64": None})
    call = openai_responses.ResponseFunctionToolCall(
        type="function_call", call_id="c1", name="upload_file", arguments=args
    )
    item = await runner.run_responses(call)
    assert item["call_id"] == "c1" and "wrote 5 bytes" in item["output"]

    chat_call = openai_chat.ChatCompletionMessageFunctionToolCall(
        id="c2", type="function", function={"name": "upload_file", "arguments": args}
    )
    (message,) = await runner.run_openai_chat(chat_call)
    assert message["tool_call_id"] == "c2" and "wrote 5 bytes" in message["content"]

    tool_use = anthropic_types.ToolUseBlock(
        type="tool_use", id="t1", name="upload_file", input=json.loads(args)
    )
    block = await runner.run_anthropic(tool_use)
    assert block["tool_use_id"] == "t1" and block["is_error"] is False

    gemini_call = genai.FunctionCall(name="upload_file", args={"path": "a", "text": "xy"}, id="g1")
    part = genai.Part.model_validate(await runner.run_gemini(gemini_call))
    assert part.function_response is not None
    assert part.function_response.response == {"output": "wrote 2 bytes to a"}

    bad = await runner.run_gemini({"name": "upload_file", "args": {"path": "a"}})
    assert "error" in bad["function_response"]["response"]
