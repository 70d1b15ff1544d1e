"""Expert load as an input: the operator scrapes its expert servers' token counters and turns
them into per-(layer, expert) token rates.

Every expert server counts ``eaas_expert_tokens_total{layer,expert,server}`` (tokens it computed for
that expert since its process started; :mod:`eaas.runtime.metrics`) and serves it on its
``--http-port`` (``GET /metrics``, Prometheus text format 0.0.4). The operator keeps the
counter samples of every Ready server pod for a sliding window and computes

    rate(server, layer, expert) = increase of the counter over the window / window length (s)

the way Prometheus' ``rate()`` does: a counter that goes down was reset (the container
restarted), so the increase across the reset counts from zero. Samples are keyed by pod uid, so
a replaced pod (same name, new uid) starts a new series.

Pure parts (unit-tested): :func:`parse_expert_tokens`, :func:`server_rates` (and its
incremental form :class:`CounterWindow`, O(series) per sample), :func:`pool_rates`, :func:`load_summary`, :func:`metrics_url`. The thin I/O part:
:class:`LoadScraper`, one background thread that scrapes every registered pod each
``interval_s`` seconds with a bounded number of concurrent GETs (``max_concurrency``), each with
a timeout; reconcile steps only hand it targets and read its last result, so a slow or dead
server never blocks a reconcile.

Units: token rates in tokens per second; times in seconds (``time.monotonic()``).
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import math
import re
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from eaas.operator.counters import WorkCounters
from eaas.operator.monitor import health_url
from eaas.operator.settings import (
    DEFAULT_CONCURRENCY,
    DEFAULT_INTERVAL_S,
    DEFAULT_WINDOW_S,
    LoadSettings,
)
from eaas.runtime.placement import LayerExpert, balancedness_of_loads

log = logging.getLogger("eaas.operator.load")

METRIC = "eaas_expert_tokens_total"
#: Per-GET timeout of one scrape (s).
DEFAULT_TIMEOUT_S = 2.0
#: A server whose scrape failed is tried again after ``interval * 2**failures`` seconds, at
#: most this long (s): a pool of servers without a metrics endpoint (kwok pods, servers not up
#: yet) costs a scrape per server per five minutes, not per interval.
RETRY_MAX_S = 300.0
#: While no server of a pool has answered a scrape yet (kwok pods, servers that serve no
#: metrics, a wrong port), a round GETs at most this many of its servers, those waiting the
#: longest: such a pool costs a few GETs per round whatever its size (a 1,024-server pool of
#: kwok pods: 1,024 refused GETs per back-off step before); every server is scraped from the
#: round after the first answer.
PROBE_SERVERS = 4
#: Hottest experts listed in the pool's status.
HOTTEST = 5

_LINE = re.compile(r"^eaas_expert_tokens_total\{([^}]*)\}\s+(\S+)", re.M)
# prometheus-client's own rendering (label names sorted): one findall over the whole text
_FAST = re.compile(
    r'^eaas_expert_tokens_total\{expert="(\d+)",layer="(\d+)"(?:,server="[^"\\]*")?\} ([0-9.e+]+)$',
    re.M,
)
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


# ---------------------------------------------------------------------------------------------
# pure: parsing and rate math
# ---------------------------------------------------------------------------------------------
def parse_expert_tokens(text: str) -> dict[LayerExpert, float]:
    """``(layer, expert) -> counter value`` from a Prometheus text exposition (only the
    ``eaas_expert_tokens_total`` samples; other metrics and lines without both labels are
    skipped; label order does not matter).

    Raises:
        ValueError: a sample of that metric whose value or labels are not numbers.
    """
    fast = _FAST.findall(text)
    if len(fast) == text.count("\neaas_expert_tokens_total{") + text.startswith(
        "eaas_expert_tokens_total{"
    ):  # every sample in the usual form: ~4x cheaper than the general parse below
        summed: dict[LayerExpert, float] = {}
        for expert, layer, v in fast:  # one server per pod; under `eaas serve` several add up
            key = (int(layer), int(expert))
            summed[key] = summed.get(key, 0.0) + float(v)
        return summed
    out: dict[LayerExpert, float] = {}
    for m in _LINE.finditer(text):
        labels = dict(_LABEL.findall(m.group(1)))
        if "layer" not in labels or "expert" not in labels:
            continue
        try:
            key = (int(labels["layer"]), int(labels["expert"]))
            value = float(m.group(2))
        except ValueError:
            raise ValueError(f"bad {METRIC} sample: {m.group(0)!r}") from None
        if math.isnan(value) or value < 0:
            raise ValueError(f"bad {METRIC} value: {m.group(0)!r}")
        out[key] = out.get(key, 0.0) + value
    return out


@dataclass(frozen=True)
class CounterSample:
    """One scrape of one server: ``time_s`` (monotonic, s) and its counters."""

    time_s: float
    counters: Mapping[LayerExpert, float]


def server_rates(
    samples: Sequence[CounterSample], window_s: float, now_s: float | None = None
) -> tuple[dict[LayerExpert, float], float] | None:
    """Token rates of one server over the last ``window_s`` seconds.

    Uses the samples with ``time_s >= now_s - window_s`` (``now_s`` defaults to the newest
    sample's time), ordered by time. The increase of a counter between two consecutive samples
    is ``b - a``, or ``b`` when ``b < a`` (a reset: the process restarted and counted from 0);
    a series that appears in a later sample counts from 0 too. The rate is the summed increase
    divided by the time between the first and the last sample used.

    Returns:
        ``(rates, span_s)``: tokens/s per (layer, expert) and the seconds the rates cover; None
        when fewer than two samples fall in the window or they span no time (no rate yet).
    """
    if not samples:
        return None
    ordered = sorted(samples, key=lambda s: s.time_s)
    end = ordered[-1].time_s if now_s is None else now_s
    used = [s for s in ordered if s.time_s >= end - window_s]
    if len(used) < 2:
        return None
    span = used[-1].time_s - used[0].time_s
    if span <= 0:
        return None
    increase: dict[LayerExpert, float] = {}
    for a, b in zip(used[:-1], used[1:], strict=True):
        for key, vb in b.counters.items():
            va = a.counters.get(key, 0.0)
            increase[key] = increase.get(key, 0.0) + (vb - va if vb >= va else vb)
    return {k: v / span for k, v in increase.items()}, span


class CounterWindow:
    """:func:`server_rates` of one server, kept incrementally: each new sample costs O(series)
    (its increase over the previous sample is added to a running sum; the oldest pair's is
    subtracted when it leaves the window), so a 1024-server pool's round stays cheap.

    ``add(sample)`` appends (samples must come in time order); ``rates(now_s)`` gives what
    :func:`server_rates` gives for the samples in the window ending at ``now_s``, except that a
    series seen only before the window stays listed with rate 0 (finding it would cost a pass
    over every pair).
    """

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._samples: collections.deque[CounterSample] = collections.deque()
        # increase between sample i-1 and i, for i >= 1 of _samples
        self._pairs: collections.deque[dict[LayerExpert, float]] = collections.deque()
        self._sum: dict[LayerExpert, float] = {}

    def add(self, sample: CounterSample) -> None:
        """Append a sample (its time must not precede the last one's)."""
        if self._samples:
            prev = self._samples[-1].counters
            inc = {}
            for key, vb in sample.counters.items():
                va = prev.get(key, 0.0)
                d = vb - va if vb >= va else vb
                inc[key] = d
                self._sum[key] = self._sum.get(key, 0.0) + d
            self._pairs.append(inc)
        self._samples.append(sample)
        self._evict(sample.time_s)

    def _evict(self, now_s: float) -> None:
        while self._samples and self._samples[0].time_s < now_s - self.window_s:
            self._samples.popleft()
            if self._pairs:
                for key, d in self._pairs.popleft().items():
                    self._sum[key] -= d
            else:
                self._sum.clear()

    def rates(self, now_s: float | None = None) -> tuple[dict[LayerExpert, float], float] | None:
        """``(tokens/s per (layer, expert), span_s)`` or None, as :func:`server_rates`."""
        if now_s is not None:
            self._evict(now_s)
        if len(self._samples) < 2:
            return None
        span = self._samples[-1].time_s - self._samples[0].time_s
        if span <= 0:
            return None
        return {k: max(0.0, v) / span for k, v in self._sum.items()}, span


def pool_rates(per_server: Mapping[str, Mapping[LayerExpert, float]]) -> dict[LayerExpert, float]:
    """Pool-wide tokens/s per (layer, expert): the sum over servers (replicas of one logical
    expert on several servers add up)."""
    out: dict[LayerExpert, float] = {}
    for rates in per_server.values():
        for key, v in rates.items():
            out[key] = out.get(key, 0.0) + v
    return out


def server_load(rates: Mapping[LayerExpert, float]) -> float:
    """One server's load: tokens/s summed over the (layer, expert) replicas it hosts."""
    return float(sum(rates.values()))


def load_summary(
    per_server: Mapping[str, Mapping[LayerExpert, float]],
    window_s: float,
    hottest: int = HOTTEST,
) -> dict[str, Any]:
    """The ``status.load`` summary (camelCase) of a pool from its servers' rates.

    Fields: ``servers`` (servers with a rate), ``windowSeconds``, ``totalTokensPerSecond``
    (sum over servers), ``serverMaxTokensPerSecond`` / ``serverMeanTokensPerSecond`` (per-server
    load, tokens/s), ``balancedness`` (mean / max server load per MoE layer, summed over layers:
    :func:`~eaas.runtime.placement.balancedness_of_loads`; 1.0 when all are idle),
    ``hottestExperts`` (up to ``hottest`` ``"L<layer>/E<expert>: <tokens/s>"`` strings, pool-wide,
    hottest first, ties by (layer, expert)). Rates are rounded to 0.01 tokens/s so that an idle
    pool's status does not change on every scrape.
    """
    loads = [server_load(r) for r in per_server.values()]
    total = sum(loads)
    mx = max(loads) if loads else 0.0
    mean = total / len(loads) if loads else 0.0
    experts = pool_rates(per_server)
    top = sorted(((-v, k) for k, v in experts.items() if v > 0))[:hottest]
    per_layer: dict[int, list[float]] = {}
    for i, rates in enumerate(per_server.values()):
        for (layer, _), v in rates.items():
            per_layer.setdefault(layer, [0.0] * len(per_server))[i] += v
    balance = balancedness_of_loads(per_layer)
    return {
        "servers": len(loads),
        "windowSeconds": round(float(window_s), 2),
        "totalTokensPerSecond": round(total, 2),
        "serverMaxTokensPerSecond": round(mx, 2),
        "serverMeanTokensPerSecond": round(mean, 2),
        "balancedness": round(balance, 4),
        "hottestExperts": [f"L{k[0]}/E{k[1]}: {-v:.2f}" for v, k in top],
    }


def metrics_url(pod: Mapping[str, Any]) -> str | None:
    """``http://<pod IP>:<port named http>/metrics`` of an expert-server pod, or None."""
    url = health_url(pod)
    return None if url is None else url[: -len("/health")] + "/metrics"


# ---------------------------------------------------------------------------------------------
# I/O: the scraper
# ---------------------------------------------------------------------------------------------
def fetch_metrics(url: str, timeout_s: float) -> str:
    """``GET url`` -> body text.

    Raises:
        OSError: connection refused, timed out, or an HTTP error status.
    """
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        return resp.read().decode("utf-8", "replace")


@dataclass
class PoolLoad:
    """What the scraper knows about one pool.

    Attributes:
        per_server: pod name -> tokens/s per (layer, expert) over the window (servers with a
            rate only).
        window_s: the configured window (s).
        updated_s: monotonic time of the last scrape round that produced it.
        errors: pod name -> why its last scrape failed.
    """

    per_server: dict[str, dict[LayerExpert, float]] = field(default_factory=dict)
    window_s: float = DEFAULT_WINDOW_S
    updated_s: float = 0.0
    errors: dict[str, str] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        """:func:`load_summary` of this pool."""
        return load_summary(self.per_server, self.window_s)

    def total(self) -> float | None:
        """Pool load in tokens/s (sum over servers), or None when no server has a rate yet."""
        if not self.per_server:
            return None
        return sum(server_load(r) for r in self.per_server.values())


class LoadScraper:
    """Scrapes the expert servers of every registered pool in one background thread.

    ``set_targets(pool, {pod uid: (pod name, url)})`` registers what to scrape (each reconcile
    step calls it: cheap, never blocks); ``load(pool)`` returns the last :class:`PoolLoad`.
    Samples of a pod that leaves the targets are dropped. A pool whose targets were not renewed
    for ``3 * window_s`` seconds (its daemon stopped) is forgotten.

    Args:
        interval_s: seconds between scrape rounds.
        window_s: rate window (s); samples older than it are dropped.
        timeout_s: per-GET timeout (s).
        max_concurrency: concurrent GETs at most.
        fetch: ``(url, timeout_s) -> text`` (default :func:`fetch_metrics`).
        counters: where each round adds its GETs (``eaas_operator_load_scrapes_total{result}``,
            ``ok`` or ``failed``; None: not counted).
    """

    def __init__(
        self,
        interval_s: float = DEFAULT_INTERVAL_S,
        window_s: float = DEFAULT_WINDOW_S,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        max_concurrency: int = DEFAULT_CONCURRENCY,
        fetch: Callable[[str, float], str] = fetch_metrics,
        counters: WorkCounters | None = None,
    ) -> None:
        if interval_s <= 0 or window_s <= 0 or timeout_s <= 0 or max_concurrency < 1:
            raise ValueError(
                "load scraper: interval, window and timeout must be > 0 and concurrency >= 1 "
                f"(got {interval_s}, {window_s}, {timeout_s}, {max_concurrency})"
            )
        if window_s < 2 * interval_s:
            raise ValueError(
                f"load window ({window_s} s) must hold at least two scrapes "
                f"(interval {interval_s} s)"
            )
        self.interval_s = interval_s
        self.window_s = window_s
        self.timeout_s = timeout_s
        self.max_concurrency = max_concurrency
        self._fetch = fetch
        self.counters = counters
        self._lock = threading.Lock()
        self._targets: dict[Any, tuple[float, dict[str, tuple[str, str]]]] = {}
        self._windows: dict[str, CounterWindow] = {}
        self._loads: dict[Any, PoolLoad] = {}
        self._failing: dict[str, tuple[int, float, str]] = {}  # uid -> (failures, retry at, why)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=max_concurrency, thread_name_prefix="eaas-load"
        )

    @classmethod
    def from_settings(
        cls, settings: LoadSettings, counters: WorkCounters | None = None
    ) -> LoadScraper:
        """A scraper with ``settings`` (:class:`eaas.operator.settings.LoadSettings`), counting
        its GETs in ``counters``.

        Raises:
            ValueError: the constraints of the constructor.
        """
        return cls(
            interval_s=settings.scrape_s,
            window_s=settings.window_s,
            max_concurrency=settings.concurrency,
            counters=counters,
        )

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> LoadScraper:
        """:meth:`from_settings` of :meth:`eaas.operator.settings.LoadSettings.from_env`.

        Raises:
            ValueError: a value that is not a number, or the constraints of the constructor.
        """
        return cls.from_settings(LoadSettings.from_env(env))

    def start(self) -> LoadScraper:
        """Start the background thread (idempotent)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="eaas-load", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def set_targets(self, pool: Any, targets: Mapping[str, tuple[str, str]]) -> None:
        """Register the pods to scrape for ``pool``: pod uid -> (pod name, metrics URL)."""
        with self._lock:
            self._targets[pool] = (time.monotonic(), dict(targets))

    def keep(self, pool: Any) -> None:
        """Renew ``pool``'s registration with its targets unchanged (its daemon runs, but an
        idle pool steps, and calls :meth:`set_targets`, only every few minutes)."""
        with self._lock:
            held = self._targets.get(pool)
            if held is not None:
                self._targets[pool] = (time.monotonic(), held[1])

    def load(self, pool: Any) -> PoolLoad:
        """The pool's last computed load (empty before the first two scrapes)."""
        with self._lock:
            return self._loads.get(pool) or PoolLoad(window_s=self.window_s)

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.monotonic()
            try:
                self.scrape_once()
            except Exception:  # a bug must not end the thread
                log.exception("load scrape round failed")
            self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - t0)))

    def scrape_once(self) -> None:
        """One round: GET every target (bounded concurrency, each with the timeout) but those
        backing off after failures (:data:`RETRY_MAX_S`) and, in a pool none of whose servers
        answered yet, all but :data:`PROBE_SERVERS`; append the samples, drop the old ones,
        recompute every pool's :class:`PoolLoad`."""
        now = time.monotonic()
        with self._lock:
            for pool, (seen, _) in list(self._targets.items()):
                if now - seen > 3 * self.window_s:
                    del self._targets[pool]
                    self._loads.pop(pool, None)
            targets = {pool: dict(t) for pool, (_, t) in self._targets.items()}
            failing = dict(self._failing)
            answered = set(self._windows)  # pods that gave a sample since they became targets
        due: list[tuple[str, str]] = []
        for t in targets.values():
            waiting = sorted(
                (retry_at, uid, url)
                for uid, (_, url) in t.items()
                if (retry_at := failing.get(uid, (0, 0.0, ""))[1]) <= now  # failing: back off
            )
            if not answered.intersection(t):  # nothing answered yet: probe a few
                waiting = waiting[:PROBE_SERVERS]
            due += [(uid, url) for _, uid, url in waiting]
        jobs = {uid: self._pool.submit(self._fetch, url, self.timeout_s) for uid, url in due}
        results: dict[str, tuple[float, dict[LayerExpert, float] | None, str]] = {}
        for uid, fut in jobs.items():
            try:
                text = fut.result(timeout=self.timeout_s + 5)
                results[uid] = (time.monotonic(), parse_expert_tokens(text), "")
            except (OSError, ValueError, concurrent.futures.TimeoutError) as exc:
                results[uid] = (time.monotonic(), None, str(exc) or type(exc).__name__)
        if self.counters is not None and results:
            failed = sum(1 for _, counters, _ in results.values() if counters is None)
            self.counters.add(
                "eaas_operator_load_scrapes_total", len(results) - failed, result="ok"
            )
            self.counters.add("eaas_operator_load_scrapes_total", failed, result="failed")
        now = time.monotonic()
        with self._lock:
            live = {uid for t in targets.values() for uid in t}
            for uid in set(self._windows) - live:
                del self._windows[uid]
            for uid in set(self._failing) - live:
                del self._failing[uid]
            for uid, (at, counters, why) in results.items():
                if counters is not None:
                    self._failing.pop(uid, None)
                    window = self._windows.setdefault(uid, CounterWindow(self.window_s))
                    window.add(CounterSample(at, counters))
                else:
                    fails = self._failing.get(uid, (0, 0.0, ""))[0] + 1
                    delay = min(self.interval_s * 2**fails, RETRY_MAX_S)
                    self._failing[uid] = (fails, at + delay, why)
            for pool, t in targets.items():
                load = PoolLoad(window_s=self.window_s, updated_s=time.monotonic())
                for uid, (name, _) in t.items():
                    held_error = self._failing.get(uid, (0, 0.0, "not scraped"))[2]
                    err = results[uid][2] if uid in results else held_error
                    if err:
                        load.errors[name] = err
                    held = self._windows.get(uid)
                    r = held.rates(now) if held is not None else None
                    if r is not None:
                        load.per_server[name] = r[0]
                self._loads[pool] = load
