"""`GET/PUT /api/v2/admin/instances/{id}/egress`: an instance's egress policy and allowlist.

Viewers read (instances they may see); operators replace (the instance's owner or an admin).
A replacement is audited (`egress.rules`, with the old and new rules), published as
`egress.rules.changed`, and applies to the instance's next proxied connection; connections
already open keep running. `nat` is a property of the VM's network (it cannot change while it
runs); `isolated` and `allowlist` differ only in whether the proxy serves, so a PUT may move
between those two.

Brokered credentials (`credentials`: a secret of the instance's owner, its destinations, the
header and the value's format) are read and replaced with the rest; an answer names the
secret, never its value (the proxy reads the value from the vault per connection). A PUT
without `credentials` keeps the instance's (so a caller that knows only `allow` and `limits`
changes nothing else); `[]` removes them. A secret that does not exist is refused (422 naming
`body.credentials.N.secret`).
"""

from __future__ import annotations

from typing import Literal

from aiohttp import web
from pydantic import Field

from agentic_sandbox.broker.auth.principal import Role
from agentic_sandbox.broker.egress.service import EgressService, config_of
from agentic_sandbox.broker.http.problems import ProblemError
from agentic_sandbox.broker.http.routing import ApiRoutes, Call, NoBody, NoQuery
from agentic_sandbox.broker.http.schemas import Input, Output
from agentic_sandbox.broker.instances import InstanceView, instance_to_change, instance_to_see
from agentic_sandbox.broker.services import services
from agentic_sandbox.broker.store import models as m
from agentic_sandbox.provision.egress_rules import (
    MAX_CREDENTIALS,
    MAX_RULES,
    BrokeredCredential,
    EgressConfig,
    EgressLimits,
    Rule,
    RuleInput,
)

api = ApiRoutes()
EGRESS_KEY: web.AppKey[EgressService] = web.AppKey("egress_service")
PATH = "/api/v2/admin/instances/{instance_id}/egress"


class EgressOut(Output):
    instance_id: str
    incarnation: str
    network: str = Field(description="isolated, allowlist or nat")
    allow: list[Rule]
    limits: EgressLimits
    credentials: list[BrokeredCredential] = Field(
        default_factory=list,
        description="brokered credentials (secret names, never values)",
    )


class EgressIn(Input):
    network: Literal["isolated", "allowlist"] | None = Field(
        default=None, description="unset: unchanged (nat cannot be changed while it runs)"
    )
    allow: list[RuleInput] = Field(
        max_length=MAX_RULES,
        description="rules as `HOST:PORT[:METHODS]` text or {host, port, methods}",
    )
    limits: EgressLimits | None = Field(default=None, description="unset: unchanged")
    credentials: list[BrokeredCredential] | None = Field(
        default=None,
        max_length=MAX_CREDENTIALS,
        description="brokered credentials: a secret of the instance's owner for the named "
        "destinations (`HOST:PORT`), its header and format; unset: unchanged, [] none",
    )


def _out(row: InstanceView, network: str, config: EgressConfig) -> EgressOut:
    return EgressOut(
        instance_id=row.id,
        incarnation=row.incarnation,
        network=network,
        allow=list(config.allow),
        limits=config.limits,
        credentials=list(config.credentials),
    )


def _credentials_detail(config: EgressConfig) -> list[dict[str, object]]:
    return [
        {"secret": c.secret, "destinations": list(c.destinations), "header": c.header}
        for c in config.credentials
    ]


@api.get(
    PATH,
    response=EgressOut,
    role=Role.viewer,
    summary="The instance's egress policy, allowlist and limits",
    tag="egress",
)
async def get_egress(call: Call[NoBody, NoQuery]) -> EgressOut:
    who = call.require_principal()
    row = await instance_to_see(services(call.request).db, who, call.match["instance_id"])
    return _out(row, row.network_policy, config_of(row.spec))


@api.put(
    PATH,
    body=EgressIn,
    response=EgressOut,
    role=Role.operator,
    summary="Replace the instance's egress allowlist (effective for its next connection)",
    tag="egress",
    responses={409: "the instance's network is nat (fixed while it runs)"},
)
async def put_egress(call: Call[EgressIn, NoQuery]) -> EgressOut:
    who = call.require_principal()
    svc = services(call.request)
    row = await instance_to_change(svc.db, who, call.match["instance_id"])
    async with svc.db.session() as s:
        live = await s.get(m.Instance, row.id, with_for_update=True)
        if live is None or live.deleted_at is not None or live.incarnation != row.incarnation:
            raise ProblemError(404, f"no instance {row.id!r}", code="not-found")
        if live.network_policy == "nat":
            raise ProblemError(
                409,
                f"instance {row.id!r} has network nat, which cannot change while it exists",
                code="network-fixed",
            )
        old = config_of(live.spec)
        creds = old.credentials if call.body.credentials is None else call.body.credentials
        for i, cred in enumerate(creds if call.body.credentials is not None else ()):
            if not await svc.vault.exists(live.owner, cred.secret):
                raise ProblemError(
                    422,
                    f"body.credentials.{i}.secret: the instance's owner has no secret "
                    f"{cred.secret!r}",
                    errors=[
                        {
                            "field": f"body.credentials.{i}.secret",
                            "message": "no such secret of the instance's owner",
                            "type": "not-found",
                        }
                    ],
                )
        try:
            new = EgressConfig(
                allow=tuple(call.body.allow),
                limits=call.body.limits or old.limits,
                credentials=tuple(creds),
            )
        except ValueError as exc:  # pydantic's ValidationError is one
            errors = getattr(exc, "errors", None)
            why = str(errors()[0].get("msg", exc)) if callable(errors) else str(exc)
            why = why.removeprefix("Value error, ")
            raise ProblemError(
                422,
                f"body.credentials: {why}",
                errors=[{"field": "body.credentials", "message": why, "type": "value_error"}],
            ) from None
        network = call.body.network or live.network_policy
        before = live.network_policy
        live.spec = {**(live.spec or {}), "egress": new.model_dump(mode="json")}
        live.network_policy = network
        s.info["wrote"] = True
    call.app[EGRESS_KEY].replace(row.id, row.incarnation, network, new)
    detail = {
        "incarnation": row.incarnation,
        "network": network,
        "network_before": before,
        "allow": [r.text for r in new.allow],
        "allow_before": [r.text for r in old.allow],
        "limits": new.limits.model_dump(mode="json"),
        "credentials": _credentials_detail(new),
        "credentials_before": _credentials_detail(old),
    }
    svc.audit.record(
        who.actor,
        "egress.rules",
        "instance",
        row.id,
        cause=f"{len(new.allow)} rules, network {network}",
        detail=detail,
    )
    svc.events.publish(
        "egress.rules.changed",
        actor=who.actor,
        instance_id=row.id,
        owner=row.owner,
        data=detail,
    )
    return _out(row, network, new)
