"""Ports: TCP connections to ports in an instance over its agent link (streams of kind `port`):
an authenticated reverse proxy (HTTP and WebSocket upgrades) and a raw TCP tunnel (WebSocket)
for `sandboxctl instance port-forward`.

Public face: `PortsComponent` (wired in `broker/components.py`).
"""

from agentic_sandbox.broker.ports.component import PortsComponent

__all__ = ["PortsComponent"]
