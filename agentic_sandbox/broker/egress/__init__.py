"""The egress proxy: what `allowlist` guests reach, through their agent link, and nothing else.

Public face: `EgressComponent` (wired in `broker/components.py`: it registers the `egress`
stream acceptor on the agent registry and the `/api/v2/admin/instances/{id}/egress` routes).
Parts: `addresses.py` (refused address classes), `resolver.py` (host resolver, hosts-file
option), `policy.py` (the decision), `limits.py`, `proxy.py` (one connection, h11),
`service.py` (policies, limits, audit, events, metrics), `routes.py`.
"""

from agentic_sandbox.broker.egress.component import EgressComponent

__all__ = ["EgressComponent"]
