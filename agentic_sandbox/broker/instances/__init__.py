"""The fleet inside the server: instances, snapshots, hosts, images, loadouts, provisioning."""

from agentic_sandbox.broker.instances.component import FLEET_KEY, FleetComponent

__all__ = ["FLEET_KEY", "FleetComponent"]
