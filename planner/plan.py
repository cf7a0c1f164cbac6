"""The compiled plan: versioned, JSON-serialisable, pure (no I/O).

It lists the base predicates (cost, cheap or not, measured selectivity), the prefilter bits
(conjunctions of cheap predicates), every query's slot and bit signature, and the residual
(expensive, or cheap but left out of the bit budget) predicates each query checks after the
prefilter. The collector compiles it into arrays for the numba prefilter.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from capture.fields import IP, STRING, enrichment_inputs, fields, key_field, key_kind
from planner.aggtree import (
    ROOT,
    AggNode,
    AggTree,
    edge_cost,
    naive_tree,
    one_sketch,
    randomized,
)
from planner.asc import ASC, add_candidate_arrows, asc_attributes, build_asc, single_attribute
from planner.charts import Chart, ChartOptions, NodeModel, node_model
from planner.cover import Cover, cover_matrix
from planner.field_groups import Unpacking, choose_unpacking
from planner.ir import RESIDUAL_OPS, Predicate, Query, expand
from planner.kernel_filter import bpf_expression
from planner.sizes import NodeSizes, TupleSample, string_key
from planner.slots import n_words

MAX_ASCS = 12
# beyond this many queries in one folder, queries with the same keys start as one node (the
# tree search is quadratic in its nodes)
MAX_TREE_TERMINALS = 48


@dataclass
class PredicateInfo:
    id: int
    predicate: Predicate
    cost: float
    cheap: bool
    selectivity: float | None = None

    def to_json(self) -> dict:
        return {"id": self.id, "text": self.predicate.text, "stream": self.predicate.stream,
                "fields": list(self.predicate.fields), "cost": self.cost, "cheap": self.cheap,
                "selectivity": self.selectivity}


@dataclass
class QueryPlan:
    query: Query
    slot: int
    predicates: list[int]  # all base predicate ids of the query
    signature: list[int]  # bit ids
    residual: list[int]  # predicate ids checked after the prefilter
    ascs: list[str] = field(default_factory=list)  # attributes whose ASC decides predicates

    def to_json(self) -> dict:
        q = self.query
        return {"name": q.name, "slot": self.slot, "stream": q.stream, "period_s": q.period,
                "keys": list(q.keys), "predicates": self.predicates,
                "signature": self.signature, "ascs": self.ascs, "residual": self.residual,
                "text": q.text}


@dataclass
class FolderTree:
    """The aggregate tree of one (stream, period) folder (seed 002): which nodes the LFTA
    maintains while tuples stream, and how each query is derived from them."""

    stream: str
    folder: str
    period: int
    tree: AggTree
    naive_cost: float
    sizes: dict[AggNode, float]
    costs: dict[AggNode, float]  # each node's edge from its parent
    names: dict[int, str]  # slot -> query name
    models: dict[AggNode, NodeModel] = field(default_factory=dict)  # maintained nodes
    charts: dict[tuple, Chart] = field(default_factory=dict)  # (keys, slots) -> OM chart

    def _maintained(self) -> list[tuple[AggNode, tuple[str, ...], tuple[int, ...]]]:
        serves: dict[AggNode, list[int]] = {}
        for slot, v in self.tree.queries.items():
            serves.setdefault(self.tree.path(v)[0], []).append(slot)
        return [(m, tuple(sorted(m.keys)), tuple(sorted(serves[m])))
                for m in self.tree.maintained if m in serves]

    def maintained(self) -> list[tuple[tuple[str, ...], list[int]]]:
        """(keys, slots) of each maintained node; the slots are those of the queries derived
        from it (a query's tuples reach exactly one LFTA table)."""
        return [(keys, list(slots)) for _, keys, slots in self._maintained()]

    def chart(self, keys, slots) -> Chart | None:
        """The OM chart of the maintained node (keys, slots), if the plan built one."""
        return self.charts.get((tuple(keys), tuple(slots)))

    def build_charts(self, options: ChartOptions) -> None:
        """Algorithm 1 for each maintained node a hash table can hold (no string key). Plans
        that send rows of a window before it closes (pass-through, age flushes) are candidates
        only where the period is at most Spark's watermark delay: Spark's watermark follows the
        newest window start it read, so a row of the next window read early would make the
        partials other nodes and probes still hold for this one late."""
        if self.period > options.watermark_delay_s:
            options = replace(options, passthrough=False, age_fraction=1.0)
        self.charts = {(keys, slots): Chart.build(self.models[m], options)
                       for m, keys, slots in self._maintained()
                       if m in self.models and not any(key_kind(self.stream, k) == STRING
                                                       for k in keys)}

    def to_json(self) -> dict:
        t = self.tree
        return {"stream": self.stream, "folder": self.folder, "period_s": self.period,
                "cost": t.cost, "naive_cost": self.naive_cost, "tuples": self.sizes.get(ROOT),
                "nodes": [{"node": v.text(), "keys": sorted(v.keys), "slots": sorted(v.slots),
                           "parent": t.parent[v].text(), "maintained": t.parent[v].root,
                           "size": self.sizes.get(v), "cost": self.costs.get(v)}
                          for v in t.nodes],
                "queries": {self.names[s]: [v.text() for v in t.path(v)]
                            for s, v in sorted(t.queries.items())},
                "charts": [{"keys": list(k), "slots": list(s), **c.to_json()}
                           for (k, s), c in self.charts.items()]}

    def explain(self) -> list[str]:
        t = self.tree
        lines = [f"  {self.stream}/{self.folder}: cost {t.cost:,.0f} per period vs "
                 f"{self.naive_cost:,.0f} with one aggregation per query "
                 f"({self.sizes.get(ROOT, 0):,.0f} tuples per period)"]

        def show(v: AggNode, depth: int) -> None:
            how = "maintained" if t.parent[v].root else "derived"
            lines.append(f"    {'  ' * depth}{v.text()} {how}, ~{self.sizes.get(v, 0):,.0f} "
                         f"rows, edge {self.costs.get(v, 0):,.0f}")
            for c in t.children(v):
                show(c, depth + 1)
        for m in t.maintained:
            show(m, 0)
        for (keys, slots), c in self.charts.items():
            lines.append(f"    OM chart of ({', '.join(keys) or 'no keys'}) for "
                         + ", ".join(self.names[s] for s in slots) + ":")
            lines += c.explain()
        for s, v in sorted(t.queries.items()):
            lines.append(f"    {self.names[s]}: " + " -> ".join(x.text() for x in t.path(v)))
        return lines


@dataclass
class Plan:
    version: int
    predicates: list[PredicateInfo]
    bits: list[tuple[int, ...]]
    queries: list[QueryPlan]
    cheap_cost: float
    bit_budget: int | None = None
    bpf: str = ""
    ascs: list[ASC] = field(default_factory=list)
    cover: Cover | None = None
    asc_min_constants: int = 16
    trees: list[FolderTree] = field(default_factory=list)

    def tree(self, stream: str, folder: str) -> FolderTree | None:
        for t in self.trees:
            if t.stream == stream and t.folder == folder:
                return t
        return None

    def stream_ascs(self, stream: str) -> list[ASC]:
        return [a for a in self.ascs if a.stream == stream]

    def by_name(self, name: str) -> QueryPlan:
        for qp in self.queries:
            if qp.query.name == name:
                return qp
        raise KeyError(name)

    def residual_order(self, stream: str) -> list[int]:
        """The stream's residual predicate ids in the order they start: cheapest first (a
        failed cheap predicate spares the expensive ones); A-Greedy reorders them on traffic
        (collector/pipeline/residual.py)."""
        used = {p for qp in self.queries if qp.query.stream == stream for p in qp.residual}
        return sorted(used, key=lambda p: (self.predicates[p].cost, p))

    def streams(self) -> list[str]:
        return sorted({qp.query.stream for qp in self.queries})

    def folders(self, stream: str) -> list[str]:
        """The spool folders this plan writes for a stream (periods and ``select``)."""
        return sorted({qp.query.folder for qp in self.queries if qp.query.stream == stream},
                      key=lambda f: (f == "select", int(f) if f.isdigit() else 0))

    def unpack_fields(self, stream: str) -> set[str]:
        """Catalogue fields the plan reads: predicates, keys, measures, time."""
        out = {"time", "ts"}
        for qp in self.queries:
            q = qp.query
            if q.stream != stream:
                continue
            out.update(key_field(k)[0] for k in q.node_keys)  # src_ip/24 reads src_ip
            out.update(q.measures)
            out.update(key_field(o.field)[0] for o in q.outputs if o.field)
            for p in q.predicates:
                out.update(p.fields)
        return out | enrichment_inputs(stream, out)  # src_asn reads src_ip

    def unpacking(self, stream: str) -> Unpacking:
        """The groups and single fields that cover what the plan reads (weighted set cover)."""
        return choose_unpacking(stream, self.unpack_fields(stream))

    def to_json(self) -> dict:
        return {
            "version": self.version,
            "cheap_cost": self.cheap_cost,
            "bit_budget": self.bit_budget,
            "predicates": [p.to_json() for p in self.predicates],
            "bits": [{"id": i, "predicates": list(b),
                      "text": " AND ".join(self.predicates[p].predicate.text for p in b)}
                     for i, b in enumerate(self.bits)],
            "ascs": [a.to_json() for a in self.ascs],
            "rectangles": [{"predicates": list(p), "queries": list(q)}
                           for p, q in (self.cover.rectangles if self.cover else [])],
            "candidate_rectangles": self.cover.candidates if self.cover else 0,
            "expected_invocations": self.cover.expected_invocations if self.cover else None,
            "queries": [qp.to_json() for qp in self.queries],
            "unpack_groups": {s: list(self.unpacking(s).groups) for s in self.streams()},
            "unpack": {s: self.unpacking(s).to_json() for s in self.streams()},
            "bpf": self.bpf,
            "aggregate_trees": [t.to_json() for t in self.trees],
            "residual_order": {s: self.residual_order(s) for s in self.streams()},
        }

    def explain(self) -> str:
        """The plan as text, for ``flowsieve plan``."""
        cheap = sum(p.cheap for p in self.predicates)
        lines = [f"plan version {self.version}: {len(self.queries)} queries, "
                 f"{len(self.predicates)} base predicates ({cheap} cheap), {len(self.bits)} "
                 f"prefilter bits (cheap cost <= {self.cheap_cost:g}, budget "
                 f"{'none' if self.bit_budget is None else self.bit_budget})", "",
                 "base predicates:"]
        for p in self.predicates:
            sel = "?" if p.selectivity is None else f"{p.selectivity:.4f}"
            kind = "cheap" if p.cheap else "expensive"
            lines.append(f"  p{p.id:<3} {kind:9} cost {p.cost:5g}  sel {sel:>6}  "
                         f"{p.predicate.text}")
        if self.cover is not None:
            how = ("largest drop in expected invocations" if self.cover.by_selectivity
                   else "most uncovered ones")
            lines += ["", f"rectangles chosen ({how}; {self.cover.candidates} candidates "
                      "after pruning):"]
            for p, q in self.cover.rectangles:
                lines.append(f"  {{{', '.join(f'p{x}' for x in p)}}} x {{{', '.join(q)}}}")
        lines += ["", "prefilter bits (after overlap elimination):"]
        for i, b in enumerate(self.bits):
            lines.append(f"  b{i:<3} " + " AND ".join(f"p{p}" for p in b))
        if self.cover is not None and self.cover.expected_invocations is not None:
            lines.append(f"\nexpected query invocations per tuple from the bits: "
                         f"{self.cover.expected_invocations:.3f} of {len(self.queries)} "
                         "(predicates independent; ASCs and residuals filter further)")
        if self.ascs:
            lines += ["", f"attribute selection constructs (>= {self.asc_min_constants} "
                      "constants):"]
            for a in self.ascs:
                lines.append(f"  {a.attribute} [{a.stream}]: {a.n_regions} regions, predicates "
                             + " ".join(f"p{p}" for p in a.predicates)
                             + ", slots " + " ".join(map(str, a.slots)))
                names = [b.attribute for b in self.stream_ascs(a.stream)]
                for r, q in enumerate(a.qrb):
                    bits = "".join("1" if q >> s & 1 else "0" for s in a.slots)
                    cab = ",".join(names[j] for j in a.cab[r]) or "-"
                    lines.append(f"      {a.region_text(r):>28}  qrb {bits}  cab {cab}")
            for s in self.streams():
                order = self.stream_ascs(s)
                if order:
                    lines.append(f"  initial macro-sequence ({s}): "
                                 + " -> ".join(a.attribute for a in order)
                                 + " (re-chosen on traffic)")
        lines += ["", "queries:"]
        for qp in self.queries:
            q = qp.query
            sig = " ".join(f"b{b}" for b in qp.signature) or "(none: always invoked)"
            res = " ".join(f"p{p}" for p in qp.residual) or "-"
            ascs = f"  ascs {' '.join(qp.ascs)}" if qp.ascs else ""
            lines.append(f"  {q.name} [slot {qp.slot}, {q.stream}, "
                         f"{'select' if q.is_selection else f'every {q.period} s'}]  "
                         f"signature {sig}{ascs}  residual {res}")
        for s in self.streams():
            order = self.residual_order(s)
            if order:
                lines.append(f"  residual order ({s}, cheapest first; A-Greedy reorders on "
                             "traffic): " + " -> ".join(f"p{p}" for p in order))
        if self.trees:
            lines += ["", "aggregate trees (LFTA tables maintained while tuples stream; the "
                      "others derived from them when a window closes):"]
            for t in self.trees:
                lines += t.explain()
        for s in self.streams():
            u = self.unpacking(s)
            if s == "packets":
                lines.append(f"\nkernel filter (live capture): {self.bpf or 'none'}")
            lines.append(f"\nunpack ({s}): groups {', '.join(u.groups) or '-'}; single fields "
                         f"{', '.join(u.singles) or '-'}; cost {u.cost:g} (each field alone "
                         f"{u.cost_singly:g}, every group {u.cost_all:g})")
        return "\n".join(lines)


def build_plan(queries: list[Query], slots: dict[str, int] | None = None, version: int = 1,
               cheap_cost: float = 10.0, bit_budget: int | None = None,
               selectivity: dict[str, float] | None = None, max_j: int = 4,
               asc_min_constants: int | None = 16,
               samples: dict[str, TupleSample] | None = None, hfta_row_cost: float = 200.0,
               tree_seed: int = 0, aggregate_tree: bool = True,
               charts: ChartOptions | None = None) -> Plan:
    """Compile queries into a plan; ``slots`` maps query names to slots (default: in order);
    ``selectivity`` maps predicate texts to measured selectivities; attributes with at least
    ``asc_min_constants`` constants get an ASC (None: no ASCs); ``samples`` are the
    engine's tuple samples per stream (node sizes of the aggregate trees), ``hfta_row_cost`` the
    cost of one partial row through Spark relative to hashing one tuple; without
    ``aggregate_tree`` every query keeps its own LFTA table (seed 002's baseline); ``charts``
    builds an OM chart for every maintained node (planner/charts.py), each with an equal share
    of Spark's merge rate."""
    queries = expand(queries)  # a joined query's parts are planned as ordinary queries
    if slots is None:
        slots = {q.name: i for i, q in enumerate(queries)}
    ids: dict[Predicate, int] = {}
    infos: list[PredicateInfo] = []
    for q in queries:
        for p in q.predicates:
            if p not in ids:
                ids[p] = len(infos)
                cost = p.cost
                # variable-offset fields (dns_qname) are never prefilter candidates
                fixed = not any(fields(p.stream)[f].variable_offset for f in p.fields) \
                    and not any(a.op in RESIDUAL_OPS for a in p.atoms)  # residual only
                infos.append(PredicateInfo(len(infos), p, cost, fixed and cost <= cheap_cost,
                                           (selectivity or {}).get(p.text)))
    # bits or ASC (DESIGN): attributes with many constants or ranges go to an ASC
    asc_attr: dict[int, str] = {}
    ascs: list[ASC] = []
    pids_of = {q.name: [ids[p] for p in q.predicates] for q in queries}  # hashed once
    for stream in sorted({q.stream for q in queries}):
        cheap = [i.predicate for i in infos if i.cheap and i.predicate.stream == stream]
        attrs = asc_attributes(cheap, asc_min_constants) if asc_min_constants else set()
        stream_ascs = []
        for attr in sorted(attrs):
            preds = {i.id: i.predicate for i in infos if i.cheap and i.predicate.stream == stream
                     and single_attribute(i.predicate) == attr}
            uses = {}
            for q in queries:
                mine = [p for p in pids_of[q.name] if p in preds]
                if mine:
                    uses[slots[q.name]] = mine
            stream_ascs.append(build_asc(attr, stream, preds, uses))
            asc_attr.update(dict.fromkeys(preds, attr))
        all_slots = sum(1 << slots[q.name] for q in queries if q.stream == stream)
        stream_ascs.sort(key=lambda a: (-len(a.slots), a.attribute))
        # at most MAX_ASCS per stream (the kernel tabulates every set of evaluated ASCs); the
        # attributes used by the fewest queries go back to the bits
        for a in stream_ascs[MAX_ASCS:]:
            for pid in a.predicates:
                del asc_attr[pid]
        stream_ascs = stream_ascs[:MAX_ASCS]
        add_candidate_arrows(stream_ascs, all_slots)
        ascs.extend(stream_ascs)
    matrix: dict[int, set[str]] = {}
    for q in queries:
        for p in pids_of[q.name]:
            if infos[p].cheap and p not in asc_attr:
                matrix.setdefault(p, set()).add(q.name)
    # one prefilter per stream: bits never mix streams
    bits: list[tuple[int, ...]] = []
    covers = []
    for stream in sorted({q.stream for q in queries}):
        rows = {p: qs for p, qs in matrix.items() if infos[p].predicate.stream == stream}
        cover = cover_matrix(rows, bit_budget, {p: infos[p].selectivity for p in rows}, max_j)
        covers.append(cover)
        bits.extend(cover.bits)
    qplans = []
    bit_sets = [frozenset(b) for b in bits]
    for q in queries:
        pids = pids_of[q.name]
        own = set(pids)
        sig = [i for i, b in enumerate(bit_sets) if b <= own]
        covered = {p for i in sig for p in bits[i]} | {p for p in pids if p in asc_attr}
        residual = [p for p in pids if p not in covered]
        q_ascs = sorted({asc_attr[p] for p in pids if p in asc_attr})
        qplans.append(QueryPlan(q, slots[q.name], pids, sig, residual, q_ascs))
    qplans.sort(key=lambda qp: qp.slot)
    merged = None
    if covers:
        exp = [c.expected_invocations for c in covers]
        merged = Cover([r for c in covers for r in c.rectangles], bits,
                       sum(c.candidates for c in covers),
                       None if None in exp else sum(exp), all(c.by_selectivity for c in covers))
    trees = aggregate_trees(qplans, infos, samples or {}, hfta_row_cost, tree_seed,
                            aggregate_tree)
    if charts is not None:
        nodes = sum(len(t.models) for t in trees)
        share = replace(charts, spark_rows_per_s=charts.spark_rows_per_s / max(1, nodes))
        for t in trees:
            t.build_charts(share)
    return Plan(version, infos, bits, qplans, cheap_cost, bit_budget,
                bpf=bpf_expression(queries), ascs=ascs, cover=merged,
                asc_min_constants=asc_min_constants or 0, trees=trees)


def packable(stream: str, keys: frozenset[str]) -> bool:
    """Whether one key holds a node of these keys (collector/keys.py): at most one sketch,
    and at most one string field (its bytes end the key), a sketched one included (the
    LFTA's table keys on the field it sketches)."""
    return one_sketch(keys) and sum(string_key(stream, k) for k in keys) <= 1


def aggregate_trees(qplans: list[QueryPlan], infos: list[PredicateInfo],
                    samples: dict[str, TupleSample], hfta_row_cost: float, seed: int,
                    search: bool = True) -> list[FolderTree]:
    """An aggregate tree per (stream, period) folder (seed 002's Algorithm 1, filter variant)."""
    out = []
    words = n_words(max((qp.slot for qp in qplans), default=0) + 1)
    folders: dict[tuple[str, str], list[QueryPlan]] = {}
    for qp in qplans:
        if not qp.query.is_selection:
            folders.setdefault((qp.query.stream, qp.query.folder), []).append(qp)
    for (stream, folder), qps in sorted(folders.items()):
        share = {}
        for qp in qps:
            sel = [infos[p].selectivity for p in qp.predicates]
            share[qp.slot] = float(np.prod([x for x in sel if x is not None])) if sel else 1.0
        sizes = NodeSizes(stream, qps[0].query.period, samples.get(stream), share)

        def hash_cost(v: AggNode, stream=stream) -> float:
            return 1.0 + (sum(3 if key_kind(stream, k) == IP else 1 for k in v.keys) + words) / 4

        terminals = {qp.slot: AggNode(frozenset(qp.query.node_keys), frozenset({qp.slot}))
                     for qp in qps}
        if search and len(terminals) > MAX_TREE_TERMINALS:
            by_keys: dict[frozenset, set[int]] = {}
            for slot, v in terminals.items():
                by_keys.setdefault(v.keys, set()).add(slot)
            terminals = {slot: AggNode(v.keys, frozenset(by_keys[v.keys]))
                         for slot, v in terminals.items()}
        naive_plan = naive_tree(terminals, sizes, hash_cost, hfta_row_cost, sizes.tuples_of)
        naive = naive_plan.cost
        tree = randomized(terminals, sizes, hash_cost, seed=seed, out_cost=hfta_row_cost,
                          stream_size=sizes.tuples_of,
                          packable=lambda keys, stream=stream: packable(stream, keys)) \
            if search else naive_plan
        edge = edge_cost(sizes, hash_cost, hfta_row_cost, sizes.tuples_of)
        period = qps[0].query.period
        out.append(FolderTree(stream, folder, period, tree, naive,
                              {v: sizes(v) for v in [ROOT, *tree.nodes]},
                              {v: edge(p, v) for v, p in tree.parent.items()},
                              {qp.slot: qp.query.name for qp in qps},
                              {m: node_model(period, sizes(m), sizes.tuples_of(m),
                                             sizes.tuples())
                               for m in tree.maintained}))
    return out
