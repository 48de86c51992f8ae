"""`AsyncClient`: the admin API of one server, by resource.

    async with AsyncClient() as sbx:                 # the local server, its admin token
        op = await sbx.instances.create("dev-1", loadout="minimal")
        inst = await sbx.instances.wait_ready(op)

The URL and token come from the arguments, else as `sandboxctl` finds them (see
`agentic_sandbox.sdk.contexts`). Every call raises an `ApiError` subclass when the server
refuses it (`NotFound`, `Conflict`, `ValidationFailed`, …; see `agentic_sandbox.sdk.errors`).
"""

from __future__ import annotations

from agentic_sandbox.sdk.access import AsyncApiKeys, AsyncSecrets, AsyncTokens
from agentic_sandbox.sdk.agentcards import AsyncAgentCards
from agentic_sandbox.sdk.contexts import Credentials
from agentic_sandbox.sdk.fleet import (
    AsyncAgents,
    AsyncHosts,
    AsyncImages,
    AsyncInstances,
    AsyncLoadouts,
    AsyncPools,
    AsyncSnapshots,
)
from agentic_sandbox.sdk.models import WhoAmI
from agentic_sandbox.sdk.observe import AsyncAudit, AsyncEvents
from agentic_sandbox.sdk.operations import AsyncOperations
from agentic_sandbox.sdk.sessions import AsyncSessions
from agentic_sandbox.sdk.tasks import AsyncTasks
from agentic_sandbox.sdk.transport import Transport


class AsyncClient:
    def __init__(
        self,
        url: str | None = None,
        token: str | None = None,
        *,
        context: str | None = None,
        timeout: float = 60.0,
        credentials: Credentials | None = None,
    ) -> None:
        """`url` and `token` (else the context's, the environment's, the local admin
        token); `timeout` is the most seconds one read of an answer may wait."""
        self.credentials = credentials or Credentials.resolve(url, token, context)
        t = self._transport = Transport(
            self.credentials.url, self.credentials.token, timeout=timeout
        )
        self.operations = AsyncOperations(t)
        self.instances = AsyncInstances(t, self.operations)
        self.snapshots = AsyncSnapshots(t)
        self.pools = AsyncPools(t)
        self.images = AsyncImages(t)
        self.hosts = AsyncHosts(t)
        self.loadouts = AsyncLoadouts(t)
        self.agents = AsyncAgents(t)
        self.sessions = AsyncSessions(t)
        self.tasks = AsyncTasks(t)
        self.events = AsyncEvents(t)
        self.audit = AsyncAudit(t)
        self.tokens = AsyncTokens(t)
        self.api_keys = AsyncApiKeys(t)
        self.secrets = AsyncSecrets(t)
        self.agentcards = AsyncAgentCards(t)

    @property
    def url(self) -> str:
        return self.credentials.url

    async def whoami(self) -> WhoAmI:
        """Who this client's token is: subject, role, kind."""
        return await self.tokens.whoami()

    async def close(self) -> None:
        await self._transport.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
