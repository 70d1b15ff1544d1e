# SHIM(issue17): moved to eaas.runtime.client.api.protocol; remove at merge
from eaas.runtime.client.api.protocol import (  # noqa: F401
    UNSUPPORTED,
    APIError,
    bad,
    check_unsupported,
    parse,
)
