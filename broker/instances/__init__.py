"""The fleet inside the server: instances, snapshots, hosts, images, loadouts, provisioning."""

from broker.instances.component import FLEET_KEY, FleetComponent

__all__ = ["FLEET_KEY", "FleetComponent"]
