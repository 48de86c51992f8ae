"""The A2A 1.0 surface: one signed AgentCard and agent per instance under
`/agents/{instance_id}`, JSON-RPC and HTTP+JSON bindings over one request handler.

Public face: `A2AComponent` (the server part). Tasks themselves live in `broker.tasks`.
"""

from agentic_sandbox.broker.a2a.component import A2AComponent

__all__ = ["A2AComponent"]
