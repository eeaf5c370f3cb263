"""A load test: several worker processes, two tenants, doing mixed append / select / read /
fork / release / close against one kvtierd for a bounded time. Every call is valid, so every
error is unexpected; each worker checks the rows it reads against what it appended; at the
end the tiers hold zero bytes and the daemon's memory has stopped growing."""
import json
import subprocess
import sys
import time
from pathlib import Path

import kvtier
from helpers import rss_kib

WORKER = r"""
import json, sys, time
import numpy as np
sys.path.insert(0, sys.argv[1])
import grpc
import kvtier

address, tenant, seed, seconds = sys.argv[2], sys.argv[3], int(sys.argv[4]), float(sys.argv[5])
L, QH, KVH, D = 4, 4, 2, 64
rng = np.random.default_rng(seed)
c = kvtier.Client(address, tenant=tenant)
ops, errors, checked = {}, [], 0
sessions = {}  # id -> (K, V, tokens, lossless) with K, V [L][KVH][tokens][D]


def count(op):
    ops[op] = ops.get(op, 0) + 1


def new_session():
    lossless = bool(rng.integers(2))
    chunking = str(rng.choice(["contiguous", "semantic", "boundary"]))
    policy = {"lossless": lossless, "recent_window": 32}
    if chunking == "boundary":
        policy["delimiter_token_ids"] = [13]
    chunking_enum = {"contiguous": 1, "boundary": 2, "semantic": 3}[chunking]
    sid = c.create_session(L, QH, KVH, D, chunking=chunking_enum, **policy).session_id
    sessions[sid] = [np.zeros((L, KVH, 0, D), np.float16), np.zeros((L, KVH, 0, D), np.float16),
                     0, lossless]
    count("create")


def append(sid):
    k, v, tokens, lossless = sessions[sid]
    n = int(rng.integers(1, 97))
    nk = rng.standard_normal((L, KVH, n, D)).astype(np.float16)
    nv = rng.standard_normal((L, KVH, n, D)).astype(np.float16)
    ids = [13 if rng.random() < 0.1 else int(rng.integers(100, 1000)) for _ in range(n)]
    assert c.append_kv(sid, ((l, tokens, nk[l], nv[l], ids) for l in range(L))) == tokens + n
    sessions[sid] = [np.concatenate([k, nk], 2), np.concatenate([v, nv], 2), tokens + n,
                     lossless]
    count("append")


def select(sid):
    global checked
    k, v, tokens, lossless = sessions[sid]
    if tokens == 0:
        return
    layer = int(rng.integers(L))
    budget = int(rng.choice([64, 128, 256, 1 << 16]))
    placement = "device" if rng.random() < 0.3 else None
    sel = c.select(sid, layer, rng.standard_normal((QH, D)), budget_tokens=budget,
                   placement=placement, lease_ms=5000)
    count("select")
    for head in sel.heads:
        pos, hk, hv = c.gather(head, sid)
        assert len(set(pos.tolist())) == len(pos), "a row returned twice"
        assert pos.max() < tokens
        if lossless:
            np.testing.assert_array_equal(hk, k[layer, head.kv_head][pos])
            np.testing.assert_array_equal(hv, v[layer, head.kv_head][pos])
            checked += len(pos)
    if rng.random() < 0.8:
        c.release(sel.lease_id)
        count("release")


deadline = time.monotonic() + seconds
while time.monotonic() < deadline:
    try:
        r = rng.random()
        if len(sessions) < 1 or (len(sessions) < 3 and r < 0.05):
            new_session()
            continue
        sid = list(sessions)[int(rng.integers(len(sessions)))]
        if r < 0.35:
            append(sid)
        elif r < 0.8:
            select(sid)
        elif r < 0.85:
            chunks = c.list_chunks(sid, limit=8).chunks
            c.read_chunks(sid, [ch.chunk_id for ch in chunks])
            count("read_chunks")
        elif r < 0.9 and sessions[sid][2] > 0:
            at = int(rng.integers(1, sessions[sid][2] + 1))
            fork = c.fork_session(sid, num_tokens=at).session_id
            k, v, _, lossless = sessions[sid]
            sessions[fork] = [k[:, :, :at].copy(), v[:, :, :at].copy(), at, lossless]
            count("fork")
        elif r < 0.93 or sessions[sid][2] > 1500:
            assert c.close_session(sid)
            del sessions[sid]
            count("close")
        else:
            c.describe_session(sid)
            c.tier_stats()
            count("admin")
    except Exception as e:  # every call is valid: any error is one too many
        errors.append(repr(e)[:300])
        if len(errors) > 20:
            break
for sid in list(sessions):
    c.close_session(sid)
c.close()
print(json.dumps({"ops": ops, "errors": errors, "checked_rows": checked}), flush=True)
"""


def retained_kib(address):
    """Emptied segments each tier keeps mapped for reuse (--retained_segment_size): part of the
    daemon's RSS by design, bounded by each tier's capacity, not a leak."""
    with kvtier.Client(address) as c:
        tiers = c.tier_stats()
    for t in tiers:
        assert t.retained_bytes + t.used_bytes <= t.capacity_bytes or not t.capacity_bytes, t
    return sum(t.retained_bytes for t in tiers) // 1024


def run_workers(tmp_path, address, seconds, seed):
    script = tmp_path / "load_worker.py"
    script.write_text(WORKER)
    lib = str(Path(kvtier.__file__).resolve().parents[1])
    procs = [subprocess.Popen([sys.executable, str(script), lib, address, tenant,
                               str(seed + i), str(seconds)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i, tenant in enumerate(["alpha", "alpha", "beta", "beta"])]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=seconds + 120)
        assert p.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def test_mixed_workers_get_no_unexpected_error_and_leave_nothing_behind(start_daemon, tmp_path):
    d = start_daemon("--host_capacity", "512M", "--device_capacity", "128M",
                     "--segment_size", "16M", "--lease_ttl_ms", "5000")
    # A first round grows the daemon to its working size; the second must not grow it much.
    first = run_workers(tmp_path, d.address, 6, seed=100)
    rss_after_first = rss_kib(d.proc.pid) - retained_kib(d.address)
    second = run_workers(tmp_path, d.address, 10, seed=200)
    for r in first + second:
        print(r["ops"], r["checked_rows"])
        assert r["errors"] == [], r["errors"]
        assert r["ops"].get("select", 0) > 10 and r["ops"].get("append", 0) > 5, r["ops"]
    assert sum(r["checked_rows"] for r in first + second) > 0
    with kvtier.Client(d.address) as c:
        # Leases the workers did not release end at their TTL (5 s) or with their workers.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(
            t.used_bytes or t.metadata_bytes for t in c.tier_stats()
        ):
            time.sleep(0.1)
        assert c.list_sessions() == []
        assert all(t.used_bytes == 0 and t.metadata_bytes == 0 for t in c.tier_stats()), (
            c.tier_stats()
        )
    rss_end = rss_kib(d.proc.pid)
    assert rss_end < 1024 * 1024, f"daemon RSS {rss_end} KiB"
    rss_end -= retained_kib(d.address)
    assert rss_end - rss_after_first < 96 * 1024, \
        f"daemon RSS (less retained segments) grew from {rss_after_first} to {rss_end} KiB " \
        f"in the second round"
