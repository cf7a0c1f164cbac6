"""The fair baseline (issue 41): what a competent Spark user writes for flowsieve's queries over
a finite capture. The decoded fields (flowsieve's decoder: addresses as 16 bytes) as a Parquet
DataFrame, ``.cache()``d and counted before the clock starts; one Spark SQL statement per query
(time buckets, keys, aggregates, ``count(DISTINCT …)``, ``approx_count_distinct``, HAVING,
ORDER BY … LIMIT per window with a window function, WITH … JOIN as Spark SQL writes it); a
Spark session on Spark's own defaults (no JVM option of flowsieve's); the answers collected
inside the clock and printed (addresses to text) outside it.
"""

from __future__ import annotations

import time
from pathlib import Path

from capture.fields import IP, fields, ip_text, key_field
from planner.ir import Query


def _lit_ip(v: int) -> str:
    return f"X'{v:032x}'"


def atom_sql(a, cat, text_ips: bool = False) -> str:
    """One atom of a WHERE in Spark SQL over the decoded columns (``text_ips``: addresses
    decoded as text, as a user who writes them to CSV keeps them)."""
    f = a.field
    if text_ips and cat[f].kind == IP:
        s = _text_ip_atom(a)
    elif a.op == "prefix":
        value, length = a.values
        if length % 8 == 0:
            s = f"substring({f}, 1, {length // 8}) = X'{f'{value:032x}'[:length // 4]}'"
        else:  # the whole bytes, then the bits of the last one
            whole, bits = divmod(length, 8)
            head = f"substring({f}, 1, {whole}) = X'{f'{value:032x}'[:whole * 2]}' AND " \
                if whole else ""
            byte = (value >> (120 - 8 * whole)) & 0xFF
            mask = (0xFF << (8 - bits)) & 0xFF
            s = (f"({head}(conv(hex(substring({f}, {whole + 1}, 1)), 16, 10) & {mask}) "
                 f"= {byte & mask})")
    elif a.op == "mask":
        s = f"({f} & {a.values[0]}) = {a.values[1]}"
    elif a.op == "regexp":
        s = f"{f} RLIKE '{a.values[0]}'"
    elif a.op == "contains":
        s = f"instr({f}, CAST('{a.values[0]}' AS BINARY)) > 0"
    elif cat[f].kind == IP:
        vals = ", ".join(_lit_ip(v) for v in a.values)
        s = f"{f} IN ({vals})" if a.op in ("in", "=") else f"{f} {a.op} {vals}"
    elif a.op == "in":
        s = f"{f} IN ({', '.join(map(_value, a.values))})"
    elif a.op == "between":
        s = f"{f} BETWEEN {_value(a.values[0])} AND {_value(a.values[1])}"
    else:
        s = f"{f} {a.op} {_value(a.values[0])}"
    return f"NOT ({s})" if a.negated else s


def _text_ip_atom(a) -> str:
    """An address atom over text addresses: equality as text, an IPv4 network of whole bytes
    as a text prefix."""
    import ipaddress

    from planner.ir import format_prefix
    f = a.field
    if a.op == "prefix":
        net = ipaddress.ip_network(format_prefix(*a.values))
        if net.prefixlen == net.max_prefixlen:  # a host: its text
            return f"{f} = '{net.network_address}'"
        if net.version != 4 or net.prefixlen % 8:
            raise NotImplementedError(f"{a.text} over text addresses")
        head = ".".join(str(net.network_address).split(".")[:net.prefixlen // 8])
        return f"startswith({f}, '{head}.')"
    vals = ", ".join(f"'{ip_text(v.to_bytes(16, 'big'))}'" for v in a.values)
    if a.op in ("in", "="):
        return f"{f} IN ({vals})"
    return f"{f} {a.op} {vals}"


def _value(v) -> str:
    return f"'{v}'" if isinstance(v, str) else str(v)


def where_sql(q: Query, text_ips: bool = False) -> str:
    cat = fields(q.stream)
    parts = ["(" + " OR ".join(atom_sql(a, cat, text_ips) for a in p.atoms) + ")"
             for p in q.predicates]
    return " AND ".join(parts) or "true"


def _key_sql(name: str) -> str:
    base, bits = key_field(name)
    if bits is None:
        return base
    whole = bits // 8
    return f"concat(substring({base}, 1, {whole}), X'{'00' * (16 - whole)}')"


def _agg_sql(o) -> str:
    if o.func == "count":
        return "count(*)"
    if o.func == "count_distinct":
        return f"count(DISTINCT {o.field})"
    if o.func == "approx_distinct":
        return f"approx_count_distinct({o.field})"
    return f"{o.func}({o.field})"


def select_sql(q: Query, text_ips: bool = False) -> str:
    """An aggregate query (no join) as one Spark SQL statement over ``packets``."""
    bucket = f"CAST(floor(time / {q.period}) AS BIGINT)"
    cols, keys = [], [bucket]
    for o in q.outputs:
        if o.kind == "bucket":
            cols.append(f"{bucket} AS `{o.name}`")
        elif o.kind == "key":
            cols.append(f"{_key_sql(o.field)} AS `{o.name}`")
            keys.append(_key_sql(o.field))
        else:
            cols.append(f"{_agg_sql(o)} AS `{o.name}`")
    sql = (f"SELECT {', '.join(cols)} FROM packets WHERE {where_sql(q, text_ips)} "
           f"GROUP BY {', '.join(keys)}")
    if q.having:
        sql += " HAVING " + " AND ".join(f"`{c.column}` {c.op} {c.value}" for c in q.having)
    bucket_name = next(o.name for o in q.outputs if o.kind == "bucket")
    return _limited(sql, q, bucket_name)


def _limited(sql: str, q: Query, bucket_name: str) -> str:
    """ORDER BY … LIMIT per window: a row number per window."""
    if q.limit is None:
        return sql
    order = ", ".join(f"`{c}` {'DESC' if d else 'ASC'}" for c, d in q.order) or f"`{bucket_name}`"
    return (f"SELECT * FROM (SELECT *, row_number() OVER (PARTITION BY `{bucket_name}` "
            f"ORDER BY {order}) AS _rank FROM ({sql})) WHERE _rank <= {q.limit}")


def join_sql(q: Query) -> str:
    """A WITH … JOIN query as Spark SQL: its parts as CTEs, the join and its expressions as
    written (sqlglot prints them in Spark's dialect)."""
    j = q.join
    ctes = [f"{p.name.rpartition('.')[2]} AS ({select_sql(p)})" for p in j.parts]
    on = [f"{j.left}.{b} = {j.right}.{b2}" for b, b2 in
          [(next(o.name for o in j.part(j.left).outputs if o.kind == "bucket"),
            next(o.name for o in j.part(j.right).outputs if o.kind == "bucket"))]]
    on += [f"{j.left}.{a} = {j.right}.{b}" for a, b in j.on]
    sel = ", ".join(f"{node.sql(dialect='spark')} AS `{name}`" for name, node in j.select)
    sql = (f"WITH {', '.join(ctes)} SELECT {sel} FROM {j.left} "
           f"{'LEFT ' if j.how == 'left' else ''}JOIN {j.right} ON {' AND '.join(on)}")
    if j.where is not None:
        sql += f" WHERE {j.where.sql(dialect='spark')}"
    left_bucket = next(o.name for o in j.part(j.left).outputs if o.kind == "bucket")
    bucket = next((name for name, node in j.select
                   if node.sql() == f"{j.left}.{left_bucket}"), j.select[0][0])
    return _limited(sql, q, bucket)


def statement(q: Query) -> str:
    return join_sql(q) if q.join is not None else select_sql(q)


def spark_session(app_name: str = "baseline"):
    """A Spark session as a Spark user starts one: Spark's defaults, the machine's cores, the
    driver memory flowsieve's Spark gets (2 GiB), no UI."""
    import os
    import sys

    from pyspark.sql import SparkSession
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    spark = (SparkSession.builder.master("local[*]").appName(app_name)
             .config("spark.driver.memory", "2g").config("spark.ui.enabled", "false")
             .config("spark.ui.showConsoleProgress", "false").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def start_session(app_name: str):
    """``spark_session``, timed: (session, seconds to start the JVM)."""
    t0 = time.perf_counter()
    spark = spark_session(app_name)
    return spark, time.perf_counter() - t0


def cached_packets(spark, raw: Path):
    """The decoded tuples as a cached temp view ``packets``, materialised (outside any clock);
    the number of tuples."""
    df = spark.read.parquet(str(raw)).cache()
    n = df.count()
    df.createOrReplaceTempView("packets")
    return n


def run_queries(spark, queries: list[Query]) -> tuple[dict[str, list], float]:
    """Each query's statement run and its rows collected (timed), then printed as flowsieve
    prints them (not timed): {name: rows as dicts of its output columns}, seconds."""
    t0 = time.perf_counter()
    got = {q.name: spark.sql(statement(q)).collect() for q in queries}
    wall = time.perf_counter() - t0
    out = {}
    for q in queries:
        names = [o.name for o in q.outputs] if q.join is None else [n for n, _ in q.join.select]
        out[q.name] = [{n: (ip_text(bytes(r[n])) if isinstance(r[n], bytes | bytearray)
                            else r[n]) for n in names} for r in got[q.name]]
    return out, wall
