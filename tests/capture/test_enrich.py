"""Enrichment look-ups (capture/enrich/) against the ``maxminddb`` reader: MaxMind's own test
databases, and databases written here by ``mmdb-writer`` (IPv4 and IPv6, nested prefixes of
mixed lengths, IPv4-only, IPinfo's layout); corrupt files; the AS precedence; reloads."""

from __future__ import annotations

import ipaddress
import logging
import os
import random
import shutil

import maxminddb
import numpy as np
import pyarrow as pa
import pytest

from capture import enrich
from capture.enrich import Database, MmdbError, Networks
from capture.enrich.databases import Enrichment
from capture.enrich.dictionary import dictionary, publish
from capture.fields import code_of, code_text
from tests.enrichtools import (
    DATA,
    SHARED,
    address_column,
    oracle,
    probe_addresses,
    random_networks,
    write_db,
)

ASN_PATH = ("autonomous_system_number",)
COUNTRY_PATH = ("country", "iso_code")
# each attribute: the reader's path to it, and its code ('text': fields.code_of's hash)
PATHS = {"asn": (ASN_PATH, None), "as_name": (("autonomous_system_organization",), "text"),
         "country": (COUNTRY_PATH, "letters"), "continent": (("continent", "code"), "letters"),
         "city": (("city", "names", "en"), "text"),
         "region": (("subdivisions", "0", "iso_code"), "text")}


def expected(reader, addrs, attribute):
    path, codec = PATHS[attribute]
    if attribute == "region":  # a list in the record: its first subdivision
        values = [oracle(reader, a, ("subdivisions",)) for a in addrs]
        values = [v[0].get("iso_code") if v else None for v in values]
    else:
        values = [oracle(reader, a, path) for a in addrs]
    if codec is None:
        return [v or -1 for v in values]
    return [code_of(v, codec) if v else -1 for v in values]


def looked_up(db: Database, addrs: list[str], attribute: str) -> list[int]:
    """Record ids gathered, the look-up that gathers as it goes, and two columns at once: the
    same."""
    col = address_column(addrs)
    ok = np.ones(len(col), bool)
    out = db.gather(attribute, db.lookup(col, ok)).tolist()
    assert db.attribute(attribute, col, ok).tolist() == out
    a, b = db.index.values_pair(col, ok, col[::-1].copy(), ok, db.values[attribute])
    assert a.tolist() == out and b.tolist() == out[::-1]  # two columns in one pass
    return out


def assert_equal_reader(db, path, attribute: str, seed: int = 1) -> int:
    with maxminddb.open_database(str(path)) as reader:
        addrs = probe_addresses(reader, seed)
        want = expected(reader, addrs, attribute)
    got = looked_up(db, addrs, attribute)
    bad = [(a, w, g) for a, w, g in zip(addrs, want, got, strict=True) if w != g]
    assert not bad, f"{len(bad)} of {len(addrs)} differ, e.g. {bad[:5]}"
    return len(addrs)


SHARED_ATTRIBUTES = [(name, database, attribute) for name in SHARED
                     for database, attribute in (
                         [("asn", "asn"), ("asn", "as_name")] if "ASN" in name else
                         [("country", "country"), ("country", "continent")] +
                         ([("city", "city"), ("city", "region")] if "City" in name else []))]


@pytest.mark.parametrize("name,database,attribute", SHARED_ATTRIBUTES)
def test_shared_databases_equal_maxminddb(name, database, attribute):
    """MaxMind's test databases: every network's edges, their neighbours outside, addresses
    inside and random ones, IPv4 and IPv6, equal the reader's; each attribute (AS numbers and
    names, countries and continents, cities and regions), texts by their codes."""
    path = DATA / f"{name}.mmdb"
    db = Database(database, path)
    assert db.networks > 100
    with maxminddb.open_database(str(path)) as reader:
        want = expected(reader, probe_addresses(reader, 1), attribute)
    assert sum(w != -1 for w in want) > 20  # not vacuous
    assert assert_equal_reader(db, path, attribute) > 4000
    if PATHS[attribute][1] == "text":  # the texts published for the codes
        assert all(code_of(db.texts[int(c)], "text") == c for c in db.values[attribute] if c)


@pytest.mark.parametrize("name", SHARED)
def test_ipv4_mapped_addresses_are_ipv4(name):
    """The catalogue holds IPv4 as IPv4-mapped IPv6: ::ffff:a.b.c.d is looked up as a.b.c.d,
    which is also what the reader finds at ::ffff:a.b.c.d in MaxMind's databases (their
    alias of ::ffff:0:0/96 to the IPv4 tree)."""
    path = DATA / f"{name}.mmdb"
    attribute = "asn" if "ASN" in name else "country"
    db = Database(attribute, path)
    with maxminddb.open_database(str(path)) as reader:
        v4 = [a for a in probe_addresses(reader, 2, uniform=500) if ":" not in a]
        mapped = [f"::ffff:{a}" for a in v4]
        want = expected(reader, v4, attribute)
        assert expected(reader, mapped, attribute) == want
    assert looked_up(db, mapped, attribute) == want
    assert any(w != -1 for w in want)


def test_generated_database_equals_maxminddb(tmp_path):
    """A held-out database of 20,000 random nested prefixes, IPv4 and IPv6 (mmdb-writer)."""
    rng = random.Random(5)
    nets = random_networks(20_000, seed=5)
    path = write_db(tmp_path / "asn.mmdb",
                    {n: {"autonomous_system_number": rng.randint(1, 400_000)} for n in nets})
    db = Database("asn", path)
    with maxminddb.open_database(str(path)) as reader:
        assert db.networks == sum(1 for _ in reader)
    assert assert_equal_reader(db, path, "asn", seed=6) > 80_000


def test_ipv4_database_and_6to4(tmp_path):
    """An IPv4-only database answers IPv4 addresses and no IPv6 one; an IPv6 database's
    6to4 alias (2002::/16 to the IPv4 tree, as the reader writes it) answers as the IPv4
    address inside."""
    rng = random.Random(8)
    nets = [n for n in random_networks(3000, seed=8, v6_share=0) if "/" in n]
    path = write_db(tmp_path / "v4.mmdb",
                    {n: {"country": {"iso_code": rng.choice(["NL", "DE", "FR", "JP"])}}
                     for n in nets}, ip_version=4)
    db = Database("country", path)
    assert_equal_reader(db, path, "country", seed=9)
    assert looked_up(db, ["2001:db8::1", "1::"], "country") == [-1, -1]
    with maxminddb.open_database(str(DATA / "GeoIP2-Country-Test.mmdb")) as reader:
        db = Database("country", DATA / "GeoIP2-Country-Test.mmdb")
        v4 = [str(n.network_address) for n, _ in reader if n.version == 4][:50]
        words = [int(ipaddress.IPv4Address(a)) for a in v4]
        six = [f"2002:{w >> 16:x}:{w & 0xFFFF:x}::1" for w in words]
        assert expected(reader, six, "country") == expected(reader, v4, "country")
        assert looked_up(db, six, "country") == expected(reader, v4, "country")


def test_ipinfo_layout_and_record_paths(tmp_path):
    """IPinfo's free databases keep the AS as text ('AS13335') and the country as a string at
    the top: the default paths find both; a configured path replaces them."""
    rng = random.Random(3)
    nets = random_networks(2000, seed=3)
    recs = {n: {"asn": f"AS{rng.randint(1, 70000)}", "country": rng.choice(["US", "BR", "nl"]),
                "org": {"number": rng.randint(1, 9)}} for n in nets}
    path = write_db(tmp_path / "ipinfo.mmdb", recs)
    asn, country = Database("asn", path), Database("country", path)
    with maxminddb.open_database(str(path)) as reader:
        addrs = probe_addresses(reader, 4, per_network=1, uniform=200)
        want_asn = [int(v[2:]) if (v := oracle(reader, a, ("asn",))) else -1 for a in addrs]
        want_c = [code_of(v) if (v := oracle(reader, a, ("country",))) else -1 for a in addrs]
        want_org = [oracle(reader, a, ("org", "number")) or -1 for a in addrs]
    assert looked_up(asn, addrs, "asn") == want_asn
    assert looked_up(country, addrs, "country") == want_c
    assert code_text(code_of("nl")) == "NL"
    org = Database("asn", path, {"asn": "org.number"})
    assert looked_up(org, addrs, "asn") == want_org
    with pytest.raises(MmdbError, match="no attribute city"):
        Database("asn", path, {"city": "x"})


def test_corrupt_files_are_refused_with_a_reason(tmp_path):
    good = (DATA / "GeoLite2-ASN-Test.mmdb").read_bytes()
    cases = {
        "empty": b"",
        "text": b"hello, not a database\n" * 10,
        "no-tree": good[:100] + good[good.rfind(b"\xab\xcd\xefMaxMind.com"):],
        "cut-metadata": good[:-20],
    }
    for name, data in cases.items():
        p = tmp_path / f"{name}.mmdb"
        p.write_bytes(data)
        with pytest.raises(MmdbError) as e:
            Database("asn", p)
        assert str(p) in str(e.value)
    with pytest.raises(MmdbError, match="No such file"):
        Database("asn", tmp_path / "absent.mmdb")


def test_mutated_databases_never_crash(tmp_path):
    """2,000 seeded mutations of a database's tree and data: each loads (and then looks up
    without crashing) or is refused with an MmdbError."""
    good = bytearray((DATA / "GeoLite2-ASN-Test.mmdb").read_bytes())
    rng = np.random.default_rng(11)
    addrs = address_column(["1.128.0.1", "2001:db8::1", "12.81.92.7", "::1", "8.8.8.8"])
    loaded = refused = 0
    p = tmp_path / "m.mmdb"
    for _ in range(2000):
        data = bytearray(good)
        for at in rng.integers(0, len(data) - 60, rng.integers(1, 8)):
            data[at] = int(rng.integers(0, 256))
        p.write_bytes(bytes(data))
        try:
            db = Database("asn", p)
        except MmdbError:
            refused += 1
            continue
        ids = db.lookup(addrs, np.ones(len(addrs), bool))
        assert ((ids >= -1) & (ids < db.records)).all()
        loaded += 1
    assert loaded and refused


class Flows:
    """A stand-in batch of the flows stream: the exporter's src_as and the address."""

    stream = "flows"

    def __init__(self, addrs, sent):
        self.addrs, self.sent = address_column(addrs), np.array(sent, np.int64)

    def __len__(self):
        return len(self.sent)

    def column(self, name):
        return {"src_ip": self.addrs, "src_as": self.sent}[name]

    def ip_valid(self, name):
        return np.ones(len(self.sent), bool)


@pytest.mark.parametrize("precedence,want", [
    ("exporter", [7018, 1221, 1221, 64512, -1, 15169]),
    ("exporter-public", [7018, 1221, 1221, 1221, -1, 15169]),
    ("database", [1221, 1221, 1221, 1221, -1, 15169]),
])
def test_asn_precedence(precedence, want):
    """src_asn of flows: the exporter's AS against the database's (worked by hand: 1.128.0.0/11
    is AS1221 and 1.0.0.0/24 AS15169 in MaxMind's test database; 10.0.0.1 is in none)."""
    db = Database("asn", DATA / "GeoLite2-ASN-Test.mmdb")
    tb = Flows(["1.128.0.1", "1.128.0.2", "1.128.0.3", "1.128.0.4", "10.0.0.1", "1.0.0.1"],
               [7018, 0, -1, 64512, 0, 0])
    out = Enrichment({"asn": db}, precedence).apply(tb, ["src_asn"])
    assert out.column("src_asn").tolist() == want


def test_no_database_gives_null_and_is_missing():
    enrich.configure({})
    tb = Flows(["1.128.0.1"], [0])
    assert enrich.current().apply(tb, ["src_asn"]).column("src_asn").tolist() == [-1]
    assert enrich.missing("packets", ["src_asn", "dst_country", "src_ip"]) == [
        ("src_asn", "asn"), ("dst_country", "country")]
    assert enrich.missing("flows", ["src_asn"]) == []  # its exporter may send it


def test_reload_swaps_a_changed_file_and_keeps_the_last_good_one(tmp_path, caplog):
    """A changed file is reloaded and said so in the log; an unchanged one is neither (the
    reloader checks every few seconds); a broken one keeps the last good one."""
    path = tmp_path / "asn.mmdb"
    shutil.copy(DATA / "GeoLite2-ASN-Test.mmdb", path)
    first = enrich.configure({"asn": (str(path), {})})
    addrs = ["1.128.0.1", "9.9.9.9"]
    assert looked_up(first.databases["asn"], addrs, "asn") == [1221, -1]
    with caplog.at_level(logging.INFO):
        assert enrich.reload_changed() == []  # unchanged
    assert "reloaded" not in caplog.text
    write_db(path, {"9.9.9.0/24": {"autonomous_system_number": 19281}})
    os.utime(path, ns=(1, 1))  # a new stamp even within the clock's resolution
    with caplog.at_level(logging.INFO):
        assert enrich.reload_changed() == ["asn"]
    assert "enrichment reloaded: asn" in caplog.text
    assert enrich.current() is not first
    assert looked_up(enrich.current().databases["asn"], addrs, "asn") == [-1, 19281]
    path.write_bytes(b"garbage")
    errors = []
    assert enrich.reload_changed(lambda n, e: errors.append((n, str(e)))) == []
    assert errors and errors[0][0] == "asn" and "not a MaxMind DB" in errors[0][1]
    assert looked_up(enrich.current().databases["asn"], addrs, "asn") == [-1, 19281]
    enrich.configure({})


NETWORKS = """# the operator's prefixes
10.0.0.0/8: {name: corp, role: internal, site: ams1}
10.1.0.0/16: {name: lab, role: internal}
10.1.2.0/24: dmz
10.1.2.128/25: {site: fra2}
192.0.2.0/24: {name: docs, role: test}
2001:db8::/32: {name: v6corp, site: ams1}
2001:db8:5::/48: {role: transit}
"""


def test_networks_file_gives_the_most_specific_prefix(tmp_path):
    """enrich.networks worked by hand: nested prefixes, the most specific one's values (a value
    it lacks is NULL, not its parent's), IPv4 and IPv6, a bare name."""
    path = tmp_path / "networks.yaml"
    path.write_text(NETWORKS)
    nets = Networks(path)
    assert nets.networks == 7
    addrs = ["10.9.9.9", "10.1.9.9", "10.1.2.1", "10.1.2.200", "10.1.3.0", "11.0.0.0",
             "192.0.2.255", "192.0.3.0", "2001:db8:1::1", "2001:db8:5::9", "2001:db9::",
             "9.255.255.255"]
    want = {
        "name": ["corp", "lab", "dmz", None, "lab", None, "docs", None, "v6corp", None, None,
                 None],
        "role": ["internal", "internal", None, None, "internal", None, "test", None, None,
                 "transit", None, None],
        "site": ["ams1", None, None, "fra2", None, None, None, None, "ams1", None, None, None],
    }
    col = address_column(addrs)
    ok = np.ones(len(col), bool)
    for attribute, texts in want.items():
        got = nets.attribute(attribute, col, ok)
        assert [nets.texts.get(int(c)) if c >= 0 else None for c in got] == texts, attribute


@pytest.mark.parametrize("text,reason", [
    ("10.0.0.300/8: x\n", "does not appear to be an IPv4 or IPv6 network"),
    ("10.0.0.0/8: {name: x, colour: red}\n", "a name or a map of name, role, site"),
    ("- 10.0.0.0/8\n", "a map of prefix"),
    ("10.0.0.0/8: [x\n", "not YAML"),
])
def test_bad_networks_files_are_refused(tmp_path, text, reason):
    path = tmp_path / "networks.yaml"
    path.write_text(text)
    with pytest.raises(MmdbError, match=reason):
        Networks(path)


def test_dictionary_published_and_read(tmp_path):
    """Text codes' texts published by content (twice: one file) and read back; an unknown
    code and a NULL are NULL."""
    texts = {code_of(t, "text"): t for t in ("Google LLC", "Telstra", "Zürich")}
    first = publish(tmp_path, "asn", texts)
    assert publish(tmp_path, "asn", dict(texts)) == first
    assert len(list(tmp_path.iterdir())) == 1
    codes = [code_of("Zürich", "text"), None, 12345, code_of("Google LLC", "text")]
    assert dictionary(tmp_path).lookup(pa.array(codes, pa.int64())).to_pylist() == [
        "Zürich", None, None, "Google LLC"]
    assert dictionary(tmp_path / "absent").lookup(pa.array([1], pa.int64())).to_pylist() == \
        [None]
