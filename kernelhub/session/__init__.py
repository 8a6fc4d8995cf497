"""Sessions as the gateway sees them: ownership, quotas, persistence, fan-out, adoption."""
