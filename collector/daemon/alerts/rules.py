"""An alert rule on a query: what makes its answer rows alerts and where they go.

A rule is registered with its query: in the queries file as a directive comment beside
``-- name:``, or as the ``alert`` object of ``POST /queries`` (changed by ``PATCH``)::

    -- name: syn_flood
    -- alert: severity=critical for=2 receivers=noc summary="SYN flood on {host}" label.team=net

Every answer row of a closed window is one alert instance, identified by the query and its key
columns (the ``GROUP BY`` fields, or a join's key columns; never the time bucket): a key that
stays in the answer stays one alert. ``for``: the consecutive windows a key must appear in
before it fires. ``summary``: a template over the row's columns (``{host}``), the window
(``{window_start}``, ``{window_end}``) and ``{query}``. ``labels``: static labels beside the key
columns'.
"""

from __future__ import annotations

import re
import shlex
import string

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from sqlglot import exp

from planner.ir import Query, QueryError

LABEL_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class AlertRule(BaseModel):
    """A query's alert rule (the ``alert`` object of the REST API)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    severity: str = Field("warning", pattern=r"^[a-z][a-z0-9_-]{0,31}$",
                          description="the severity label: critical, warning, info, …")
    for_windows: int = Field(1, ge=1, le=1000, alias="for", description="consecutive closed "
                             "windows a key must appear in before it fires")
    summary: str | None = Field(None, max_length=1000, description="a template over the row's "
                                "columns, {window_start}, {window_end} and {query}")
    receivers: list[str] = Field(default_factory=list, description="the receivers (alerts."
                                 "receivers) it goes to; empty: all of them")
    labels: dict[str, str] = Field(default_factory=dict, description="static labels besides "
                                   "alertname, severity and the key columns'")
    keys: list[str] | None = Field(None, description="the columns that identify an instance "
                                   "(default: the query's key columns)")


def parse_directive(text: str) -> AlertRule:
    """``-- alert:``'s text: ``key=value`` words (shell quoting), ``label.<name>=value``."""
    try:
        words = shlex.split(text)
    except ValueError as e:
        raise QueryError(f"alert directive: {e}") from e
    fields: dict = {"labels": {}}
    for word in words:
        key, eq, value = word.partition("=")
        if not eq:
            raise QueryError(f"alert directive: {word!r} is not key=value")
        if key.startswith("label."):
            fields["labels"][key[6:]] = value
        elif key in ("receivers", "keys"):
            fields[key] = [v for v in value.split(",") if v]
        elif key in ("severity", "for", "summary"):
            fields[key] = value
        else:
            raise QueryError(f"alert directive: unknown key {key!r} (severity, for, summary, "
                             "receivers, keys, label.<name>)")
    try:
        return AlertRule.model_validate(fields)
    except ValidationError as e:
        err = e.errors()[0]
        raise QueryError(f"alert directive: {'.'.join(map(str, err['loc']))}: {err['msg']}") \
            from e


def key_columns(query: Query) -> list[str]:
    """The output columns that identify an answer row within a window: the grouping keys of
    an aggregate query, the join key columns a joined query selects."""
    if query.join is None:
        return [o.name for o in query.outputs if o.kind == "key"]
    on = {c for pair in query.join.on for c in pair}
    return [name for name, e in query.join.select
            if isinstance(e, exp.Column) and e.name in on]


def bucket_columns(query: Query) -> set[str]:
    """The time bucket's output columns (``time/60 AS t``, a join's ``a.t``)."""
    if query.join is None:
        return {o.name for o in query.outputs if o.kind == "bucket"}
    buckets = {o.name for p in query.join.parts for o in p.outputs if o.kind == "bucket"}
    return {name for name, e in query.join.select
            if isinstance(e, exp.Column) and e.name in buckets}


def check_rule(rule: AlertRule, query: Query, receivers: set[str]) -> AlertRule:
    """The rule, valid for ``query`` and the configured receivers; else a QueryError."""
    if query.is_selection:
        raise QueryError(f"query {query.name}: an alert needs an aggregate query (its rows "
                         "per closed window)")
    columns = [o.name for o in query.outputs]
    keys = rule.keys if rule.keys is not None else key_columns(query)
    for k in keys:
        if k not in columns or k in bucket_columns(query):
            raise QueryError(f"alert of {query.name}: key {k!r} is not a column of its "
                             f"answer besides the time bucket ({', '.join(columns)})")
    try:
        fields = {f for _, f, _, _ in string.Formatter().parse(rule.summary or "") if f}
    except ValueError as e:
        raise QueryError(f"alert of {query.name}: the summary is no template: {e}") from e
    unknown = fields - {*columns, "window_start", "window_end", "query"}
    if unknown:
        raise QueryError(f"alert of {query.name}: the summary names {sorted(unknown)}, not "
                         f"columns of its answer ({', '.join(columns)})")
    for name in rule.labels:
        if not LABEL_RE.match(name) or name in ("alertname", "severity", *keys):
            raise QueryError(f"alert of {query.name}: {name!r} cannot be a static label")
    missing = set(rule.receivers) - receivers
    if missing:
        raise QueryError(f"alert of {query.name}: no receiver {sorted(missing)} is configured "
                         f"(alerts.receivers: {sorted(receivers) or 'none'})")
    if not receivers:
        raise QueryError(f"alert of {query.name}: no receiver is configured (alerts.receivers)")
    return rule.model_copy(update={"keys": keys})
