"""The daemon's sFlow listener (``type: sflow``): datagrams from an agent over loopback answered by
a query FROM samples and one FROM counters; a clean stop commits each agent's datagram and
sample sequences, and what the agent sent while the daemon was down is counted as lost after
the restart (as the NetFlow listener counts it); GET /exporters shows the agent."""

from __future__ import annotations

import socket
import time

import httpx
import pytest

from tests import sflowgen as g
from tests.processes import (
    answers,
    daemon_config,
    daemon_ready,
    free_port,
    metric,
    start_daemon,
    stop_daemon,
    wait_for,
)

pytestmark = pytest.mark.slow

AGENT = "192.0.2.77"
QUERIES = """-- name: per_agent
SELECT time/2 AS t, agent, count(*) AS n, sum(est_packets) AS p, sum(wirelen) AS b
FROM samples GROUP BY time/2, agent;
-- name: https_out
SELECT time/2 AS t, dst_port, count(*) AS n FROM samples WHERE protocol = 6 AND src_port = 443
GROUP BY time/2, dst_port;
-- name: ifaces
SELECT time/2 AS t, agent, if_index, max(in_octets) AS octets FROM counters
GROUP BY time/2, agent, if_index;
"""
SAMPLES_PER_DATAGRAM = 3
RATE = 10


def datagram(seq: int, uptime_ms: int) -> bytes:
    """Datagram ``seq``: three flow samples of data source 7 (numbered on from the datagrams
    before it) and a counter sample of interface 7 whose octets grow with ``seq``."""
    first = (seq - 1) * SAMPLES_PER_DATAGRAM + 1
    generic = dict.fromkeys(g.GENERIC, 0)
    generic.update(if_index=7, if_type=6, if_speed=10**9, if_status=3, in_octets=1000 * seq)
    return g.datagram(AGENT, 0, seq, uptime_ms, [
        *(g.flow_sample(s, (0, 7), RATE, RATE * s, 0, (0, 7), (0, 9),
                        [g.raw_header(g.frame(), stripped=4)])
          for s in range(first, first + SAMPLES_PER_DATAGRAM)),
        g.counter_sample(seq, (0, 7), [g.generic_if(generic)])])


def send(port: int, seqs, t0: float) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for seq in seqs:
            s.sendto(datagram(seq, 3_600_000 + int((time.time() - t0) * 1000)),
                     ("127.0.0.1", port))
            time.sleep(0.01)


def test_sflow_listener_answers_and_counts_what_a_restart_lost(tmp_path):
    listen = free_port()
    cfg, port = daemon_config(tmp_path, [f"{{type: sflow, name: fabric, listen: "
                                         f"['127.0.0.1:{listen}']}}"], QUERIES)
    base = f"http://127.0.0.1:{port}"
    t0 = time.time()
    decoded = [0]

    def flow_samples() -> float:
        return metric(httpx.get(f"{base}/metrics", timeout=10).text,
                      "flowsieve_sflow_samples_total",
                      'kind="flow",source="fabric"')

    logged = tmp_path / "daemon.log"
    with open(logged, "w") as log:
        proc = start_daemon(cfg, log)
        try:
            wait_for(lambda: daemon_ready(proc, base, logged), 240, "the daemon ready")
            send(listen, range(1, 21), t0)
            wait_for(lambda: flow_samples() >= 60, 60, "60 flow samples decoded")
            decoded[0] = flow_samples()
        finally:
            stop_daemon(proc)  # a clean stop: the sequences are committed
        # datagrams 21..25 are sent while the daemon is down: nobody receives them
        proc = start_daemon(cfg, log)
        try:
            wait_for(lambda: daemon_ready(proc, base, logged), 240, "the daemon ready again")
            send(listen, range(26, 31), t0)
            wait_for(lambda: flow_samples() >= 15, 60, "15 more flow samples decoded")
            text = httpx.get(f"{base}/metrics", timeout=10).text
            lost = metric(text, "flowsieve_flow_sequence_lost_total",
                          f'exporter="{AGENT}",source="fabric"')
            samples_lost = metric(text, "flowsieve_sflow_samples_lost_total",
                                  f'agent="{AGENT}",source="fabric"')
            assert (lost, samples_lost) == (5, 15)
            [exp] = httpx.get(f"{base}/exporters", timeout=10).json()
            [st] = exp["streams"]
            assert exp["exporter"] == AGENT and st["protocol"] == "sflow"
            assert st["sequence"]["lost"] == 5 and st["samples"]["lost"] == 15
            assert st["sequence"]["next"] == 31
            # every window answered: the samples of both runs, the counters' growing octets
            client = httpx.Client(base_url=base, timeout=30)
            end = time.time()
            for q in ("per_agent", "https_out", "ifaces"):  # each stream's Spark query
                wait_for(lambda q=q: (answers(client, q)[1] or 0) > end, 120,
                         f"{q}'s windows closed")
            rows, _ = answers(client, "per_agent")
            https, _ = answers(client, "https_out")
            ifaces, _ = answers(client, "ifaces")
            client.close()
        finally:
            stop_daemon(proc)
    assert decoded[0] == 60
    n = sum(r["n"] for r in rows)
    assert n == 75 and {r["agent"] for r in rows} == {AGENT}
    assert sum(r["p"] for r in rows) == 75 * RATE
    assert sum(r["b"] for r in rows) == 75 * len(g.frame())  # the frame, FCS stripped
    assert sum(r["n"] for r in https) == 75 and {r["dst_port"] for r in https} == {50123}
    assert max(r["octets"] for r in ifaces) == 30_000 and {r["if_index"] for r in ifaces} == {7}
