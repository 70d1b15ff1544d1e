"""Expert load as an input: parsing the servers' counters, windowed token
rates with counter resets, the status summary, and the scraper against real HTTP servers."""

from __future__ import annotations

import http.server
import threading
import time

import pytest

from eaas.operator.load import (
    CounterSample,
    CounterWindow,
    LoadScraper,
    load_summary,
    metrics_url,
    parse_expert_tokens,
    pool_rates,
    server_rates,
)

pytestmark = pytest.mark.elastic

EXPOSITION = """# HELP eaas_expert_tokens_total Tokens computed per (layer, expert).
# TYPE eaas_expert_tokens_total counter
eaas_expert_tokens_total{expert="0",layer="1"} 10.0
eaas_expert_tokens_total{layer="1",expert="3"} 2.5e+02
eaas_expert_tokens_total{expert="1",layer="2"} 0.0
# HELP eaas_expert_tokens_created Unix creation time.
eaas_expert_tokens_created{expert="0",layer="1"} 1.7e+09
eaas_expert_server_batch_tokens_bucket{le="1.0"} 4.0
"""


def test_parse_expert_tokens_reads_only_the_counter_in_any_label_order():
    assert parse_expert_tokens(EXPOSITION) == {(1, 0): 10.0, (1, 3): 250.0, (2, 1): 0.0}
    assert parse_expert_tokens("") == {}


def test_parse_expert_tokens_rejects_garbage_values():
    with pytest.raises(ValueError, match="eaas_expert_tokens_total"):
        parse_expert_tokens('eaas_expert_tokens_total{layer="x",expert="1"} 3\n')
    with pytest.raises(ValueError, match="bad"):
        parse_expert_tokens('eaas_expert_tokens_total{layer="1",expert="1"} -3\n')


def s(t, **counters):
    return CounterSample(t, {(1, int(k[1:])): v for k, v in counters.items()})


def test_rate_is_increase_over_span():
    rates, span = server_rates(
        [s(0, e0=0, e1=100), s(10, e0=50, e1=100), s(20, e0=100, e1=300)], 60
    )
    assert span == 20
    assert rates == {(1, 0): 5.0, (1, 1): 10.0}


def test_counter_reset_counts_from_zero():
    # e0 restarts between t=10 and t=20: 100 -> 30 means 30 new tokens, not -70
    rates, _ = server_rates([s(0, e0=0), s(10, e0=100), s(20, e0=30)], 60)
    assert rates == {(1, 0): (100 + 30) / 20}


def test_series_appearing_later_counts_from_zero():
    rates, _ = server_rates([s(0, e0=10), s(10, e0=10, e5=40)], 60)
    assert rates == {(1, 0): 0.0, (1, 5): 4.0}


def test_window_drops_old_samples_and_needs_two():
    samples = [s(0, e0=0), s(100, e0=1000), s(110, e0=1100)]
    rates, span = server_rates(samples, 30)
    assert span == 10 and rates == {(1, 0): 10.0}
    assert server_rates(samples, 30, now_s=200) is None  # nothing fresh: no rate
    assert server_rates([s(5, e0=1)], 30) is None
    assert server_rates([s(5, e0=1), s(5, e0=2)], 30) is None  # no time spanned
    assert server_rates([], 30) is None


def test_samples_out_of_order_are_sorted():
    rates, _ = server_rates([s(20, e0=40), s(0, e0=0), s(10, e0=20)], 60)
    assert rates == {(1, 0): 2.0}


def test_pool_rates_sum_replicas_and_summary():
    per_server = {
        "a": {(1, 0): 30.0, (1, 1): 10.0},
        "b": {(1, 0): 10.0, (2, 2): 0.0},
        "c": {},
    }
    assert pool_rates(per_server) == {(1, 0): 40.0, (1, 1): 10.0, (2, 2): 0.0}
    summary = load_summary(per_server, 30.0, hottest=2)
    assert summary == {
        "servers": 3,
        "windowSeconds": 30.0,
        "totalTokensPerSecond": 50.0,
        "serverMaxTokensPerSecond": 40.0,
        "serverMeanTokensPerSecond": round(50 / 3, 2),
        "balancedness": round((50 / 3) / 40, 4),
        "hottestExperts": ["L1/E0: 40.00", "L1/E1: 10.00"],
    }
    idle = load_summary({"a": {}}, 30.0)
    assert idle["balancedness"] == 1.0 and idle["hottestExperts"] == []


def test_metrics_url_from_the_http_port():
    pod = {
        "metadata": {"labels": {"eaas.io/role": "expert-server"}},
        "status": {"podIP": "127.1.0.7"},
        "spec": {
            "containers": [
                {"name": "expert-server", "ports": [{"name": "http", "containerPort": 9001}]}
            ]
        },
    }
    assert metrics_url(pod) == "http://127.1.0.7:9001/metrics"
    assert metrics_url({**pod, "status": {}}) is None


class _Counters(http.server.BaseHTTPRequestHandler):
    value = 0.0
    hang = False

    def do_GET(self):  # noqa: N802
        if self.hang:
            time.sleep(20)
        body = f'eaas_expert_tokens_total{{layer="1",expert="2"}} {type(self).value}\n'.encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def _serve(handler):
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


def test_scraper_rates_from_real_servers_and_a_hung_one_does_not_block():
    live = type("Live", (_Counters,), {"value": 0.0})
    hung = type("Hung", (_Counters,), {"hang": True})
    a, b = _serve(live), _serve(hung)
    scraper = LoadScraper(interval_s=0.2, window_s=30, timeout_s=3.0, max_concurrency=2)
    try:
        scraper.set_targets(
            ("ns", "pool"),
            {
                "uid-a": ("pool-0", f"http://127.0.0.1:{a.server_port}/metrics"),
                "uid-b": ("pool-1", f"http://127.0.0.1:{b.server_port}/metrics"),
                "uid-c": ("pool-2", "http://127.0.0.1:9/metrics"),  # refused
            },
        )
        assert scraper.load(("ns", "pool")).total() is None  # nothing scraped: unknown
        scraper.scrape_once()
        t0 = time.monotonic()
        live.value = 500.0
        time.sleep(0.5)
        scraper.scrape_once()
        elapsed = time.monotonic() - t0
        load = scraper.load(("ns", "pool"))
        assert set(load.per_server) == {"pool-0"}
        rate = load.per_server["pool-0"][(1, 2)]
        assert 500 / (elapsed + 5.0) < rate <= 500 / 0.5  # 500 tokens over the scrapes' span
        assert set(load.errors) == {"pool-1", "pool-2"}
        assert load.total() == rate
        # a pod that leaves the targets loses its samples
        scraper.set_targets(("ns", "pool"), {})
        scraper.scrape_once()
        assert scraper.load(("ns", "pool")).per_server == {}
    finally:
        scraper.stop()
        a.shutdown()
        b.shutdown()


def test_scraper_settings_are_checked():
    with pytest.raises(ValueError, match="two scrapes"):
        LoadScraper(interval_s=10, window_s=15)
    with pytest.raises(ValueError):
        LoadScraper(max_concurrency=0)
    assert (
        LoadScraper.from_env(
            {"EAAS_OPERATOR_LOAD_WINDOW_S": "12", "EAAS_OPERATOR_LOAD_SCRAPE_S": "3"}
        ).window_s
        == 12
    )


def test_counter_window_matches_server_rates_on_random_counters_with_resets():
    import random

    rng = random.Random(7)
    window = CounterWindow(30.0)
    samples = []
    values = {(1, e): 0.0 for e in range(6)}
    t = 0.0
    for _ in range(60):
        t += rng.uniform(1.0, 6.0)
        for key in values:
            if rng.random() < 0.05:
                values[key] = rng.uniform(0, 5)  # a restart: counted from 0
            else:
                values[key] += rng.uniform(0, 50)
        shown = {k: v for k, v in values.items() if not (k[1] == 5 and t < 40)}  # appears later
        sample = CounterSample(t, shown)
        samples.append(sample)
        window.add(sample)
        want = server_rates(samples, 30.0)
        got = window.rates()
        if want is None:
            assert got is None
            continue
        assert got[1] == pytest.approx(want[1])
        assert set(want[0]) <= set(got[0])
        for key, rate in got[0].items():
            assert rate == pytest.approx(want[0].get(key, 0.0), abs=1e-6)
    assert window.rates(now_s=t + 100) is None  # everything left the window


def test_parse_real_prometheus_client_exposition_fast_path_equals_general():
    from prometheus_client import CollectorRegistry, Counter, generate_latest

    import eaas.operator.load as load_mod

    reg = CollectorRegistry()
    c = Counter("eaas_expert_tokens", "t", ["layer", "expert"], registry=reg)
    for layer in (3, 4):
        for e in range(40):
            c.labels(layer=str(layer), expert=str(e)).inc(layer * 1000 + e * 7.5)
    text = generate_latest(reg).decode()
    fast = parse_expert_tokens(text)
    assert load_mod._FAST.findall(text)  # this text takes the fast path
    slow = parse_expert_tokens(text + '\neaas_expert_tokens_total{layer="9",expert="9"} 1 1700\n')
    assert fast[(4, 39)] == 4000 + 39 * 7.5 and len(fast) == 80
    assert {k: v for k, v in slow.items() if k != (9, 9)} == fast and slow[(9, 9)] == 1.0
