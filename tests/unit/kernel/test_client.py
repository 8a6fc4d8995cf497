"""The host's Session: same checks as jupyter_client's, minus the date parsing."""

from __future__ import annotations

import pytest
from jupyter_client.session import Session

from kernelhub.kernel.client import SandboxSession

KEY = b"k" * 32


def _wire(session: Session, content: dict[str, object]) -> list[bytes]:
    msg = session.msg("execute_reply", content, parent=session.msg_header("execute_request"))
    return session.serialize(msg)[1:]  # past the <IDS|MSG> delimiter: [sig, header, ...]


def test_deserialize_matches_jupyter_client_except_for_dates() -> None:
    kernel = Session(key=KEY)
    wire = _wire(kernel, {"status": "ok", "execution_count": 3})
    ours = SandboxSession(key=KEY).deserialize(list(wire))
    stock = Session(key=KEY).deserialize(list(wire))
    assert ours["content"] == stock["content"] == {"status": "ok", "execution_count": 3}
    assert ours["msg_type"] == stock["msg_type"] == "execute_reply"
    assert ours["parent_header"]["msg_id"] == stock["parent_header"]["msg_id"]
    assert isinstance(ours["header"]["date"], str)  # left as the kernel sent it
    assert ours["header"]["date"].startswith(str(stock["header"]["date"].date()))


def test_forged_unsigned_and_replayed_messages_are_refused() -> None:
    wire = _wire(Session(key=KEY), {"status": "ok"})
    with pytest.raises(ValueError, match="Invalid Signature"):
        SandboxSession(key=b"x" * 32).deserialize(list(wire))
    with pytest.raises(ValueError, match="Unsigned"):
        SandboxSession(key=KEY).deserialize([b"", *wire[1:]])
    session = SandboxSession(key=KEY)
    session.deserialize(list(wire))
    with pytest.raises(ValueError, match="Duplicate Signature"):
        session.deserialize(list(wire))
    with pytest.raises(TypeError, match="malformed"):
        session.deserialize(wire[:3])
