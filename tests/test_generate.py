"""`andrea generate`: the key/value cache against full recomputation, sampling, streaming."""

from __future__ import annotations

import math
import shutil

import pytest
import torch
from conftest import andrea_main, assert_user_error, make_checkpoint

from andrea.config import load_config
from andrea.data.prepare import ensure_prepared
from andrea.data.tokenizer import BpeTokenizer, ByteTokenizer
from andrea.errors import UserError
from andrea.generate import TextStream, _check_options, _prompt_tokens, generate, pick_next
from andrea.model.transformer import Andrea
from andrea.trained import load_model


@pytest.fixture(scope="module")
def model64() -> Andrea:
    """The tiny preset (block 64, vocab 320) with random weights, in float64."""
    torch.manual_seed(0)
    cfg = load_config("andrea-tiny", ["model.init_std=0.2"])  # peaky logits: varied greedy picks
    return Andrea(cfg.model).double().eval()


def run(model, prompt, n, **kwargs) -> tuple[list[int], list[torch.Tensor]]:
    seen: list[torch.Tensor] = []
    ids = list(generate(model, prompt, n, on_logits=lambda x: seen.append(x.clone()), **kwargs))
    return ids, seen


def test_cached_greedy_equals_uncached(model64):
    prompt = torch.randint(0, 257, (10,), generator=torch.Generator().manual_seed(1)).tolist()
    cached, cached_logits = run(model64, prompt, 54, temperature=0, use_cache=True)
    plain, plain_logits = run(model64, prompt, 54, temperature=0, use_cache=False)
    assert len(cached) == 54 and cached == plain  # 10 + 54 = 64 positions: one full block
    assert len(set(cached)) > 5
    for a, b in zip(cached_logits, plain_logits, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)


def test_a_full_cache_slides_to_the_last_half_block(model64):
    prompt = list(range(50))
    ids, logits = run(model64, prompt, 40, temperature=0, use_cache=True)
    full = prompt + ids
    # The 15th new token fills position 64; the next step re-prefills the last 32 tokens.
    for step, context_len in ((15, 32), (16, 33), (39, 56)):
        context = torch.tensor([full[: 50 + step][-context_len:]])
        expected = model64(context)[0][0, -1]
        torch.testing.assert_close(logits[step], expected, rtol=0, atol=1e-10)


def test_a_prompt_past_the_block_keeps_its_last_block_and_plain_steps_see_the_last_block(
        model64):
    """A prompt one token longer than the block (65 of 64) is cut to its last 64 tokens, with
    the cache or without; without it, every step runs the last block_size tokens again."""
    prompt = list(range(65))
    for use_cache, steps in ((True, 1), (False, 3)):
        ids, logits = run(model64, prompt, 3, temperature=0, use_cache=use_cache)
        full = prompt + ids
        for step in range(steps):
            expected = model64(torch.tensor([full[: 65 + step][-64:]]))[0][0, -1]
            torch.testing.assert_close(logits[step], expected, rtol=0, atol=1e-10)


def test_generating_leaves_the_model_in_the_mode_it_was_in(model64):
    """A model in training (a tool that samples between steps) is put back in training mode,
    its dropout on again; an eval model stays in eval."""
    model64.train()
    try:
        list(generate(model64, [1, 2, 3], 2, temperature=0))
        assert model64.training
    finally:
        model64.eval()
    list(generate(model64, [1, 2, 3], 2, temperature=0))
    assert not model64.training


def test_a_prompt_of_exactly_the_block_is_kept_whole_without_a_note(capsys):
    tok = ByteTokenizer()
    assert _prompt_tokens(tok, None, ",".join(["65"] * 8), 257, 8) == [65] * 8
    assert capsys.readouterr().err == ""
    assert _prompt_tokens(tok, None, ",".join(["65"] * 9), 257, 8) == [65] * 8
    assert "the prompt is 9 tokens, longer than the block size 8" in capsys.readouterr().err


def test_max_new_tokens_0_prints_the_prompt_and_below_0_is_refused():
    _check_options(0.8, 200, None, 0, 1, "fp32")
    with pytest.raises(UserError, match="--max-new-tokens: must be >= 0, got -1"):
        _check_options(0.8, 200, None, -1, 1, "fp32")


def test_seeded_sampling_repeats(model64):
    kwargs = dict(temperature=1.0, top_k=50, top_p=0.9)
    a = list(generate(model64, [1, 2, 3], 40, seed=7, **kwargs))
    b = list(generate(model64, [1, 2, 3], 40, seed=7, **kwargs))
    c = list(generate(model64, [1, 2, 3], 40, seed=8, **kwargs))
    assert a == b and a != c
    greedy = list(generate(model64, [1, 2, 3], 40, temperature=0))
    assert list(generate(model64, [1, 2, 3], 40, seed=3, top_k=1)) == greedy
    # Ids past the tokenizer's (the model's vocab padding) are never drawn.
    hot = list(generate(model64, [1, 2, 3], 300, seed=1, temperature=3.0, n_valid=257))
    assert max(hot) < 257


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    gen = torch.Generator().manual_seed(0)
    draws = {pick_next(logits, 1.0, None, 0.8, gen) for _ in range(400)}
    assert draws == {0, 1}  # 0.5 < 0.8 <= 0.5 + 0.3
    assert {pick_next(logits, 1.0, None, 0.5, gen) for _ in range(100)} == {0}
    assert {pick_next(logits, 1.0, 2, None, gen) for _ in range(400)} == {0, 1}
    assert {pick_next(logits, 1.0, None, 1.0, gen) for _ in range(2000)} == {0, 1, 2, 3}
    # Equally likely tokens, 1/4 each (exact in float64): 2 of them reach 0.5, 3 reach 0.75.
    even = torch.zeros(4)
    assert len({pick_next(even, 1.0, None, 0.5, gen) for _ in range(400)}) == 2
    assert len({pick_next(even, 1.0, None, 0.75, gen) for _ in range(400)}) == 3


def test_the_models_vocab_padding_is_never_a_candidate(model64):
    """Ids from the tokenizer's count up (the model's vocab rounded up: 320 for 257 byte ids)
    get no probability at all, whatever the temperature; every id below keeps its logit."""
    ids, seen = run(model64, [1, 2, 3], 300, temperature=1e39, seed=2, n_valid=257)
    for logits in seen:
        assert torch.isinf(logits[257:]).all() and torch.isfinite(logits[:257]).all()
    assert max(ids) < 257 and len(set(ids)) > 150  # near uniform over the 257


def test_stops_at_end_of_text(model64):
    greedy = list(generate(model64, [5], 30, temperature=0))
    eot = greedy[3]  # pretend the 4th greedy token is end-of-text
    assert list(generate(model64, [5], 30, temperature=0, eot_id=eot))[-1] == eot
    assert len(list(generate(model64, [5], 30, temperature=0, eot_id=eot))) == 4
    assert len(list(generate(model64, [5], 30, temperature=0, eot_id=eot,
                             stop_at_eot=False))) == 30


def test_bad_sampling_arguments(model64):
    with pytest.raises(UserError, match="outside the vocabulary"):
        list(generate(model64, [1, 320], 3))
    with pytest.raises(UserError, match=r"--top-p: must be in \(0, 1\]"):
        list(generate(model64, [1], 3, top_p=0.0))
    with pytest.raises(UserError, match=r"--top-p: must be in \(0, 1\], got 1.5"):
        list(generate(model64, [1], 3, top_p=1.5))
    for bad in (-0.5, math.inf, math.nan):
        with pytest.raises(UserError, match="--temperature: must be a finite number >= 0"):
            list(generate(model64, [1], 3, temperature=bad))
    for bad in (-1, 2**63):
        with pytest.raises(UserError, match=f"--seed: must be an integer from 0 to "
                                            f"{2**63 - 1}, got {bad}"):
            list(generate(model64, [1], 3, seed=bad))


def test_extreme_temperatures_sample_near_greedy_and_near_uniform(model64):
    """Before: a temperature of 1e-45 or 1e39 was a traceback (softmax of inf/inf, NaN)."""
    greedy = list(generate(model64, [1, 2, 3], 20, temperature=0))
    for cold in (1e-45, 1e-320):
        assert list(generate(model64, [1, 2, 3], 20, temperature=cold, seed=4)) == greedy
    hot = list(generate(model64, [1, 2, 3], 300, temperature=1e39, top_k=None, seed=4,
                        n_valid=257))
    assert len(set(hot)) > 150  # 300 draws near uniform over 257 ids: some 180 distinct


def test_stream_holds_back_split_characters():
    tok = ByteTokenizer()
    text = "a é ✓ 🙂 日本!"
    stream = TextStream(tok.decode)
    pieces = [stream.push(b) for b in text.encode("utf-8")] + [stream.flush()]
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)
    invalid = TextStream(tok.decode)  # bytes that never complete a character are still shown
    out = "".join(invalid.push(b) for b in [0xFF, 0xFF, 0xFF, 0xFF, 0x41]) + invalid.flush()
    assert out.count("\ufffd") == 4 and out.endswith("A")


def test_command_line(tmp_path):
    ckpt = make_checkpoint(tmp_path)
    args = ["generate", "--checkpoint", str(ckpt), "-n", "20", "--seed", "5", "-t", "1.0",
            "--no-stop-at-eot", "--num-samples", "2"]
    long_prompt = "To be, or not to be, that is the question. " * 3  # 129 bytes > block 64
    a = andrea_main(*args, "--prompt", long_prompt)
    assert a.returncode == 0, a.stderr
    assert "the prompt is 129 tokens, longer than the block size 64; keeping its last 64" \
        in a.stderr
    assert a.stdout.count(long_prompt[-64:]) == 2 and "\n---\n" in a.stdout
    b = andrea_main(*args, "--prompt", "To be")
    c = andrea_main(*args, "--prompt", "To be", "--no-cache")
    assert b.returncode == 0 and b.stdout.startswith("To be")
    assert c.stdout == b.stdout  # the same seed; the cache changes nothing within a block
    # The sampling arguments' own errors are generate()'s (test_bad_sampling_arguments).
    assert_user_error(andrea_main(*args, "--prompt-ids", "1,2,999"), "999", "outside the vocab")
    for hollow in ("72,,101", "72,", ",72"):  # an id lost between commas: it was dropped
        assert_user_error(andrea_main(*args, "--prompt-ids", hollow),
                          f"--prompt-ids: '{hollow}' is not a list of integer token ids")
    spaced = andrea_main(*args, "--prompt-ids", "84 111, 32")  # spaces, commas, or both
    assert spaced.returncode == 0 and spaced.stdout.startswith("To "), spaced.stderr


def test_an_empty_prompt_is_a_new_document_either_way(tmp_path):
    """No prompt, --prompt "" and --prompt-ids "" all sample from end-of-text, the same text."""
    ckpt = make_checkpoint(tmp_path, "model.init_std=0.2")
    args = ["generate", "--checkpoint", str(ckpt), "-n", "30", "--seed", "3", "-t", "1.0",
            "--no-stop-at-eot"]
    eot = ByteTokenizer.eot_id
    outs = [andrea_main(*args, *extra) for extra in ([], ["--prompt", ""], ["--prompt-ids", ""])]
    for proc in outs:
        assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert len({proc.stdout for proc in outs}) == 1
    assert len(outs[0].stdout) > 10  # 30 sampled bytes (some may be control characters)
    model, _, _ = load_model(ckpt)
    expected = list(generate(model, [eot], 30, temperature=1.0, top_k=200, seed=3,
                             stop_at_eot=False, n_valid=ByteTokenizer().vocab_size))
    assert outs[0].stdout == ByteTokenizer().decode(expected) + "\n"


def test_a_bpe_run_whose_data_is_gone_prepares_it_again(tmp_path):
    """generate needs a trained BPE's tokenizer.json: with the run's data folder gone, it
    prepares the data from the run's config (one line on stderr) under ./data (never in the
    folder the checkpoint names) and finds the same BPE."""
    text = tmp_path / "text.txt"
    text.write_text("".join(f"the cat sat on mat {i % 7}, the dog ran to {i % 5}.\n"
                            for i in range(300)))
    sets = ["data.tokenizer=bpe", f"data.source={text}", f"data.dir={tmp_path / 'data'}"]
    data = ensure_prepared(load_config("andrea-tiny", sets))
    identity = BpeTokenizer(data / "tokenizer.json").identity
    ckpt = make_checkpoint(tmp_path, *sets, tokenizer=identity)
    before = andrea_main("generate", "--checkpoint", str(ckpt), "-p", "the cat", "-n", "8",
                         "--seed", "1")
    assert before.returncode == 0 and before.stderr == "", before.stderr
    shutil.rmtree(data)
    after = andrea_main("generate", "--checkpoint", str(ckpt), "-p", "the cat", "-n", "8",
                        "--seed", "1", cwd=tmp_path)
    assert after.returncode == 0, after.stderr
    assert after.stderr.splitlines() == [
        f"preparing data/text-bpe-320 from {text} with a BPE trained again, as the run's config "
        f"says ({ckpt} holds no tokenizer.json: written before checkpoints carried their "
        f"tokenizer): the run's data, {data}, is not here (andrea writes a checkpoint's data "
        "only under ./data)"
    ]
    assert not (data / "manifest.json").exists()  # tmp_path/data holds only the new folder
    assert (tmp_path / "data/text-bpe-320/tokenizer.json").is_file()
    assert after.stdout == before.stdout and after.stdout.startswith("the cat")


def test_a_prompt_or_checkpoint_a_user_gets_wrong_is_one_line(tmp_path):
    """A prompt in another encoding (a terminal not in UTF-8: Python keeps its bytes as lone
    surrogates) was a traceback from inside the tokenizer, the model file given as
    --checkpoint was told it has no model.safetensors, and an export's folder was told it is
    no andrea checkpoint without a way on. Each is one line that says what to give."""
    ckpt = make_checkpoint(tmp_path)
    assert_user_error(andrea_main("generate", "--checkpoint", str(ckpt), "-p", "ab\udcffcd"),
                      "--prompt: not UTF-8 text (byte 0xff at character 2",
                      "give UTF-8 text, or the ids with --prompt-ids")
    model_file = ckpt / "model.safetensors"
    assert_user_error(andrea_main("generate", "--checkpoint", str(model_file)),
                      f"{model_file}: a file; give the checkpoint's folder")
    hf = tmp_path / "hf"
    assert andrea_main("export", "--checkpoint", str(ckpt), "--out", str(hf)).returncode == 0
    assert_user_error(andrea_main("generate", "--checkpoint", str(hf)),
                      "it is a Hugging Face model folder: import it first, andrea import "
                      f"--format hf {hf}")


def test_several_samples_of_one_seed_are_each_its_own_and_repeat_as_a_whole(tmp_path):
    """--num-samples N --seed S: N different continuations of the prompt, and the same N again
    for the same seed; sample i is the i-th draw of one generator seeded S (each sample
    re-seeded printed the same text N times)."""
    ckpt = make_checkpoint(tmp_path, "model.init_std=0.2")
    args = ["generate", "--checkpoint", str(ckpt), "-p", "To be", "-n", "24", "--seed", "5",
            "-t", "1.0", "--no-stop-at-eot", "--num-samples", "3"]
    first, again = andrea_main(*args), andrea_main(*args)
    assert first.returncode == 0, first.stderr
    assert again.stdout == first.stdout
    model, _, _ = load_model(ckpt)
    tok = ByteTokenizer()
    generator = torch.Generator().manual_seed(5)
    expected = [
        tok.decode(tok.encode("To be") + list(generate(
            model, tok.encode("To be"), 24, temperature=1.0, top_k=200, stop_at_eot=False,
            n_valid=tok.vocab_size, generator=generator)))
        for _ in range(3)]
    assert len(set(expected)) == 3, expected
    assert first.stdout == "\n---\n".join(f"{sample}\n" for sample in expected)


def test_a_sample_ends_at_end_of_text_which_is_not_printed(tmp_path):
    """By default a sample stops where the model ends the document: the text before the
    end-of-text token, never the token's own spelling (<|endoftext|>); --no-stop-at-eot goes on
    past it to -n tokens."""
    ckpt = make_checkpoint(tmp_path)  # near-uniform logits: end-of-text comes by chance
    tok = ByteTokenizer()
    model, _, _ = load_model(ckpt)
    prompt = tok.encode("To be")
    drawn = list(generate(model, prompt, 120, temperature=1.0, top_k=200, seed=4,
                          eot_id=tok.eot_id, n_valid=tok.vocab_size))
    assert drawn[-1] == tok.eot_id and len(drawn) < 120  # the premise: seed 4 draws it
    args = ["generate", "--checkpoint", str(ckpt), "-p", "To be", "-n", "120", "--seed", "4",
            "-t", "1.0"]
    stopped = andrea_main(*args)
    assert stopped.returncode == 0, stopped.stderr
    assert stopped.stdout == tok.decode(prompt + drawn[:-1]) + "\n"
    assert "<|endoftext|>" not in stopped.stdout
    on = andrea_main(*args, "--no-stop-at-eot")
    assert on.returncode == 0, on.stderr
    assert on.stdout.startswith(stopped.stdout[:-1]) and len(on.stdout) > len(stopped.stdout)
