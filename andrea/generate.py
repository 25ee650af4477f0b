"""`andrea generate`: sample text from a checkpoint, streamed as it is produced.

With the key/value cache (the default) the prompt is run once (prefill) and every new token then
costs one position: the model sees only that token and attends to the cached keys and values.
When the cache is full (block_size positions), it slides: the last block_size // 2 tokens are
run again as a fresh prefill and decoding continues after them. Without the cache every step runs
the whole context (the last block_size tokens) again. The two agree exactly while the text fits
in block_size; past it they differ by design (half-block versus full-block context after a slide).

An empty prompt (none, `--prompt ""` or `--prompt-ids ""`) samples unconditionally: the context
is the end-of-text token, which ends every document in the training shards (so what follows it
is a new document), and it is not printed.

Sampling: logits / temperature, then top-k, then top-p (the smallest set of most likely tokens
whose probability reaches p), drawn with a CPU torch.Generator seeded by `seed`, so a seed
repeats on any device. Temperature 0 is greedy (argmax). Ids the tokenizer cannot produce (the
model's vocab padding) are never drawn.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable, Iterator, Sequence

import torch

from andrea.config import PRECISIONS
from andrea.data.tokenizer import Tokenizer
from andrea.errors import UserError
from andrea.model.transformer import Andrea, KVCache


def check_sampling(temperature: float, top_k: int | None, top_p: float | None) -> None:
    if not 0 <= temperature < math.inf:  # also refuses NaN
        raise UserError(f"--temperature: must be a finite number >= 0 (0 is greedy), got "
                        f"{temperature}")
    if top_k is not None and top_k < 1:
        raise UserError(f"--top-k: must be a positive integer, got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise UserError(f"--top-p: must be in (0, 1], got {top_p}")


def check_prompt_ids(ids: Sequence[int], n_valid: int) -> None:
    bad = [i for i in ids if not 0 <= i < n_valid]
    if bad:
        raise UserError(f"prompt: token id {bad[0]} is outside the vocabulary (0..{n_valid - 1})")


def seeded_generator(seed: int | None) -> torch.Generator:
    """A CPU generator seeded by `seed` (random when None), so a seed repeats on any device."""
    if seed is not None and not 0 <= seed < 2**63:  # what the generator takes
        raise UserError(f"--seed: must be an integer from 0 to {2**63 - 1}, got {seed}")
    generator = torch.Generator()
    generator.manual_seed(seed if seed is not None else int.from_bytes(os.urandom(8)) >> 1)
    return generator


def pick_next(
    logits: torch.Tensor,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    generator: torch.Generator,
) -> int:
    """One id from logits [vocab] (already -inf where forbidden)."""
    if temperature == 0:
        return int(torch.argmax(logits))
    # Shifted to at most 0 and in float64, a temperature near 0 is near greedy and a large one
    # near uniform: never 0/0, inf/inf or an overflow, which softmax turns into NaN.
    logits = logits.double().cpu()
    logits = (logits - logits.max()) / temperature
    if top_k is not None and top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p is not None and top_p < 1:
        sorted_probs, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass of the better ones
        sorted_probs[before >= top_p] = 0.0  # the most likely token always stays
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))


@torch.no_grad()
def generate(
    model: Andrea,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    stop_at_eot: bool = True,
    use_cache: bool = True,
    *,
    eot_id: int | None = None,
    n_valid: int | None = None,
    generator: torch.Generator | None = None,
    on_logits: Callable[[torch.Tensor], None] | None = None,
) -> Iterator[int]:
    """Yield up to max_new_tokens new ids after prompt_ids (see the module doc).

    eot_id: stop after yielding it when stop_at_eot. n_valid: ids >= n_valid are never drawn
    (default: all of the model's vocab). generator: share one across calls (e.g. several
    samples from one seed); else one is seeded from `seed` (random when None).
    on_logits: called with each step's next-token logits [vocab] (for tests and tools).
    """
    check_sampling(temperature, top_k, top_p)
    cfg = model.cfg
    n_valid = cfg.vocab_size if n_valid is None else min(n_valid, cfg.vocab_size)
    ids = [int(i) for i in prompt_ids]
    if not ids:
        raise UserError("prompt: empty; give at least one token")
    check_prompt_ids(ids, n_valid)
    if len(ids) > cfg.block_size:
        ids = ids[-cfg.block_size :]
    if generator is None:
        generator = seeded_generator(seed)
    was_training = model.training
    model.eval()
    try:
        decoder = _Decoder(model, ids, use_cache)
        for _ in range(max_new_tokens):
            logits = decoder.next_logits(ids)
            if logits.dtype != torch.float64:  # sample in float32 at least; keep float64
                logits = logits.float()
            if n_valid < logits.numel():
                logits[n_valid:] = float("-inf")
            if on_logits is not None:
                on_logits(logits)
            nxt = pick_next(logits, temperature, top_k, top_p, generator)
            ids.append(nxt)
            yield nxt
            if stop_at_eot and nxt == eot_id:
                return
            decoder.advance(ids)
    finally:
        model.train(was_training)


class _Decoder:
    """The next-token logits of a growing text: with the cache, the prompt is run once and
    each new token costs one position (sliding to the last half block when the cache is
    full); without it, the last block_size tokens are run again at every step."""

    def __init__(self, model: Andrea, ids: list[int], use_cache: bool) -> None:
        self.model, self.cfg = model, model.cfg
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.cache: KVCache | None = None
        if use_cache:
            self._prefill(ids)

    def _prefill(self, tokens: list[int]) -> None:
        self.cache = KVCache.empty(self.cfg, 1, self.cfg.block_size, self.device, self.dtype)
        logits, _ = self.model(torch.tensor([tokens], device=self.device), cache=self.cache)
        self.logits = logits[0, -1]

    def next_logits(self, ids: list[int]) -> torch.Tensor:
        if self.cache is not None:
            return self.logits
        context = torch.tensor([ids[-self.cfg.block_size :]], device=self.device)
        return self.model(context)[0][0, -1]

    def advance(self, ids: list[int]) -> None:
        """Feed the newest id (the last of ids) to the cache."""
        if self.cache is None:
            return
        if self.cache.length == self.cfg.block_size:  # full: slide to the last half block
            self._prefill(ids[-max(1, self.cfg.block_size // 2) :])
        else:
            logits, _ = self.model(torch.tensor([[ids[-1]]], device=self.device),
                                   cache=self.cache)
            self.logits = logits[0, -1]


class TextStream:
    """Decode ids incrementally: text is released once it ends in a complete character.

    A multi-byte character split across tokens decodes to U+FFFD until its last byte arrives,
    so a pending tail that decodes to U+FFFD is held back (at most 4 tokens: a UTF-8 character
    has at most 4 bytes; past that the U+FFFD is real and is released).
    """

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self.decode = decode
        self.pending: list[int] = []

    def push(self, token: int) -> str:
        self.pending.append(token)
        text = self.decode(self.pending)
        if text.endswith("\ufffd") and len(self.pending) < 4:
            return ""
        self.pending = []
        return text

    def flush(self) -> str:
        text = self.decode(self.pending) if self.pending else ""
        self.pending = []
        return text


def parse_prompt_ids(text: str) -> list[int]:
    """Ids split by commas or spaces; an empty place between commas ('72,,101': an id lost?)
    is refused as a word is."""
    fields = [field.strip() for field in text.split(",")]
    try:
        if text.strip() and not all(fields):
            raise ValueError
        return [int(part) for field in fields for part in field.split()]
    except ValueError:
        raise UserError(
            f"--prompt-ids: {text!r} is not a list of integer token ids (e.g. '464,3290')"
        ) from None


def generate_command(
    checkpoint: str | None,
    prompt: str | None,
    *,
    prompt_ids: str | None = None,
    max_new_tokens: int = 200,
    temperature: float = 0.8,
    top_k: int | None = 200,
    top_p: float | None = None,
    seed: int | None = None,
    num_samples: int = 1,
    stop_at_eot: bool = True,
    use_cache: bool = True,
    device: str = "auto",
    precision: str = "fp32",
) -> None:
    """What `andrea generate` does: print each sample (prompt + continuation) as it grows."""
    from andrea.train.device import pick_device, pick_dtype
    from andrea.trained import find_checkpoint, open_trained

    out = sys.stdout
    _check_options(temperature, top_k, top_p, max_new_tokens, num_samples, precision)
    generator = seeded_generator(seed)  # a bad --seed refused before the checkpoint is read
    if prompt is not None and prompt_ids is not None:
        raise UserError("give --prompt TEXT or --prompt-ids IDS, not both")
    ckpt = find_checkpoint(checkpoint, use="andrea generate --checkpoint {}")
    dev = pick_device(device)
    dtype = pick_dtype(precision, dev)
    opened = open_trained(ckpt, dev, prepare_missing=True, dtype=dtype)
    model = opened.model.to(dtype)  # bf16: bf16 weights and cache
    tok, block_size = opened.tokenizer, opened.cfg.model.block_size
    n_valid = min(tok.vocab_size, opened.cfg.model.vocab_size)
    ids = _prompt_tokens(tok, prompt, prompt_ids, n_valid, block_size)
    for sample in range(num_samples):
        if sample:
            out.write("\n---\n")
        out.write(tok.decode(ids) if ids != [tok.eot_id] else "")
        out.flush()
        stream = TextStream(tok.decode)
        for token in generate(
            model, ids, max_new_tokens, temperature, top_k, top_p,
            stop_at_eot=stop_at_eot, use_cache=use_cache, eot_id=tok.eot_id,
            n_valid=n_valid, generator=generator,
        ):
            if stop_at_eot and token == tok.eot_id:
                break
            text = stream.push(token)
            if text:
                out.write(text)
                out.flush()
        out.write(stream.flush() + "\n")
        out.flush()


def _check_options(
    temperature: float, top_k: int | None, top_p: float | None, max_new_tokens: int,
    num_samples: int, precision: str,
) -> None:
    check_sampling(temperature, top_k, top_p)
    if max_new_tokens < 0:
        raise UserError(f"--max-new-tokens: must be >= 0, got {max_new_tokens}")
    if num_samples < 1:
        raise UserError(f"--num-samples: must be a positive integer, got {num_samples}")
    if precision not in PRECISIONS:
        raise UserError(f"--precision: '{precision}' is not one of {', '.join(PRECISIONS)}")


def _check_prompt_text(prompt: str) -> None:
    """A UserError for a prompt that is no Unicode: bytes of another encoding, which Python
    keeps in a command line as lone surrogates (a terminal not in UTF-8). No tokenizer takes
    it (a traceback from inside each)."""
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as exc:
        char = ord(prompt[exc.start])
        byte = f"byte 0x{char - 0xDC00:02x}" if 0xDC80 <= char <= 0xDCFF else f"U+{char:04X}"
        raise UserError(f"--prompt: not UTF-8 text ({byte} at character {exc.start}: a terminal "
                        f"or file in another encoding?); give UTF-8 text, or the ids with "
                        f"--prompt-ids") from None


def _prompt_tokens(
    tok: Tokenizer, prompt: str | None, prompt_ids: str | None, n_valid: int, block_size: int
) -> list[int]:
    """The prompt's ids, checked before the prompt is printed (generate checks them lazily),
    cut to the last block_size (said on stderr)."""
    if prompt_ids is None and prompt:
        _check_prompt_text(prompt)
    given = parse_prompt_ids(prompt_ids) if prompt_ids is not None else tok.encode(prompt or "")
    # No prompt, --prompt "" and --prompt-ids "" alike: a new document, which in the shards
    # follows an end-of-text, so the sample is unconditional.
    ids = given or [tok.eot_id]
    check_prompt_ids(ids, n_valid)
    if len(ids) > block_size:
        print(
            f"note: the prompt is {len(ids)} tokens, longer than the block size "
            f"{block_size}; keeping its last {block_size}",
            file=sys.stderr, flush=True,
        )
        ids = ids[-block_size :]
    return ids
