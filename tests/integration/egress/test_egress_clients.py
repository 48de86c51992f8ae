"""The egress allowlist through the SDK and sandboxctl, against a real server with a real host
agent (no proxied traffic here: test_egress_proxy.py does that): a get/set round trip in both
rule forms with the blocking twin agreeing, a bad rule refused naming its field, `sandboxctl
instance egress` showing and replacing, and a viewer who may read but not replace."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from agentic_sandbox import AsyncClient, Client
from agentic_sandbox.sdk import EgressRule, Forbidden, NotFound, ValidationFailed
from tests.support.agents import register_host_instance, start_agent
from tests.support.cli import Sandboxctl
from tests.support.fixtures import AgentFactory, unique_id
from tests.support.server import ServerProcess

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
async def sbx(sandbox_server: ServerProcess) -> AsyncIterator[AsyncClient]:
    async with AsyncClient(sandbox_server.url, sandbox_server.admin_token) as client:
        yield client


async def test_sdk_get_and_set_round_trip(
    sandbox_server: ServerProcess, sbx: AsyncClient, agent_factory: AgentFactory
) -> None:
    iid = agent_factory(sandbox_server).instance_id
    first = await sbx.instances.egress(iid)
    assert (first.instance_id, first.network, first.allow) == (iid, "isolated", [])
    assert first.incarnation and first.limits.max_connections > 0
    got = await sbx.instances.set_egress(
        iid,
        [
            "API.Example.com.:443",  # normalised: lower case, no trailing dot
            {"host": "*.pypi.org", "port": 443},
            EgressRule(host="deb.debian.org", port=80, methods=["get", "HEAD"]),
            "[fd00::2]:8080",
        ],
        network="allowlist",
        limits={"max_connections": 4, "bandwidth_bytes_per_second": 1_000_000},
    )
    texts = [
        "api.example.com:443",
        "*.pypi.org:443",
        "deb.debian.org:80:GET,HEAD",
        "[fd00::2]:8080",
    ]
    assert got.network == "allowlist" and [r.text for r in got.allow] == texts
    assert got.allow[2].methods == ["GET", "HEAD"] and got.allow[3].host == "fd00::2"
    assert (got.limits.max_connections, got.limits.bandwidth_bytes_per_second) == (4, 1_000_000)
    read = await sbx.instances.egress(iid)
    assert read.to_dict() == got.to_dict() and read.incarnation == first.incarnation
    # the rules read back are valid input again (what a caller editing them would send)
    again = await sbx.instances.set_egress(iid, read.allow)
    assert [r.text for r in again.allow] == texts and again.limits.max_connections == 4
    with Client(sandbox_server.url, sandbox_server.admin_token) as sync:
        assert sync.instances.egress(iid).to_dict() == again.to_dict()
        cleared = sync.instances.set_egress(iid, [], network="isolated")
    assert (cleared.network, cleared.allow) == ("isolated", [])
    assert cleared.limits.max_connections == 4  # unset limits are left as they were


async def test_a_bad_rule_is_refused_naming_the_field(
    sandbox_server: ServerProcess, sbx: AsyncClient, agent_factory: AgentFactory
) -> None:
    iid = agent_factory(sandbox_server).instance_id
    await sbx.instances.set_egress(iid, ["ok.example:443"], network="allowlist")
    with pytest.raises(ValidationFailed) as bad:
        await sbx.instances.set_egress(iid, ["ok.example:443", "*x.example:443"])
    assert set(bad.value.fields) == {"body.allow.1.host"}, bad.value.fields
    assert "wildcard" in bad.value.fields["body.allow.1.host"]
    with pytest.raises(ValidationFailed) as bad:
        await sbx.instances.set_egress(iid, ["no-port.example"])
    assert set(bad.value.fields) == {"body.allow.0"} and "HOST:PORT" in str(bad.value)
    with pytest.raises(ValidationFailed) as bad:
        await sbx.instances.set_egress(iid, [{"host": "a.example", "port": 70000}])
    assert set(bad.value.fields) == {"body.allow.0.port"}, bad.value.fields
    with pytest.raises(ValidationFailed) as bad:
        await sbx.instances.set_egress(iid, [], network="nat")  # type: ignore[arg-type]
    assert set(bad.value.fields) == {"body.network"}, bad.value.fields
    # nothing of the refused replacements was kept
    assert [r.text for r in (await sbx.instances.egress(iid)).allow] == ["ok.example:443"]
    with pytest.raises(NotFound):
        await sbx.instances.egress("no-such-instance")
    with pytest.raises(TypeError):
        await sbx.instances.set_egress(iid, "ok.example:443")


def test_cli_shows_and_replaces(
    sandbox_server: ServerProcess, agent_factory: AgentFactory, tmp_path: Path
) -> None:
    ctl = Sandboxctl(sandbox_server.url, sandbox_server.admin_token, tmp_path / "cli")
    iid = agent_factory(sandbox_server).instance_id
    res = ctl("instance", "egress", iid)
    assert res.returncode == 0, res.stderr
    assert "network" in res.stdout and "isolated" in res.stdout and "nothing" in res.stdout
    res = ctl(
        "instance",
        "egress",
        iid,
        "--allow",
        "api.example.com:443",
        "--allow",
        "deb.debian.org:80:GET,HEAD",
        "--network",
        "allowlist",
        "--max-connections",
        "3",
    )
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert any(line.split() == ["network", "allowlist"] for line in lines), res.stdout
    header = next(line for line in lines if "RULE" in line)
    assert header.split() == ["allow", "RULE", "HOST", "PORT", "METHODS"], res.stdout
    row = next(line for line in lines if "deb.debian.org:80:GET,HEAD" in line)
    assert row.split() == ["deb.debian.org:80:GET,HEAD", "deb.debian.org", "80", "GET,", "HEAD"]
    assert any(line.split() == ["limits", "max_connections", "3"] for line in lines), res.stdout
    shown = ctl.json("instance", "egress", iid)
    assert shown["network"] == "allowlist" and shown["limits"]["max_connections"] == 3
    assert [r["host"] for r in shown["allow"]] == ["api.example.com", "deb.debian.org"]
    # a bad rule: exit 6, the field and the --allow it came from named; nothing changed
    res = ctl("instance", "egress", iid, "--allow", "ok.example:443", "--allow", "*x.example:1")
    assert res.returncode == 6, (res.stdout, res.stderr)
    assert "--allow '*x.example:1' (body.allow.1.host): " in res.stderr, res.stderr
    assert "wildcard" in res.stderr and res.stderr.count("body.allow") == 1, res.stderr
    res = ctl("instance", "egress", iid, "--network", "isolated")  # no rules given
    assert res.returncode == 2 and "--allow" in res.stderr and "--clear" in res.stderr
    res = ctl("instance", "egress", iid, "--network", "nat", "--clear")
    assert res.returncode == 2 and "--network" in res.stderr  # argparse's choices
    assert ctl.json("instance", "egress", iid) == shown
    res = ctl("instance", "egress", iid, "--clear", "--network", "isolated", "-o", "json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert (out["network"], out["allow"], out["limits"]["max_connections"]) == ("isolated", [], 3)
    assert ctl("instance", "egress", "no-such-instance").returncode == 3


def test_a_viewer_may_read_but_not_replace(sandbox_server: ServerProcess, tmp_path: Path) -> None:
    """Olga (operator) owns the instance; her viewer token reads it, and is refused the
    replacement by role; another viewer does not see it at all."""
    olga = sandbox_server.make_token("olga", "operator")
    olga_viewer = sandbox_server.make_token("olga", "viewer")
    vic = sandbox_server.make_token("vic", "viewer")
    iid = unique_id("egress-olga")
    register_host_instance(sandbox_server, iid, token=olga)
    agent = start_agent(sandbox_server, iid, tmp_path, register=False)
    try:
        with Client(sandbox_server.url, olga) as owner:
            owner.instances.set_egress(iid, ["api.example.com:443"], network="allowlist")
        with Client(sandbox_server.url, olga_viewer) as viewer:
            seen = viewer.instances.egress(iid)
            assert [r.text for r in seen.allow] == ["api.example.com:443"]
            with pytest.raises(Forbidden, match="operator role"):
                viewer.instances.set_egress(iid, [])
        with Client(sandbox_server.url, vic) as stranger, pytest.raises(NotFound):
            stranger.instances.egress(iid)
        ctl = Sandboxctl(sandbox_server.url, olga_viewer, tmp_path / "cli")
        assert ctl.json("instance", "egress", iid)["network"] == "allowlist"
        res = ctl("instance", "egress", iid, "--clear")
        assert res.returncode == 4 and "operator role" in res.stderr, res.stderr
        with Client(sandbox_server.url, olga) as owner:
            assert [r.text for r in owner.instances.egress(iid).allow] == ["api.example.com:443"]
    finally:
        agent.stop()


async def test_the_openapi_document_says_both_rule_forms(sbx: AsyncClient) -> None:
    """Input rules are text or objects (the server reads both); output rules are objects."""
    doc = await sbx._transport.request("GET", "/api/openapi.json")
    schemas = doc["components"]["schemas"]
    for name in ("EgressIn", "EgressConfig"):  # the PUT, and the create request's `egress`
        forms = schemas[name]["properties"]["allow"]["items"]["anyOf"]
        assert [f.get("type") or f.get("$ref") for f in forms] == [
            "string",
            "#/components/schemas/Rule",
        ], (name, forms)
        assert "HOST:PORT" in forms[0]["description"]
    assert schemas["EgressOut"]["properties"]["allow"]["items"] == {
        "$ref": "#/components/schemas/Rule"
    }


def test_cli_sets_brokered_credentials(
    sandbox_server: ServerProcess, agent_factory: AgentFactory, tmp_path: Path
) -> None:
    """`--credential SECRET=HOST:PORT[,…][,header=H][,format=F]` replaces the credentials
    (alone it keeps the rules), the table and JSON show them (never a value), a bad one is
    refused naming the `--credential` it came from, `--clear-credentials` removes them."""
    ctl = Sandboxctl(sandbox_server.url, sandbox_server.admin_token, tmp_path / "cli")
    iid = agent_factory(sandbox_server).instance_id
    sandbox_server.ok("PUT", "/api/v2/admin/secrets/API_TOKEN", {"value": "v-123-secret"})
    rc, out, err = ctl.run_inprocess(
        "instance", "egress", iid, "--allow", "api.example.com:443", "--network", "allowlist"
    )
    assert rc == 0, err
    rc, out, err = ctl.run_inprocess(
        "instance",
        "egress",
        iid,
        "--credential",
        "API_TOKEN=api.example.com:443,API.example.com:8443,header=X-Api-Key,"
        "format=Key {value}, v1",
        "-o",
        "json",
    )
    assert rc == 0, err
    shown = json.loads(out)
    assert [r["host"] for r in shown["allow"]] == ["api.example.com"]  # the rules stayed
    assert shown["credentials"] == [
        {
            "secret": "API_TOKEN",
            "destinations": ["api.example.com:443", "api.example.com:8443"],
            "header": "X-Api-Key",
            "format": "Key {value}, v1",
        }
    ]
    rc, out, err = ctl.run_inprocess("instance", "egress", iid)
    assert rc == 0 and "credentials" in out and "X-Api-Key" in out, (out, err)
    assert "v-123-secret" not in out
    # defaults: Authorization, Bearer {value}; with --allow the rules are replaced too
    rc, out, err = ctl.run_inprocess(
        "instance",
        "egress",
        iid,
        "--allow",
        "api.example.com:443",
        "--allow",
        "other.example:443",
        "--credential",
        "API_TOKEN=other.example:443",
        "-o",
        "json",
    )
    assert rc == 0, err
    creds = json.loads(out)["credentials"]
    assert creds == [
        {
            "secret": "API_TOKEN",
            "destinations": ["other.example:443"],
            "header": "Authorization",
            "format": "Bearer {value}",
        }
    ]
    # refused: the server's field, and the --credential it came from
    rc, out, err = ctl.run_inprocess(
        "instance", "egress", iid, "--credential", "NO_SUCH=api.example.com:443"
    )
    assert rc == 6, (rc, out, err)
    assert "--credential 'NO_SUCH=api.example.com:443' (body.credentials.0.secret)" in err, err
    rc, _, err = ctl.run_inprocess("instance", "egress", iid, "--credential", "API_TOKEN")
    assert rc == 2 and "SECRET=HOST:PORT" in err, err
    rc, _, err = ctl.run_inprocess(
        "instance", "egress", iid, "--credential", "API_TOKEN=header=X-Key"
    )
    assert rc == 2 and "no HOST:PORT" in err, err
    assert ctl.json("instance", "egress", iid)["credentials"] == creds  # nothing changed
    rc, out, err = ctl.run_inprocess("instance", "egress", iid, "--clear-credentials", "-o", "json")
    assert rc == 0, err
    after = json.loads(out)
    assert after["credentials"] == [] and len(after["allow"]) == 2
