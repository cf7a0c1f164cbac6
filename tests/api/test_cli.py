"""The stable command line: decode against tshark, plan JSON, one-line errors."""

from __future__ import annotations

import csv
import io
import ipaddress
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from api.cli import main
from collector.config import data_file
from tests.helpers import ROOT, capture, many_groups, need_tool
from tests.processes import cli, cli_spark, one_error_line
from tests.reference import packets


def test_decode_csv_equals_tshark():
    """Addresses, ports, TTL and DNS question name of every packet, as tshark prints them."""
    tshark = need_tool("tshark")
    path = capture("wikipedia.pcap")
    out = cli("decode", str(path), "--fields", "src_ip,dst_ip,src_port,dst_port,ttl,dns_qname")
    assert out.returncode == 0, out.stderr
    ours = list(csv.reader(io.StringIO(out.stdout)))
    assert ours[0] == ["src_ip", "dst_ip", "src_port", "dst_port", "ttl", "dns_qname"]
    ts = subprocess.run(
        [tshark, "-n", "-r", str(path), "-T", "fields", "-E", "separator=,", "-E", "occurrence=f",
         "-e", "ip.src", "-e", "ipv6.src", "-e", "ip.dst", "-e", "ipv6.dst", "-e", "tcp.srcport",
         "-e", "udp.srcport", "-e", "tcp.dstport", "-e", "udp.dstport", "-e", "ip.ttl",
         "-e", "ipv6.hlim", "-e", "dns.qry.name"],
        capture_output=True, text=True, check=True).stdout.splitlines()
    assert len(ts) == len(ours) - 1
    for k, (mine, line) in enumerate(zip(ours[1:], ts, strict=True)):
        f = line.split(",")
        want = [f[0] or f[1], f[2] or f[3], f[4] or f[5], f[6] or f[7], f[8] or f[9],
                f[10].lower() if mine[2] in ("53", "5353") or mine[3] in ("53", "5353") else ""]
        assert mine == want, f"packet {k + 1}"


def test_decode_json_and_stdin():
    path = capture("dns_udp.pcap")
    with open(path, "rb") as stdin:
        out = cli("decode", "-", "--fields", "ts,dns_qr,dns_qname,vlan", "--format", "json",
                  stdin=stdin, text=False, timeout=120)
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.decode().splitlines()]
    assert [r["dns_qr"] for r in rows] == [0, 1]
    assert rows[0]["dns_qname"] == "www.tcpdump.org" and rows[0]["vlan"] is None
    assert rows[0]["ts"] == 1591780794.740079


def test_plan_json_contract():
    out = cli("plan", "--queries", data_file("example.sql"), "--format", "json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert [q["name"] for q in doc["queries"]] == ["udp_bw", "dns_req", "dns_resp"]
    assert [b["predicates"] for b in doc["bits"]] == [[0], [1, 2], [3, 4]]
    assert doc["queries"][1]["signature"] == [0, 1]


def test_errors_are_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.sql"
    bad.write_text("SELECT ts FROM packets;\n-- name: x\nSELECT ts FROM packets\nWHERE nope = 1")
    assert main(["plan", "--queries", str(bad)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {bad}: query x: line 4, column 7: unknown field 'nope' in stream "
                   "packets"]
    assert main(["decode", str(capture("partial_first_header.pcap"))]) == 1
    captured = capsys.readouterr()
    assert captured.err.strip().endswith("truncated record header (file ends inside a 16-byte "
                                         "record header) at byte 24")
    assert captured.out.splitlines()[0].startswith("ts,time,")
    assert main(["decode", str(capture("dns_udp.pcap")), "--fields", "nope"]) == 1
    assert "unknown packets field 'nope'" in capsys.readouterr().err
    assert main(["replay", "/nonexistent.pcap", "--queries", str(bad)]) == 1
    assert main(["decode", str(capture("dns_udp.pcap")), "--stream", "flows", "--fields",
                 "wirelen"]) == 1
    assert "unknown flows field 'wirelen'" in capsys.readouterr().err
    # a capture without export datagrams has no flow records: a header and nothing else
    assert main(["decode", str(capture("dns_udp.pcap")), "--stream", "flows"]) == 0
    assert capsys.readouterr().out.splitlines()[0].startswith("exporter,observation_domain,")




def test_decode_of_what_is_not_a_capture(tmp_path):
    """Found by trying: a missing file and a directory printed a CSV header and a 17-line
    traceback. Now: one line, nothing on stdout."""
    one_error_line(cli("decode", "/nonexistent.pcap"), "/nonexistent.pcap does not exist")
    one_error_line(cli("decode", str(tmp_path)), "is a directory")
    one_error_line(cli("decode", "/nonexistent.pcap", "--stream", "flows"), "does not exist")


def test_decode_of_an_unreadable_file(tmp_path):
    """A file the user may not read. Root reads everything, so as root the command runs
    without the capabilities that let it (setpriv, util-linux)."""
    import os
    path = tmp_path / "secret.pcap"
    path.write_bytes(capture("dns_udp.pcap").read_bytes())
    path.chmod(0)
    cmd = [sys.executable, "-m", "api.cli", "decode", str(path)]
    if os.geteuid() == 0:
        cmd = [need_tool("setpriv"), "--bounding-set=-dac_override,-dac_read_search", *cmd]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120)
    one_error_line(out, "cannot be read: Permission denied")


def test_spark_failure_is_one_line():
    """Spark refusing to start (a driver memory below its minimum) is one line naming the
    reason and the JVM's log; the JVM's stack trace goes to that log, not the terminal."""
    import os
    out = cli_spark("replay", str(capture("ok.pcap")), "--queries", data_file("example.sql"),
                    env={**os.environ, "FLOWSIEVE_SPARK__DRIVER_MEMORY": "100m"})
    line = one_error_line(out, "Spark did not start", "Insufficient driver memory")
    log = Path(line.rsplit("its log: ", 1)[1].rstrip(")"))
    assert "SparkIllegalArgumentException" in log.read_text()
    log.unlink()


def test_replay_spool_over_its_bound_is_one_line(tmp_path):
    """replay's spool is merged at the end of the input, so one over ``spool.max_bytes`` stops
    the command with one line naming the setting (it never waits for a consumer)."""
    import os
    out = cli_spark("replay", str(capture("ok.pcap")), "--queries", data_file("example.sql"),
                    env={**os.environ, "FLOWSIEVE_SPOOL__MAX_BYTES": "1000",
                         "FLOWSIEVE_LFTA__ENABLED": "false"})
    one_error_line(out, "reached spool.max_bytes (1000 bytes) before the end of the input")


def test_spark_reason_of_an_out_of_memory_error():
    """A JVM OutOfMemoryError (as Py4J's error text carries it) becomes advice on driver
    memory; an error that is not Spark's is left alone."""
    from collector.spark.session import failure_reason
    e = RuntimeError("An error occurred while calling o123.collectToPython.\n"
                     ": java.lang.OutOfMemoryError: Java heap space\n\tat java.base/...")
    assert "ran out of memory" in failure_reason(e) and "driver_memory" in failure_reason(e)
    assert failure_reason(ValueError("not Spark's")) is None


def test_missing_java_is_one_line(tmp_path):
    """Without java on PATH, replay says what to install before doing anything."""
    import os
    out = cli("replay", str(capture("ok.pcap")), "--queries", data_file("example.sql"),
              timeout=120, env={**os.environ, "PATH": str(Path(sys.executable).parent)})
    one_error_line(out, "Java not found", "openjdk-17")


def test_run_on_a_port_in_use(tmp_path):
    """The API port is checked before Spark starts: an immediate one-line error."""
    import socket
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        cfg = tmp_path / "c.yaml"
        cfg.write_text(f"var_dir: {tmp_path / 'var'}\napi: {{host: 127.0.0.1, port: {port}}}\n")
        out = cli("run", "--config", str(cfg))
    one_error_line(out, f"cannot listen on 127.0.0.1:{port}", "Address already in use")
    assert not (tmp_path / "var" / "checkpoints").exists()


def test_run_refuses_initial_queries_it_could_not_start_with(tmp_path):
    """An initial query whose alert names no configured receiver is one line before anything
    starts (the daemon stopped in its start-up, with a traceback in its log)."""
    (tmp_path / "q.sql").write_text("-- name: udp_src\n-- alert: for=1\nSELECT time/5 AS t, "
                                    "src_ip, count(*) AS n FROM packets GROUP BY time/5, src_ip")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"var_dir: {tmp_path / 'var'}\napi: {{host: 127.0.0.1, port: 0}}\n"
                   f"initial_queries: {tmp_path / 'q.sql'}\n")
    out = cli("run", "--config", str(cfg))
    one_error_line(out, "initial_queries", "udp_src", "no receiver is configured")
    assert not (tmp_path / "var" / "checkpoints").exists()


def test_a_start_up_failure_is_one_line(tmp_path):
    """An interface source that names no interface: the daemon stops in its start-up with one
    line saying which source and why, exit status 1, no traceback (it was 60 lines ending in
    "Application startup failed"); nothing is left running."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"var_dir: {tmp_path / 'var'}\napi: {{host: 127.0.0.1, port: 0}}\n"
                   "sources:\n  - {type: interface, name: uplink, interface: nosuch0}\n")
    out = cli("run", "--config", str(cfg))
    assert out.returncode == 1 and out.stdout == "", out.stderr
    lines = out.stderr.splitlines()
    assert lines[-1].startswith("error: start-up failed: ") and \
        [ln for ln in lines if "error" in ln.lower()] == lines[-1:], out.stderr
    assert "source uplink" in lines[-1] and "nosuch0" in lines[-1]
    assert "Traceback" not in out.stderr
    assert not (tmp_path / "var" / "checkpoints").exists() or \
        not any((tmp_path / "var" / "checkpoints").iterdir())


def test_version_fields_and_help():
    from capture.fields import fields
    out = cli("--version")
    assert out.returncode == 0 and out.stdout.startswith("flowsieve 0.")
    out = cli("fields", "--stream", "flows", "--format", "json")
    doc = json.loads(out.stdout)
    assert [f["name"] for f in doc] == list(fields("flows"))
    assert all(f["type"] and f["meaning"] for f in doc)
    text = cli("fields").stdout
    assert "dns_qname" in text and "est_bytes" in text
    # every subcommand has a description and every flag a help text
    from api.cli import parser
    sub = next(a for a in parser()._actions if a.dest == "command")
    assert set(sub.choices) == {"run", "replay", "decode", "plan", "fields", "prepare"}
    for name, p in sub.choices.items():
        assert p.description, name
        assert all(a.help for a in p._actions), name


def test_progress_on_a_terminal_only():
    """decode on a terminal shows a progress bar on it; into a pipe, nothing but the rows."""
    import os
    import pty
    path = capture("wikipedia.pcap")
    pid, fd = pty.fork()
    if pid == 0:  # the child: stdout and stderr are the terminal
        os.chdir(ROOT)
        os.execv(sys.executable, [sys.executable, "-m", "api.cli", "decode", str(path)])
    chunks = []
    while True:
        try:
            data = os.read(fd, 65536)
        except OSError:
            break
        if not data:
            break
        chunks.append(data)
    os.waitpid(pid, 0)
    screen = b"".join(chunks).decode(errors="replace")
    assert "decode packets" in screen  # the bar's label, drawn while reading
    piped = cli("decode", str(path))
    assert piped.returncode == 0 and piped.stderr == ""
    assert "decode packets" not in piped.stdout


def test_plan_command_prints_the_plan_the_daemon_runs(tmp_path):
    """`flowsieve plan --config` compiles as the daemon does (one planner configuration): the
    same bits, signatures, ASCs and residuals as GET /prefilter of a collector on that config.
    Before, plan used unlimited bits while the daemon used a budget of 64."""
    from fastapi.testclient import TestClient

    from api.app import create_app
    from collector.config import load_settings
    from collector.daemon.service import Collector
    queries = tmp_path / "q.sql"
    queries.write_text(Path(data_file("example.sql")).read_text() + """
-- name: web
SELECT time/60 AS t, count(*) AS n FROM packets WHERE protocol = 6 AND dst_port IN (80, 443, 8080)
GROUP BY time/60;
""")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"var_dir: {tmp_path / 'var'}\ninitial_queries: {queries}\n"
                   "planner: {bit_budget: 2, max_j: 2}\nasc: {min_constants: 3}\n")
    c = Collector(load_settings(cfg))
    c.start(with_sources=False, with_spark=False)
    try:
        with TestClient(create_app(c)) as client:
            daemon = client.get("/prefilter").json()
    finally:
        c.stop()
    out = cli("plan", "--queries", str(queries), "--config", str(cfg), "--format", "json")
    assert out.returncode == 0, out.stderr
    planned = json.loads(out.stdout)

    def shape(doc):
        preds = {p["id"]: p["text"] for p in doc["predicates"]}
        return ([sorted(preds[i] for i in b["predicates"]) for b in doc["bits"]],
                [(q["name"], q["signature"], q["ascs"], sorted(preds[i] for i in q["residual"]))
                 for q in doc["queries"]],
                [a["attribute"] for a in doc["ascs"]],
                [(t["folder"], sorted(t["queries"].items())) for t in doc["aggregate_trees"]])
    assert shape(planned) == shape(daemon)
    # the aggregate tree of the 60 s folder: every query derived from one maintained node, never
    # dearer than one aggregation per query
    tree = planned["aggregate_trees"][0]
    assert tree["folder"] == "60" and set(tree["queries"]) == {"udp_bw", "dns_req", "dns_resp",
                                                              "web"}
    assert tree["cost"] <= tree["naive_cost"]
    maintained = {n["node"] for n in tree["nodes"] if n["maintained"]}
    assert all(path[0] in maintained for path in tree["queries"].values())
    assert len(planned["bits"]) == 2 and planned["ascs"]  # the budget and the ASC rule applied
    # --bits overrides the config's budget
    more = json.loads(cli("plan", "--queries", str(queries), "--config", str(cfg), "--bits",
                          "none", "--format", "json").stdout)
    assert len(more["bits"]) > 2


def test_py4j_logs_no_traceback_of_a_lost_jvm():
    """Py4J logs a connection lost to a dead JVM on the root logger with its traceback (seen
    on a real JVM's OutOfMemoryError): a command prints only its one error line."""
    import logging

    from api.cli import quiet_py4j
    root = logging.getLogger()
    filters = list(root.filters)
    try:
        quiet_py4j()
        record = root.makeRecord("root", logging.ERROR, "/x/site-packages/py4j/java_gateway.py",
                                 1056, "Exception while sending command.", (), None)
        assert not root.filter(record)
        mine = root.makeRecord("root", logging.ERROR, "/x/collector/replay.py", 1, "kept", (),
                               None)
        assert root.filter(mine)
    finally:
        root.filters[:] = filters
        logging.getLogger("py4j").setLevel(logging.NOTSET)


def test_the_daemon_logs_no_py4j_retry_and_nothing_of_py4j_once_stopping():
    """The daemon's filter of Py4J's root-logger lines: a call that lost its connection to the
    JVM is retried after an INFO line with the lost call's traceback (seen once in ten stops
    under load, the callback's Py4JJavaError then an empty answer): never logged; an error of
    Py4J's is logged while running and dropped once a stop was asked (the JVM goes away under
    the calls in flight)."""
    import logging
    from types import SimpleNamespace

    from api.cli import _Py4JRetry
    collector = SimpleNamespace(stop_requested=None)
    keep = _Py4JRetry(collector)

    def record(level, path):
        return logging.getLogger().makeRecord("root", level, path, 1056,
                                              "Exception while sending command.", (), None)
    py4j = "/x/site-packages/py4j/java_gateway.py"
    assert not keep.filter(record(logging.INFO, py4j))
    assert keep.filter(record(logging.ERROR, py4j))
    assert keep.filter(record(logging.INFO, "/x/collector/daemon/service.py"))
    collector.stop_requested = 1.0
    assert not keep.filter(record(logging.ERROR, py4j))
    assert keep.filter(record(logging.ERROR, "/x/collector/daemon/service.py"))


def test_decode_to_parquet_equals_dpkt(tmp_path):
    """``--format parquet --output FILE``: addresses as text, ports, TTL, DNS names and times of
    every packet as dpkt reads them (IPv4 and IPv6)."""
    path = capture("wikipedia.pcap")
    names = ["time", "src_ip", "dst_ip", "src_port", "dst_port", "ttl", "dns_qname"]
    out = tmp_path / "w.parquet"
    r = cli("decode", str(path), "--fields", ",".join(names), "--format", "parquet",
            "--output", str(out))
    assert r.returncode == 0 and r.stdout == "", r.stderr
    got = pq.read_table(out).to_pylist()
    want = packets(path)
    assert len(got) == len(want)
    for k, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g == {n: w[n] for n in names}, f"packet {k + 1}"


def test_decode_to_parquet_writes_a_row_group_per_batch(tmp_path):
    """The capture is never held whole: a row group per batch read (65,536 packets), and every
    packet as the trace generator's arrays say (not our decoder's word)."""
    n, t0 = 140_000, 1_700_000_040
    path = tmp_path / "groups.pcap"
    many_groups(path, n, t0)
    out = tmp_path / "g.parquet"
    r = cli("decode", str(path), "--fields", "ts,src_ip,src_port,dst_port", "--format",
            "parquet", "--output", str(out))
    assert r.returncode == 0, r.stderr
    f = pq.ParquetFile(out)
    assert f.num_row_groups == 3 and f.metadata.num_rows == n
    t = f.read()
    assert t.schema.field("ts").type == pa.timestamp("ns", tz="UTC")
    i = np.arange(n)
    ts_ns = (t0 * 1_000_000 + i * (50_000_000 // n)) * 1000
    assert (t.column("ts").cast(pa.int64()).to_numpy() == ts_ns).all()
    assert t.column("src_ip").to_pylist() == [str(ipaddress.IPv4Address(0x0A000000 + k // 7))
                                              for k in range(n)]
    assert (t.column("src_port").to_numpy() == 1024 + i % 7).all()
    assert set(t.column("dst_port").to_pylist()) == {9999}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g.parquet", "groups.pcap"]


def test_a_failed_decode_leaves_no_output_file(tmp_path):
    """A capture that turns corrupt after its first record: one error line, and the output
    file is neither made nor half written (it is renamed into place only when complete)."""
    out = tmp_path / "d.csv"
    r = cli("decode", str(capture("bad_first_header.pcap")), "--output", str(out))
    assert r.returncode != 0
    one_error_line(r, "caplen larger than the snapshot length at byte 40")
    assert list(tmp_path.iterdir()) == []
    ok = cli("decode", str(capture("dns_udp.pcap")), "--fields", "dns_qr,dns_qname", "--output",
             str(out))
    assert ok.returncode == 0 and ok.stdout == ""
    assert out.read_text() == "dns_qr,dns_qname\n0,www.tcpdump.org\n1,www.tcpdump.org\n"
