"""Spark SQL built as text (collector/spark/sqltext.py) against PySpark's own Column API: the
same literals, operators and functions give the same values and types in Spark."""

import math

import pytest
from pyspark.sql import Window
from pyspark.sql import functions as F

from collector.spark import sqltext as S

pytestmark = pytest.mark.slow

LITERALS = [0, -7, 2**31 - 1, 2**31, -(2**63), 1.5, -0.1, 1e-300, float("inf"), float("nan"),
            True, False, "", "it's", "back\\slash", "ünï €", b"", bytearray(8), b"\x00\xff\x10",
            None]


def test_literals_are_pyspark_s(spark):
    df = spark.range(1)
    got = S.select(df, *(S.lit(v).alias(f"c{i}") for i, v in enumerate(LITERALS)))
    want = df.select(*(F.lit(v).alias(f"c{i}") for i, v in enumerate(LITERALS)))
    assert [f.dataType for f in got.schema] == [f.dataType for f in want.schema]
    for g, w, v in zip(got.first(), want.first(), LITERALS, strict=True):
        if isinstance(v, float) and math.isnan(v):
            assert math.isnan(g)
        else:
            assert g == w, v


def test_expressions_equal_pyspark_s_columns(spark):
    rows = [(i, (i * 7919) % 23 - 11, f"n{i % 5}", bytes([i % 256, 255 - i % 256]))
            for i in range(40)]
    df = spark.createDataFrame(rows, "a bigint, b bigint, s string, x binary")
    pairs = {
        "arith": (S.col("a") * 3 - S.col("b") + 1, F.col("a") * 3 - F.col("b") + 1),
        "div": (S.col("a") / 4, F.col("a") / 4),
        "rsub": (10 - S.col("b"), 10 - F.col("b")),
        "neg": (-S.col("b"), -F.col("b")),
        "logic": ((S.col("a") > 5) & ~(S.col("b") == 0) | S.col("s").isin(["n1", "n3"]),
                  (F.col("a") > 5) & ~(F.col("b") == 0) | F.col("s").isin(["n1", "n3"])),
        "case": (S.when(S.col("b") < 0, S.lit("neg")).when(S.col("b") == 0, "zero")
                 .otherwise(S.col("s")),
                 F.when(F.col("b") < 0, F.lit("neg")).when(F.col("b") == 0, "zero")
                 .otherwise(F.col("s"))),
        "case_null": (S.when(S.col("b") > 0, S.col("b")), F.when(F.col("b") > 0, F.col("b"))),
        "bits": (S.shiftright(S.col("a"), 2).bitwiseAND(S.lit(3)),
                 F.shiftright(F.col("a"), 2).bitwiseAND(F.lit(3))),
        "hex": (S.conv(S.hex(S.reverse(S.col("x"))), 16, -10).cast("bigint"),
                F.conv(F.hex(F.reverse(F.col("x"))), 16, -10).cast("bigint")),
        "text": (S.concat_ws(":", S.col("s"), S.regexp_replace("s", "^n", "N$0"),
                             S.translate(S.col("s"), "n", "m")),
                 F.concat_ws(":", F.col("s"), F.regexp_replace("s", "^n", "N$0"),
                             F.translate(F.col("s"), "n", "m"))),
        "substring": (S.substring(S.col("x"), 2, 1), F.substring(F.col("x"), 2, 1)),
        "rlike": (S.col("s").rlike("[13]$"), F.col("s").rlike("[13]$")),
        "window": (S.row_number().over(S.Window.partitionBy("s").orderBy(
                       S.col("b").desc_nulls_last(), S.col("a").asc_nulls_last())),
                   F.row_number().over(Window.partitionBy("s").orderBy(
                       F.col("b").desc_nulls_last(), F.col("a").asc_nulls_last()))),
    }
    got = S.select(df, "a", *(e.alias(n) for n, (e, _) in pairs.items()))
    want = df.select("a", *(c.alias(n) for n, (_, c) in pairs.items()))
    assert [f.dataType for f in got.schema] == [f.dataType for f in want.schema]
    assert sorted(got.collect()) == sorted(want.collect())


def test_names_are_quoted(spark):
    df = spark.range(3).withColumnRenamed("id", "a.b `c`")
    out = S.select(df, S.col("a.b `c`").alias("x y"), S.col("`a.b ``c```"))
    assert out.columns == ["x y", "a.b `c`"]
    assert sorted(r[0] for r in out.collect()) == [0, 1, 2]


def test_an_expression_has_no_truth_value():
    with pytest.raises(ValueError):
        bool(S.col("a") == 1)


def test_local_rows_are_the_rows_given_and_spark_s_own(spark):
    """``local_rows``: the rows as given (texts with quotes and backslashes, bytes, numbers
    past 32 bits, NULLs), none when given none, as a local relation (no RDD in the plan)."""
    columns = {"node": "string", "_pat": "binary", "n": "int", "big": "bigint"}
    rows = [("src_ip#1", b"\x01\x00\xff", 3, 2**40), ("it's \\ ü", b"", 0, -1),
            (None, None, None, None)]
    frame = S.local_rows(spark, columns, rows)
    assert [(f.name, f.dataType.simpleString()) for f in frame.schema] == list(columns.items())
    got = [tuple(bytes(v) if isinstance(v, bytearray) else v for v in r)
           for r in frame.collect()]
    assert got == rows
    assert "ExistingRDD" not in frame._jdf.queryExecution().optimizedPlan().toString()
    assert S.local_rows(spark, columns, []).count() == 0
