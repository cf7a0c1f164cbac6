"""The peers' query set in every tool's form.

``../shared/bench/peer-queries.json`` gives 50 filters as tshark display filters (``dfilter``),
BPF (``bpf``, what tcpdump reads) and nfdump filters (``nf``). This module adds flowsieve's SQL
(a packet count per minute; ``bench.spark_queries.bpf_to_sql``) and pmacct's form (a
``pre_tag_map`` entry whose BPF filter tags the packets a plugin counts), and keeps all five in
``bench/peers/queries.json`` so that the benchmark runs from a checkout alone.

``python -m bench.peers.queries`` writes that file again from the shared one.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from bench.spark_queries import bpf_to_sql

HERE = Path(__file__).resolve().parent
QUERIES = HERE / "queries.json"
SHARED = HERE.parents[2] / "shared" / "bench" / "peer-queries.json"
FORMS = ("dfilter", "bpf", "nf", "sql", "pmacct")


def name(i: int) -> str:
    return f"peer{i:02d}"


def with_forms(filters: list[dict]) -> list[dict]:
    """The shared filters with flowsieve's SQL and pmacct's pre_tag_map entry added."""
    out = []
    for i, f in enumerate(filters):
        sql = (f"-- name: {name(i)}\nSELECT time/60 AS t, count(*) AS pkts FROM packets "
               f"WHERE {bpf_to_sql(f['bpf'])} GROUP BY time/60;")
        out.append({"dfilter": f["dfilter"], "bpf": f["bpf"], "nf": f["nf"], "sql": sql,
                    "pmacct": f"set_tag=1 filter='{f['bpf']}'"})
    return out


def load() -> list[dict]:
    return json.loads(QUERIES.read_text())


def sql(n: int | None = None) -> str:
    """The first ``n`` (default all) as one flowsieve query file."""
    return "\n".join(q["sql"] for q in load()[:n]) + "\n"


def main() -> int:
    QUERIES.write_text(json.dumps(with_forms(json.loads(SHARED.read_text())), indent=1) + "\n")
    print(QUERIES)
    return 0


if __name__ == "__main__":
    sys.exit(main())
