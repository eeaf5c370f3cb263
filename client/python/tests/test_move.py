"""Moving a session between two real daemons (ExportSession, ImportSession, move_session)."""
import contextlib
import signal
import threading
import time

import grpc
import numpy as np
import pytest

import kvtier
from helpers import counter, free_port
from kvtier.v1 import kvtier_pb2 as pb

L, QH, KVH, D = 4, 9, 3, 64


def make_kv(rng, tokens):
    k = rng.standard_normal((L, KVH, tokens, D)).astype(np.float16)
    v = rng.standard_normal((L, KVH, tokens, D)).astype(np.float16)
    return k, v


def chunks_of(client, sid):
    """Every chunk's metadata and its bytes as ReadChunks gives them, by chunk id."""
    listed = client.list_chunks(sid, limit=100000).chunks
    got = client.read_chunks(sid, [c.chunk_id for c in listed])
    meta = {c.chunk_id: (c.layer, c.kv_head, c.num_tokens, c.precision) for c in listed}
    data = {h.chunk_id: (list(h.positions), h.keys, h.values) for h in got}
    return meta, data


@pytest.fixture
def pair(start_daemon):
    a, b = start_daemon(), start_daemon()
    with kvtier.Client(a.address) as ca, kvtier.Client(b.address) as cb:
        yield ca, cb


def test_a_moved_session_is_the_same_session_there(pair):
    """Aged (int4) and recent (fp16) chunks arrive byte for byte, over more than one part;
    a Select there picks what it picks here; the copy takes appends; the source is untouched."""
    a, b = pair
    rng = np.random.default_rng(7)
    k, v = make_kv(rng, 1500)  # 4.6 MB of fp16: several parts of about 1 MiB
    sid = a.create_session(L, QH, KVH, D, session_id="prefill", labels={"job": "x"}).session_id
    a.append_layers(sid, 0, k, v, wait_aged=True)
    before = chunks_of(a, sid)
    assert pb.PRECISION_INT4 in {m[3] for m in before[0].values()}
    assert pb.PRECISION_FP16 in {m[3] for m in before[0].values()}

    moved = a.move_session(sid, b, "decode")
    assert moved.session_id == "decode"
    assert moved.policy == a.describe_session(sid).info.policy
    assert chunks_of(b, "decode") == before
    info = b.describe_session("decode").info
    assert info.num_tokens == 1500 and dict(info.labels) == {"job": "x"}

    q = rng.standard_normal((QH, D))
    for layer in range(L):
        here = a.select(sid, layer, q, budget_tokens=256)
        there = b.select("decode", layer, q, budget_tokens=256)
        for h1, h2 in zip(here.heads, there.heads):
            p1 = sorted(p for blk in h1.blocks for p in blk.positions)
            p2 = sorted(p for blk in h2.blocks for p in blk.positions)
            assert p1 == p2
        a.release(here.lease_id)
        b.release(there.lease_id)

    k2, v2 = make_kv(rng, 40)
    assert b.append_layers("decode", 1500, k2, v2) == 1540
    assert a.describe_session(sid).info.num_tokens == 1500
    assert chunks_of(a, sid) == before
    # The same id, by default; it is taken there now.
    with pytest.raises(kvtier.KvTierError) as e:
        a.move_session(sid, b, "decode")
    assert e.value.code == grpc.StatusCode.ALREADY_EXISTS and "decode" in e.value.message
    assert a.move_session(sid, b).session_id == "prefill"
    assert {s.session_id for s in b.list_sessions()} == {"decode", "prefill"}


def parts(client, sid):
    return [r.part for r in client.stub.ExportSession(pb.ExportSessionRequest(session_id=sid),
                                                       metadata=client._metadata)]


def import_raw(client, requests):
    return client.stub.ImportSession(iter(requests), metadata=client._metadata)


def test_damaged_reordered_or_cut_transfers_import_nothing(pair):
    a, b = pair
    rng = np.random.default_rng(8)
    k, v = make_kv(rng, 1200)
    sid = a.create_session(L, QH, KVH, D, lossless=True).session_id
    a.append_layers(sid, 0, k, v)
    p = parts(a, sid)
    assert len(p) >= 4  # header, chunks over more than one part, end

    def refused(requests, code, text):
        with pytest.raises(grpc.RpcError) as e:
            import_raw(b, requests)
        assert e.value.code() == code, e.value.details()
        assert text in e.value.details(), e.value.details()
        assert b.list_sessions() == []

    req = [pb.ImportSessionRequest(part=x) for x in p]
    flipped = bytearray(p[1])
    flipped[len(flipped) // 2] ^= 1
    refused(req[:1] + [pb.ImportSessionRequest(part=bytes(flipped))] + req[2:],
            grpc.StatusCode.DATA_LOSS, "part 2: checksum")
    refused([req[0], req[2], req[1]] + req[3:], grpc.StatusCode.DATA_LOSS, "out of order")
    refused(req[:-1], grpc.StatusCode.DATA_LOSS, "without the end part")
    refused(req[1:], grpc.StatusCode.DATA_LOSS, "part 1: chunks before the header")
    refused(req + [req[-1]], grpc.StatusCode.DATA_LOSS, "after the end part")
    refused([req[0], pb.ImportSessionRequest(part=p[1], session_id="late")] + req[2:],
            grpc.StatusCode.INVALID_ARGUMENT, "session_id")
    refused([pb.ImportSessionRequest(part=b"KVTR" + p[0][4:])] + req[1:],
            grpc.StatusCode.DATA_LOSS, "no KVTP magic")
    # Intact, it imports.
    r = import_raw(b, req)
    assert r.session_id == sid and b.describe_session(sid).info.num_tokens == 1200


def test_move_errors_name_what_failed(start_daemon):
    a, small = start_daemon(), start_daemon("--host_capacity", "4M")
    with kvtier.Client(a.address) as ca, kvtier.Client(small.address) as cs:
        with pytest.raises(kvtier.KvTierError) as e:
            ca.move_session("nope", cs)
        assert e.value.code == grpc.StatusCode.NOT_FOUND and "nope" in e.value.message
        rng = np.random.default_rng(9)
        k, v = make_kv(rng, 2000)  # 6 MB of lossless data: more than the 4 MiB tier holds
        sid = ca.create_session(L, QH, KVH, D, lossless=True).session_id
        ca.append_layers(sid, 0, k, v)
        with pytest.raises(kvtier.KvTierError) as e:
            ca.move_session(sid, cs)
        assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "part 1" in e.value.message and "6144000 bytes" in e.value.message
        assert cs.list_sessions() == []
        with pytest.raises(kvtier.KvTierError) as e:
            ca.move_session(sid, cs, "bad id!")
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "session_id" in e.value.message
        assert ca.describe_session(sid).info.num_tokens == 2000


def test_the_asyncio_client_moves_sessions_and_raises_either_sides_error(start_daemon):
    import asyncio

    import kvtier.aio
    a, small = start_daemon(), start_daemon("--host_capacity", "4M")
    rng = np.random.default_rng(10)
    k, v = make_kv(rng, 2000)

    async def run():
        async with kvtier.aio.Client(a.address) as ca, kvtier.aio.Client(small.address) as cs:
            sid = (await ca.create_session(L, QH, KVH, D, lossless=True)).session_id
            await ca.append_layers(sid, 0, k[:, :, :200], v[:, :, :200])
            moved = await ca.move_session(sid, cs, "copy")
            assert moved.session_id == "copy"
            assert (await cs.describe_session("copy")).info.num_tokens == 200
            with pytest.raises(kvtier.KvTierError) as e:
                await ca.move_session("nope", cs)
            assert e.value.code == grpc.StatusCode.NOT_FOUND
            await ca.append_layers(sid, 200, k[:, :, 200:], v[:, :, 200:])
            with pytest.raises(kvtier.KvTierError) as e:
                await ca.move_session(sid, cs, "big")
            # grpc.aio may report the refusal as INTERNAL (grpc/grpc#36066; move_session says so)
            assert (e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED or
                    (e.value.code == grpc.StatusCode.INTERNAL and
                     "Internal error from Core" in e.value.message)), e.value
            assert [s.session_id for s in await cs.list_sessions()] == ["copy"]

    asyncio.run(run())


def test_kvtierctl_moves_a_session_and_closes_it_here(start_daemon, kvtierctl):
    a, b = start_daemon(), start_daemon()
    rng = np.random.default_rng(11)
    k, v = make_kv(rng, 100)
    with kvtier.Client(a.address) as ca, kvtier.Client(b.address) as cb:
        ca.create_session(L, QH, KVH, D, session_id="ctl")
        ca.append_layers("ctl", 0, k, v)
        r = kvtierctl(a.address, "move", "ctl", "--to", b.address, "--as", "there", "--close")
        assert r.returncode == 0, r.stderr
        assert r.stdout == f"moved ctl to {b.address} as there\n"
        assert ca.list_sessions() == []
        assert cb.describe_session("there").info.num_tokens == 100
        r = kvtierctl(b.address, "move", "there", "--to", b.address)
        assert r.returncode == 1 and "ALREADY_EXISTS" in r.stderr + r.stdout
        assert [s.session_id for s in cb.list_sessions()] == ["there"]


def test_moved_bytes_are_counted_on_both_daemons(start_daemon):
    pa, pb = free_port(), free_port()
    a, b = start_daemon("--metrics_port", str(pa)), start_daemon("--metrics_port", str(pb))
    k, v = make_kv(np.random.default_rng(12), 100)
    with kvtier.Client(a.address) as ca, kvtier.Client(b.address) as cb:
        ca.create_session(L, QH, KVH, D, session_id="m", lossless=True)
        ca.append_layers("m", 0, k, v)
        ca.move_session("m", cb)
        with pytest.raises(kvtier.KvTierError):
            ca.move_session("m", cb)  # refused there; the export may have finished first
    fp16_bytes = L * KVH * 100 * D * 2 * 2  # K and V of every stream
    assert counter(pa, "kvtier_moved_out_bytes_total") in (fp16_bytes, 2 * fp16_bytes)
    assert counter(pb, "kvtier_moved_in_bytes_total") == fp16_bytes
    assert counter(pa, "kvtier_moved_in_bytes_total") == 0


def test_chunk_bytes_can_go_daemon_to_daemon_beside_the_parts(start_daemon, kvtierctl):
    """carrier="socket" (the NCCL carrier's CPU twin): only the parts' sizes and checksums pass
    through the client, the bytes go daemon to daemon, and the session arrives byte for byte.
    On daemons whose device tier is emulated, carrier="nccl" is refused naming why, and nothing
    is imported."""
    a, b = start_daemon("--device", "emulated"), start_daemon("--device", "emulated")
    rng = np.random.default_rng(13)
    k, v = make_kv(rng, 1500)
    with kvtier.Client(a.address) as ca, kvtier.Client(b.address) as cb:
        ca.create_session(L, QH, KVH, D, session_id="s")
        ca.append_layers("s", 0, k, v, wait_aged=True)
        before = chunks_of(ca, "s")
        assert ca.move_session("s", cb, "via-socket", carrier="socket").session_id == "via-socket"
        assert chunks_of(cb, "via-socket") == before
        with pytest.raises(kvtier.KvTierError) as e:
            ca.move_session("s", cb, "via-nccl", carrier="nccl")
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "carrier: CHUNK_CARRIER_NCCL" in e.value.message or "CUDA" in e.value.message
        with pytest.raises(kvtier.KvTierArgumentError, match="carrier: 'rdma' is not one of"):
            ca.move_session("s", cb, carrier="rdma")
        assert sorted(s.session_id for s in cb.list_sessions()) == ["via-socket"]
        r = kvtierctl(a.address, "move", "s", "--to", b.address, "--as", "ctl", "--via", "socket")
        assert r.returncode == 0, r.stderr
        assert chunks_of(cb, "ctl") == before


def test_carried_transfers_at_once_are_bounded(start_daemon):
    """Each transfer with a carrier may hold a thread of the daemon while it waits for the other
    daemon: the fifth at once is RESOURCE_EXHAUSTED, and a cancelled one gives its place back."""
    from kvtier.v1 import kvtier_pb2_grpc as pb_grpc
    a = start_daemon("--device", "emulated")
    k, v = make_kv(np.random.default_rng(14), 20)
    with kvtier.Client(a.address) as ca:
        ca.create_session(L, QH, KVH, D, session_id="s")
        ca.append_layers("s", 0, k, v)
        stub = pb_grpc.KvTierStub(grpc.insecure_channel(a.address))
        req = pb.ExportSessionRequest(session_id="s", carrier=pb.CHUNK_CARRIER_SOCKET)
        held = [stub.ExportSession(req, timeout=60) for _ in range(4)]
        for call in held:
            next(call)  # the header: each export is running, waiting for an importer
        with pytest.raises(grpc.RpcError) as e:
            next(stub.ExportSession(req, timeout=60))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "carrier: 4 transfers with a carrier are in progress" in e.value.details()
        held[0].cancel()
        for _ in range(100):  # the cancelled export stops waiting within about 100 ms
            try:
                next(stub.ExportSession(req, timeout=60))
                break
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                time.sleep(0.05)
        else:
            pytest.fail("the cancelled export kept its place")
        for call in held[1:]:
            call.cancel()


class SlowRequests(grpc.StreamUnaryClientInterceptor):
    """Each request of a client-streaming call handed on `delay` seconds after gRPC asks."""

    def __init__(self, delay):
        self.delay = delay

    def intercept_stream_unary(self, continuation, details, request_iterator):
        def slow():
            for r in request_iterator:
                time.sleep(self.delay)
                yield r
        return continuation(details, slow())


def test_a_move_longer_than_the_timeout_goes_on_while_its_parts_move(start_daemon):
    """The timeout bounds each part's wait, not the whole move (which grows with the session):
    a move that takes longer than the timeout, its parts coming within it, completes. Before,
    the whole move ran under one deadline, and a large session could never be moved."""
    from kvtier.v1 import kvtier_pb2_grpc as pb_grpc
    a, b = start_daemon(), start_daemon()
    with kvtier.Client(a.address, timeout=1.0) as ca, kvtier.Client(b.address, timeout=1.0) as cb:
        rng = np.random.default_rng(12)
        k, v = make_kv(rng, 400)
        sid = ca.create_session(L, QH, KVH, D).session_id
        ca.append_layers(sid, 0, k, v)
        cb.stub = pb_grpc.KvTierStub(grpc.intercept_channel(cb._channel, SlowRequests(0.25)))
        t0 = time.monotonic()
        moved = ca.move_session(sid, cb, "slow")
        took = time.monotonic() - t0
        assert took > 1.5, f"the move took {took:.2f} s: too few parts to outlast the timeout"
        assert moved.session_id == "slow"
        assert cb.describe_session("slow").info.num_tokens == 400


@contextlib.contextmanager
def stopped(daemon, at_most=10):
    """The daemon's process stopped (SIGSTOP) for the block, and at most `at_most` seconds: a
    call that waits for it (the hang a test looks for) then ends, and fails the test's time
    check, instead of holding the test for good (tests/daemon_test.cc's Stopped)."""
    daemon.proc.send_signal(signal.SIGSTOP)
    watchdog = threading.Timer(at_most, daemon.proc.send_signal, (signal.SIGCONT,))
    watchdog.start()
    try:
        yield
    finally:
        watchdog.cancel()
        daemon.proc.send_signal(signal.SIGCONT)


def test_a_move_whose_daemon_stalls_ends_after_the_timeout(start_daemon):
    """A move whose daemon stalls (the importing one stopped) raises DEADLINE_EXCEEDED once
    nothing has moved for the timeout, in either client, and nothing is imported. Before, the
    blocking client waited for as long as the daemon was stopped."""
    import asyncio

    import kvtier.aio
    a, b = start_daemon(), start_daemon()
    rng = np.random.default_rng(13)
    k, v = make_kv(rng, 1500)
    with kvtier.Client(a.address, timeout=1.0) as ca, kvtier.Client(b.address, timeout=1.0) as cb:
        sid = ca.create_session(L, QH, KVH, D).session_id
        ca.append_layers(sid, 0, k, v)
        cb.list_sessions()  # its connection made
        with stopped(b):
            t0 = time.monotonic()
            with pytest.raises(kvtier.KvTierError) as e:
                ca.move_session(sid, cb, "stalled")
            assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED, e.value
            assert "nothing moved for 1 s" in e.value.message
            assert time.monotonic() - t0 < 8

            async def run():
                async with kvtier.aio.Client(a.address, timeout=1.0) as aa, \
                        kvtier.aio.Client(b.address, timeout=1.0) as ab:
                    with pytest.raises(kvtier.KvTierError) as e:
                        await aa.move_session(sid, ab, "stalled-aio")
                    assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED, e.value
            asyncio.run(asyncio.wait_for(run(), 20))
    with kvtier.Client(b.address) as cb:  # the longer default timeout: b reads what it was left
        assert cb.list_sessions() == []


def test_an_append_to_a_stalled_daemon_ends_past_the_timeout(daemon):
    """An append (the bytes path) into a daemon that stopped reading raises DEADLINE_EXCEEDED
    about a second past the timeout, in either client. Before, the blocking client waited for
    as long as the daemon was stopped (a write into its connection ends only when it reads).
    The daemon then takes appends again."""
    import asyncio

    import kvtier.aio
    rng = np.random.default_rng(14)
    k, v = make_kv(rng, 1500)
    items = [(layer, 0, k[layer], v[layer]) for layer in range(L)]
    with kvtier.Client(daemon.address, timeout=1.0) as c:
        sid = c.create_session(L, QH, KVH, D).session_id
        with stopped(daemon):
            t0 = time.monotonic()
            with pytest.raises(kvtier.KvTierError) as e:
                c.append_kv(sid, items)
            assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED, e.value
            assert time.monotonic() - t0 < 8

            async def run():
                async with kvtier.aio.Client(daemon.address, timeout=1.0) as a:
                    with pytest.raises(kvtier.KvTierError) as e:
                        await a.append_kv(sid, items)
                    assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED, e.value
            asyncio.run(asyncio.wait_for(run(), 20))
    with kvtier.Client(daemon.address) as c:  # the default timeout: it reads what it was left
        other = c.create_session(L, QH, KVH, D).session_id
        assert c.append_kv(other, [(layer, 0, k[layer][:, :32], v[layer][:, :32])
                                   for layer in range(L)]) == 32


def held_import(client, requests, release):
    """An ImportSession that sends the first request, waits for `release`, then the rest: its
    future."""
    def gen():
        yield requests[0]
        release.wait(30)
        yield from requests[1:]
    return client.stub.ImportSession.future(gen(), metadata=client._metadata)


def test_imports_in_progress_hold_at_most_max_import_size(start_daemon):
    """An import's parts wait in memory until its session is made, so the imports in progress
    together hold at most --max_import_size: from its header, an import holds the chunk data it
    names. One past it is RESOURCE_EXHAUSTED naming the flag, and imports nothing; once the
    first ends, it goes through. A session larger than the flag alone is refused at its header.
    Before, any number of imports held their parts at once."""
    port = free_port()
    a, b = start_daemon(), start_daemon("--max_import_size", "2M", "--metrics_port", str(port))
    rng = np.random.default_rng(15)
    with kvtier.Client(a.address) as ca, kvtier.Client(b.address) as cb:
        k, v = make_kv(rng, 400)  # 1.2 MB of fp16 K and V
        ca.create_session(L, QH, KVH, D, session_id="s", lossless=True)
        ca.append_layers("s", 0, k, v)
        req = [pb.ImportSessionRequest(part=x) for x in parts(ca, "s")]
        release = threading.Event()
        first = held_import(cb, req, release)
        for _ in range(200):  # its header in: it holds the session's chunk data
            if counter(port, "kvtier_import_bytes") > 0:
                break
            time.sleep(0.02)
        assert counter(port, "kvtier_import_bytes") >= L * KVH * 400 * D * 2 * 2
        second = [pb.ImportSessionRequest(part=req[0].part, session_id="two")] + req[1:]
        with pytest.raises(grpc.RpcError) as e:
            import_raw(cb, second)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value.details()
        assert "imports in progress hold" in e.value.details()
        assert "--max_import_size 2097152" in e.value.details()
        release.set()
        assert first.result(timeout=30).session_id == "s"
        assert counter(port, "kvtier_import_bytes") == 0
        assert import_raw(cb, second).session_id == "two"
        assert cb.describe_session("two").info.num_tokens == 400

        k, v = make_kv(rng, 1000)  # 3 MB: more than the flag lets imports hold at once
        ca.create_session(L, QH, KVH, D, session_id="big", lossless=True)
        ca.append_layers("big", 0, k, v)
        with pytest.raises(grpc.RpcError) as e:
            import_raw(cb, [pb.ImportSessionRequest(part=x) for x in parts(ca, "big")])
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value.details()
        assert "more than --max_import_size 2097152" in e.value.details()
        assert sorted(s.session_id for s in cb.list_sessions()) == ["s", "two"]
        assert counter(port, "kvtier_import_bytes") == 0


def test_a_transfer_whose_caller_stops_is_cancelled(start_daemon):
    """An ImportSession whose caller sends nothing for --transfer_idle_timeout_ms (here 2 s),
    or an ExportSession whose caller takes nothing for as long, is cancelled, and its parts go:
    an import makes no session. The bound is per wait: an import whose parts come closer
    together goes through, however long it takes in all. Before, a stuck caller held them for
    good."""
    port = free_port()
    a = start_daemon("--transfer_idle_timeout_ms", "2000", "--metrics_port", str(port))
    rng = np.random.default_rng(16)
    with kvtier.Client(a.address) as c:
        k, v = make_kv(rng, 1500)  # 4.6 MB: several parts
        c.create_session(L, QH, KVH, D, session_id="s", lossless=True)
        c.append_layers("s", 0, k, v)
        p = parts(c, "s")
        assert len(p) >= 4
        req = [pb.ImportSessionRequest(part=x, session_id="copy" if i == 0 else "")
               for i, x in enumerate(p)]

        release = threading.Event()
        stuck = held_import(c, req, release)
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as e:
            stuck.result(timeout=20)
        assert e.value.code() == grpc.StatusCode.CANCELLED, e.value.details()
        assert time.monotonic() - t0 < 10
        release.set()
        assert [s.session_id for s in c.list_sessions()] == ["s"]
        assert counter(port, "kvtier_transfers_idle_ended_total") == 1

        def slow():
            for r in req:
                time.sleep(0.5)
                yield r
        t0 = time.monotonic()
        assert c.stub.ImportSession(slow(), metadata=c._metadata).session_id == "copy"
        assert time.monotonic() - t0 > 2  # longer than the timeout in all
        assert counter(port, "kvtier_transfers_idle_ended_total") == 1

        # A channel whose receive window stays small (no BDP probing): the export's parts
        # wait for the caller to take them.
        from kvtier.v1 import kvtier_pb2_grpc as pb_grpc
        narrow = grpc.insecure_channel(a.address, options=[("grpc.http2.bdp_probe", 0)])
        export = pb_grpc.KvTierStub(narrow).ExportSession(
            pb.ExportSessionRequest(session_id="s"), metadata=c._metadata)
        next(export)  # the header; the next parts fill what the connection buffers, then wait
        time.sleep(4)
        with pytest.raises(grpc.RpcError) as e:
            for _ in export:
                pass
        assert e.value.code() == grpc.StatusCode.CANCELLED, e.value.details()
        assert counter(port, "kvtier_transfers_idle_ended_total") == 2
        narrow.close()


def test_a_cancelled_import_makes_nothing_even_with_every_part_in(start_daemon):
    """An import whose caller cancels it after sending every part, the end part too, instead
    of closing its side, makes no session: the mover that gave up is told nothing was imported,
    and so it is. Before, the daemon took the failed read for the close and made the session."""
    port = free_port()
    a = start_daemon("--metrics_port", str(port))
    with kvtier.Client(a.address) as c:
        k, v = make_kv(np.random.default_rng(17), 400)
        c.create_session(L, QH, KVH, D, session_id="s", lossless=True)
        c.append_layers("s", 0, k, v)
        p = parts(c, "s")
        req = [pb.ImportSessionRequest(part=x, session_id="copy" if i == 0 else "")
               for i, x in enumerate(p)]
        sent, release = threading.Event(), threading.Event()

        def then_wait():
            yield from req
            sent.set()  # gRPC asks for the next request once the last is sent
            release.wait(30)
        call = c.stub.ImportSession.future(then_wait(), metadata=c._metadata)
        assert sent.wait(30)
        time.sleep(1)  # a local daemon has read them all by now
        assert counter(port, "kvtier_import_bytes") >= sum(len(x) for x in p)
        call.cancel()
        release.set()
        with pytest.raises(grpc.FutureCancelledError):
            call.result(timeout=10)
        for _ in range(100):  # the daemon has ended the call
            if counter(port, "kvtier_import_bytes") == 0:
                break
            time.sleep(0.02)
        assert counter(port, "kvtier_import_bytes") == 0
        assert [s.session_id for s in c.list_sessions()] == ["s"]
