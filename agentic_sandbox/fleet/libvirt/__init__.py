"""The libvirt driver: a host is a `LibvirtHost` (any libvirt URI, the test driver included).

Everything that knows libvirt lives here: the connection and its events (`host.py`,
`events.py`, `loop.py`), domains (`domain.py`), domain XML (`domain_xml.py`), storage pools
and files (`storage.py`, `volumes.py`), save-image headers (`save_images.py`). The rest of the
fleet speaks the driver protocol (`fleet/driver.py`).
"""

from .domain_xml import METADATA_NS, preview_domain_xml
from .host import LibvirtHost
from .loop import LoopBridge

__all__ = ["METADATA_NS", "LibvirtHost", "LoopBridge", "preview_domain_xml"]
