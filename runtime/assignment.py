# SHIM(issue17): moved to eaas.runtime.server.assignment; remove at merge
from eaas.runtime.server.assignment import (  # noqa: F401
    AssignmentStep,
    LayerExpert,
    Loader,
    ServerAssignment,
    TableEndpoint,
    assignment_step,
    server_experts,
)
