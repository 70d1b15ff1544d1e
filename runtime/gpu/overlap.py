# SHIM(issue17): moved to eaas.runtime.client.overlap; remove at merge
from eaas.runtime.client.overlap import (  # noqa: F401
    DecodeStack,
    MicroBatchStreams,
    Op,
    PagedOverlapRunner,
    record_event,
    run_decode_layers,
    schedule,
    split_batch,
    wait_event,
)
