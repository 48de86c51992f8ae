"""agent-client: the in-guest agent. Imports only `proto`, the standard library, grpcio,
protobuf and ptyprocess (an import-linter contract), so it installs into a guest alone.

Public face: `main` (the `agent-client` console script).
"""
