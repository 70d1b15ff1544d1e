"""The load scraper's cost for a pool whose servers serve no metrics (kwok pods, a wrong port)
does not grow with the pool: while none of its servers answered yet, a round GETs at most
:data:`~eaas.operator.load.PROBE_SERVERS` of them, those waiting the longest; after the first
answer every server is scraped. The GETs are counted (``eaas_operator_load_scrapes_total``)."""

from __future__ import annotations

import pytest

from eaas.operator.counters import WorkCounters
from eaas.operator.load import PROBE_SERVERS, LoadScraper

pytestmark = pytest.mark.scale

SAMPLE = 'eaas_expert_tokens_total{expert="2",layer="1"} 5\n'


def _scraper(serving: set[str], calls: list[str], counters: WorkCounters) -> LoadScraper:
    def fetch(url: str, timeout_s: float) -> str:
        calls.append(url)
        if url not in serving:
            raise ConnectionRefusedError("refused")
        return SAMPLE

    # interval 1 s: a failed server waits 2 s, 4 s, ... (not due again within the test)
    return LoadScraper(interval_s=1.0, window_s=30.0, fetch=fetch, counters=counters)


@pytest.mark.parametrize("servers", [16, 1024])
def test_a_pool_none_of_whose_servers_answer_costs_a_few_gets_per_round(servers):
    calls: list[str] = []
    counters = WorkCounters()
    scraper = _scraper(set(), calls, counters)
    targets = {f"uid-{i}": (f"p-{i}", f"http://s{i}/metrics") for i in range(servers)}
    try:
        scraper.set_targets("pool", targets)
        rounds = min(5, servers // PROBE_SERVERS)  # rounds back to back: no retry is due
        for _ in range(rounds):
            scraper.scrape_once()
        # the same few GETs per round at 16 and at 1,024 servers, never the same server twice
        assert len(calls) == rounds * PROBE_SERVERS, calls
        assert len(set(calls)) == len(calls)
        assert counters.get("eaas_operator_load_scrapes_total", result="failed") == len(calls)
        assert counters.get("eaas_operator_load_scrapes_total", result="ok") == 0
        errors = scraper.load("pool").errors
        assert len(errors) == servers  # every server reported: refused or not scraped yet
        assert sum(why == "refused" for why in errors.values()) == len(calls)
    finally:
        scraper.stop()


def test_every_server_is_scraped_from_the_round_after_the_first_answer():
    calls: list[str] = []
    counters = WorkCounters()
    urls = [f"http://s{i}/metrics" for i in range(40)]
    scraper = _scraper(set(urls), calls, counters)  # all serve
    try:
        scraper.set_targets("pool", {f"uid-{i}": (f"p-{i}", u) for i, u in enumerate(urls)})
        scraper.scrape_once()
        assert len(calls) == PROBE_SERVERS  # nothing answered before: probe a few
        scraper.scrape_once()
        assert len(calls) == PROBE_SERVERS + len(urls)  # one answered: all of them
        assert counters.get("eaas_operator_load_scrapes_total", result="ok") == len(calls)
        scraper.scrape_once()
        assert set(scraper.load("pool").per_server) >= {f"p-{i}" for i in range(PROBE_SERVERS)}
    finally:
        scraper.stop()


def test_a_pool_of_its_own_is_probed_although_another_pool_answers():
    calls: list[str] = []
    counters = WorkCounters()
    scraper = _scraper({"http://a0/metrics"}, calls, counters)
    try:
        scraper.set_targets("a", {"uid-a0": ("a-0", "http://a0/metrics")})
        scraper.set_targets(
            "b", {f"uid-b{i}": (f"b-{i}", f"http://b{i}/metrics") for i in range(50)}
        )
        scraper.scrape_once()
        assert sum(u.startswith("http://b") for u in calls) == PROBE_SERVERS
        assert scraper.load("a").per_server == {}  # one sample: no rate yet
    finally:
        scraper.stop()
