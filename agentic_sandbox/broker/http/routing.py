"""Declarative API routes: one decorator names the method, path, models and required role.

The same declarations drive request parsing (pydantic, 422 naming the field), authorization
(minimum role), the response encoding and the OpenAPI document, so the three never drift.

    api = ApiRoutes()

    @api.post("/api/v2/admin/tokens", body=TokenCreate, response=TokenCreated, status=201,
              role=Role.admin, summary="Create an operator token", tag="tokens")
    async def create_token(call: Call[TokenCreate, NoQuery]) -> TokenCreated: ...
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Generic, Required, TypedDict, TypeVar, Unpack

from aiohttp import web
from pydantic import BaseModel, ConfigDict, JsonValue, ValidationError

from agentic_sandbox.broker.auth.principal import Principal, Role
from agentic_sandbox.broker.http.body import BodyError, read_json_body
from agentic_sandbox.broker.http.problems import ProblemError, validation_problem
from agentic_sandbox.broker.services import services

B = TypeVar("B", bound=BaseModel)
Q = TypeVar("Q", bound=BaseModel)

PRINCIPAL_KEY = web.RequestKey("principal", Principal)
DENIED_REASON = web.RequestKey("denied_reason", str)
AUTH_ERROR = web.RequestKey("auth_error", str)
CSRF_TOKEN = web.RequestKey("csrf_token", str)
JSON_TYPES = ("application/json", "application/a2a+json", "application/merge-patch+json")


class NoBody(BaseModel):
    model_config = ConfigDict(extra="forbid")


class NoQuery(BaseModel):
    model_config = ConfigDict(extra="forbid")


@dataclass
class Call(Generic[B, Q]):
    """What a handler receives: the request, its parsed body/query, path params and caller."""

    request: web.Request
    body: B
    query: Q
    principal: Principal | None
    status: int | None = None  # a handler may override the declared status (e.g. 201 vs 200)

    @property
    def match(self) -> dict[str, str]:
        return dict(self.request.match_info)

    @property
    def app(self) -> web.Application:
        return self.request.app

    def require_principal(self) -> Principal:
        if self.principal is None:
            raise ProblemError(401, "a valid token is required")
        return self.principal


Handler = Callable[[Call[Any, Any]], Awaitable[BaseModel | web.StreamResponse | None]]


@dataclass
class RouteSpec:
    method: str
    path: str
    handler: Handler
    body: type[BaseModel] | None
    query: type[BaseModel] | None
    response: type[BaseModel] | None
    status: int
    role: Role | None  # None: anonymous allowed
    summary: str
    tag: str
    responses: dict[int, str] = field(default_factory=dict)
    content_type: str | None = None  # for non-JSON responses (text/plain, SSE, …)
    websocket: bool = False
    name: str = ""
    description: str = ""
    deprecated: bool = False
    follower: bool = False  # a follower node serves it itself (a read of the shared database)


def current_principal(request: web.Request) -> Principal | None:
    return request.get(PRINCIPAL_KEY)


async def read_json(request: web.Request) -> JsonValue:
    """Read and parse the body as JSON (see `http/body.py`): 400/408/413/415 naming what is
    wrong."""
    ctype = request.content_type
    if ctype not in JSON_TYPES:
        raise ProblemError(
            415,
            f"Content-Type must be application/json (got {ctype or 'none'})",
            code="unsupported-media-type",
        )
    timeout = services(request).settings.http_body_timeout_seconds
    try:
        present, doc = await read_json_body(request, timeout)
    except BodyError as exc:
        unfinished = exc.status != 400  # the rest of the body was never read
        raise ProblemError(exc.status, exc.message, code=exc.code, close=unfinished) from None
    if not present:
        raise ProblemError(400, "request body is empty; a JSON object is expected", code="bad-json")
    return doc


def parse_query(model: type[Q], request: web.Request) -> Q:
    values: dict[str, Any] = {}
    for key in request.query:
        items = request.query.getall(key)
        values[key] = items if len(items) > 1 else items[0]
    try:
        return model.model_validate(values)
    except ValidationError as exc:
        raise validation_problem(exc, "query") from None


class RouteOptions(TypedDict, total=False):
    """What `ApiRoutes.get/post/…` take besides the path (see `ApiRoutes.route`)."""

    body: type[BaseModel] | None
    query: type[BaseModel] | None
    response: type[BaseModel] | None
    status: int
    role: Role | None
    summary: Required[str]
    tag: Required[str]
    responses: dict[int, str] | None
    content_type: str | None
    websocket: bool
    description: str
    deprecated: bool
    follower: bool


class ApiRoutes:
    """A collection of declared routes, added to an aiohttp app with `install(app)`."""

    def __init__(self) -> None:
        self.specs: list[RouteSpec] = []

    def route(
        self,
        method: str,
        path: str,
        *,
        body: type[BaseModel] | None = None,
        query: type[BaseModel] | None = None,
        response: type[BaseModel] | None = None,
        status: int = 200,
        role: Role | None = Role.viewer,
        summary: str,
        tag: str,
        responses: dict[int, str] | None = None,
        content_type: str | None = None,
        websocket: bool = False,
        description: str = "",
        deprecated: bool = False,
        follower: bool = False,
    ) -> Callable[[Handler], Handler]:
        def register(fn: Handler) -> Handler:
            self.specs.append(
                RouteSpec(
                    method=method.upper(),
                    path=path,
                    handler=fn,
                    body=body,
                    query=query,
                    response=response,
                    status=status,
                    role=role,
                    summary=summary,
                    tag=tag,
                    responses=responses or {},
                    content_type=content_type,
                    websocket=websocket,
                    name=fn.__name__,
                    description=description or (fn.__doc__ or "").strip(),
                    deprecated=deprecated,
                    follower=follower,
                )
            )
            return fn

        return register

    def get(self, path: str, **kw: Unpack[RouteOptions]) -> Callable[[Handler], Handler]:
        return self.route("GET", path, **kw)

    def post(self, path: str, **kw: Unpack[RouteOptions]) -> Callable[[Handler], Handler]:
        return self.route("POST", path, **kw)

    def put(self, path: str, **kw: Unpack[RouteOptions]) -> Callable[[Handler], Handler]:
        return self.route("PUT", path, **kw)

    def patch(self, path: str, **kw: Unpack[RouteOptions]) -> Callable[[Handler], Handler]:
        return self.route("PATCH", path, **kw)

    def delete(self, path: str, **kw: Unpack[RouteOptions]) -> Callable[[Handler], Handler]:
        return self.route("DELETE", path, **kw)

    def install(self, app: web.Application) -> None:
        if FOLLOWER_ROUTES not in app:
            app[FOLLOWER_ROUTES] = set()
        for spec in self.specs:
            app.router.add_route(spec.method, spec.path, _wrap(spec), name=_route_name(spec))
            if spec.follower:
                app[FOLLOWER_ROUTES].add(_route_name(spec))
        if ROUTE_SPECS not in app:
            app[ROUTE_SPECS] = []
        app[ROUTE_SPECS].extend(self.specs)


ROUTE_SPECS = web.AppKey("api_route_specs", list[RouteSpec])
#: names of the routes a follower node serves (`follower=True`); the rest go to the leader
FOLLOWER_ROUTES = web.AppKey("follower_routes", set[str])


def _route_name(spec: RouteSpec) -> str:
    return f"{spec.tag}.{spec.name}.{spec.method.lower()}"


def route_specs(app: web.Application) -> list[RouteSpec]:
    return app.get(ROUTE_SPECS, [])


def _wrap(spec: RouteSpec) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    async def handle(request: web.Request) -> web.StreamResponse:
        principal = current_principal(request)
        if spec.role is not None:
            if principal is None:
                raise ProblemError(
                    401,
                    "a valid token is required (Authorization: Bearer <token>)",
                    headers={"WWW-Authenticate": 'Bearer realm="agentic-sandbox"'},
                )
            # (A2A API keys never get this far: the auth middleware refuses them outside
            # /agents/, on every route.)
            if not principal.role.allows(spec.role):
                request[DENIED_REASON] = f"role {principal.role} below {spec.role}"
                raise ProblemError(
                    403,
                    f"this needs the {spec.role.value} role; your token has {principal.role.value}",
                    code="forbidden-role",
                )
        query = parse_query(spec.query, request) if spec.query else NoQuery()
        if spec.body is not None:
            raw = await read_json(request)
            try:
                body: BaseModel = spec.body.model_validate(raw)
            except ValidationError as exc:
                raise validation_problem(exc, "body") from None
        else:
            body = NoBody()
        call: Call[Any, Any] = Call(request, body, query, principal)
        result = await spec.handler(call)
        if isinstance(result, web.StreamResponse):
            return result
        status = call.status or spec.status
        if result is None:
            return web.Response(status=204 if status in (200, 204) else status)
        return web.Response(
            status=status,
            text=result.model_dump_json(by_alias=True, exclude_none=False),
            content_type="application/json",
        )

    handle.__name__ = spec.name
    return handle
