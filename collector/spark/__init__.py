"""The HFTA on Spark: ``session`` (the JVM, its options and failures), ``source`` (the spool as
a stream), ``merge`` (the streaming merge of partials and the answer job per trigger),
``derive`` (fan-out and answer tasks; ``answers`` and ``grouping`` inside them), ``write`` (the
results' parts), ``worker`` (the Python worker with the answer code loaded)."""
