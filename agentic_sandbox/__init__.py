"""agentic-sandbox: a libvirt/QEMU VM fleet controller with a PTY session broker.

Every import name of the project lives under this one package (`agentic_sandbox.broker`,
`.fleet`, `.images`, `.provision`, `.agent`, `.sandboxctl`, `.sdk`, `.proto`): generic
top-level names such as `agent`, `broker`, `fleet`, `provision` or `proto` are installed by
other distributions on PyPI (`proto` by proto-plus, which a2a-sdk pulls in), and one of them
shadowing ours breaks the server or the guest's agent. Keep this module free of imports: the
guest's agent imports `agentic_sandbox.agent` with nothing but its own runtime installed.

The SDK's face is here too, loaded on first use (PEP 562): `from agentic_sandbox import
Client` imports `agentic_sandbox.sdk` then, and only then (it needs the `sdk` extra).
"""

TYPE_CHECKING = False  # not `typing`'s: this module imports nothing at run time
if TYPE_CHECKING:
    from agentic_sandbox.sdk import AsyncClient, Client

_SDK_NAMES = frozenset({"AsyncClient", "Client"})
__all__ = ["AsyncClient", "Client"]


def __getattr__(name: str) -> object:
    if name in _SDK_NAMES:
        from agentic_sandbox import sdk

        return getattr(sdk, name)
    raise AttributeError(f"module 'agentic_sandbox' has no attribute {name!r}")
