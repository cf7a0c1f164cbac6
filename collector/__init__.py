"""Runs the plan, in three layers, each importing only those before it:

- ``collector/pipeline/`` — the per-batch stages, in pipeline order: ``engine`` drives
  ``prefilter`` (with ``asc_runtime``), ``residual`` (``user_predicates``, ``prefix_tables``,
  ``selectivity``), ``lfta`` (``lfta_kernels``), ``sampling``, then ``spool`` and ``durability``;
- ``collector/spark/`` — the HFTA on Spark: ``session``, ``source`` (the spool as a stream),
  ``merge``, ``derive`` (``answers``, ``grouping``), ``write``, ``worker``;
- ``collector/daemon/`` — the long-running service: ``service`` (``queries``: registration and
  rebuilds; ``supervision``: sources and Spark), ``sources``, ``registry``, ``cluster``,
  ``results`` (storage and paging), ``process``.

Below all three sit the modules every layer uses: ``config`` (settings), ``metrics`` (the
Prometheus registry) and ``keys`` (the group-key layout the LFTA writes and Spark merges).
"""
