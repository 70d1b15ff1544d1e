"""One reconciler per file: ``pool`` (ExpertPools with command-line experts), ``table_pool``
(ExpertPools with routing-table assignment), ``fleet`` (AttentionFleets), ``reports`` (the
failure-report endpoint and operator metrics), ``load`` (expert load, the HPA, the external
metrics API), ``daemon`` (the per-object loop and the operator's start and stop)."""
