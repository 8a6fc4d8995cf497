"""Persistence: sessions, executions, events, tokens and the audit log."""
