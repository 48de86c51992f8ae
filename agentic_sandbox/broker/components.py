"""The list of server components beyond the foundation, in start order.

Each layer (agent link, session hub, fleet, provisioning, A2A) adds itself here; tests can pass
their own factory to `Server` instead.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from agentic_sandbox.broker.app import Component
    from agentic_sandbox.broker.services import Services


def build_components(svc: Services) -> list[Component]:
    from agentic_sandbox.broker.a2a import A2AComponent
    from agentic_sandbox.broker.agentlink import AgentLinkComponent
    from agentic_sandbox.broker.egress import EgressComponent
    from agentic_sandbox.broker.exec import ExecComponent
    from agentic_sandbox.broker.files import FilesComponent
    from agentic_sandbox.broker.instances import FleetComponent
    from agentic_sandbox.broker.instances.enroller import LinkEnroller
    from agentic_sandbox.broker.ports import PortsComponent
    from agentic_sandbox.broker.sessions.component import SessionsComponent
    from agentic_sandbox.broker.tasks import TasksComponent
    from agentic_sandbox.broker.upgrades import UpgradesComponent

    # The hub starts first (it loads unfinished sessions) and stops last; the agent link
    # hands every agent message to it.
    sessions = SessionsComponent(svc)
    agent_link = AgentLinkComponent(svc, handler=sessions.hub)
    sessions.hub.use_registry(agent_link.registry)
    # Tasks and A2A: after the hub, so recovery can follow runs; they see it as its contract.
    tasks = TasksComponent(svc, sessions=sessions.hub)
    # The fleet last: provisioning waits for agents through the agent link.
    fleet = FleetComponent(svc, enroller_factory=lambda: LinkEnroller(agent_link, svc.settings))
    execs = ExecComponent(svc, agent_link.registry)
    files = FilesComponent(svc, agent_link.registry)
    tasks.service.use_files(files.task_files)  # A2A file parts in, outbox files out
    ports = PortsComponent(svc, agent_link.registry)
    # egress streams from agents: bound to each link as it attaches
    egress = EgressComponent(svc, agent_link.registry)
    tasks.service.use_egress_bytes(egress.service.run_bytes)  # a run's network_egress_bytes
    execs.service.use_egress(egress.service)  # an exec's network_egress_bytes
    # agent bundles and rollouts: operations on the fleet's runner
    upgrades = UpgradesComponent(svc, agent_link.registry, fleet.ops)
    return [
        sessions,
        agent_link,
        execs,
        files,
        ports,
        egress,
        tasks,
        A2AComponent(svc, tasks.service),
        fleet,
        upgrades,
    ]
