"""The operator's settings: small documented dataclasses under one root, :class:`Settings`,
read once from the environment when the operator starts (:meth:`Settings.from_env`), the way
kopf keeps its own ``OperatorSettings`` (``kopf/_cogs/configs/configuration.py``): one frozen
object per concern, each with its defaults beside its fields, and nothing below reads
``os.environ`` again.

Environment variables (all optional):

=====================================  ====================================================
``EAAS_OPERATOR_RESYNC_S``              period of a pool's / fleet's daemon (s; default 2)
``EAAS_OPERATOR_IDLE_RESYNC_S``         idle pool's inputs compared this often (s; default 120)
``EAAS_OPERATOR_WATCH_TIMEOUT_S``       server-side timeout of kopf's watches (s; default 60)
``EAAS_OPERATOR_REPORT_LISTEN``         ``HOST:PORT`` of the failure-report endpoint
``EAAS_OPERATOR_REPORT_URL``            that endpoint as clients reach it
``EAAS_OPERATOR_LEASE_NAMESPACE``       Lease namespace (else ``POD_NAMESPACE``, else default)
``EAAS_OPERATOR_LEASE_NAME``            Lease name (default ``eaas-operator``)
``EAAS_OPERATOR_ID``                    identity in the election (else ``POD_NAME``)
``EAAS_OPERATOR_LEASE_DURATION_S``      Lease duration (s; default 15)
``EAAS_OPERATOR_ADVERTISE_URL``         report URL written on the Lease while leading
``EAAS_OPERATOR_LEASE_OWNER_DEPLOYMENT``  Deployment that owns the Lease
``EAAS_OPERATOR_LOAD_SCRAPE_S``         expert-load scrape interval (s; default 5)
``EAAS_OPERATOR_LOAD_WINDOW_S``         expert-load rate window (s; default 30)
``EAAS_OPERATOR_LOAD_CONCURRENCY``      concurrent scrapes at most (default 32)
``EAAS_OPERATOR_METRICS_LISTEN``        ``HOST:PORT`` of the external metrics API
``EAAS_OPERATOR_METRICS_CERT_FILE``     its serving certificate (PEM file)
``EAAS_OPERATOR_METRICS_KEY_FILE``      its private key (PEM file)
``EAAS_OPERATOR_NETWORK_POLICIES``      apply each pool's NetworkPolicy (true/false; default true)
=====================================  ====================================================

plus ``POD_NAMESPACE``, ``POD_NAME`` and ``POD_IP`` (downward API) for the election.
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field

#: Default period (s) of full steps of a pool nothing happened to.
IDLE_RESYNC_S = 120.0
#: Default name of the election's Lease.
LEASE_NAME = "eaas-operator"
#: Default expert-load scrape interval (s): env ``EAAS_OPERATOR_LOAD_SCRAPE_S``.
DEFAULT_INTERVAL_S = 5.0
#: Default expert-load rate window (s): env ``EAAS_OPERATOR_LOAD_WINDOW_S``.
DEFAULT_WINDOW_S = 30.0
#: Concurrent scrapes at most (a 1024-server pool is scraped 32 at a time).
DEFAULT_CONCURRENCY = 32


def _flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    """``env[name]`` as a boolean (``true``/``false``, ``1``/``0``, ``on``/``off``, ``yes``/``no``;
    ``default`` when unset or empty).

    Raises:
        ValueError: any other value (the message names the variable).
    """
    raw = (env.get(name) or "").strip().lower()
    if not raw:
        return default
    if raw in ("true", "1", "on", "yes"):
        return True
    if raw in ("false", "0", "off", "no"):
        return False
    raise ValueError(f"{name} must be true or false, got {env[name]!r}")


def _number(env: Mapping[str, str], name: str, default: float) -> float:
    """``env[name]`` as a float (``default`` when unset).

    Raises:
        ValueError: not a number (the message names the variable).
    """
    raw = env.get(name)
    if raw is None:
        return default
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{name} must be a number, got {raw!r}") from None


def idle_resync_from_env(env: Mapping[str, str]) -> float:
    """``EAAS_OPERATOR_IDLE_RESYNC_S`` (s), default :data:`IDLE_RESYNC_S`.

    Raises:
        ValueError: not a number >= 0 (the message names the variable).
    """
    value = _number(env, "EAAS_OPERATOR_IDLE_RESYNC_S", IDLE_RESYNC_S)
    if not value >= 0:
        raise ValueError(f"EAAS_OPERATOR_IDLE_RESYNC_S must be >= 0, got {value!r}")
    return value


@dataclass(frozen=True)
class ResyncSettings:
    """How often the daemons step and how long kopf's watches stay open.

    Attributes:
        resync_s: period of every pool's / fleet's daemon (s), on top of event wakeups.
        idle_resync_s: a pool nothing happened to is looked at only this often (s; 0: a
            full step every ``resync_s``): a full step when something it reads changed
            (:mod:`eaas.operator.resync`).
        watch_timeout_s: server-side timeout of kopf's watch requests (s; the client's is 10 s
            longer).
    """

    resync_s: float = 2.0
    idle_resync_s: float = IDLE_RESYNC_S
    watch_timeout_s: int = 60

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> ResyncSettings:
        """From ``EAAS_OPERATOR_RESYNC_S``, ``EAAS_OPERATOR_IDLE_RESYNC_S``,
        ``EAAS_OPERATOR_WATCH_TIMEOUT_S``.

        Raises:
            ValueError: a value that is not a number (or a negative idle resync).
        """
        return cls(
            resync_s=_number(env, "EAAS_OPERATOR_RESYNC_S", 2.0),
            idle_resync_s=idle_resync_from_env(env),
            watch_timeout_s=int(env.get("EAAS_OPERATOR_WATCH_TIMEOUT_S", "60")),
        )


@dataclass(frozen=True)
class ReportSettings:
    """The failure-report endpoint (clients report expert servers they cannot reach).

    Attributes:
        listen: ``HOST:PORT`` it is served on ("": not served; ``GET /metrics`` neither).
        base_url: that address as clients reach it, e.g.
            ``http://eaas-operator.eaas-system.svc:8081`` ("": clients get no
            ``--failure-report-url``).
    """

    listen: str = ""
    base_url: str = ""

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> ReportSettings:
        """From ``EAAS_OPERATOR_REPORT_LISTEN`` and ``EAAS_OPERATOR_REPORT_URL``."""
        return cls(
            listen=env.get("EAAS_OPERATOR_REPORT_LISTEN", ""),
            base_url=env.get("EAAS_OPERATOR_REPORT_URL", ""),
        )


@dataclass(frozen=True)
class LeaseSettings:
    """Timing and identity of the election (all seconds).

    Attributes:
        namespace, name: the Lease object.
        identity: this process (unique among candidates: pod name or host-pid-random).
        lease_duration_s: how long a candidate waits after the last change it saw.
        renew_deadline_s: how stale its own last renewal may get before a leader stops acting.
        retry_s: period of renew / acquire attempts.
        advertise_url: this process's failure-report base URL, written on the Lease while it
            leads ("" : none).
        owner_deployment: name of an ``apps/v1`` Deployment in ``namespace`` that owns the
            Lease ("": none).
    """

    namespace: str
    name: str = LEASE_NAME
    identity: str = ""
    lease_duration_s: float = 15.0
    renew_deadline_s: float = 10.0
    retry_s: float = 2.0
    advertise_url: str = ""
    owner_deployment: str = ""

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> LeaseSettings:
        """From ``EAAS_OPERATOR_LEASE_NAMESPACE`` (else ``POD_NAMESPACE``, else ``default``),
        ``EAAS_OPERATOR_LEASE_NAME``, ``EAAS_OPERATOR_ID`` (else ``POD_NAME``, else
        host-pid-random), ``EAAS_OPERATOR_LEASE_DURATION_S`` (default 15; the renew deadline is
        2/3 of it and the retry period 2/15 of it), the advertised report URL
        ``EAAS_OPERATOR_ADVERTISE_URL`` (else :func:`advertise_url` of
        ``EAAS_OPERATOR_REPORT_LISTEN`` and ``POD_IP``), the owning Deployment
        ``EAAS_OPERATOR_LEASE_OWNER_DEPLOYMENT``.

        Raises:
            ValueError: a duration that is not a positive number.
        """
        duration = float(env.get("EAAS_OPERATOR_LEASE_DURATION_S", "15"))
        if not duration > 0:
            raise ValueError(f"EAAS_OPERATOR_LEASE_DURATION_S must be > 0, got {duration}")
        identity = (
            env.get("EAAS_OPERATOR_ID")
            or env.get("POD_NAME")
            or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        )
        return cls(
            namespace=env.get("EAAS_OPERATOR_LEASE_NAMESPACE")
            or env.get("POD_NAMESPACE")
            or "default",
            name=env.get("EAAS_OPERATOR_LEASE_NAME", LEASE_NAME),
            identity=identity,
            lease_duration_s=duration,
            renew_deadline_s=duration * 2 / 3,
            retry_s=duration * 2 / 15,
            advertise_url=env.get("EAAS_OPERATOR_ADVERTISE_URL")
            or advertise_url(env.get("EAAS_OPERATOR_REPORT_LISTEN", ""), env.get("POD_IP", "")),
            owner_deployment=env.get("EAAS_OPERATOR_LEASE_OWNER_DEPLOYMENT", ""),
        )


def advertise_url(listen: str, pod_ip: str) -> str:
    """Base URL at which the other replicas reach this one's report listener ``HOST:PORT``:
    a wildcard host (``0.0.0.0``, ``::``, empty) becomes ``pod_ip`` (else 127.0.0.1).
    "" when ``listen`` is empty or has no port."""
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit():
        return ""
    host = host.strip("[]")
    if host in ("", "0.0.0.0", "::"):
        host = pod_ip or "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}"


@dataclass(frozen=True)
class LoadSettings:
    """The expert-load scraper (:class:`eaas.operator.load.LoadScraper`).

    Attributes:
        scrape_s: interval between scrapes of a pool's servers (s).
        window_s: rate window (s): a rate needs two scrapes this far apart at most.
        concurrency: concurrent scrapes at most.
    """

    scrape_s: float = DEFAULT_INTERVAL_S
    window_s: float = DEFAULT_WINDOW_S
    concurrency: int = DEFAULT_CONCURRENCY

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> LoadSettings:
        """From ``EAAS_OPERATOR_LOAD_SCRAPE_S``, ``EAAS_OPERATOR_LOAD_WINDOW_S`` and
        ``EAAS_OPERATOR_LOAD_CONCURRENCY``.

        Raises:
            ValueError: a value that is not a number.
        """
        return cls(
            scrape_s=float(env.get("EAAS_OPERATOR_LOAD_SCRAPE_S", DEFAULT_INTERVAL_S)),
            window_s=float(env.get("EAAS_OPERATOR_LOAD_WINDOW_S", DEFAULT_WINDOW_S)),
            concurrency=int(env.get("EAAS_OPERATOR_LOAD_CONCURRENCY", DEFAULT_CONCURRENCY)),
        )


@dataclass(frozen=True)
class MetricsApiSettings:
    """The external metrics API (``external.metrics.k8s.io``) the HPA reads expert load from.

    Attributes:
        listen: ``HOST:PORT`` it is served on ("": not served).
        cert_file, key_file: its serving certificate and key (PEM files; the APIService trusts
            the certificate). Both are needed when ``listen`` is set.
    """

    listen: str = ""
    cert_file: str = ""
    key_file: str = ""

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> MetricsApiSettings:
        """From ``EAAS_OPERATOR_METRICS_LISTEN``, ``EAAS_OPERATOR_METRICS_CERT_FILE`` and
        ``EAAS_OPERATOR_METRICS_KEY_FILE``."""
        return cls(
            listen=env.get("EAAS_OPERATOR_METRICS_LISTEN", ""),
            cert_file=env.get("EAAS_OPERATOR_METRICS_CERT_FILE", ""),
            key_file=env.get("EAAS_OPERATOR_METRICS_KEY_FILE", ""),
        )


@dataclass(frozen=True)
class ElasticSettings:
    """How a pool follows changes of ``spec.replicas`` (:mod:`eaas.operator.drain`).

    Attributes:
        settle_s: a new ``spec.replicas`` is acted on once it stood this long (s): a burst of
            changes within it creates and deletes no pod (0: act at once).
        drain_quiet_s: a leaving server (out of every table, every client acknowledged) is
            deleted once it answered no frame for this long (s, by its own ``/health`` record).
        drain_timeout_s: ... or once it has drained this long (s) whatever it reports.
    """

    settle_s: float = 5.0
    drain_quiet_s: float = 1.0
    drain_timeout_s: float = 60.0

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> ElasticSettings:
        """From ``EAAS_OPERATOR_SCALE_SETTLE_S``, ``EAAS_OPERATOR_DRAIN_QUIET_S`` and
        ``EAAS_OPERATOR_DRAIN_TIMEOUT_S``.

        Raises:
            ValueError: a value that is not a number, or a negative one (names the variable).
        """
        out = cls(
            settle_s=_number(env, "EAAS_OPERATOR_SCALE_SETTLE_S", cls.settle_s),
            drain_quiet_s=_number(env, "EAAS_OPERATOR_DRAIN_QUIET_S", cls.drain_quiet_s),
            drain_timeout_s=_number(env, "EAAS_OPERATOR_DRAIN_TIMEOUT_S", cls.drain_timeout_s),
        )
        for name, value in (
            ("EAAS_OPERATOR_SCALE_SETTLE_S", out.settle_s),
            ("EAAS_OPERATOR_DRAIN_QUIET_S", out.drain_quiet_s),
            ("EAAS_OPERATOR_DRAIN_TIMEOUT_S", out.drain_timeout_s),
        ):
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        return out


@dataclass(frozen=True)
class Settings:
    """Every setting of the operator process (the root; read once at start-up).

    Attributes:
        resync: daemon periods and watch timeouts.
        reports: the failure-report endpoint.
        lease: the leader election.
        load: the expert-load scraper.
        metrics_api: the external metrics API.
        elastic: replica changes (settle) and the drain of leaving servers.
        network_policies: apply each pool's NetworkPolicy
            (:mod:`eaas.operator.network_policy`).
    """

    resync: ResyncSettings = field(default_factory=ResyncSettings)
    reports: ReportSettings = field(default_factory=ReportSettings)
    lease: LeaseSettings = field(default_factory=lambda: LeaseSettings(namespace="default"))
    load: LoadSettings = field(default_factory=LoadSettings)
    metrics_api: MetricsApiSettings = field(default_factory=MetricsApiSettings)
    elastic: ElasticSettings = field(default_factory=ElasticSettings)
    network_policies: bool = True

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        """All settings from ``env`` (default: this process's environment).

        Raises:
            ValueError: a malformed value (the message names the variable).
        """
        env = os.environ if env is None else env
        return cls(
            resync=ResyncSettings.from_env(env),
            reports=ReportSettings.from_env(env),
            lease=LeaseSettings.from_env(env),
            load=LoadSettings.from_env(env),
            metrics_api=MetricsApiSettings.from_env(env),
            elastic=ElasticSettings.from_env(env),
            network_policies=_flag(env, "EAAS_OPERATOR_NETWORK_POLICIES", True),
        )
