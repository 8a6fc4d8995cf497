"""Kernelhub as tools for LLM agents.

:mod:`kernelhub.agents.tools` defines the tools once (a pydantic model each), renders them
(through :mod:`kernelhub.agents.schemas`) for OpenAI chat completions, the OpenAI Responses
API, Anthropic tool use and Gemini function declarations, and runs calls against a session with
:class:`ToolRunner`; :mod:`kernelhub.agents.results` turns executions into model-ready
results (bounded text, images, summarized errors). :mod:`kernelhub.agents.mcp_server` serves the same tools over MCP
(needs the ``agents`` extra); :mod:`kernelhub.agents.example_loop` is a runnable agent loop
with a scripted model.
"""

from kernelhub.agents.results import Attachment, ToolResult
from kernelhub.agents.tools import (
    TOOLS,
    ToolRunner,
    ToolSession,
    ToolSpec,
    anthropic_tools,
    gemini_tools,
    openai_responses_tools,
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
    "gemini_tools",
    "openai_responses_tools",
    "openai_tools",
]
