"""The MCP server's tools: kernelhub's :data:`~kernelhub.agents.tools.TOOLS` plus
``answer_input``, each taking the optional ``session`` handle, and their results as MCP
content (pure)."""

from __future__ import annotations

from collections.abc import Sequence

import mcp_types as types
from pydantic import BaseModel, ConfigDict, Field

from kernelhub.agents.mcp_kernels import AwaitingInput
from kernelhub.agents.results import ToolResult, truncate
from kernelhub.agents.tools import TOOLS

__all__ = [
    "ANSWER_INPUT",
    "HANDLE_NOTE",
    "SESSION_ARG",
    "AnswerInputArgs",
    "mcp_tools",
    "tool_result",
    "waiting_result",
]

SESSION_ARG = {
    "type": "string",
    "description": 'The session handle an earlier result named ("session handle: ..."). '
    "Pass it on every call if your variables get lost between calls; omit it otherwise.",
}
HANDLE_NOTE = (
    " Every result ends with the session handle; if your client does not keep an MCP "
    "session, pass it back as `session` to keep variables between calls."
)


class AnswerInputArgs(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    value: str = Field(
        description="The answer to the cell's input() prompt (for confirm(): y or n)."
    )


ANSWER_INPUT = types.Tool(
    name="answer_input",
    description="Answer the input() or confirm() a running execute_python cell waits on (a "
    "result said so); returns the cell's result, or the next question it asks.",
    input_schema={
        "type": "object",
        "properties": {
            "value": AnswerInputArgs.model_json_schema()["properties"]["value"],
            "session": SESSION_ARG,
        },
        "required": ["value"],
        "additionalProperties": False,
    },
)


def mcp_tools() -> list[types.Tool]:
    tools = []
    for spec in TOOLS.values():
        schema = spec.json_schema()
        schema["properties"] = {**schema.get("properties", {}), "session": SESSION_ARG}
        description = spec.description + (HANDLE_NOTE if spec.name == "execute_python" else "")
        tools.append(types.Tool(name=spec.name, description=description, input_schema=schema))
    return [*tools, ANSWER_INPUT]


def tool_result(result: ToolResult, notes: Sequence[str] = ()) -> types.CallToolResult:
    text = "\n".join([result.text, *notes]) if notes else result.text
    blocks: list[types.ContentBlock] = [types.TextContent(text=text)]
    blocks += [types.ImageContent(data=a.data_base64, mime_type=a.mime_type) for a in result.images]
    return types.CallToolResult(content=blocks, is_error=result.is_error)


def waiting_result(waiting: AwaitingInput, max_chars: int) -> ToolResult:
    shown = (
        f"[output so far]\n{truncate(waiting.output, max_chars // 2)}\n" if waiting.output else ""
    )
    return ToolResult(
        text=f"{shown}[waiting for input] the cell is paused at input({waiting.prompt!r}) and "
        "keeps waiting: call answer_input with the value to answer it, or interrupt to stop it."
    )
