# SHIM(issue17): moved to eaas.runtime.server; remove at merge
from eaas.runtime.server.compute import GROUPED_MM_MAX_PAIRS, grouped_expert_sum  # noqa: F401
from eaas.runtime.server.hosting import LayerStack  # noqa: F401
from eaas.runtime.server.main import (  # noqa: F401
    learn_from_table,
    main,
    random_experts,
    run,
    start_http,
)
from eaas.runtime.server.server import LOAD_METRICS_FLUSH_S, ExpertServer  # noqa: F401

if __name__ == "__main__":  # `python -m eaas.runtime.expert_server` keeps working
    import sys

    main(sys.argv[1:])
