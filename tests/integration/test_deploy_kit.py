"""The operations kit (deploy/): Debian's real ``prometheus`` scrapes a running ``kvfuse serve`` with
the kit's configuration; every alert rule loads and evaluates, every dashboard query parses, and
every kvfuse series the kit names is really exported."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml
from openai import OpenAI

from kvfuse_testkit import ServerProcess, ensure_model, free_port

pytestmark = pytest.mark.integration

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
RULES = DEPLOY / "prometheus" / "kvfuse-alerts.yml"
DASHBOARD = DEPLOY / "grafana" / "kvfuse-dashboard.json"
MODEL = "smollm2"


def dashboard_exprs() -> list[str]:
    """Every panel query, with Grafana's variables replaced as Grafana would (all servers, 1m)."""
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [
        t["expr"].replace("$__rate_interval", "1m").replace("$instance", ".*")
        for p in panels
        for t in p["targets"]
    ]


def rule_exprs() -> list[str]:
    return [r["expr"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def metric_names(exprs: list[str]) -> set[str]:
    return {m for e in exprs for m in re.findall(r"\bkvfuse_[a-z_]+", e)}


def test_the_kit_files_are_valid():
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed: apt-get install -y prometheus")
    subprocess.run([promtool, "check", "rules", str(RULES)], check=True, capture_output=True)
    subprocess.run(
        [promtool, "check", "config", str(DEPLOY / "prometheus" / "prometheus.yml")],
        check=True,
        capture_output=True,
    )
    assert len(json.loads(DASHBOARD.read_text())["panels"]) >= 8


@pytest.fixture(scope="module")
def kvfuse(kvfuse_home, tmp_path_factory):
    ensure_model(kvfuse_home, MODEL)
    tmp = tmp_path_factory.mktemp("deploy")
    srv = ServerProcess(
        kvfuse_home,
        config={
            "model": MODEL,
            "cache": {"disk_path": str(tmp / "kv")},
            "responses": {"path": str(tmp / "r.sqlite3")},
        },
    )
    srv.start()
    c = OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=300)
    prompt = (
        " ".join(f"Item {i} weighs {i * 3} grams." for i in range(60))
        + "\nWhich item weighs 27 grams?"
    )
    for _ in range(2):  # the second is a hit: hits, TTFT, tokens reused are all non-zero
        c.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def prometheus(kvfuse, tmp_path_factory):
    exe = shutil.which("prometheus")
    if exe is None:
        pytest.skip(
            "prometheus is not installed: apt-get install -y prometheus (scripts/install.sh --test does)"
        )
    tmp = tmp_path_factory.mktemp("prometheus")
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    config["rule_files"] = [str(RULES)]
    config["scrape_configs"][0]["static_configs"] = [{"targets": [f"127.0.0.1:{kvfuse.port}"]}]
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    log = open(tmp / "prometheus.log", "wb")
    proc = subprocess.Popen(
        [
            exe,
            f"--config.file={tmp / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}/api/v1"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert proc.poll() is None, (tmp / "prometheus.log").read_text()[-3000:]
            try:
                # /-/ready answers 503 "Service Unavailable" (plain text) until the TSDB is open
                if httpx.get(
                    f"http://127.0.0.1:{port}/-/ready", timeout=5
                ).status_code == 200 and query(url, "kvfuse_engine_requests_total"):
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            pytest.fail(
                "prometheus scraped no kvfuse series within 60 s:\n"
                + (tmp / "prometheus.log").read_text()[-3000:]
            )
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def query(url: str, expr: str) -> list:
    r = httpx.get(url + "/query", params={"query": expr}, timeout=30)
    assert r.headers.get("content-type", "").startswith("application/json"), (
        f"{expr!r}: {r.status_code} {r.text[:300]}"
    )
    body = r.json()
    assert r.status_code == 200 and body["status"] == "success", f"{expr!r}: {body}"
    return body["data"]["result"]


def test_prometheus_scrapes_the_server(prometheus):
    assert [float(s["value"][1]) for s in query(prometheus, 'up{job="kvfuse"}')] == [1.0]
    assert float(query(prometheus, "kvfuse_engine_requests_total")[0]["value"][1]) >= 2
    cached = query(prometheus, 'kvfuse_prompt_tokens_total{source="cached"}')
    assert cached and float(cached[0]["value"][1]) > 0
    tiers = {s["metric"]["tier"] for s in query(prometheus, "kvfuse_tier_capacity_bytes")}
    assert tiers == {"memory", "disk"}


def test_every_series_the_kit_names_is_exported(prometheus):
    names = set(httpx.get(prometheus + "/label/__name__/values", timeout=30).json()["data"])
    wanted = metric_names(dashboard_exprs() + rule_exprs())
    assert wanted and wanted <= names, f"not exported: {sorted(wanted - names)}"


def test_every_dashboard_query_parses(prometheus):
    for expr in dashboard_exprs():
        query(prometheus, expr)  # asserts status success (a parse error is a 400)


def test_every_alert_rule_loads_and_evaluates(prometheus):
    deadline = time.monotonic() + 30
    while True:
        groups = httpx.get(prometheus + "/rules", timeout=30).json()["data"]["groups"]
        rules = [r for g in groups for r in g["rules"]]
        if (
            rules
            and all(r.get("lastEvaluation", "").startswith("20") for r in rules)
            or time.monotonic() > deadline
        ):
            break
        time.sleep(0.5)
    assert sorted(r["name"] for r in rules) == sorted(
        r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]
    )
    assert all(r["health"] == "ok" for r in rules), [(r["name"], r.get("lastError")) for r in rules]
