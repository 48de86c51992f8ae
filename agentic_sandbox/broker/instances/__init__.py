"""The fleet inside the server: instances, snapshots, hosts, images, loadouts, pools,
provisioning. Others use the component; its services are reached through `keys.py`.

Public face: `FleetComponent`; for the components that act on an instance over its agent
link (exec, files, ports, egress): `instance_to_change` (the instance if the caller may change
it, else the 404/403 problem), `instance_to_see` (the instance if the caller may see it, else
the 404), both an `InstanceView` (read-only, served from memory while nothing wrote it), and
`LOADOUTS` (the app key of the loadout catalog, absent without a fleet); `OperationOut` (the
answer of a route that starts an operation on the fleet's runner).
"""

from agentic_sandbox.broker.instances.access import InstanceView
from agentic_sandbox.broker.instances.api.models import OperationOut
from agentic_sandbox.broker.instances.api.problems import instance_to_change, instance_to_see
from agentic_sandbox.broker.instances.component import FleetComponent
from agentic_sandbox.broker.instances.keys import LOADOUTS

__all__ = [
    "LOADOUTS",
    "FleetComponent",
    "InstanceView",
    "OperationOut",
    "instance_to_change",
    "instance_to_see",
]
