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
window and the chunks that matter, read through torch views over kvtierd's shared memory,
with no copy in between), whose lease ends right after. A forward of several tokens onto a
cache that holds earlier ones (the next turn of a chat, a prompt continued) attends, causally,
over every row stored before it (one Select a layer whose budget covers the context) and over
its own keys and values, as a prompt does over its own.
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
        self._cache.client.append_kv(self._cache.session_id,
                                     [(self._layer, self.tokens, k, v)])
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
        super().__init__(layers=[_KvTierLayer(self, i) for i in range(config.num_hidden_layers)])

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        """Appends the layer's new keys and values to the session (Cache.update); the
        attention function that follows in this layer's forward reads this cache."""
        _ACTIVE.set(self)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def close(self) -> None:
        """Closes the kvtierd session."""
        self.client.close_session(self.session_id)


def _read(client: kvtier.Client, head, head_dim: int):
    """The selected rows' positions (int64 [n]) and K and V (fp32 [n][head_dim]) of one
    HeadSelection, read straight from torch views over kvtierd's shared memory (each handle's
    selected rows converted in one copy, no gather buffer between), then checked: every slot
    still holds its handle's generation."""
    n = sum(len(b.rows) or b.num_tokens for b in head.blocks)
    kt = torch.empty(n, head_dim, dtype=torch.float32)
    vt = torch.empty(n, head_dim, dtype=torch.float32)
    pos = torch.empty(n, dtype=torch.int64)
    at = 0
    for b in head.blocks:
        if b.keys and b.precision == pb.PRECISION_BF16:  # inline bf16 bits
            k, v = (torch.frombuffer(bytearray(x), dtype=torch.bfloat16).reshape(b.num_tokens, -1)
                    for x in (b.keys, b.values))
        elif b.keys:  # the bytes came inline (a remote daemon)
            k, v = (torch.from_dlpack(np.frombuffer(x, np.float16).reshape(b.num_tokens, -1))
                    for x in (b.keys, b.values))
        else:
            k, v = client.view(b, head_dim, like="torch")
        p = torch.tensor(b.positions, dtype=torch.int64)
        if b.rows:
            rows = torch.tensor(b.rows, dtype=torch.int64)
            k, v, p = k.index_select(0, rows), v.index_select(0, rows), p.index_select(0, rows)
        m = k.shape[0]
        kt[at:at + m].copy_(k)
        vt[at:at + m].copy_(v)
        pos[at:at + m].copy_(p)
        at += m
    for b in head.blocks:
        if not b.keys:
            client.segments.check(b)
    return pos, kt, vt


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
    sel = cache.client.select(cache.session_id, layer, last, budget_tokens=min(total, 2**32 - 1))
    try:
        out = torch.empty(q_len, query.shape[1], query.shape[3], dtype=torch.float32)
        at = past + torch.arange(q_len, dtype=torch.int64)  # each new token's position
        for head in sel.heads:
            pos, kt, vt = _read(cache.client, head, cache.head_dim)
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
            logits = (qh @ k.T) * scale  # [groups][q_len][rows]
            logits.masked_fill_(p[None, None, :] > at[None, :, None], float("-inf"))
            out[:, h0:h0 + groups] = (torch.softmax(logits, dim=-1) @ v).transpose(0, 1)
    finally:
        cache.client.release(sel.lease_id)
    return out


def kvtier_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                     **kwargs):
    """transformers' attention interface: (output [batch][q_len][heads][d], None)."""
    cache = _ACTIVE.get()
    layer = module.layer_idx
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    q_len = query.shape[2]
    groups = query.shape[1] // key.shape[1]
    past = cache.layers[layer].tokens - q_len if cache is not None else 0
    if past == 0:
        # The prompt from an empty cache: causal attention over its own keys and values.
        k = key.repeat_interleave(groups, dim=1)
        v = value.repeat_interleave(groups, dim=1)
        out = torch.nn.functional.scaled_dot_product_attention(
            query, k, v, attn_mask=None, is_causal=q_len > 1, scale=scale)
        return out.transpose(1, 2).contiguous(), None
    if q_len > 1:  # a prompt onto earlier tokens
        out = _attend_onto_past(cache, layer, query, key, value, past, scale, groups)
        return out.to(query.dtype)[None], None
    q = query[0, :, 0, :].detach().float().cpu().numpy()  # [q_heads][d]
    sel = cache.client.select(cache.session_id, layer, q, budget_tokens=cache.budget_tokens)
    try:
        out = torch.empty(query.shape[1], query.shape[3], dtype=torch.float32)
        for head in sel.heads:
            _, kt, vt = _read(cache.client, head, cache.head_dim)
            h0 = head.kv_head * groups
            qh = query[0, h0:h0 + groups, 0, :].float()
            weights = torch.softmax((qh @ kt.T) * scale, dim=-1)
            out[h0:h0 + groups] = weights @ vt
    finally:
        cache.client.release(sel.lease_id)
    return out.to(query.dtype)[None, None], None


AttentionInterface.register("kvtier", kvtier_attention)
