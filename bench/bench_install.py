"""A fresh install's first run against its second (issue 56): from a clean clone of the commit,
``make run``'s own install step (``pip install -e '.[live]'`` then ``flowsieve prepare``), then
``flowsieve replay`` of the backbone trace (6M packets) with its 50 queries (``--format csv``,
the whole command) twice in a row. The first must take at most 1.2x the second: before
``prepare``, the first compiled every numba kernel and had no JVM class-data archive (30.2
against 15.2 s). The same clone's first run without what prepare made (an empty numba cache,
no archive) is measured too, as a fresh install's first run was. Each round is a new clone;
medians of 3 rounds.

``python bench/bench_install.py [--rounds N] [--packets N]``; figures in
``bench/results/install.json``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_spark import _sql, trace  # noqa: E402
from bench.common import CACHE, write_result  # noqa: E402


def user_env(**extra: str) -> dict[str, str]:
    """A user's shell: none of this interpreter's virtual environment."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON")}
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep)
                                  if not p.startswith(sys.prefix))
    return {**env, **extra}


def timed(cmd: list[str], cwd: Path, env: dict, out=subprocess.DEVNULL) -> float:
    t = time.perf_counter()
    r = subprocess.run(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.PIPE, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {r.stderr[-2000:]}")
    return time.perf_counter() - t


def one_round(k: int, pcap: Path, queries: Path) -> dict:
    home = Path(tempfile.mkdtemp(prefix=f"bench-install-{k}-", dir=CACHE))
    clone = home / "flowsieve"
    try:
        subprocess.run(["git", "clone", "--quiet", "--no-hardlinks", str(ROOT), str(clone)],
                       check=True)
        env = user_env()
        install = timed(["make", ".venv/.installed-runtime"], clone, env)
        flowsieve = str(clone / ".venv" / "bin" / "flowsieve")
        replay = [flowsieve, "replay", str(pcap), "--queries", str(queries), "--format", "csv"]
        first = timed(replay, clone, env)
        second = timed(replay, clone, env)
        # the first run of an install that did not prepare: no numba cache, no archive
        bare = home / "bare.yaml"
        bare.write_text(f"spark: {{class_archive_dir: {home / 'no-archive'}}}\n")
        unprepared = timed([*replay, "--config", str(bare)], clone,
                           user_env(NUMBA_CACHE_DIR=str(home / "no-numba-cache")))
        out = {"install_s": round(install, 1), "first_s": round(first, 2),
               "second_s": round(second, 2), "ratio": round(first / second, 3),
               "unprepared_first_s": round(unprepared, 2),
               "unprepared_ratio": round(unprepared / second, 3)}
        print(f"round {k}: {out}", flush=True)
        return out
    finally:
        archives = list((Path.home() / ".cache" / "flowsieve").glob("spark-*-job-classes.jsa*"))
        ours = clone / ".venv"
        if ours.exists():  # this clone's archive (its name holds a digest of its pyspark)
            r = subprocess.run([str(ours / "bin" / "python"), "-c",
                                "from collector.config import cache_dir;"
                                "from collector.spark.session import class_archive_path;"
                                "print(class_archive_path(cache_dir()))"],
                               cwd=clone, capture_output=True, text=True)
            mine = Path(r.stdout.strip()) if r.returncode == 0 else None
            for a in archives:
                if mine is not None and a.name.startswith(mine.name):
                    a.unlink(missing_ok=True)
        shutil.rmtree(home, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--packets", type=int, default=6_000_000)
    args = ap.parse_args()
    CACHE.mkdir(exist_ok=True)
    pcap, p = trace("backbone", args.packets, CACHE)
    queries = CACHE / "install-backbone.sql"
    queries.write_text(_sql("backbone", p))
    rounds = [one_round(k, pcap, queries) for k in range(args.rounds)]

    def med(key: str) -> float:
        return round(statistics.median(r[key] for r in rounds), 3)
    result = {"trace": "backbone", "packets": args.packets, "queries": 50,
              "rounds": rounds, "install_s": med("install_s"), "first_s": med("first_s"),
              "second_s": med("second_s"), "ratio": med("ratio"),
              "unprepared_first_s": med("unprepared_first_s"),
              "unprepared_ratio": med("unprepared_ratio"), "target_ratio": 1.2,
              "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                       capture_output=True, text=True).stdout.strip()}
    path = write_result("install", result)
    print(f"install (make run's step, prepare included) {result['install_s']} s; replay of "
          f"{args.packets:,} packets x 50 queries: first {result['first_s']} s, second "
          f"{result['second_s']} s, ratio {result['ratio']} (target <= 1.2); unprepared first "
          f"{result['unprepared_first_s']} s ({result['unprepared_ratio']}x); {path}")


if __name__ == "__main__":
    main()
