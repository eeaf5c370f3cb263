"""Attention policies for the real-model harness: what each decode query attends over.

Every policy answers `attend(layer, n, q, cache)`: the attention output of one token's
query heads q [heads][d] over a context of n tokens whose K and V (fp16, post-RoPE) are in
`cache` (the harness's own full copy). Policies that select also return the positions they
kept per KV head, so the harness can score them against the oracle.

Harness-only policies (`full`, `window`, `quest`) select in numpy; daemon policies append
each new token's K and V to kvtierd and attend over what `Select` returns, read through the
shared-memory handles.
"""
from __future__ import annotations

import time

import numpy as np

from llama import attend, softmax
from kvtier.v1 import kvtier_pb2 as pb

CHUNK = 16   # tokens per chunk: the daemon's contiguous chunking and Quest's page size
SINKS = 16


def mandatory_chunks(n: int, sinks: int, window: int, chunk: int = CHUNK) -> np.ndarray:
    """Chunk indices that overlap the sinks or the recent window (the daemon's rule)."""
    nchunks = (n + chunk - 1) // chunk
    lo = np.arange(nchunks) * chunk
    hi = np.minimum(lo + chunk, n)
    return np.nonzero((lo < min(sinks, n)) | (hi > n - min(window, n)))[0]


def chunk_positions(chunks: np.ndarray, n: int, chunk: int = CHUNK) -> np.ndarray:
    if len(chunks) == 0:
        return np.zeros(0, np.int64)
    pos = (np.sort(chunks)[:, None] * chunk + np.arange(chunk)[None, :]).ravel()
    return pos[pos < n]


class KVCache:
    """The harness's full K and V, [layers][kv_heads][capacity][d]: the fp16 values an fp16
    cache holds, kept as float32 (exactly representable) so attention needs no conversion."""

    def __init__(self, K: np.ndarray, V: np.ndarray, capacity: int):
        L, H, P, d = K.shape
        self.K = np.zeros((L, H, capacity, d), np.float32)
        self.V = np.zeros_like(self.K)
        self.K[:, :, :P] = K
        self.V[:, :, :P] = V
        self.n = [P] * L

    def append(self, layer: int, k: np.ndarray, v: np.ndarray) -> int:
        """k, v [kv_heads][d] fp16 of the next token of `layer`; returns its position."""
        p = self.n[layer]
        self.K[layer, :, p] = k
        self.V[layer, :, p] = v
        self.n[layer] = p + 1
        return p


class Policy:
    name = "policy"
    budget: int | None = None
    dense_layers = 2
    token_ids: np.ndarray | None = None  # the text's ids, set by the harness before begin
    # The harness runs each scored token through every layer before the next (as decoding
    # does) rather than each layer over every token: for a policy whose choice at one layer
    # depends on the others' in the same step.
    token_major = False

    def begin(self, config, prefill_k: np.ndarray, prefill_v: np.ndarray) -> None:
        """config: the model's Config; prefill K, V [layers][kv_heads][P][d] fp16."""

    def on_append(self, layer: int, pos: int, k: np.ndarray, v: np.ndarray) -> None:
        pass

    def attend(self, layer: int, n: int, q: np.ndarray, cache: KVCache):
        """-> (out [heads][d], positions per KV head or None when everything was read)."""
        raise NotImplementedError

    def end(self) -> None:
        pass

    def stats(self) -> dict:
        return {}


def attend_positions(q: np.ndarray, cache: KVCache, layer: int, selected) -> np.ndarray:
    """Attention of q [heads][d] over the listed positions (an index array or a slice) of
    each KV head."""
    H = cache.K.shape[1]
    g = q.shape[0] // H
    out = np.empty(q.shape, np.float32)
    for h in range(H):
        pos = selected[h]
        out[h * g:(h + 1) * g] = attend(q[h * g:(h + 1) * g], cache.K[layer, h, pos],
                                        cache.V[layer, h, pos])
    return out


class Full(Policy):
    """Everything, from the harness's own cache: the reference."""
    name = "full"

    def attend(self, layer, n, q, cache):
        return attend_positions(q, cache, layer, [slice(0, n)] * cache.K.shape[1]), None


class Window(Policy):
    """StreamingLLM: the sinks and the most recent budget - sinks tokens."""
    name = "window"

    def __init__(self, budget: int):
        self.budget = budget

    def attend(self, layer, n, q, cache):
        if layer < self.dense_layers or n <= self.budget:
            return Full.attend(self, layer, n, q, cache)
        pos = np.concatenate([np.arange(SINKS), np.arange(n - (self.budget - SINKS), n)])
        sel = [pos] * cache.K.shape[1]
        return attend_positions(q, cache, layer, sel), sel


class Oracle(Policy):
    """The exact top-budget tokens per KV head by attention mass (softmax over the full
    context, averaged over the head's query group): the best any token selection can keep."""
    name = "oracle"

    def __init__(self, budget: int):
        self.budget = budget

    def attend(self, layer, n, q, cache):
        if layer < self.dense_layers or n <= self.budget:
            return Full.attend(self, layer, n, q, cache)
        H = cache.K.shape[1]
        g = q.shape[0] // H
        scale = np.float32(1.0 / np.sqrt(q.shape[1]))
        sel = []
        for h in range(H):
            pg = softmax((q[h * g:(h + 1) * g] @ cache.K[layer, h, :n].T) * scale).mean(axis=0)
            sel.append(np.sort(np.argpartition(-pg, self.budget - 1)[:self.budget]))
        return attend_positions(q, cache, layer, sel), sel


class Quest(Policy):
    """Quest: 16-token pages ranked by the min/max box bound sum_j max(q_j lo_j, q_j hi_j),
    the max over a KV head's query heads; the same sinks and recent window as kvtier, then
    the best pages up to the budget."""
    name = "quest"

    def __init__(self, budget: int, window: int | None = None):
        self.budget = budget
        self.window = window if window else budget // 4

    def begin(self, config, K, V):
        L, H, P, d = K.shape
        cap = P + 8192
        self.lo = np.full((L, H, cap // CHUNK + 1, d), np.inf, np.float32)
        self.hi = np.full_like(self.lo, -np.inf)
        full = P // CHUNK * CHUNK
        kf = K[:, :, :full].astype(np.float32).reshape(L, H, -1, CHUNK, d)
        self.lo[:, :, :full // CHUNK] = kf.min(axis=3)
        self.hi[:, :, :full // CHUNK] = kf.max(axis=3)
        for p in range(full, P):
            self.on_append(slice(None), p, K[:, :, p], None)  # every layer at once

    def on_append(self, layer, pos, k, v):
        c = pos // CHUNK
        kf = k.astype(np.float32)
        self.lo[layer, :, c] = np.minimum(self.lo[layer, :, c], kf)
        self.hi[layer, :, c] = np.maximum(self.hi[layer, :, c], kf)

    def attend(self, layer, n, q, cache):
        if layer < self.dense_layers or n <= self.budget:
            return Full.attend(self, layer, n, q, cache)
        H = cache.K.shape[1]
        g = q.shape[0] // H
        must = mandatory_chunks(n, SINKS, self.window)
        nchunks = (n + CHUNK - 1) // CHUNK
        free = np.ones(nchunks, bool)
        free[must] = False
        used = len(chunk_positions(must, n))
        take = max(0, (self.budget - used) // CHUNK)
        sel = []
        for h in range(H):
            qh = q[h * g:(h + 1) * g]  # [g][d]
            lo, hi = self.lo[layer, h, :nchunks], self.hi[layer, h, :nchunks]
            bound = np.maximum(qh[:, None, :] * lo[None], qh[:, None, :] * hi[None]).sum(-1)
            score = np.where(free, bound.max(axis=0), -np.inf)
            k = min(take, int(free.sum()))
            best = np.argpartition(-score, k)[:k] if k else np.zeros(0, np.int64)
            sel.append(chunk_positions(np.concatenate([must, best]), n))
        return attend_positions(q, cache, layer, sel), sel


class Daemon(Policy):
    """kvtierd as the KV store: each token's K and V are appended to the session, and every
    layer >= dense_layers attends only over what Select returns, read from shared memory.

    `summaries`: the response also carries a mean key, mean value and count for every
    left-out group; each adds a pseudo-token with logit q.mu/sqrt(d) + log(count) and value
    the mean value (the mass the worker did not fetch, approximated).

    `lookahead`: selections asked for before the query they serve exists, so that a worker's
    bytes are ready when its layer runs. "step": at the end of each step one BatchSelect
    asks for every layer's next-step selection with this step's queries; "layer": each layer
    asks for the next layer's selection with its own query. Either selection was made before
    the newest token reached that layer, so the worker adds that token (its own) to what came
    back. Token-major: each token through every layer, as a decoder runs."""

    def __init__(self, client, name: str, budget: int | None, *, lossless: bool = False,
                 cold_precision: int = 0, sinks: int = SINKS, window: int | None = None,
                 dense_layers: int = 2, summaries: bool = False, placement: str | None = None,
                 ranking: int = 0, chunking: int = 0, delimiters: list[int] | None = None,
                 refine_factor: int = 0, refine_score: int = 0, mass_target: float = 0.0,
                 layer_budget: int = 0, chunk_tokens: int = 0, lookahead: str | None = None):
        if lookahead not in (None, "step", "layer"):
            raise ValueError(f"lookahead: {lookahead!r} is none of step, layer")
        self.lookahead = lookahead
        self.ahead: dict[int, pb.SelectResponse] = {}  # layer -> its selection, asked earlier
        self.step_q: dict[int, np.ndarray] = {}        # this step's queries (lookahead step)
        self.client = client
        self.name = name
        self.budget = budget
        self.policy = dict(sink_tokens=sinks,
                           recent_window=window if window else max(1, (budget or 256) // 4),
                           dense_layers=dense_layers, lossless=lossless,
                           cold_precision=cold_precision, ranking=ranking,
                           default_budget=budget or 256, chunking=chunking,
                           delimiter_token_ids=delimiters or [], refine_factor=refine_factor,
                           refine_score=refine_score, mass_target=mass_target,
                           layer_budget=layer_budget, chunk_tokens=chunk_tokens)
        self.send_ids = bool(delimiters)  # boundary chunking cuts at the ids sent
        # Layer budgets by need share a step's rows among its layers.
        self.token_major = layer_budget == pb.LAYER_BUDGET_BY_NEED or lookahead is not None
        self.dense_layers = dense_layers
        self.summaries = summaries
        self.placement = placement
        self.select_seconds: list[float] = []
        self.inline_blocks = 0  # blocks that came with inline bytes (none are asked for)
        self.shm_blocks = 0     # blocks read in place through shared memory
        self.sid = None

    def begin(self, config, K, V):
        L, H, P, d = K.shape
        s = self.client.create_session(num_layers=L, num_q_heads=config.num_heads,
                                       num_kv_heads=H, head_dim=d,
                                       labels={"harness": self.name},
                                       **self.policy)
        self.sid = s.session_id
        self.effective_policy = s.policy
        self.tiers_before = self._cache_counts()
        ids = self.token_ids[:P] if self.send_ids else None
        # wait_aged: every Select sees the chunks in their aged (int4, indexed) form, as it
        # would once the aging pool caught up, whatever the pool's pace on this machine.
        for layer in range(L):
            self.client.append_kv(self.sid, [(layer, 0, K[layer], V[layer], ids)],
                                  wait_aged=True)

    def on_append(self, layer, pos, k, v):
        ids = self.token_ids[pos:pos + 1] if self.send_ids else None
        self.client.append_kv(self.sid, [(layer, pos, k[:, None, :], v[:, None, :], ids)],
                              wait_aged=True)

    def _request(self, layer, q) -> pb.SelectRequest:
        return pb.SelectRequest(session_id=self.sid, layer=layer,
                                query=np.ascontiguousarray(q, np.float32).tobytes(),
                                budget_tokens=self.budget or 0,
                                placement={None: pb.TIER_UNSPECIFIED, "device": pb.TIER_DEVICE,
                                           "host": pb.TIER_HOST}[self.placement],
                                include_summaries=self.summaries, row_handles=True)

    def _select(self, layer, q) -> pb.SelectResponse:
        t0 = time.perf_counter()
        r = self.client.select(self.sid, layer, q, budget_tokens=self.budget or 0,
                               placement=self.placement, include_summaries=self.summaries)
        self.select_seconds.append(time.perf_counter() - t0)
        return r

    def _look_ahead(self, layer, q, num_layers):
        """Asks now for what later attends will read (self.lookahead)."""
        if self.lookahead == "layer" and layer + 1 < num_layers:
            self.ahead[layer + 1] = self._select(layer + 1, q)
        elif self.lookahead == "step":
            self.step_q[layer] = np.array(q, np.float32)
            if layer == num_layers - 1:  # the step's last layer: the next step's, in one call
                t0 = time.perf_counter()
                batch = self.client.batch_select(
                    [self._request(l, self.step_q[l]) for l in range(num_layers)])
                self.select_seconds.append(time.perf_counter() - t0)
                self.ahead = dict(enumerate(batch.responses))

    def attend(self, layer, n, q, cache):
        r = self.ahead.pop(layer, None)
        if r is None:
            r = self._select(layer, q)
        if self.lookahead:
            self._look_ahead(layer, q, cache.K.shape[0])
        # A selection asked ahead saw the context before this token reached the layer.
        newest = r.context_tokens == n - 1 and self.lookahead is not None
        if r.context_tokens != n and not newest:
            raise AssertionError(f"{self.name}: layer {layer} context {r.context_tokens} != {n}")
        H = len(r.heads)
        g = q.shape[0] // H
        d = q.shape[1]
        out = np.empty(q.shape, np.float32)
        sel, everything = [], True
        for h, head in enumerate(r.heads):
            for b in head.blocks:
                if b.keys:
                    self.inline_blocks += 1
                else:
                    self.shm_blocks += 1
            pos, k, v = self.client.gather(head, head_dim=d)
            if newest:  # the worker's own newest token
                pos = np.append(pos, n - 1)
                k = np.concatenate([k, cache.K[layer, head.kv_head, n - 1:n].astype(k.dtype)])
                v = np.concatenate([v, cache.V[layer, head.kv_head, n - 1:n].astype(v.dtype)])
            # Position order (semantic chunks hold rows out of it): attention then sums in the
            # harness's own order, so reading everything reproduces full attention exactly.
            order = np.argsort(pos, kind="stable")
            pos, k, v = pos[order], k[order], v[order]
            qh = q[h * g:(h + 1) * g]
            if head.summaries:
                mk = np.stack([np.frombuffer(s.mean_key, np.float32) for s in head.summaries])
                mv = np.stack([np.frombuffer(s.mean_value, np.float32) for s in head.summaries])
                cnt = np.array([s.num_tokens for s in head.summaries], np.float32)
                kk = np.concatenate([k.astype(np.float32), mk])
                vv = np.concatenate([v.astype(np.float32), mv])
                bias = np.concatenate([np.zeros(len(pos), np.float32), np.log(cnt)])
                s = (qh @ kk.T) * np.float32(1.0 / np.sqrt(d)) + bias
                out[h * g:(h + 1) * g] = softmax(s) @ vv
            else:
                out[h * g:(h + 1) * g] = attend(qh, k, v)
            everything = everything and len(pos) == n
            sel.append(pos)
        self.client.release(r.lease_id)
        return out, (None if everything else sel)

    def _cache_counts(self):
        """The promotion cache's counters of the tier this policy reads from."""
        want = pb.TIER_DEVICE if self.placement == "device" else pb.TIER_HOST
        for t in self.client.tier_stats():
            if t.tier == want:
                return {k: getattr(t, k) for k in
                        ("cache_hits", "cache_misses", "prefetched", "prefetch_hits")}
        return {}

    def end(self):
        for r in self.ahead.values():  # asked ahead for a step that never came
            self.client.release(r.lease_id)
        self.ahead = {}
        if self.sid and self.budget:
            after = self._cache_counts()
            self.cache = {k: after[k] - self.tiers_before[k] for k in after}
        if self.sid:
            self.client.close_session(self.sid)
            self.sid = None

    def stats(self):
        if not self.select_seconds:
            return {}
        ms = np.asarray(self.select_seconds) * 1e3
        out = {"select_ms_p50": float(np.median(ms)), "select_ms_p99": float(np.percentile(ms, 99)),
               "selects": len(ms), "select_ms_total": float(ms.sum())}
        c = getattr(self, "cache", None)
        if c and c["cache_hits"] + c["cache_misses"]:
            # Of the selected chunks that needed an fp16 copy (cold ones, on the host), the
            # share already promoted: by an earlier step, or by the prefetch after it.
            out["cache_hit_rate"] = c["cache_hits"] / (c["cache_hits"] + c["cache_misses"])
            out["prefetch_hits"] = c["prefetch_hits"]
            out["prefetched"] = c["prefetched"]
        return out
