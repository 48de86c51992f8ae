"""The fleet inside the server: instances, snapshots, hosts, images, loadouts, pools,
provisioning. Others use the component; its services are reached through `keys.py`."""

from agentic_sandbox.broker.instances.component import FleetComponent

__all__ = ["FleetComponent"]
