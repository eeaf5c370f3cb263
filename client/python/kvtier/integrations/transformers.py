"""kvtier inside Hugging Face transformers: a Cache whose keys and values live in kvtierd, and
an attention function ("kvtier") that attends over what Select returns.

    from transformers import AutoModelForCausalLM
    from kvtier.integrations.transformers import KvTierCache
    model = AutoModelForCausalLM.from_pretrained(..., attn_implementation="kvtier")
    cache = KvTierCache(kvtier.Client("unix:/tmp/kvtier.sock"), model.config, budget_tokens=256)
    out = model.generate(ids, cache=cache, max_new_tokens=32)
    cache.close()

Each layer's update appends the new tokens' keys and values (after RoPE, as fp16) to the
cache's kvtierd session. The prompt (a forward from an empty cache) attends over its own keys
and values, causally, as transformers does; each decoded token's query then goes to Select
for its layer, and the token attends over the rows Select returned (the sinks, the recent
window and the chunks that matter, read through torch views over kvtierd's shared memory; over
TCP, inline in the reply), whose lease ends right after. On a Unix socket a decoded token's
append, Select and release go through a shared-memory channel, not gRPC. A forward of several
tokens onto a cache that holds earlier ones (the next turn of a chat, a prompt continued)
attends, causally, over every row stored before it (one Select a layer whose budget covers the
context) and over its own keys and values, as a prompt does over its own. With another Cache
(or none) the "kvtier" attention is plain causal attention over the keys that cache gives.
Importing this module registers the attention function. Batch size 1; a Llama-family model
(grouped-query attention, no sliding window)."""
from __future__ import annotations

import contextvars

import numpy as np
import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, DynamicLayer

import kvtier
from kvtier.v1 import kvtier_pb2 as pb

# The cache whose layer was just updated: the attention function that follows in the same
# layer's forward reads it.
_ACTIVE: contextvars.ContextVar["KvTierCache | None"] = contextvars.ContextVar(
    "kvtier_active_cache", default=None)


class _KvTierLayer(DynamicLayer):
    """One layer's length; its keys and values are in kvtierd, never kept here."""

    def __init__(self, cache: "KvTierCache", layer: int):
        super().__init__()
        self._cache = cache
        self._layer = layer
        self.tokens = 0
        self.appended_now = 0  # tokens the last update appended (the attention's query length)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if key_states.shape[0] != 1:
            raise kvtier.KvTierArgumentError("key_states", "kvtier's cache takes batch size 1")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        k = key_states[0].detach().to(torch.float16).cpu().numpy()  # [kv_heads][n][d]
        v = value_states[0].detach().to(torch.float16).cpu().numpy()
        self._cache._append(self._layer, self.tokens, k, v)
        self.appended_now = k.shape[1]
        self.tokens += k.shape[1]
        return key_states, value_states

    def get_seq_length(self) -> int:
        return self.tokens


class KvTierCache(Cache):
    """A transformers Cache over one kvtierd session, made for `config`'s shape; `policy`
    takes SessionPolicy fields (lossless=True keeps every token in fp16), `budget_tokens`
    each Select's budget (0: the session's default)."""

    def __init__(self, client: kvtier.Client, config, budget_tokens: int = 0,
                 session_id: str = "", **policy):
        head_dim = getattr(config, "head_dim", None) or \
            config.hidden_size // config.num_attention_heads
        self.client = client
        self.budget_tokens = budget_tokens
        self.head_dim = head_dim
        self.session_id = client.create_session(
            num_layers=config.num_hidden_layers, num_q_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads, head_dim=head_dim, session_id=session_id,
            model_id=getattr(config, "name_or_path", "") or "", **policy).session_id
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
        super().__init__(layers=[_KvTierLayer(self, i) for i in range(config.num_hidden_layers)])

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        """Appends the layer's new keys and values to the session (Cache.update); the
        attention function that follows in this layer's forward reads this cache."""
        _ACTIVE.set(self)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def close(self) -> None:
        """Closes the kvtierd session and the cache's channel."""
        try:
            if self.channel is not None:
                self.channel.close()  # ends the leases of its Selects too
        finally:
            self.channel = None
            self.client.close_session(self.session_id)

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

    def _append(self, layer: int, start: int, k, v) -> None:
        """One layer's new rows: a decoded token's through the channel, a prompt's streamed
        (an append the channel began and then broke on is made again over gRPC: a rewrite of
        the same rows is a no-op)."""
        if k.shape[1] == 1 and self._through_channel(
                lambda ch: ch.append(self.session_id, layer, start, k, v)) is not None:
            return
        self.client.append_kv(self.session_id, [(layer, start, k, v)])

    def _select(self, layer: int, query, budget_tokens: int):
        """A decoded token's Select, its refined rows gathered into blocks of their own (one
        handle per block, every row of it selected). Returns (response, whether its lease is
        the channel's)."""
        sel = self._through_channel(lambda ch: ch.select(
            self.session_id, layer, query, budget_tokens=budget_tokens, row_handles=False))
        if sel is not None:
            return sel, True
        return self.client.select(self.session_id, layer, query, budget_tokens=budget_tokens,
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
    `positions` their positions (int64 [n]; else None): each handle's selected rows taken from
    torch views over kvtierd's shared memory, concatenated and converted to fp32 as one tensor
    (not handle by handle), then checked: every slot still holds its handle's generation."""
    ks, vs, ps = [], [], []
    for b in head.blocks:
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
        if positions:
            ps.append(b.positions if not b.rows else [b.positions[r] for r in b.rows])
    if not ks:
        empty = torch.empty(0, head_dim, dtype=torch.float32)
        return empty, empty.clone(), (torch.empty(0, dtype=torch.int64) if positions else None)
    kt = torch.cat(ks).float()  # copies out of the views before the check below
    vt = torch.cat(vs).float()
    for b in head.blocks:
        if not b.keys:
            client.segments.check(b)
    pos = torch.tensor([p for run in ps for p in run], dtype=torch.int64) if positions else None
    return kt, vt, pos


# The most logits _attend_onto_past holds at once (fp32): a long prompt onto a long context is
# attended a block of queries at a time.
_MAX_LOGITS = 1 << 24


def _attend_onto_past(cache: KvTierCache, layer: int, query, key, value, past: int, scale: float,
                      groups: int):
    """Several new tokens (positions past .. past + q_len - 1) onto a cache holding `past`
    earlier ones: each query attends over every row stored before the forward (a Select whose
    budget covers the whole context returns each chunk whole) and over the new tokens' own keys
    and values up to its own position, as transformers' causal attention does over a dense
    cache. Output [q_len][q_heads][d], fp32."""
    q_len = query.shape[2]
    total = cache.layers[layer].tokens
    last = query[0, :, -1, :].detach().float().cpu().numpy()  # any query: the budget takes all
    # Over gRPC: the whole context's handles may not fit the channel's response area.
    sel = cache.client.select(cache.session_id, layer, last, include_data=cache.inline,
                              budget_tokens=min(total, 2**32 - 1))
    try:
        out = torch.empty(q_len, query.shape[1], query.shape[3], dtype=torch.float32)
        at = past + torch.arange(q_len, dtype=torch.int64)  # each new token's position
        for head in sel.heads:
            kt, vt, pos = _read(cache.client, head, cache.head_dim, positions=True)
            old = pos < past  # the rows this forward appended come from its own tensors
            if int(old.sum()) != past:
                raise RuntimeError(
                    f"layer {layer} KV head {head.kv_head}: a Select with the whole context as "
                    f"its budget returned {int(old.sum())} of the {past} rows stored before "
                    "this forward (was the session appended to outside this cache?)")
            k = torch.cat([kt[old], key[0, head.kv_head].detach().float().cpu()])
            v = torch.cat([vt[old], value[0, head.kv_head].detach().float().cpu()])
            p = torch.cat([pos[old], at])
            h0 = head.kv_head * groups
            qh = query[0, h0:h0 + groups].detach().float().cpu()  # [groups][q_len][d]
            step = max(1, _MAX_LOGITS // (groups * k.shape[0]))
            for i in range(0, q_len, step):
                j = min(q_len, i + step)
                logits = (qh[:, i:j] @ k.T) * scale  # [groups][j - i][rows]
                logits.masked_fill_(p[None, None, :] > at[None, i:j, None], float("-inf"))
                out[i:j, h0:h0 + groups] = (torch.softmax(logits, dim=-1) @ v).transpose(0, 1)
    finally:
        cache.client.release(sel.lease_id)
    return out


def kvtier_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                     **kwargs):
    """transformers' attention interface: (output [batch][q_len][heads][d], None)."""
    # The cache whose update just ran in this layer's forward, taken once: a forward with
    # another Cache (or none) after it finds none.
    cache = _ACTIVE.get()
    _ACTIVE.set(None)
    layer = module.layer_idx
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    q_len = query.shape[2]
    groups = query.shape[1] // key.shape[1]
    past = cache.layers[layer].tokens - q_len if cache is not None else 0
    if past == 0:
        # The prompt from an empty KvTierCache (key and value: its own), or a forward with
        # another cache, whose key and value hold its earlier tokens first: causal attention,
        # each query over the keys up to its own position.
        k = key.repeat_interleave(groups, dim=1)
        v = value.repeat_interleave(groups, dim=1)
        kv_len = k.shape[2]
        mask = None
        if kv_len != q_len:
            mask = (torch.arange(kv_len, device=query.device)[None, :] <=
                    torch.arange(kv_len - q_len, kv_len, device=query.device)[:, None])
        out = torch.nn.functional.scaled_dot_product_attention(
            query, k, v, attn_mask=mask, is_causal=mask is None and q_len > 1, scale=scale)
        return out.transpose(1, 2).contiguous(), None
    if q_len > 1:  # a prompt onto earlier tokens
        out = _attend_onto_past(cache, layer, query, key, value, past, scale, groups)
        return out.to(query.dtype)[None], None
    q = query[0, :, 0, :].detach().float().cpu().numpy()  # [q_heads][d]
    sel, on_channel = cache._select(layer, q, cache.budget_tokens)
    try:
        out = torch.empty(query.shape[1], query.shape[3], dtype=torch.float32)
        for head in sel.heads:
            kt, vt, _ = _read(cache.client, head, cache.head_dim)
            h0 = head.kv_head * groups
            qh = query[0, h0:h0 + groups, 0, :].float()
            weights = torch.softmax((qh @ kt.T) * scale, dim=-1)
            out[h0:h0 + groups] = weights @ vt
    finally:
        cache._release(sel.lease_id, on_channel)
    return out.to(query.dtype)[None, None], None


AttentionInterface.register("kvtier", kvtier_attention)
