"""The batch queue (issue #24): batch items wait in the store, and every node claims the
next runnable ones whenever it has room, so a batch submitted through any node is worked
by all of them. Sans-I/O operations like executions.py's, and the pure planner they use.

A claim (:func:`claim_batch_items`) is one transaction that

1. settles lapsed claims (:func:`sweep`): a running item whose lease ran out goes back
   to the queue if its code never reached a kernel (``submitted_at`` unset); one whose
   code did ends, with its execution's status if that finished and failed otherwise, and
   never runs again (it may have run: only the client knows if twice is safe);
2. reads the open batches (not cancelled, with items waiting);
3. counts the running items per principal (cluster-wide), and per batch and per
   principal on this node (a batch's ``concurrency`` and the principal cap are per node,
   like the ``KERNELHUB_BATCH__CONCURRENCY`` slots they share: a batch spreads over every
   node, as many at once on each as it asked for);
4. plans (:func:`plan_claims`, pure): the principal with the fewest items running
   cluster-wide goes first, ties to the one whose open batch is oldest; within a
   principal the oldest batch with room. A principal with 1,000 items waiting therefore
   never starves one with 2: the second gets the next slot that frees anywhere;
5. takes the planned items in index order, ``FOR UPDATE SKIP LOCKED`` on PostgreSQL:
   an item another node is claiming right now is skipped, not waited for, so two nodes
   never take the same item and claimers never queue behind each other; and marks them
   running on this node, with a lease.

Only items are locked, never a batch: a lock on the batch rows would let one claimer at a
time through (measured with 2 workers: half the claims came back empty). Nothing needs
one, as every cap is per node and each node claims from one task.

SQLite runs the same statements without the locking clauses: its one connection runs one
transaction at a time, which is all the locking one machine needs.

Why no broker (issue #24 asks for one only if a measurement says so; bench/batch_claims.py,
2 shared cores at load 7-9): 2 worker processes claiming from the test suite's private
PostgreSQL sustained 123-182 claims/s (one item each; p50 8-13 ms) and 210 items/s taking 4 a
claim, while a node runs real batch items at about 1 a second (24 ``1+1`` items, 4 at a
time: 0.92 items/s; each is a fresh sandbox). The queue has two orders of magnitude of
room before it is the bottleneck, and a broker would add a second source of truth.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime

from kernelhub.models import ExecutionStatus
from kernelhub.store.queries import Op, Query
from kernelhub.store.records import StoredBatchItem

# An item any node may take: waiting, not a duplicate (such a row always has its input:
# the rows older versions left waiting without one were settled by migration 8).
_RUNNABLE = "status = 'queued' AND dup_batch_id IS NULL"
# Those rows through their partial index (migration 8), in (batch, index) order: SQLite's
# planner would rather take the index on status alone and read every waiting row
# (measured on a 10,000-item queue: 30 ms a claim, against 0.2 ms this way), so its text
# names the index; PostgreSQL finds it by itself.
_WAITING = "batch_items INDEXED BY batch_items_waiting"


def _waiting(sql: str) -> Query:
    """A read of the waiting items, ``{w}`` standing for their table."""
    return Query(sql.format(w=_WAITING), postgres=sql.format(w="batch_items"))


# -- the plan (pure) ---------------------------------------------------------------------


@dataclass(frozen=True)
class OpenBatch:
    """A batch with items waiting, as a claim sees it."""

    id: str
    owner: str
    concurrency: int  # its items running at once on one node
    waiting: int
    running: int = 0  # on this node


def plan_claims(
    batches: Sequence[OpenBatch],
    running: Mapping[str, int],
    here: Mapping[str, int],
    limit: int,
    principal_limit: int | None,
) -> dict[str, int]:
    """How many items to take from each batch (see the module): ``batches`` oldest first
    (each with its items running on this node), ``running`` each principal's items
    running anywhere, ``here`` those running on this node, which ``principal_limit``
    caps; at most ``limit`` in all."""
    taken: dict[str, int] = {}
    by_owner: dict[str, int] = {}
    first: dict[str, int] = {}  # each principal's oldest open batch: the tie-break
    for n, b in enumerate(batches):
        first.setdefault(b.owner, n)
    for _ in range(limit):
        best: tuple[int, int, OpenBatch] | None = None
        for b in batches:
            took = taken.get(b.id, 0)
            if took >= b.waiting or b.running + took >= b.concurrency:
                continue
            mine = by_owner.get(b.owner, 0)
            if principal_limit is not None and here.get(b.owner, 0) + mine >= principal_limit:
                continue
            rank = (running.get(b.owner, 0) + mine, first[b.owner])
            if best is None or rank < best[:2]:
                best = (*rank, b)
        if best is None:
            break
        chosen = best[2]
        taken[chosen.id] = taken.get(chosen.id, 0) + 1
        by_owner[chosen.owner] = by_owner.get(chosen.owner, 0) + 1
    return taken


# -- operations --------------------------------------------------------------------------


@dataclass(frozen=True)
class BatchClaim:
    items: list[StoredBatchItem]  # claimed now, with their bodies, in claim order
    waiting: int  # items still waiting, all batches, every node


@dataclass(frozen=True)
class HeldItem:
    batch_id: str
    index: int
    cancelled: bool  # its batch was cancelled (perhaps through another node): stop it


def _lost(node: str) -> str:
    return (
        f"the node running this item ({node}) stopped or lost touch while its code ran; its "
        "output may be incomplete. It keeps its idempotency key (it may have run): submit it "
        "again under a new key if running it twice is safe"
    )


def sweep(now: datetime, node: str | None = None) -> Op[int]:
    """Settle lapsed claims (see the module): those whose lease ran out by ``now``, or with
    ``node`` every claim of that node (it is starting or stopping). Returns how many."""
    if node is None:
        lapsed, params = "status = 'running' AND lease_expires_at < ?", (now.isoformat(),)
    else:
        lapsed, params = "status = 'running' AND node = ?", (node,)
    at = now.isoformat()
    # Never ran, batch cancelled meanwhile: cancelled, its key free (as in a cancel).
    n = yield Query(
        "UPDATE batch_items SET status = 'cancelled', finished_at = ?, idempotency_key = NULL,"
        " body = NULL, error = 'the batch was cancelled before this item started' WHERE " + lapsed +
        " AND submitted_at IS NULL"
        " AND batch_id IN (SELECT id FROM batches WHERE cancelled_at IS NOT NULL)",
        (at, *params),
        rowcount=True,
    )  # fmt: skip
    # Never ran: back to the queue, for whichever node claims it next.
    m = yield Query(
        "UPDATE batch_items SET status = 'queued', node = NULL, lease_expires_at = NULL,"
        " started_at = NULL, session_id = NULL WHERE " + lapsed + " AND submitted_at IS NULL",
        params,
        rowcount=True,
    )
    # Its code went to a kernel: it ends, as its execution did if that finished.
    finished = (
        "(SELECT e.status FROM executions e WHERE e.id = batch_items.execution_id"
        " AND e.record IS NOT NULL)"
    )
    lost = yield Query(
        "SELECT batch_id, idx, node FROM batch_items WHERE " + lapsed + " AND submitted_at IS NOT NULL",
        params,
    )  # fmt: skip
    for batch_id, index, was in lost:
        yield Query(
            f"UPDATE batch_items SET status = COALESCE({finished}, 'failed'), finished_at = ?,"
            " body = NULL,"
            f" error = CASE WHEN {finished} IS NULL THEN ? ELSE NULL END"
            " WHERE batch_id = ? AND idx = ?",
            (at, _lost(was or "unknown"), batch_id, index),
        )
    return int(n[0][0]) + int(m[0][0]) + len(lost)


def claim_batch_items(
    node: str, limit: int, expires_at: datetime, now: datetime, principal_limit: int | None
) -> Op[BatchClaim]:
    """Up to ``limit`` runnable items, claimed for ``node`` until ``expires_at``: see the
    module for the steps."""
    yield from sweep(now)
    claimed: list[StoredBatchItem] = []
    if limit > 0:
        # The open batches by a loose index scan (one index probe per open batch, not a
        # read of every waiting item), each with its waiting items counted up to
        # ``limit``: no claim takes more.
        # The first open batch id after ``o.id``: SQLite takes MIN through the named
        # index; PostgreSQL needs the ORDER BY ... LIMIT 1 form to walk its index.
        first = (
            "SELECT MIN(batch_id) FROM {w} WHERE " + _RUNNABLE,
            "(SELECT batch_id FROM {w} WHERE " + _RUNNABLE + " ORDER BY batch_id LIMIT 1)",
        )
        after = (
            "SELECT MIN(batch_id) FROM {w} WHERE " + _RUNNABLE + " AND batch_id > o.id",
            "SELECT batch_id FROM {w} WHERE " + _RUNNABLE +
            " AND batch_id > o.id ORDER BY batch_id LIMIT 1",
        )  # fmt: skip
        open_sql = [
            f"WITH RECURSIVE o(id) AS ({first[d]} UNION ALL SELECT ({after[d]}) FROM o"
            " WHERE o.id IS NOT NULL)"
            " SELECT b.id, b.owner, b.concurrency, (SELECT COUNT(*) FROM (SELECT 1 FROM {w}"
            " WHERE batch_id = b.id AND " + _RUNNABLE + " LIMIT ?) AS y)"
            " FROM o JOIN batches b ON b.id = o.id WHERE b.cancelled_at IS NULL"
            " ORDER BY b.created_at, b.id"
            for d in (0, 1)
        ]
        rows = yield Query(
            open_sql[0].format(w=_WAITING),
            (limit,),
            postgres=open_sql[1].format(w="batch_items"),
        )
        counts = yield Query(
            "SELECT batch_id, owner, node, COUNT(*) FROM batch_items WHERE status = 'running'"
            " GROUP BY batch_id, owner, node"
        )
        per_batch: dict[str, int] = {}
        running: dict[str, int] = {}
        here: dict[str, int] = {}
        for batch_id, owner, on, count in counts:
            running[owner] = running.get(owner, 0) + count
            if on == node:
                per_batch[batch_id] = per_batch.get(batch_id, 0) + count
                here[owner] = here.get(owner, 0) + count
        batches = [
            OpenBatch(id=r[0], owner=r[1], concurrency=r[2], waiting=r[3],
                      running=per_batch.get(r[0], 0))
            for r in rows
        ]  # fmt: skip
        plan = plan_claims(batches, running, here, limit, principal_limit)
        pick = _waiting(
            "SELECT idx FROM {w} WHERE batch_id = ? AND " + _RUNNABLE + " ORDER BY idx LIMIT ?"
        )
        for batch_id, n in plan.items():
            # Picked first, then taken: as a subquery of the UPDATE, PostgreSQL may run a
            # SKIP LOCKED pick more than once and take more than ``n`` rows.
            assert pick.postgres is not None
            picked = yield pick._replace(
                params=(batch_id, n), postgres=pick.postgres + " FOR UPDATE SKIP LOCKED"
            )
            if not picked:
                continue
            got = yield Query(
                "UPDATE batch_items SET status = 'running', node = ?, lease_expires_at = ?,"
                f" started_at = ? WHERE batch_id = ? AND idx IN ({','.join('?' * len(picked))})"
                " RETURNING batch_id, idx, owner, idempotency_key, queued_at, started_at, body",
                (node, expires_at.isoformat(), now.isoformat(), batch_id,
                 *(r[0] for r in picked)),
            )  # fmt: skip
            claimed += sorted(
                (
                    StoredBatchItem(
                        batch_id=r[0], index=r[1], owner=r[2], idempotency_key=r[3],
                        status=ExecutionStatus.RUNNING, queued_at=datetime.fromisoformat(r[4]),
                        started_at=datetime.fromisoformat(r[5]), node=node, body=r[6],
                    )
                    for r in got
                ),
                key=lambda i: i.index,
            )  # fmt: skip
    left = yield from count_waiting()
    return BatchClaim(items=claimed, waiting=left)


def renew_batch_items(node: str, expires_at: datetime) -> Op[list[HeldItem]]:
    """Extend ``node``'s claims; returns the items it still holds (one it runs but does
    not hold lapsed and was settled elsewhere: it stops it)."""
    yield Query(
        "UPDATE batch_items SET lease_expires_at = ? WHERE node = ? AND status = 'running'",
        (expires_at.isoformat(), node),
    )
    rows = yield Query(
        "SELECT i.batch_id, i.idx, b.cancelled_at FROM batch_items i"
        " JOIN batches b ON b.id = i.batch_id WHERE i.node = ? AND i.status = 'running'",
        (node,),
    )
    return [HeldItem(batch_id=r[0], index=r[1], cancelled=r[2] is not None) for r in rows]


def release_batch_items(node: str, now: datetime) -> Op[int]:
    """Every claim of ``node`` lapses now (it is starting, or stopping): see :func:`sweep`."""
    return (yield from sweep(now, node))


def cancel_queued_batch_items(batch_id: str, now: datetime) -> Op[int]:
    """Mark the batch cancelled and its waiting items too (their keys freed); returns how
    many. On PostgreSQL the batch row's lock waits for a claim in progress."""
    yield Query(
        "UPDATE batches SET cancelled_at = COALESCE(cancelled_at, ?) WHERE id = ?",
        (now.isoformat(), batch_id),
    )
    n = yield Query(
        "UPDATE batch_items SET status = 'cancelled', finished_at = ?, idempotency_key = NULL,"
        " body = NULL, error = 'the batch was cancelled before this item started'"
        " WHERE batch_id = ? AND status = 'queued' AND dup_batch_id IS NULL",
        (now.isoformat(), batch_id),
        rowcount=True,
    )
    return int(n[0][0])


def count_waiting() -> Op[int]:
    rows = yield _waiting("SELECT COUNT(*) FROM {w} WHERE " + _RUNNABLE)
    return int(rows[0][0])
