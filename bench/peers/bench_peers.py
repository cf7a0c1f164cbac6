"""Side by side with the tools operators use (issue 12): flowsieve end to end (prefilter, LFTA,
aggregate trees, Spark) against pmacctd, tshark, tcpdump and nfpcapd + nfdump, on FACTS' uniform
peer trace (3M whole frames, 2,000 hosts) with the first 1, 10 and 50 of the peers' queries
(``bench/peers/queries.json``; how each tool is run: ``bench/peers/tools.py``).

Every tool's per-query packet counts must equal the numpy truth of the trace generator's arrays
(and so each other), or the run fails. Times are medians of 3 runs, taken in rounds (every
tool once per round). Packets/s leave out each tool's fixed start-up cost that does not depend on
the input: the JVM start for flowsieve, pmacctd's 2 s sleep before it reads a savefile; the
whole wall time is reported too.

``python bench/peers/bench_peers.py [--quick]``; figures in ``bench/results/peers.json`` and the
plot ``bench/results/peers.png``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.common import CACHE, RESULTS, write_result  # noqa: E402
from bench.peers import queries as peer_queries  # noqa: E402
from bench.peers.tools import DEBIAN, RUNNERS, Run, ToolError, missing  # noqa: E402
from bench.spark_queries import columns, truth  # noqa: E402
from bench.traces import trace  # noqa: E402
from planner.query import parse_queries  # noqa: E402

SETS = (1, 10, 50)
PACKETS = 3_000_000
QUICK_PACKETS = 200_000
TOOLS = ("flowsieve", *RUNNERS)


def flowsieve(n: int, nq: int) -> Run:
    """``flowsieve replay``'s path in a fresh process (bench_spark's ``full`` mode)."""
    from bench.bench_spark import measure
    doc = measure("full", "uniform", n, nq, 1800)
    if not doc.get("finished"):
        raise ToolError(f"flowsieve: {doc.get('failure')}")
    answers = doc["answers"]
    counts = [sum(r["pkts"] for r in answers.get(peer_queries.name(i), [])) for i in range(nq)]
    return Run("flowsieve", counts, doc["jvm_start_s"] + doc["wall_s"], doc["jvm_start_s"],
               {"rows_into_spark": doc["rows_into_spark"],
                "peak_rss_total_mib": doc["peak_rss_total_mib"]})


def run_tool(tool: str, pcap: Path, n: int, qs: list[dict]) -> Run:
    if tool == "flowsieve":
        return flowsieve(n, len(qs))
    return RUNNERS[tool](pcap, qs)


def summarize(runs: list[dict]) -> dict:
    out: dict = {}
    for tool in TOOLS:
        for nq in SETS:
            rs = [r for r in runs if r["tool"] == tool and r["queries"] == nq and r["correct"]]
            if rs:
                out[f"{tool}/{nq}"] = {
                    "pps": statistics.median(r["pps"] for r in rs),
                    "wall_s": statistics.median(r["wall_s"] for r in rs),
                    "fixed_s": statistics.median(r["fixed_s"] for r in rs), "runs": len(rs)}
    return out


def plot(summary: dict, path: Path, packets: int) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7.6, 4.2))
    for tool in TOOLS:
        pts = [(nq, summary[f"{tool}/{nq}"]["pps"]) for nq in SETS if f"{tool}/{nq}" in summary]
        if pts:
            ax.plot(*zip(*pts, strict=True), marker="o", label=tool,
                    linewidth=2.5 if tool == "flowsieve" else 1.2)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xticks(SETS, [str(s) for s in SETS])
    ax.set_xlabel("queries")
    ax.set_ylabel("packets/s (medians of 3)")
    ax.set_title(f"Uniform peer trace, {packets / 1e6:g}M packets, 2 cores")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table(summary: dict) -> str:
    lines = ["| tool | " + " | ".join(f"{nq} {'query' if nq == 1 else 'queries'}"
                                      for nq in SETS) + " |",
             "|---|" + "---|" * len(SETS)]
    for tool in TOOLS:
        cells = []
        for nq in SETS:
            s = summary.get(f"{tool}/{nq}")
            cells.append(f"{s['pps'] / 1e3:,.0f} k ({s['wall_s']:.1f} s)" if s else "failed")
        lines.append(f"| {tool} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="200k packets, one round (smoke)")
    ap.add_argument("--tools", nargs="+", choices=TOOLS, default=list(TOOLS))
    args = ap.parse_args()
    absent = {t: m for t in args.tools if t != "flowsieve" and (m := missing(t))}
    if absent:
        print("error: not installed: " + ", ".join(b for m in absent.values() for b in m) +
              " (apt-get install -y " + " ".join(DEBIAN[t] for t in absent) + ")")
        return 1
    n = QUICK_PACKETS if args.quick else PACKETS
    rounds = 1 if args.quick else 3
    pcap, p = trace("uniform", n, CACHE)
    qs = peer_queries.load()
    cols = columns(p)
    want = [sum(r["pkts"] for r in truth(q, p, cols))
            for q in parse_queries(peer_queries.sql())]
    del p, cols
    print(f"== uniform trace: {n:,} packets, {pcap.stat().st_size / 2**20:,.0f} MiB", flush=True)
    runs, failures = [], []
    for k in range(rounds):
        for nq in SETS:
            for tool in args.tools:
                try:
                    r = run_tool(tool, pcap, n, qs[:nq])
                except ToolError as e:
                    failures.append({"tool": tool, "queries": nq, "failure": str(e)})
                    print(f"   round {k + 1} {tool:9} {nq:2} queries: failed: {e}", flush=True)
                    continue
                wrong = [i for i, (a, b) in enumerate(zip(r.counts, want, strict=False))
                         if a != b] + ([len(r.counts)] if len(r.counts) != nq else [])
                doc = {"tool": tool, "queries": nq, "round": k + 1, "wall_s": r.wall_s,
                       "fixed_s": r.fixed_s, "pps": r.pps(n), "counts": r.counts,
                       "correct": not wrong, **r.detail}
                runs.append(doc)
                if wrong:
                    failures.append({"tool": tool, "queries": nq, "failure":
                                     f"counts differ from the truth at queries {wrong[:5]}"})
                print(f"   round {k + 1} {tool:9} {nq:2} queries: {doc['pps'] / 1e3:9,.0f} kpps,"
                      f" wall {r.wall_s:6.1f} s (fixed {r.fixed_s:.1f} s), "
                      f"{'counts equal' if not wrong else 'COUNTS DIFFER'}", flush=True)
    summary = summarize(runs)
    print(table(summary))
    if not args.quick:
        write_result("peers", {"packets": n, "trace": str(pcap.name), "truth": want,
                               "runs": runs, "failures": failures, "summary": summary})
        plot(summary, RESULTS / "peers.png", n)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
