"""Many machines, one API (issue #24): node agents own their machine's sandboxes, stateless
gateway replicas place and route sessions to them, all sharing one store."""
