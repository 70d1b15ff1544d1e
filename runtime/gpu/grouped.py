# SHIM(issue17): moved to eaas.runtime.server.grouped; remove at merge
from eaas.runtime.server.grouped import (  # noqa: F401
    BM,
    BN,
    ROUTE_THREADS,
    GroupedExperts,
    GroupMeta,
    compact_groups,
    grouped_swiglu_reference,
    max_tiles,
    stack_weights,
)
