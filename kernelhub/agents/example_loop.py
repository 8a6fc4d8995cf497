"""An agent loop with kernelhub's tools, and a scripted model standing in for an LLM.

The loop is the shape of any tool-using agent (Anthropic Messages shapes here): send the
conversation and the tools to the model; if it asks for tools, run each through
:class:`~kernelhub.agents.tools.ToolRunner` and append the results; repeat until it
answers in text. :class:`ScriptedModel` needs no network: asked to compute a sum, it
calls ``execute_python`` and then reads the number out of the tool result, so a wrong
result changes its answer.

    python -m kernelhub.agents.example_loop   # with KERNELHUB_URL / KERNELHUB_TOKEN set
"""

from __future__ import annotations

import asyncio
import os
import re
from typing import Any, Protocol

from kernelhub.agents.tools import ToolRunner, anthropic_tools
from kernelhub.client import AsyncHub

__all__ = ["Model", "ScriptedModel", "agent_loop", "main"]

Message = dict[str, Any]


class Model(Protocol):
    """What the loop needs of a model: one turn, given the conversation and the tools,
    returning an assistant message (``content`` a list of text / tool_use blocks)."""

    async def respond(self, messages: list[Message], tools: list[dict[str, Any]]) -> Message: ...


class ScriptedModel:
    """A stand-in for an LLM that handles one request: sum 1..N, verified with Python."""

    async def respond(self, messages: list[Message], tools: list[dict[str, Any]]) -> Message:
        if not any(t["name"] == "execute_python" for t in tools):
            return _say("I need the execute_python tool to verify anything.")
        last = messages[-1]
        if last["role"] == "user" and isinstance(last["content"], str):
            match = re.search(r"sum of 1\s*\.\.\s*(\d+)", last["content"])
            if match is None:
                return _say("I can only sum ranges like 1..100.")
            n = int(match.group(1))
            code = f"print(sum(range(1, {n + 1})))"
            return {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "Let me compute that with Python."},
                    {
                        "type": "tool_use",
                        "id": "toolu_1",
                        "name": "execute_python",
                        "input": {"code": code},
                    },
                ],
            }
        # The tool's answer: read the number from the result's stdout section.
        block = next(b for b in last["content"] if b["type"] == "tool_result")
        text = "\n".join(c["text"] for c in block["content"] if c["type"] == "text")
        found = re.search(r"\[stdout\]\n(-?\d+)\s*$", text, re.MULTILINE)
        if block.get("is_error") or found is None:
            return _say(f"The tool did not give me a number; it said:\n{text}")
        return _say(f"The sum is {found.group(1)}, verified with Python.")


def _say(text: str) -> Message:
    return {"role": "assistant", "content": [{"type": "text", "text": text}]}


async def agent_loop(
    model: Model, runner: ToolRunner, user_message: str, max_turns: int = 8
) -> str:
    """Run the conversation to the model's final text answer; returns that text."""
    tools = anthropic_tools()
    messages: list[Message] = [{"role": "user", "content": user_message}]
    for _ in range(max_turns):
        reply = await model.respond(messages, tools)
        messages.append(reply)
        calls = [b for b in reply["content"] if b["type"] == "tool_use"]
        if not calls:
            return "".join(b["text"] for b in reply["content"] if b["type"] == "text")
        results = [
            (await runner.run(call["name"], call["input"])).to_anthropic_block(call["id"])
            for call in calls
        ]
        messages.append({"role": "user", "content": results})
    raise RuntimeError(f"the model did not answer within {max_turns} turns; raise max_turns=")


async def _demo(url: str, token: str) -> None:
    async with AsyncHub(url, token) as hub, await hub.create_session() as session:
        answer = await agent_loop(
            ScriptedModel(),
            ToolRunner(session),
            "compute the sum of 1..100 and verify it with Python",
        )
        print(answer)


def main() -> None:
    token = os.environ.get("KERNELHUB_TOKEN")
    if not token:
        raise SystemExit("set KERNELHUB_TOKEN (and KERNELHUB_URL if not http://127.0.0.1:8765)")
    asyncio.run(_demo(os.environ.get("KERNELHUB_URL", "http://127.0.0.1:8765"), token))


if __name__ == "__main__":
    main()
