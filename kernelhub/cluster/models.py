"""What crosses the cluster's seams: a node agent's heartbeat row in the shared store."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, Field


class NodeInfo(BaseModel):
    """One node agent as the shared store knows it; written by its heartbeat, read by
    every gateway replica to place and route sessions, and by the node-loss sweep."""

    id: str = Field(description="the node's name (KERNELHUB_STORE__NODE)")
    address: str = Field(description="where gateways reach its agent, e.g. https://10.0.0.5:8766")
    started_at: datetime
    heartbeat_at: datetime
    lease_expires_at: datetime = Field(description="the node counts as lost after this")
    draining: bool = Field(False, description="takes no new sessions; its sessions move away")
    sessions: int = Field(0, ge=0, description="live sessions it runs")
    memory_total_bytes: int = Field(0, ge=0)
    memory_free_bytes: int = Field(0, ge=0, description="what it can still give sandboxes")
    cpu_load: float = Field(0.0, ge=0, description="1-minute load average per core")
    version: str = ""

    def alive(self, now: datetime) -> bool:
        return self.lease_expires_at > now
