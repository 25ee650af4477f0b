"""train.precision fp16: dynamic loss scaling (andrea/train/scaling.py), the overflow a test
injects (skipped, counted, the scale halved, an exact resume), the gradients against a float64
reference, and what precision auto chooses on each kind of GPU (andrea/train/device.py).

fp16 autocast on a CPU without fp16 units is several times slower than fp32 (docs/log.md), so
these runs take micro-batches of 2 sequences."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_config

from andrea import runs
from andrea.config import load_config
from andrea.model.transformer import Andrea
from andrea.train import checkpoint as ckpt_io
from andrea.train.device import choose_precision, gpu_precision
from andrea.train.loop import train
from andrea.train.optim import build_optimizer
from andrea.train.scaling import INIT_SCALE, DynamicLossScaling, LossScaling, loss_scaling_for
from andrea.train.schedule import multiplier

SMALL = ("train.precision=fp16", "train.micro_batch_size=2", "model.dropout=0.1")


def events(run_dir, kind: str) -> list[dict]:
    records, _ = runs.read_metrics(run_dir / "metrics.jsonl")
    return [r for r in records if r["event"] == kind]


def test_an_overflow_is_one_skipped_step_and_a_resume_keeps_the_scale(
        tmp_path, data_dir, inject_faults, capsys):
    """overflow@3: step 3 is not applied, the scale halves, the schedule and the run go on;
    the skip is counted in metrics.jsonl and `andrea runs`. A run stopped after step 3 and
    resumed repeats the uninterrupted run bit for bit, its scale and count carried over.
    fp16 asked for on a CPU is one warning line with its measured cost, and `andrea runs`
    shows the run's precision."""
    inject_faults("overflow@3")
    sets = (*SMALL, "train.max_steps=5")
    whole = train(tiny_config(tmp_path / "a" / "runs", data_dir, *sets), progress=False)
    warned = [line for line in capsys.readouterr().out.splitlines() if "warning" in line]
    assert warned == ["warning: fp16 on a CPU: it ran 3.4 to 6.8 times slower than fp32 on this "
                      "project's CPU (docs/precision.md); set train.precision=auto (fp32 on a "
                      "CPU, bf16 on one with bf16 units)"]
    assert whole.state == "finished" and sorted(whole.losses) == [1, 2, 3, 4, 5]
    [overflow] = events(whole.run_dir, "overflow")
    assert overflow["step"] == 3 and overflow["loss_scale"] == INIT_SCALE / 2
    trained = {r["step"]: r for r in events(whole.run_dir, "train")}
    assert [trained[s]["loss_scale"] for s in (2, 3, 5)] == [INIT_SCALE, INIT_SCALE / 2,
                                                             INIT_SCALE / 2]
    assert [trained[s]["overflows"] for s in (2, 3, 5)] == [0, 1, 1]
    cfg = tiny_config(tmp_path / "runs", data_dir, *sets).train  # the schedule still counted step 3
    assert trained[4]["lr"] == pytest.approx(multiplier(3, cfg, None).lr)
    assert events(whole.run_dir, "end")[0]["overflow_steps"] == 1
    summary = runs.read_run(whole.run_dir)
    assert summary.overflows == 1
    assert "fp16 overflow steps skipped: 1" in runs.format_table([summary])
    header, row = runs.format_table([summary]).splitlines()[:2]
    assert summary.precision == "fp16" and row[header.index("PRECISION"):].split()[0] == "fp16"

    first = train(tiny_config(tmp_path / "b" / "runs", data_dir, *sets), progress=False,
                  stop_after=3)
    inject_faults(None)  # the resumed segment needs no fault: step 3 is behind it
    rest = train(tiny_config(tmp_path / "b" / "runs", data_dir, *sets), resume=str(first.run_dir),
                 progress=False)
    assert {**first.losses, **rest.losses} == whole.losses  # exact, every step
    state = ckpt_io.read_trainer_state(rest.checkpoint)[0]
    assert state.loss_scaling["scale"] == INIT_SCALE / 2 and state.loss_scaling["overflows"] == 1
    a = ckpt_io.read_model_checkpoint(whole.checkpoint)[0]
    b = ckpt_io.read_model_checkpoint(rest.checkpoint)[0]
    assert all(torch.equal(a[k], b[k]) for k in a)


def gradients(model: Andrea, x: torch.Tensor, scaling: LossScaling, dtype: torch.dtype,
              loss_factor: float, optimizer=None) -> torch.Tensor:
    """Every gradient, flat, of loss_factor x the model's loss under autocast to dtype, as the
    optimizer would step with it."""
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        _, loss = model(x[:, :-1], x[:, 1:])
    scaling.scale(loss * loss_factor).backward()
    scaling.unscale(optimizer or torch.optim.SGD(model.parameters()))
    return torch.cat([p.grad.double().flatten() for p in model.parameters()])


def test_scaled_fp16_gradients_match_float64_where_unscaled_ones_underflow():
    """A small loss (x 2^-14, as a late-training loss's gradients are small) through fp16's
    backward: scaled by 2^16 its gradients match a float64 reference within fp16's precision
    (a relative error of a few 2^-11: 5.5e-4 measured); unscaled, a quarter of them flush to
    zero and the whole is half wrong (0.51)."""
    cfg = load_config("andrea-tiny")
    torch.manual_seed(0)
    model = Andrea(cfg.model)
    x = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.block_size + 1))
    small = 2.0**-14
    reference = gradients(model.double(), x, LossScaling(), torch.float32, small)
    model.float()
    scaled = gradients(model, x, DynamicLossScaling(torch.device("cpu")), torch.float16, small)
    unscaled = gradients(model, x, LossScaling(), torch.float16, small)
    error = (scaled - reference).norm() / reference.norm()
    assert error < 8 * 2.0**-11, error
    lost = (unscaled - reference).norm() / reference.norm()
    assert lost > 0.2 and (unscaled == 0).float().mean() > 0.1, lost


def test_muon_and_adamw_both_step_with_unscaled_gradients():
    """Muon orthogonalises its gradients (a scale would not change the direction, but its
    weight decay and AdamW's moments would see 65,536x too much): each part is unscaled."""
    cfg = load_config("andrea-tiny", ["train.optimizer=muon"])
    torch.manual_seed(0)
    model = Andrea(cfg.model)
    optimizer = build_optimizer(model, cfg, torch.device("cpu"))
    assert set(optimizer.parts) == {"muon", "adamw"}
    x = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.block_size + 1))
    plain = gradients(model, x, LossScaling(), torch.float16, 1.0, optimizer)
    scaled = gradients(model, x, DynamicLossScaling(torch.device("cpu")), torch.float16, 1.0,
                       optimizer)
    assert (scaled - plain).norm() / plain.norm() < 1e-2  # unscaled: 65,535 off


def test_no_scaling_is_a_pass_through():
    cpu = torch.device("cpu")
    assert isinstance(loss_scaling_for(torch.float16, cpu), DynamicLossScaling)
    for dtype in (torch.bfloat16, torch.float32):
        none = loss_scaling_for(dtype, cpu)
        loss = torch.tensor(2.0)
        assert not none.enabled and none.scale(loss) is loss and none.state_dict() is None
        assert not none.overflowed(1.0, float("inf"))  # a non-finite step is no overflow here


def test_an_overflow_is_a_finite_loss_with_gradients_that_are_not():
    """Only gradients past the scale's range are an overflow (the step skipped, the scale
    halved, the run goes on); a non-finite loss is the forward's, which no scale causes: the
    run stops (or skips it under train.skip_nonfinite). Mutation round 3: a NaN loss counted as
    an overflow passed every test, so a diverged fp16 run went on halving its scale."""
    scaling = DynamicLossScaling(torch.device("cpu"))
    assert scaling.overflowed(2.0, float("inf")) and scaling.overflowed(2.0, float("nan"))
    assert not scaling.overflowed(float("nan"), float("nan"))
    assert not scaling.overflowed(float("inf"), float("inf"))
    assert not scaling.overflowed(2.0, 1.5)


@pytest.mark.parametrize("capability, chosen, says", [
    ((9, 0), torch.bfloat16, "bf16 tensor cores"),  # H100, H200
    ((8, 0), torch.bfloat16, "bf16 tensor cores"),  # A100
    ((8, 9), torch.bfloat16, "bf16 tensor cores"),  # RTX 40xx, L4, L40S
    ((7, 5), torch.float16, "fp16 tensor cores"),  # T4, RTX 20xx
    ((7, 0), torch.float16, "fp16 tensor cores"),  # V100
    ((6, 0), torch.float16, "twice its fp32 rate"),  # P100
    ((6, 1), torch.float32, "far slower"),  # GTX 10xx, P40: fp16 at 1/64 of fp32
    ((5, 2), torch.float32, "far slower"),  # Maxwell
])
def test_auto_precision_by_compute_capability(monkeypatch, capability, chosen, says):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    got = choose_precision("auto", torch.device("cuda"))
    assert got == gpu_precision(capability) and got.dtype == chosen and says in got.why
    assert f"{capability[0]}.{capability[1]}" in got.why
    assert choose_precision("fp16", torch.device("cuda")).dtype == torch.float16  # by name


def test_eval_and_generate_take_fp16():
    from andrea.evaluate import EvalSettings
    from andrea.generate import _check_options

    EvalSettings(precision="fp16", device="cpu").check()
    _check_options(1.0, None, None, 1, 1, "fp16")
