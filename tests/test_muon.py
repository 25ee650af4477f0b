"""train.optimizer: muon: the update rule against torch.optim.Muon, groups, checkpoints, exact
resume, two processes, bad input."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from conftest import (
    Result,
    andrea_main,
    assert_user_error,
    config_file,
    load_script,
    run_torchrun_each,
    tiny_config,
)
from test_train import read_events

from andrea.config import load_config
from andrea.errors import UserError
from andrea.model.transformer import Andrea
from andrea.train import checkpoint as ckpt_io
from andrea.train.loop import train
from andrea.train.muon import (
    POLAR_EXPRESS,
    Float32Muon,
    NewtonSchulzSchedule,
    assign_owners,
    build_muon,
    newton_schulz,
    newton_schulz_macs,
    shard_rows,
)
from andrea.train.optim import CombinedOptimizer, build_optimizer, make_empty_state
from andrea.train.rundir import OPTIMIZER_FILE

torch_ns = pytest.importorskip("torch.optim._muon")._zeropower_via_newtonschulz
COEFFS = (3.4445, -4.7750, 2.0315)
QUINTIC = NewtonSchulzSchedule.quintic(COEFFS, 5)


@pytest.mark.parametrize("shape", [(48, 16), (16, 48), (32, 32)])
def test_newton_schulz_is_torchs_in_bf16_and_close_in_fp32(shape):
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    theirs = torch_ns(g, COEFFS, 5, 1e-7)
    assert torch.equal(newton_schulz(g, QUINTIC, eps=1e-7, dtype=torch.bfloat16), theirs)
    ours32 = newton_schulz(g, QUINTIC, eps=1e-7, dtype=torch.float32)
    ours64 = newton_schulz(g.double(), QUINTIC, eps=1e-7, dtype=torch.float64)
    # bf16 has an 8-bit mantissa (relative step 2^-8) and the entries are O(1/sqrt(n)).
    assert (ours32.double() - theirs.double()).abs().max() < 0.05
    assert (ours32.double() - ours64).abs().max() < 1e-5  # fp32 is the float64 result
    # The point of the iteration: singular values pushed into roughly (0.5, 1.5).
    s = torch.linalg.svdvals(ours64)
    assert s.min() > 0.3 and s.max() < 1.5


@pytest.mark.parametrize("shape", [(384, 1536), (1152, 384), (96, 192)])
@pytest.mark.parametrize("polar_express", [False, True])
def test_gram_iteration_is_the_plain_iteration(shape, polar_express):
    g = load_script("bench_newton_schulz").spread_matrix(*shape, decades=8, seed=0)
    schedule = POLAR_EXPRESS if polar_express else QUINTIC
    plain64 = newton_schulz(g, schedule, eps=1e-7, dtype=torch.float64)
    # The same arithmetic: in float64 the two forms agree to rounding.
    gram64 = newton_schulz(g, schedule, eps=1e-7, dtype=torch.float64, gram=True)
    assert (gram64 - plain64).norm() / plain64.norm() < 1e-10
    # float32 picks the Gram form at these shapes (long side >= 2x the short one) ...
    ours32 = newton_schulz(g.float(), schedule, eps=1e-7, dtype=torch.float32)
    assert torch.equal(ours32, newton_schulz(g.float(), schedule, eps=1e-7, dtype=torch.float32,
                                             gram=True))
    assert not torch.equal(ours32, newton_schulz(g.float(), schedule, eps=1e-7,
                                                 dtype=torch.float32, gram=False))
    # ... and follows float64 over 8 decades of singular values: measured 6e-5 to 3e-4 with the
    # quintic, up to 2.5e-3 with Polar Express, whose first step multiplies the smallest ones by
    # 8 (the plain float32 iteration: 1e-5; bfloat16, torch's own choice: about 0.1).
    error = (ours32.double() - plain64).norm() / plain64.norm()
    assert error < (5e-3 if polar_express else 1e-3)


def test_square_matrices_and_bf16_keep_the_plain_iteration():
    spread_matrix = load_script("bench_newton_schulz").spread_matrix
    square = spread_matrix(96, 96, decades=4, seed=0).float()
    assert torch.equal(newton_schulz(square, QUINTIC, eps=1e-7, dtype=torch.float32),
                       newton_schulz(square, QUINTIC, eps=1e-7, dtype=torch.float32,
                                     gram=False))
    wide = spread_matrix(32, 96, decades=4, seed=0).float()
    assert torch.equal(newton_schulz(wide, QUINTIC, eps=1e-7, dtype=torch.bfloat16),
                       torch_ns(wide, COEFFS, 5, 1e-7))


@pytest.mark.parametrize("shape", [(96, 96), (32, 96), (96, 32), (32, 48), (32, 160)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("polar_express", [False, True])
def test_newton_schulz_macs_counts_what_newton_schulz_multiplies(shape, dtype, polar_express):
    from torch.utils.flop_counter import FlopCounterMode

    x = torch.randn(shape)
    with FlopCounterMode(display=False) as counter:
        newton_schulz(x, POLAR_EXPRESS if polar_express else QUINTIC, eps=1e-7, dtype=dtype)
    assert counter.get_total_flops() == 2 * newton_schulz_macs(shape, dtype)


def _agree(got: torch.Tensor, want: torch.Tensor, bits: bool) -> bool:
    if bits:
        return torch.equal(got, want)
    return bool((got.double() - want.double()).abs().max() <= 1e-5 * want.abs().max())


def _stacked_products_give_single_bits(dtype: torch.dtype) -> bool:
    """Whether this machine's batched matrix products give each matrix its lone product's bits,
    as they do on the Xeon this was written on (then a stack must give the same bits)."""
    gen = torch.Generator().manual_seed(9)
    a, b = (torch.randn(4, 24, 24, generator=gen).to(dtype) for _ in range(2))
    return all(torch.equal(torch.baddbmm(a, a, b, beta=0.5)[i], torch.addmm(a[i], a[i], b[i],
                                                                             beta=0.5))
               for i in range(4))


@pytest.mark.parametrize("shape", [(36, 12), (12, 36), (20, 20)])  # tall, wide, square
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("polar_express", [False, True])
def test_a_stack_orthogonalises_each_matrix_as_if_alone(shape, dtype, polar_express):
    """Muon orthogonalises matrices of one shape as one stack (batched products: on a GPU one
    launch for all of them). Each must come out as it would alone: the norm per matrix (the
    matrices' scales here span 10^6, so one norm for the stack would be far off), the Gram form
    where it pays, a tall one transposed."""
    schedule = POLAR_EXPRESS if polar_express else QUINTIC
    gen = torch.Generator().manual_seed(sum(shape))
    mats = [torch.randn(shape, generator=gen) * 10.0 ** e for e in (-3, -1, 0, 1, 3)]
    alone = [newton_schulz(m, schedule, eps=1e-7, dtype=dtype) for m in mats]
    stacked = newton_schulz(torch.stack(mats), schedule, eps=1e-7, dtype=dtype)
    bits = _stacked_products_give_single_bits(dtype)
    for got, want in zip(stacked.unbind(0), alone, strict=True):
        assert got.shape == shape and got.dtype == dtype
        assert _agree(got, want, bits)


def _muon_steps(params: list[torch.nn.Parameter], groups_of_one: bool, **kwargs) -> Float32Muon:
    groups = [{"params": [p]} for p in params] if groups_of_one else [{"params": params}]
    opt = Float32Muon(groups, lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True, **kwargs)
    gen = torch.Generator().manual_seed(4)
    for _ in range(3):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    return opt


@pytest.mark.parametrize("options", [{"neuron_beta2": 0.95}, {"cautious_weight_decay": True},
                                     {}], ids=["normuon", "cautious", "plain"])
def test_one_group_of_many_matrices_steps_each_as_if_alone(options):
    """Three steps of Float32Muon over matrices of three shapes in one group (stacks by shape:
    the momentum, Newton-Schulz, NorMuon and the update as one launch per shape) against the
    same matrices each in a group of its own: the same parameters and state."""
    shapes = [(12, 20), (20, 12), (16, 16), (12, 20), (16, 16), (20, 12), (12, 20)]

    def params() -> list[torch.nn.Parameter]:
        gen = torch.Generator().manual_seed(1)
        return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]

    together, alone = params(), params()
    opt_together = _muon_steps(together, False, **options)
    opt_alone = _muon_steps(alone, True, **options)
    bits = _stacked_products_give_single_bits(torch.float32)
    for a, b in zip(together, alone, strict=True):
        assert _agree(a.detach(), b.detach(), bits)
        for key, value in opt_alone.state[b].items():
            assert _agree(opt_together.state[a][key], value, bits), key


def test_muons_launches_grow_with_the_shapes_not_the_matrices():
    """On a GPU each operator but a view is a kernel launch: a step over 8 matrices of one
    shape launches about as many as over one (scripts/step_op_counts.py's count), where one per
    matrix made it 8 times as many."""
    counts = load_script("step_op_counts")

    def launches(count: int) -> int:
        opt = _muon_steps([torch.nn.Parameter(torch.randn(24, 16)) for _ in range(count)],
                          False, neuron_beta2=0.95)
        with counts.OpCounter() as counter:
            opt.step()
        return sum(n for op, n in counter.ops.items() if op not in counts.VIEWS)

    one, eight = launches(1), launches(8)
    assert eight < 1.5 * one, (one, eight)


def test_the_split_weighs_each_matrix_by_the_form_it_is_orthogonalised_in():
    """A wide matrix in float32 costs less than its shape says (the Gram form): the former
    weights (rows x cols x min) put all four square matrices on one rank."""
    shapes = [(1536, 384)] + [(384, 384)] * 4
    owners = assign_owners(shapes, 2, torch.float32)
    load = [sum(newton_schulz_macs(s, torch.float32)
                for s, o in zip(shapes, owners, strict=True) if o == r) for r in range(2)]
    # in units of 384³: 40:45, where the former weights gave 25:60
    assert max(load) <= newton_schulz_macs((384, 384), torch.float32) * 3
    assert owners == [0, 1, 1, 0, 1]
    assert assign_owners(shapes, 2, torch.bfloat16) == [0, 1, 1, 1, 0]  # plain: 45:45


def test_polar_express_scales_by_its_margin_then_runs_its_five_quintics():
    """Against the formula in float64: G / (1.02 ||G||_F), then X <- a X + (b A + c A²) X
    with A = X Xᵀ for each of the schedule's (a, b, c) in turn."""
    g = torch.randn(8, 24, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    x = g / (g.norm() * 1.02)
    for a, b, c in POLAR_EXPRESS.coefficients:
        a_mat = x @ x.T
        x = a * x + (b * a_mat + c * a_mat @ a_mat) @ x
    for gram in (False, True):
        got = newton_schulz(g, POLAR_EXPRESS, eps=1e-7, dtype=torch.float64, gram=gram)
        torch.testing.assert_close(got, x, rtol=1e-9, atol=1e-12)


def test_bf16_with_an_option_torchs_muon_lacks_builds_andreas_muon():
    """torch's Muon (bfloat16) has no Polar Express, NorMuon or cautious decay: asked with
    any, bfloat16 gets Float32Muon in bfloat16, which has them, not torch's without a word."""
    params = [torch.nn.Parameter(torch.randn(8, 4))]
    common = dict(lr=0.02, weight_decay=0.1, momentum=0.95, ns_dtype=torch.bfloat16)
    assert type(build_muon(params, **common)) is torch.optim.Muon
    for option in (dict(polar_express=True), dict(neuron_beta2=0.95),
                   dict(cautious_weight_decay=True)):
        opt = build_muon(params, **common, **option)
        assert type(opt) is Float32Muon and opt.ns_dtype == torch.bfloat16, option


def test_cautious_decay_leaves_a_row_without_an_update_as_it_is():
    """A neuron whose gradient is zero gets a zero row of update (the orthogonalisation keeps
    zero rows): cautious decay, which decays only where the update agrees in sign, leaves it."""
    p = torch.nn.Parameter(torch.randn(6, 4, generator=torch.Generator().manual_seed(2)))
    before = p.detach().clone()
    opt = Float32Muon([p], lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True,
                      cautious_weight_decay=True)
    for seed in range(3):
        p.grad = torch.randn(6, 4, generator=torch.Generator().manual_seed(seed))
        p.grad[0] = 0.0
        opt.step()
    assert torch.equal(p.detach()[0], before[0])
    assert not torch.equal(p.detach()[1], before[1])


def test_each_ranks_rows_are_fsdps_torch_chunk_of_the_matrix():
    """SplitMuon's row split is the one FSDP2 shards by (torch.chunk: ceil(rows / world) a
    rank, the last ranks short or empty): every row on exactly one rank, in order."""
    for rows in range(1, 12):
        for world in range(1, 5):
            chunks = torch.arange(rows).chunk(world)
            want = [(int(c[0]), int(c[-1]) + 1) for c in chunks]
            want += [(rows, rows)] * (world - len(chunks))
            assert shard_rows(rows, world) == want, (rows, world)


def _three_steps(opt_cls, **kwargs):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(24, 8)), torch.nn.Parameter(torch.randn(8, 24))]
    opt = opt_cls(params, lr=0.02, weight_decay=0.1, momentum=0.95, **kwargs)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    return params, opt


def test_float32_muon_follows_torchs_update_rule():
    ref, ref_opt = _three_steps(torch.optim.Muon)
    same, _ = _three_steps(Float32Muon, ns_dtype=torch.bfloat16)
    assert all(torch.equal(a, b) for a, b in zip(ref, same, strict=True))  # bit for bit
    f32, f32_opt = _three_steps(Float32Muon)
    # Each step moves an entry by about lr * sqrt(3) / sqrt(cols); fp32 and bf16
    # orthogonalisation differ by a few bf16 ulps (2^-8 relative) of that, over three steps.
    for a, b in zip(ref, f32, strict=True):
        diff = (a.double() - b.double()).abs().max().item()
        assert 0 < diff < 3 * 0.02 * math.sqrt(3) * 0.05, diff
    for p, q in zip(ref_opt.state, f32_opt.state, strict=True):  # the same state, same field names
        assert set(ref_opt.state[p]) == set(f32_opt.state[q]) == {"momentum_buffer"}


def test_muon_takes_the_block_matrices_and_adamw_the_rest(data_dir, tmp_path):
    cfg = tiny_config(tmp_path / "runs", data_dir, "train.optimizer=muon", "train.muon_lr=0.05")
    model = Andrea(cfg.model)
    opt = build_optimizer(model, cfg, torch.device("cpu"))
    assert isinstance(opt, CombinedOptimizer) and list(opt.parts) == ["muon", "adamw"]
    names = {id(p): n for n, p in model.named_parameters()}
    muon = sorted(names[id(p)] for g in opt.parts["muon"].param_groups for p in g["params"])
    assert muon == sorted(f"blocks.{i}.{m}.weight" for i in range(cfg.model.n_layer)
                          for m in ("attn.qkv", "attn.out", "mlp.up", "mlp.down"))
    adamw = {names[id(p)] for g in opt.parts["adamw"].param_groups for p in g["params"]}
    assert "tok_emb.weight" in adamw and "pos_emb.weight" in adamw and "ln_f.weight" in adamw
    assert len(muon) + len(adamw) == len(names)  # every parameter once (the head is tied)
    assert isinstance(opt.parts["muon"], (Float32Muon, torch.optim.Muon))
    # each group's peak lr, stated once: Muon's train.muon_lr, AdamW's train.lr
    assert [g["peak_lr"] for g in opt.param_groups] == [0.05] + [cfg.train.lr] * 2


def test_ns_precision_picks_the_implementation(data_dir, tmp_path):
    for precision, want in (("fp32", Float32Muon), ("bf16", torch.optim.Muon)):
        cfg = tiny_config(tmp_path / "runs", data_dir, "train.optimizer=muon",
                          f"train.muon_ns_precision={precision}")
        opt = build_optimizer(Andrea(cfg.model), cfg, torch.device("cpu"))
        assert type(opt.parts["muon"]) is want


def test_exact_resume_bit_for_bit_with_muon(tmp_path, data_dir):
    sets = ("train.max_steps=8", "train.precision=fp32", "train.optimizer=muon",
            "train.global_batch_tokens=1024", "train.warmup_steps=2")
    whole = train(tiny_config(tmp_path / "a" / "runs", data_dir, *sets), progress=False)
    first = train(tiny_config(tmp_path / "b" / "runs", data_dir, *sets), progress=False,
                  stop_after=3)
    assert first.state == "stopped" and first.steps == 3
    fields = ckpt_io.read_safetensors(first.checkpoint / OPTIMIZER_FILE)[0]
    assert "blocks.0.attn.qkv.weight.momentum_buffer" in fields
    assert "tok_emb.weight.exp_avg" in fields and "blocks.0.attn.qkv.weight.exp_avg" not in fields
    rest = train(tiny_config(tmp_path / "b" / "runs", data_dir, *sets), resume=str(first.run_dir),
                 progress=False)
    assert {**first.losses, **rest.losses} == whole.losses  # exact float equality
    a = ckpt_io.read_model_checkpoint(whole.checkpoint)[0]
    b = ckpt_io.read_model_checkpoint(rest.checkpoint)[0]
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert whole.losses[8] < whole.losses[1]


TWO_SETS = ("train.max_steps=3", "train.precision=fp32", "train.micro_batch_size=4",
            "train.global_batch_tokens=512", "train.optimizer=muon", "train.muon_ns_precision=fp32")


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory, data_dir) -> tuple[Path, dict[str, Result]]:
    """This file's two-process runs in one torchrun launch (conftest.run_torchrun_each): a
    training with Muon (runs/t), then the SPLIT script, which counts Newton-Schulz calls by
    patching them (last, so that it counts no training's)."""
    root = tmp_path_factory.mktemp("two")
    cfg = tiny_config(root / "runs", data_dir, *TWO_SETS)
    (root / "split.py").write_text(SPLIT)
    return root, run_torchrun_each(root / "launch", {
        "train": ["train", "-c", str(config_file(cfg, root)), "--no-progress"],
        "split": [str(root / "split.py")],
    })


def test_two_processes_with_muon_match_one(tmp_path, data_dir, two_processes):
    one = train(tiny_config(tmp_path / "one" / "runs", data_dir, *TWO_SETS), progress=False)
    root, proc = two_processes[0], two_processes[1]["train"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    two = {r["step"]: r["loss"] for r in read_events(root / "runs" / "t", "train")}
    assert sorted(two) == [1, 2, 3]
    for step, loss in two.items():
        assert math.isclose(loss, one.losses[step], rel_tol=1e-5), (step, loss, one.losses)


SPLIT = """
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from andrea.config import load_config
from andrea.model.transformer import Andrea
from andrea.train import muon
from andrea.train.optim import build_optimizer
from andrea.train.process_group import init_distributed, shutdown
from andrea.train.sharding import full_tensor, shard_like, shard_model

info = init_distributed("cpu")
# d_model 15: every matrix has an odd number of rows (45, 15, 60, 15), so the shards are uneven.
cfg = load_config("andrea-tiny", ["train.optimizer=muon", "train.muon_ns_precision=fp32",
                                  "model.n_head=3", "model.head_dim=5", "model.d_model=15"])
calls = []
real_ns = muon.newton_schulz


def counted_ns(g, *a, **kw):  # each matrix orthogonalised, alone or in a stack of one shape
    calls.extend([tuple(g.shape[-2:])] * (g.shape[0] if g.dim() == 3 else 1))
    return real_ns(g, *a, **kw)


muon.newton_schulz = counted_ns
STEPS = 3


def train(layout, world_size):
    torch.manual_seed(0)
    model = Andrea(cfg.model)
    if layout == "fsdp":
        shard_model(model, info, torch.device("cpu"), bf16_params=False)
    if layout == "float64":
        model.double()
    opt = build_optimizer(model, cfg, torch.device("cpu"), world_size)
    if layout == "float64":
        opt.parts["muon"].ns_dtype = torch.float64
    gen = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        for p in model.parameters():  # every rank the same (all-reduced) gradient
            p.grad = shard_like(torch.randn(p.shape, generator=gen, dtype=torch.float64)
                                .to(p.dtype), p)
        for group in opt.param_groups:
            group["lr"] = 0.01 * (step + 1)
        opt.step()
    return model, opt


got = {}
for layout in ("ddp", "fsdp"):
    calls.clear()
    model, opt = train(layout, 2)
    matrices = opt.parts["muon"].param_groups[0]["params"]
    owners = muon.assign_owners([p.shape for p in matrices], 2)
    mine = [tuple(p.shape) for p, o in zip(matrices, owners) if o == info.rank]
    assert sorted(calls) == sorted(mine * STEPS)
    assert isinstance(opt.parts["muon"].state[matrices[0]]["momentum_buffer"], DTensor) == (
        layout == "fsdp")
    got[layout] = {n: full_tensor(p.detach()) for n, p in model.named_parameters()}
    shares = [None, None]
    dist.all_gather_object(shares, len(calls) // STEPS)
    if info.rank == 0:
        print(layout, "newton-schulz calls per step and rank:", shares)
if info.rank == 0:
    calls.clear()
    one = dict(train("one", 1)[0].named_parameters())
    assert len(calls) == 8 * STEPS  # one process orthogonalises every matrix
    ref = dict(train("float64", 1)[0].named_parameters())
    for layout, params in got.items():
        for name, p in params.items():
            # float32 against float64 after 3 steps of about 0.02 each: ~1e-7 measured
            assert (p.double() - ref[name]).abs().max() < 1e-6, (layout, name)
            assert (p - one[name]).abs().max() < 1e-6, (layout, name)  # measured: bit for bit
    print("split ok")
shutdown(info)  # collects the sharded model's cycles first: gloo torn down late can SIGABRT
"""


def test_two_processes_split_newton_schulz_and_match_one(two_processes):
    """DDP's whole matrices and FSDP2's uneven row shards: each rank orthogonalises its share
    (assign_owners), and 3 steps give one process's parameters and a float64 reference's."""
    proc = two_processes[1]["split"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ddp newton-schulz calls per step and rank: [4, 4]" in proc.stdout
    assert "fsdp newton-schulz calls per step and rank: [4, 4]" in proc.stdout
    assert "split ok" in proc.stdout


def test_bad_muon_settings_are_one_line_errors(tmp_path, data_dir):
    cfg = tiny_config(tmp_path / "runs", data_dir, "train.max_steps=2")
    path = str(config_file(cfg, tmp_path))
    for key in ("train.muon_lr", "train.lr"):
        for value in ("0", "-0.01"):
            assert_user_error(
                andrea_main("train", "-c", path, "--set", "train.optimizer=muon",
                           "--set", f"{key}={value}"),
                key, "must be positive",
            )
    assert_user_error(andrea_main("train", "-c", path, "--set", "train.optimizer=lion"),
                      "train.optimizer", "'lion'", "adamw, muon")


def test_resuming_with_another_optimizer_is_refused(tmp_path, data_dir):
    result = train(tiny_config(tmp_path / "runs", data_dir, "train.max_steps=2"), progress=False)
    assert_user_error(
        andrea_main("train", "--resume", str(result.run_dir), "--set", "train.optimizer=muon"),
        "cannot change", "train.optimizer (adamw -> muon)",
    )


def test_a_torch_without_muon_is_named(tmp_path, data_dir, monkeypatch):
    cfg = tiny_config(tmp_path / "runs", data_dir, "train.optimizer=muon")
    monkeypatch.delattr(torch.optim, "Muon")
    monkeypatch.setattr(torch, "__version__", "2.8.0")
    with pytest.raises(UserError, match=r"muon needs torch >= 2\.9 \(this is 2\.8\.0\)"):
        build_optimizer(Andrea(cfg.model), cfg, torch.device("cpu"))


@pytest.mark.parametrize("sets", [["train.optimizer=adamw"],
                                  ["train.optimizer=muon", "train.muon_ns_precision=bf16"],
                                  ["train.optimizer=muon", "train.muon_neuron_beta2=0.95"]])
def test_each_optimizer_makes_the_empty_state_its_first_step_makes(sets):
    """What a sharded checkpoint is read into: the fields, shapes, dtypes and devices of the
    state a step makes (AdamW's, torch's Muon, NorMuon's per-neuron moments), as zeros."""
    cfg = load_config("andrea-tiny", sets)

    def built():
        torch.manual_seed(0)
        model = Andrea(cfg.model)
        return model, build_optimizer(model, cfg, torch.device("cpu"))

    stepped, opt = built()
    for p in stepped.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    _, empty = built()
    make_empty_state(empty)

    def layout(o):
        return [{k: (v.shape, v.dtype, v.device) for k, v in o.state[p].items()}
                for g in o.param_groups for p in g["params"]]

    assert layout(empty) == layout(opt)
    assert all(not v.any() for s in empty.state.values() for v in s.values())


def test_an_optimizer_whose_state_is_unknown_is_refused_not_given_adamws():
    sgd = torch.optim.SGD([torch.nn.Parameter(torch.ones(3))], lr=0.1, momentum=0.9)
    with pytest.raises(NotImplementedError, match="SGD: its per-parameter state is not known"):
        make_empty_state(CombinedOptimizer(sgd=sgd))
    assert not sgd.state
