"""Metrics as a fleet reads them: Debian's Prometheus scrapes a live kvtierd (with a Redis remote
tier, so that every family exists) and answers through its HTTP API; promtool checks the
exposition; every expression of deploy/grafana/kvtier.json runs against those live series and
names only families that exist."""
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = ROOT / os.environ.get("KVTIER_BUILD", "build") / "bin"
sys.path.insert(0, str(ROOT / "client" / "python"))
import kvtier  # noqa: E402
from kvtier.daemon import LocalDaemon  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("prometheus") is None or
                                shutil.which("redis-server") is None,
                                reason="needs Debian's prometheus and redis-server "
                                       "(scripts/install-deps installs them)")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(what, fn, timeout=60):
    deadline = time.time() + timeout
    while time.time() < deadline:
        v = fn()
        if v:
            return v
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def get(url):
    return urllib.request.urlopen(url, timeout=10).read().decode()


def ready(url):
    """Whether `url` answers 200 yet (a server still starting refuses the connection)."""
    try:
        return urllib.request.urlopen(url, timeout=10).status == 200
    except OSError:
        return False


def query(api, expr):
    body = json.loads(get(f"{api}/api/v1/query?" + urllib.parse.urlencode({"query": expr})))
    assert body["status"] == "success", (expr, body)
    return body["data"]["result"]


@pytest.fixture
def stack(tmp_path):
    procs = []
    redis_sock = tmp_path / "redis.sock"
    procs.append(subprocess.Popen(["redis-server", "--port", "0", "--unixsocket", str(redis_sock),
                                   "--save", "", "--appendonly", "no"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    wait_for("redis", redis_sock.exists, 20)
    metrics = free_port()
    d = LocalDaemon(BIN / "kvtierd", tmp_path, "--remote", f"unix:{redis_sock}",
                    "--metrics_port", str(metrics), "--persist_interval_ms", "200")
    prom_port = free_port()
    (tmp_path / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        f"  - job_name: kvtierd\n    static_configs: [{{targets: ['127.0.0.1:{metrics}']}}]\n")
    procs.append(subprocess.Popen(
        ["prometheus", f"--config.file={tmp_path / 'prometheus.yml'}",
         f"--storage.tsdb.path={tmp_path / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{prom_port}"],
        stdout=subprocess.DEVNULL, stderr=open(tmp_path / "prometheus.log", "w")))
    try:
        wait_for("prometheus to listen", lambda: ready(f"http://127.0.0.1:{prom_port}/-/ready"))
        yield d, metrics, f"http://127.0.0.1:{prom_port}"
    finally:
        code = d.stop()
        for p in procs:
            p.terminate()
            p.wait(timeout=30)
        assert code == 0, d.log.read_text()


def traffic(address, name):
    """Appends, Selects (prefetch, copies), a failed call, a move to Redis and back."""
    rng = np.random.default_rng(1)
    with kvtier.Client(address) as c:
        sid = c.create_session(4, 4, 2, 64, session_id=name).session_id
        k = rng.standard_normal((4, 2, 512, 64)).astype(np.float16)
        c.append_layers(sid, 0, k, k)
        for _ in range(20):
            sel = c.select(sid, 3, rng.standard_normal((4, 64)).astype(np.float32),
                           budget_tokens=128)
            c.release(sel.lease_id)
        with pytest.raises(kvtier.KvTierError):
            c.describe_session("nope")
        c.evict(sid, "host")  # to the remote tier, whole
        assert c.describe_session(sid).info.num_tokens == 512  # and back


def test_prometheus_scrapes_kvtierd_and_the_dashboard_reads_its_series(stack, tmp_path):
    d, metrics_port, api = stack
    traffic(d.address, "first")
    text = get(f"http://127.0.0.1:{metrics_port}/metrics")
    check = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True,
                           text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    # Scraped, several times since the traffic (rate() needs two samples).
    wait_for("the target up", lambda: any(r["value"][1] == "1" for r in query(api, "up")))
    wait_for("five scrapes", lambda: query(api, "count_over_time(kvtier_build_info[1m]) >= 5"))
    traffic(d.address, "second")
    time.sleep(3)
    version = subprocess.run([BIN / "kvtierd", "--version"], capture_output=True,
                             text=True).stdout.split()[1]
    info = query(api, "kvtier_build_info")
    assert [r["metric"]["version"] for r in info] == [version]
    assert info[0]["metric"]["remote"] == "redis"
    # A bucket bound as written in a query matches: le="0.0025", not 0.0025000000000000001.
    assert query(api, 'kvtier_rpc_latency_seconds_bucket{method="Select",le="0.0025"}')
    names = set(json.loads(get(f"{api}/api/v1/label/__name__/values"))["data"])
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "kvtier.json").read_text())
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"datasource", "instance"} <= variables
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    for e in exprs:
        for name in re.findall(r"\bkvtier_[a-z_]+", e):
            assert name in names, f"{name} (in {e}) is no live series"
        live = e.replace("$instance", ".*").replace("$__rate_interval", "1m")
        assert query(api, live), f"no series for {e}"
    titles = " ".join(p["title"] for p in dashboard["panels"]).lower()
    assert "copy caches" in titles and "prefetch" in titles and "remote tier" in titles
