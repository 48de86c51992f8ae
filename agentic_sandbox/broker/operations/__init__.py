"""Long-running operations (provisioning, image builds) with stages and progress."""

from agentic_sandbox.broker.operations.runner import OperationFailed, OperationRunner, Progress

__all__ = ["OperationFailed", "OperationRunner", "Progress"]
