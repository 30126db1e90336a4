"""TextStream: the pieces it gives, token by token, are those that decoding every id so far gives
(the rule before it decoded a window) and add up to the decode of all the ids, for the bundled
model's byte-level tokenizer and for a SentencePiece-style one (a leading "▁" that a decode drops at
its start, byte fallback for characters outside the vocabulary), on made-up texts and ids."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshd.shard.artifact import open_artifact
from meshd.shard.tokenizer import TextStream, load_tokenizer

SAMPLES = ["The capital of France is Paris.", "  two  spaces, tabs\tand\nnew lines\n\n",
           "naïve café, 日本語のテキスト, emoji 🐈‍⬛🎉 and ∑ x² ≠ y", "end with a space ", "ąęł 😀😀 ok",
           "code: `def f(x):\n    return x*2`", ""]


@pytest.fixture(scope="module")
def smollm2():
    return load_tokenizer(open_artifact("smollm2"))


@pytest.fixture(scope="module")
def sentencepiece_like():
    """A Llama-2-style tokenizer: spaces become "▁", a decode drops one leading space, characters
    outside the vocabulary go as UTF-8 byte tokens <0xNN>."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece in ["▁", *"abcdefghijklmnopqrstuvwxyzTFP,.:`()*2x", "▁the", "▁a"]:
        vocab.setdefault(piece, len(vocab))
    merges = [("▁", "t"), ("▁t", "h"), ("▁th", "e"), ("▁", "a")]
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def streamed(tok, ids) -> list[str]:
    stream = TextStream(tok)
    return [stream.push(t) for t in ids]


def by_whole_decodes(tok, ids) -> list[str]:
    """The pieces as decoding every id so far at each token gives them (the rule before the window):
    the reference. A decode ending in an unfinished character gives nothing until one does not."""
    pieces, emitted = [], 0
    for n in range(1, len(ids) + 1):
        text = tok.decode(ids[:n], skip_special_tokens=True)
        if text.endswith("\ufffd"):
            pieces.append("")
            continue
        pieces.append(text[emitted:])
        emitted = len(text)
    return pieces


@pytest.mark.parametrize("name", ["smollm2", "sentencepiece_like"])
def test_the_pieces_add_up_to_the_whole_decode(name, request):
    tok = request.getfixturevalue(name)
    for text in SAMPLES:
        ids = tok(text, add_special_tokens=False).input_ids
        assert "".join(streamed(tok, ids)) == tok.decode(ids, skip_special_tokens=True), text
        assert streamed(tok, ids) == by_whole_decodes(tok, ids)
        with_specials = [tok.eos_token_id, *ids[:3], tok.eos_token_id, *ids[3:]]  # skipped, as generation does
        assert "".join(streamed(tok, with_specials)) == tok.decode(with_specials, skip_special_tokens=True), text


@pytest.mark.parametrize("name", ["smollm2", "sentencepiece_like"])
def test_a_character_split_across_tokens_waits_for_its_last_byte(name, request):
    tok = request.getfixturevalue(name)
    ids = tok("🐈 cat", add_special_tokens=False).input_ids
    pieces = streamed(tok, ids)
    assert len(ids) > 3 and "".join(pieces) == tok.decode(ids) == "🐈 cat"
    assert "🐈" in next(p for p in pieces if p)  # the first text is the whole cat, never half of it
    assert "\ufffd" not in "".join(pieces)


@settings(max_examples=150, deadline=None)
@given(text=st.text(max_size=60))
def test_any_text_streams_to_its_decode_smollm2(smollm2, text):
    ids = smollm2(text, add_special_tokens=False).input_ids
    assert streamed(smollm2, ids) == by_whole_decodes(smollm2, ids)


@settings(max_examples=150, deadline=None)
@given(text=st.text(max_size=60))
def test_any_text_streams_to_its_decode_sentencepiece_like(sentencepiece_like, text):
    ids = sentencepiece_like(text, add_special_tokens=False).input_ids
    assert streamed(sentencepiece_like, ids) == by_whole_decodes(sentencepiece_like, ids)


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_any_ids_stream_to_their_decode(smollm2, sentencepiece_like, data):
    """Made-up ids, byte tokens that form no character included: a model can sample anything."""
    for tok in (smollm2, sentencepiece_like):
        ids = data.draw(st.lists(st.integers(0, len(tok) - 1), max_size=40))
        assert streamed(tok, ids) == by_whole_decodes(tok, ids)


def test_bytes_that_form_no_character_inside_the_window_stream_as_the_whole_decode_has_them(smollm2):
    """The example the property test above found: the window split the stray bytes into one replacement
    character where the whole decode has two."""
    ids = [197, 131, 3, 131, 259]
    assert streamed(smollm2, ids) == by_whole_decodes(smollm2, ids)
    assert "".join(streamed(smollm2, ids)) == smollm2.decode(ids, skip_special_tokens=True)
