"""The decode loop of the real-model harness: prefill with full attention, then score tokens
teacher-forced with each layer attending through a Policy, and measure what it kept."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from llama import Model, log_softmax, softmax
from policies import CHUNK, KVCache, Policy


@dataclass
class Prefill:
    ids: np.ndarray        # every token id of the text used (context + scored + 1)
    context: int           # P: tokens prefilled with full attention
    scored: int            # S: tokens scored teacher-forced after the context
    K: np.ndarray          # [layers][kv_heads][P][d] fp16
    V: np.ndarray
    h: np.ndarray = field(repr=False, default=None)  # hidden state after the last prefill token


def prefill(model: Model, ids, context: int, scored: int) -> Prefill:
    ids = np.asarray(ids)
    if len(ids) < context + scored + 1:
        raise ValueError(f"the text has {len(ids)} tokens; context {context} + scored {scored} "
                         "+ 1 are needed")
    _, K, V, h = model.prefill(ids[:context], want_logits=False)
    return Prefill(ids=ids[:context + scored + 1], context=context, scored=scored, K=K, V=V, h=h)


class LayerMetrics:
    """Per (layer, token, KV head): mass recall against the oracle's, against the best whole
    chunks, and the attention-output error of the policy and of the oracle."""

    def __init__(self, num_layers: int):
        self.ratio = [[] for _ in range(num_layers)]
        self.chunk_ratio = [[] for _ in range(num_layers)]
        self.err = [[] for _ in range(num_layers)]
        self.oracle_err = [[] for _ in range(num_layers)]
        self.tokens = [[] for _ in range(num_layers)]  # tokens the policy returned

    def add(self, layer, n, q, out, selected, cache: KVCache, budget: int):
        H = cache.K.shape[1]
        g = q.shape[0] // H
        d = q.shape[1]
        for h in range(H):
            qh = q[h * g:(h + 1) * g]
            Kf = cache.K[layer, h, :n]
            Vf = cache.V[layer, h, :n]
            p = softmax((qh @ Kf.T) * np.float32(1.0 / np.sqrt(d)))  # [g][n]
            pg = p.mean(axis=0)
            b = min(budget, n)
            top = np.argpartition(-pg, b - 1)[:b]
            r_or = pg[top].sum()
            kept = pg[selected[h]]
            r = kept.sum()
            self.tokens[layer].append(kept.size)
            self.ratio[layer].append(r / r_or)
            csum = np.add.reduceat(pg, np.arange(0, n, CHUNK))
            kc = max(1, b // CHUNK)
            self.chunk_ratio[layer].append(r / np.sort(csum)[-kc:].sum())
            o = p @ Vf
            po = p[:, top] / p[:, top].sum(axis=1, keepdims=True)
            o_or = po @ Vf[top]
            norm = np.linalg.norm(o)
            self.err[layer].append(np.linalg.norm(out[h * g:(h + 1) * g] - o) / norm)
            self.oracle_err[layer].append(np.linalg.norm(o_or - o) / norm)

    def summary(self, dense_layers: int) -> dict:
        def flat(rows):  # every (token, KV head) value of the layers that select
            return [x for layer in rows[dense_layers:] for x in layer]

        def mean_of(rows):
            return float(np.mean(flat(rows)))

        ratios = flat(self.ratio)
        if not ratios:
            return {}
        return {
            "oracle_ratio_mean": float(np.mean(ratios)),
            "oracle_ratio_p10": float(np.percentile(ratios, 10)),
            "chunk_oracle_ratio_mean": mean_of(self.chunk_ratio),
            "output_error_mean": mean_of(self.err),
            "oracle_output_error_mean": mean_of(self.oracle_err),
            # The mean tokens per (layer >= dense_layers, token, KV head): comparisons are at
            # equal means.
            "tokens_per_head_mean": mean_of(self.tokens),
            "oracle_ratio_per_layer": [float(np.mean(r)) if r else None for r in self.ratio],
        }


def run(model: Model, pre: Prefill, policy: Policy, measure: bool = True) -> dict:
    """Scores pre.scored tokens after the context with `policy`; returns its record, with
    the logits of every scored token under "logits"."""
    c = model.config
    P, S = pre.context, pre.scored
    t0 = time.perf_counter()
    cache = KVCache(pre.K, pre.V, P + S)
    policy.token_ids = pre.ids
    policy.begin(c, pre.K, pre.V)
    metrics = LayerMetrics(c.num_layers)
    def step(layer, q, k, v):
        p = cache.append(layer, k, v)
        policy.on_append(layer, p, k, v)
        out, selected = policy.attend(layer, p + 1, q, cache)
        if measure and selected is not None and policy.budget:
            metrics.add(layer, p + 1, q, out, selected, cache, policy.budget)
        return out

    try:
        pos = np.arange(P, P + S)
        h = model.embed[pre.ids[P:P + S]]
        if policy.token_major:
            # Token-major, as a decoder runs: each token through every layer before the next,
            # for a policy whose choice at a layer depends on what the other layers saw of the
            # same step (layer budgets by need).
            for t in range(S):
                x = h[t:t + 1]
                for layer in range(c.num_layers):
                    q, k, v = model.qkv(layer, x, pos[t:t + 1])
                    x = model.finish(layer, x, step(layer, q[0], k[0], v[0])[None])
                h[t] = x[0]
        else:
            # Layer-major: every scored token's input to a layer is known (teacher forcing), so
            # a layer's projections run as one product; tokens still go through attention one
            # by one, each after its own K and V were appended, as in decoding.
            for layer in range(c.num_layers):
                q, k, v = model.qkv(layer, h, pos)
                out = np.empty((S, c.num_heads, c.head_dim), np.float32)
                for t in range(S):
                    out[t] = step(layer, q[t], k[t], v[t])
                h = model.finish(layer, h, out)
        logits = model.logits(h)
    finally:
        policy.end()
    targets = pre.ids[P + 1:P + S + 1]
    nll = -log_softmax(logits)[np.arange(S), targets]
    rec = {"policy": policy.name, "budget": policy.budget, "context": P, "scored": S,
           "perplexity": float(np.exp(nll.mean())), "nll_mean": float(nll.mean()),
           "seconds": time.perf_counter() - t0}
    rec.update(metrics.summary(policy.dense_layers))
    rec.update(policy.stats())
    rec["logits"] = logits
    return rec
