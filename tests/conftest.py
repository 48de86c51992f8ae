"""The one test support package, `tests/support/`, loaded as pytest plugins.

Fixtures every tier shares are registered here (a conftest.py further down only defines what
is its folder's own); helpers are imported as `tests.support.<module>`.

- `tests.support.fixtures`: `server_factory`, `sandbox_server` (a real server subprocess) and
  `agent_factory` (real host-side agent-client processes).
- `tests.support.inproc_server`: `running`, the foundation server in this process.
"""

pytest_plugins = ["tests.support.fixtures", "tests.support.inproc_server"]
