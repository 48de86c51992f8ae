"""Exec: non-interactive commands on an instance over its agent link, with budgets.

Public face: `ExecComponent` (wired in `broker/components.py`).
"""

from agentic_sandbox.broker.exec.component import ExecComponent

__all__ = ["ExecComponent"]
