"""Shared aggregate computation: aggregate trees (Nagaraj, Naidu, Rastogi, Satkin), with filters.

A node is a (group-by attributes, filter) pair; the filter is a set of query slots, and a node
takes the tuples whose query mask has any of its slots set (it keeps the query-bit pattern in its
key, so a finer filter is a selection of its rows). The root (⊤, ⊤) is the input stream. An edge
v1 → v2 exists when v1 covers v2 (v2's attributes ⊆ v1's and v2's slots ⊆ v1's) and costs
``sz(v1) · C_H(v2)``: hashing v1's rows (N tuples for the root) on v2's key. The root's children are
*maintained* while tuples stream (LFTA hash tables); every other node is *derived* from its
parent when its window closes. A tree's cost is the sum of its edges: the CPU cost of a period.
In flowsieve a maintained node's rows also pass through the HFTA (Spark merges the partials of
every capture daemon): ``out_cost`` per row is added to the root's edges, so a fine node that
serves many queries is weighed against the rows it sends to Spark.

Finding the cheapest tree containing every query's node is a directed Steiner problem (NP-hard,
Theorem 1). ``randomized`` is the paper's Algorithm 1 with its filter variant: each iteration adds
random unions of query nodes (and, for every node covering such a union, the two nodes between
them) to the nodes of the best tree so far, builds the partial aggregate graph on them, and
solves it with a directed Steiner approximation. The approximation here is Charikar et al.'s
level-2 greedy (repeatedly attach the "bunch" — one node and the terminals below it — of least
cost per terminal), which sees shared intermediate aggregates that a shortest-path heuristic
misses; the paper used Wong's dual ascent.
"""

from __future__ import annotations

import functools
import heapq
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field


@functools.total_ordering
@dataclass(frozen=True)
class AggNode:
    """Group-by attributes and a filter (query slots); the root has ``root`` set. Nodes sort
    by their sorted attributes and slots: a total order, so a plan never depends on the order
    a set of nodes was iterated in (frozensets compare as subsets, which sorted by the order
    of the input, and that changed with each process's string hashing)."""

    keys: frozenset[str]
    slots: frozenset[int]
    root: bool = False
    _order: tuple = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_order", (self.root, sorted(self.keys), sorted(self.slots)))

    def __lt__(self, other: AggNode) -> bool:
        return self._order < other._order

    def covers(self, other: AggNode) -> bool:
        if self.root:
            return not other.root
        return not other.root and other.keys <= self.keys and other.slots <= self.slots

    def union(self, other: AggNode) -> AggNode:
        return AggNode(self.keys | other.keys, self.slots | other.slots)

    def text(self) -> str:
        if self.root:
            return "stream"
        keys = ", ".join(sorted(self.keys)) or "∅"
        return f"({keys} | slots {','.join(map(str, sorted(self.slots)))})"


ROOT = AggNode(frozenset(), frozenset(), root=True)

# sz(v): result rows of a node per period (the root: tuples per period); C_H(v): cost of hashing
# one row on v's key
SizeFn = Callable[[AggNode], float]
HashCostFn = Callable[[AggNode], float]


@dataclass
class AggTree:
    """A tree: each non-root node's parent, its cost, and each query's node."""

    parent: dict[AggNode, AggNode]
    cost: float
    queries: dict[int, AggNode] = field(default_factory=dict)  # slot -> its node

    @property
    def nodes(self) -> list[AggNode]:
        return sorted(self.parent)

    @property
    def maintained(self) -> list[AggNode]:
        """The root's children: the LFTA tables kept while tuples stream."""
        return sorted(v for v, p in self.parent.items() if p.root)

    def children(self, v: AggNode) -> list[AggNode]:
        return sorted(c for c, p in self.parent.items() if p == v)

    def path(self, v: AggNode) -> list[AggNode]:
        """The nodes from a maintained node down to ``v``: how v's answer is derived."""
        out = [v]
        while not self.parent[out[-1]].root:
            out.append(self.parent[out[-1]])
        return out[::-1]


def edge_cost(size: SizeFn, hash_cost: HashCostFn, out_cost: float = 0.0,
              stream_size: SizeFn | None = None) -> Callable[[AggNode, AggNode], float]:
    """The cost of edge u → w: hashing u's rows on w's key, plus shipping a maintained node's
    rows to the HFTA. ``stream_size(w)``, when given, is how many of the stream's tuples reach
    a maintained node w (the prefilter passes a node only its filter's tuples); else all."""
    def cost(u: AggNode, w: AggNode) -> float:
        if not u.root:
            return size(u) * hash_cost(w)
        n = size(u) if stream_size is None else stream_size(w)
        return n * hash_cost(w) + size(w) * out_cost
    return cost


def memo_edges(edge: Callable[[AggNode, AggNode], float]
               ) -> Callable[[AggNode, AggNode], float]:
    """``edge`` with each pair's cost computed once (Algorithm 1 meets the same edges in
    every iteration)."""
    cache: dict[tuple[AggNode, AggNode], float] = {}

    def cost(u: AggNode, w: AggNode) -> float:
        got = cache.get((u, w))
        if got is None:
            got = cache[u, w] = edge(u, w)
        return got
    return cost


def tree_cost(parent: dict[AggNode, AggNode], size: SizeFn, hash_cost: HashCostFn,
              out_cost: float = 0.0, stream_size: SizeFn | None = None,
              edge: Callable[[AggNode, AggNode], float] | None = None) -> float:
    edge = edge or edge_cost(size, hash_cost, out_cost, stream_size)
    return sum(edge(p, v) for v, p in parent.items())


def naive_tree(queries: dict[int, AggNode], size: SizeFn, hash_cost: HashCostFn,
               out_cost: float = 0.0, stream_size: SizeFn | None = None) -> AggTree:
    """One aggregation per query, each from the stream (no sharing)."""
    parent = dict.fromkeys(set(queries.values()), ROOT)
    return AggTree(parent, tree_cost(parent, size, hash_cost, out_cost, stream_size),
                   dict(queries))


Edges = dict[AggNode, list[tuple[AggNode, float]]]


def _distances(succ: Edges, src: AggNode) -> tuple[dict[AggNode, float], dict[AggNode, AggNode]]:
    """Cheapest path costs (and predecessors) from ``src`` in the partial aggregate graph
    (``succ``: each node's edges, to the nodes it covers)."""
    dist = {src: 0.0}
    prev: dict[AggNode, AggNode] = {}
    heap = [(0.0, 0, src)]
    tick = 1
    while heap:
        d, _, u = heapq.heappop(heap)
        if d > dist[u]:
            continue
        for w, c in succ[u]:
            nd = d + c
            if nd < dist.get(w, float("inf")):
                dist[w], prev[w] = nd, u
                heapq.heappush(heap, (nd, tick, w))
                tick += 1
    return dist, prev


def steiner(nodes: Sequence[AggNode], terminals: Iterable[AggNode], size: SizeFn,
            hash_cost: HashCostFn, out_cost: float = 0.0, stream_size: SizeFn | None = None,
            edge: Callable[[AggNode, AggNode], float] | None = None
            ) -> dict[AggNode, AggNode]:
    """A directed Steiner tree from the root to ``terminals`` over the graph on ``nodes``
    (level-2 greedy): returns each tree node's parent. ``edge``: the edge costs (default:
    ``edge_cost`` of the size and cost functions)."""
    inf = float("inf")
    nodes = [ROOT, *[v for v in nodes if not v.root]]
    edge = edge or edge_cost(size, hash_cost, out_cost, stream_size)
    succ = {u: [(w, edge(u, w)) for w in nodes if w is not u and u.covers(w)] for u in nodes}
    paths = {u: _distances(succ, u) for u in nodes}
    parent: dict[AggNode, AggNode] = {}
    in_tree = {ROOT}
    left = set(terminals) - in_tree
    # each hub's terminals by their distance from it; the cheapest way to reach each hub from
    # the tree (distance, tree node), kept up to date as the tree grows
    below = {hub: sorted((paths[hub][0].get(t, inf), t) for t in left) for hub in nodes}
    reach = {hub: (0.0, hub) if hub in in_tree else
             min((paths[t][0].get(hub, inf), t) for t in in_tree) for hub in nodes}
    while left:
        best = None  # (density, hub, attach-from, terminals taken)
        for hub in nodes:
            start, src = reach[hub]
            if start == inf:
                continue
            total, k = start, 0
            for d, t in below[hub]:
                if t not in left:
                    continue
                if d == inf:
                    break
                total += d
                k += 1
                if best is None or total / k < best[0] - 1e-12:
                    best = (total / k, hub, src, k)
        if best is None:
            raise ValueError("a query's node is unreachable from the stream")
        _, hub, src, k = best
        chosen = [t for _, t in below[hub] if t in left][:k]
        before = set(in_tree)
        _attach(parent, in_tree, paths[src][1], src, hub)
        for t in chosen:
            _attach(parent, in_tree, paths[hub][1], hub, t)
        left -= in_tree
        for t in sorted(in_tree - before):
            for v in nodes:
                reach[v] = (0.0, v) if v in in_tree else \
                    min(reach[v], (paths[t][0].get(v, inf), t))
    return parent


def tightened(parent: dict[AggNode, AggNode], terminals: Iterable[AggNode]
              ) -> dict[AggNode, AggNode]:
    """The tree with each shared node cut down to what the nodes below it read: the union of
    their attributes and filters (the random unions Algorithm 1 adds may carry attributes and
    slots no query under them needs, which cost a wider key, more tuples and, with a string
    attribute, an LFTA that passes every tuple through). A node left serving one node is
    dropped, that node taking its place; a query's node stays as it is."""
    kids: dict[AggNode, list[AggNode]] = {}
    for v, p in parent.items():
        kids.setdefault(p, []).append(v)
    queries = set(terminals)
    out: dict[AggNode, AggNode] = {}

    def build(v: AggNode) -> list[AggNode]:
        """The nodes that stand for v's subtree (attached to v's parent by the caller)."""
        below = [n for c in sorted(kids.get(v, ())) for n in build(c)]
        if v in queries:
            top = v
        elif len(below) <= 1:
            return below
        else:
            top = AggNode(frozenset().union(*(n.keys for n in below)),
                          frozenset().union(*(n.slots for n in below)))
        for n in below:
            if n != top:
                out[n] = top
        return [top]
    for c in sorted(kids.get(ROOT, ())):
        for n in build(c):
            out[n] = ROOT
    return out


def _attach(parent, in_tree, prev, src, dst) -> None:
    """Add the cheapest path src → dst to the tree (nodes already in it keep their parent)."""
    path = [dst]
    while path[-1] != src:
        path.append(prev[path[-1]])
    for child, par in zip(path[-2::-1], path[::-1], strict=False):
        if child not in in_tree:
            parent[child] = par
            in_tree.add(child)


def one_sketch(keys: frozenset[str]) -> bool:
    """A node's rows carry at most one sketch (approx_count_distinct's ``~f`` keys)."""
    return sum(k.startswith("~") for k in keys) <= 1


def randomized(queries: dict[int, AggNode], size: SizeFn, hash_cost: HashCostFn,
               c1: int = 8, c2: int = 8, seed: int = 0, out_cost: float = 0.0,
               stream_size: SizeFn | None = None,
               packable: Callable[[frozenset[str]], bool] = one_sketch) -> AggTree:
    """Algorithm 1 with the filter variant: ``c1`` iterations of ``c2`` random unions;
    a union whose keys a row cannot hold (``packable``) is no candidate."""
    rng = random.Random(seed)
    edge = memo_edges(edge_cost(size, hash_cost, out_cost, stream_size))
    terminals = sorted(set(queries.values()))
    best = naive_tree(queries, size, hash_cost, out_cost, stream_size)
    keep = set(terminals)
    # the filter variant's first candidates: one node over the filters of every key set
    by_keys: dict[frozenset[str], AggNode] = {}
    for v in terminals:
        by_keys[v.keys] = by_keys[v.keys].union(v) if v.keys in by_keys else v
    keep |= set(by_keys.values())
    for _ in range(c1):
        extra: set[AggNode] = set()
        for _ in range(c2):
            pick = rng.sample(terminals, rng.randint(1, len(terminals)))
            v = pick[0]
            for u in pick[1:]:
                v = v.union(u)
            extra.add(v)
            for u in keep:
                if u != v and u.covers(v):
                    extra.add(AggNode(u.keys, v.slots))  # v's filter, u's attributes
                    extra.add(AggNode(v.keys, u.slots))  # v's attributes, u's filter
        extra = {v for v in extra if packable(v.keys)}
        parent = steiner(sorted(keep | extra), terminals, size, hash_cost, edge=edge)
        cost = tree_cost(parent, size, hash_cost, edge=edge)
        tight = tightened(parent, terminals)
        tight_cost = tree_cost(tight, size, hash_cost, edge=edge)
        if tight_cost < cost:
            parent, cost = tight, tight_cost
        if cost < best.cost - 1e-9:
            best = AggTree(parent, cost, dict(queries))
        keep = set(best.parent) | set(terminals)
    return best
