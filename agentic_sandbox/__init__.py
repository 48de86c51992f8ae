"""agentic-sandbox: a libvirt/QEMU VM fleet controller with a PTY session broker.

Every import name of the project lives under this one package (`agentic_sandbox.broker`,
`.fleet`, `.images`, `.provision`, `.agent`, `.sandboxctl`, `.proto`): generic top-level names
such as `agent`, `broker`, `fleet`, `provision` or `proto` are installed by other distributions
on PyPI (`proto` by proto-plus, which a2a-sdk pulls in), and one of them shadowing ours breaks
the server or the guest's agent. Keep this module free of imports: the guest's agent imports
`agentic_sandbox.agent` with nothing but its own runtime installed.
"""
