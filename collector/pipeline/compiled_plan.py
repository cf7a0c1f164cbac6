"""A plan made ready for one stream's engine: its prefilter as arrays, the ASC runtime, the
residual stage, and per spool folder the LFTA tables of its aggregate tree's maintained nodes
(charted by OM unless the input is finite). The engine swaps one for another between batches.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from capture.batch import TupleBatch
from capture.fields import enriched
from collector.config import AscConfig, LftaConfig, OmConfig, ResidualConfig
from collector.keys import KeyLayout
from collector.pipeline.asc_runtime import AscRuntime
from collector.pipeline.compiled_prefilter import CompiledPrefilter, compile_prefilter
from collector.pipeline.lfta import NodeTable
from collector.pipeline.residual import Residual, ValueCache
from planner.plan import Plan
from planner.slots import n_words


@dataclass
class FolderPlan:
    """What one spool folder receives: its queries' slots, grouped into aggregate-tree nodes."""

    stream: str
    folder: str
    period: int | None
    slots: list[int]
    tables: list[NodeTable] = field(default_factory=list)  # one per maintained node


@dataclass
class CompiledPlan:
    plan: Plan
    prefilter: CompiledPrefilter
    asc: AscRuntime
    residual: Residual
    fields: tuple[str, ...]  # what the plan's unpack groups extract
    enriched: tuple[str, ...]  # the enrichment fields among them, computed after unpack
    folders: list[FolderPlan]
    names: dict[int, str]
    keys: tuple[str, ...]  # every field an aggregate query of the stream groups by
    agg_slots: tuple[int, ...]  # the stream's aggregate queries' slots

    def node_tables(self) -> list[NodeTable]:
        return [t for fp in self.folders for t in fp.tables]


class Prepared(NamedTuple):
    """A raw batch's tuples unpacked ahead, with the fields they hold."""

    fields: tuple[str, ...]
    tuples: TupleBatch


def maintained_nodes(plan: Plan, stream: str, folder: str
                     ) -> list[tuple[tuple[str, ...], list[int]]]:
    """(keys, slots) of the LFTA tables of a folder: its aggregate tree's maintained nodes, or
    one node per set of group-by fields when the plan has no tree for it."""
    tree = plan.tree(stream, folder)
    if tree is not None:
        return tree.maintained()
    nodes: dict[tuple[str, ...], list[int]] = {}
    for qp in plan.queries:
        if qp.query.stream == stream and qp.query.folder == folder:
            nodes.setdefault(tuple(sorted(qp.query.node_keys)), []).append(qp.slot)
    return sorted(nodes.items())


def node_layouts(plan: Plan, stream: str, folder: str) -> list[str]:
    """The node layouts (``collector/keys.py`` labels) that the LFTA tables of a folder write
    to the spool under ``plan``: each ``NodeTable.spool_layout``."""
    q_words = n_words(max([qp.slot for qp in plan.queries] + [-1]) + 1)  # compile_prefilter's
    return [KeyLayout(stream, keys, q_words).label
            for keys, _ in maintained_nodes(plan, stream, folder)]


def compile_plan(plan: Plan, stream: str, asc: AscConfig, residual: ResidualConfig,
                 lfta: LftaConfig, om: OmConfig, value_cache: ValueCache,
                 finite: bool, previous: CompiledPlan | None = None) -> CompiledPlan:
    """``plan`` for ``stream``'s engine; ``finite``: an input with no arrival rate to chart
    (``replay``), whose nodes keep ``lfta.capacity``; ``previous``: the plan it replaces, whose
    residual stage's learned order carries over."""
    cp = compile_prefilter(plan, stream)
    folders = []
    for folder in plan.folders(stream):
        qps = [qp for qp in plan.queries
               if qp.query.stream == stream and qp.query.folder == folder]
        period = qps[0].query.period
        fp = FolderPlan(stream, folder, period, [qp.slot for qp in qps])
        if period is not None:
            tree = plan.tree(stream, folder)
            charted = bool(tree) and om.enabled and not finite
            fp.tables = [NodeTable(stream, period, keys, slots, cp.q_words, lfta,
                                   tree.chart(keys, slots) if charted else None,
                                   om.history, om.decay,
                                   {m for qp in qps if qp.slot in slots
                                    for m in qp.query.measures})
                         for keys, slots in maintained_nodes(plan, stream, folder)]
        folders.append(fp)
    runtime = AscRuntime(cp, asc.strategy, asc.period_tuples, asc.mu, asc.sample)
    r = residual
    stage = Residual(plan, stream, r.ordering, r.profile_probability, r.profile_window, r.alpha,
                     r.sweep_stage, value_cache, budget=r.profile_budget, adapt=r.adapt,
                     previous=previous.residual if previous is not None else None)
    mine = [qp for qp in plan.queries if qp.query.stream == stream]
    aggregates = [qp for qp in mine if not qp.query.is_selection]
    extract = plan.unpacking(stream).extract
    return CompiledPlan(plan, cp, runtime, stage, extract,
                        tuple(f for f in extract if f in enriched(stream)), folders,
                        {qp.slot: qp.query.name for qp in mine},
                        tuple(sorted({k for qp in aggregates for k in qp.query.node_keys})),
                        tuple(qp.slot for qp in aggregates))
