"""Transports (shm over a Unix socket, TCP, and ``cudaipc`` in its host emulation: the shm
protocol with the payload mapping swapped) against a real expert-server process."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import pytest
import torch

from eaas.runtime.transport.base import (
    STATUS_OK,
    DeadlineExceeded,
    FrameError,
    PeerDeadError,
    RequestFrame,
)

from helpers.server import (
    HIDDEN,
    TRANSPORT_KINDS,
    assert_misuse_raises_frame_error,
    connect_emulated,
    listen_endpoint,
    reference,
    request_frame,
    shm_entries,
    start_server,
    wait_until,
)

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("kind", TRANSPORT_KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_round_trip_matches_local_reference(kind, dtype, tmp_path):
    srv = start_server(listen_endpoint(kind, tmp_path), dtype=dtype)
    try:
        # max_tokens=4 / max_k=1: larger frames force the shm slot to grow (remap) transparently.
        c = connect_emulated(
            srv.endpoint, "s-test", hidden_size=HIDDEN, dtype=dtype, max_tokens=4, max_k=1
        )
        for i, (n, k, layer, n_exp) in enumerate(
            [
                (1, 1, 1, 4),
                (3, 2, 1, 4),
                (17, 4, 1, 4),
                (5, 2, 2, 2),
                (0, 2, 1, 4),
                (64, 3, 1, 4),
                (2, 1, 1, 4),
            ]
        ):
            f = request_frame(n, k, layer, n_exp, dtype, seq=100 + i)
            c.send(f)
            r = c.recv(time.monotonic() + 5)
            assert r.status == STATUS_OK, r.message
            assert (r.seq, r.layer) == (100 + i, layer)
            assert r.output.dtype == dtype and tuple(r.output.shape) == (n, HIDDEN)
            ref = reference(layer, f.hidden, f.experts, f.weights, dtype=dtype)
            if dtype == torch.float32:
                torch.testing.assert_close(r.output, ref, rtol=1e-5, atol=1e-6)
            else:
                torch.testing.assert_close(r.output.float(), ref.float(), rtol=2e-2, atol=2e-2)
        c.close()
    finally:
        srv.stop()


@pytest.mark.parametrize("kind", TRANSPORT_KINDS)
def test_protocol_misuse_raises_frame_error(kind, tmp_path):
    srv = start_server(listen_endpoint(kind, tmp_path))
    try:
        with pytest.raises(FrameError, match="hidden size"):
            connect_emulated(srv.endpoint, "s-test", hidden_size=HIDDEN + 1, dtype=torch.float32)
        c = connect_emulated(srv.endpoint, "s-test", hidden_size=HIDDEN, dtype=torch.float32)
        assert_misuse_raises_frame_error(c, 5)
        c.close()
    finally:
        srv.stop()


@pytest.mark.parametrize("kind", TRANSPORT_KINDS)
def test_connect_to_nothing_is_peer_dead(kind, tmp_path):
    ep = f"{kind}:{tmp_path}/none.sock" if kind != "tcp" else "tcp://127.0.0.1:1"
    # A refused connection is PeerDeadError at once; waiting out the (long) connect timeout
    # would raise DeadlineExceeded instead.
    with pytest.raises(PeerDeadError):
        connect_emulated(ep, "nobody", hidden_size=HIDDEN, dtype=torch.float32, connect_timeout=30)


@pytest.mark.parametrize("kind", TRANSPORT_KINDS)
def test_server_sigkill_mid_request_gives_peer_dead_fast(kind, tmp_path):
    srv = start_server(listen_endpoint(kind, tmp_path))
    c = connect_emulated(srv.endpoint, "s-test", hidden_size=HIDDEN, dtype=torch.float32)
    c.send(request_frame(2, 1))
    assert c.recv(time.monotonic() + 5).status == STATUS_OK
    os.kill(srv.pid, signal.SIGSTOP)  # the next request is surely in flight when it dies
    c.send(request_frame(3, 1))
    os.kill(srv.pid, signal.SIGKILL)
    # The server's death is seen on the socket (EOF), not by waiting out the deadline: that
    # would raise DeadlineExceeded.
    with pytest.raises(PeerDeadError):
        c.recv(time.monotonic() + 60)
    assert c.in_flight  # the request was never answered ...
    with pytest.raises(PeerDeadError):  # ... and the connection stays dead
        c.recv(time.monotonic() + 60)
    c.close()
    assert not c.in_flight
    with pytest.raises(PeerDeadError, match="closed"):
        c.send(request_frame(1, 1))
    srv.kill()


@pytest.mark.parametrize("kind", TRANSPORT_KINDS)
def test_stopped_server_hits_deadline_then_recovers(kind, tmp_path):
    srv = start_server(listen_endpoint(kind, tmp_path))
    try:
        c = connect_emulated(srv.endpoint, "s-test", hidden_size=HIDDEN, dtype=torch.float32)
        os.kill(srv.pid, signal.SIGSTOP)
        f = request_frame(4, 2)
        c.send(f)
        t0 = time.monotonic()
        with pytest.raises(DeadlineExceeded):
            c.recv(t0 + 2.0)
        assert time.monotonic() - t0 >= 2.0  # the deadline was honoured, not cut short
        assert c.in_flight
        os.kill(srv.pid, signal.SIGCONT)
        r = c.recv(time.monotonic() + 5)  # the late answer is still delivered
        assert r.status == STATUS_OK
        torch.testing.assert_close(
            r.output, reference(1, f.hidden, f.experts, f.weights), rtol=1e-5, atol=1e-6
        )
        c.close()
    finally:
        srv.stop()


def _doomed_client(endpoint, ready):
    torch.set_num_threads(1)  # forked child: keep out of the parent's OpenMP pool
    c = connect_emulated(endpoint, "s-test", hidden_size=HIDDEN, dtype=torch.float32)
    c.send(request_frame(8, 2))
    ready.set()
    time.sleep(60)


@pytest.mark.parametrize("kind", TRANSPORT_KINDS)
def test_client_sigkill_does_not_disturb_server(kind, tmp_path):
    before = shm_entries()
    srv = start_server(listen_endpoint(kind, tmp_path))
    try:
        ctx = mp.get_context("fork")
        for _ in range(2):
            ready = ctx.Event()
            p = ctx.Process(target=_doomed_client, args=(srv.endpoint, ready), daemon=True)
            p.start()
            assert ready.wait(20)
            os.kill(p.pid, signal.SIGKILL)
            p.join(5)
        c = connect_emulated(srv.endpoint, "s-test", hidden_size=HIDDEN, dtype=torch.float32)
        for i in range(5):
            f = request_frame(3, 2, seq=i)
            c.send(f)
            r = c.recv(time.monotonic() + 5)
            assert r.status == STATUS_OK and r.seq == i
        c.close()
        assert srv.proc.is_alive()
    finally:
        stats = srv.stop()
    assert stats is not None and stats["errors"] == 0
    assert wait_until(lambda: shm_entries() <= before, 30.0), shm_entries() - before


def test_no_shm_files_even_after_sigkill(tmp_path):
    """memfd slots leave nothing in /dev/shm, whoever dies."""
    before = shm_entries()
    srv = start_server(listen_endpoint("unix", tmp_path))
    c = connect_emulated(
        srv.endpoint, "s-test", hidden_size=HIDDEN, dtype=torch.float32, max_tokens=2
    )
    c.send(request_frame(50, 3))  # grows the slot: a second memfd
    assert c.recv(time.monotonic() + 5).status == STATUS_OK
    assert shm_entries() <= before
    srv.kill()
    c.close()
    assert shm_entries() <= before
    # the stale socket file left by SIGKILL is replaced by the next server on the same path
    srv2 = start_server(srv.endpoint)
    c = connect_emulated(srv2.endpoint, "s-test", hidden_size=HIDDEN, dtype=torch.float32)
    c.send(request_frame(1, 1))
    assert c.recv(time.monotonic() + 5).status == STATUS_OK
    c.close()
    srv2.stop()
    assert not os.path.exists(srv.endpoint[len("unix:") :])
    assert shm_entries() <= before


def _lazy_client(endpoint, hidden, ready):
    """Sends a huge frame and never reads the answer (a wedged/stopped client)."""
    torch.set_num_threads(1)  # forked child: keep out of the parent's OpenMP pool
    c = connect_emulated(endpoint, "s-test", hidden_size=hidden, dtype=torch.float32)
    n = 4096
    c.send(
        RequestFrame(
            5,
            1,
            1,
            0,
            torch.randn(n, hidden),
            torch.zeros(n, 1, dtype=torch.int32),
            torch.ones(n, 1),
        )
    )
    ready.set()
    time.sleep(60)


@pytest.mark.parametrize("kind", TRANSPORT_KINDS)
def test_client_not_reading_does_not_stall_others(kind, tmp_path):
    hidden = 1024  # 4096 tokens x 4 KiB = 16 MiB response, more than the socket buffers hold
    # The server would drop the wedged client only after send_timeout; make that far longer
    # than the other client's deadline, so a server loop stalled on the wedged client's
    # socket shows up as DeadlineExceeded below instead of a late success.
    listener_kw = {"send_timeout": 600.0} if kind == "tcp" else {}
    srv = start_server(listen_endpoint(kind, tmp_path), hidden=hidden, **listener_kw)
    ctx = mp.get_context("fork")
    ready = ctx.Event()
    p = ctx.Process(target=_lazy_client, args=(srv.endpoint, hidden, ready), daemon=True)
    p.start()
    try:
        assert ready.wait(20)
        c = connect_emulated(srv.endpoint, "s-test", hidden_size=hidden, dtype=torch.float32)
        for i in range(3):
            c.send(
                RequestFrame(
                    1,
                    1,
                    1,
                    i,
                    torch.randn(2, hidden),
                    torch.zeros(2, 1, dtype=torch.int32),
                    torch.ones(2, 1),
                )
            )
            r = c.recv(time.monotonic() + 60)
            assert r.status == STATUS_OK and r.seq == i
        assert p.is_alive()  # the wedged client is still connected, still not reading
        c.close()
    finally:
        p.kill()
        p.join(5)
        srv.stop()
