"""The time-to-quality recipe keys (docs/log.md, "time to quality, round 2"): each is off by
default and changes training only when set; checked against float64 references."""

from __future__ import annotations

import json
import shlex
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import REPO, andrea_main, assert_user_error, tiny_config
from test_train import read_events

from andrea.config import load_config
from andrea.data import shards
from andrea.data.loader import TokenSplit, train_batch
from andrea.data.shards import MANIFEST
from andrea.errors import UserError
from andrea.model.transformer import Andrea
from andrea.train import checkpoint as ckpt_io
from andrea.train import loop
from andrea.train.loop import train
from andrea.train.muon import POLAR_EXPRESS, Float32Muon, NewtonSchulzSchedule, newton_schulz
from andrea.train.optim import build_optimizer
from andrea.train.parallel import parallel_for
from andrea.train.rundir import OPTIMIZER_FILE
from andrea.train.setup import build_model
from andrea.train.torchrun import DistInfo

QUINTIC = NewtonSchulzSchedule.quintic((3.4445, -4.7750, 2.0315), 5)


def _polar(g: torch.Tensor) -> torch.Tensor:
    u, _, vh = torch.linalg.svd(g, full_matrices=False)
    return u @ vh


@pytest.mark.parametrize("shape", [(384, 1152), (1536, 384), (96, 96)])
def test_polar_express_is_closer_to_the_polar_factor_than_the_quintic(shape):
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    exact = _polar(g)
    quintic = newton_schulz(g, QUINTIC, eps=1e-7, dtype=torch.float64)
    polar = newton_schulz(g, POLAR_EXPRESS, eps=1e-7, dtype=torch.float64)
    error = {name: float((x - exact).norm() / exact.norm())
             for name, x in (("quintic", quintic), ("polar", polar))}
    assert error["polar"] < 0.75 * error["quintic"], error
    s = torch.linalg.svdvals(polar)
    # In (0.8, 1.2) but the few a square random matrix has near zero, which 5 steps cannot lift.
    assert s.max() < 1.2 and (s > 0.8).double().mean() > 0.95
    # Its own iteration, step by step in float64: the five (a, b, c), the 1.02 margin.
    x = (g.T if g.size(0) > g.size(1) else g) / (g.norm() * 1.02)
    for a, b, c in POLAR_EXPRESS.coefficients:
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    x = x.T if g.size(0) > g.size(1) else x
    assert (polar - x).abs().max() < 1e-12
    # bf16 follows the float64 iteration to bf16's rounding.
    bf16 = newton_schulz(g.float(), POLAR_EXPRESS, eps=1e-7, dtype=torch.bfloat16)
    assert (bf16.double() - polar).abs().max() < 0.05


def test_polar_express_takes_float32_muon_even_in_bf16(tmp_path, data_dir):
    for precision in ("bf16", "fp32"):
        cfg = tiny_config(tmp_path / "runs", data_dir, "train.optimizer=muon",
                          f"train.muon_ns_precision={precision}",
                          "train.muon_ns_coefficients=polar_express")
        opt = build_optimizer(Andrea(cfg.model), cfg, torch.device("cpu"))
        assert type(opt.parts["muon"]) is Float32Muon and opt.parts["muon"].polar_express
    quintic = tiny_config(tmp_path / "runs", data_dir, "train.optimizer=muon",
                          "train.muon_ns_precision=bf16")
    built = build_optimizer(Andrea(quintic.model), quintic, torch.device("cpu"))
    assert type(built.parts["muon"]) is torch.optim.Muon


def test_zero_init_output_starts_every_block_as_the_identity(tmp_path, data_dir):
    cpu, one = torch.device("cpu"), parallel_for("ddp", DistInfo())
    plain = build_model(tiny_config(tmp_path / "runs", data_dir), cpu, one, torch.float32,
                        "sdpa")[0]
    zero = build_model(tiny_config(tmp_path / "runs", data_dir, "train.zero_init_output=true"), cpu,
                       one, torch.float32, "sdpa")[0]
    projections = {f"blocks.{i}.{m}.weight" for i in range(len(zero.blocks))
                   for m in ("attn.out", "mlp.down")}
    for (name, p), q in zip(zero.named_parameters(), plain.parameters(), strict=True):
        if name in projections:
            assert not p.any() and q.abs().sum() > 0, name
        else:
            assert torch.equal(p, q), name  # the same seed, the same other weights
    # The loss is that of no blocks at all: the head over the final norm of the embeddings.
    idx = torch.randint(0, zero.cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    targets = torch.roll(idx, -1, 1)
    _, loss = zero(idx, targets)
    x = (zero.tok_emb.weight[idx] + zero.pos_emb.weight[:16]).double()
    x = F.layer_norm(x, (x.size(-1),), zero.ln_f.weight.double(),
                     None if zero.ln_f.bias is None else zero.ln_f.bias.double())
    ref = F.cross_entropy((x @ zero.tok_emb.weight.double().T).reshape(-1, zero.cfg.vocab_size),
                          targets.reshape(-1))
    assert abs(loss.item() - ref.item()) < 1e-5


def test_both_keys_train_and_differ_from_the_default(tmp_path, data_dir):
    base = ("train.optimizer=muon", "train.max_steps=4", "train.precision=fp32")
    default = train(tiny_config(tmp_path / "runs", data_dir, *base, "train.name=default"),
                    progress=False)
    runs = {key: train(tiny_config(tmp_path / "runs", data_dir, *base,
                                   f"train.name={key.split('.')[1][:4]}", key), progress=False)
            for key in ("train.zero_init_output=true", "train.muon_ns_coefficients=polar_express")}
    for key, result in runs.items():
        assert result.state == "finished"
        assert result.losses[4] < result.losses[1], key  # it learns
        assert result.losses[2] != default.losses[2], key  # and the key took effect
        assert key.replace("=", ": ").split(".")[1] in (result.run_dir / "config.yaml").read_text()


def _normuon_reference(weights, grads, lr, wd, momentum, beta2):
    """NorMuon in float64, written out: Nesterov momentum, 5 quintic Newton-Schulz steps, each
    row divided by the root of its running mean square, rescaled to the orthogonalised norm."""
    weights = [w.double().clone() for w in weights]
    bufs = [torch.zeros_like(w) for w in weights]
    moments = [torch.zeros(w.size(0), 1, dtype=torch.float64) for w in weights]
    for step_grads in grads:
        for w, g, buf, v in zip(weights, step_grads, bufs, moments, strict=True):
            g = g.double()
            buf.mul_(momentum).add_(g, alpha=1 - momentum)
            u = g + momentum * (buf - g)  # Nesterov: lerp(grad, buf, momentum)
            o = newton_schulz(u, QUINTIC, eps=1e-7, dtype=torch.float64)
            v.mul_(beta2).add_((o * o).mean(dim=1, keepdim=True), alpha=1 - beta2)
            scaled = o / v.sqrt()
            scaled = scaled * o.norm() / scaled.norm()
            w.mul_(1 - lr * wd).add_(scaled, alpha=-lr * max(1, w.size(0) / w.size(1)) ** 0.5)
    return weights


def test_normuon_follows_its_float64_reference():
    gen = torch.Generator().manual_seed(3)
    start = [torch.randn(24, 8, generator=gen), torch.randn(8, 24, generator=gen)]
    grads = [[torch.randn(w.shape, generator=gen) for w in start] for _ in range(4)]
    params = [torch.nn.Parameter(w.double().clone()) for w in start]
    opt = Float32Muon(params, ns_dtype=torch.float64, neuron_beta2=0.95, lr=0.02,
                      weight_decay=0.1, momentum=0.95, nesterov=True)
    for step_grads in grads:
        for p, g in zip(params, step_grads, strict=True):
            p.grad = g.double()
        opt.step()
    ref = _normuon_reference(start, grads, 0.02, 0.1, 0.95, 0.95)
    for p, r in zip(params, ref, strict=True):
        assert (p.detach() - r).abs().max() < 1e-10
    plain = [torch.nn.Parameter(w.double().clone()) for w in start]
    plain_opt = Float32Muon(plain, ns_dtype=torch.float64, lr=0.02, weight_decay=0.1,
                            momentum=0.95, nesterov=True)
    for step_grads in grads:
        for p, g in zip(plain, step_grads, strict=True):
            p.grad = g.double()
        plain_opt.step()
    assert not torch.allclose(plain[0], params[0])  # the normalisation changed the steps


def test_normuon_resumes_bit_for_bit(tmp_path, data_dir):
    sets = ("train.max_steps=6", "train.precision=fp32", "train.optimizer=muon",
            "train.global_batch_tokens=1024", "train.warmup_steps=2",
            "train.muon_neuron_beta2=0.95")
    whole = train(tiny_config(tmp_path / "a" / "runs", data_dir, *sets), progress=False)
    first = train(tiny_config(tmp_path / "b" / "runs", data_dir, *sets), progress=False,
                  stop_after=3)
    fields = ckpt_io.read_safetensors(first.checkpoint / OPTIMIZER_FILE)[0]
    rows = fields["blocks.0.attn.qkv.weight.momentum_buffer"].shape[0]
    assert fields["blocks.0.attn.qkv.weight.neuron_second_moment"].shape == (rows, 1)
    rest = train(tiny_config(tmp_path / "b" / "runs", data_dir, *sets), resume=str(first.run_dir),
                 progress=False)
    assert {**first.losses, **rest.losses} == whole.losses  # exact float equality


def test_normuon_under_fsdp_is_refused_in_one_line(tmp_path, data_dir):
    cfg = tiny_config(tmp_path / "runs", data_dir, "train.optimizer=muon",
                      "train.muon_neuron_beta2=0.95", "train.parallel=fsdp")
    # The way out a resume can take comes first: it may not change muon_neuron_beta2.
    with pytest.raises(UserError, match=r"^train\.muon_neuron_beta2: 0\.95: NorMuon is not "
                                        r"supported under train\.parallel: fsdp.*; use "
                                        r"train\.parallel=ddp, or for a new run "
                                        r"train\.muon_neuron_beta2=0 \(a resume keeps"):
        build_optimizer(Andrea(cfg.model), cfg, torch.device("cpu"), world_size=2,
                        sharded=parallel_for(cfg.train.parallel, DistInfo(0, 0, 2)).sharded)


def test_cautious_weight_decay_decays_only_where_the_update_agrees():
    gen = torch.Generator().manual_seed(5)
    start = torch.randn(16, 8, generator=gen, dtype=torch.float64)
    grad = torch.randn(16, 8, generator=gen, dtype=torch.float64)
    p = torch.nn.Parameter(start.clone())
    opt = Float32Muon([p], ns_dtype=torch.float64, cautious_weight_decay=True, lr=0.1,
                      weight_decay=0.5, momentum=0.0, nesterov=False)
    p.grad = grad.clone()
    opt.step()
    update = newton_schulz(grad, QUINTIC, eps=1e-7, dtype=torch.float64)  # momentum 0: the gradient
    agree = (start * update > 0).double()
    ref = start - 0.1 * 0.5 * start * agree - 0.1 * max(1, 16 / 8) ** 0.5 * update
    assert (p.detach() - ref).abs().max() < 1e-12
    assert 0 < agree.mean() < 1  # some entries decayed, some not: the mask did something


WARMUP = ("train.max_steps=6", "train.precision=fp32", "train.optimizer=muon",
          "train.micro_batch_size=8", "train.warmup_steps=2")


@pytest.fixture(scope="module")
def plain(tmp_path_factory, data_dir) -> dict[int, object]:
    """WARMUP's run with no warm-up, trained once for the tests that compare with it, by
    train.global_batch_tokens: 0 (one micro-batch of 512 tokens a step) and 1,024."""
    root = tmp_path_factory.mktemp("plain")
    return {tokens: train(tiny_config(root / "runs", data_dir, *WARMUP,
                                      f"train.name=plain-{tokens}",
                                      f"train.global_batch_tokens={tokens}"), progress=False)
            for tokens in (0, 1024)}


def test_batch_warmup_takes_the_small_batch_first_then_the_full_one(tmp_path, data_dir, plain):
    # tiny: 8 x 64 = 512 tokens a micro-batch; 3 steps of 1 micro-batch, then 3 of 2.
    warm = train(tiny_config(tmp_path / "runs", data_dir, *WARMUP, "train.name=warm",
                             "train.global_batch_tokens=1024", "train.batch_warmup_tokens=512",
                             "train.batch_warmup_steps=3"), progress=False)
    small = train(tiny_config(tmp_path / "runs", data_dir, *WARMUP, "train.name=small",
                              "train.global_batch_tokens=512"), progress=False)
    full = plain[1024]
    # The warm-up's steps are the small-batch run's, bit for bit (same windows, same lr)...
    assert [warm.losses[s] for s in (1, 2, 3)] == [small.losses[s] for s in (1, 2, 3)]
    assert warm.losses[1] != full.losses[1]
    # ...and after it the steps take twice the tokens: the full run's windows, other weights.
    assert warm.losses[4] != small.losses[4] and warm.losses[4] != full.losses[4]
    tokens = [e["tokens"] for e in read_events(warm.run_dir, "train")]
    assert tokens == [512, 1024, 1536, 2560, 3584, 4608] and warm.tokens == 4608
    start = read_events(warm.run_dir, "start")[0]
    assert start["tokens_per_step"] == 1024


def test_batch_warmup_resumes_bit_for_bit_inside_and_after_it(tmp_path, data_dir):
    sets = (*WARMUP, "train.global_batch_tokens=1024", "train.batch_warmup_tokens=512",
            "train.batch_warmup_steps=3")
    whole = train(tiny_config(tmp_path / "a" / "runs", data_dir, *sets), progress=False)
    for stop in (2, 4):  # a resume inside the warm-up, and one after it
        first = train(tiny_config(tmp_path / f"b{stop}" / "runs", data_dir, *sets), progress=False,
                      stop_after=stop)
        rest = train(tiny_config(tmp_path / f"b{stop}" / "runs", data_dir, *sets),
                     resume=str(first.run_dir), progress=False)
        assert {**first.losses, **rest.losses} == whole.losses  # exact float equality
        assert rest.tokens == whole.tokens == 4608


@pytest.mark.parametrize(("sets", "message"), [
    (("train.batch_warmup_tokens=512",), r"batch_warmup_tokens \(512\) and "
                                         r"train\.batch_warmup_steps \(0\) go together"),
    (("train.global_batch_tokens=0", "train.batch_warmup_tokens=512",
      "train.batch_warmup_steps=3"), r"batch_warmup_tokens: 512 needs train\.global_batch_tokens"),
])
def test_batch_warmup_settings_that_cannot_work_are_refused(tmp_path, data_dir, sets, message):
    with pytest.raises(UserError, match=message):
        tiny_config(tmp_path / "runs", data_dir, "train.global_batch_tokens=1024", *sets)


def test_a_warmup_batch_not_below_the_batch_is_off_and_says_so(tmp_path, data_dir, capsys,
                                                                plain):
    # A preset's warm-up after --set lowered global_batch_tokens to it: the plain run.
    plain = plain[1024]
    capsys.readouterr()
    same = train(tiny_config(tmp_path / "runs", data_dir, *WARMUP, "train.name=same",
                             "train.global_batch_tokens=1024", "train.batch_warmup_tokens=1024",
                             "train.batch_warmup_steps=3"), progress=False)
    assert "batch warm-up: off (train.batch_warmup_tokens 1,024 is not below " \
           "train.global_batch_tokens 1,024)" in capsys.readouterr().out
    assert same.state == "finished", (same.state, same.message)
    assert same.losses == plain.losses and same.tokens == plain.tokens == 6 * 1024


def test_batch_warmup_not_a_whole_number_of_micro_batches_is_refused(tmp_path, data_dir):
    cfg = tiny_config(tmp_path / "runs", data_dir, *WARMUP, "train.global_batch_tokens=1024",
                      "train.batch_warmup_tokens=768", "train.batch_warmup_steps=3")
    with pytest.raises(UserError, match=r"train\.batch_warmup_tokens: 768 is not a multiple of "
                                        r"micro_batch_size \* block_size \* processes = "
                                        r"8 \* 64 \* 1 = 512"):
        train(cfg, progress=False)
    # Not even whole windows with a micro-batch of the config's: both multiples at once (before,
    # the micro-batch's was said only once the count was made whole windows).
    cfg = tiny_config(tmp_path / "runs", data_dir, *WARMUP, "train.global_batch_tokens=1024",
                      "train.batch_warmup_tokens=100", "train.batch_warmup_steps=3")
    with pytest.raises(UserError, match=r"100 is not a multiple of block_size \* processes = "
                                        r"64 \* 1 = 64; make it one, and with "
                                        r"train.micro_batch_size 8 one of micro_batch_size \* "
                                        r"block_size \* processes = 512: e.g. 512$"):
        train(cfg, progress=False)
    # The example stays below global_batch_tokens (1,024 would switch the warm-up off).
    cfg = tiny_config(tmp_path / "runs", data_dir, *WARMUP, "train.global_batch_tokens=1024",
                      "train.batch_warmup_tokens=900", "train.batch_warmup_steps=3")
    with pytest.raises(UserError, match=r"= 512: e.g. 512$"):
        train(cfg, progress=False)
    # Not even whole windows: auto cannot help, so the message names the window instead.
    cfg = tiny_config(tmp_path / "runs", data_dir, *WARMUP, "train.micro_batch_size=auto",
                      "train.global_batch_tokens=1024", "train.batch_warmup_tokens=600",
                      "train.batch_warmup_steps=3")
    with pytest.raises(UserError, match=r"train\.batch_warmup_tokens: 600 is not a multiple of "
                                        r"block_size \* processes = 64 \* 1 = 64; make it one$"):
        train(cfg, progress=False)


def test_batch_warmup_auto_micro_batch_divides_both_batches(tmp_path, data_dir):
    # 24 sequences of 64 a step after the warm-up, 8 during it: auto alone would take 24.
    cfg = tiny_config(tmp_path / "runs", data_dir, "train.max_steps=3",
                      "train.micro_batch_size=auto", "train.global_batch_tokens=1536",
                      "train.batch_warmup_tokens=512", "train.batch_warmup_steps=2")
    result = train(cfg, progress=False)
    start = read_events(result.run_dir, "start")[0]
    assert 8 % start["micro_batch_size"] == 0 and result.tokens == 512 + 512 + 1536


def test_a_half_set_batch_warmup_is_one_line_at_the_command_line():
    proc = andrea_main("config", "show", "--config", "andrea-12m", "--set",
                      "train.batch_warmup_tokens=4096")
    assert_user_error(proc, "andrea-12m.yaml", "train.batch_warmup_tokens (4096) and "
                      "train.batch_warmup_steps (0) go together")


SEQ_WARMUP = ("train.seq_warmup_length=16", "train.seq_warmup_steps=3")


def test_seq_warmup_trains_on_short_windows_first_then_the_block(tmp_path, data_dir,
                                                                monkeypatch, plain):
    # tiny: block 64, 8 x 64 a micro-batch; the first 3 steps 32 windows of 16 (the same 512
    # tokens), then 8 of 64. Every batch the loop asks for is recorded with its step.
    import andrea.train.loop as loop

    asked = []

    def recording(split, **kw):
        x, y = train_batch(split, **kw)
        asked.append((kw["step"], tuple(x.shape)))
        return x, y

    train_batch = loop.train_batch
    monkeypatch.setattr(loop, "train_batch", recording)
    warm = train(tiny_config(tmp_path / "runs", data_dir, *WARMUP, "train.name=warm", *SEQ_WARMUP),
                 progress=False)
    assert asked == [(0, (32, 16)), (1, (32, 16)), (2, (32, 16)),
                     (3, (8, 64)), (4, (8, 64)), (5, (8, 64))]
    plain = plain[0]
    assert warm.losses[1] != plain.losses[1]  # other windows from the first step
    # The tokens a step stay 512: the count, the tokens/s and the bar are unchanged.
    tokens = [e["tokens"] for e in read_events(warm.run_dir, "train")]
    assert tokens == [512 * k for k in range(1, 7)] and warm.tokens == plain.tokens == 3072


def test_seq_warmup_resumes_bit_for_bit_inside_and_after_it(tmp_path, data_dir):
    whole = train(tiny_config(tmp_path / "a" / "runs", data_dir, *WARMUP, *SEQ_WARMUP),
                  progress=False)
    for stop in (2, 4):  # a resume inside the warm-up, and one after it
        first = train(tiny_config(tmp_path / f"b{stop}" / "runs", data_dir, *WARMUP, *SEQ_WARMUP),
                      progress=False, stop_after=stop)
        rest = train(tiny_config(tmp_path / f"b{stop}" / "runs", data_dir, *WARMUP, *SEQ_WARMUP),
                     resume=str(first.run_dir), progress=False)
        assert {**first.losses, **rest.losses} == whole.losses  # exact float equality


def test_seq_warmup_not_below_the_block_is_off_and_says_so(tmp_path, data_dir, capsys, plain):
    plain = plain[0]
    capsys.readouterr()
    same = train(tiny_config(tmp_path / "runs", data_dir, *WARMUP, "train.name=same",
                             "train.seq_warmup_length=64", "train.seq_warmup_steps=3"),
                 progress=False)
    assert "sequence warm-up: off (train.seq_warmup_length 64 is not below " \
           "model.block_size 64)" in capsys.readouterr().out
    assert same.losses == plain.losses


def test_a_seq_warmup_as_long_as_the_run_is_warned_about(tmp_path, data_dir, capsys):
    # The README's short run of a preset with a long warm-up would otherwise never train (nor
    # be scored after training) on the windows evaluation uses, without a word.
    train(tiny_config(tmp_path / "runs", data_dir, *WARMUP, "train.seq_warmup_length=16",
                      "train.seq_warmup_steps=6"), progress=False)
    assert ("warning: the sequence warm-up covers all 6 steps: no step trains on windows of 64 "
            "tokens") in capsys.readouterr().out


def test_the_readme_main_command_trains_its_last_steps_on_whole_windows():
    """The main command shortens andrea-12m to 100 steps; the preset's 150-step sequence warm-up
    must be shortened with it, or the README's run would never train on 256-token windows."""
    readme = (REPO / "README.md").read_text()
    block = readme.split("<!-- main-command -->", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    args = shlex.split(block.split("andrea train", 1)[1])
    assert args[:2] == ["--config", "andrea-12m.yaml"]
    cfg = load_config("andrea-12m", [args[i + 1] for i, a in enumerate(args) if a == "--set"])
    t = cfg.train
    assert 0 < t.seq_warmup_steps < t.max_steps and t.seq_warmup_length < cfg.model.block_size
    assert t.warmup_steps < t.max_steps and t.max_steps % t.checkpoint_every == 0


@pytest.mark.parametrize(("sets", "message"), [
    (("train.seq_warmup_length=16",), r"train\.seq_warmup_length \(16\) and "
                                      r"train\.seq_warmup_steps \(0\) go together"),
    (("train.seq_warmup_length=24", "train.seq_warmup_steps=3"),
     r"train\.seq_warmup_length: 24 does not divide model\.block_size 64 .* e\.g\. 32$"),
])
def test_seq_warmup_settings_that_cannot_work_are_refused(tmp_path, data_dir, sets, message):
    with pytest.raises(UserError, match=message):
        tiny_config(tmp_path / "runs", data_dir, *sets)


def test_a_seq_warmup_that_does_not_divide_the_block_is_one_line_at_the_command_line():
    proc = andrea_main("config", "show", "--config", "andrea-12m", "--set",
                      "train.seq_warmup_length=100", "--set", "train.seq_warmup_steps=50")
    assert_user_error(proc, "andrea-12m.yaml", "train.seq_warmup_length: 100 does not divide "
                      "model.block_size 256")


@pytest.fixture(scope="module")
def short_data(tmp_path_factory, data_dir) -> Path:
    """The tiny preset's data with a train split of its first 2,000 tokens: 30 windows of 64 a
    pass at any offset, so a run of a few steps goes through several passes."""
    out = tmp_path_factory.mktemp("short") / data_dir.name
    shutil.copytree(data_dir, out)
    manifest = json.loads((out / MANIFEST).read_text())
    first = manifest["shards"]["train"][0]
    tokens = np.array(shards.open_shard(out / first["file"])[:2000])
    for entry in manifest["shards"]["train"]:
        (out / entry["file"]).unlink()
    writer = shards.ShardWriter(out / first["file"], tokens.dtype,
                                manifest["tokenizer"]["identity"])
    writer.write(tokens)
    writer.close()
    manifest["shards"]["train"] = [{**first, "tokens": 2000, "checksum": writer.checksum}]
    (out / MANIFEST).write_text(json.dumps(manifest))
    return out


def read_starts(monkeypatch, data: Path) -> list[int]:
    """Make every training micro-batch append the start of each of its windows (of 64 tokens)
    to the list returned, found by their tokens in the train split."""
    tokens = np.asarray(TokenSplit(data, "train").shards[0]).tolist()
    where = {tuple(tokens[s:s + 64]): s for s in range(len(tokens) - 64)}
    assert len(where) == len(tokens) - 64  # each window's tokens name its start
    starts: list[int] = []

    def recording(*args, **kwargs):
        x, y = train_batch(*args, **kwargs)
        starts.extend(where[tuple(row)] for row in x.tolist())
        return x, y

    monkeypatch.setattr(loop, "train_batch", recording)
    return starts


EPOCHS = (*WARMUP, "train.max_steps=8", "data.order=epochs", "train.global_batch_tokens=1024",
          "train.batch_warmup_tokens=512", "train.batch_warmup_steps=3")


def test_epochs_order_reads_each_window_once_a_pass_through_a_batch_warmup_and_a_resume(
        tmp_path, short_data, monkeypatch, capsys):
    # 3 steps of 8 windows, then 5 of 16: 104 windows, three passes of 30 and 14 of a fourth.
    starts = read_starts(monkeypatch, short_data)
    whole = train(tiny_config(tmp_path / "a" / "runs", short_data, *EPOCHS), progress=False)
    assert "passes over the 2,000 prepared training tokens, each window once a pass" in (
        capsys.readouterr().out)
    assert len(starts) == 104 and whole.tokens == 104 * 64
    passes = [starts[k * 30:(k + 1) * 30] for k in range(3)]
    for seen in passes:
        assert sorted(seen) == list(range(seen[0] % 64, 2000 - 64, 64))[:30]
    assert passes[0] != passes[1] != passes[2]
    # The order goes on from where a resume starts, inside the warm-up and after it.
    for stop in (2, 5):
        read = len(starts)
        first = train(tiny_config(tmp_path / f"b{stop}" / "runs", short_data, *EPOCHS),
                      progress=False, stop_after=stop)
        rest = train(tiny_config(tmp_path / f"b{stop}" / "runs", short_data, *EPOCHS),
                     resume=str(first.run_dir), progress=False)
        assert starts[read:] == starts[:104]
        assert {**first.losses, **rest.losses} == whole.losses


def test_the_12m_preset_reads_in_epochs_and_a_mixture_on_it_is_told_to_draw():
    """Round 10 made data.order epochs the 12M preset's; a mixture set on the preset is one
    line that says what to change, not a traceback."""
    assert load_config("andrea-12m.yaml").data.order == "epochs"
    proc = andrea_main("train", "--config", "andrea-12m.yaml",
                       "--set", "data.sources=[{path: a, weight: 1}, {path: b}]")
    assert_user_error(proc, "andrea-12m.yaml", "data.order: epochs passes over one data dir",
                      "set data.order=random, or use one source as data.source")
