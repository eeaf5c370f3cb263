"""kvtier inside Hugging Face transformers: a Cache whose keys and values live in kvtierd, and
an attention function ("kvtier") that attends over what Select returns.

    from transformers import AutoModelForCausalLM
    from kvtier.integrations.transformers import KvTierCache
    model = AutoModelForCausalLM.from_pretrained(..., attn_implementation="kvtier")
    cache = KvTierCache(kvtier.Client("unix:/tmp/kvtier.sock"), model.config, budget_tokens=256)
    out = model.generate(ids, cache=cache, max_new_tokens=32)
    cache.close()

Each layer's attention appends the new tokens' keys and values (after RoPE, as fp16) to the
cache's kvtierd session of their batch row, the row's padding left out. The prompt (a forward
from an empty cache) attends over its own keys and values, causally, as transformers does;
each decoded token's query then goes to Select
for its layer, and the token attends over the rows Select returned (the sinks, the recent
window and the chunks that matter, copied out of kvtierd's shared memory; over TCP, inline
in the reply), whose lease ends right after. On a Unix socket a decoded token's
append, Select and release go through a shared-memory channel, not gRPC. A forward of several
tokens onto a cache that holds earlier ones (the next turn of a chat, a prompt continued)
attends, causally, over every row stored before it (one Select a layer whose budget covers the
context) and over its own keys and values, as a prompt does over its own. With another Cache
(or none) the "kvtier" attention is plain causal attention over the keys that cache gives.
Importing this module registers the attention function, and a mask function that hands it
transformers' 2D padding mask. One session per batch row; a Llama-family model (grouped-query
attention, no sliding window)."""
from __future__ import annotations

import contextvars

import numpy as np
import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface
from transformers.cache_utils import Cache, DynamicLayer

import kvtier
from kvtier.v1 import kvtier_pb2 as pb

# The cache whose layer was just updated: the attention function that follows in the same
# layer's forward reads it.
_ACTIVE: contextvars.ContextVar["KvTierCache | None"] = contextvars.ContextVar(
    "kvtier_active_cache", default=None)


class _KvTierLayer(DynamicLayer):
    """One layer's length; its keys and values are in kvtierd, never kept here. `tokens`
    counts the forwards' tokens as transformers sees them (padding included); `rows[b]` the
    rows stored in batch row b's session (its padding left out)."""

    def __init__(self, cache: "KvTierCache"):
        super().__init__()
        self._cache = cache
        self.tokens = 0
        self.rows: list[int] = []

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        # The rows are stored by the attention function that follows, which knows the padding.
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._cache._start(key_states.shape[0])
        if not self.rows:
            self.rows = [0] * key_states.shape[0]
        self.tokens += key_states.shape[2]
        return key_states, value_states

    def get_seq_length(self) -> int:
        return self.tokens

    def _unsupported(self, what: str):
        raise kvtier.KvTierArgumentError(
            "cache", f"a KvTierCache cannot {what}: its rows live in kvtierd sessions, one per "
            "batch row (greedy or sampled generation only; no beam search, no assisted "
            "decoding)")

    def reorder_cache(self, beam_idx) -> None:
        self._unsupported("reorder its batch rows")

    def crop(self, tokens_to_remove: int) -> None:
        self._unsupported("drop tokens")

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._unsupported("repeat its batch rows")

    def batch_select_indices(self, indices) -> None:
        self._unsupported("select batch rows")

    def reset(self) -> None:
        self._unsupported("be reset (close it and make another)")


class KvTierCache(Cache):
    """A transformers Cache over kvtierd sessions, one per batch row, made for `config`'s
    shape; `policy` takes SessionPolicy fields (lossless=True keeps every token in fp16),
    `budget_tokens` each Select's budget (0: the session's default). `session_id` names the
    first row's session (made here); the other rows' are made at the first forward, which
    fixes the batch size. A row's padding (attention_mask 0) is not stored."""

    def __init__(self, client: kvtier.Client, config, budget_tokens: int = 0,
                 session_id: str = "", **policy):
        head_dim = getattr(config, "head_dim", None) or \
            config.hidden_size // config.num_attention_heads
        self.client = client
        self.budget_tokens = budget_tokens
        self.head_dim = head_dim
        self._shape = dict(
            num_layers=config.num_hidden_layers, num_q_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads, head_dim=head_dim,
            model_id=getattr(config, "name_or_path", "") or "", **policy)
        self.session_ids = [client.create_session(session_id=session_id,
                                                  **self._shape).session_id]
        self._batch = 0  # fixed by the first forward
        # A decoded token's per-layer append, Select and release go through a shared-memory
        # channel on a Unix socket; over TCP, and once the channel broke, they are gRPC calls,
        # as is a call the channel's areas cannot hold.
        self.channel = None
        # Over TCP the daemon may be on another host: the rows come inline in the replies.
        self.inline = not client.address.startswith("unix:")
        if not self.inline:
            try:
                self.channel = client.open_channel()
            except kvtier.KvTierError:
                self.channel = None
        super().__init__(layers=[_KvTierLayer(self) for _ in range(config.num_hidden_layers)])

    @property
    def session_id(self) -> str:
        """The first batch row's session."""
        return self.session_ids[0]

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        """Counts the layer's new tokens (Cache.update); the attention function that follows in
        this layer's forward stores them and reads this cache."""
        _ACTIVE.set(self)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def _start(self, batch: int) -> None:
        """The sessions of a forward's `batch` rows: made at the first forward, the same after."""
        if self._batch == batch:
            return
        if self._batch:
            raise kvtier.KvTierArgumentError(
                "key_states", f"a batch of {batch} rows onto a KvTierCache of {self._batch}: "
                "the first forward fixes the batch size")
        while len(self.session_ids) < batch:
            self.session_ids.append(self.client.create_session(**self._shape).session_id)
        self._batch = batch

    def close(self) -> None:
        """Closes the kvtierd sessions and the cache's channel: each of them, the first error
        raised after."""
        errors = []
        try:
            if self.channel is not None:
                self.channel.close()  # ends the leases of its Selects too
        except Exception as e:  # noqa: BLE001 - raised below, once the sessions are closed
            errors.append(e)
        self.channel = None
        for sid in self.session_ids:
            try:
                self.client.close_session(sid)
            except Exception as e:  # noqa: BLE001
                errors.append(e)
        if errors:
            raise errors[0]

    def _through_channel(self, call):
        """call(self.channel), or None for the caller to make the call over gRPC: there is no
        channel, it broke (closed, timed out, the daemon restarted: it is closed for good), or
        the call does not fit its request or response area (RESOURCE_EXHAUSTED; the channel
        stays). Other errors are raised."""
        ch = self.channel
        if ch is None:
            return None
        try:
            return call(ch)
        except kvtier.KvTierError as e:
            if e.code.name == "RESOURCE_EXHAUSTED":
                return None
            if f"channel {ch.id}" not in e.message:
                raise
            ch.close()
            self.channel = None
            return None

    def _append(self, sid: str, layer: int, start: int, k, v) -> None:
        """One layer's new rows of session `sid`: a decoded token's through the channel, a
        prompt's streamed (an append the channel began and then broke on is made again over
        gRPC: a rewrite of the same rows is a no-op)."""
        if k.shape[1] == 1 and self._through_channel(
                lambda ch: ch.append(sid, layer, start, k, v)) is not None:
            return
        self.client.append_kv(sid, [(layer, start, k, v)])

    def _select(self, sid: str, layer: int, query, budget_tokens: int):
        """A decoded token's Select, its refined rows gathered into blocks of their own (one
        handle per block, every row of it selected). Returns (response, whether its lease is
        the channel's)."""
        sel = self._through_channel(lambda ch: ch.select(
            sid, layer, query, budget_tokens=budget_tokens, row_handles=False))
        if sel is not None:
            return sel, True
        return self.client.select(sid, layer, query, budget_tokens=budget_tokens,
                                  row_handles=False, include_data=self.inline), False

    def _release(self, lease_id: str, on_channel: bool) -> None:
        """Ends a lease; one of a channel that broke meanwhile ended with it (NOT_FOUND)."""
        if on_channel and self._through_channel(
                lambda ch: ch.release(lease_id) or True) is not None:
            return
        try:
            self.client.release(lease_id)
        except kvtier.KvTierError as e:
            if not (on_channel and e.code.name == "NOT_FOUND"):
                raise


def _read(client: kvtier.Client, head, head_dim: int, positions: bool = False):
    """The selected rows' K and V (fp32 [n][head_dim]) of one HeadSelection, and with
    `positions` their positions (int64 [n]; else None). Handles over host shared memory are
    read together (SegmentMap.gather: a slice a handle, the slots' generations compared with
    the handles' as one array after the copy); inline bytes and device memory a handle at a
    time (device memory through torch views), concatenated and converted to fp32 as one
    tensor, then checked."""
    blocks = head.blocks
    pos = torch.from_numpy(kvtier.SegmentMap.positions(blocks)) if positions else None
    if blocks and not any(b.keys for b in blocks) and not client.segments.on_device(blocks):
        # Every handle over host shared memory: read together, checked after the copy.
        k, v = client.segments.gather(blocks, head_dim)  # a bf16 session's bits as uint16
        bf16 = k.dtype == np.uint16
        kt, vt = (torch.from_numpy(x.view(np.int16)).view(torch.bfloat16).float() if bf16
                  else torch.from_numpy(x).float() for x in (k, v))
        return kt, vt, pos
    ks, vs = [], []
    for b in blocks:
        if b.keys and b.precision == pb.PRECISION_BF16:  # inline bf16 bits
            k, v = (torch.frombuffer(bytearray(x), dtype=torch.bfloat16).reshape(b.num_tokens, -1)
                    for x in (b.keys, b.values))
        elif b.keys:  # the bytes came inline (a remote daemon)
            k, v = (torch.from_dlpack(np.frombuffer(x, np.float16).reshape(b.num_tokens, -1))
                    for x in (b.keys, b.values))
        else:
            k, v = client.view(b, head_dim, like="torch")
        if b.rows:
            rows = torch.tensor(b.rows, dtype=torch.int64)
            k, v = k.index_select(0, rows), v.index_select(0, rows)
        ks.append(k)
        vs.append(v)
    if not ks:
        empty = torch.empty(0, head_dim, dtype=torch.float32)
        return empty, empty.clone(), pos
    kt = torch.cat(ks).float()  # copies out of the views before the check below
    vt = torch.cat(vs).float()
    for b in blocks:
        if not b.keys:
            client.segments.check(b)
    return kt, vt, pos


# The most logits _attend_onto_past holds at once (fp32): a long prompt onto a long context is
# attended a block of queries at a time.
_MAX_LOGITS = 1 << 24


def _attend_onto_past(cache: KvTierCache, sid: str, layer: int, query, key, value, past: int,
                      scale: float, groups: int):
    """Several new tokens of one batch row (query [q_heads][n][d], key and value
    [kv_heads][n][d], positions past .. past + n - 1) onto its session holding `past` earlier
    rows: each query attends over every row stored before the forward (a Select whose budget
    covers the whole context returns each chunk whole) and over the new tokens' own keys and
    values up to its own position, as transformers' causal attention does over a dense cache.
    Output [n][q_heads][d], fp32."""
    q_len = query.shape[1]
    total = past + q_len
    last = query[:, -1, :].detach().float().cpu().numpy()  # any query: the budget takes all
    # Over gRPC: the whole context's handles may not fit the channel's response area.
    sel = cache.client.select(sid, layer, last, include_data=cache.inline,
                              budget_tokens=min(total, 2**32 - 1))
    try:
        out = torch.empty(q_len, query.shape[0], query.shape[2], dtype=torch.float32)
        at = past + torch.arange(q_len, dtype=torch.int64)  # each new token's position
        for head in sel.heads:
            kt, vt, pos = _read(cache.client, head, cache.head_dim, positions=True)
            old = pos < past  # the rows this forward appended come from its own tensors
            if int(old.sum()) != past:
                raise RuntimeError(
                    f"session {sid} layer {layer} KV head {head.kv_head}: a Select with the "
                    f"whole context as its budget returned {int(old.sum())} of the {past} rows "
                    "stored before this forward (was it appended to outside this cache?)")
            k = torch.cat([kt[old], key[head.kv_head].detach().float().cpu()])
            v = torch.cat([vt[old], value[head.kv_head].detach().float().cpu()])
            p = torch.cat([pos[old], at])
            h0 = head.kv_head * groups
            qh = query[h0:h0 + groups].detach().float().cpu()  # [groups][q_len][d]
            step = max(1, _MAX_LOGITS // (groups * k.shape[0]))
            for i in range(0, q_len, step):
                j = min(q_len, i + step)
                logits = (qh[:, i:j] @ k.T) * scale  # [groups][j - i][rows]
                logits.masked_fill_(p[None, None, :] > at[None, i:j, None], float("-inf"))
                out[i:j, h0:h0 + groups] = (torch.softmax(logits, dim=-1) @ v).transpose(0, 1)
    finally:
        cache.client.release(sel.lease_id)
    return out


def _attend_decoded(cache: KvTierCache, sid: str, layer: int, query, groups: int,
                    scale: float):
    """One decoded token of one batch row (query [q_heads][d]) over the rows a Select of its
    session returns. Output [q_heads][d], fp32."""
    query = query.detach().float().cpu()
    sel, on_channel = cache._select(sid, layer, query.numpy(), cache.budget_tokens)
    try:
        out = torch.empty(query.shape[0], query.shape[1], dtype=torch.float32)
        for head in sel.heads:
            kt, vt, _ = _read(cache.client, head, cache.head_dim)
            h0 = head.kv_head * groups
            qh = query[h0:h0 + groups]
            weights = torch.softmax((qh @ kt.T) * scale, dim=-1)
            out[h0:h0 + groups] = weights @ vt
    finally:
        cache._release(sel.lease_id, on_channel)
    return out


def _plain(query, key, value, attention_mask, scale: float, groups: int):
    """Causal attention of the new tokens ([batch][heads][q_len][d]) over the keys and values
    given, the new tokens' last (a prompt's own, or what a cache other than a KvTierCache
    gives: its earlier tokens first), padding (a 2D attention_mask) left out. Output
    [batch][q_len][heads][d]."""
    k = key.repeat_interleave(groups, dim=1)
    v = value.repeat_interleave(groups, dim=1)
    q_len, kv_len = query.shape[2], k.shape[2]
    mask = None
    if kv_len != q_len or attention_mask is not None:
        mask = (torch.arange(kv_len, device=query.device)[None, :] <=
                torch.arange(kv_len - q_len, kv_len, device=query.device)[:, None])[None, None]
        if attention_mask is not None:
            pad = attention_mask[:, -kv_len:].to(torch.bool)
            if pad.shape[-1] < kv_len:  # a mask of the new tokens alone: the earlier are real
                pad = torch.nn.functional.pad(pad, (kv_len - pad.shape[-1], 0), value=True)
            mask = mask & pad[:, None, None, :]
            mask = mask | ~mask.any(-1, keepdim=True)  # a padding query: any output
    out = torch.nn.functional.scaled_dot_product_attention(
        query, k, v, attn_mask=mask, is_causal=mask is None and q_len > 1, scale=scale)
    return out.transpose(1, 2).contiguous()


def kvtier_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                     **kwargs):
    """transformers' attention interface: (output [batch][q_len][heads][d], None).
    `attention_mask`: the 2D padding mask (_padding_mask), or None when nothing is padding."""
    # The cache whose update just ran in this layer's forward, taken once: a forward with
    # another cache (or none) after it finds none.
    cache = _ACTIVE.get()
    _ACTIVE.set(None)
    if attention_mask is not None and attention_mask.dim() != 2:
        raise kvtier.KvTierArgumentError(
            "attention_mask", "the kvtier attention takes a 2D padding mask (batch, tokens), "
            f"not one of {attention_mask.dim()} dimensions")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    groups = query.shape[1] // key.shape[1]
    if cache is None:
        return _plain(query, key, value, attention_mask, scale, groups), None
    layer = module.layer_idx
    state = cache.layers[layer]
    batch, q_len = query.shape[0], query.shape[2]
    real = (attention_mask[:, -q_len:].to(torch.bool) if attention_mask is not None
            else torch.ones(batch, q_len, dtype=torch.bool))
    out = torch.zeros(batch, q_len, query.shape[1], query.shape[3], dtype=torch.float32,
                      device=query.device)
    for b in range(batch):
        idx = real[b].nonzero().flatten().cpu()
        n = len(idx)
        if n == 0:
            continue  # nothing but padding in this forward
        sid = cache.session_ids[b]
        qb, kb, vb = query[b][:, idx], key[b][:, idx], value[b][:, idx]
        past = state.rows[b]
        cache._append(sid, layer, past, kb.detach().to(torch.float16).cpu().numpy(),
                      vb.detach().to(torch.float16).cpu().numpy())
        state.rows[b] = past + n
        if past == 0:  # the prompt from an empty session: causal over its own keys and values
            out[b, idx] = _plain(qb[None], kb[None], vb[None], None, scale, groups)[0].float()
        elif n > 1:  # a prompt onto earlier tokens
            out[b, idx] = _attend_onto_past(cache, sid, layer, qb, kb, vb, past, scale,
                                            groups).to(out.device)
        else:
            out[b, idx[0]] = _attend_decoded(cache, sid, layer, qb[:, 0], groups,
                                             scale).to(out.device)
    return out.to(query.dtype), None


def _padding_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
                  attention_mask=None, **kwargs):
    """The mask transformers makes for the "kvtier" attention: the 2D padding mask as given
    ([batch][tokens], True for a real token), or None when every token is real."""
    if attention_mask is None or bool(attention_mask.all()):
        return None
    return attention_mask.to(torch.bool)


AttentionInterface.register("kvtier", kvtier_attention)
AttentionMaskInterface.register("kvtier", _padding_mask)
