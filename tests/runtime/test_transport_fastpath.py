"""The shared-memory transport's per-frame fast path keeps the protocol's rules:
frame shapes validated once per shape are still validated for every new shape, a server busy
with one client still accepts and remaps others, and a server answer that does not fit the
response slot is an error response, never a hang. Real server processes and sockets; shm and the
``cudaipc`` host emulation (the shm data path with another payload mapping); tcp where the rule
is the transport interface's."""

from __future__ import annotations

import multiprocessing as mp
import threading
import time

import pytest
import torch

from eaas.runtime.transport.base import (
    STATUS_BAD_FRAME,
    STATUS_NOT_HOSTED,
    STATUS_OK,
    FrameError,
    RequestFrame,
    ResponseFrame,
)
from eaas.runtime.transport.factory import listen

from helpers.server import (
    HIDDEN,
    TRANSPORT_KINDS,
    connect_emulated,
    listen_endpoint,
    reference,
    request_frame,
    start_server,
)

pytestmark = pytest.mark.timeout(60)

SHM_KINDS = ["unix", pytest.param("cudaipc", marks=pytest.mark.gpu_cpu)]


def _round_trip(c, f: RequestFrame, seq: int):
    c.send(f)
    r = c.recv(time.monotonic() + 10)
    assert r.status == STATUS_OK, r.message
    assert r.seq == seq
    return r.output.clone()


def _connect_while_polling(lst, **kw):
    """Open a client connection to ``lst`` from a thread while this thread polls ``lst`` (which
    answers the hello); returns the connection."""
    client: dict = {}

    def open_client():
        client["c"] = connect_emulated(
            lst.endpoint, "s", hidden_size=HIDDEN, dtype=torch.float32, **kw
        )

    t = threading.Thread(target=open_client)
    t.start()
    deadline = time.monotonic() + 20
    while t.is_alive() and time.monotonic() < deadline:
        lst.poll(0.05)  # answers the hello
    t.join()
    return client["c"]


@pytest.mark.parametrize("kind", TRANSPORT_KINDS)
def test_every_new_frame_shape_is_validated_after_cached_ones(kind, tmp_path):
    """Good frames of one shape first (their validation is remembered), then frames that differ
    from them in one property each: every bad one raises FrameError, loses nothing, and the
    good shapes keep working; 1-D experts / weights (k = 1) and ``rows`` frames are exact."""
    srv = start_server(listen_endpoint(kind, tmp_path))
    try:
        c = connect_emulated(srv.endpoint, "s-test", hidden_size=HIDDEN, dtype=torch.float32)
        good = request_frame(3, 2, seq=1)
        for _ in range(3):
            out = _round_trip(c, good, 1)
        ref = reference(1, good.hidden, good.experts, good.weights)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
        h, ex, w = good.hidden, good.experts, good.weights
        bad = [
            ("dtype", RequestFrame(1, 1, 3, 2, h.to(torch.bfloat16), ex, w)),
            ("hidden", RequestFrame(1, 1, 3, 2, torch.randn(3, HIDDEN + 1), ex, w)),
            ("must both be", RequestFrame(1, 1, 3, 2, h, ex, w[:, :1])),
            ("must both be", RequestFrame(1, 1, 3, 2, h, ex[:2], w[:2])),
            ("rows must be", RequestFrame(1, 1, 3, 2, h, ex, w, rows=torch.tensor([0, 1, 2.0]))),
        ]
        for match, f in bad:
            with pytest.raises(FrameError, match=match):
                c.send(f)
            assert not c.in_flight  # nothing was sent
        # k = 1 as 1-D tensors, and rows gathered from a larger batch
        g = torch.Generator().manual_seed(5)
        h1 = torch.randn(4, HIDDEN, generator=g)
        ex1, w1 = torch.tensor([0, 3, 1, 2], dtype=torch.int32), torch.rand(4, generator=g)
        out = _round_trip(c, RequestFrame(1, 1, 3, 3, h1, ex1, w1), 3)
        ref = reference(1, h1, ex1.unsqueeze(1), w1.unsqueeze(1))
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
        rows = torch.tensor([3, 0], dtype=torch.int64)
        exr, wr = ex1[rows].unsqueeze(1).to(torch.int64), w1[rows].unsqueeze(1)
        for seq in (4, 5):  # the second time from the remembered shape
            out = _round_trip(c, RequestFrame(1, 1, 3, seq, h1, exr, wr, rows=rows), seq)
            ref = reference(1, h1[rows], exr, wr)
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
        out = _round_trip(c, good, 1)  # and the first shape still
        torch.testing.assert_close(
            out, reference(1, good.hidden, good.experts, good.weights), rtol=1e-5, atol=1e-6
        )
        c.close()
    finally:
        srv.stop()


@pytest.mark.parametrize("kind", TRANSPORT_KINDS)
def test_send_parts_answers_as_send_and_checks_each_new_shape(kind, tmp_path):
    """``send_parts`` (the dispatcher's send: the frame's fields and its ``(n, k)``) gives the
    answers ``send`` gives: whole batches and ``rows`` gathers, rung at once or deferred until
    ``ring``, shapes alternating; the first frame of an ``(n, k)`` whose tensors disagree with
    it raises FrameError, sends nothing, and the connection goes on."""
    srv = start_server(listen_endpoint(kind, tmp_path))
    try:
        c = connect_emulated(srv.endpoint, "s-test", hidden_size=HIDDEN, dtype=torch.float32)
        g = torch.Generator().manual_seed(9)
        hb = torch.randn(5, HIDDEN, generator=g)
        rows = torch.tensor([4, 1], dtype=torch.int64)
        frames = [
            request_frame(3, 2, seq=0),
            request_frame(1, 2, seq=0),
            request_frame(2, 2, seq=0),
        ]
        frames[2] = RequestFrame(1, 1, 3, 0, hb, frames[2].experts, frames[2].weights, rows=rows)
        with pytest.raises(FrameError):  # n says 3 tokens, the tensors hold 2 (rows)
            f = frames[2]
            c.send_parts(1, 1, 3, 0, f.hidden, f.experts, f.weights, f.rows, 3, 2)
        assert not c.in_flight
        for seq in range(1, 10):
            f = frames[seq % 3]
            n = f.num_tokens
            c.send_parts(1, 1, 3, seq, f.hidden, f.experts, f.weights, f.rows, n, 2, seq % 2 == 0)
            if seq % 2:
                c.ring()  # a deferred frame waits for its doorbell (recv would ring it too)
            r = c.recv(time.monotonic() + 10)
            assert (r.status, r.seq) == (STATUS_OK, seq), r.message
            ref = reference(1, f.token_hidden(), f.experts, f.weights)
            torch.testing.assert_close(r.output, ref, rtol=1e-5, atol=1e-6)
            c.send(f)  # and send, with the same answer
            r2 = c.recv(time.monotonic() + 10)
            torch.testing.assert_close(r2.output, ref, rtol=1e-5, atol=1e-6)
        # experts / weights must be [n, k] (2-D also for k = 1) on a key's first frame
        h1, e1, w1 = hb[:3], torch.tensor([0, 1, 2], dtype=torch.int32), torch.rand(3)
        with pytest.raises(FrameError, match=r"\[n, k\]"):
            c.send_parts(1, 1, 3, 20, h1, e1, w1, None, 3, 1)
        # a rows frame's hidden of another width, after its key's plan exists: refused, and the
        # key's next frames (send_parts and send) are still right
        f = frames[2]
        with pytest.raises(FrameError, match="hidden must be"):
            c.send_parts(1, 1, 3, 21, hb[:, :-4], f.experts, f.weights, f.rows, 2, 2)
        assert not c.in_flight
        for seq, parts in ((22, True), (23, False)):
            if parts:
                c.send_parts(1, 1, 3, seq, f.hidden, f.experts, f.weights, f.rows, 2, 2)
            else:
                c.send(RequestFrame(1, 1, 3, seq, f.hidden, f.experts, f.weights, f.rows))
            r = c.recv(time.monotonic() + 10)
            assert (r.status, r.seq) == (STATUS_OK, seq), r.message
            ref = reference(1, f.token_hidden(), f.experts, f.weights)
            torch.testing.assert_close(r.output, ref, rtol=1e-5, atol=1e-6)
        c.close()
    finally:
        srv.stop()


def _busy_client(endpoint, started, stop, result):
    """Round trips back to back (the server never idles long enough to block) until ``stop``;
    puts ``(round trips, all ok)`` in ``result``."""
    torch.set_num_threads(1)  # forked child: keep out of the parent's OpenMP pool
    c = connect_emulated(endpoint, "s-test", hidden_size=HIDDEN, dtype=torch.float32)
    f = request_frame(2, 1)
    ok, n = True, 0
    while not stop.is_set():
        c.send(f)
        ok &= c.recv(time.monotonic() + 20).status == STATUS_OK
        n += 1
        if n == 50:
            started.set()
    c.close()
    result.put((n, ok))


@pytest.mark.parametrize("kind", SHM_KINDS)
def test_busy_server_still_accepts_and_remaps_another_client(kind, tmp_path):
    """A server that always has a frame ready (so it never blocks in select) still reads its
    sockets: a new client's hello is answered and its slot grows (remap) on a busy server.
    The server spins up to 50 ms for a frame before it would block (its poll timeout), so the
    busy client's next frame always comes first."""
    srv = start_server(listen_endpoint(kind, tmp_path), spin_us=50_000)
    ctx = mp.get_context("fork")
    started, stop, result = ctx.Event(), ctx.Event(), ctx.Queue()
    p = ctx.Process(target=_busy_client, args=(srv.endpoint, started, stop, result), daemon=True)
    p.start()
    try:
        assert started.wait(30)
        c = connect_emulated(
            srv.endpoint, "s-test", hidden_size=HIDDEN, dtype=torch.float32, max_tokens=1,
            connect_timeout=20,
        )  # fmt: skip
        for i, n in enumerate((1, 40, 3)):  # 40 tokens: a new, larger slot (remap)
            f = request_frame(n, 2, seq=i)
            out = _round_trip(c, f, i)
            ref = reference(1, f.hidden, f.experts, f.weights)
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
        c.close()
        stop.set()
        n_busy, ok = result.get(timeout=30)
        assert ok and n_busy >= 50
    finally:
        stop.set()
        p.join(10)
        if p.is_alive():
            p.kill()
        srv.stop()


@pytest.mark.parametrize("kind", SHM_KINDS)
def test_server_output_that_does_not_fit_is_an_error_response(kind, tmp_path):
    """``respond`` with an output of more rows than the client's slot holds, or of the wrong
    hidden size, answers STATUS_BAD_FRAME with a message (the client never waits out its
    deadline), and the connection keeps working."""
    ep = listen_endpoint(kind, tmp_path)
    lst = listen(ep, hidden_size=HIDDEN, dtype=torch.float32)
    c = _connect_while_polling(lst, max_tokens=2)
    try:
        outputs = [torch.zeros(3, HIDDEN), torch.zeros(1, HIDDEN + 4)]  # 3 rows > 2 of the slot
        for seq, bad in enumerate(outputs):
            c.send(request_frame(1, 1, seq=seq))
            (conn, f), *rest = lst.poll(10)
            assert not rest and f.seq == seq
            lst.respond(conn, ResponseFrame(f.seq, f.layer, STATUS_OK, bad))
            r = c.recv(time.monotonic() + 10)
            assert r.status == STATUS_BAD_FRAME and r.seq == seq
            assert "does not fit" in r.message and r.output is None
        f0 = request_frame(2, 1, seq=7)
        c.send(f0)
        (conn, f), *_ = lst.poll(10)
        lst.respond(conn, ResponseFrame(f.seq, f.layer, STATUS_OK, f.hidden * 2))
        r = c.recv(time.monotonic() + 10)
        assert r.status == STATUS_OK and r.seq == 7
        torch.testing.assert_close(r.output, f0.hidden * 2)
    finally:
        c.close()
        lst.close()


@pytest.mark.parametrize("kind", TRANSPORT_KINDS)
def test_respond_ok_answers_as_respond_does(kind, tmp_path):
    """``respond_ok(conn, request, output)`` (the expert server's answer path; shm writes it
    without a ResponseFrame) gives the client the same answer as ``respond`` with a
    ``STATUS_OK`` frame, and (shared memory) an output that does not fit the slot is a
    STATUS_BAD_FRAME answer."""
    ep = listen_endpoint(kind, tmp_path)
    lst = listen(ep, hidden_size=HIDDEN, dtype=torch.float32)
    c = _connect_while_polling(lst, max_tokens=2)
    try:
        for seq, answer in enumerate(("respond", "respond_ok", "respond", "respond_ok")):
            f0 = request_frame(2, 1, seq=seq)
            c.send(f0)
            (conn, f), *_ = lst.poll(10)
            if answer == "respond":
                lst.respond(conn, ResponseFrame(f.seq, f.layer, STATUS_OK, f.hidden * 3))
            else:
                lst.respond_ok(conn, f, f.hidden * 3)
            r = c.recv(time.monotonic() + 10)
            assert (r.status, r.seq, r.layer) == (STATUS_OK, seq, f0.layer), answer
            torch.testing.assert_close(r.output, f0.hidden * 3)
        if kind != "tcp":  # a shared slot has room for 2 rows: 3 do not fit
            c.send(request_frame(1, 1, seq=9))
            (conn, f), *_ = lst.poll(10)
            lst.respond_ok(conn, f, torch.zeros(3, HIDDEN))
            r = c.recv(time.monotonic() + 10)
            assert (r.seq, r.status) == (9, STATUS_BAD_FRAME) and "does not fit" in r.message
    finally:
        c.close()
        lst.close()


@pytest.mark.parametrize("kind", SHM_KINDS)
def test_an_answer_through_another_listener_or_after_a_drop_writes_nothing(kind, tmp_path):
    """``respond_ok`` / ``respond`` with a connection of another listener write nothing into its
    response slot (the done counter stays); the owner's answer then arrives; a connection the
    listener dropped (its slots released) is ignored, not an error."""
    a = listen(f"{kind}:{tmp_path}/a.sock", hidden_size=HIDDEN, dtype=torch.float32)
    b = listen(f"{kind}:{tmp_path}/b.sock", hidden_size=HIDDEN, dtype=torch.float32)
    c = _connect_while_polling(a, max_tokens=2)
    try:
        f0 = request_frame(2, 1, seq=5)
        c.send(f0)
        (conn, f), *_ = a.poll(10)
        done = conn.slots.resp_q[0]
        b.respond_ok(conn, f, f.hidden * 2)
        b.respond(conn, ResponseFrame(f.seq, f.layer, STATUS_OK, f.hidden * 2))
        assert conn.slots.resp_q[0] == done  # nothing answered through b
        a.respond_ok(conn, f, f.hidden * 2)
        r = c.recv(time.monotonic() + 10)
        assert (r.status, r.seq) == (STATUS_OK, 5)
        torch.testing.assert_close(r.output, f0.hidden * 2)
        c.send(request_frame(1, 1, seq=6))
        (conn, f), *_ = a.poll(10)
        a._drop(conn)  # as for a client that died with its frame in flight
        assert conn.slots is None
        a.respond_ok(conn, f, torch.zeros(1, HIDDEN))  # ignored
    finally:
        c.close()
        a.close()
        b.close()


@pytest.mark.parametrize("kind", SHM_KINDS)
def test_error_status_carries_its_message_and_the_next_frame_is_ok(kind, tmp_path):
    """An error response (STATUS_NOT_HOSTED) reaches the client with its status, seq and utf-8
    message (a message longer than the slot's 1024 bytes is cut there) and no output; the frames
    after it on the same connection are answered normally."""
    ep = listen_endpoint(kind, tmp_path)
    lst = listen(ep, hidden_size=HIDDEN, dtype=torch.float32)
    c = _connect_while_polling(lst)
    try:
        for seq, msg in enumerate(["expert 7 is not hosted here (ü)", "x" * 3000]):
            c.send(request_frame(2, 2, seq=seq))
            (conn, f), *_ = lst.poll(10)
            lst.respond(conn, ResponseFrame(f.seq, f.layer, STATUS_NOT_HOSTED, None, msg))
            r = c.recv(time.monotonic() + 10)
            assert (r.status, r.seq, r.output) == (STATUS_NOT_HOSTED, seq, None)
            assert r.message == msg[:1024]
        f0 = request_frame(2, 2, seq=5)
        c.send(f0)
        (conn, f), *_ = lst.poll(10)
        lst.respond(conn, ResponseFrame(f.seq, f.layer, STATUS_OK, f.hidden + 1))
        r = c.recv(time.monotonic() + 10)
        assert (r.status, r.seq, r.message) == (STATUS_OK, 5, "")
        torch.testing.assert_close(r.output, f0.hidden + 1)
    finally:
        c.close()
        lst.close()


@pytest.mark.parametrize("kind", TRANSPORT_KINDS)
def test_frames_written_before_any_doorbell_are_answered_and_recv_rings_a_forgotten_one(
    kind, tmp_path
):
    """A layer call's frames to several servers are written first (``send_deferred``) and the
    servers woken afterwards (``ring``): every answer is exact. The servers never busy-poll
    (spin 0), so each frame needs its doorbell; a frame whose ``ring`` was never called is
    rung by ``recv`` and still answered (a forgotten ring costs latency, never a hang). tcp:
    ``send_deferred`` is ``send`` and ``ring`` does nothing (the interface's default)."""
    srvs = []
    for i in range(2):
        d = tmp_path / f"s{i}"
        d.mkdir()
        srvs.append(start_server(listen_endpoint(kind, d), spin_us=0))
    try:
        conns = [
            connect_emulated(s.endpoint, f"s{i}", hidden_size=HIDDEN, dtype=torch.float32)
            for i, s in enumerate(srvs)
        ]
        frames = [request_frame(5, 2, seq=10 + i) for i in range(2)]
        for rnd in range(3):
            for c, f in zip(conns, frames, strict=True):
                c.send_deferred(f)
                assert c.in_flight
            for c in conns:
                if rnd < 2:  # the third round: no ring at all
                    c.ring()
                    c.ring()  # a second ring of the same frame does nothing
            for c, f in zip(conns, frames, strict=True):
                r = c.recv(time.monotonic() + 30)
                assert r.status == STATUS_OK, r.message
                assert r.seq == f.seq
                ref = reference(1, f.hidden, f.experts, f.weights)
                torch.testing.assert_close(r.output, ref, rtol=1e-5, atol=1e-6)
                assert not c.in_flight
        # a plain send after deferred ones: unchanged
        out = _round_trip(conns[0], frames[0], frames[0].seq)
        torch.testing.assert_close(
            out, reference(1, frames[0].hidden, frames[0].experts, frames[0].weights)
        )
        for c in conns:
            c.ring()  # nothing deferred: a no-op
            c.close()
    finally:
        for s in srvs:
            s.stop()


def test_the_client_spins_only_while_its_servers_and_itself_fit_on_the_cores(tmp_path, monkeypatch):
    """The adaptive spin is kept for when a core is free for it: with two requests in flight
    on as many cores (two expert servers working, the client waiting) the client only blocks;
    once one server has answered, the wait for the other may spin again. Answers stay exact."""
    from eaas.runtime.transport import shm

    servers = [start_server(f"unix:{tmp_path}/spin{i}.sock") for i in range(2)]
    conns = [
        connect_emulated(s.endpoint, f"s{i}", hidden_size=HIDDEN, dtype=torch.float32)
        for i, s in enumerate(servers)
    ]
    try:
        others = sum(1 for c in shm._LIVE_CLIENTS if c._outstanding)  # left by other tests
        monkeypatch.setattr(shm, "_CORES", others + 2)
        assert shm._cores_to_spin()
        frames = [request_frame(3, 2, seq=i) for i in range(2)]
        for c, f in zip(conns, frames, strict=True):
            c.send(f)
        assert not shm._cores_to_spin()  # 2 servers at work + this client > 2 cores
        outs = [conns[0].recv(time.monotonic() + 10)]
        assert shm._cores_to_spin()  # one server left to wait for
        outs.append(conns[1].recv(time.monotonic() + 10))
        for r, f in zip(outs, frames, strict=True):
            assert r.status == STATUS_OK, r.message
            torch.testing.assert_close(
                r.output, reference(1, f.hidden, f.experts, f.weights), rtol=1e-5, atol=1e-6
            )
    finally:
        for c in conns:
            c.close()
        for s in servers:
            s.stop()


def test_counting_the_requests_in_flight_while_connections_open_on_another_thread(monkeypatch):
    """The dispatcher opens connections on its connector thread while the engine thread counts
    the requests in flight: a walk of the registry during an add raised "Set changed size
    during iteration" out of ``recv`` (and the server was marked down)."""
    from eaas.runtime.transport import shm

    class Conn:  # registered like a connection: only ``_outstanding`` is read
        _outstanding = True

    monkeypatch.setattr(shm, "_CORES", 1)  # always walk the registry
    kept: list[Conn] = []
    stop = threading.Event()

    def open_many() -> None:
        while not stop.is_set():
            c = Conn()
            kept.append(c)
            shm._register(c)
            if len(kept) > 2000:
                del kept[:1000]  # dropped from the weak registry as they go

    t = threading.Thread(target=open_many)
    t.start()
    try:
        end = time.monotonic() + 3
        walks = 0
        while time.monotonic() < end:
            assert not shm._cores_to_spin()  # requests in flight: more than 1 core's worth
            walks += 1
    finally:
        stop.set()
        t.join(10)
    kept.clear()
    assert walks > 10


def test_a_server_spins_longer_only_while_frames_come_within_a_spin():
    """The server's spin before it blocks: ``spin_us``, or 1.5x the recent wait for a frame
    when that is at most ``MAX_SERVER_SPIN_S`` (capped there); never for ``spin_us`` 0."""
    from eaas.runtime.transport.shm_server import MAX_SERVER_SPIN_S, _server_spin_s

    spin = 80e-6
    assert _server_spin_s(spin, 0.0) == spin  # frames were waiting: the base spin
    assert _server_spin_s(spin, 160e-6) == pytest.approx(240e-6)  # back-to-back big frames
    assert _server_spin_s(spin, MAX_SERVER_SPIN_S) == MAX_SERVER_SPIN_S  # capped
    assert _server_spin_s(spin, 3e-3) == spin  # an attention client's layers, ms apart
    assert _server_spin_s(0.0, 160e-6) == 0.0  # block at once stays block at once
