"""What the product imports is what it installs: every third-party module that the daemon,
``replay`` and the answer path import, on the driver and in Spark's Python workers, comes from a
runtime dependency of ``pyproject.toml`` (or one of theirs) and is pinned in
``deploy/requirements.lock``, which the image installs. pandas was only a development extra
while PySpark's ``mapInArrow`` needs it in the driver: every answer job of a runtime-only install
failed, and every test passed, with the extras installed.

Two readings: the imports written in the product's source (each must be a direct runtime
dependency), and the modules the processes really load, recorded by ``tests/hooks/
sitecustomize.py`` in every interpreter of the tree (a library's own lazy imports, such as
PySpark's of pandas, are only seen there)."""

from __future__ import annotations

import ast
import importlib.metadata as md
import os
import re
import sys
import tomllib

import httpx
from packaging.requirements import Requirement

from tests.helpers import ROOT
from tests.processes import (
    cli_spark,
    daemon_config,
    free_port,
    start_daemon,
    stop_daemon,
    wait_for,
)

PACKAGES = ("capture", "planner", "collector", "api")
# reference implementations for tests and benchmarks, never imported by the product (checked
# below): the ILP of planner/reference.py needs scipy, a development dependency
TEST_ONLY = {"planner/reference.py"}
HOOKS = ROOT / "tests" / "hooks"
LOCK = ROOT / "deploy" / "requirements.lock"

# every query class the answer path serves: aggregates, HAVING, ORDER BY … LIMIT, a selection,
# exact and approximate distinct counts, a prefix key, a regexp, a join of two aggregates
QUERIES = """
-- name: udp_bw
SELECT time/5 AS t, src_ip, dst_ip, sum(wirelen) AS bytes, count(*) AS pkts FROM packets
WHERE protocol = 17 GROUP BY time/5, src_ip, dst_ip HAVING pkts > 1;
-- name: top_ports
SELECT time/5 AS t, dst_port, count(*) AS n, avg(wirelen) AS mean FROM packets
WHERE protocol = 6 GROUP BY time/5, dst_port ORDER BY n DESC LIMIT 3;
-- name: dns_names
SELECT ts, src_ip, dns_qname FROM packets WHERE dst_port = 53 AND regexp(dns_qname, '.*\\.com');
-- name: fanout
SELECT time/5 AS t, src_ip, count(DISTINCT dst_ip) AS peers, approx_count_distinct(dst_port)
AS ports FROM packets GROUP BY time/5, src_ip;
-- name: nets
SELECT time/5 AS t, prefix(src_ip, 24) AS net, count(*) AS n FROM packets
GROUP BY time/5, prefix(src_ip, 24);
-- name: both
WITH a AS (SELECT time/5 AS t, src_ip, count(*) AS n FROM packets WHERE protocol = 17
           GROUP BY time/5, src_ip),
     b AS (SELECT time/5 AS t, src_ip, count(*) AS m FROM packets WHERE protocol = 6
           GROUP BY time/5, src_ip)
SELECT a.t, a.src_ip, a.n, b.m FROM a LEFT JOIN b ON a.t = b.t AND a.src_ip = b.src_ip;
"""


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def runtime_requirements() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [Requirement(s) for s in
            project["dependencies"] + project["optional-dependencies"]["live"]]


def closure(requirements: list[Requirement]) -> set[str]:
    """The distributions the runtime requirements install, their own requirements (markers
    read for this interpreter and the extras asked) included."""
    seen: set[str] = set()
    todo = [(r.name, set(r.extras)) for r in requirements]
    while todo:
        name, extras = todo.pop()
        key = canonical(name)
        if key in seen:
            continue
        seen.add(key)
        for spec in md.requires(name) or []:
            r = Requirement(spec)
            if r.marker is None or any(r.marker.evaluate({"extra": e})
                                       for e in extras | {""}):
                todo.append((r.name, set(r.extras)))
    return seen


def locked() -> set[str]:
    return {canonical(n) for n in re.findall(r"^([A-Za-z0-9_.-]+)==", LOCK.read_text(), re.M)}


# names in sys.modules that no distribution installs as a module: Cython's shared runtime of
# compiled extensions, cryptography's bindings' OpenSSL module, the Java packages Py4J
# exposes, runpy's and multiprocessing's main modules
NOT_INSTALLED = re.compile(r"_cython_[\d_]+|_cyutility|cython_runtime|_openssl|org|<.*>|__\w+__")


# libraries the product uses import these when they are installed, and run without them (the
# CI lane of .ci/run runs the product in an environment made by its runtime install alone):
# this test's environment has them as development dependencies
OPTIONAL = {"scipy": "numba imports it when present (its linear algebra)",
            "charset_normalizer": "numpy.f2py tries it when numba imports numpy's f2py"}


def owners() -> dict[str, set[str]]:
    """Top-level module -> the distributions whose files provide it (compiled modules such as
    datasketches' ``_datasketches.cpython-311-….so`` included)."""
    out: dict[str, set[str]] = {}
    for m, dists in md.packages_distributions().items():
        out.setdefault(m, set()).update(canonical(d) for d in dists)
    for dist in md.distributions():
        name = canonical(dist.metadata["Name"])  # parsed once, not once a file (30 s)
        for f in dist.files or ():
            top = f.parts[0].split(".")[0] if f.parts else ""
            if top and not f.parts[0].endswith((".dist-info", ".data", ".pth")):
                out.setdefault(top, set()).add(name)
    return out


def distributions(modules: set[str]) -> dict[str, set[str]]:
    """Third-party top-level modules -> the distributions that provide them (the standard
    library and the product's own packages left out)."""
    by = owners()
    return {m: by.get(m, set()) for m in modules
            if m not in sys.stdlib_module_names and m not in sys.builtin_module_names and
            m not in PACKAGES and not m.startswith(("__editable__", "_sysconfigdata")) and
            not NOT_INSTALLED.fullmatch(m)}


def written_imports() -> set[str]:
    """The module of every import statement in the product's packages (inside functions and
    under TYPE_CHECKING too; ``from m import n`` as ``m.n``), bar the test-only modules."""
    found = set()
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            if str(path.relative_to(ROOT)) in TEST_ONLY:
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    found |= {a.name for a in node.names}
                elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                    found |= {f"{node.module}.{a.name}" for a in node.names}
    return found


def test_every_import_written_in_the_product_is_a_direct_runtime_dependency():
    direct = {canonical(r.name) for r in runtime_requirements()}
    written = written_imports()
    by_module = distributions({m.partition(".")[0] for m in written})
    unowned = sorted(m for m, d in by_module.items() if not d)
    assert not unowned, f"imported by the product, installed by nothing: {unowned}"
    missing = {m: sorted(d) for m, d in by_module.items() if not d & direct}
    assert not missing, f"imported by the product, not a runtime dependency: {missing}"
    assert {"numpy", "pyspark", "numba"} <= set(by_module)  # not vacuous
    test_only = {m.removesuffix(".py").replace("/", ".") for m in TEST_ONLY}
    assert not {m for m in written if m.rpartition(".")[0] in test_only or m in test_only}


def test_every_module_the_running_product_loads_is_installed_by_the_runtime_install(tmp_path):
    """``flowsieve replay`` of every query class (its driver and Spark's Python workers), and
    the daemon with a capture file, a NetFlow and an sFlow listener, enrichment and an alert
    receiver until a window is answered: every third-party module any of their interpreters
    loaded belongs to the runtime dependencies' closure and to the lock."""
    audit = tmp_path / "imports"
    audit.mkdir()
    env = {"FLOWSIEVE_IMPORT_AUDIT": str(audit),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(HOOKS),
                                                       os.environ.get("PYTHONPATH")]))}
    queries = tmp_path / "q.sql"
    queries.write_text(QUERIES)
    out = cli_spark("replay", str(ROOT / "collector" / "data" / "sample.pcap"), "--queries",
                    str(queries), "--format", "csv", env={**os.environ, **env})
    assert out.returncode == 0, out.stderr
    answered = {line.split(",", 1)[0] for line in out.stdout.splitlines()[1:]}
    assert {"udp_bw", "top_ports", "dns_names", "fanout", "nets", "both"} <= answered
    replayed = set(audit.iterdir())
    assert len(replayed) >= 2  # the command and Spark's Python worker daemon (and its forks)
    (tmp_path / "networks.yaml").write_text("192.168.0.0/16: {name: home, role: internal}\n")
    cfg, port = daemon_config(tmp_path, [
        "{type: pcap, name: sample, loop: true, restamp: true}",
        f"{{type: netflow, name: routers, listen: ['127.0.0.1:{free_port()}']}}",
        f"{{type: sflow, name: fabric, listen: ['127.0.0.1:{free_port()}']}}"],
        "-- name: per_net\nSELECT time/5 AS t, src_net_name, count(*) AS n FROM packets "
        "GROUP BY time/5, src_net_name;\n"
        "-- name: flows5\nSELECT time/5 AS t, exporter, sum(bytes) AS b FROM flows "
        "GROUP BY time/5, exporter;\n"
        "-- name: samples5\nSELECT time/5 AS t, agent, count(*) AS n FROM samples "
        "GROUP BY time/5, agent;\n")
    cfg.write_text(cfg.read_text() + f"""
enrich:
  networks: {tmp_path / 'networks.yaml'}
  snmp: {{refresh_s: 3600, timeout_s: 0.2, devices: {{127.0.0.1: {{community: public}}}}}}
alerts:
  receivers:
    hook: {{type: webhook, url: "http://127.0.0.1:{free_port()}/hook"}}
""")
    base = f"http://127.0.0.1:{port}"
    with open(tmp_path / "daemon.log", "w") as log:
        proc = start_daemon(cfg, log, env=env)
    try:
        wait_for(lambda: httpx.get(f"{base}/queries/per_net/results", timeout=5).json()["rows"],
                 240, "a window of per_net answered")
    finally:
        stop_daemon(proc)
    assert proc.returncode == 0, (tmp_path / "daemon.log").read_text()[-3000:]
    assert len(set(audit.iterdir()) - replayed) >= 2  # the daemon and its Python workers
    loaded = set()
    for path in audit.iterdir():
        loaded |= set(path.read_text().split())
    by_module = distributions(loaded)
    unowned = sorted(m for m, d in by_module.items() if not d)
    assert not unowned, f"loaded, installed by no distribution: {unowned}"
    runtime, lock = closure(runtime_requirements()), locked()
    assert not {canonical(m) for m in OPTIONAL} & runtime  # the list stays true
    by_module = {m: d for m, d in by_module.items() if m not in OPTIONAL}
    missing = {m: sorted(d) for m, d in by_module.items() if not d & runtime}
    assert not missing, f"loaded by the product, not installed by its runtime install: {missing}"
    unpinned = {m: sorted(d) for m, d in by_module.items() if not d & lock}
    assert not unpinned, f"loaded by the product, not in deploy/requirements.lock: {unpinned}"
    assert {"pandas", "pyspark", "numba", "uvicorn", "pysnmp"} <= set(by_module)  # not vacuous
