"""Egress by policy: the proxy that is a sandbox's only way out.

policy.py    pure: names, ports, addresses, the gate's answers, the byte meter
dns.py       the proxy's own resolver (pinned upstreams, DNS, private answers refused)
tls.py       the ClientHello's SNI (pure); the operator CA for credential injection
proxy.py     the asyncio proxy on one Unix socket per session
sessions.py  the gateway's side: a session's policy, its human gate, its audit
"""
