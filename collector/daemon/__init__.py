"""The long-running service: ``service`` (``Collector``: ``queries`` and ``supervision``),
``sources``, ``source_metrics``, ``registry``, ``cluster`` (probes sharing a spool),
``results`` (answers stored and paged), ``process`` (process-wide start-up settings)."""
