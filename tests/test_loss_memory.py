"""The chunked loss and activation checkpointing: same numbers as the plain forms."""

from __future__ import annotations

import re
import shutil

import pytest
import torch
import torch.nn.functional as F
from conftest import andrea_main, config_file, tiny_config

from andrea.config import load_config
from andrea.errors import UserError
from andrea.model.transformer import (
    LOSS_CHUNK_LOGITS,
    WEIGHT_GRAD_GROUP,
    Andrea,
    ChunkedCrossEntropy,
    add_in_order,
    softmax_chunk,
)
from andrea.train.memory import estimate_peak_bytes


def tiny_model(*sets: str, dtype: torch.dtype = torch.float32) -> Andrea:
    torch.manual_seed(0)
    return Andrea(load_config("andrea-tiny", list(sets)).model).to(dtype)


def batch(model: Andrea, b: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, model.cfg.vocab_size, (b, model.cfg.block_size), generator=g)
    y = torch.randint(0, model.cfg.vocab_size, (b, model.cfg.block_size), generator=g)
    y[0, :5] = -1  # ignored positions count neither in the loss nor in the mean
    return x, y


def loss_and_grads(model: Andrea, x, y, autocast: bool = False):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits, loss = model(x, y)
    assert logits is None
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("chunk_rows", [1, 7, 64, 10_000])  # many chunks, ragged, one
def test_chunked_loss_equals_full_logits_float32(chunk_rows):
    model = tiny_model()
    x, y = batch(model)
    model.loss_chunk_rows = None
    full_loss, full_grads = loss_and_grads(model, x, y)
    model.loss_chunk_rows = chunk_rows
    loss, grads = loss_and_grads(model, x, y)
    assert abs(loss.item() - full_loss.item()) <= 1e-6 * full_loss.item()
    for name, grad in grads.items():
        assert relative(grad, full_grads[name]) <= 1e-6, name


def test_chunked_loss_matches_a_float64_reference():
    torch.manual_seed(0)
    n, d, vocab = 50, 16, 37
    hidden = torch.randn(n, d, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(vocab, d, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, vocab, (n,))
    targets[3] = -1
    reference = F.cross_entropy(hidden @ weight.t(), targets, ignore_index=-1)
    ref_grads = torch.autograd.grad(reference, (hidden, weight))
    loss = ChunkedCrossEntropy.apply(hidden, weight, targets, 8)
    assert loss.dtype == torch.float64
    grads = torch.autograd.grad(loss, (hidden, weight))
    assert abs(loss.item() - reference.item()) <= 1e-12 * reference.item()
    for got, want in zip(grads, ref_grads, strict=True):
        assert relative(got, want) <= 1e-12
    assert torch.count_nonzero(grads[0][3]) == 0  # an ignored row gets no gradient
    # gradcheck perturbs one input at a time, two forwards each: on the whole problem that took
    # a minute and a half. A corner of it keeps ragged chunks (4, 4, 3) and the ignored row.
    corner_h = hidden[:11, :4].detach().clone().requires_grad_()
    corner_w = weight[:6, :4].detach().clone().requires_grad_()
    corner_t = targets[:11].clamp(max=5)
    assert corner_t[3] == -1
    assert torch.autograd.gradcheck(
        lambda h, w: ChunkedCrossEntropy.apply(h, w, corner_t, 4), (corner_h, corner_w)
    )


def test_chunked_loss_under_bf16_autocast_agrees_with_the_full_form():
    model = tiny_model()
    x, y = batch(model)
    model.loss_chunk_rows = None
    full_loss, full_grads = loss_and_grads(model, x, y, autocast=True)
    model.loss_chunk_rows = 7
    loss, grads = loss_and_grads(model, x, y, autocast=True)
    assert loss.dtype == torch.float32
    # The same bf16 matmuls; only the gradient's per-chunk bf16 rounding differs.
    assert abs(loss.item() - full_loss.item()) <= 1e-6 * full_loss.item()
    for name, grad in grads.items():
        assert relative(grad, full_grads[name]) <= 1e-2, name


def float64_grads(hidden, weight, targets) -> tuple[torch.Tensor, torch.Tensor]:
    """d loss / d hidden and d loss / d weight of the plain loss in float64: the reference."""
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    return torch.autograd.grad(F.cross_entropy(h64 @ w64.t(), targets, ignore_index=-1),
                               (h64, w64))


def fp16_errors(loss_of, hidden, weight, want, scale=2.0**16) -> list[float] | None:
    """The gradients' relative errors against `want` (float64_grads), the loss scaled as
    GradScaler scales it (SCALE: its first) and the gradients divided back; None where they are
    not finite (GradScaler would skip the step and halve the scale)."""
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = loss_of(h, w)
    grads = torch.autograd.grad(loss * scale, (h, w))
    if not all(torch.isfinite(g).all() for g in grads):
        return None
    return [relative(got.double() / scale, ref) for got, ref in zip(grads, want, strict=True)]


def plain_loss(targets):
    return lambda h, w: F.cross_entropy(F.linear(h, w).float(), targets, ignore_index=-1)


def chunked_loss(targets, rows):
    return lambda h, w: ChunkedCrossEntropy.apply(h, w, targets, rows)


@pytest.fixture(scope="module")
def fp16_batch():
    """4,096 rows at vocab 8,192, every 7th target ignored; the float64 reference and the plain
    form's fp16 errors, computed once for every chunk size (fp16 matmuls are slow on a CPU)."""
    g = torch.Generator().manual_seed(0)
    n, d, vocab = 4096, 64, 8192
    hidden = torch.randn(n, d, generator=g)
    weight = torch.randn(vocab, d, generator=g) * 0.16
    targets = torch.randint(0, vocab, (n,), generator=g)
    targets[::7] = -1
    want = float64_grads(hidden, weight, targets)
    return hidden, weight, targets, want, fp16_errors(plain_loss(targets), hidden, weight, want)


# 4,096 rows: chunks of 256, 1,024 and 4,096 take divisors 1/4, 1 and 4; one of 100,000 is
# the whole batch's, as 4,096 is.
@pytest.mark.parametrize("chunk_rows", [256, 1024, 4096, 100_000])
def test_chunked_loss_under_fp16_loses_no_more_than_the_plain_form(chunk_rows, fp16_batch):
    """fp16 with GradScaler (train.precision: fp16): the chunked loss computes d loss / d logits
    in its forward, before the loss scale is applied in backward. Divided by the count of rows
    there, most of it flushed to zero in fp16 (8.5e-3 off float64 here, against the plain
    form's 3.1e-4); it must be the plain form's to fp16's rounding, ignored targets too."""
    hidden, weight, targets, want, plain = fp16_batch
    chunked = fp16_errors(chunked_loss(targets, chunk_rows), hidden, weight, want)
    assert max(plain) < 1e-3
    for got, base in zip(chunked, plain, strict=True):
        assert got <= 1.05 * base, (chunked, plain)


def test_a_large_hidden_feature_does_not_overflow_the_fp16_chunked_loss():
    """A hidden feature of 70 where every row has the same target: a chunk's weight-gradient
    product (rows x the multiplier x |hidden|) overflowed fp16 at any loss scale, so GradScaler
    would have skipped every step; the multiplier now shrinks with |hidden|, and the gradients
    are finite where the plain form's are, as accurate."""
    g = torch.Generator().manual_seed(0)
    n, d, vocab = 1024, 64, 8192
    hidden = torch.randn(n, d, generator=g)
    hidden[:, 0] = 70.0
    weight = torch.randn(vocab, d, generator=g) * 0.02
    targets = torch.zeros(n, dtype=torch.long)
    want = float64_grads(hidden, weight, targets)
    plain = fp16_errors(plain_loss(targets), hidden, weight, want, scale=256.0)
    chunked = fp16_errors(chunked_loss(targets, 1024), hidden, weight, want, scale=256.0)
    assert plain is not None and chunked is not None
    for got, base in zip(chunked, plain, strict=True):
        assert got <= 1.05 * base + 1e-4, (chunked, plain)


def test_the_loss_computes_no_gradients_without_autograd():
    """Validation (torch.no_grad) wants the loss alone: the chunked form's gradients, computed in
    its forward, would cost another two matmuls and a float32 [vocab, d_model] for nothing."""
    model = tiny_model()
    x, y = batch(model)
    asked = []

    def spy(*args):
        asked.append(args[-1])
        return softmax_chunk(*args)

    model.loss_chunk_fn = spy
    with torch.no_grad():
        loss = model(x, y)[1]
    assert asked and not any(asked)
    asked.clear()
    assert torch.equal(model(x, y)[1], loss) and all(asked)


def test_logits_are_returned_without_targets():
    model = tiny_model()
    x, y = batch(model)
    logits, loss = model(x)
    assert loss is None and logits.shape == (*x.shape, model.cfg.vocab_size)
    model.loss_chunk_rows = None
    want = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1), ignore_index=-1)
    assert torch.equal(model(x, y)[1], want)


def test_activation_checkpointing_gives_the_same_gradients():
    model = tiny_model("model.dropout=0.1")  # dropout: the recomputation must replay the RNG
    x, y = batch(model)
    torch.manual_seed(5)
    plain_loss, plain = loss_and_grads(model, x, y)
    model.checkpoint_blocks = True
    torch.manual_seed(5)
    loss, grads = loss_and_grads(model, x, y)
    assert torch.equal(loss, plain_loss)
    for name, grad in grads.items():
        assert torch.equal(grad, plain[name]), name


@pytest.mark.skipif(shutil.which("g++") is None, reason="inductor's CPU code needs g++")
def test_the_compiled_chunk_is_one_pass_with_the_eager_arithmetic(monkeypatch):
    """Under torch.compile, softmax_chunk writes its gradient pointwise, which inductor fuses
    with the softmax into one kernel that allocates no float32 [rows, vocab] buffer: the
    in-place scatter of the eager form made it keep one and read it back (a chunk of 667 x
    50,304 took 131 ms compiled that way on a 2-core EPYC, 78 ms as one pass). The pointwise
    form is the eager form's arithmetic: the same bits."""
    from torch._inductor.utils import run_and_get_code

    rows, vocab = 6, 300
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, vocab, generator=g).to(torch.bfloat16)
    targets = torch.randint(0, vocab, (rows, 1), generator=g)
    valid = torch.ones(rows)
    valid[2] = 0  # an ignored row
    count = valid.sum()
    eager = softmax_chunk(logits, targets, valid, count, True)
    with monkeypatch.context() as patch:
        patch.setattr(torch.compiler, "is_compiling", lambda: True)
        pointwise = softmax_chunk(logits, targets, valid, count, True)
    assert torch.equal(pointwise[0], eager[0]) and torch.equal(pointwise[1], eager[1])

    torch._dynamo.reset()
    compiled = torch.compile(softmax_chunk, dynamic=False)
    (nll, grad), (code,) = run_and_get_code(compiled, logits, targets, valid, count, True)
    assert code.count("async_compile.cpp_pybinding(") == 1, code  # one kernel
    buffers = re.findall(r"empty_strided_cpu\(\((\d+), (\d+)\), [^)]*\), torch\.(\w+)\)", code)
    assert (str(rows), str(vocab), "float32") not in buffers, buffers
    assert torch.allclose(nll, eager[0], rtol=1e-6)
    assert torch.allclose(grad.float(), eager[1].float(), rtol=1e-2, atol=1e-7)
    assert torch.count_nonzero(grad[2]) == 0


@pytest.mark.parametrize("setting", ["auto", "5", "0"])
def test_train_loss_chunk_rows_reaches_the_training_loss(tmp_path, data_dir, monkeypatch,
                                                         setting):
    """train.loss_chunk_rows is the chunk size of the loss a training computes (auto: from the
    vocabulary alone; 0: no chunks, the plain form), in its steps and its evaluation."""
    rows_seen = []
    chunked = ChunkedCrossEntropy.apply
    monkeypatch.setattr(ChunkedCrossEntropy, "apply",
                        lambda *args: rows_seen.append(args[3]) or chunked(*args))
    cfg = tiny_config(tmp_path / "runs", data_dir, f"train.loss_chunk_rows={setting}",
                      "train.max_steps=2")
    proc = andrea_main("train", "-c", str(config_file(cfg, tmp_path)), "--no-progress")
    assert proc.returncode == 0, proc.stderr
    if setting == "0":
        assert rows_seen == []
    else:
        auto = LOSS_CHUNK_LOGITS // cfg.model.vocab_size
        assert rows_seen and set(rows_seen) == {auto if setting == "auto" else int(setting)}


def test_loss_chunk_rows_is_checked_and_weighed_by_the_memory_estimate():
    for bad in ("-1", "1.5", "half", "true"):
        with pytest.raises(UserError, match=r"train\.loss_chunk_rows: (must be auto or an "
                                            r"integer of 0 or more|expected an integer)"):
            load_config("andrea-tiny", [f"train.loss_chunk_rows={bad}"])
    assert load_config("andrea-tiny", ["train.loss_chunk_rows=0"]).train.loss_chunk_rows == 0
    model = load_config("andrea-120m").model
    n, tokens = 124_373_760, 16 * 1024
    auto, plain, big = (estimate_peak_bytes(model, n, 16, torch.bfloat16, False, rows)
                        for rows in ("auto", 0, 4096))
    auto_chunk = LOSS_CHUNK_LOGITS // model.vocab_size * model.vocab_size  # 667 rows
    # 16 x 1024 x 50,304 logits: about 0.8 G at once, 12 + 2 x 2 bytes each unchunked, and no
    # float32 gradient of the tied weight of the loss's own, nor a group of its bf16 products.
    assert plain - auto == (16 * tokens * model.vocab_size - 8 * auto_chunk
                            - (4 + 2 * WEIGHT_GRAD_GROUP) * model.vocab_size * 768)
    assert big - auto == 8 * (4096 * model.vocab_size - auto_chunk)


@pytest.mark.skipif(shutil.which("g++") is None, reason="inductor's CPU code needs g++")
@pytest.mark.parametrize("n,groups_wanted", [(45, [WEIGHT_GRAD_GROUP, 6 - WEIGHT_GRAD_GROUP]),
                                             (37, [WEIGHT_GRAD_GROUP])])
def test_the_weight_gradients_products_added_a_group_at_a_time_give_the_same_bits(
        n, groups_wanted):
    """Under a compiled model the chunks' bf16 weight-gradient products are added into the
    float32 sum WEIGHT_GRAD_GROUP at a time by one compiled pass (add_in_order) instead of one
    pass each: the same loss and gradients, bit for bit, with 6 chunks of 8 rows (a group, then
    the 2 left) and with 5 (a group, then one added alone), through inductor's fused kernel as a
    compiled run has it (one kernel a group)."""
    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(0)
    d, vocab = 16, 37
    hidden, weight = torch.randn(n, d), torch.randn(vocab, d)
    targets = torch.randint(0, vocab, (n,))
    compiled = torch.compile(add_in_order, dynamic=False)
    groups, kernels = [], []

    def add_products(total, products):
        groups.append(len(products))
        _, codes = run_and_get_code(compiled, total, products)
        kernels.extend(code.count("async_compile.cpp_pybinding(") for code in codes)

    def run(add):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = ChunkedCrossEntropy.apply(h, w, targets, 8, softmax_chunk, add)
        loss.backward()
        return loss, h.grad, w.grad

    want = run(None)
    got = run(add_products)
    assert groups == groups_wanted
    assert all(k == 1 for k in kernels), kernels  # each group's adds, one pass
    assert want[2].dtype == torch.float32
    for name, g, w in zip(("loss", "hidden", "weight"), got, want, strict=True):
        assert torch.equal(g, w), name
