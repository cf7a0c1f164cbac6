"""The per-batch stages, in pipeline order: ``engine`` takes a batch (unpacked by capture/) through
``prefilter`` (``compiled_prefilter``, ``asc_runtime``), ``residual`` (``user_predicates``,
``prefix_tables``; ``selectivity`` measures), ``lfta`` (``lfta_kernels``; ``sampling`` sizes its
nodes) and ``spooling`` into the ``spool``, committing a durable source's position with
``durability``; ``meters`` counts each stage, ``compiled_plan`` is what a plan becomes for an
engine."""
