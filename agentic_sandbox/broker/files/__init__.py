"""Files: upload, download, list, stat, mkdir and remove on an instance over its agent link.

Public face: `FilesComponent` (wired in `broker/components.py`).
"""

from agentic_sandbox.broker.files.component import FilesComponent

__all__ = ["FilesComponent"]
