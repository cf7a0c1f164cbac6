"""The telemetry applications (bench/telemetry/apps.sql) through ``replay`` and through the
daemon (registered at start, answers read over REST) on a generated backbone-shaped capture with
attacks injected at known hosts and windows: every answer equals the pandas truth computed from
the generator's own arrays, and each application reports the injected attacks and nothing
else."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from api.replay import replay
from bench.telemetry.attacks import COLUMNS, capture, expected_keys, frame, truth
from collector.config import Settings
from planner.query import parse_queries
from tests.processes import daemon_config, start_daemon, stop_daemon, wait_for
from tests.reference import packets, rows_of

pytestmark = pytest.mark.slow
APPS = Path(__file__).parent.parent / "bench" / "telemetry" / "apps.sql"


def test_capture_says_what_the_arrays_say(tmp_path):
    """dpkt reads in the pcap the fields the truth takes from the arrays."""
    path, p, _ = capture(30_000, tmp_path, seed=7)
    df, ref = frame(p), packets(path)
    assert len(ref) == len(df)
    for col, field in [("src", "src_ip"), ("dst", "dst_ip"), ("dport", "dst_port"),
                       ("ip_len", "ip_len")]:
        assert [r[field] for r in ref] == [None if v == -1 else v for v in df[col]], field
    assert [r["tcp_flags"] for r in ref] == [None if f < 0 else f for f in df["tcp_flags"]]
    dns = [(r["dns_an_type"], r["dns_an_ttl"], r["dns_an_name"]) for r in ref]
    want = [(t, ttl, n) if n is not None else (None, None, None)
            for t, ttl, n in zip(df["an_type"], df["an_ttl"], df["an_name"], strict=True)]
    assert dns == want and sum(t == 16 for t, _, _ in dns) > 100


def check(got: dict[str, list[dict]], p: dict, want: dict[str, set]) -> None:
    """Every application's rows equal the truth, and their keys are the injected attacks."""
    right, attacks = truth(frame(p)), expected_keys(want)
    assert set(got) == set(COLUMNS) == set(attacks)
    for app, (keys, values) in COLUMNS.items():
        rows = {tuple(r[k] for k in keys): tuple(r[v] for v in values) for r in got[app]}
        assert len(rows) == len(got[app]), app  # one row per key
        assert rows == right[app], app
        assert set(rows) == attacks[app], app


@pytest.mark.parametrize("workers", [1, 3])
def test_applications_find_the_attacks(workers, spark, tmp_path):
    """Also with the capture read by three processes (byte ranges of one file, each with its
    own engine and LFTA): exact distinct counts and joins merge their partials in Spark."""
    path, p, want = capture(200_000, tmp_path)
    res = replay(path, parse_queries(APPS.read_text()), tmp_path / "work", spark,
                 settings=Settings(initial_queries=None, replay_workers=workers))
    assert res.error is None and res.workers == workers
    check({q.name: rows_of(q, t) for q, t in res.answers}, p, want)


def test_applications_through_the_daemon(tmp_path):
    """The daemon reads the capture with the applications registered at start; once its
    source is finished and Spark has answered the last window, every application's rows over
    REST equal the truth."""
    path, p, want = capture(200_000, tmp_path)
    source = f"{{type: pcap, name: attacks, path: {path}, loop: false, restamp: false}}"
    cfg, port = daemon_config(tmp_path, [source], APPS.read_text())
    end = (int(p["ts_us"].max()) // 1_000_000 // 60 + 1) * 60  # the last window's end
    log = open(tmp_path / "daemon.log", "w")
    proc = start_daemon(cfg, log)
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)

    def answered() -> dict[str, list[dict]] | None:
        got = {}
        for name in COLUMNS:
            r = client.get(f"/queries/{name}/results", params={"limit": 100_000})
            r.raise_for_status()
            body = r.json()
            if (body["complete_before"] or 0) < end:
                return None
            assert body["next_cursor"] is None
            got[name] = body["rows"]
        return got
    try:
        wait_for(lambda: client.get("/healthz").status_code == 200, 180, "the API")
        got = wait_for(answered, 300, "the last window answered")
    finally:
        client.close()
        stop_daemon(proc)
        log.close()
    check(got, p, want)
