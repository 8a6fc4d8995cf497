"""ToolRunner against a real gateway and Docker sandbox, answering each LLM API's tool call
in that API's own result shape, validated with the official SDK types (no network)."""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from pydantic import TypeAdapter

from kernelhub.agents.tools import ToolRunner
from kernelhub.client import AsyncHub
from tests.conftest import UNIT
from tests.gateway.conftest import Gateway

openai_responses = pytest.importorskip("openai.types.responses")
openai_chat = pytest.importorskip("openai.types.chat")
anthropic_types = pytest.importorskip("anthropic.types")
genai = pytest.importorskip("google.genai.types")

pytestmark = pytest.mark.docker

PLOT = "import matplotlib.pyplot as plt\nplt.plot([1, 2, 3])\nprint('plotted')\nplt.show()"


@pytest.fixture(scope="module")
def token(shared_gateway: Gateway) -> str:
    return shared_gateway.token("schemas")


@pytest.fixture
async def runner(shared_gateway: Gateway, token: str) -> AsyncIterator[ToolRunner]:
    async with AsyncHub(shared_gateway.url, token, timeout=60 * UNIT) as hub:
        session = await hub.create_session()
        async with session:
            yield ToolRunner(session)


def validate(adapter: TypeAdapter[Any], value: object) -> None:
    adapter.validate_python(value, strict=True, extra="forbid")


def png_of(data_url: str) -> bytes:
    prefix = "data:image/png;base64,"
    assert data_url.startswith(prefix)
    return base64.b64decode(data_url[len(prefix) :])


async def test_responses_function_call_output_has_the_plot(runner: ToolRunner) -> None:
    call = openai_responses.ResponseFunctionToolCall(
        type="function_call", call_id="c1", name="execute_python",
        arguments=json.dumps({"code": PLOT, "timeout": None}),  # as strict mode sends it
    )  # fmt: skip
    item = await runner.run_responses(call)
    validate(TypeAdapter(openai_responses.ResponseInputItemParam), item)
    text, image = item["output"]
    assert "plotted" in text["text"]
    assert png_of(image["image_url"]).startswith(b"\x89PNG")


async def test_anthropic_gemini_and_chat_results_carry_the_plot(runner: ToolRunner) -> None:
    tool_use = anthropic_types.ToolUseBlock(
        type="tool_use", id="t1", name="execute_python", input={"code": PLOT}
    )
    block = await runner.run_anthropic(tool_use)
    validate(TypeAdapter(anthropic_types.ToolResultBlockParam), block)
    image = block["content"][1]["source"]
    assert base64.b64decode(image["data"]).startswith(b"\x89PNG")

    part = genai.Part.model_validate(
        await runner.run_gemini(genai.FunctionCall(name="execute_python", args={"code": PLOT}))
    )
    assert part.function_response is not None and part.function_response.parts
    blob = part.function_response.parts[0].inline_data
    assert blob is not None and blob.data is not None and blob.data.startswith(b"\x89PNG")

    chat_call = openai_chat.ChatCompletionMessageFunctionToolCall(
        id="c2", type="function",
        function={"name": "execute_python", "arguments": json.dumps({"code": "1 / 0"})},
    )  # fmt: skip
    (message,) = await runner.run_openai_chat(chat_call)
    validate(TypeAdapter(openai_chat.ChatCompletionToolMessageParam), message)
    assert "ZeroDivisionError" in message["content"]
