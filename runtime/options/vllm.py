"""The options of the vLLM plugin (``eaas.vllm``): environment variables of a ``vllm serve``
process whose routed experts run on EaaS expert servers.

vLLM loads its general plugins in every process it starts (API server, engine core, workers),
so the plugin's settings travel as environment variables, which all of them inherit. The plugin
is a no-op unless a routing-table source is set (``EAAS_ROUTING_TABLE`` or
``EAAS_ROUTING_TABLE_CONFIGMAP``). Built by the plugin from ``os.environ``
(:meth:`VllmPluginOptions.from_env`), and by ``eaas serve --engine vllm`` and the operator's
fleet pods the other way round (:meth:`VllmPluginOptions.env`). Torch-free (the operator
imports it).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from eaas.runtime.options.client import check_dispatch_timeout, client_id_of

#: field -> environment variable (one source of truth for the names; docs/vllm.md lists them)
ENV = {
    "routing_table": "EAAS_ROUTING_TABLE",
    "routing_table_configmap": "EAAS_ROUTING_TABLE_CONFIGMAP",
    "push_token_file": "EAAS_PUSH_TOKEN_FILE",
    "http_port": "EAAS_HTTP_PORT",
    "http_host": "EAAS_HTTP_HOST",
    "failure_report_url": "EAAS_FAILURE_REPORT_URL",
    "dispatch_timeout": "EAAS_DISPATCH_TIMEOUT",
    "client_id": "EAAS_CLIENT_ID",
    "spin_us": "EAAS_SPIN_US",
    "failed_requests_dir": "EAAS_FAILED_REQUESTS_DIR",
}

#: ``vllm serve --scheduler-cls`` value of the plugin's scheduler (``eaas.vllm.scheduler``): a
#: request whose tokens need an expert without a live replica ends with an error, the others go
#: on (docs/vllm.md). ``eaas serve --engine vllm`` and the operator's vllm pods pass it.
SCHEDULER_CLS = "eaas.vllm.scheduler.Scheduler"
#: ``vllm serve --middleware`` value of the plugin's API-server middleware
#: (``eaas.vllm.middleware``): the requests that scheduler ends get HTTP 503 with an OpenAI-style
#: error body (a stream: that error event), not vLLM's generic 500
MIDDLEWARE = "eaas.vllm.middleware.NoLiveReplica503"


def plugin_vllm_args(extra: Sequence[str] = ()) -> list[str]:
    """The ``vllm serve`` flags of the plugin's per-request failure, to add before ``extra``
    (the user's own flags): ``--scheduler-cls`` :data:`SCHEDULER_CLS` unless ``extra`` names
    another scheduler, and ``--middleware`` :data:`MIDDLEWARE` with it (the middleware answers
    only what that scheduler records). ``eaas serve --engine vllm`` and the operator's
    ``engine: vllm`` pods pass these.

    Returns:
        the flags, e.g. ``["--scheduler-cls", SCHEDULER_CLS, "--middleware", MIDDLEWARE]``.
    """
    if any(a == "--scheduler-cls" or a.startswith("--scheduler-cls=") for a in extra):
        return []
    return ["--scheduler-cls", SCHEDULER_CLS, "--middleware", MIDDLEWARE]


#: ``vllm serve`` flags ``eaas serve --engine vllm`` sets from its own flags of the same names
#: (the model is the positional argument, ``--api-key`` goes to ``VLLM_API_KEY``): ``--vllm-args``
#: may not set them
SERVE_OWNED_VLLM_FLAGS = (
    "--host",
    "--port",
    "--model",
    "--served-model-name",
    "--dtype",
    "--max-num-batched-tokens",
    "--api-key",
)


def vllm_flag_in(arg: str, flags: Sequence[str]) -> str | None:
    """The flag of ``flags`` that ``arg`` (one ``vllm serve`` argument) would set, read as vLLM's
    argparse reads it (the name before ``=``, ``_`` as ``-``, an abbreviation: a prefix of a
    flag name), ``"--"`` for a bare ``--``; None for any other argument (a value, another flag).
    """
    if not arg.startswith("--"):
        return None
    name = arg.split("=", 1)[0].replace("_", "-")
    if len(name) <= 2:
        return "--"
    return next((f for f in flags if f.startswith(name)), None)


_NUMBERS: dict[str, type] = {"http_port": int, "dispatch_timeout": float, "spin_us": float}


@dataclass(kw_only=True)
class VllmPluginOptions:
    """The plugin's settings (field ``x_y`` is variable ``EAAS_X_Y``, :data:`ENV`).

    Attributes:
        routing_table: a routing-table JSON file, polled (``eaas serve`` writes one).
        routing_table_configmap: ``NAMESPACE/NAME`` of the routing-table ConfigMap, watched.
        push_token_file: file with the bearer token of ``PUT /routing-table`` and failure
            reports (a mounted Secret); without it pushes are refused (403).
        http_port: the plugin's own HTTP port (``GET /health``, ``GET|PUT /routing-table``,
            ``GET /metrics``), opened by the vLLM worker process that holds the model; 0: none.
        http_host: address of that port.
        failure_report_url: where expert servers marked down are reported (the operator's
            ``/failure-report``), authenticated with the push token.
        dispatch_timeout: seconds one MoE layer's round trip may take before the servers not
            answered are marked down and their pairs re-sent (> 0).
        client_id: the client id in frames, metrics and failure reports (a pod name is hashed,
            :func:`~eaas.runtime.options.client.client_id_of`).
        spin_us: busy-poll microseconds on ``unix:`` connections (None: the transport's own).
        failed_requests_dir: the directory where the plugin's scheduler records the requests
            it ends for a missing expert and its API-server middleware reads them (the 503s;
            ``eaas.vllm.failed``); None: the plugin sets a fresh one under the temp dir in
            vLLM's first process, which its other processes inherit.

    Raises (at construction):
        ValueError: a bad value; the message names the variable.
    """

    routing_table: str | None = None
    routing_table_configmap: str | None = None
    push_token_file: str | None = None
    http_port: int = 0
    http_host: str = "127.0.0.1"
    failure_report_url: str | None = None
    dispatch_timeout: float = 5.0
    client_id: str = "vllm"
    spin_us: float | None = None
    failed_requests_dir: str | None = None

    def __post_init__(self) -> None:
        try:
            check_dispatch_timeout(self.dispatch_timeout)
        except ValueError as exc:
            raise ValueError(
                str(exc).replace("--dispatch-timeout", ENV["dispatch_timeout"])
            ) from None
        if not 0 <= self.http_port <= 65535:
            raise ValueError(f"{ENV['http_port']} must be in 0..65535, got {self.http_port}")
        url = self.failure_report_url
        if url and not url.startswith(("http://", "https://")):
            raise ValueError(
                f"{ENV['failure_report_url']} must be http:// or https://, got {url!r}"
            )
        if self.spin_us is not None and not (math.isfinite(self.spin_us) and self.spin_us >= 0):
            raise ValueError(f"{ENV['spin_us']} must be a finite number >= 0, got {self.spin_us}")
        try:
            client_id_of(self.client_id)
        except ValueError as exc:
            raise ValueError(str(exc).replace("--client-id", ENV["client_id"])) from None

    @property
    def enabled(self) -> bool:
        """True when a routing-table source is set (the plugin does nothing otherwise)."""
        return bool(self.routing_table or self.routing_table_configmap)

    @property
    def numeric_client_id(self) -> int:
        """The int64 client id of frames (:func:`~eaas.runtime.options.client.client_id_of`)."""
        return client_id_of(self.client_id)

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> VllmPluginOptions:
        """The options the variables of :data:`ENV` in ``environ`` give (empty = not set).

        Raises:
            ValueError: a value that does not parse or is out of range (names the variable).
        """
        kw: dict[str, object] = {}
        for f in dataclasses.fields(cls):
            raw = environ.get(ENV[f.name], "").strip()
            if not raw:
                continue
            kind = _NUMBERS.get(f.name)
            try:
                kw[f.name] = kind(raw) if kind is not None else raw
            except ValueError:
                raise ValueError(f"{ENV[f.name]}: not a number: {raw!r}") from None
        return cls(**kw)  # type: ignore[arg-type]

    def env(self) -> dict[str, str]:
        """The variables that give these options (the fields that differ from the defaults)."""
        out: dict[str, str] = {}
        default = VllmPluginOptions()
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v is not None and v != getattr(default, f.name):
                out[ENV[f.name]] = str(v)
        return out
