"""`/metrics`: valid exposition (promtool), access modes, a real Prometheus scrape."""

from __future__ import annotations

import gc
import json
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from tests.support.inproc_server import Running, free_port, make_settings, start_server


def promtool(text: bytes) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        ["promtool", "check", "metrics"], input=text, capture_output=True, timeout=60
    )


async def exercise(r: Running) -> None:
    """A scenario touching auth failures, denials, validation errors and events."""
    viewer = await r.make_token("vera", "viewer")
    await r.call("GET", "/api/v2/admin/whoami", token="sbx_not_a_token")
    await r.call("POST", "/api/v2/admin/tokens", token=viewer, json={"subject": "x"})
    await r.call("POST", "/api/v2/admin/tokens", json={"subject": "bad subject"})
    await r.call("GET", "/api/v1/events?after=0")


async def test_exposition_passes_promtool(running: Running) -> None:
    await exercise(running)
    status, text, resp = await running.call("GET", "/metrics")
    assert status == 200 and resp.content_type == "text/plain"
    check = promtool(text)
    assert check.returncode == 0, check.stdout.decode() + check.stderr.decode()
    assert b'sandbox_auth_failures_total{reason="unauthenticated"} 1.0' in text
    assert b'route="/api/v2/admin/tokens"' in text
    assert b"sandbox_instances" in text and b"sandbox_build_info" in text


def sample(text: bytes, series: str) -> float:
    (line,) = (x for x in text.decode().splitlines() if x.startswith(series + " "))
    return float(line.rsplit(" ", 1)[1])


async def test_process_and_gc_families_are_this_process(running: Running) -> None:
    """An operator's usual process and GC series (the in-process server: this process)."""
    _, before, _ = await running.call("GET", "/metrics")
    full = 'python_gc_collections_total{generation="2"}'
    gc.collect()
    _, after, _ = await running.call("GET", "/metrics")
    assert sample(after, full) == sample(before, full) + 1
    with open("/proc/self/status") as f:
        rss = next(int(x.split()[1]) * 1024 for x in f if x.startswith("VmRSS:"))
    assert abs(sample(after, "process_resident_memory_bytes") - rss) < rss / 4
    assert sample(after, "process_cpu_seconds_total") >= sample(before, "process_cpu_seconds_total")
    assert b"python_info{" in after


async def test_metrics_needs_a_token_by_default(running: Running) -> None:
    status, body, _ = await running.call("GET", "/metrics", token="")
    assert status == 401 and "SANDBOX_METRICS_ACCESS" in body["detail"]


async def test_metrics_on_a_separate_listener(tmp_path: Path) -> None:
    mport = free_port()
    settings = make_settings(
        tmp_path, metrics_access="listener", metrics_listen=f"127.0.0.1:{mport}"
    )
    async with start_server(settings) as r:
        status, _, _ = await r.call("GET", "/metrics")
        assert status == 404  # not on the main listener
        async with r.http.get(f"http://127.0.0.1:{mport}/metrics") as resp:
            assert resp.status == 200
            assert b"sandbox_build_info" in await resp.read()


def wait_for(predicate: object, timeout: float, what: str) -> object:
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        last = predicate()  # type: ignore[operator]
        if last:
            return last
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}; last={last!r}")


async def test_real_prometheus_scrapes_and_answers_promql(tmp_path: Path) -> None:
    async with start_server(make_settings(tmp_path)) as r:
        await exercise(r)
        scraper = await r.make_token("prometheus", "viewer")
        token_file = tmp_path / "prom.token"
        token_file.write_text(scraper)
        host, port = r.svc.settings.http_address
        prom_port = free_port()
        config = tmp_path / "prometheus.yml"
        # the shipped example, pointed at this server and scraping fast
        shipped = Path("deploy/prometheus.yml").read_text()
        config.write_text(
            shipped.replace("scrape_interval: 15s", "scrape_interval: 1s")
            .replace("/etc/prometheus/agentic-sandbox.token", str(token_file))
            .replace('"127.0.0.1:8122"', f'"{host}:{port}"')
        )
        proc = subprocess.Popen(
            [
                "prometheus",
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{prom_port}",
                "--log.level=warn",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        try:
            base = f"http://127.0.0.1:{prom_port}"

            def query(expr: str) -> list[dict[str, object]]:
                url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
                try:
                    with urllib.request.urlopen(url, timeout=2) as resp:
                        result: list[dict[str, object]] = json.loads(resp.read())["data"]["result"]
                        return result
                except OSError:
                    return []

            import asyncio

            loop = asyncio.get_running_loop()
            up = await loop.run_in_executor(
                None, wait_for, lambda: query('up{job="agentic-sandbox"} == 1'), 60, "target up"
            )
            assert up
            series = await loop.run_in_executor(
                None,
                wait_for,
                lambda: query('sandbox_auth_failures_total{reason="unauthenticated"}'),
                30,
                "auth failure series",
            )
            assert float(series[0]["value"][1]) >= 1  # type: ignore[index]
            forbidden = query('sum(sandbox_http_requests_total{status="403"})')
            assert forbidden and float(forbidden[0]["value"][1]) >= 1  # type: ignore[index]
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if proc.returncode not in (0, -15):
            pytest.fail(proc.stderr.read().decode() if proc.stderr else "prometheus failed")
