"""Tokenizers: known GPT-2 ids, round trips, offline hash checks, deterministic BPE training."""

import shutil
from pathlib import Path

import pytest

from andrea.data.tokenizer import (
    EOT_TEXT,
    ByteTokenizer,
    Gpt2Tokenizer,
    gpt2_vocab_files,
    load_tokenizer,
    train_bpe,
)
from andrea.errors import UserError

NON_ASCII = "Ünïcödé — naïve café, 日本語 🙂\n\tzürich  Ελληνικά\r\n"


@pytest.fixture(scope="module")
def sample() -> str:
    from andrea.data.corpus import shakespeare

    plays = shakespeare()
    return plays[0][1][:60_000] + plays[-1][1][:60_000]


@pytest.fixture(scope="module")
def gpt2() -> Gpt2Tokenizer:
    return Gpt2Tokenizer()


@pytest.fixture(scope="module")
def bpe(tmp_path_factory, sample):
    path = tmp_path_factory.mktemp("bpe") / "tokenizer.json"
    return train_bpe(iter([sample]), 512, path)


def test_gpt2_known_ids(gpt2):
    assert gpt2.encode("Hello world") == [15496, 995]
    assert gpt2.encode("The quick brown fox") == [464, 2068, 7586, 21831]
    assert gpt2.vocab_size == 50257 and gpt2.eot_id == 50256
    assert gpt2.decode([50256]) == EOT_TEXT


def test_gpt2_matches_independent_implementation(gpt2, sample):
    # transformers' pure-Python GPT-2 BPE reads the same two files by a different route.
    transformers = pytest.importorskip("transformers", reason="reference implementation")
    encoder_json, vocab_bpe = gpt2_vocab_files()
    ref = transformers.GPT2Tokenizer(str(encoder_json), str(vocab_bpe))
    for text in (sample[:5000], NON_ASCII, "  spaces   and\ttabs\n\n", "don't we'll I'M"):
        assert gpt2.encode(text) == ref.encode(text)


def test_gpt2_rejects_wrong_vocabulary_file(tmp_path):
    encoder_json, vocab_bpe = gpt2_vocab_files()
    bad = tmp_path / "encoder.json"
    shutil.copy(encoder_json, bad)
    with open(bad, "ab") as f:
        f.write(b" ")
    with pytest.raises(UserError, match=r"encoder.json: sha256 .* is not GPT-2's"):
        Gpt2Tokenizer(encoder_json=bad, vocab_bpe=vocab_bpe)


@pytest.mark.parametrize("kind", ["gpt2", "bpe", "byte"])
def test_round_trip(kind, gpt2, bpe, sample):
    tok = {"gpt2": gpt2, "bpe": bpe, "byte": ByteTokenizer()}[kind]
    for text in (sample, NON_ASCII, "", "\n"):
        ids = tok.encode(text)
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == text
    # Literal end-of-text characters are plain text, never the end-of-text id.
    ids = tok.encode(f"a{EOT_TEXT}b")
    assert tok.eot_id not in ids and tok.decode(ids) == f"a{EOT_TEXT}b"
    assert tok.decode(tok.encode("x") + [tok.eot_id]) == "x" + EOT_TEXT


def test_byte_tokenizer_ids_and_invalid_utf8():
    tok = ByteTokenizer()
    assert tok.encode("é") == [0xC3, 0xA9] and tok.vocab_size == 257 and tok.eot_id == 256
    assert tok.decode([0xC3, 65]) == "\ufffdA"  # a cut sequence decodes, replaced


def test_bpe_training_is_deterministic_and_sized(tmp_path, bpe, sample):
    again = train_bpe(iter([sample]), 512, tmp_path / "tokenizer.json")
    assert again.identity == bpe.identity
    assert (tmp_path / "tokenizer.json").read_bytes() == bpe.path.read_bytes()
    assert bpe.vocab_size == 512 and bpe.eot_id == 511
    assert len(bpe.encode(sample)) < 0.7 * len(sample.encode())  # it actually merges


def test_bpe_line_batches_equal_whole_string(bpe, sample):
    whole = bpe._tok.encode(sample, add_special_tokens=False).ids
    assert bpe.encode(sample) == whole


def test_bpe_line_batches_keep_merged_whitespace(tmp_path):
    """Lines are cut only between two non-space characters: a BPE that merged runs of
    whitespace ("\\n\\n", " \\n", as GPT-2's own has ĊĊ) encodes them as in the whole string.
    Mutation round 3: cutting after every line break passed every test (Shakespeare's lines
    gave a 512-id BPE no such merge)."""
    texts = ["word \nword\n\n\nword  \n\n word\n", "x\n \ny \n\n\n\nz\n"] * 300
    tok = train_bpe(iter(texts), 300, tmp_path / "tokenizer.json")
    for text in ("a \nb", "one\n\n\ntwo", "end  \n\n next", "x \n \ny", texts[0] * 3):
        whole = tok._tok.encode(text, add_special_tokens=False).ids
        assert tok.encode(text) == whole, text


def test_bpe_reload_and_missing(tmp_path, bpe):
    tok = load_tokenizer("bpe", bpe.path.parent)
    assert tok.identity == bpe.identity
    with pytest.raises(UserError, match="no trained BPE tokenizer"):
        load_tokenizer("bpe", tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(UserError, match="not a readable BPE tokenizer"):
        load_tokenizer("bpe", tmp_path)


def test_bpe_vocab_too_small(tmp_path):
    with pytest.raises(UserError, match="vocab size 100 is too small"):
        train_bpe(iter(["abc"]), 100, Path(tmp_path) / "t.json")


def test_a_tokenizer_kind_is_one_entry_in_its_registry(monkeypatch):
    """A throwaway kind added to data.tokenizer.KINDS alone: data.tokenizer allows it
    (validation, the key's listing); with a file of its own it takes data.tokenizer_file, and
    the refusal of one for a kind without a file names the kinds that have one."""
    from andrea.config import key_spec, load_config
    from andrea.data import tokenizer

    monkeypatch.setitem(tokenizer.KINDS, "unigram",
                        tokenizer.TokenizerKind("unigram", None, 0.3, file="unigram.json"))
    assert key_spec("data.tokenizer").allowed == "gpt2, bpe, byte, unigram"
    given = load_config("andrea-tiny", ["data.tokenizer=unigram", "data.tokenizer_file=u.json"])
    assert given.data.tokenizer_file == "u.json"
    with pytest.raises(UserError, match=r"data\.tokenizer_file applies to data\.tokenizer bpe, "
                                        r"unigram only, not byte; set data\.tokenizer=bpe or"):
        load_config("andrea-tiny", ["data.tokenizer=byte", "data.tokenizer_file=u.json"])


def test_a_given_bpe_without_every_byte_is_refused(tmp_path):
    """A byte-level BPE trained without ByteLevel's initial alphabet has no token for the bytes
    its text lacked: HF drops them from the ids silently, so such a file is refused, naming it."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers, trainers
    from tokenizers import Tokenizer as HfTokenizer

    from andrea.data.tokenizer import read_tokenizer_file

    hf = HfTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.train_from_iterator(["hello world"] * 20, trainers.BpeTrainer(vocab_size=40))
    hf.add_special_tokens([AddedToken(EOT_TEXT, special=True)])
    hf.save(str(tmp_path / "ascii.json"))
    with pytest.raises(UserError, match=r"ascii.json: has no token for \d+ of the 256 bytes") \
            as err:
        read_tokenizer_file(tmp_path / "ascii.json")
    assert "\n" not in str(err.value)


def test_a_given_bpe_with_a_prefix_space_keeps_the_lines_as_they_are(tmp_path):
    """encode cuts a text at its line breaks to batch them, which only GPT-2's pre-tokenizer
    allows: one that adds a prefix space added it to every line, not once to the text."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers, trainers
    from tokenizers import Tokenizer as HfTokenizer

    from andrea.data.tokenizer import read_tokenizer_file

    hf = HfTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    hf.decoder = decoders.ByteLevel()
    hf.train_from_iterator(["Hi there\nyou\n"] * 20, trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf.add_special_tokens([AddedToken(EOT_TEXT, special=True)])
    hf.save(str(tmp_path / "prefix.json"))
    _, tok = read_tokenizer_file(tmp_path / "prefix.json")
    text = "Hi there\nyou\nthere\n"
    assert tok.encode(text) == hf.encode(text, add_special_tokens=False).ids
    assert tok.decode(tok.encode(text)) == " " + text  # the tokenizer's one space, no more


def test_a_given_bpe_counts_the_bytes_of_its_added_tokens(tmp_path):
    """Bits per byte divide by token_byte_lengths: an added token that is text ("hello world",
    added with add_tokens) stands for its own bytes, not 0."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers, trainers
    from tokenizers import Tokenizer as HfTokenizer

    from andrea.data.tokenizer import read_tokenizer_file

    hf = HfTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.train_from_iterator([NON_ASCII] * 5, trainers.BpeTrainer(
        vocab_size=270, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf.add_tokens(["hello wörld"])
    hf.add_special_tokens([AddedToken("<|im_start|>", special=True),
                           AddedToken(EOT_TEXT, special=True)])
    hf.save(str(tmp_path / "added.json"))
    _, tok = read_tokenizer_file(tmp_path / "added.json")
    text = f"say hello wörld <|im_start|> {NON_ASCII}"
    ids = tok.encode(text)
    assert hf.token_to_id("hello wörld") in ids and tok.decode(ids) == text
    assert tok.token_byte_lengths()[ids].sum() == len(text.encode("utf-8"))


def test_a_given_bpe_without_a_byte_level_decoder_is_refused(tmp_path, bpe):
    """A byte-level BPE whose tokenizer.json has no ByteLevel decoder decodes to the byte
    map's characters ('ĠworldĊ'): generate would print that, so the file is refused."""
    import json

    from andrea.data.tokenizer import read_tokenizer_file

    spec = json.loads(bpe.path.read_text(encoding="utf-8"))
    spec["decoder"] = None
    (tmp_path / "nodecoder.json").write_text(json.dumps(spec), encoding="utf-8")
    with pytest.raises(UserError, match=r"nodecoder.json: its decoder is not ByteLevel"):
        read_tokenizer_file(tmp_path / "nodecoder.json")
    assert read_tokenizer_file(bpe.path)[1].decode(bpe.encode(NON_ASCII)) == NON_ASCII


def test_a_given_bpe_with_dropout_is_refused(tmp_path, bpe):
    """BPE-dropout in a tokenizer.json (model.dropout) skips merges at random on every encode:
    the same text would make other ids each time, so the file is refused, naming the key."""
    import json

    from andrea.data.tokenizer import read_tokenizer_file

    spec = json.loads(bpe.path.read_text(encoding="utf-8"))
    spec["model"]["dropout"] = 0.5
    (tmp_path / "dropout.json").write_text(json.dumps(spec), encoding="utf-8")
    with pytest.raises(UserError, match=r"dropout.json: its BPE dropout \(0.5\) makes encoding "
                                        r"random; set model.dropout to null"):
        read_tokenizer_file(tmp_path / "dropout.json")
