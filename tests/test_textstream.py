"""Incremental decoding of a streamed answer: after every token the text is exactly the decode of all tokens so far,
what is shown is never taken back, stop strings split over tokens end the answer, and each token's text maps to the
piece it is streamed in. Checked on toy byte-level and byte-fallback decoders, and on the real Qwen3 and Gemma-3
tokenizers."""
from __future__ import annotations

import random

import pytest

from pop_vlm import Pipeline
from pop_vlm.textstream import CONTEXT_TOKENS, DecodedText, check_stop, first_stop, local_decode

TEXTS = [
    "The cat sat on the mat. Then it left, quietly!",
    "Grüße aus Köln — naïve café, déjà vu.",
    "你好，世界！这是一个测试。日本語のテキストも。",
    "Emoji: 🎉🧌🫨 👩‍👩‍👧 and flags 🇫🇷🇯🇵 in a row",
    "Rare scripts: 𝔘𓀀ꙮ𒀱 𐍈 ᚠᛇᚻ and Ελληνικά, русский, العربية, हिन्दी",
    "  leading spaces,\ttabs\nand\n\nnewlines  ",
    "Q: what is 2+2?\nA: 4\nQ: and 3+3?\nA: 6",
]


def check_stream(decode, ids, stop=None) -> DecodedText:
    """Feed `ids` one at a time, as the generation loop does (one list, growing). After each token the text must be
    the whole decode (cut before a stop string); what may be shown must only grow, and end as a beginning of the
    final text, so that the pieces streamed and the rest add up to it."""
    stops = check_stop(stop)
    tracker, so_far, settled, views = DecodedText(decode, stop), [], [], []
    for token in ids:
        so_far.append(token)
        stopped = tracker.add(so_far)
        whole = decode(so_far)
        cut = first_stop(whole, stops)
        assert tracker.text == (whole if cut is None else whole[:cut]), so_far
        assert stopped == (cut is not None)
        settled.append(whole[:cut].rstrip("\ufffd"))
        if stopped:
            break
        views.append(tracker.visible())
    final = tracker.visible(final=True)
    assert final == tracker.text and len(tracker._ends) == len(so_far)
    if decode_never_retracts(settled, final):
        for before, after in zip(views, [*views[1:], final]):
            assert after.startswith(before), (before, after, so_far)
    return tracker


def decode_never_retracts(settled: list[str], final: str) -> bool:
    """Whether the decode itself keeps every complete character it once gave. A byte-fallback decode does not when
    an invalid byte joins a run of byte tokens: the whole run, characters already complete included, turns into
    U+FFFD; what was shown of them cannot be taken back."""
    return all(final.startswith(text) for text in settled)


# ---- toy decoders ------------------------------------------------------------------------------------------------
SPECIAL = 256  # a special token, skipped by every toy decoder
WORDS = ["▁the", "▁cat", "▁sat", ".", ",", "▁", "Q", ":", "\n", "▁你好", "é", "▁🎉"]


def byte_level(ids) -> str:
    """Qwen-style: every token is bytes; invalid UTF-8 decodes as U+FFFD, one per maximal invalid subpart."""
    return bytes(i for i in ids if i < SPECIAL).decode("utf-8", "replace")


def byte_fallback(ids, strip: bool = False) -> str:
    """SentencePiece-style: ids < 256 are byte tokens, the rest words with ▁ for a space; a run of byte tokens that
    is not valid UTF-8 decodes as one U+FFFD per byte (Gemma, Llama); `strip`: the leading space of the text is
    dropped (Llama, Gemma 1)."""
    out, run = [], []
    for i in [*(i for i in ids if i != SPECIAL), None]:  # special tokens are skipped before the decoder runs
        if i is not None and i < 256:
            run.append(i)
            continue
        try:
            out.append(bytes(run).decode("utf-8"))
        except UnicodeDecodeError:
            out.append("\ufffd" * len(run))
        run = []
        if i is not None and i > SPECIAL:
            out.append(WORDS[i - SPECIAL - 1].replace("▁", " "))
    text = "".join(out)
    return text[1:] if strip and text.startswith(" ") else text


def fallback_ids(text: str, rng: random.Random) -> list[int]:
    """`text` as byte-fallback tokens: known words where they fit, bytes elsewhere, special tokens here and there."""
    words = {w.replace("▁", " "): SPECIAL + 1 + i for i, w in enumerate(WORDS)}
    ids, i = [], 0
    while i < len(text):
        word = next((w for w in sorted(words, key=len, reverse=True) if text.startswith(w, i)), None)
        if word:
            ids.append(words[word])
            i += len(word)
        else:
            ids += list(text[i].encode())
            i += 1
        if rng.random() < 0.1:
            ids.append(SPECIAL)
    return ids


def noisy_bytes(text: str, rng: random.Random) -> list[int]:
    """The UTF-8 bytes of `text` with a few random bytes and special tokens thrown in."""
    ids = []
    for b in text.encode():
        ids.append(b)
        if rng.random() < 0.03:
            ids.append(rng.randrange(256))
        if rng.random() < 0.05:
            ids.append(SPECIAL)
    return ids


@pytest.mark.parametrize("seed", range(20))
def test_byte_level_text_is_the_whole_decode_after_every_token(seed):
    rng = random.Random(seed)
    decode = local_decode(byte_level)
    check_stream(decode, noisy_bytes(rng.choice(TEXTS), rng))
    check_stream(decode, [rng.randrange(257) for _ in range(80)])


@pytest.mark.parametrize("strip", [False, True])
@pytest.mark.parametrize("seed", range(20))
def test_byte_fallback_text_is_the_whole_decode_after_every_token(seed, strip):
    rng = random.Random(seed)
    decode = local_decode(lambda ids: byte_fallback(ids, strip))
    check_stream(decode, fallback_ids(rng.choice(TEXTS), rng))
    check_stream(decode, [rng.choice([rng.randrange(256), SPECIAL, SPECIAL + 1 + rng.randrange(len(WORDS))])
                          for _ in range(80)])


def test_a_stripped_leading_space_after_special_tokens_stays_in_the_middle():
    decode = local_decode(lambda ids: byte_fallback(ids, strip=True))
    the, cat, space = (SPECIAL + 1 + WORDS.index(w) for w in ("▁the", "▁cat", "▁"))
    tracker = check_stream(decode, [SPECIAL, the, SPECIAL, SPECIAL, cat, space, SPECIAL, space, SPECIAL, cat])
    assert tracker.text == "the cat   cat"


def test_an_emoji_over_byte_tokens_is_shown_once_complete_with_the_logprobs_of_all_its_tokens():
    decode = local_decode(byte_level)
    ids = list("ab🎉c".encode())
    tracker, so_far, shown = DecodedText(decode), [], []
    for token in ids:
        so_far.append(token)
        tracker.add(so_far)
        shown.append(tracker.visible())
    assert shown == ["a", "ab", "ab", "ab", "ab", "ab🎉", "ab🎉c"]
    assert tracker.tokens_covering(len("ab🎉")) == 6  # the four bytes of the emoji begin in its piece
    assert tracker.tokens_covering(len("ab")) == 2 and tracker.tokens_covering(0) == 0
    so_far.pop()
    tracker = DecodedText(decode)
    tracker.add(so_far[:4])  # an answer that ends inside the emoji ends with U+FFFD, as the whole decode does
    assert tracker.visible() == "ab" and tracker.visible(final=True) == "ab\ufffd" == tracker.text
    assert tracker.tokens_covering(len(tracker.text)) == 4


def word(text: str) -> int:
    return SPECIAL + 1 + WORDS.index(text)


def test_a_stop_string_split_over_tokens_is_held_back_then_cuts_the_text():
    decode = local_decode(byte_fallback)
    ids = [word(w) for w in ("▁the", "▁cat", "\n", "Q", ":", "▁the")]
    tracker, so_far, shown = DecodedText(decode, stop=["\nQ:"]), [], []
    for token in ids:
        so_far.append(token)
        if tracker.add(so_far):
            break
        shown.append(tracker.visible())
    assert shown == [" the", " the cat", " the cat", " the cat"] and len(so_far) == 5
    assert tracker.text == tracker.visible() == " the cat"
    for stop in ["\nQ:", ["é", "Q:"], "cat\n", "Q: the"]:
        check_stream(decode, ids, stop)


def test_a_stop_string_before_an_incomplete_character_of_the_same_token_is_found_at_once():
    pieces = [b"ab", b" \xf0\x9f", b"\x8e\x89", b" c"]  # " 🎉" split inside the emoji, as byte-level BPE does
    decode = local_decode(lambda ids: b"".join(pieces[i] for i in ids).decode("utf-8", "replace"))
    tracker = check_stream(decode, [0, 1, 2, 3], stop=" ")
    assert tracker.stopped and tracker.text == "ab" and len(tracker._ends) == 2
    tracker = check_stream(decode, [0, 1, 2, 3], stop="🎉 c")
    assert tracker.text == "ab " and len(tracker._ends) == 4


def test_windows_stay_short_and_unmarked_decodes_are_whole():
    calls = []

    def counted(ids):
        calls.append(len(ids))
        return byte_level(ids)

    ids = list(("The cat sat on the mat, 你好 🎉. " * 40).encode())
    tracker, so_far = DecodedText(local_decode(counted)), []
    for token in ids:
        so_far.append(token)
        tracker.add(so_far)
    assert tracker.text == byte_level(ids)
    assert max(calls) <= 2 * CONTEXT_TOKENS + 4  # the four bytes of an emoji wait for each other
    assert sum(calls) < 12 * len(ids)
    calls.clear()
    tracker, so_far = DecodedText(counted), []
    for token in ids[:50]:
        so_far.append(token)
        tracker.add(so_far)
    assert calls == list(range(1, 51)) and tracker.text == byte_level(ids[:50])


def test_any_callable_gets_its_whole_decode():
    # each token's text depends on how many came before: only a whole decode can tell, so such a decode is not
    # marked local; one that is, but whose windows do not extend their prefix, is caught and decoded whole
    check_stream(lambda ids: "".join(f"{i}:{t} " for i, t in enumerate(ids)), list(range(40)), stop="9:9")
    reverse = local_decode(lambda ids: "".join(chr(65 + i % 26) for i in reversed(ids)))
    check_stream(reverse, list(range(30)))
    check_stream(reverse, list(range(30)), stop="ZY")


def test_spaces_cleaned_up_across_three_tokens_are_seen_by_the_window():
    # the clean-up of older tokenizers (transformers' clean_up_tokenization_spaces) joins " ' " over the tokens on
    # both sides of the quote: a window of the last token alone would keep "' s" apart
    vocab = ["it", "'", "s", "fine", ".", "isn", "n't", "!"]

    def cleaned(ids):
        text = " ".join(vocab[i] for i in ids)
        for spaced, joined in [(" .", "."), (" !", "!"), (" ' ", "'"), (" n't", "n't")]:
            text = text.replace(spaced, joined)
        return text

    for shift in range(2 * CONTEXT_TOKENS):  # wherever the window starts
        tracker = check_stream(local_decode(cleaned), [3] * shift + [0, 1, 2, 3, 4, 5, 6, 3, 7, 0, 1, 2])
        assert tracker.text == "fine " * shift + "it's fine. isnn't fine! it's"


def test_tokens_that_are_not_the_ones_seen_so_far_are_decoded_afresh():
    tracker = DecodedText(local_decode(byte_level))
    tracker.add(list(b"hello"))
    assert not tracker.add(list(b"help")) and tracker.text == "help"
    assert not tracker.add(list(b"help me")) and tracker.text == "help me" and len(tracker._ends) == 7


def test_the_pipeline_decode_is_marked_local():
    assert Pipeline.decode.local_decode


# ---- real tokenizers ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def qwen():
    pytest.importorskip("transformers")
    from pop_vlm.offline_tokenizers import qwen3_tokenizer

    try:
        return qwen3_tokenizer()
    except RuntimeError as error:
        pytest.skip(str(error))


@pytest.fixture(scope="module")
def gemma():
    from transformers import AutoTokenizer

    from pop_vlm import zoo

    try:
        return AutoTokenizer.from_pretrained(zoo.gemma3_270m(progress=False))
    except ValueError as error:  # neither converted nor convertible here
        pytest.skip(str(error))


def token_decode(tokenizer):
    return local_decode(lambda ids: tokenizer.decode(ids, skip_special_tokens=True))


def real_sequences(tokenizer, specials: list[int], seed: int) -> list[list[int]]:
    """Encoded multilingual text with special tokens thrown in, and random ids from the whole vocabulary."""
    rng = random.Random(seed)
    encoded = []
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        for _ in range(2):
            ids.insert(rng.randrange(len(ids) + 1), rng.choice(specials))
        encoded.append(ids)
    return encoded + [[rng.randrange(len(tokenizer)) for _ in range(60)] for _ in range(15)]


def test_qwen3_text_is_the_whole_decode_after_every_token(qwen):
    decode = token_decode(qwen)
    for ids in real_sequences(qwen, qwen.all_special_ids, seed=0):
        check_stream(decode, ids)
    ids = qwen.encode(TEXTS[6], add_special_tokens=False)
    tracker = check_stream(decode, ids, stop="\nQ: and")
    assert tracker.text == "Q: what is 2+2?\nA: 4"


def test_qwen3_emoji_over_several_tokens(qwen):
    ids = qwen.encode("ok 🫨🧌", add_special_tokens=False)
    assert any("\ufffd" in qwen.decode(ids[:n]) for n in range(1, len(ids)))  # the emoji spans tokens
    tracker = check_stream(token_decode(qwen), ids)
    assert tracker.tokens_covering(len(tracker.text)) == len(ids)


@pytest.mark.slow
def test_gemma3_text_is_the_whole_decode_after_every_token(gemma):
    decode = token_decode(gemma)
    specials = [gemma.convert_tokens_to_ids(t) for t in ("<start_of_turn>", "<end_of_turn>", "<eos>", "<pad>")]
    for ids in real_sequences(gemma, specials, seed=1):
        check_stream(decode, ids)
    ids = gemma.encode("a 𝔘𓀀ꙮ b", add_special_tokens=False)
    assert len(ids) > 12  # byte-fallback tokens
    tracker = check_stream(decode, ids, stop="ꙮ b")
    assert tracker.text == "a 𝔘𓀀"


@pytest.mark.slow
def test_gemma3_with_a_stripped_leading_space_and_special_tokens_in_the_middle(gemma):
    from tokenizers import Tokenizer, decoders

    backend = Tokenizer.from_str(gemma.backend_tokenizer.to_str())
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])  # the Llama / Gemma 1 decoder
    decode = local_decode(lambda ids: backend.decode(ids, skip_special_tokens=True))
    bos, turn = gemma.bos_token_id, gemma.convert_tokens_to_ids("<end_of_turn>")
    words = gemma.encode(" Hello world, again 🫨 you", add_special_tokens=False)
    ids = [bos, turn, *words[:2], turn, turn, *words[2:4], bos, *words[4:]]
    tracker = check_stream(decode, ids)
    assert tracker.text == "Hello world, again 🫨 you"
    for ids in real_sequences(gemma, [bos, turn], seed=2)[:8]:
        check_stream(decode, ids)
