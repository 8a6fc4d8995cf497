"""The egress gate's question over MCP elicitation: a three-way choice, deny by default."""

from __future__ import annotations

from kernelhub.agents.mcp_live import answer_of, elicitation_for
from kernelhub.egress.policy import Answer, gate_prompt, parse_answer


def test_the_gate_is_a_choice_of_once_session_or_deny() -> None:
    prompt = gate_prompt("api.example.com", 443)
    message, schema = elicitation_for(prompt)
    assert "api.example.com:443" in message
    assert schema["properties"]["answer"]["enum"] == ["once", "session", "deny"]
    for choice in ("once", "session", "deny"):
        answer = answer_of(prompt, "accept", {"answer": choice})
        assert parse_answer(answer) is Answer(choice)
    assert parse_answer(answer_of(prompt, "decline", None)) is Answer.DENY
    assert parse_answer(answer_of(prompt, "accept", {})) is Answer.DENY
