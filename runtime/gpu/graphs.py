# SHIM(issue17): moved to eaas.runtime.client.graphs; remove at merge
from eaas.runtime.client.graphs import (  # noqa: F401
    DecodeRoundTripGraph,
    GraphRoundTrips,
    check_cuda_graphs,
    choose_bucket,
    default_buckets,
    graph_eligible,
)
