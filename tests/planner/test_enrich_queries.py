"""Queries over enrichment fields: countries compared as their codes, AS numbers as integers,
both prefilter candidates; a plan unpacks what they are looked up by; a query reading a field no
configured database gives is refused where it names it."""

from __future__ import annotations

import pytest

from capture import enrich
from capture.fields import code_of, fields
from collector.pipeline import enrichment
from planner.ir import QueryError
from planner.plan import build_plan
from planner.query import parse_queries, parse_single
from tests.enrichtools import DATA


def test_country_predicates_are_codes_and_prefilter_bits():
    q = parse_single("SELECT time/60 AS t, src_asn, count(*) AS n FROM packets "
                     "WHERE dst_country = 'nl' AND src_country IN ('DE', 'fr') "
                     "GROUP BY time/60, src_asn", "c")
    atoms = {p.text: p.atoms[0] for p in q.predicates}
    assert set(atoms) == {"dst_country = 'NL'", "src_country IN ('DE', 'FR')"}
    assert atoms["dst_country = 'NL'"].values == (0x4E4C,)
    assert sorted(atoms["src_country IN ('DE', 'FR')"].values) == [code_of("DE"), code_of("FR")]
    plan = build_plan([q])
    assert all(p.cheap for p in plan.predicates)  # prefilter candidates like any small integer
    assert plan.bits
    assert {"src_ip", "dst_ip", "src_asn", "dst_country", "src_country"} <= \
        plan.unpack_fields("packets")


def test_flows_asn_reads_the_exported_as_too():
    q = parse_single("SELECT time/60 AS t, dst_asn, sum(bytes) AS b FROM flows "
                     "GROUP BY time/60, dst_asn", "f")
    assert {"dst_ip", "dst_as", "dst_asn"} <= build_plan([q]).unpack_fields("flows")
    assert fields("samples")["src_asn"].groupable


@pytest.mark.parametrize("where,reason", [
    ("src_country < 'NL'", "supports =, != and IN"),
    ("src_country = 5", "quoted text"),
    ("src_country = 'NLD'", "not a two-letter code"),
    ("src_country BETWEEN 'A' AND 'B'", "integer field"),
])
def test_bad_country_predicates(where, reason):
    with pytest.raises(QueryError, match=reason):
        parse_single(f"SELECT src_ip FROM packets WHERE {where}", "bad")


def test_a_field_without_its_database_is_refused_where_it_is_named():
    enrich.configure({"asn": (str(DATA / "GeoLite2-ASN-Test.mmdb"), {})})
    try:
        ok, bad = parse_queries(
            "-- name: ok\nSELECT time/60 AS t, src_asn, count(*) AS n FROM packets "
            "GROUP BY time/60, src_asn;\n"
            "-- name: bad\nSELECT time/60 AS t, count(*) AS n FROM packets\n"
            "WHERE dst_country = 'NL' GROUP BY time/60;")
        enrichment.check(ok)
        with pytest.raises(QueryError) as e:
            enrichment.check(bad)
        assert "dst_country needs an enrichment database: set enrich.country" in str(e.value)
        assert (e.value.line, e.value.col) == (2, 7)
    finally:
        enrich.configure({})
