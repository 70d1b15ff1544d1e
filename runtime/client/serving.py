# SHIM(issue17): moved to eaas.runtime.client.api; remove at merge
from eaas.runtime.client.api.prepare import Prepared  # noqa: F401
from eaas.runtime.client.api.protocol import UNSUPPORTED  # noqa: F401
from eaas.runtime.client.api.responses import (  # noqa: F401
    ServerShuttingDown,
    exc_error,
    json_bytes,
    json_bytes_with_array,
)
from eaas.runtime.client.api.server import DEFAULT_MAX_REQUEST_BODY, OpenAIServer  # noqa: F401
from eaas.runtime.client.api.streaming import DISCONNECT_POLL_S, EventMailbox  # noqa: F401
