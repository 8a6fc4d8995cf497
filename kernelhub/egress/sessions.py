"""The gateway's side of egress: which policy a session gets, its human gate, its audit.

:class:`EgressSessions` is the session manager's collaborator (it holds no reference to
the manager): ``choose`` picks a new session's policy within what the operator allows,
``bind`` serves the session's socket when its sandbox is bound to a kernel (new, adopted,
woken or recovered: the same call), ``unbind`` stops serving it. The policy chosen and a
human's "for this session" answers are in the session's row (``save``), and ``restore``
reads them back after a gateway restart. The gate asks through the
kernel's running cell (``KernelSession.ask``), so it is answered wherever ``confirm()``
is: REST, WebSocket, MCP elicitation, the review page.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from kernelhub.config import EgressPolicy, EgressSettings
from kernelhub.egress.policy import Answer, gate_prompt, parse_answer
from kernelhub.egress.proxy import EgressProxy, EgressSession
from kernelhub.errors import ConfigError, ForbiddenError
from kernelhub.execution.engine import KernelSession
from kernelhub.store.base import Store
from kernelhub.store.records import AuditEntry, EgressGrants, StoredSession

log = logging.getLogger(__name__)


def check_settings(settings: EgressSettings) -> None:
    """Fail closed on a policy name that names nothing, or a half-configured CA."""
    names = set(settings.policies)
    referenced = {
        ("KERNELHUB_EGRESS__DEFAULT_POLICY", settings.default_policy),
        *(
            ("KERNELHUB_EGRESS__PRINCIPAL_POLICIES", n)
            for n in settings.principal_policies.values()
        ),
        *(
            ("KERNELHUB_EGRESS__ALLOWED_POLICIES", n)
            for ns in settings.allowed_policies.values()
            for n in ns
        ),
    }
    for variable, name in referenced:
        if name is not None and name not in names:
            raise ConfigError(
                f"{variable} names the egress policy {name!r}, which "
                f"KERNELHUB_EGRESS__POLICIES does not define (it has: {sorted(names) or 'none'})"
            )
    if (settings.ca_cert_file is None) != (settings.ca_key_file is None):
        raise ConfigError(
            "set both KERNELHUB_EGRESS__CA_CERT_FILE and KERNELHUB_EGRESS__CA_KEY_FILE, or neither"
        )
    needs_ca = [d for p in settings.policies.values() for d in p.headers]
    if needs_ca and settings.ca_cert_file is None:
        raise ConfigError(
            f"egress policies add headers for {needs_ca[:3]}: that needs "
            "KERNELHUB_EGRESS__CA_CERT_FILE and KERNELHUB_EGRESS__CA_KEY_FILE (for HTTPS)"
        )


class EgressSessions:
    """Every live session's egress: its audit entries and answers go to ``store``."""

    def __init__(
        self,
        settings: EgressSettings,
        work_dir: Path,
        store: Store,
        *,
        proxy: EgressProxy | None = None,
    ) -> None:
        check_settings(settings)
        self.settings = settings
        self.proxy = proxy or EgressProxy(settings, work_dir)
        self._audit = store.audit
        self._save = store.set_egress_grants
        self._policies: dict[str, str | None] = {}
        self._grants: dict[str, EgressGrants] = {}  # as last stored, for a new sandbox
        self._tasks: set[asyncio.Future[None]] = set()

    def choose(self, principal: str, asked: str | None, *, fixed: str | None = None) -> str | None:
        """The policy name a new session of ``principal`` gets; ``asked``: the one the
        request names; ``fixed``: its trust tier's, which no request changes.
        ForbiddenError if the operator does not let this principal use it."""
        s = self.settings
        if fixed is not None:
            if asked is not None and asked != fixed:
                raise ForbiddenError(
                    f"this session's profile fixes its egress policy to {fixed!r}; "
                    f"{asked!r} cannot be asked for"
                )
            return fixed
        if asked is None:
            return s.principal_policies.get(principal, s.default_policy)
        allowed = {*s.allowed_policies.get("*", []), *s.allowed_policies.get(principal, [])}
        default = s.principal_policies.get(principal, s.default_policy)
        if asked != default and asked not in allowed:
            raise ForbiddenError(
                f"egress policy {asked!r} is not allowed for {principal!r}; the operator "
                "lists the policies each principal may ask for in "
                "KERNELHUB_EGRESS__ALLOWED_POLICIES"
            )
        return asked

    def remember(self, stored: StoredSession) -> None:
        """A session's recorded policy and answers (a new one's, or read back after a
        restart). A row from before they were recorded keeps the owner's default."""
        if stored.egress_grants is not None:
            self._policies[stored.id] = stored.egress_policy
            self._grants[stored.id] = stored.egress_grants

    def policy_name(self, session_id: str, owner: str) -> str | None:
        if session_id in self._policies:
            return self._policies[session_id]
        # Adopted after a gateway restart: the owner's default (never more than it).
        return self.settings.principal_policies.get(owner, self.settings.default_policy)

    async def bind(self, session_id: str, owner: str, kernel: KernelSession) -> None:
        name = self.policy_name(session_id, owner)
        policy: EgressPolicy | None = self.settings.policies.get(name) if name else None
        previous = self.proxy.session(session_id)

        async def ask(host: str, port: int) -> Answer:
            self._spawn_audit(session_id, "egress.ask", {"host": host, "port": port})
            answer = parse_answer(await kernel.ask(gate_prompt(host, port)))
            self._spawn_audit(
                session_id, "egress.answer", {"host": host, "port": port, "answer": answer.value}
            )
            if answer is not Answer.ONCE:
                # Written before the proxy acts on it: an answer given is never lost.
                key = {(host, port)}
                granted = session.granted | key if answer is Answer.SESSION else session.granted
                denied = session.denied | key if answer is Answer.DENY else session.denied
                grants = EgressGrants(granted=sorted(granted), denied=sorted(denied))
                await self._save(session_id, grants)
                self._grants[session_id] = grants
            return answer

        session = EgressSession(
            session_id,
            policy,
            name,
            ask,
            lambda action, detail: self._spawn_audit(session_id, action, detail),
        )
        if previous is not None:
            # A new kernel for the same session keeps its human's answers and its meter.
            session.granted, session.denied = previous.granted, previous.denied
            session.meter = previous.meter
        elif (saved := self._grants.get(session_id)) is not None:
            session.granted, session.denied = set(saved.granted), set(saved.denied)
        try:
            await self.proxy.open(session, kernel.sandbox.session_dir.ipc_dir)
        except OSError as exc:
            # The sandbox goes on without a way out; its requests fail at the forwarder.
            log.warning("session %s: cannot serve its egress socket: %s", session_id, exc)

    async def unbind(self, session_id: str, *, ended: bool = False) -> None:
        """Stop serving the session's socket; ``ended``: the session is gone for good."""
        await self.proxy.close_session(session_id)
        if ended:
            self._policies.pop(session_id, None)
            self._grants.pop(session_id, None)

    async def close(self) -> None:
        await self.proxy.close()
        for task in list(self._tasks):
            task.cancel()

    def _spawn_audit(self, session_id: str, action: str, detail: dict[str, object]) -> None:
        entry = AuditEntry(principal=None, action=action, session_id=session_id, detail=detail)
        task = asyncio.ensure_future(self._audit(entry))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
