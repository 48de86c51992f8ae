"""Agent upgrades: agent bundles kept by the server, and rollouts of one to the fleet's agents
over their links, one instance at a time, each kept only when its new worker linked with every
session (see `agent/upgrade.py` for the agent's side).

Public face: `UpgradesComponent` (wired in `broker/components.py`).
"""

from agentic_sandbox.broker.upgrades.component import UpgradesComponent

__all__ = ["UpgradesComponent"]
