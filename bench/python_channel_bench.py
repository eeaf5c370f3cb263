"""Whole-chunk Select latency through the Python client's shared-memory Select channel
(kvtier.Client.open_channel), against the same through a daemon that does not co-locate the
channel's thread with the worker (--channel_colocate off), in the same run. One JSON line per
figure, as the other benchmarks print them:

  python_channel_select_p50               a Select after a quiet spell (the worker spins 300 us
                                          between calls: the daemon's thread has gone to sleep)
  python_channel_select_p50_back_to_back  Selects one after another

Both daemons hold the same session (a SmolLM2-135M shape, 4096 tokens of random K and V, whole
chunks, budget 256); the runs alternate between them, and each figure is the median over runs
of each run's p50.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "client" / "python"))
from kvtier.client import Client  # noqa: E402
from kvtier.daemon import LocalDaemon  # noqa: E402

LAYERS, QH, KVH, D, TOKENS, BUDGET = 30, 9, 3, 64, 4096, 256


def filled_session(c: Client) -> str:
    sid = c.create_session(LAYERS, QH, KVH, D, refine_factor=1).session_id
    rng = np.random.default_rng(1)
    for start in range(0, TOKENS, 512):
        items = []
        for layer in range(LAYERS):
            k = rng.standard_normal((KVH, 512, D)).astype(np.float16)
            items.append((layer, start, k, k))
        c.append_kv(sid, items, wait_aged=start + 512 >= TOKENS)
    return sid


def p50(channel, sid: str, q: np.ndarray, calls: int, quiet_s: float) -> float:
    took = []
    for i in range(calls + 50):
        if quiet_s > 0:
            until = time.perf_counter() + quiet_s
            while time.perf_counter() < until:
                pass
        t0 = time.perf_counter()
        r = channel.select(sid, LAYERS // 2, q, budget_tokens=BUDGET)
        t1 = time.perf_counter()
        channel.release(r.lease_id)
        if i >= 50:  # warm-up
            took.append((t1 - t0) * 1e6)
    return statistics.median(took)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kvtierd", default=str(ROOT / os.environ.get("KVTIER_BUILD", "build")
                                             / "bin" / "kvtierd"))
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    rng = np.random.default_rng(2)
    q = rng.standard_normal((QH, D)).astype(np.float32)
    with tempfile.TemporaryDirectory() as on_dir, tempfile.TemporaryDirectory() as off_dir, \
            LocalDaemon(args.kvtierd, on_dir) as on, \
            LocalDaemon(args.kvtierd, off_dir, "--channel_colocate", "off") as off, \
            Client(on.address) as con, Client(off.address) as coff:
        sids = {"on": filled_session(con), "off": filled_session(coff)}
        runs = {(mode, kind): [] for mode in ("on", "off") for kind in ("quiet", "b2b")}
        with con.open_channel() as chon, coff.open_channel() as choff:
            channels = {"on": chon, "off": choff}
            for _ in range(args.reps):
                for mode in ("on", "off"):
                    runs[(mode, "quiet")].append(
                        p50(channels[mode], sids[mode], q, args.calls, 300e-6))
                    runs[(mode, "b2b")].append(p50(channels[mode], sids[mode], q, args.calls, 0))
    params = {"client": "python (kvtier.Client.open_channel)", "context_tokens": TOKENS,
              "budget_tokens": BUDGET, "selection": "whole chunks", "shape": "30x9/3x64",
              "calls": args.calls, "reps": args.reps}
    for kind, name, what in (("quiet", "python_channel_select_p50",
                              "each Select after 300 us of the worker's own work"),
                             ("b2b", "python_channel_select_p50_back_to_back",
                              "Selects one after another")):
        value = statistics.median(runs[("on", kind)])
        base = statistics.median(runs[("off", kind)])
        print(json.dumps({"name": name, "value": round(value, 3), "unit": "us",
                          "baseline": round(base, 3), "baseline_name": "channel_colocate_off",
                          "ratio": round(value / base, 4),
                          "parameters": {**params, "path": what, "target_ratio": "reported"}}),
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
