"""Scale-down that drains, and a burst of replica changes, on process nodes.

One ``placement.assignment: routing-table`` pool (tiny model, 4 servers, redundancy 2) and one
attention client, all real processes; 16 streaming completions (official ``openai`` client,
greedy) run in a loop throughout.

1. 4 -> 3 under the 16 streams: no request fails and every answer has the baseline tokens; the
   client acknowledged a table without the leaving server before its pod was deleted; and by the
   leaving server's own record (its exit line in its log: frames answered, the wall-clock time
   of its last frame, of the SIGTERM, frames answered after it) its last frame came before the
   pod's deletion was asked, and nothing was left to answer when it stopped. The operator's
   ``ServerDrained`` Event names it.
2. Re-placement of live servers, back to 4: a pod spec change (``podTemplate`` env) makes all 3
   outdated; each in turn leaves an acknowledged table, drains and only then is deleted (the
   same proof from its own record), its replacement joins; the fourth server is new; no request
   fails.
3. Then ``replicas`` patched 4 -> 5 -> 6 -> 7 -> 6 -> 8 -> 5 within 20 s under the same
   streams: the pool converges to 5 within the bound docs/autoscaling.md states; the survivors
   keep their UIDs and restart counts; every pod created during the burst ends up serving (in
   the published table, answering frames), none is created and deleted without; at every
   status sample, a Ready pool (status for the current generation) has ``readyReplicas`` equal to
   ``spec.replicas``; no request fails.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import threading
import time
import uuid
from datetime import datetime
from pathlib import Path

import openai
import pytest

from eaas.runtime.tables.table import RoutingTable

from helpers.faults import apply_tiny_pool_and_fleet
from helpers.k8s import (
    Operator,
    apply_crds,
    get,
    get_json,
    kubectl,
    routing_table,
    wait_for,
    wait_namespaces_deleted,
)
from helpers.k8s import server_pods as _server_pods

pytestmark = pytest.mark.elastic

POOL = "drain"
PROMPTS = [f"Stream {i}: a long story about the number {i * 11}" for i in range(16)]
MAX_TOKENS = 32
BURST = (5, 6, 7, 6, 8, 5)  # from 4, one patch every ~2-3 s (< 20 s in all, < the 5 s settle)
BURST_GAP_S = 1.5
# spec.replicas settles 5 s (EAAS_OPERATOR_SCALE_SETTLE_S), then a pod starts and the table's
# two phases run: the bound docs/autoscaling.md states for a loaded test machine
CONVERGE_BOUND_S = 180.0
ENV_MARK = {"name": "EAAS_TEST_REVISION", "value": "2"}  # a pod spec change: re-placement
EXIT_LINE = re.compile(
    r"expert-server \S+ stopped: frames=(\d+) last_frame_unix=([\d.]+|none) \(.*?\) "
    r"stop_unix=([\d.]+|none) frames_after_stop=(\d+)"
)


def pods(ns: str) -> dict[str, dict]:
    return _server_pods(ns, POOL, terminating=True)


def restarts(pod: dict) -> int:
    return sum(c.get("restartCount", 0) for c in pod["status"].get("containerStatuses") or [])


def rfc3339(ts: str) -> float:
    return datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp()


class Watcher:
    """Polls the published table, the fleet's acknowledged version, the server pods and the
    pool's status (wall-clock times)."""

    def __init__(self, ns: str):
        self.ns = ns
        self.tables: dict[int, RoutingTable] = {}
        self.acked_at: dict[int, float] = {}
        self.deleted_at: dict[str, float] = {}  # pod uid -> first seen terminating or gone
        self.pods: dict[str, dict] = {}  # pod uid -> its last JSON
        self.pods_seen_at: dict[str, float] = {}  # pod uid -> first seen
        self.table_at: dict[int, float] = {}  # table version -> first seen
        self.inconsistent: list[str] = []
        self.samples = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def poll(self) -> None:
        t = routing_table(self.ns, POOL)
        if t is not None:
            self.tables.setdefault(t.version, t)
            self.table_at.setdefault(t.version, time.time())
        f = get("attentionfleet", "clients", self.ns) or {}
        v = (f.get("status") or {}).get("acknowledgedVersion") or 0
        for tv in self.tables:
            if tv <= v:
                self.acked_at.setdefault(tv, time.time())
        now = pods(self.ns)
        uids = {p["metadata"]["uid"] for p in now.values()}
        for p in now.values():
            self.pods[p["metadata"]["uid"]] = p
            self.pods_seen_at.setdefault(p["metadata"]["uid"], time.time())
            if p["metadata"].get("deletionTimestamp"):
                self.deleted_at.setdefault(p["metadata"]["uid"], time.time())
        for uid in set(self.pods) - uids:
            self.deleted_at.setdefault(uid, time.time())
        pool = get("expertpool", POOL, self.ns) or {}
        st = pool.get("status") or {}
        ready = {c["type"]: c["status"] for c in st.get("conditions") or []}.get("Ready")
        current = st.get("observedGeneration") == pool.get("metadata", {}).get("generation")
        if current and ready == "True" and st.get("readyReplicas") != pool["spec"]["replicas"]:
            self.inconsistent.append(
                f"Ready with readyReplicas {st.get('readyReplicas')} != spec.replicas "
                f"{pool['spec']['replicas']}"
            )
        self.samples += 1

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll()
            except Exception:  # noqa: BLE001  (a kubectl hiccup: poll again)
                pass
            self._stop.wait(0.2)

    def __enter__(self) -> Watcher:
        self.poll()  # the pods that exist now, before any change
        self._t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join(30)


class Streams:
    """16 streaming completions in a loop (one thread each) until stopped; every answer kept."""

    def __init__(self, api: openai.OpenAI, model: str):
        self.api, self.model = api, model
        self.answers: list[tuple[int, str]] = []
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(len(PROMPTS))
        ]

    def _loop(self, i: int) -> None:
        while not self._stop.is_set():
            try:
                self.answers.append((i, stream_one(self.api, self.model, PROMPTS[i])))
            except BaseException as exc:  # noqa: BLE001
                self.errors.append(exc)
                return

    def __enter__(self) -> Streams:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(300)


def stream_one(api: openai.OpenAI, model: str, prompt: str) -> str:
    stream = api.completions.create(
        model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True
    )
    return "".join(chunk.choices[0].text for chunk in stream if chunk.choices)


def assert_drained(w: Watcher, state_dir: Path, ns: str, uid: str) -> dict:
    """The pod ``uid`` left as it must: a table without it was acknowledged before its
    deletion; by its own exit record it served, got no frame after its SIGTERM and its last
    frame came before its deletion was asked (seen by ``w``, and by the deletionTimestamp).
    Returns the record."""
    pod = w.pods[uid]
    name = pod["metadata"]["name"]
    assert uid in w.deleted_at, f"{name} was not deleted"
    # a table without it, published before its deletion, acknowledged before its deletion
    without = [
        v
        for v, tb in w.tables.items()
        if name not in tb.servers and w.table_at[v] <= w.deleted_at[uid]
    ]
    assert without, f"no table without {name} was seen"
    assert w.acked_at.get(min(without), float("inf")) <= w.deleted_at[uid] + 2.0, (
        f"{name} was deleted before the client acknowledged a table without it"
    )
    record = exit_record(state_dir, ns, pod)
    assert record["stop_unix"] is not None and record["last_frame_unix"] is not None, record
    assert record["frames_after_stop"] == 0, f"{name}: frames still came after its SIGTERM"
    assert record["last_frame_unix"] <= record["stop_unix"]
    assert record["last_frame_unix"] < w.deleted_at[uid]
    # the deletion's own time: deletionTimestamp = request + grace (1 s resolution)
    deletion = pod["metadata"].get("deletionTimestamp")
    if deletion:
        grace = pod["metadata"].get("deletionGracePeriodSeconds", 30)
        asked = rfc3339(deletion) - grace
        assert record["last_frame_unix"] <= asked + 1.0, (record, deletion, grace)
    drained = get_json("events", "-n", ns, "--field-selector", "reason=ServerDrained")["items"]
    assert any(f"server {name} drained" in e["message"] for e in drained), drained
    for tv, tb in w.tables.items():
        assert not tb.uncovered(), f"version {tv} uncovers {tb.uncovered()[:4]}"
    return record


def exit_record(state_dir: Path, ns: str, pod: dict) -> dict:
    """The server's exit line from its log on its process node (``frames``, ``last_frame_unix``,
    ``stop_unix``, ``frames_after_stop``)."""
    meta = pod["metadata"]
    folder = f"{ns}_{meta['name']}_{meta['uid'][:8]}"
    logs = sorted(state_dir.glob(f"nodes/*/pods/{folder}/*.log"))
    assert logs, f"no log of {meta['name']} under {state_dir}"
    found = [m for f in logs for m in EXIT_LINE.finditer(f.read_text(errors="replace"))]
    assert found, f"{meta['name']} logged no exit line ({[str(f) for f in logs]})"
    m = found[-1]

    def num(s: str) -> float | None:
        return None if s == "none" else float(s)

    return {
        "frames": int(m.group(1)),
        "last_frame_unix": num(m.group(2)),
        "stop_unix": num(m.group(3)),
        "frames_after_stop": int(m.group(4)),
    }


@pytest.fixture(scope="module")
def operator(cluster, tmp_path_factory):
    apply_crds()
    op = Operator(tmp_path_factory.mktemp("operator") / "operator.log")
    op.start()
    yield op
    wait_namespaces_deleted()  # while the operator runs: it removes the pools' finalizers
    op.stop()


def serving(ns: str, n: int):
    """The published table once ``n`` servers serve it: confirmed, acknowledged, no other pod."""
    t, p = routing_table(ns, POOL), get("expertpool", POOL, ns)
    f = get("attentionfleet", "clients", ns)
    ps, fs = (p or {}).get("status") or {}, (f or {}).get("status") or {}
    ready = {c["type"]: c["status"] for c in ps.get("conditions") or []}.get("Ready")
    ok = (
        t is not None
        and len(t.servers) == n
        and not t.uncovered()
        and set(pods(ns)) == {f"{POOL}-{i}" for i in range(n)}
        and ps.get("serversConfirmed") == n
        and ps.get("stagedRoutingTableVersion") == 0
        and ps.get("readyReplicas") == n
        and ps.get("replicas") == n
        and ready == "True"
        and fs.get("readyReplicas") == 1
        and fs.get("acknowledgedVersion") == t.version
    )
    return t if ok else None


def scale(ns: str, n: int) -> None:
    kubectl(
        "patch",
        "expertpool",
        POOL,
        "-n",
        ns,
        "--type=merge",
        "-p",
        json.dumps({"spec": {"replicas": n}}),
    )


def test_scale_down_drains_and_a_burst_converges(operator, cluster):
    ns = f"t-{uuid.uuid4().hex[:6]}"
    kubectl("create", "namespace", ns)
    apply_tiny_pool_and_fleet(
        ns, pool=POOL, servers=4, pool_spec={"placement": {"assignment": "routing-table"}}
    )
    try:
        wait_for("pool of 4 serving", lambda: serving(ns, 4), timeout=400, interval=1)
        cpod = next(
            p
            for p in get_json("pods", "-n", ns, "-l", "eaas.io/fleet=clients")["items"]
            if p["status"].get("podIP")
        )
        api = openai.OpenAI(
            base_url=f"http://{cpod['status']['podIP']}:8000/v1", api_key="unused", timeout=300
        )
        model = api.models.list().data[0].id
        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as ex:
            baseline = list(ex.map(lambda p: stream_one(api, model, p), PROMPTS))
        assert all(baseline), baseline

        # ---- 4 -> 3 under 16 streams: out of an acknowledged table, drained, then deleted ----
        leaving = pods(ns)[f"{POOL}-3"]
        survivors = {
            n: (p["metadata"]["uid"], restarts(p))
            for n, p in pods(ns).items()
            if n != leaving["metadata"]["name"]
        }
        t0 = time.monotonic()
        with Watcher(ns) as w, Streams(api, model) as s:
            wait_for("streams running", lambda: len(s.answers) >= 16 or s.errors, timeout=300)
            scale(ns, 3)
            final = wait_for("scaled to 3", lambda: serving(ns, 3), timeout=300, interval=0.5)
            took = time.monotonic() - t0
            n_during = len(s.answers)
            wait_for(
                "streams after the scale-down",
                lambda: len(s.answers) >= n_during + 16 or s.errors,
                timeout=300,
            )
        assert not s.errors, s.errors[0]
        assert s.answers and all(a == baseline[i] for i, a in s.answers)
        now = {n: (p["metadata"]["uid"], restarts(p)) for n, p in pods(ns).items()}
        assert now == survivors, "a survivor was replaced or restarted"
        uid = leaving["metadata"]["uid"]
        record = assert_drained(w, cluster.state_dir, ns, uid)
        assert record["frames"] > 0, "the leaving server never served: the test shows nothing"
        for tv, tb in w.tables.items():
            assert not tb.uncovered(), f"version {tv} uncovers {tb.uncovered()[:4]}"
        assert min(len(r) for ex in final.layers.values() for r in ex) >= 2
        gap = w.deleted_at[uid] - record["last_frame_unix"]
        print(
            f"\n[measure] 4->3 under 16 streams: converged {took:.1f}s, {len(s.answers)} streams "
            f"all with the baseline tokens, leaving server answered {record['frames']} frames, "
            f"its last {gap:.2f}s before its deletion was seen, 0 after SIGTERM"
        )

        # ---- re-placement of live servers (pod spec changed): each leaves the table first ----
        old = {p["metadata"]["uid"]: n for n, p in pods(ns).items()}
        overlay = {"spec": {"containers": [{"name": "expert-server", "env": [ENV_MARK]}]}}
        t0 = time.monotonic()
        with Watcher(ns) as w, Streams(api, model) as s:
            kubectl(
                "patch",
                "expertpool",
                POOL,
                "-n",
                ns,
                "--type=merge",
                "-p",
                json.dumps({"spec": {"podTemplate": overlay, "replicas": 4}}),
            )

            def replaced():
                now = pods(ns)
                fresh = all(
                    p["metadata"]["uid"] not in old
                    and ENV_MARK in (p["spec"]["containers"][0].get("env") or [])
                    for p in now.values()
                )
                return fresh and serving(ns, 4)

            wait_for("every server replaced", replaced, timeout=400, interval=1)
            took = time.monotonic() - t0
            n_after = len(s.answers)
            wait_for(
                "streams after the re-placement",
                lambda: len(s.answers) >= n_after + 16 or s.errors,
                timeout=300,
            )
        assert not s.errors, s.errors[0]
        assert all(a == baseline[i] for i, a in s.answers)
        gaps = [assert_drained(w, cluster.state_dir, ns, uid) for uid in old]
        assert all(g["frames"] > 0 for g in gaps)
        print(
            f"[measure] re-placement of 3 live servers (and 3->4) under 16 streams: {took:.1f}s, "
            f"{len(s.answers)} streams all with the baseline tokens, each replaced server out of "
            f"an acknowledged table and drained before its deletion, 0 frames after SIGTERM"
        )

        # ---- the burst 4 -> 5 -> 6 -> 7 -> 6 -> 8 -> 5 within 20 s ------------------------------
        before = {p["metadata"]["uid"]: (n, restarts(p)) for n, p in pods(ns).items()}
        with Watcher(ns) as w, Streams(api, model) as s:
            b0 = time.monotonic()
            for k, n in enumerate(BURST):
                if k:
                    time.sleep(BURST_GAP_S)
                scale(ns, n)
            burst_s = time.monotonic() - b0
            last_patch = time.monotonic()
            final = wait_for(
                "burst converged to 5",
                lambda: serving(ns, 5),
                timeout=CONVERGE_BOUND_S,
                interval=0.5,
            )
            converged = time.monotonic() - last_patch
            n_after = len(s.answers)
            wait_for(
                "streams after the burst",
                lambda: len(s.answers) >= n_after + 16 or s.errors,
                timeout=300,
            )
        assert burst_s < 20.0, f"the burst took {burst_s:.1f}s"
        assert not s.errors, s.errors[0]
        assert all(a == baseline[i] for i, a in s.answers)
        now = {p["metadata"]["uid"]: (n, restarts(p)) for n, p in pods(ns).items()}
        assert {u: now.get(u) for u in before} == before, "a survivor was replaced or restarted"
        created = set(w.pods) - set(before)
        assert not (created & set(w.deleted_at)), "a pod was created and deleted during the burst"
        assert {w.pods[u]["metadata"]["name"] for u in created} == {f"{POOL}-4"}
        assert f"{POOL}-4" in final.servers and final.hosted_by(f"{POOL}-4")
        assert not w.inconsistent, w.inconsistent[:3]
        for tv, tb in w.tables.items():
            assert not tb.uncovered(), f"version {tv} uncovers {tb.uncovered()[:4]}"
        print(
            f"[measure] burst {BURST} in {burst_s:.1f}s: converged {converged:.1f}s after the "
            f"last patch (bound {CONVERGE_BOUND_S:.0f}s), pods created {len(created)}, "
            f"deleted 0, {w.samples} status samples consistent, {len(s.answers)} streams ok"
        )
    finally:
        kubectl("delete", "namespace", ns, "--wait=false", check=False)
