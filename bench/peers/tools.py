"""The tools operators run today, each run over a capture with a set of the peers' queries, as
its documentation says to run it. A runner returns per-query packet counts and its times.

- ``pmacctd`` in pcap-file mode: one ``print`` plugin per query, each with its own
  ``pre_tag_map`` (the query's BPF sets tag 1) and ``pre_tag_filter: 1`` (in file mode pmacctd
  ignores ``aggregate_filter``), aggregated on the tag; large pipes (the default 4 MB ones lose
  30-40 % of records silently, FACTS). A daemon takes at most 32 plugins: more queries run as
  several daemons at once. Reading a savefile, pmacctd first sleeps 2 s: a fixed cost.
- ``tshark -q -z io,stat,0,<filter>,…``: one pass, every display filter a column.
- ``tcpdump --count -r FILE <bpf>``: one pass per query.
- ``nfpcapd -r FILE -w DIR`` (the capture as flows, once), then ``nfdump -R DIR -A srcip,dstip
  <filter>`` per query, its summary giving the packets.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

PMACCT_MAX_PLUGINS = 32  # per daemon
PMACCT_SLEEP_S = 2.0  # pmacctd sleeps this long before it reads a savefile
PMACCT_PIPE = 64 << 20  # bytes of queue per plugin; 4 MB loses records silently
PMACCT_BUFFER = PMACCT_PIPE // 10  # per transfer; 1:10 ran 1.6x faster than 1:100 and 1:1000
TOOLS = ("pmacctd", "tshark", "tcpdump", "nfdump")
BINARIES = {"pmacctd": ["pmacctd"], "tshark": ["tshark"], "tcpdump": ["tcpdump"],
            "nfdump": ["nfpcapd", "nfdump"]}
DEBIAN = {"pmacctd": "pmacct", "tshark": "tshark", "tcpdump": "tcpdump", "nfdump": "nfdump"}


class ToolError(RuntimeError):
    pass


@dataclass
class Run:
    """One tool over one capture with ``len(counts)`` queries. ``wall_s`` is the whole run;
    ``fixed_s`` the part of it that does not depend on the input (pmacctd's sleep)."""
    tool: str
    counts: list[int]
    wall_s: float
    fixed_s: float = 0.0
    detail: dict = field(default_factory=dict)

    def pps(self, packets: int) -> float:
        return packets / max(1e-9, self.wall_s - self.fixed_s)


def missing(tool: str) -> list[str]:
    return [b for b in BINARIES[tool] if shutil.which(b) is None]


def _run(cmd: list[str], timeout: float, **kw) -> subprocess.CompletedProcess:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    except subprocess.TimeoutExpired as e:
        raise ToolError(f"{cmd[0]} did not finish in {timeout:.0f} s") from e
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        raise ToolError(f"{cmd[0]} exited {proc.returncode}: {tail[0]}")
    return proc


# ---------------------------------------------------------------------------------- pmacctd
def pmacct_config(pcap: Path, queries: list[dict], work: Path) -> str:
    """One daemon's configuration: a print plugin per query, counting the packets its own
    pre_tag_map tags."""
    names = [f"q{i:02d}" for i in range(len(queries))]
    lines = ["daemonize: false", f"pcap_savefile: {pcap}", "aggregate: tag",
             "print_output: csv", "print_refresh_time: 86400",
             f"plugin_pipe_size: {PMACCT_PIPE}", f"plugin_buffer_size: {PMACCT_BUFFER}",
             "plugins: " + ", ".join(f"print[{n}]" for n in names)]
    for n, q in zip(names, queries, strict=True):
        (work / f"{n}.map").write_text(q["pmacct"] + "\n")
        lines += [f"pre_tag_map[{n}]: {work / f'{n}.map'}", f"pre_tag_filter[{n}]: 1",
                  f"print_output_file[{n}]: {work / f'{n}.csv'}"]
    return "\n".join(lines) + "\n"


def _pmacct_count(path: Path) -> int:
    """Packets in a print plugin's CSV (TAG,PACKETS,BYTES); no file: nothing matched."""
    if not path.exists():
        return 0
    rows = [line.split(",") for line in path.read_text().splitlines()[1:] if line.strip()]
    return sum(int(r[1]) for r in rows)


def pmacctd(pcap: Path, queries: list[dict], timeout: float = 1800) -> Run:
    with tempfile.TemporaryDirectory(prefix="peers-pmacct-") as d:
        work = Path(d)
        chunks = [queries[i:i + PMACCT_MAX_PLUGINS]
                  for i in range(0, len(queries), PMACCT_MAX_PLUGINS)]
        # as even as the plugin limit allows: 50 queries run as 25 + 25
        per = -(-len(queries) // len(chunks))
        chunks = [queries[i:i + per] for i in range(0, len(queries), per)]
        procs, dirs = [], []
        t = time.perf_counter()
        for k, chunk in enumerate(chunks):
            sub = work / f"d{k}"
            sub.mkdir()
            conf = sub / "pmacctd.conf"
            conf.write_text(pmacct_config(pcap, chunk, sub))
            dirs.append(sub)
            procs.append(subprocess.Popen(["pmacctd", "-f", str(conf)], text=True,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
        logs = []
        try:
            for p in procs:
                logs.append(p.communicate(timeout=timeout)[0])
        except subprocess.TimeoutExpired as e:
            for p in procs:
                p.kill()
            raise ToolError(f"pmacctd did not finish in {timeout:.0f} s") from e
        wall = time.perf_counter() - t
        for p, log in zip(procs, logs, strict=True):
            if p.returncode != 0:
                raise ToolError(f"pmacctd exited {p.returncode}: "
                                f"{(log.strip().splitlines() or ['no output'])[-1]}")
        counts = [_pmacct_count(sub / f"q{i:02d}.csv")
                  for sub, chunk in zip(dirs, chunks, strict=True) for i in range(len(chunk))]
    return Run("pmacctd", counts, wall, PMACCT_SLEEP_S, {"daemons": len(chunks)})


# ----------------------------------------------------------------------------------- tshark
def _io_stat_counts(out: str, n: int) -> list[int]:
    """Frames per filter of ``-z io,stat,0,…``'s one interval row."""
    row = next((line for line in out.splitlines() if "<>" in line), None)
    if row is None:
        raise ToolError("tshark printed no io,stat interval row")
    cells = [c.strip() for c in row.strip().strip("|").split("|")][1:]
    if len(cells) != 2 * n:  # a frames cell and a bytes cell per filter
        raise ToolError(f"tshark io,stat row has {len(cells)} cells for {n} filters")
    return [int(c) for c in cells[0::2]]


def tshark(pcap: Path, queries: list[dict], timeout: float = 3600) -> Run:
    spec = ",".join(["io,stat,0"] + [q["dfilter"] for q in queries])
    t = time.perf_counter()
    proc = _run(["tshark", "-n", "-q", "-r", str(pcap), "-z", spec], timeout)
    return Run("tshark", _io_stat_counts(proc.stdout, len(queries)), time.perf_counter() - t)


# ---------------------------------------------------------------------------------- tcpdump
def tcpdump(pcap: Path, queries: list[dict], timeout: float = 600) -> Run:
    counts = []
    t = time.perf_counter()
    for q in queries:
        proc = _run(["tcpdump", "--count", "-n", "-r", str(pcap), q["bpf"]], timeout)
        m = re.search(r"^(\d+) packets?$", proc.stdout + proc.stderr, re.M)
        if m is None:
            raise ToolError(f"tcpdump --count printed no count for {q['bpf']!r}")
        counts.append(int(m.group(1)))
    return Run("tcpdump", counts, time.perf_counter() - t)


# ----------------------------------------------------------------------------------- nfdump
def _nfdump_packets(out: str) -> int:
    """Packets of ``nfdump -o csv``'s summary (``flows,bytes,packets,…`` then its values)."""
    lines = out.strip().splitlines()
    for i, line in enumerate(lines[:-1]):
        if line.startswith("flows,bytes,packets"):
            return int(lines[i + 1].split(",")[2])
    raise ToolError("nfdump printed no summary")


def nfdump(pcap: Path, queries: list[dict], timeout: float = 600) -> Run:
    with tempfile.TemporaryDirectory(prefix="peers-nfdump-") as d:
        t = time.perf_counter()
        _run(["nfpcapd", "-r", str(pcap), "-w", d], timeout)
        t_flows = time.perf_counter() - t
        counts = [_nfdump_packets(_run(["nfdump", "-R", d, "-A", "srcip,dstip", "-o", "csv",
                                        q["nf"]], timeout).stdout) for q in queries]
        wall = time.perf_counter() - t
    return Run("nfdump", counts, wall, 0.0, {"nfpcapd_s": t_flows})


RUNNERS = {"pmacctd": pmacctd, "tshark": tshark, "tcpdump": tcpdump, "nfdump": nfdump}
