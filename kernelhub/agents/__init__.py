"""Kernelhub as tools for LLM agents.

:mod:`kernelhub.agents.tools` defines the tools once (a pydantic model each), renders them
for OpenAI function calling and Anthropic tool use, and runs calls against a session with
:class:`ToolRunner`, which turns executions into model-ready results (bounded text, images,
summarized errors). :mod:`kernelhub.agents.mcp_server` serves the same tools over MCP
(needs the ``agents`` extra); :mod:`kernelhub.agents.example_loop` is a runnable agent loop
with a scripted model.
"""

from kernelhub.agents.tools import (
    TOOLS,
    Attachment,
    ToolResult,
    ToolRunner,
    ToolSession,
    ToolSpec,
    anthropic_tools,
    openai_tools,
)

__all__ = [
    "TOOLS",
    "Attachment",
    "ToolResult",
    "ToolRunner",
    "ToolSession",
    "ToolSpec",
    "anthropic_tools",
    "openai_tools",
]
