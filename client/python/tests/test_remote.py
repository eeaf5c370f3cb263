"""The remote tier against a real redis-server started here: demotion by Evict and by a full
host tier, transparent restore, migration to a second kvtierd, and corrupt records."""
import shutil
import subprocess
import threading
import time

import grpc
import numpy as np
import pytest

import kvtier
from kvtier.v1 import kvtier_pb2 as pb

L, QH, KVH, D = 4, 9, 3, 64


@pytest.fixture
def redis(tmp_path):
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is missing: scripts/install-deps installs it")
    sock = tmp_path / "redis.sock"
    proc = subprocess.Popen(["redis-server", "--port", "0", "--unixsocket", str(sock),
                             "--save", "", "--appendonly", "no"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 10
    while not sock.exists():
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            pytest.fail("redis-server did not start")
        time.sleep(0.02)
    yield sock
    proc.terminate()
    proc.wait(timeout=10)


def cli(sock, *args):
    return subprocess.run(["redis-cli", "-s", str(sock), *args], check=True,
                          capture_output=True, text=True).stdout.strip()


def make_kv(seed, tokens):
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((L, KVH, tokens, D)).astype(np.float16)
    v = rng.standard_normal((L, KVH, tokens, D)).astype(np.float16)
    return k, v


def expect_exact(client, sid, k, v, tokens):
    sel = client.select(sid, L - 1, np.ones((QH, D), np.float32), budget_tokens=1 << 20)
    assert sel.context_tokens == tokens
    for head in sel.heads:
        pos, hk, hv = client.gather(head, head_dim=D)
        assert sorted(pos.tolist()) == list(range(tokens))
        np.testing.assert_array_equal(hk, k[L - 1, head.kv_head][pos])
        np.testing.assert_array_equal(hv, v[L - 1, head.kv_head][pos])
    client.release(sel.lease_id)


def remote_row(client):
    return next(t for t in client.tier_stats() if t.tier == pb.TIER_REMOTE)


def test_a_session_evicted_by_one_daemon_is_served_by_another(redis, start_daemon):
    a = start_daemon("--remote", f"unix:{redis}", "--instance", "remote-a")
    b = start_daemon("--remote", f"unix:{redis}", "--instance", "remote-b")
    k, v = make_kv(1, 500)
    with kvtier.Client(a.address) as ca, kvtier.Client(b.address) as cb:
        sid = ca.create_session(L, QH, KVH, D, lossless=True, session_id="moving").session_id
        ca.append_layers(sid, 0, k, v)
        moved = ca.evict(sid, "host")
        assert moved > 2 * L * KVH * 500 * D * 2  # every K and V byte went down
        assert cli(redis, "EXISTS", "kvtier:session:moving") == "1"
        assert ca.tier_stats()[0].used_bytes == 0
        # The second daemon restores it on first use, bytes exact, and takes it over.
        expect_exact(cb, sid, k, v, 500)
        assert remote_row(cb).promotions == 1
        assert cli(redis, "EXISTS", "kvtier:session:moving") == "0"
        with pytest.raises(kvtier.KvTierError) as e:
            ca.describe_session(sid)
        assert e.value.code == grpc.StatusCode.NOT_FOUND
        # Its id stays taken while it lies in Redis.
        sid2 = ca.create_session(L, QH, KVH, D, session_id="parked").session_id
        ca.evict(sid2, "host")
        assert ca.evict(sid2, "host") == 0  # already there: nothing moves, nothing restored
        with pytest.raises(kvtier.KvTierError) as e:
            cb.create_session(L, QH, KVH, D, session_id="parked")
        assert e.value.code == grpc.StatusCode.ALREADY_EXISTS
        # It carries on there: appends extend it.
        k2, v2 = make_kv(2, 40)
        assert cb.append_layers(sid, 500, k2, v2) == 540


def test_a_full_host_tier_demotes_the_least_recent_idle_session(redis, start_daemon):
    # Each session: 4 layers x 3 heads x 32 chunks of 4 KiB = 1.5 MiB, and some 0.5 MiB of
    # metadata (chunk records, statistics, index) charged beside it; room for one and a half.
    d = start_daemon("--remote", f"unix:{redis}", "--host_capacity", "3M",
                     "--segment_size", "1M")
    k1, v1 = make_kv(3, 512)
    k2, v2 = make_kv(4, 512)
    with kvtier.Client(d.address) as c:
        s1 = c.create_session(L, QH, KVH, D, lossless=True).session_id
        c.append_layers(s1, 0, k1, v1)
        s2 = c.create_session(L, QH, KVH, D, lossless=True).session_id
        c.append_layers(s2, 0, k2, v2)  # needs room: s1 moves down
        assert remote_row(c).evictions == 1
        assert cli(redis, "EXISTS", f"kvtier:session:{s1}") == "1"
        expect_exact(c, s1, k1, v1, 512)  # restored transparently; s2 moves down for it
        assert remote_row(c).promotions == 1
        assert remote_row(c).evictions == 2
        expect_exact(c, s2, k2, v2, 512)
        assert c.describe_session(s1).info.num_tokens == 512


def test_without_a_remote_tier_a_full_host_refuses_and_keeps_what_it_has(start_daemon):
    d = start_daemon("--host_capacity", "3M", "--segment_size", "1M")  # room for one session
    k1, v1 = make_kv(5, 512)
    with kvtier.Client(d.address) as c:
        s1 = c.create_session(L, QH, KVH, D, lossless=True).session_id
        c.append_layers(s1, 0, k1, v1)
        s2 = c.create_session(L, QH, KVH, D, lossless=True).session_id
        with pytest.raises(kvtier.KvTierError) as e:
            c.append_layers(s2, 0, k1, v1)
        assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        expect_exact(c, s1, k1, v1, 512)
        with pytest.raises(kvtier.KvTierError) as e:
            c.evict(s1, "host")
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION


def test_a_corrupt_record_is_reported_and_never_served(redis, start_daemon):
    d = start_daemon("--remote", f"unix:{redis}")
    k, v = make_kv(6, 200)
    with kvtier.Client(d.address) as c:
        sid = c.create_session(L, QH, KVH, D, lossless=True).session_id
        c.append_layers(sid, 0, k, v)
        c.evict(sid, "host")
        key = f"kvtier:session:{sid}"
        cli(redis, "SETRANGE", key, "5000", "garbage")
        with pytest.raises(kvtier.KvTierError) as e:
            c.describe_session(sid)
        assert e.value.code == grpc.StatusCode.DATA_LOSS
        assert "checksum" in str(e.value)
        assert cli(redis, "EXISTS", key) == "1"  # kept for the operator, not served
        assert c.close_session(sid)  # closing a demoted session deletes its record
        assert cli(redis, "EXISTS", key) == "0"


def test_sessions_moving_down_and_back_under_concurrent_calls_stay_exact(redis, start_daemon):
    # Room for about two of the four sessions: every append and select may demote another
    # session or restore its own, while the other threads do the same.
    d = start_daemon("--remote", f"unix:{redis}", "--host_capacity", "3M",
                     "--segment_size", "1M", "--prefetch", "off")
    tokens, step = 384, 64
    data = [make_kv(10 + i, tokens) for i in range(4)]
    errors = []

    def retrying(call):
        # As documented: UNAVAILABLE when the call was caught while its session moved, and
        # "host tier full" while every other session is leased (between a Select and its
        # Release); both clear on their own, so the worker waits a little and retries.
        for attempt in range(200):
            try:
                return call()
            except kvtier.KvTierError as e:
                full = (e.code == grpc.StatusCode.RESOURCE_EXHAUSTED
                        and "host tier full" in str(e))
                if e.code != grpc.StatusCode.UNAVAILABLE and not full:
                    raise
                time.sleep(0.01 * (attempt % 5))
        raise AssertionError("no progress after 200 tries")

    def worker(i):
        try:
            with kvtier.Client(d.address) as c:
                sid = retrying(lambda: c.create_session(L, QH, KVH, D, lossless=True,
                                                        session_id=f"w{i}").session_id)
                k, v = data[i]
                for s in range(0, tokens, step):
                    retrying(lambda: c.append_layers(sid, s, k[:, :, s:s + step],
                                                     v[:, :, s:s + step]))
                    sel = retrying(lambda: c.select(sid, L - 1, np.ones((QH, D), np.float32),
                                                    budget_tokens=128))
                    c.release(sel.lease_id)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(f"worker {i}: {e!r}")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    with kvtier.Client(d.address) as c:
        assert remote_row(c).evictions > 0, "the host tier never filled: the test tests nothing"
        for i in range(4):
            expect_exact(c, f"w{i}", *data[i], tokens)


def test_sigterm_hands_every_session_to_the_remote_tier(redis, start_daemon):
    """--drain_to_remote (on by default with --remote): a stopped daemon's sessions, leased
    ones included, are served whole by the next daemon on that Redis; with it off they are
    gone."""
    a = start_daemon("--remote", f"unix:{redis}", "--instance", "drain-a", "--log_level", "info")
    k, v = make_kv(3, 300)
    k2, v2 = make_kv(4, 200)
    with kvtier.Client(a.address, attach=False) as ca:
        first = ca.create_session(L, QH, KVH, D, lossless=True, session_id="first").session_id
        ca.append_layers(first, 0, k, v)
        second = ca.create_session(L, QH, KVH, D, lossless=True, session_id="second").session_id
        ca.append_layers(second, 0, k2, v2)
        ca.select(second, L - 1, np.ones((QH, D), np.float32), lease_ms=600000)  # held
    assert a.stop() == 0
    assert "daemon.drain_to_remote demoted=2" in a.log.read_text()
    assert cli(redis, "EXISTS", "kvtier:session:first") == "1"
    assert cli(redis, "EXISTS", "kvtier:session:second") == "1"

    b = start_daemon("--remote", f"unix:{redis}", "--instance", "drain-b",
                     "--drain_to_remote", "off", "--log_level", "info")
    with kvtier.Client(b.address) as cb:
        expect_exact(cb, first, k, v, 300)
        expect_exact(cb, second, k2, v2, 200)
        assert remote_row(cb).promotions == 2
    assert b.stop() == 0
    assert "drain_to_remote" not in b.log.read_text()
    assert cli(redis, "EXISTS", "kvtier:session:first") == "0"  # closed with b, not handed on
    assert cli(redis, "KEYS", "kvtier:owner:*") == ""  # and their ids free for any daemon


def test_a_killed_daemon_restarted_serves_its_sessions_as_last_persisted(redis, start_daemon):
    """--persist_interval_ms: a daemon killed with SIGKILL and started again (same instance,
    same Redis) serves each session as of its last write-behind point, bytes exact, and says
    how many tokens it holds, so the worker re-appends the rest (a repeat is a no-op)."""
    flags = ("--remote", f"unix:{redis}", "--instance", "persist-a", "--persist_interval_ms",
             "100")
    a = start_daemon(*flags)
    k, v = make_kv(5, 400)
    with kvtier.Client(a.address) as ca:
        sid = ca.create_session(L, QH, KVH, D, lossless=True, session_id="kept").session_id
        ca.append_layers(sid, 0, k[:, :, :300], v[:, :, :300])
        deadline = time.monotonic() + 10
        key = "kvtier:snapshot:persist-a@"
        while not cli(redis, "KEYS", key + "*") and time.monotonic() < deadline:
            time.sleep(0.02)
        assert cli(redis, "KEYS", key + "*").endswith(":kept")
        time.sleep(0.5)  # five more intervals: the 300 tokens are in the snapshot
        ca.append_layers(sid, 300, k[:, :, 300:], v[:, :, 300:])
    a.proc.kill()  # SIGKILL: no drain, no shutdown
    a.proc.wait()
    a.killed = True

    other = start_daemon("--remote", f"unix:{redis}", "--instance", "persist-other")
    with kvtier.Client(other.address) as co:  # another daemon's snapshots are not its own
        with pytest.raises(kvtier.KvTierError) as e:
            co.describe_session(sid)
        assert e.value.code == grpc.StatusCode.NOT_FOUND

    b = start_daemon(*flags)
    with kvtier.Client(b.address) as cb:
        held = cb.describe_session(sid).info.num_tokens
        assert held in (300, 400)  # the last write-behind point: after 300, maybe after 400
        expect_exact(cb, sid, k[:, :, :held], v[:, :, :held], held)
        assert cb.append_layers(sid, 0, k, v) == 400  # from 0: what it holds is a no-op
        expect_exact(cb, sid, k, v, 400)
        assert cb.close_session(sid)
    assert cli(redis, "KEYS", key + "*") == ""  # a closed session leaves no snapshot
