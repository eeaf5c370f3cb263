#!/usr/bin/env python3
"""Which chunk ranking keeps the most attention mass? Compared against the chunk oracle on
the real model's tensors (a dump of bench/model/dump.py) and on synthetic clustered keys.

For every (layer, query position, KV head), chunks of 16 tokens wholly before the recent
window and after the sinks are ranked by each candidate score, the best k are kept (k fills
the budget left after 16 sinks and a budget/4 window), and the mass they hold (softmax over
the full context, averaged over the head's query group) is divided by the mass of the best
k chunks by true mass (the chunk oracle). Scores, max over the group's query heads q:
  mean        q.mu                              (mu: the chunk's mean key)
  box         sum_j max(q_j lo_j, q_j hi_j)     (Quest's page bound)
  ball        q.mu + |q| r                      (r: max distance of a key from mu)
  mean+var    q.mu + (q^2 . var) / (2 sqrt(d))  (second-order estimate of log sum exp)
  max(mean,peak)  max(q.mu, q.k_peak)               (k_peak: the key farthest from mu)
  lse-peak    log(15 e^(q.mu/sqrt d) + e^(q.k_peak/sqrt d))
  lse-peak-int8   the same over mu and k_peak as kvtierd keeps them once aged: signed bytes
                  times each vector's largest magnitude / 127
  lse-peak-int8q  and against the query as kvtierd ranks with it: each head's values on the
                  grid of the smallest power of two p with every |q_j| <= 127 p
  max         max_k q.k                          (the true best key: needs every key)
Prints one JSON line per (source, budget, score) with the mean and 10th percentile ratio.

usage: bench/ranking/compare.py --dump bench/out/qkv.npz [--synthetic] [--budgets 128,256]
"""
from __future__ import annotations

import argparse
import json
import sys

import numpy as np

CHUNK, SINKS = 16, 16
SCORES = ["mean", "box", "ball", "mean+var", "max(mean,peak)", "lse-peak", "lse-peak-int8",
          "lse-peak-int8q", "max"]


def int8_rows(x: np.ndarray) -> np.ndarray:
    """Each row as kvtierd's compact statistics hold it: bytes times its largest magnitude / 127."""
    top = np.abs(x).max(axis=-1, keepdims=True)
    step = np.where(top > 0, top / 127.0, 1.0)
    return np.round(x / step) * step


def query_grid(q: np.ndarray) -> np.ndarray:
    """Each row on its power-of-two grid (RoundQueryToInt8): the smallest p = 2^e with every
    |q_j| <= 127 p, each value its nearest multiple of p."""
    top = np.abs(q).max(axis=-1, keepdims=True)
    p = np.exp2(np.ceil(np.log2(np.where(top > 0, top, 1.0) / 127.0)))
    return np.round(q / p) * p


def chunk_stats(k: np.ndarray):
    """k [n_chunks][16][d] -> mu, lo, hi, r, var."""
    mu = k.mean(axis=1)
    dist = np.linalg.norm(k - mu[:, None], axis=-1)
    peak = k[np.arange(k.shape[0]), dist.argmax(axis=1)]
    return dict(mu=mu, lo=k.min(axis=1), hi=k.max(axis=1), r=dist.max(axis=1),
                var=k.var(axis=1), peak=peak)


def scores(q: np.ndarray, k: np.ndarray, st: dict) -> dict:
    """q [g][d], k [c][16][d]: every candidate's score per chunk, max over the g heads."""
    d = q.shape[1]
    mean = q @ st["mu"].T  # [g][c]
    mu8, peak8, q8 = int8_rows(st["mu"]), int8_rows(st["peak"]), query_grid(q)

    def lse_peak(qq, mu, peak):
        return np.logaddexp((qq @ mu.T) / np.sqrt(d) + np.log(CHUNK - 1),
                            (qq @ peak.T) / np.sqrt(d))

    qn = np.linalg.norm(q, axis=1, keepdims=True)
    out = {
        "mean": mean,
        "box": np.maximum(q[:, None, :] * st["lo"][None], q[:, None, :] * st["hi"][None]).sum(-1),
        "ball": mean + qn * st["r"][None],
        "mean+var": mean + (q * q) @ st["var"].T / (2 * np.sqrt(d)),
        "max(mean,peak)": np.maximum(mean, q @ st["peak"].T),
        "lse-peak": lse_peak(q, st["mu"], st["peak"]),
        "lse-peak-int8": lse_peak(q, mu8, peak8),
        "lse-peak-int8q": lse_peak(q8, mu8, peak8),
        "max": np.einsum("gd,ctd->gct", q, k).max(axis=2),
    }
    return {name: s.max(axis=0) for name, s in out.items()}


def evaluate(q_rows, k_all, budgets, group):
    """q_rows: list of (q [heads][d], p); k_all [kv][n][d]. Yields (budget, score, ratio)."""
    H, _, d = k_all.shape
    for q, p in q_rows:
        n = p + 1
        for h in range(H):
            qh = q[h * group:(h + 1) * group].astype(np.float64)
            kh = k_all[h, :n].astype(np.float64)
            pg = np.exp(qh @ kh.T / np.sqrt(d) - (qh @ kh.T / np.sqrt(d)).max(1, keepdims=True))
            pg = (pg / pg.sum(1, keepdims=True)).mean(0)
            for b in budgets:
                window = b // 4
                first = SINKS // CHUNK
                last = (n - window) // CHUNK  # chunks wholly before the window
                if last - first < 2:
                    continue
                kc = kh[first * CHUNK:last * CHUNK].reshape(last - first, CHUNK, d)
                mass = pg[first * CHUNK:last * CHUNK].reshape(last - first, CHUNK).sum(1)
                must = SINKS + (n - last * CHUNK)
                take = max(1, (b - must) // CHUNK)
                if take >= last - first:
                    continue
                best = np.sort(mass)[-take:].sum()
                sc = scores(qh, kc, chunk_stats(kc))
                for name in SCORES:
                    top = np.argpartition(-sc[name], take - 1)[:take]
                    yield b, name, mass[top].sum() / best


def synthetic(rng, n=4096, d=64, heads=9, kv=3, queries=32):
    """Clustered keys with outlier channels (as real keys have), queries near some clusters."""
    centers = rng.standard_normal((64, d)) * 2.0
    scale = np.ones(d)
    scale[::16] = 8.0  # outlier channels
    k = np.empty((kv, n, d))
    for h in range(kv):
        which = rng.integers(0, 64, n // CHUNK).repeat(CHUNK)
        k[h] = (centers[which] + rng.standard_normal((n, d))) * scale
    qs = []
    for i in range(queries):
        c = centers[rng.integers(0, 64, heads)]
        qs.append(((c + 0.5 * rng.standard_normal((heads, d))) / scale, n - 1))
    return qs, k.astype(np.float32)


def report(source, rows):
    out = []
    for (b, name), vals in sorted(rows.items()):
        v = np.asarray(vals)
        out.append({"name": "ranking_chunk_oracle_ratio", "value": float(v.mean()),
                    "unit": "ratio", "baseline": 1.0, "baseline_name": "chunk oracle (by mass)",
                    "ratio": float(v.mean()),
                    "parameters": {"source": source, "budget": b, "score": name,
                                   "p10": float(np.percentile(v, 10)), "samples": len(v)}})
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dump", help="an .npz from bench/model/dump.py")
    ap.add_argument("--synthetic", action="store_true")
    ap.add_argument("--budgets", default="128,256,512")
    a = ap.parse_args(argv)
    budgets = [int(b) for b in a.budgets.split(",")]
    if not a.dump and not a.synthetic:
        raise SystemExit("give --dump FILE and/or --synthetic")
    if a.dump:
        z = np.load(a.dump)
        group = int(z["num_heads"]) // int(z["num_kv_heads"])
        for layer in z["layers"]:
            rows = {}
            qs = [(z[f"q{layer}"][i], int(p)) for i, p in enumerate(z["positions"])]
            for b, name, r in evaluate(qs, z[f"k{layer}"], budgets, group):
                rows.setdefault((b, name), []).append(r)
            for line in report(f"smollm2 layer {int(layer)}", rows):
                print(json.dumps(line))
    if a.synthetic:
        rows = {}
        qs, k = synthetic(np.random.default_rng(0))
        for b, name, r in evaluate(qs, k, budgets, 3):
            rows.setdefault((b, name), []).append(r)
        for line in report("synthetic clustered, outlier channels", rows):
            print(json.dumps(line))


if __name__ == "__main__":
    sys.exit(main())
