"""The passkey task: the haystack has the length and the needle where asked, the answer check
reads the first number, and full attention finds a key at a short context."""
from policies import Full
from retrieval import answer, haystack, retrieved


def test_the_haystack_has_its_length_and_the_needle_at_its_depth(model):
    for depth in (0.1, 0.5, 0.9):
        hay = haystack(model.tokenizer, 600, depth, "12345")
        assert hay.length == 600
        text = model.tokenizer.decode(hay.context)
        assert text.count("The pass key is 12345.") == 1
        at = text.index("The pass key is 12345.") / len(text)
        assert abs(at - depth) < 0.12, (depth, at)
        assert model.tokenizer.decode(hay.question).strip() == "What is the pass key? The pass key is"


def test_an_answer_passes_when_its_first_number_is_the_key():
    assert retrieved(" 12345. Remember it.", "12345")
    assert retrieved(" 12345", "12345")
    assert not retrieved(" 12354.", "12345")
    assert not retrieved(" 1234", "12345")
    assert not retrieved(" the key.", "12345")
    assert not retrieved(" 7 and then 12345", "12345")


def test_full_attention_finds_the_key_in_a_short_haystack(model):
    hay = haystack(model.tokenizer, 700, 0.3, "40721")
    _, K, V, _ = model.prefill(hay.context, want_logits=False)
    text = answer(model, hay, K, V, Full())
    assert retrieved(text, hay.key), text
