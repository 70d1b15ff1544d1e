# SHIM(issue17): moved to eaas.runtime.server.http; remove at merge
from eaas.runtime.server.http import (  # noqa: F401
    DEFAULT_STALE_AFTER_S,
    HealthVerdict,
    ServerHealth,
    ServerHTTP,
    health_verdict,
)
