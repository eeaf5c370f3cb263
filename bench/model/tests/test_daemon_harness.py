"""The harness's attention through kvtierd: the small variant of `make eval`."""
import numpy as np
import pytest

from conftest import BIN
from harness import prefill, run
from kvtier.v1 import kvtier_pb2 as pb
from policies import Daemon, Full, Quest, Window, mandatory_chunks


@pytest.fixture(scope="module")
def small(model, text_ids):
    return prefill(model, text_ids, 1024, 32)


@pytest.fixture(scope="module")
def token_major_full(model, small):
    """Full attention, token-major, over `small`: the reference several tests compare with."""
    policy = Full()
    policy.token_major = True
    return run(model, small, policy)


@pytest.fixture
def client(tmp_path):
    import kvtier
    from kvtier.daemon import LocalDaemon
    with LocalDaemon(BIN / "kvtierd", tmp_path) as d:
        with kvtier.Client(d.address) as c:
            yield c
        assert d.stop() == 0, d.log.read_text()


def test_full_through_the_daemon_matches_the_harness(model, small, client):
    """1K context, 32 scored tokens: every layer reads every token back from shared memory;
    the logits must equal the harness's own full attention to float tolerance."""
    ref = run(model, small, Full())
    through = Daemon(client, "daemon-full", None, lossless=True, dense_layers=1 << 20)
    got = run(model, small, through)
    np.testing.assert_allclose(got["logits"], ref["logits"], rtol=0, atol=1e-4)
    assert got["perplexity"] == pytest.approx(ref["perplexity"], rel=1e-5)
    assert through.inline_blocks == 0 and through.shm_blocks > 0
    assert got["selects"] == model.config.num_layers * 32
    assert client.list_sessions() == []  # the policy closed its session


def test_selection_policies_keep_the_budget_and_score_below_the_oracle(model, small, client):
    whole = Daemon(client, "kvtier-chunks", 128, refine_factor=1, chunking=pb.CHUNKING_CONTIGUOUS)
    for policy in (Window(128), Quest(128), whole, Daemon(client, "kvtier", 128)):
        rec = run(model, small, policy)
        assert 0 < rec["oracle_ratio_p10"] <= rec["oracle_ratio_mean"] <= 1 + 1e-6, rec
        assert rec["tokens_per_head_mean"] <= 128, rec
        if policy.name != "kvtier":  # whole chunks never beat the best whole chunks
            assert rec["chunk_oracle_ratio_mean"] <= 1 + 1e-6
        assert rec["perplexity"] > 1


def test_mandatory_chunks_follow_the_daemons_rule():
    # 100 tokens, sinks 16, window 32: chunk 0 (sinks) and chunks 4..6 (tokens 68..99).
    assert mandatory_chunks(100, 16, 32).tolist() == [0, 4, 5, 6]
    assert mandatory_chunks(10, 16, 32).tolist() == [0]


def test_token_major_runs_match_layer_major_ones(model, small, token_major_full):
    """Each token through every layer before the next (as a decoder runs) gives the logits
    of each layer over every token, to float tolerance: only the order of the work differs
    (one row's products against a whole batch's, whose float sums round differently, and
    K and V rounded to fp16 after them: 0.015 at most seen over 30 layers)."""
    ref = run(model, small, Full())
    got = token_major_full
    np.testing.assert_allclose(got["logits"], ref["logits"], rtol=0, atol=5e-2)
    assert got["perplexity"] == pytest.approx(ref["perplexity"], rel=1e-3)


def test_layer_budgets_by_need_keep_the_average_budget(model, small, client):
    """LAYER_BUDGET_BY_NEED moves rows between the layers of a step but not their mean."""
    split = Daemon(client, "kvtier-split", 128, layer_budget=pb.LAYER_BUDGET_BY_NEED)
    assert split.token_major  # a step's layers share its budget
    rec = run(model, small, split)
    assert abs(rec["tokens_per_head_mean"] - 128) < 2, rec
    assert 0 < rec["oracle_ratio_p10"] <= rec["oracle_ratio_mean"] <= 1 + 1e-6, rec


@pytest.mark.parametrize("ahead", ["step", "layer"])
def test_look_ahead_reads_what_was_asked_early_plus_the_newest_token(model, small, client, ahead,
                                                                      token_major_full):
    """A selection asked ahead (a step early with the last step's queries, or a layer early
    with the previous layer's query) misses only the newest token, which the worker adds: with
    every token returned, the logits equal full attention's (both token-major); with a budget,
    the rows stay within it (and the newest) and below the oracle."""
    ref = token_major_full
    everything = Daemon(client, f"daemon-full-ahead-{ahead}", None, lossless=True,
                        dense_layers=1 << 20, lookahead=ahead)
    got = run(model, small, everything)
    np.testing.assert_allclose(got["logits"], ref["logits"], rtol=0, atol=1e-4)
    budgeted = Daemon(client, f"kvtier-ahead-{ahead}", 128, lookahead=ahead)
    rec = run(model, small, budgeted)
    assert 0 < rec["oracle_ratio_p10"] <= rec["oracle_ratio_mean"] <= 1 + 1e-6, rec
    assert rec["tokens_per_head_mean"] <= 129, rec
    assert client.list_sessions() == []  # the leases asked ahead went with the session
