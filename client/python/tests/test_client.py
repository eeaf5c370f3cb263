"""The Python client against a real kvtierd (started by the `daemon` fixture)."""
import json
import mmap
import os
import re
import struct
import subprocess
import sys
from pathlib import Path
import time
import urllib.request

import grpc
import numpy as np
import pytest

import kvtier
from helpers import free_port
from kvtier.v1 import kvtier_pb2 as pb

L, QH, KVH, D = 4, 9, 3, 64


def make_kv(rng, tokens):
    k = rng.standard_normal((L, KVH, tokens, D)).astype(np.float16)
    v = rng.standard_normal((L, KVH, tokens, D)).astype(np.float16)
    return k, v


@pytest.fixture
def client(daemon):
    with kvtier.Client(daemon.address) as c:
        yield c


def test_round_trip_through_shared_memory_is_exact_and_zero_copy(client):
    rng = np.random.default_rng(1)
    k, v = make_kv(rng, 600)
    sid = client.create_session(L, QH, KVH, D, lossless=True).session_id
    assert client.append_layers(sid, 0, k[:, :, :350], v[:, :, :350]) == 350
    assert client.append_layers(sid, 350, k[:, :, 350:], v[:, :, 350:]) == 600
    sel = client.select(sid, L - 1, rng.standard_normal((QH, D)), budget_tokens=5000)
    assert sel.context_tokens == 600
    for head in sel.heads:
        pos, hk, hv = client.gather(head, sid)
        order = np.argsort(pos)
        assert pos[order].tolist() == list(range(600))
        np.testing.assert_array_equal(hk[order], k[L - 1, head.kv_head])
        np.testing.assert_array_equal(hv[order], v[L - 1, head.kv_head])
    # One handle's view is backed by the daemon's mapping, not a copy.
    block = sel.heads[0].blocks[0]
    kview, vview = client.view(block, D)
    assert not kview.flags.owndata and not kview.flags.writeable
    base = kview
    while isinstance(base, np.ndarray):
        base = base.base
    if isinstance(base, memoryview):
        base = base.obj
    assert isinstance(base, mmap.mmap)
    np.testing.assert_array_equal(kview, k[L - 1, 0, :16])
    client.release(sel.lease_id)


def test_a_bf16_sessions_rows_come_back_as_the_bits_appended(client):
    """A bf16 session stores bf16 bits (appended as uint16): gather, view and the torch view give
    them back as such (uint16 bits; torch.bfloat16), never read as fp16, through shared memory
    and inline alike."""
    rng = np.random.default_rng(5)
    want = rng.standard_normal((L, KVH, 200, D)).astype(np.float32)
    bits = (want.view(np.uint32) >> 16).astype(np.uint16)  # bf16 by truncation: exact below
    bits[0, 0, 0, :2] = (0x3F80, 0xC000)  # 1.0 and -2.0 (as fp16 bits: 1.875 and -2.0)
    sid = client.create_session(L, QH, KVH, D, dtype="bf16", lossless=True).session_id
    assert client.append_layers(sid, 0, bits, bits[::-1].copy(), wait_aged=True) == 200
    for data in (False, True):
        sel = client.select(sid, 0, rng.standard_normal((QH, D)), budget_tokens=5000,
                            include_data=data)
        for head in sel.heads:
            assert all(b.precision == pb.PRECISION_BF16 for b in head.blocks)
            pos, hk, hv = client.gather(head, sid)
            assert hk.dtype == np.uint16
            order = np.argsort(pos)
            np.testing.assert_array_equal(hk[order], bits[0, head.kv_head])
            np.testing.assert_array_equal(hv[order], bits[::-1][0, head.kv_head])
            if not data:  # SegmentMap.gather, its dtype unnamed: the bits too
                sk, sv = client.segments.gather(head.blocks, D)
                assert sk.dtype == np.uint16
                np.testing.assert_array_equal(sk, hk)
                np.testing.assert_array_equal(sv, hv)
        block = sel.heads[0].blocks[0]
        if not data:
            kview, _ = client.view(block, D)
            assert kview.dtype == np.uint16
            np.testing.assert_array_equal(kview[0, :2], [0x3F80, 0xC000])
            try:
                import torch
            except ImportError:
                torch = None
            if torch is not None:
                kt, _ = client.view(block, D, like="torch")
                assert kt.dtype == torch.bfloat16
                assert kt[0, :2].float().tolist() == [1.0, -2.0]
        client.release(sel.lease_id)


def test_torch_views_are_the_mapped_bytes_without_a_copy(client):
    """like="torch" gives tensors over the same mapping as the numpy views (same address, no
    copy), equal to what was appended; both export DLPack to the other without a copy."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(11)
    k, v = make_kv(rng, 300)
    sid = client.create_session(L, QH, KVH, D, lossless=True).session_id
    client.append_layers(sid, 0, k, v, wait_aged=True)
    sel = client.select(sid, 2, rng.standard_normal((QH, D)), budget_tokens=5000)
    for head in sel.heads:
        pos = []
        for b in head.blocks:
            kt, vt = client.view(b, D, like="torch")
            kn, vn = client.view(b, D)
            assert kt.dtype == torch.float16 and tuple(kt.shape) == (b.num_tokens, D)
            assert kt.data_ptr() == kn.ctypes.data and vt.data_ptr() == vn.ctypes.data
            p = np.asarray(b.positions)
            np.testing.assert_array_equal(kt.numpy(), k[2, head.kv_head][p])
            np.testing.assert_array_equal(vt.numpy(), v[2, head.kv_head][p])
            back = np.from_dlpack(kt)
            assert back.ctypes.data == kn.ctypes.data
            assert torch.from_dlpack(kn).data_ptr() == kt.data_ptr()
            client.segments.check(b)
            pos += p.tolist()
        assert sorted(pos) == list(range(300))
    with pytest.raises(kvtier.KvTierArgumentError, match="like"):
        client.view(sel.heads[0].blocks[0], D, like="jax")
    client.release(sel.lease_id)


def test_budget_semantics_and_inline_bytes_match_mapped_bytes(client):
    rng = np.random.default_rng(2)
    k, v = make_kv(rng, 2000)
    sid = client.create_session(L, QH, KVH, D, lossless=True).session_id
    client.append_layers(sid, 0, k, v, wait_aged=True)  # Selects below compare
    q = rng.standard_normal((QH, D))
    mapped = client.select(sid, 3, q, budget_tokens=256)
    inline = client.select(sid, 3, q, budget_tokens=256, include_data=True)
    for hm, hi in zip(mapped.heads, inline.heads):
        pm, km, vm = client.gather(hm, sid)
        pi, ki, vi = client.gather(hi, sid)
        np.testing.assert_array_equal(pm, pi)
        np.testing.assert_array_equal(km, ki)
        np.testing.assert_array_equal(vm, vi)
        assert len(pm) <= 256 and len(set(pm.tolist())) == len(pm)
        assert set(range(16)) | set(range(2000 - 64, 2000)) <= set(pm.tolist())
        # rows are the appended rows at their positions
        np.testing.assert_array_equal(km, k[3, hm.kv_head][pm])
    # Dense layers (below dense_layers=2) return everything.
    dense = client.select(sid, 1, q, budget_tokens=256)
    assert all(sum(b.num_tokens for b in h.blocks) == 2000 for h in dense.heads)


def test_refined_selections_gather_only_the_chosen_rows(client):
    """With refine_factor 4 a handle may name a subset of its chunk's rows: gather returns
    exactly those, mapped and inline alike, and the budget counts rows."""
    rng = np.random.default_rng(5)
    k, v = make_kv(rng, 2000)
    sid = client.create_session(L, QH, KVH, D, lossless=True, refine_factor=4).session_id
    assert client.describe_session(sid).info.policy.refine_factor == 4
    client.append_layers(sid, 0, k, v, wait_aged=True)  # Selects below compare
    q = rng.standard_normal((QH, D))
    mapped = client.select(sid, 3, q, budget_tokens=256)
    inline = client.select(sid, 3, q, budget_tokens=256, include_data=True)
    compact = client.select(sid, 3, q, budget_tokens=256, row_handles=False)
    partial = gathered = 0
    for hm, hi, hc in zip(mapped.heads, inline.heads, compact.heads):
        pm, km, vm = client.gather(hm, sid)
        pi, ki, vi = client.gather(hi, sid)
        pc, kc, vc = client.gather(hc, sid)
        np.testing.assert_array_equal(pm, pi)
        np.testing.assert_array_equal(km, ki)
        assert len(pm) == 256 and len(set(pm.tolist())) == 256
        np.testing.assert_array_equal(km, k[3, hm.kv_head][pm])
        np.testing.assert_array_equal(vm, v[3, hm.kv_head][pm])
        # The same rows, gathered by the daemon: every handle's rows all selected.
        assert sorted(pc.tolist()) == sorted(pm.tolist())
        np.testing.assert_array_equal(kc, k[3, hc.kv_head][pc])
        assert not any(b.rows for b in hc.blocks)
        partial += sum(1 for b in hm.blocks if b.rows)
        gathered += sum(1 for b in hc.blocks if b.gathered)
    assert partial > 0 and gathered > 0, "refinement chose no partial chunk: it did nothing"
    with pytest.raises(kvtier.KvTierError) as e:
        client.create_session(L, QH, KVH, D, refine_factor=65)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "refine_factor" in e.value.message


def test_token_ids_drive_boundary_chunks_and_semantic_chunks_keep_positions(client):
    rng = np.random.default_rng(4)
    k, v = make_kv(rng, 400)
    ids = np.where(rng.random(400) < 0.15, 13, 100 + rng.integers(0, 50, 400))
    sid = client.create_session(L, QH, KVH, D, lossless=True, chunking=pb.CHUNKING_BOUNDARY,
                                delimiter_token_ids=[13]).session_id
    for start in range(0, 400, 90):
        end = min(400, start + 90)
        client.append_kv(sid, [(layer, start, k[layer, :, start:end], v[layer, :, start:end],
                                ids[start:end]) for layer in range(L)])
    # The rule, written out: cut after id 13 from 8 tokens on, and at 32.
    sizes, n = [], 0
    for t in range(400):
        n += 1
        if n == 32 or (n >= 8 and ids[t] == 13):
            sizes.append(n)
            n = 0
    if n:
        sizes.append(n)
    listed = client.list_chunks(sid, layer=2)
    assert [c.num_tokens for c in listed.chunks if c.kv_head == 0] == sizes
    with pytest.raises(kvtier.KvTierError) as e:
        client.create_session(L, QH, KVH, D, chunking=pb.CHUNKING_BOUNDARY)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "policy.delimiter_token_ids" in str(e.value)

    sid = client.create_session(L, QH, KVH, D, lossless=True,
                                chunking=pb.CHUNKING_SEMANTIC).session_id
    client.append_layers(sid, 0, k, v, wait_aged=True)  # Selects below compare
    sel = client.select(sid, L - 1, rng.standard_normal((QH, D)), budget_tokens=5000)
    for head in sel.heads:
        pos, hk, hv = client.gather(head, sid)
        assert sorted(pos.tolist()) == list(range(400))
        np.testing.assert_array_equal(hk, k[L - 1, head.kv_head][pos])
        np.testing.assert_array_equal(hv, v[L - 1, head.kv_head][pos])
    client.release(sel.lease_id)


def test_cold_copies_are_cached_and_prefetched(client):
    rng = np.random.default_rng(5)
    # Twice the refinement's candidate pool at this budget (8 x the 176 rows the sinks and window
    # leave), so that the first Select leaves cold chunks for the prefetch to promote.
    k, v = make_kv(rng, 3000)
    sid = client.create_session(L, QH, KVH, D).session_id  # int4 cold chunks
    client.append_layers(sid, 0, k, v, wait_aged=True)  # cold before the first Select

    def host():
        return next(t for t in client.tier_stats() if t.tier == pb.TIER_HOST)

    before = host()
    assert before.eviction_policy == "lru"
    q = rng.standard_normal((QH, D))
    first = client.select(sid, L - 1, q, budget_tokens=256)
    client.release(first.lease_id)
    mid = host()
    assert mid.cache_misses > before.cache_misses  # cold chunks dequantized on demand
    # The prefetch after the first Select runs in the background; the same query again finds
    # every copy cached.
    for _ in range(100):
        if host().prefetched > before.prefetched:
            break
        time.sleep(0.01)
    second = client.select(sid, L - 1, q, budget_tokens=256)
    client.release(second.lease_id)
    after = host()
    assert after.cache_misses == mid.cache_misses
    assert after.cache_hits > mid.cache_hits
    assert after.prefetched > before.prefetched
    assert after.cached_copies > 0


def test_tenant_quotas_name_the_quota(start_daemon, tmp_path):
    config = tmp_path / "quota.conf"
    config.write_text('quotas { key: "small" value { host_bytes: "512K" max_sessions: 1 } }\n')
    d = start_daemon("--config", str(config))
    rng = np.random.default_rng(6)
    k, v = make_kv(rng, 300)  # 4 layers x 3 heads x 19 chunks of 4 KiB: 912 KiB
    with kvtier.Client(d.address, tenant="small") as small, \
            kvtier.Client(d.address, tenant="big") as big:
        sid = small.create_session(L, QH, KVH, D, lossless=True).session_id
        with pytest.raises(kvtier.KvTierError) as e:
            small.create_session(L, QH, KVH, D)
        assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert 'quota: tenant "small" max_sessions 1' in str(e.value)
        with pytest.raises(kvtier.KvTierError) as e:
            small.append_layers(sid, 0, k, v)
        assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert 'quota: tenant "small" host_bytes 512.0 KiB' in str(e.value)
        # Another tenant is not held to it.
        other = big.create_session(L, QH, KVH, D, lossless=True).session_id
        assert big.append_layers(other, 0, k, v) == 300



def test_bearer_tokens_name_the_tenant(start_daemon, tmp_path):
    """The Python client's token: the daemon's auth.tokens entry (made by kvtierctl, checked
    here against hashlib) admits it as its tenant, and nothing else gets in."""
    import hashlib
    token = "py-token-" + os.urandom(8).hex()
    (tmp_path / "token").write_text(token + "\n")
    ctl = Path(__file__).resolve().parents[3] / os.environ.get("KVTIER_BUILD", "build") / "bin"
    made = subprocess.run([str(ctl / "kvtierctl"), "token", "hash", "--tenant", "carol"],
                          stdin=(tmp_path / "token").open(), capture_output=True, text=True,
                          timeout=30)
    assert made.returncode == 0, made.stderr
    salt = re.search(r'salt: "([0-9a-f]+)"', made.stdout).group(1)
    digest = re.search(r'sha256: "([0-9a-f]+)"', made.stdout).group(1)
    assert digest == hashlib.sha256((salt + token).encode()).hexdigest()
    config = tmp_path / "auth.conf"
    config.write_text('auth { same_uid_by_metadata: "off" ' + made.stdout + " }\n")
    d = start_daemon("--config", str(config))
    rng = np.random.default_rng(8)
    k, v = make_kv(rng, 100)
    with kvtier.Client(d.address, token=token) as carol:
        sid = carol.create_session(L, QH, KVH, D, lossless=True).session_id
        assert carol.append_layers(sid, 0, k, v) == 100
        assert [s.tenant for s in carol.list_sessions()] == ["carol"]
    for kwargs, code in (({}, grpc.StatusCode.UNAUTHENTICATED),
                         ({"token": token + "x"}, grpc.StatusCode.UNAUTHENTICATED),
                         ({"token": token, "tenant": "dave"}, grpc.StatusCode.PERMISSION_DENIED)):
        with kvtier.Client(d.address, **kwargs) as c, pytest.raises(kvtier.KvTierError) as e:
            c.list_sessions()
        assert e.value.code == code, kwargs
        assert token not in e.value.message


def test_open_segments_gives_read_only_descriptors_of_ones_own(daemon):
    """The descriptor socket: alice's segments as read-only descriptors with the bytes of the
    named files; bob's ids are NOT_FOUND to her."""
    rng = np.random.default_rng(12)
    k, v = make_kv(rng, 200)
    with kvtier.Client(daemon.address, tenant="alice") as alice, \
            kvtier.Client(daemon.address, tenant="bob") as bob:
        sid = alice.create_session(L, QH, KVH, D, lossless=True).session_id
        alice.append_layers(sid, 0, k, v)
        bsid = bob.create_session(L, QH, KVH, D, lossless=True).session_id
        bob.append_layers(bsid, 0, k, v)
        opened = alice.open_segments([])
        assert opened and all(seg.tenant == "alice" for seg, _ in opened)
        for seg, fd in opened:
            try:
                with pytest.raises(PermissionError):
                    mmap.mmap(fd, seg.size_bytes, prot=mmap.PROT_READ | mmap.PROT_WRITE)
                with open("/dev/shm/" + seg.shm_name.lstrip("/"), "rb") as f:
                    named = f.read(seg.size_bytes)
                assert mmap.mmap(fd, seg.size_bytes, prot=mmap.PROT_READ)[:] == named
            finally:
                os.close(fd)
        with pytest.raises(kvtier.KvTierError) as e:
            alice.open_segments([bob.list_segments()[0].segment_id])
        assert e.value.code == grpc.StatusCode.NOT_FOUND


OTHER_SHM = """
import os, sys
import numpy as np
sys.path.insert(0, sys.argv[3])
import kvtier
from kvtier.v1 import kvtier_pb2 as pb
address, sid = sys.argv[1], sys.argv[2]
want_k = np.load(sys.argv[4])
def read():
    with kvtier.Client(address) as c:
        sel = c.select(sid, 3, np.ones((9, 64), np.float32), budget_tokens=5000)
        pos, k, _ = c.gather(sel.heads[0], sid)
        c.release(sel.lease_id)
        return np.array_equal(k[np.argsort(pos)], want_k), c.list_segments()
# This /dev/shm is not the daemon's: no file of its names is here.
ok, segments = read()
assert segments and all(s.shm_name and s.stamp_offset for s in segments), segments
print("absent", ok)
# A same-named file of someone else's, as big, with other bytes (another daemon's segment).
for s in segments:
    with open("/dev/shm/" + s.shm_name.lstrip("/"), "wb") as f:
        f.write(b"\x3c" * s.size_bytes)
print("decoy", read()[0])
"""


def test_a_daemon_behind_another_dev_shm_is_read_by_descriptor(daemon, tmp_path):
    """A worker whose /dev/shm is not the daemon's (the daemon in a container): its segment names
    are not found there, or name someone else's files, whose stamp differs. Either way the
    client reads the daemon's own bytes, by descriptor. Run in a private mount namespace with
    its own /dev/shm (root only)."""
    if os.geteuid() != 0 or subprocess.run(["unshare", "-m", "true"]).returncode != 0:
        pytest.skip("needs root and unshare -m for a private /dev/shm")
    rng = np.random.default_rng(21)
    k, v = make_kv(rng, 120)
    with kvtier.Client(daemon.address) as c:
        sid = c.create_session(L, QH, KVH, D, lossless=True).session_id
        c.append_layers(sid, 0, k, v, wait_aged=True)
        for seg in c.list_segments():  # the stamp is in the daemon's file where it says
            with open("/dev/shm/" + seg.shm_name.lstrip("/"), "rb") as f:
                f.seek(seg.stamp_offset)
                assert f.read(8) == seg.stamp.to_bytes(8, "little")
    np.save(tmp_path / "k.npy", k[3, 0])
    (tmp_path / "other_shm.py").write_text(OTHER_SHM)
    out = subprocess.run(
        ["unshare", "-m", "sh", "-c", 'mount -t tmpfs -o size=64m tmpfs /dev/shm && exec "$@"',
         "sh", sys.executable, str(tmp_path / "other_shm.py"), daemon.address, sid,
         str(Path(kvtier.__file__).resolve().parents[1]), str(tmp_path / "k.npy")],
        capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["absent True", "decoy True"], out.stdout


def test_memfd_segments_are_read_by_descriptor(start_daemon):
    """segment_memory memfd: the daemon names no segment and /dev/shm holds none of its
    memory, yet the client's gather reads every row exactly, through descriptors."""
    d = start_daemon("--segment_memory", "memfd")
    rng = np.random.default_rng(21)
    k, v = make_kv(rng, 400)
    with kvtier.Client(d.address, tenant="alice") as c:
        sid = c.create_session(L, QH, KVH, D, lossless=True).session_id
        assert c.append_layers(sid, 0, k, v) == 400
        segs = c.list_segments()
        assert segs and all(s.shm_name == "" for s in segs)
        assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"kvtier-{d.instance}-")]
        sel = c.select(sid, 1, rng.standard_normal((QH, D)), budget_tokens=5000)
        for head in sel.heads:
            assert not any(b.keys for b in head.blocks)  # nothing inline: read from memory
            pos, hk, hv = c.gather(head, sid)
            order = np.argsort(pos)
            assert pos[order].tolist() == list(range(400))
            np.testing.assert_array_equal(hk[order], k[1, head.kv_head])
            np.testing.assert_array_equal(hv[order], v[1, head.kv_head])
        c.release(sel.lease_id)


def _staging_fds(d) -> int:
    """How many staging areas the daemon holds (its memfds named "...-staging-N")."""
    fd_dir = f"/proc/{d.proc.pid}/fd"
    return sum("-staging-" in os.readlink(f"{fd_dir}/{n}") for n in os.listdir(fd_dir))


def test_append_layers_goes_through_a_staging_area_and_stores_the_same(start_daemon):
    """On a Unix socket append_layers writes K and V into the session's staging area (zero-copy
    ingest); what it stores is what the bytes sent inline store. It opens a new area when the
    daemon lost its own, and sends the bytes to a daemon without staging."""
    d = start_daemon()
    rng = np.random.default_rng(23)
    k, v = make_kv(rng, 300)
    q = rng.standard_normal((QH, D))
    with kvtier.Client(d.address, tenant="alice") as c:
        staged = c.create_session(L, QH, KVH, D, lossless=True).session_id
        inline = c.create_session(L, QH, KVH, D, lossless=True).session_id
        assert _staging_fds(d) == 0
        assert c.append_layers(staged, 0, k[:, :, :200], v[:, :, :200], wait_aged=True) == 200
        assert _staging_fds(d) == 1
        # Another area replaces the client's: the next append opens one anew, transparently.
        other = c.open_staging(staged, 4096)
        assert other.size == 4096
        assert c.append_layers(staged, 200, k[:, :, 200:], v[:, :, 200:], wait_aged=True) == 300
        assert _staging_fds(d) == 1
        assert c.append_layers(staged, 0, k, v) == 300  # a repeat: a new area, and a no-op
        assert _staging_fds(d) == 1
        assert c.append_layers(inline, 0, k, v, wait_aged=True, zero_copy=False) == 300
        assert _staging_fds(d) == 1  # the inline one opened none
        for layer in range(L):
            a = c.select(staged, layer, q, budget_tokens=5000, include_data=True)
            b = c.select(inline, layer, q, budget_tokens=5000, include_data=True)
            for ha, hb in zip(a.heads, b.heads):
                assert [x.keys for x in ha.blocks] == [x.keys for x in hb.blocks]
                assert [x.values for x in ha.blocks] == [x.values for x in hb.blocks]
                assert sum(x.num_tokens for x in ha.blocks) == 300
        # A staged append past the area is refused by name, before anything is sent.
        small = c.open_staging(staged, 4096)
        with pytest.raises(ValueError, match="staging area"):
            c.append_kv(staged, [(0, 300, k[0], v[0])], staging=small)
        assert c.close_session(staged)
        assert _staging_fds(d) == 0  # the area went with its session
    bare = start_daemon("--max_staging_size", "0")
    with kvtier.Client(bare.address) as c:
        sid = c.create_session(L, QH, KVH, D, lossless=True).session_id
        assert c.append_layers(sid, 0, k, v) == 300  # sent as bytes
        with pytest.raises(kvtier.KvTierError) as e:
            c.open_staging(sid, 4096)
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "max_staging_size" in e.value.message


def test_append_layers_sends_the_bytes_when_no_area_or_channel_can_carry_them(start_daemon):
    """append_layers picks staging and the channel by default; an append larger than the
    daemon lets a staging area be (--max_staging_size), or a decode step larger than the
    channel's request area, is sent as bytes instead of refused, and stored exactly."""
    rng = np.random.default_rng(27)
    d = start_daemon("--max_staging_size", "1M")
    with kvtier.Client(d.address) as c:
        k, v = make_kv(rng, 1200)  # 2 x 1.8 MB: past the 1 MB an area may hold
        sid = c.create_session(L, QH, KVH, D, lossless=True).session_id
        assert c.append_layers(sid, 0, k[:, :, :100], v[:, :, :100]) == 100  # staged
        assert c.append_layers(sid, 100, k[:, :, 100:], v[:, :, 100:], wait_aged=True) == 1200
        sel = c.select(sid, 1, rng.standard_normal((QH, D)), budget_tokens=5000)
        pos, hk, _ = c.gather(sel.heads[2], sid)
        np.testing.assert_array_equal(hk[np.argsort(pos)], k[1, 2])
        # 32 KV heads x 128 x 64 tokens: a layer's K and V are 1 MiB, past the request area of
        # the default 4 MiB channel.
        big = rng.standard_normal((1, 32, 64, 128)).astype(np.float16)
        wide = c.create_session(1, 32, 32, 128, lossless=True).session_id
        assert c.append_layers(wide, 0, big, big[:, ::-1].copy(), wait_aged=True) == 64
        sel = c.select(wide, 0, rng.standard_normal((32, 128)), budget_tokens=5000)
        pos, hk, hv = c.gather(sel.heads[31], wide)
        np.testing.assert_array_equal(hk[np.argsort(pos)], big[0, 31])
        np.testing.assert_array_equal(hv[np.argsort(pos)], big[0, 0])


def test_arrays_in_either_byte_order_are_stored_as_their_values(client):
    """The daemon reads little-endian values: a big-endian array's values are stored, not its
    bytes."""
    rng = np.random.default_rng(28)
    k, v = make_kv(rng, 100)
    sid = client.create_session(L, QH, KVH, D, lossless=True).session_id
    assert client.append_layers(sid, 0, k.astype(">f2"), v.astype(">f2"), wait_aged=True) == 100
    sel = client.select(sid, 0, rng.standard_normal((QH, D)), budget_tokens=5000)
    pos, hk, hv = client.gather(sel.heads[1], sid)
    np.testing.assert_array_equal(hk[np.argsort(pos)], k[0, 1])
    np.testing.assert_array_equal(hv[np.argsort(pos)], v[0, 1])


def test_a_channels_descriptors_are_not_inherited_and_go_with_it(client):
    """The descriptors a channel receives are close-on-exec (a child program never holds the
    worker's end, which would keep the channel and its leases alive), and a channel dropped
    without close() still hangs up once collected."""
    import gc
    ch = client.open_channel()
    fds = list(ch._fds)
    assert fds and not any(os.get_inheritable(fd) for fd in fds)
    files = [(os.fstat(fd).st_dev, os.fstat(fd).st_ino) for fd in fds]
    del ch
    gc.collect()
    for fd, file in zip(fds, files):  # closed (or the number taken since by another file)
        try:
            st = os.fstat(fd)
        except OSError:
            continue
        assert (st.st_dev, st.st_ino) != file


def test_select_channel_thread_waits_on_the_workers_cpu_unless_told_not_to(start_daemon):
    """The client says which CPU it calls from (the header's worker_cpu); a daemon that
    co-locates (the default) holds the channel's thread there and says so in serving_cpu, and
    the answers are the same; with --channel_colocate off it says nothing."""
    rng = np.random.default_rng(26)
    k, v = make_kv(rng, 300)
    q = rng.standard_normal((QH, D))
    for flags, colocates in (((), True), (("--channel_colocate", "off"), False)):
        d = start_daemon(*flags)
        with kvtier.Client(d.address, tenant="alice") as c:
            sid = c.create_session(L, QH, KVH, D, lossless=True).session_id
            c.append_layers(sid, 0, k, v, wait_aged=True)
            want = [x.chunk_id for x in c.select(sid, 1, q, budget_tokens=128).heads[0].blocks]
            with c.open_channel() as ch:
                for _ in range(3):
                    r = ch.select(sid, 1, q, budget_tokens=128)
                    assert [x.chunk_id for x in r.heads[0].blocks] == want
                    ch.release(r.lease_id)
                said, serving = struct.unpack_from("<II", ch._mem, 72)
                assert said >= 1  # 1 + the CPU of the last call
                for _ in range(200):
                    said, serving = struct.unpack_from("<II", ch._mem, 72)
                    if serving == (said if colocates else 0):
                        break
                    time.sleep(0.01)
                assert serving == (said if colocates else 0), (flags, said, serving)


def test_select_channel_answers_as_the_rpc_and_a_dead_worker_loses_its_leases(start_daemon):
    """A Select through the shared-memory channel returns the RPC's handles and errors; a worker
    process that dies holding the channel's leases (it never releases them) loses them at once,
    not at their TTL."""
    d = start_daemon("--lease_ttl_ms", "600000")
    rng = np.random.default_rng(25)
    k, v = make_kv(rng, 500)
    q = rng.standard_normal((QH, D))
    with kvtier.Client(d.address, tenant="alice") as c:
        sid = c.create_session(L, QH, KVH, D, lossless=True).session_id
        c.append_layers(sid, 0, k, v, wait_aged=True)
        with c.open_channel() as ch:
            assert ch.worker_id
            a = ch.select(sid, 2, q, budget_tokens=128, include_data=True)
            b = c.select(sid, 2, q, budget_tokens=128, include_data=True)
            for ha, hb in zip(a.heads, b.heads):
                assert [x.chunk_id for x in ha.blocks] == [x.chunk_id for x in hb.blocks]
                assert [x.keys for x in ha.blocks] == [x.keys for x in hb.blocks]
            ch.release(a.lease_id)
            c.release(b.lease_id)
            with pytest.raises(kvtier.KvTierError) as e:
                ch.select(sid, L, q)  # no such layer: the RPC's own error
            assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert "layer" in e.value.message
            batch = ch.batch_select([pb.SelectRequest(
                session_id=sid, layer=layer, query=np.float32(q).tobytes(), budget_tokens=128)
                for layer in range(L)])
            assert len(batch.responses) == L
            assert c.describe_session(sid).info.active_leases == L
        # Closed: its leases end (seen by the daemon's channel thread, so polled).
        for _ in range(100):
            if c.describe_session(sid).info.active_leases == 0:
                break
            time.sleep(0.05)
        assert c.describe_session(sid).info.active_leases == 0
        worker = subprocess.run(
            [sys.executable, "-c", f"""
import os, numpy as np, kvtier
c = kvtier.Client({d.address!r}, tenant="alice")
ch = c.open_channel()
for layer in range({L}):
    ch.select({sid!r}, layer, np.ones(({QH}, {D}), np.float32), budget_tokens=128)
print("selected", c.describe_session({sid!r}).info.active_leases, flush=True)
os._exit(0)  # dies holding the leases: nothing released, nothing closed
"""], capture_output=True, text=True, timeout=120,
            env={**os.environ, "PYTHONPATH": str(Path(kvtier.__file__).parents[1])})
        assert worker.stdout.split() == ["selected", str(L)], worker.stderr
        for _ in range(100):
            if c.describe_session(sid).info.active_leases == 0:
                break
            time.sleep(0.05)
        assert c.describe_session(sid).info.active_leases == 0, "the dead worker's leases stayed"


def test_batch_select_takes_every_layer_at_once_as_this_clients_worker(start_daemon):
    """batch_select answers each request as select does, and its leases are this client's
    worker's: they end when the client closes."""
    d = start_daemon("--lease_ttl_ms", "600000")
    rng = np.random.default_rng(27)
    k, v = make_kv(rng, 400)
    q = np.float32(rng.standard_normal((QH, D)))
    with kvtier.Client(d.address, tenant="alice") as watcher:
        c = kvtier.Client(d.address, tenant="alice")
        sid = c.create_session(L, QH, KVH, D, lossless=True).session_id
        c.append_layers(sid, 0, k, v, wait_aged=True)
        batch = c.batch_select([pb.SelectRequest(session_id=sid, layer=layer, query=q.tobytes(),
                                                 budget_tokens=128, include_data=True,
                                                 row_handles=True)
                                for layer in range(L)])
        assert len(batch.responses) == L
        for layer, r in enumerate(batch.responses):
            one = c.select(sid, layer, q, budget_tokens=128, include_data=True)
            assert [[b.keys for b in h.blocks] for h in r.heads] == \
                [[b.keys for b in h.blocks] for h in one.heads]
            c.release(one.lease_id)
        assert watcher.describe_session(sid).info.active_leases == L
        c.close()  # its worker goes, and the batch's leases with it
        for _ in range(100):
            if watcher.describe_session(sid).info.active_leases == 0:
                break
            time.sleep(0.05)
        assert watcher.describe_session(sid).info.active_leases == 0


def test_mtls_names_the_tenant_by_certificate(start_tcp_daemon, pki, tmp_path):
    config = tmp_path / "tls.conf"
    config.write_text(f'tls {{ cert_file: "{tmp_path}/server.pem" key_file: "{tmp_path}/server.key" '
                      f'client_ca_file: "{tmp_path}/ca.pem" }}\n'
                      'auth { cert_subjects { subject: "CN=carol,O=team-c" tenant: "carol" } }\n')
    _, port = start_tcp_daemon("--config", str(config))
    tls = dict(tls_ca=str(tmp_path / "ca.pem"))
    with kvtier.Client(f"127.0.0.1:{port}", timeout=10, tls_cert=str(tmp_path / "carol.pem"),
                       tls_key=str(tmp_path / "carol.key"), **tls) as carol:
        sid = carol.create_session(L, QH, KVH, D).session_id
        assert [(s.session_id, s.tenant) for s in carol.list_sessions()] == [(sid, "carol")]
    with kvtier.Client(f"127.0.0.1:{port}", timeout=5, **tls) as anonymous, \
            pytest.raises(kvtier.KvTierError) as e:
        anonymous.list_sessions()
    assert e.value.code == grpc.StatusCode.UNAVAILABLE  # no certificate: no handshake

WORKER = """
import sys, time
import numpy as np
sys.path.insert(0, sys.argv[3])
import kvtier
c = kvtier.Client(sys.argv[1], attach=sys.argv[4] == "attach")
sel = c.select(sys.argv[2], 3, np.ones((9, 64), np.float32), budget_tokens=256,
               lease_ms=int(sys.argv[5]), placement=sys.argv[6])
pos, k, v = c.gather(sel.heads[0], sys.argv[2])  # reads through shared memory
print(sel.lease_id, flush=True)
time.sleep(600)  # holds the lease until killed
"""


def start_worker(tmp_path, address, sid, attach, lease_ms, placement="host"):
    """A worker process holding one lease; returns it and the lease id it printed."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    worker = subprocess.Popen(
        [sys.executable, str(script), address, sid,
         str(Path(kvtier.__file__).resolve().parents[1]), "attach" if attach else "no",
         str(lease_ms), placement],
        stdout=subprocess.PIPE, text=True)
    lease = worker.stdout.readline().strip()
    assert lease, "the worker printed no lease"
    return worker, lease


def session_of(c, seed):
    """A new session of 1000 random tokens in every layer."""
    k, v = make_kv(np.random.default_rng(seed), 1000)
    sid = c.create_session(L, QH, KVH, D).session_id
    c.append_layers(sid, 0, k, v)
    return sid


def pinned(c):
    return sum(t.pinned_bytes for t in c.tier_stats())


def wait_unpinned(c, seconds):
    deadline = time.monotonic() + seconds
    while pinned(c) > 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    return pinned(c) == 0


def test_a_killed_worker_s_leases_expire_and_free_their_pins(start_daemon, tmp_path):
    d = start_daemon("--lease_ttl_ms", "600")
    with kvtier.Client(d.address) as c:
        sid = session_of(c, 7)
        worker, lease = start_worker(tmp_path, d.address, sid, attach=False, lease_ms=600)
        assert pinned(c) > 0
        worker.kill()
        worker.wait()
        assert wait_unpinned(c, 10), "the dead worker's pins outlived its lease"
        with pytest.raises(kvtier.KvTierError) as e:
            c.release(lease)
        assert e.value.code == grpc.StatusCode.NOT_FOUND


def test_a_killed_worker_s_device_leases_end_and_the_device_memory_comes_back(start_daemon,
                                                                              tmp_path):
    """The crash test of the device tier (here emulated; on a GPU gpu_path_gpu_test's twin):
    a worker holding leases on device copies is killed; within the lease TTL nothing of the
    device tier is pinned for it, and its copies are then evicted to the last byte."""
    d = start_daemon("--lease_ttl_ms", "600")
    with kvtier.Client(d.address) as c:
        sid = session_of(c, 9)
        for attach in (True, False):
            worker, lease = start_worker(tmp_path, d.address, sid, attach=attach,
                                         lease_ms=600, placement="device")
            device = next(t for t in c.tier_stats() if t.tier == pb.TIER_DEVICE)
            assert device.pinned_bytes > 0 and device.used_bytes > 0
            worker.kill()
            worker.wait()
            assert wait_unpinned(c, 10), "the dead worker's device pins outlived its lease"
            assert c.evict(sid, "device") > 0
            device = next(t for t in c.tier_stats() if t.tier == pb.TIER_DEVICE)
            assert device.used_bytes == 0 and device.pinned_bytes == 0


def test_a_worker_s_mappings_of_a_restarted_daemon_are_replaced_not_used(start_daemon,
                                                                         tmp_path):
    """The worker keeps its mapping of segment N across a daemon's restart (same socket, same
    instance); the new daemon's segment N is another one. Its handles are read through a
    mapping made anew, never the old one: the bytes are the new session's."""
    a = start_daemon()
    rng = np.random.default_rng(21)
    with kvtier.Client(a.address, attach=False) as c:
        def first_block(k, v):
            sid = c.create_session(L, QH, KVH, D, lossless=True, refine_factor=1,
                                   chunking=pb.CHUNKING_CONTIGUOUS).session_id
            c.append_layers(sid, 0, k, v)
            block = c.select(sid, 3, np.ones((QH, D), np.float32), budget_tokens=256).heads[0].blocks[0]
            keys, _ = c.view(block, head_dim=D)
            p = list(block.positions)
            np.testing.assert_array_equal(keys, k[3, 0, p[0]:p[-1] + 1])
            return block.segment_id

        before = first_block(*make_kv(rng, 300))
        a.proc.kill()
        a.proc.wait()
        a.killed = True
        b = type(a)(tmp_path / "d0", "--instance", a.instance)  # its socket, its instance
        try:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                try:
                    if c.health():
                        break
                except kvtier.KvTierError:
                    time.sleep(0.05)
            assert first_block(*make_kv(rng, 300)) == before, "the scenario needs the id reused"
        finally:
            assert b.stop() == 0, b.log.read_text()


def test_an_attached_worker_s_leases_end_when_its_process_dies(daemon, tmp_path):
    """Leases of ten minutes: the attached worker's end as soon as it is killed; an unattached
    worker's stay until released (the TTL is the only end it has)."""
    rng = np.random.default_rng(8)
    k, v = make_kv(rng, 1000)
    with kvtier.Client(daemon.address, attach=False) as c:
        sid = c.create_session(L, QH, KVH, D).session_id
        c.append_layers(sid, 0, k, v)

        worker, lease = start_worker(tmp_path, daemon.address, sid, attach=True, lease_ms=600000)
        assert pinned(c) > 0
        assert c.list_sessions()[0].active_leases == 1
        worker.kill()
        worker.wait()
        assert wait_unpinned(c, 5), "the dead worker's leases outlived its connection"
        assert c.list_sessions()[0].active_leases == 0
        with pytest.raises(kvtier.KvTierError) as e:
            c.release(lease)
        assert e.value.code == grpc.StatusCode.NOT_FOUND

        worker, lease = start_worker(tmp_path, daemon.address, sid, attach=False, lease_ms=600000)
        worker.kill()
        worker.wait()
        time.sleep(1)
        assert pinned(c) > 0, "an unattached worker's lease ends only by release or TTL"
        c.release(lease)
        assert pinned(c) == 0


def test_worker_ids_are_checked_and_close_ends_the_leases(daemon):
    rng = np.random.default_rng(9)
    k, v = make_kv(rng, 300)
    q = np.ones((QH, D), np.float32)
    with kvtier.Client(daemon.address) as admin, \
            kvtier.Client(daemon.address, tenant="other") as other:
        sid = admin.create_session(L, QH, KVH, D).session_id
        admin.append_layers(sid, 0, k, v)
        wid = other.worker_id()
        assert wid.startswith("w-")
        request = pb.SelectRequest(session_id=sid, layer=3, query=q.tobytes(), worker_id=wid)
        with pytest.raises(kvtier.KvTierError) as e:  # another tenant's worker: as if none
            admin._unary("Select", request)
        assert e.value.code == grpc.StatusCode.NOT_FOUND
        assert "worker_id" in e.value.message
        request.worker_id = "w-1-0000000000000000"
        with pytest.raises(kvtier.KvTierError) as e:
            admin._unary("Select", request)
        assert e.value.code == grpc.StatusCode.NOT_FOUND

        worker = kvtier.Client(daemon.address)
        worker.select(sid, 3, q, lease_ms=600000)
        assert pinned(admin) > 0
        worker.close()
        assert wait_unpinned(admin, 5), "close() ended the stream, and with it the lease"


def test_a_select_ends_the_leases_it_names(daemon):
    rng = np.random.default_rng(10)
    k, v = make_kv(rng, 300)
    q = np.ones((QH, D), np.float32)
    with kvtier.Client(daemon.address) as c:
        sid = c.create_session(L, QH, KVH, D).session_id
        c.append_layers(sid, 0, k, v)
        first = c.select(sid, 3, q)
        second = c.select(sid, 3, q, release_lease_ids=[first.lease_id])
        with pytest.raises(kvtier.KvTierError) as e:  # ended with the second Select
            c.release(first.lease_id)
        assert e.value.code == grpc.StatusCode.NOT_FOUND
        with pytest.raises(kvtier.KvTierError) as e:  # checked first: nothing selected
            c.select(sid, 3, q, release_lease_ids=[second.lease_id, "no-such-lease"])
        assert e.value.code == grpc.StatusCode.NOT_FOUND
        assert "release_lease_ids[1]" in e.value.message
        with pytest.raises(kvtier.KvTierArgumentError):
            c.select(sid, 3, q, release_lease_ids=second.lease_id)  # a string, not a list
        c.release(second.lease_id)  # still live


def test_a_stale_handle_is_reported_not_read(client):
    rng = np.random.default_rng(8)
    k, v = make_kv(rng, 200)
    keep = client.create_session(L, QH, KVH, D, lossless=True).session_id
    client.append_layers(keep, 0, k, v)  # keeps the segment mapped in the daemon
    a = client.create_session(L, QH, KVH, D, lossless=True).session_id
    client.append_layers(a, 0, k, v)
    sel = client.select(a, L - 1, rng.standard_normal((QH, D)), budget_tokens=1000)
    pos, hk, _ = client.gather(sel.heads[0], a)
    np.testing.assert_array_equal(hk, k[L - 1, 0][pos])
    client.release(sel.lease_id)
    client.close_session(a)
    b = client.create_session(L, QH, KVH, D, lossless=True).session_id
    client.append_layers(b, 0, k[:, :, ::-1].copy(), v)  # other bytes in the reused slots
    with pytest.raises(kvtier.KvTierError) as e:
        client.gather(sel.heads[0], head_dim=D)
    assert e.value.code == grpc.StatusCode.ABORTED
    assert "stale handle" in str(e.value)


def test_segment_gather_reads_a_selection_in_one_pass_exactly(client, monkeypatch):
    """SegmentMap.gather reads mapped handles (whole chunks, refined rows, gathered blocks) by
    its one-pass path, and gives the rows the session holds; a handle whose slot is reused
    between the copy and the check after it is ABORTED, never returned."""
    rng = np.random.default_rng(12)
    k, v = make_kv(rng, 1500)
    sid = client.create_session(L, QH, KVH, D, lossless=True, refine_factor=4).session_id
    client.append_layers(sid, 0, k, v, wait_aged=True)
    q = rng.standard_normal((QH, D))
    runs = []
    real = kvtier.SegmentMap._gather_runs
    monkeypatch.setattr(kvtier.SegmentMap, "_gather_runs",
                        lambda self, *a: runs.append(real(self, *a)) or runs[-1])
    for opts in ({"budget_tokens": 1500}, {"budget_tokens": 256},
                 {"budget_tokens": 256, "row_handles": False}):
        sel = client.select(sid, 2, q, **opts)
        client.segments.gather(sel.heads[0].blocks, D)  # maps the segments it names
        for head in sel.heads:
            runs.clear()
            hk, hv = client.segments.gather(head.blocks, D)
            assert runs and runs[0] is not None, "the one-pass path was not taken"
            pos = np.concatenate([np.asarray(b.positions)[list(b.rows)] if b.rows
                                  else np.asarray(b.positions) for b in head.blocks])
            assert len(pos) == len(hk) == opts["budget_tokens"]
            np.testing.assert_array_equal(hk, k[2, head.kv_head][pos])
            np.testing.assert_array_equal(hv, v[2, head.kv_head][pos])
        client.release(sel.lease_id)
    # The slots change after the copy, before the check: the session closed, its slots
    # reused by another session's rows.
    keep = client.create_session(L, QH, KVH, D, lossless=True).session_id
    client.append_layers(keep, 0, k, v)  # keeps the segment in the daemon
    a = client.create_session(L, QH, KVH, D, lossless=True).session_id
    client.append_layers(a, 0, k, v, wait_aged=True)  # no slot changes but the test's own
    sel = client.select(a, L - 1, q, budget_tokens=1000)
    client.segments.gather(sel.heads[0].blocks, D)
    client.release(sel.lease_id)
    stale = kvtier.SegmentMap._stale
    looks = []

    def reuse_after_the_copy(probes):
        looks.append(1)
        if len(looks) == 2:  # the look after the copy
            client.close_session(a)
            b = client.create_session(L, QH, KVH, D, lossless=True).session_id
            client.append_layers(b, 0, k[:, :, ::-1].copy(), v)
        return stale(probes)

    monkeypatch.setattr(kvtier.SegmentMap, "_stale", staticmethod(reuse_after_the_copy))
    runs.clear()
    with pytest.raises(kvtier.KvTierError) as e:
        client.segments.gather(sel.heads[0].blocks, D)
    assert len(looks) == 2 and runs == [], "not raised by the one-pass path's second look"
    assert e.value.code == grpc.StatusCode.ABORTED
    assert "stale handle" in str(e.value)


def test_the_client_trusts_no_segment_the_daemon_names(client, monkeypatch):
    # A daemon (or whoever answers on its socket) that names a path, a link or a file smaller
    # than it claims gets an error naming the segment, never another file's bytes or a SIGBUS.
    small = f"/dev/shm/kvtier-trust-{os.getpid()}"
    link = f"/dev/shm/kvtier-trustlink-{os.getpid()}"
    with open(small, "wb") as f:
        f.write(b"\x01" * 4096)
    os.symlink("/etc/passwd", link)
    try:
        segments = {
            1: ("/kvtier-x/../../../etc/passwd", 4096),
            2: ("../etc/passwd", 4096),
            3: (link[len("/dev/shm"):], 4096),
            4: (small[len("/dev/shm"):], 1 << 20),
            5: (small[len("/dev/shm"):], 4096),
        }

        def listed():
            return [pb.Segment(segment_id=i, shm_name=n, size_bytes=b)
                    for i, (n, b) in segments.items()]

        monkeypatch.setattr(client, "list_segments", listed)
        for seg, code in [(1, grpc.StatusCode.FAILED_PRECONDITION),
                          (2, grpc.StatusCode.FAILED_PRECONDITION),
                          (3, grpc.StatusCode.NOT_FOUND),
                          (4, grpc.StatusCode.FAILED_PRECONDITION)]:
            with pytest.raises(kvtier.KvTierError) as e:
                client.segments.halves(seg)
            assert e.value.code == code, (seg, e.value)
            assert f"segment {seg}" in e.value.message
        assert client.segments.halves(5).nbytes == 4096
        # A handle past the end, even by a wrapping 64-bit sum, is refused.
        far = pb.BlockHandle(segment_id=5, offset=(1 << 64) - 8, length=16, num_tokens=2)
        with pytest.raises(kvtier.KvTierError) as e:
            client.segments.view(far, head_dim=2)
        assert e.value.code == grpc.StatusCode.OUT_OF_RANGE
    finally:
        os.unlink(small)
        os.unlink(link)


def test_errors_carry_code_and_field(client):
    sid = client.create_session(L, QH, KVH, D).session_id
    with pytest.raises(kvtier.KvTierError) as e:
        client.create_session(L, 4, 3, D)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "num_q_heads" in e.value.message
    with pytest.raises(kvtier.KvTierError) as e:
        client.select("missing", 0, np.zeros((QH, D)))
    assert e.value.code == grpc.StatusCode.NOT_FOUND
    with pytest.raises(kvtier.KvTierError) as e:
        client.select(sid, 0, np.zeros((QH + 1, D)))
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "query" in e.value.message
    gap = np.zeros((KVH, 2, D), np.float16)
    with pytest.raises(kvtier.KvTierError) as e:
        client.append_kv(sid, [(0, 5, gap, gap)])
    assert e.value.code == grpc.StatusCode.OUT_OF_RANGE
    with pytest.raises(kvtier.KvTierError) as e:
        client.release("l-0-nothing")
    assert e.value.code == grpc.StatusCode.NOT_FOUND
    other = kvtier.Client(client.address, tenant="someone-else")
    with pytest.raises(kvtier.KvTierError) as e:
        other.evict(sid, "device")
    assert e.value.code == grpc.StatusCode.PERMISSION_DENIED
    other.close()


def test_fork_read_chunks_and_admin(client):
    rng = np.random.default_rng(3)
    k, v = make_kv(rng, 100)
    sid = client.create_session(L, QH, KVH, D, session_id="parent", labels={"team": "a"},
                                lossless=True).session_id
    client.append_layers(sid, 0, k, v)
    child = client.fork_session(sid, 40, "child").session_id
    assert client.describe_session(child).info.num_tokens == 40
    chunks = client.list_chunks(child, layer=2)
    assert chunks.total == KVH * 3
    got = client.read_chunks(child, [c.chunk_id for c in chunks.chunks])
    by_head = {}
    for h in got:
        by_head.setdefault(h.kv_head, []).append(h)
    for head, handles in by_head.items():
        keys = np.concatenate([np.frombuffer(h.keys, np.float16).reshape(-1, D) for h in handles])
        np.testing.assert_array_equal(keys, k[2, head, :40])
    infos = {s.session_id: s for s in client.list_sessions()}
    assert set(infos) == {"parent", "child"} and infos["parent"].labels["team"] == "a"
    tiers = {t.tier: t for t in client.tier_stats()}
    assert tiers[pb.TIER_HOST].used_bytes > 0 and tiers[pb.TIER_DEVICE].emulated
    assert client.set_policy(sid, recent_window=128).recent_window == 128
    assert client.health()
    assert client.close_session(child) and not client.close_session(child)


def test_reflection_lists_the_services(daemon):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
    with grpc.insecure_channel(daemon.address) as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        req = reflection_pb2.ServerReflectionRequest(list_services="")
        resp = next(stub.ServerReflectionInfo(iter([req]), timeout=10))
        names = {s.name for s in resp.list_services_response.service}
    assert {"kvtier.v1.KvTier", "grpc.health.v1.Health"} <= names


def test_kvtierctl_json_and_exit_codes(daemon, client, kvtierctl):
    rng = np.random.default_rng(4)
    k, v = make_kv(rng, 50)
    sid = client.create_session(L, QH, KVH, D, session_id="ctl").session_id
    client.append_layers(sid, 0, k, v)
    out = kvtierctl(daemon.address, "-o", "json", "sessions")
    assert out.returncode == 0, out.stderr
    sessions = json.loads(out.stdout)["sessions"]
    assert sessions[0]["session_id"] == "ctl" and sessions[0]["num_tokens"] == "50"
    tiers = json.loads(kvtierctl(daemon.address, "-o", "json", "tiers").stdout)["tiers"]
    assert {t["tier"] for t in tiers} == {"TIER_DEVICE", "TIER_HOST"}
    chunks = json.loads(kvtierctl(daemon.address, "-o", "json", "chunks", "ctl").stdout)
    assert int(chunks["total"]) == L * KVH * 4
    segs = json.loads(kvtierctl(daemon.address, "-o", "json", "segments").stdout)["segments"]
    assert all(os.path.exists("/dev/shm/" + s["shm_name"].lstrip("/")) for s in segs)
    bad = kvtierctl(daemon.address, "session", "nope")
    assert bad.returncode == 1 and "NOT_FOUND" in bad.stderr and "nope" in bad.stderr
    down = kvtierctl("unix:/nonexistent/kvtier.sock", "health")
    assert down.returncode == 1 and "UNAVAILABLE" in down.stderr


def scrape(port):
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()


def test_metrics_endpoint(start_daemon):
    port = free_port()
    d = start_daemon("--metrics_port", str(port))
    with kvtier.Client(d.address) as c:
        sid = c.create_session(L, QH, KVH, D).session_id
        k, v = make_kv(np.random.default_rng(5), 40)
        c.append_layers(sid, 0, k, v, channel=False)  # one stream: the only channel is below
        c.select(sid, 3, np.ones((QH, D)), budget_tokens=256)
        body = scrape(port)
        assert "kvtier_leases 1" in body
        assert "kvtier_workers_attached 1" in body
        assert "kvtier_channels_open 0" in body
        with c.open_channel() as ch:
            for _ in range(3):
                ch.release(ch.select(sid, 3, np.ones((QH, D)), budget_tokens=256).lease_id)
            channels = scrape(port)
        assert "kvtier_channels_open 1" in channels
        # Six calls, each counted once, by where the channel's thread was.
        served = re.findall(r'kvtier_channel_calls_total\{served="(\w+)"\} (\d+)', channels)
        assert sorted(k for k, _ in served) == ["beside_worker", "elsewhere"], served
        assert sum(int(n) for _, n in served) == 6, served
    assert 'kvtier_rpc_total{code="OK",method="Select"} 1' in body
    assert 'kvtier_appended_tokens_total{tenant="default"} 160' in body
    assert 'kvtier_tier_used_bytes{tier="host"} 147456' in body  # 4 x 3 x 3 slots of 4 KiB
    assert "# TYPE kvtier_rpc_latency_seconds histogram" in body
    assert "# TYPE kvtier_aging_backlog_tokens gauge" in body  # the aging pool's
    assert "# TYPE kvtier_aging_tasks_total counter" in body
    assert "kvtier_aging_pressed_tasks_total 0" in body  # no append waited on its backlog
    # The client closed: its Attach stream ended, and its lease with it.
    deadline = time.monotonic() + 5
    while "kvtier_leases 0" not in body and time.monotonic() < deadline:
        time.sleep(0.05)
        body = scrape(port)
    assert "kvtier_leases 0" in body
    assert "kvtier_workers_attached 0" in body


def test_the_daemon_s_own_log_lines(start_daemon):
    """kvtierd's stderr as an operator reads it: logfmt with ts= in UTC, the start-up line
    with the version and every backend, failed calls (an Attach among them) at info with
    their code, values quoted where they need it; and the same events as JSON lines."""
    d = start_daemon("--log_level", "info")
    with kvtier.Client(d.address) as c, pytest.raises(kvtier.KvTierError):
        c.describe_session("no such session")
    with kvtier.Client(d.address, tenant="not a tenant") as bad, \
            pytest.raises(kvtier.KvTierError, match="INVALID_ARGUMENT"):
        bad.worker_id()  # the Attach stream is refused
    assert d.stop() == 0
    lines = d.log.read_text().splitlines()
    ts = r"ts=\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z level=(debug|info|warning|error)"
    ours = [line for line in lines if line.startswith("ts=")]
    assert ours and all(re.match(ts + r" event=[a-z_.]+( |$)", line) for line in ours), ours
    start = next(line for line in ours if " event=daemon.start " in line)
    for field in (r"version=\d+\.\d+\.\d+", "listen=unix:", 'tcp_listen="" tcp=none',
                  "segments=named", "device=emulated", "remote=none", r"aging_threads=\d+",
                  "aging_priority=(idle|nice10)", "prefetch=on", "channel_colocate=on"):
        assert re.search(field, start), (field, start)
    errors = [line for line in ours if " event=rpc.error " in line]
    assert any("level=info" in e and "method=DescribeSession" in e and "code=NOT_FOUND" in e
               and 'message="' in e for e in errors), errors
    assert any("method=Attach" in e for e in errors), errors
    j = start_daemon("--log_level", "info", "--log_format", "json")
    with kvtier.Client(j.address) as c, pytest.raises(kvtier.KvTierError):
        c.describe_session("no such session")
    assert j.stop() == 0
    events = [json.loads(line) for line in j.log.read_text().splitlines()
              if line.startswith("{")]
    assert events and all(e["ts"].endswith("Z") for e in events)
    assert any(e["event"] == "daemon.start" and e["device"] == "emulated" for e in events)
    assert any(e["event"] == "rpc.error" and e["code"] == "NOT_FOUND" for e in events)


def test_sigterm_cleans_up(start_daemon):
    d = start_daemon()
    with kvtier.Client(d.address) as c:
        sid = c.create_session(L, QH, KVH, D).session_id
        k, v = make_kv(np.random.default_rng(6), 40)
        c.append_layers(sid, 0, k, v)
    assert any(n.startswith(f"kvtier-{d.instance}-") for n in os.listdir("/dev/shm"))
    assert d.stop() == 0
    assert not d.socket.exists()
    assert not any(n.startswith(f"kvtier-{d.instance}-") for n in os.listdir("/dev/shm"))


def test_client_side_mistakes_name_their_argument(daemon):
    c = kvtier.Client(daemon.address)
    with pytest.raises(kvtier.KvTierArgumentError, match="^INVALID_ARGUMENT: dtype: 'fp8'"):
        c.create_session(num_layers=1, num_q_heads=1, num_kv_heads=1, head_dim=8, dtype="fp8")
    sid = c.create_session(num_layers=2, num_q_heads=2, num_kv_heads=1, head_dim=8).session_id
    k = np.ones((1, 4, 8), np.float16)
    # A 2-D array among the items: refused before the stream starts, nothing of it applied.
    with pytest.raises(kvtier.KvTierArgumentError, match=r"items\[1\]\.keys: shape \(4, 8\)") as e:
        c.append_kv(sid, [(0, 0, k, k), (1, 0, k[0], k[0])])
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and e.value.argument == "items[1].keys"
    assert isinstance(e.value, ValueError)
    assert c.describe_session(sid).info.num_tokens == 0  # item 0 was not sent either
    with pytest.raises(kvtier.KvTierArgumentError, match=r"items\[0\]\.keys: dtype float32"):
        c.append_kv(sid, [(0, 0, k.astype(np.float32), k.astype(np.float32))])
    with pytest.raises(kvtier.KvTierArgumentError, match=r"^INVALID_ARGUMENT: keys: shape"):
        c.append_layers(sid, 0, k, k)  # 3-D where [layers][kv_heads][tokens][d] is wanted
    with pytest.raises(kvtier.KvTierArgumentError, match="placement: 'gpu' is not one of"):
        c.select(sid, 0, np.ones((2, 8), np.float32), placement="gpu")
    with pytest.raises(kvtier.KvTierArgumentError, match="tls_ca: cannot read /nonexistent"):
        kvtier.Client("localhost:1", tls_ca="/nonexistent/ca.pem")
    with pytest.raises(kvtier.KvTierArgumentError, match="tier: 'disk'"):
        c.evict(sid, tier="disk")
    # Every other way a call's arguments can be wrong: the argument named, nothing sent.
    q = np.ones((2, 8), np.float32)
    cases = [
        ("bogus", lambda: c.create_session(1, 1, 1, 8, bogus=1)),
        ("num_layers", lambda: c.create_session("2", 1, 1, 8)),
        ("sink_tokens", lambda: c.create_session(1, 1, 1, 8, sink_tokens="x")),
        ("labels", lambda: c.create_session(1, 1, 1, 8, labels=[1])),
        ("bogus", lambda: c.set_policy(sid, bogus=1)),
        ("layer", lambda: c.list_chunks(sid, layer="x")),
        ("lease_id", lambda: c.release(5)),
        ("segment_ids", lambda: c.open_segments("x")),
        ("chunk_ids", lambda: c.read_chunks(sid, 5)),
        ("items", lambda: c.append_kv(sid, None)),
        ("items[0].layer", lambda: c.append_kv(sid, [("a", 0, k, k)])),
        ("items[0].token_ids", lambda: c.append_kv(sid, [(0, 0, k, k, 5)])),
        ("keys", lambda: c.append_layers(sid, 0, k.tolist(), k.tolist())),
        ("query", lambda: c.select(sid, 0, "abc")),
        ("layer", lambda: c.select(sid, "x", q)),
        ("requests[0]", lambda: c.batch_select([5])),
        ("address", lambda: kvtier.Client(None)),
        ("timeout", lambda: kvtier.Client(daemon.address, timeout="a")),
    ]
    for argument, call in cases:
        with pytest.raises(kvtier.KvTierArgumentError) as e:
            call()
        assert e.value.argument == argument, (argument, e.value)
        assert e.value.message.startswith(argument + ":"), e.value.message
    assert c.describe_session(sid).info.num_tokens == 0
    with c.open_channel() as ch:
        with pytest.raises(kvtier.KvTierArgumentError) as e:
            ch.select(sid, 0, q, bogus=1)
        assert e.value.argument == "bogus"
    # Inline bytes read with the wrong head_dim.
    c.append_kv(sid, [(1, 0, k, k)], wait_aged=True)
    inline = c.select(sid, 1, q, budget_tokens=64, include_data=True)
    with pytest.raises(kvtier.KvTierArgumentError) as e:
        c.gather(inline.heads[0], head_dim=5)
    assert e.value.argument == "head_dim"
    c.release(inline.lease_id)


def test_asyncio_client_names_bad_arguments_and_has_the_admin_calls(daemon):
    import asyncio

    import kvtier.aio

    async def run():
        async with kvtier.aio.Client(daemon.address) as c:
            for argument, call in [("bogus", c.create_session(1, 1, 1, 8, bogus=1)),
                                   ("keys", c.append_layers("s", 0, [[1]], [[1]])),
                                   ("requests[0]", c.batch_select([5])),
                                   ("lease_id", c.release(5))]:
                with pytest.raises(kvtier.KvTierArgumentError) as e:
                    await call
                assert e.value.argument == argument
            sid = (await c.create_session(2, 2, 1, 8)).session_id
            k = np.ones((1, 40, 8), np.float16)
            await c.append_kv(sid, [(0, 0, k, k), (1, 0, k, k)], wait_aged=True)
            assert await c.health()
            assert (await c.set_policy(sid, default_budget=32)).default_budget == 32
            chunks = await c.list_chunks(sid, layer=1)
            assert chunks.chunks and all(ch.layer == 1 for ch in chunks.chunks)
            handles = await c.read_chunks(sid, [chunks.chunks[0].chunk_id])
            assert handles[0].chunk_id == chunks.chunks[0].chunk_id
            fork = await c.fork_session(sid, num_tokens=16)
            assert (await c.describe_session(fork.session_id)).info.num_tokens == 16
            assert await c.list_segments() and await c.tier_stats()
            assert await c.evict(sid, "device") == 0
            assert await c.drain() >= 2
    asyncio.run(run())
    assert daemon.proc.wait(timeout=30) == 0


def _normalize(x):
    """JSON of a proto quotes 64-bit integers; YAML of it writes them as numbers."""
    if isinstance(x, dict):
        return {k: _normalize(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_normalize(v) for v in x]
    if isinstance(x, str) and re.fullmatch(r"-?\d+", x):
        return int(x)
    if isinstance(x, float) and x.is_integer():
        return int(x)
    return x


def test_kvtierctl_for_operators(start_daemon, kvtierctl, tmp_path):
    import yaml
    d = start_daemon()
    rng = np.random.default_rng(5)
    k, v = make_kv(rng, 300)
    with kvtier.Client(d.address) as c:
        sid = c.create_session(L, QH, KVH, D, session_id="ops", labels={"team": "a"}).session_id
        c.append_layers(sid, 0, k, v)
        sel = c.select(sid, 1, rng.standard_normal((QH, D)).astype(np.float32),
                       budget_tokens=128, lease_ms=60000)
        # leases: the one just taken, with its pins; yaml says what json says.
        out = kvtierctl(d.address, "-o", "json", "leases", "--session", sid)
        assert out.returncode == 0, out.stderr
        leases = json.loads(out.stdout)
        assert [l["lease_id"] for l in leases["leases"]] == [sel.lease_id]
        assert int(leases["leases"][0]["pinned_bytes"]) > 0 and leases["leases"][0]["worker_id"]
        for args in (["leases"], ["sessions"], ["tiers"], ["session", sid], ["chunks", sid]):
            as_json = json.loads(kvtierctl(d.address, "-o", "json", *args).stdout)
            as_yaml = yaml.safe_load(kvtierctl(d.address, *args, "-o", "yaml").stdout)
            if args[0] == "session":  # last access moves between the two calls
                for doc in (as_json, as_yaml):
                    doc["info"].pop("last_access_unix_ms")
            if args[0] == "sessions":
                for doc in (as_json, as_yaml):
                    for s in doc["sessions"]:
                        s.pop("last_access_unix_ms")
            assert _normalize(as_yaml) == _normalize(as_json), args
        wide = kvtierctl(d.address, "-o", "wide", "leases").stdout
        assert "WORKER" in wide and sel.lease_id in wide
        assert "team=a" in kvtierctl(d.address, "-o", "wide", "sessions").stdout
        # top refreshes: --count 2 shows the tiers and the session twice.
        top = kvtierctl(d.address, "top", "--count", "2", "--interval", "0.1")
        assert top.returncode == 0, top.stderr
        assert top.stdout.count("TIER ") == 2 and top.stdout.count("ops ") == 2, top.stdout
        # top as one document: its tiers and busiest sessions, in JSON and in YAML alike.
        top_json = json.loads(kvtierctl(d.address, "-o", "json", "top", "--count", "1").stdout)
        top_yaml = yaml.safe_load(kvtierctl(d.address, "-o", "yaml", "top", "--count", "1").stdout)
        assert [s["session_id"] for s in top_json["busiest"]["sessions"]] == ["ops"]
        assert {t["tier"] for t in top_yaml["tiers"]["tiers"]} == {"TIER_DEVICE", "TIER_HOST"}
        watched = kvtierctl(d.address, "-o", "json", "sessions", "--watch", "--count", "2",
                            "--interval", "0.1")
        assert watched.stdout.count('"session_id": "ops"') == 2
        assert "\033" not in watched.stdout
        # As a document, top runs once unless told to watch (it ran forever); YAML documents
        # watched are apart.
        once = kvtierctl(d.address, "-o", "json", "top")
        assert once.returncode == 0 and json.loads(once.stdout)["busiest"]["sessions"]
        docs = list(yaml.safe_load_all(kvtierctl(d.address, "-o", "yaml", "sessions", "--watch",
                                                 "--count", "2", "--interval", "0.1").stdout))
        assert len(docs) == 2 and all(x["sessions"][0]["session_id"] == "ops" for x in docs)
        c.release(sel.lease_id)
        assert json.loads(kvtierctl(d.address, "-o", "json", "leases").stdout)["leases"] == []
        # evict: off the device tier (nothing there: 0 bytes), and a bad tier is usage.
        ev = kvtierctl(d.address, "-o", "json", "evict", sid, "--tier", "device")
        assert ev.returncode == 0 and json.loads(ev.stdout)["bytes_moved"] == "0"
        assert kvtierctl(d.address, "evict", sid, "--tier", "disk").returncode == 2
    # Usage and help.
    version = kvtierctl(d.address, "--version")
    assert version.returncode == 0 and re.fullmatch(r"kvtierctl \d+\.\d+\.\d+\n", version.stdout)
    assert kvtierctl(d.address, "--timeout", "0", "health").returncode == 2
    assert kvtierctl(d.address, "--timeout", "nan", "health").returncode == 2  # Range passes NaN
    # Usage only a look after parsing finds is usage too, named by the flags.
    bad_tls = kvtierctl(d.address, "--tls-cert", "/x.pem", "--tls-key", "/x.key", "health")
    assert bad_tls.returncode == 2 and "--tls-cert needs --tls-ca" in bad_tls.stderr
    assert kvtierctl(d.address, "--token-file", "/nonexistent/token", "health").returncode == 2
    assert kvtierctl(d.address, "sessions", "-w", "--interval", "nan").returncode == 2
    assert kvtierctl(d.address, "nosuchcommand").returncode == 2
    script = kvtierctl(d.address, "completion", "bash").stdout
    assert "complete -F _kvtierctl kvtierctl" in script and " leases " in script
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
    down = kvtierctl("unix:/nonexistent/kvtier.sock", "health")
    assert down.returncode == 1 and "hint: no kvtierd answered" in down.stderr
    # drain: the daemon (its uid's caller is an admin) stops and exits 0.
    dr = kvtierctl(d.address, "drain")
    assert dr.returncode == 0 and "draining" in dr.stdout
    assert d.proc.wait(timeout=30) == 0


def test_an_idle_connected_client_does_not_hold_the_drain(start_daemon):
    # A blocking client between calls does not read the daemon's GOAWAY: once nothing is in
    # flight, the daemon cuts such connections instead of waiting its drain timeout for them.
    d = start_daemon("--drain_timeout_ms", "120000")
    c = kvtier.Client(d.address)
    sid = c.create_session(num_layers=1, num_q_heads=1, num_kv_heads=1, head_dim=8).session_id
    assert d.stop() == 0  # stop() waits 30 s at most, a quarter of the drain timeout
    with pytest.raises(kvtier.KvTierError) as e:  # the daemon is gone, and so is the connection
        c.describe_session(sid)
    assert e.value.code == grpc.StatusCode.UNAVAILABLE


def test_asyncio_client_equals_the_sync_one(daemon):
    import asyncio

    import kvtier.aio
    rng = np.random.default_rng(9)
    k, v = make_kv(rng, 300)
    q = rng.standard_normal((QH, D)).astype(np.float32)

    async def run():
        async with kvtier.aio.Client(daemon.address) as c:
            sid = (await c.create_session(L, QH, KVH, D, session_id="aio")).session_id
            # Aged before the reply, so that both clients read the same final chunks.
            assert await c.append_layers(sid, 0, k, v, wait_aged=True) == 300
            with pytest.raises(kvtier.KvTierArgumentError, match=r"items\[0\]\.keys"):
                await c.append_kv(sid, [(0, 300, k[0, 0], v[0, 0])])
            # Several Selects at once on one channel.
            sels = await asyncio.gather(*[c.select(sid, layer, q, budget_tokens=128)
                                          for layer in range(L)])
            got = [await c.gather(s.heads[0], sid) for s in sels]
            # A view of a handle is its chunk's rows, as gather copied them.
            first = sels[L - 1].heads[0].blocks[0]
            kview, _ = await c.view(first, sid)
            n = len(first.rows) or first.num_tokens
            rows = list(first.rows) or list(range(n))
            np.testing.assert_array_equal(kview[rows], got[L - 1][1][:n])
            assert (await c.list_leases(sid)).total == L
            for s in sels:
                await c.release(s.lease_id)
            with pytest.raises(kvtier.KvTierError) as e:
                await c.describe_session("nope")
            assert e.value.code == grpc.StatusCode.NOT_FOUND
            return sid, got

    sid, got = asyncio.run(run())
    with kvtier.Client(daemon.address) as c:
        for layer in range(L):
            sel = c.select(sid, layer, q, budget_tokens=128)
            pos, kk, vv = c.gather(sel.heads[0], sid)
            np.testing.assert_array_equal(pos, got[layer][0])
            np.testing.assert_array_equal(kk, got[layer][1])
            np.testing.assert_array_equal(vv, got[layer][2])
            c.release(sel.lease_id)


def test_the_public_api_is_documented():
    import inspect

    import kvtier.aio
    import kvtier.daemon
    classes = [kvtier.Client, kvtier.aio.Client, kvtier.SegmentMap, kvtier.SelectChannel,
               kvtier.Staging, kvtier.client.SessionHandle, kvtier.daemon.LocalDaemon,
               kvtier.KvTierError, kvtier.KvTierArgumentError]
    try:
        import kvtier.integrations.transformers as hf
        classes.append(hf.KvTierCache)
    except ImportError:  # transformers is not installed
        pass
    for cls in classes:
        assert (cls.__doc__ or "").strip(), cls.__name__
        undocumented = [n for n, f in inspect.getmembers(cls, inspect.isfunction)
                        if not n.startswith("_") and f.__qualname__.startswith(cls.__name__)
                        and not (f.__doc__ or "").strip()]
        assert not undocumented, (cls.__name__, undocumented)


def assert_stored_exactly(c, sid, select, k, v):
    """Every layer's rows, selected whole by `select` (a budget past the context) and read
    through shared memory, are k and v ([layers][kv_heads][tokens][head_dim]) bit for bit."""
    for layer in range(L):
        r = select(sid, layer, np.ones((QH, D)), budget_tokens=1024)
        for h, head in enumerate(r.heads):
            pos, hk, hv = c.gather(head, sid)
            order = np.argsort(pos)
            assert pos[order].tolist() == list(range(k.shape[2]))
            assert np.array_equal(hk[order].view(np.uint16), k[layer, h].view(np.uint16))
            assert np.array_equal(hv[order].view(np.uint16), v[layer, h].view(np.uint16))
        c.release(r.lease_id)


def test_select_channel_appends_store_the_bytes_appended(start_daemon):
    """A prefill and then a decode loop's per-layer appends through the channel store exactly
    the bytes appended (read back through a Select and shared memory); an append the daemon
    refuses gets the RPC's error, and one that is malformed is refused before it is sent."""
    d = start_daemon()
    k, v = make_kv(np.random.default_rng(27), 320)
    with kvtier.Client(d.address, tenant="alice") as c:
        sid = c.create_session(L, QH, KVH, D, lossless=True).session_id
        with c.open_channel() as ch:
            for layer in range(L):
                got = ch.append(sid, layer, 0, k[layer, :, :300], v[layer, :, :300])
                assert got == (300 if layer == L - 1 else 0)  # stored in every layer
            for t in range(300, 320):
                for layer in range(L):
                    ch.append(sid, layer, t, k[layer, :, t:t + 1], v[layer, :, t:t + 1],
                              wait_aged=True)
            assert c.describe_session(sid).info.num_tokens == 320
            assert_stored_exactly(c, sid, ch.select, k, v)
            with pytest.raises(kvtier.KvTierError) as e:
                ch.append(sid, L, 320, k[0, :, :1], v[0, :, :1])  # no such layer
            assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert "layer" in e.value.message
            with pytest.raises(kvtier.KvTierArgumentError):
                ch.append(sid, 0, 320, k[0, :, :1], v[0, :, :2])
            assert c.describe_session(sid).info.num_tokens == 320


def test_append_layers_sends_a_decode_steps_tokens_through_a_channel(start_daemon):
    """On a Unix socket append_layers sends a few tokens (a decode step's) layer by layer
    through the client's own channel, and a prefill's many as one stream; both store exactly
    the bytes appended. A channel that broke is replaced, its append streamed instead."""
    d = start_daemon()
    k, v = make_kv(np.random.default_rng(28), 200)
    with kvtier.Client(d.address, tenant="alice") as c:
        sid = c.create_session(L, QH, KVH, D, lossless=True).session_id
        assert c.append_layers(sid, 0, k[:, :, :100], v[:, :, :100]) == 100
        assert c._append_channel is None  # 100 tokens: one stream
        for t in range(100, 110):
            assert c.append_layers(sid, t, k[:, :, t:t + 1], v[:, :, t:t + 1]) == t + 1
        first = c._append_channel
        assert first is not None
        first.close()  # broken behind the client's back: this append goes as a stream
        assert c.append_layers(sid, 110, k[:, :, 110:150], v[:, :, 110:150]) == 150
        assert c._append_channel is None
        assert c.append_layers(sid, 150, k[:, :, 150:200], v[:, :, 150:200],
                               wait_aged=True) == 200
        assert c._append_channel is not None and c._append_channel is not first
        assert c.append_layers(sid, 190, k[:, :, 190:200], v[:, :, 190:200],
                               channel=False) == 200  # a rewrite of the same bytes: a no-op
        with pytest.raises(kvtier.KvTierError) as e:  # other bytes: the stream's refusal
            c.append_layers(sid, 190, v[:, :, 190:191], k[:, :, 190:191])
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert_stored_exactly(c, sid, c.select, k, v)
