"""The numpy SmolLM2 against independent expectations: the GGUF rotation convention, a known
completion, a plausible perplexity, the tokenizer's round trip, and the harness's token-by-token
decode loop against one causal forward."""
from pathlib import Path

import numpy as np
import pytest

from conftest import TEXT
from harness import Prefill, run
from llama import log_softmax, permute, rope_halves, rope_pairs, rope_tables, rmsnorm, unpermute
from policies import Full


def test_permute_inverts():
    w = np.random.default_rng(0).standard_normal((3 * 64, 10)).astype(np.float32)
    assert np.array_equal(unpermute(permute(w, 3), 3), w)
    assert not np.array_equal(permute(w, 3), w)


@pytest.mark.parametrize("layer", [0, 13, 29])
def test_scores_equal_under_both_rotation_conventions(model, text_ids, layer):
    """llama.cpp's file keeps q/k rows pair-interleaved for its adjacent-pair rotation; we
    unpermute and rotate halves. q.k must be the same either way, and wrong when mixed."""
    c = model.config
    rng = np.random.default_rng(layer)
    x = (model.embed[np.asarray(text_ids[:40])]
         + rng.standard_normal((40, c.dim)) * 0.1).astype(np.float32)
    h = rmsnorm(x, model.layers[layer]["attn_norm"], c.eps)
    pos = np.arange(100, 140)
    cos, sin = rope_tables(pos, c.head_dim, c.rope_theta)
    wq, wk = model.gguf_qk[layer]
    qg = rope_pairs((h @ wq.T).reshape(40, c.num_heads, c.head_dim), cos, sin)
    kg = rope_pairs((h @ wk.T).reshape(40, c.num_kv_heads, c.head_dim), cos, sin)
    qh = rope_halves((h @ unpermute(wq, c.num_heads).T).reshape(40, c.num_heads, c.head_dim),
                     cos, sin)
    kh = rope_halves((h @ unpermute(wk, c.num_kv_heads).T).reshape(40, c.num_kv_heads,
                                                                    c.head_dim), cos, sin)
    mixed_q = rope_halves((h @ wq.T).reshape(40, c.num_heads, c.head_dim), cos, sin)
    mixed_k = rope_halves((h @ wk.T).reshape(40, c.num_kv_heads, c.head_dim), cos, sin)
    for head in range(c.num_heads):
        kv = head // c.group
        s_gguf = qg[:, head] @ kg[:, kv].T
        s_hf = qh[:, head] @ kh[:, kv].T
        np.testing.assert_allclose(s_hf, s_gguf, rtol=1e-4, atol=1e-3 * np.abs(s_gguf).max())
        s_mixed = mixed_q[:, head] @ mixed_k[:, kv].T
        assert np.abs(s_mixed - s_gguf).max() > 1e-2 * np.abs(s_gguf).max()
    # And the model's own qkv() is the halves convention on the unpermuted weights.
    q, k, _ = model.qkv(layer, x, pos)
    np.testing.assert_allclose(q, qh, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(k, kh, rtol=1e-3, atol=1e-2)  # k is rounded to fp16


def test_capital_of_france_is_paris(model):
    ids = model.tokenizer.encode("The capital of France is")
    logits, _, _, _ = model.prefill(ids)
    assert model.tokenizer.decode([int(np.argmax(logits[-1]))]) == " Paris"


def test_perplexity_on_a_long_real_text_is_plausible(model, text_ids):
    ids = np.asarray(text_ids[:1024])
    logits, _, _, _ = model.prefill(ids)
    nll = -log_softmax(logits[:-1])[np.arange(len(ids) - 1), ids[1:]]
    ppl = float(np.exp(nll.mean()))
    # A 135M model on legal English: well above 1, far below the vocabulary's 49152.
    assert 3 < ppl < 60, ppl
    # The model uses its context: the same tokens in a shuffled order are far less predictable.
    shuffled = np.random.default_rng(0).permutation(ids)
    logits, _, _, _ = model.prefill(shuffled)
    nll_shuffled = -log_softmax(logits[:-1])[np.arange(len(ids) - 1), shuffled[1:]]
    assert np.exp(nll_shuffled.mean()) > 3 * ppl


def test_tokenizer_round_trips_and_splits_digits(model):
    tok = model.tokenizer
    text = Path(TEXT).read_text()
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert len(ids) < len(text) / 3  # merges happen: English runs ~4.6 characters a token
    s = "In 2024, naïve café owners paid €1.5M — ok?\n\n  Indented."
    assert tok.decode(tok.encode(s)) == s
    digits = tok.encode("x 2024")
    assert [tok.tokens[i] for i in digits[-4:]] == ["2", "0", "2", "4"]
    assert [tok.tokens[i] for i in tok.encode("The capital")] == ["The", "Ġcapital"]


def test_decode_loop_with_full_attention_matches_one_causal_forward(model, text_ids):
    """The harness's layer-major, token-by-token loop against Model.prefill over the same
    tokens: the logits of the scored positions must agree to float tolerance."""
    P, S = 200, 12
    ids = np.asarray(text_ids[:P + S + 1])
    logits, _, _, _ = model.prefill(ids[:P + S])
    _, K, V, _ = model.prefill(ids[:P], want_logits=False)
    rec = run(model, Prefill(ids=ids, context=P, scored=S, K=K, V=V), Full())
    # Products of other shapes round differently by ~1e-6, and an fp16 rounding of K or V can
    # then land one ulp apart; over 30 layers that is ~1e-2 on logits of magnitude ~20. A
    # wrong position, mask or cache entry moves them by whole units.
    np.testing.assert_allclose(rec["logits"], logits[P:P + S], rtol=0, atol=0.05)
    assert np.array_equal(rec["logits"].argmax(-1), logits[P:P + S].argmax(-1))
