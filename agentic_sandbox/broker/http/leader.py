"""Followers send writes to the leader: `307` with its URL; no leader yet: `503`.

A follower (several control hosts on one PostgreSQL, `broker/cluster/`) serves itself only
the routes declared `follower=True` (reads of the shared database, health); every other
request — whatever its method — is answered `307 Temporary Redirect` to the same path and
query on the leader (a 307 keeps the method and body), with the header
`Sandbox-Leader: <node> <url>` and a problem document of type `not-leader` naming
`leader_url`. A follower never forwards: a forwarded write whose connection breaks after the
leader committed could be applied twice. While nobody leads — or this node is still taking
over — the answer is `503` with `Retry-After: 1`. Unknown paths answer 404 as usual.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

from agentic_sandbox.broker.cluster import Role
from agentic_sandbox.broker.http.problems import ProblemError
from agentic_sandbox.broker.http.routing import FOLLOWER_ROUTES
from agentic_sandbox.broker.services import services

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
LEADER_HEADER = "Sandbox-Leader"


@web.middleware
async def leader_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    svc = services(request)
    cluster = svc.cluster
    if svc.leading or cluster is None:
        return await handler(request)
    info = request.match_info
    if info.http_exception is not None:  # no such route: 404/405 here as anywhere
        return await handler(request)
    if info.route.name in request.app.get(FOLLOWER_ROUTES, set()):
        return await handler(request)
    leader = cluster.leader
    if cluster.role is not Role.follower or leader is None or leader.node == cluster.me.node:
        raise ProblemError(
            503,
            "no node leads right now (an election is under way); retry in a moment",
            code="no-leader",
            headers={"Retry-After": "1"},
        )
    location = leader.url + request.path_qs
    raise ProblemError(
        307,
        f"this node ({cluster.me.node}) is a follower; node {leader.node} leads: "
        f"send this request to {leader.url}",
        code="not-leader",
        headers={"Location": location, LEADER_HEADER: f"{leader.node} {leader.url}"},
        extra={"leader_node": leader.node, "leader_url": leader.url},
    )
