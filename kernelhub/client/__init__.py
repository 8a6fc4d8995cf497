"""The kernelhub SDK: drive sandboxed, stateful IPython kernels on a kernelhub gateway.

Needs only the base install (pydantic, httpx, websockets)::

    from kernelhub.client import Hub

    with Hub() as hub, hub.create_session() as session:  # KERNELHUB_URL, KERNELHUB_TOKEN
        session.run("x = 1")
        execution = session.run("print(x + 1)", on_stdout=print)
        assert execution.stdout == "2\\n" and execution.error is None
        png = session.run("plt.plot([1, 2]); plt.show()").results[0].png  # base64

:class:`AsyncHub` / :class:`AsyncSession` are the async originals; :class:`Hub` /
:class:`Session` their blocking twins. A failing cell is data (``execution.error``); the
exceptions below are for kernelhub refusing or failing. The protocol is in
``docs/protocol.md``.
"""

from kernelhub.client._async import AsyncHub, AsyncSession, FileInfo, batch_item
from kernelhub.client._sync import Hub, Session, SyncIterator
from kernelhub.client.errors import (
    ApiError,
    AuthError,
    ClientError,
    ConflictError,
    ForbiddenError,
    GatewayUnreachableError,
    InvalidRequestError,
    MediaTypeError,
    NotFoundError,
    ProtocolError,
    RateLimitedError,
    ServerError,
    SessionEndedError,
    StorageFullError,
    StreamLostError,
    TooLargeError,
)
from kernelhub.errors import KernelhubError
from kernelhub.models import (
    CellError,
    ClearOutputEvent,
    DisplayEvent,
    EndedBy,
    ErrorEvent,
    Event,
    Execution,
    ExecutionRecord,
    ExecutionStatus,
    FinalEvent,
    InputReplyEvent,
    InputRequestEvent,
    NoticeEvent,
    Result,
    ResultEvent,
    StatusEvent,
    StreamEvent,
    TruncatedEvent,
)
from kernelhub.wire import (
    BatchInfo,
    BatchItemIn,
    BatchItemInfo,
    BatchState,
    ExecutionInfo,
    LimitsIn,
    SessionInfo,
    SessionState,
)

__all__ = [
    "ApiError",
    "AsyncHub",
    "AsyncSession",
    "AuthError",
    "BatchInfo",
    "BatchItemIn",
    "BatchItemInfo",
    "BatchState",
    "CellError",
    "ClearOutputEvent",
    "ClientError",
    "ConflictError",
    "DisplayEvent",
    "EndedBy",
    "ErrorEvent",
    "Event",
    "Execution",
    "ExecutionInfo",
    "ExecutionRecord",
    "ExecutionStatus",
    "FileInfo",
    "FinalEvent",
    "ForbiddenError",
    "GatewayUnreachableError",
    "Hub",
    "InputReplyEvent",
    "InputRequestEvent",
    "InvalidRequestError",
    "KernelhubError",
    "LimitsIn",
    "MediaTypeError",
    "NotFoundError",
    "NoticeEvent",
    "ProtocolError",
    "RateLimitedError",
    "Result",
    "ResultEvent",
    "ServerError",
    "Session",
    "SessionEndedError",
    "SessionInfo",
    "SessionState",
    "StatusEvent",
    "StorageFullError",
    "StreamEvent",
    "StreamLostError",
    "SyncIterator",
    "TooLargeError",
    "TruncatedEvent",
    "batch_item",
]
