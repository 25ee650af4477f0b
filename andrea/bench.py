"""`andrea bench`: attention kernels per backend, and training steps of a preset.

Attention: forward, backward and forward+backward of causal attention at fixed shapes, per
backend and dtype; the median over `repeats` timings after `warmup` untimed calls, timed with
CUDA events on a GPU (device time) and with perf_counter on the CPU. A timing runs enough calls
back to back to span TARGET_MS (`time_cases`), so on a GPU the host's Python and launch cost
overlaps the kernels as in training instead of being counted as GPU time. Backward alone is
timed after untimed forwards (one per call, all made before the timing starts), so it is the
backward kernels only. The three modes are timed in rounds (fwd, bwd, fwd_bwd, then again), so
a change in the machine's load during the run reaches all three medians alike. Dtypes: --dtype's;
else with --quick the one the training benchmark's preset trains in on this device
(andrea.train.device.choose_precision: fp32 on a CPU without bf16 units), without it all three.

FLOPs counted (the convention of the FlashAttention papers, with the causal half removed):
forward = 2 matmuls of 2·B·H·T²·D each, halved by the causal mask = 2·B·H·T²·D;
backward = 5 such matmuls (recompute S, dV, dP, dQ, dK) = 2.5 × forward. Softmax, masking and
exponentials are not counted. A backend that computes the masked half anyway (math) is still
credited with the causal count, so its TFLOP/s is comparable with the others.

Training: optimizer steps of a preset on random tokens at the preset's batch on one process:
train.global_batch_tokens as micro-batches of train.micro_batch_size (auto as the trainer
chooses it), each forward under autocast and backward, then gradient clipping and the preset's
optimizer step (Muon's orthogonalisation once per step, as in training), built from the
trainer's own pieces (model, optimizer builder, micro-batch and accumulation, precision choice,
FLOPs per token, peak for MFU). Full-length windows: a sequence-length warm-up's short windows
are not measured. `--quick` and global_batch_tokens: 0 time one micro-batch per step.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import torch

from andrea.errors import UserError
from andrea.model.attention import BACKENDS as ATTENTION
from andrea.model.attention import cuda_unavailable_reason, sdpa_attention
from andrea.resources import cpu_name
from andrea.train.device import DTYPES as TORCH_DTYPES
from andrea.train.flops import (
    DTYPE_NAMES,
    MfuMeter,
    attention_flops,
    flops_per_token,
    no_mfu_reason,
)
from andrea.train.metrics import format_mfu

# name -> (B, n_head, T, head_dim)
SHAPES: dict[str, tuple[int, int, int, int]] = {
    "gpt2": (8, 12, 1024, 64),  # GPT-2 small / ANDREA-120M attention
    "andrea-12m": (8, 12, 256, 32),
}
DTYPES = {name: TORCH_DTYPES[name] for name in ("bf16", "fp32", "fp16")}  # the tables' order
# Bench's variants of a model.attention backend, timed after it. cuda_naive: the
# one-block-per-(batch, head) baseline kernels, the reference of the goal "cuda at least 10x
# cuda_naive" (the "cuda vs naive" column); sdpa_flash: SDPA held to its flash kernel.
VARIANTS = {"cuda": ("cuda_naive",), "sdpa": ("sdpa_flash",)}
# model.attention's backends that run (auto resolves to one of them), each with its variants.
BACKENDS = tuple(name for backend in ATTENTION.values() if not backend.picks_another
                 for name in (backend.name, *VARIANTS.get(backend.name, ())))
MODES = ("fwd", "bwd", "fwd_bwd")


@dataclass
class AttentionRow:
    shape: str
    backend: str
    dtype: str
    batch: int
    n_head: int
    seq_len: int
    head_dim: int
    ms: dict[str, float] = field(default_factory=dict)  # mode -> median milliseconds
    tflops: dict[str, float] = field(default_factory=dict)  # mode -> achieved TFLOP/s
    calls: dict[str, int] = field(default_factory=dict)  # mode -> back-to-back calls per timing


@dataclass
class TrainRow:
    preset: str
    backend: str
    dtype: str
    micro_batch_size: int
    block_size: int
    n_params: int
    step_ms: float  # one optimizer step: `accumulation` micro-batches
    tokens_per_s: float
    mfu: float | None
    accumulation: int = 1  # micro-batches per optimizer step


@dataclass
class BenchResult:
    device: str
    device_name: str
    torch_version: str
    repeats: int
    warmup: int
    attention: list[AttentionRow]
    train: list[TrainRow]
    skipped: list[str]  # "what: why" for every backend or case not run
    # The header's line on which attention dtypes were timed and why (attention_dtypes);
    # empty in results written before it was recorded.
    dtype_note: str = ""

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> BenchResult:
        d = json.loads(text)
        d["attention"] = [AttentionRow(**r) for r in d["attention"]]
        d["train"] = [TrainRow(**r) for r in d["train"]]
        return cls(**d)


class Timer(Protocol):
    """Marks the start of the timed calls; stop() returns the milliseconds since."""

    def start(self) -> None: ...

    def stop(self) -> float: ...


class WallTimer:
    """Host time around the calls (CPU work is synchronous, so it is the work itself)."""

    def start(self) -> None:
        self.t0 = time.perf_counter()

    def stop(self) -> float:
        return (time.perf_counter() - self.t0) * 1e3


class CudaTimer:
    """Device time between two events on the current stream. start() comes after the untimed
    preparation in stream order; stop() waits for the timed work and returns milliseconds."""

    def start(self) -> None:
        self.begin = torch.cuda.Event(enable_timing=True)
        self.end = torch.cuda.Event(enable_timing=True)
        self.begin.record()

    def stop(self) -> float:
        self.end.record()
        self.end.synchronize()
        return self.begin.elapsed_time(self.end)


def timer_for(device: torch.device) -> Timer:
    return CudaTimer() if device.type == "cuda" else WallTimer()


# Each timing spans at least TARGET_MS of work (at most MAX_CALLS calls): on a GPU the host
# launches call i+1 while the device runs call i, so the Python and launch cost of a call (tens
# to hundreds of µs) is hidden behind the kernels except for the first call's, a fraction
# 1/calls of one call's host time. Timing one call between events after a synchronize instead
# adds all of it to a few hundred µs of kernels (10-20% at the gpt2 shape).
TARGET_MS = 20.0
MAX_CALLS = 50  # a backward's prepared forwards are all alive at once


@dataclass
class Timing:
    ms: float  # median milliseconds per call
    calls: int  # back-to-back calls per timing


@dataclass
class Case:
    """What one mode times: timed(prepare()), prepare() untimed (None: no preparation)."""

    timed: Callable[[Any], Any]
    prepare: Callable[[], Any] | None = None


def time_per_call(
    timer: Timer, repeats: int, warmup: int, timed: Callable[[Any], Any],
    prepare: Callable[[], Any] | None = None, max_calls: int = MAX_CALLS,
) -> Timing:
    """Median milliseconds of one timed(prepare()) call over `repeats` timings after `warmup`
    untimed calls (time_cases with one case)."""
    return time_cases(timer, repeats, warmup, {"": Case(timed, prepare)}, max_calls)[""]


def time_cases(
    timer: Timer, repeats: int, warmup: int, cases: dict[str, Case],
    max_calls: int = MAX_CALLS,
) -> dict[str, Timing]:
    """Median milliseconds of one call of each case over `repeats` timings after `warmup`
    untimed calls. A timing runs `calls` calls back to back between timer.start() and
    timer.stop(), enough for TARGET_MS by a one-call estimate after the warm-up; the calls'
    prepare() results (a forward for a backward) are all made before start(), untimed.

    The timings go in rounds, every case once a round: on a shared machine the load changes
    while a benchmark runs, and cases timed one after another would each see a different
    stretch of it (a backward alone measured slower than forward + backward)."""

    def timing(case: Case, calls: int) -> float:
        states = [case.prepare() if case.prepare is not None else None for _ in range(calls)]
        timer.start()
        for state in states:
            case.timed(state)
        return timer.stop() / calls

    calls: dict[str, int] = {}
    for name, case in cases.items():
        for _ in range(warmup):
            case.timed(case.prepare() if case.prepare is not None else None)
        estimate = timing(case, 1)
        calls[name] = max(1, min(max_calls, math.ceil(TARGET_MS / max(estimate, 1e-6))))
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(repeats):
        for name, case in cases.items():
            samples[name].append(timing(case, calls[name]))
    return {name: Timing(statistics.median(samples[name]), calls[name]) for name in cases}


def _attention_fn(backend: str) -> Callable[..., torch.Tensor]:
    if backend == "sdpa_flash":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return sdpa_attention(q, k, v)

        return flash
    if backend == "cuda_naive":
        from andrea.cuda.attention import cuda_attention

        return lambda q, k, v: cuda_attention(q, k, v, naive=True)
    return ATTENTION[backend].run


def bench_attention(
    shape_name: str, shape: tuple[int, int, int, int], backend: str, dtype_name: str,
    device: torch.device, repeats: int, warmup: int,
) -> AttentionRow:
    b, h, t, d = shape
    dtype = DTYPES[dtype_name]
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v, dout = (
        torch.randn(b, h, t, d, device=device, dtype=dtype, generator=gen) for _ in range(4)
    )
    for x in (q, k, v):
        x.requires_grad_()
    fn = _attention_fn(backend)

    def grads(out: torch.Tensor) -> Any:
        return torch.autograd.grad(out, (q, k, v), dout)

    row = AttentionRow(shape_name, backend, dtype_name, b, h, t, d)
    timer = timer_for(device)
    # Forward with inputs that require grad, as in training: a backend saves what its backward
    # needs; the graph is dropped right after.
    timings = time_cases(timer, repeats, warmup, {
        "fwd": Case(lambda _: fn(q, k, v)),
        "bwd": Case(grads, prepare=lambda: fn(q, k, v)),
        "fwd_bwd": Case(lambda _: grads(fn(q, k, v))),
    })
    row.ms = {m: t.ms for m, t in timings.items()}
    row.calls = {m: t.calls for m, t in timings.items()}
    flops = attention_flops(b, h, t, d)
    row.tflops = {m: flops[m] / (row.ms[m] * 1e-3) / 1e12 for m in MODES}
    return row


def bench_train(
    preset: str, backend: str, device: torch.device, steps: int, warmup: int,
    overrides: list[str],
) -> TrainRow:
    """Median optimizer-step time of `preset` with `backend` on random tokens, at the preset's
    tokens per step on one process."""
    from andrea.config import load_config
    from andrea.model.transformer import Andrea, loss_chunk_rows
    from andrea.train.batch import accumulation_steps, resolve_micro_batch
    from andrea.train.device import pick_dtype
    from andrea.train.optim import build_optimizer

    cfg = load_config(preset, overrides)
    dtype = pick_dtype(cfg.train.precision, device)
    torch.manual_seed(cfg.train.seed)
    model = Andrea(cfg.model, attention_backend=backend).to(device)
    model.loss_chunk_rows = loss_chunk_rows(cfg.model.vocab_size, cfg.train.loss_chunk_rows)
    model.train()
    optimizer = build_optimizer(model, cfg, device)
    micro_batch = resolve_micro_batch(cfg, model, dtype, device)[0]
    accum = accumulation_steps(cfg, micro_batch, 1)[0]
    shape = (micro_batch, cfg.model.block_size)
    batches = [(torch.randint(cfg.model.vocab_size, shape, device=device),
                torch.randint(cfg.model.vocab_size, shape, device=device)) for _ in range(accum)]
    clip = cfg.train.grad_clip if cfg.train.grad_clip > 0 else math.inf

    def step(_: Any) -> None:
        for x, y in batches:
            with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                _, loss = model(x, y)
            (loss / accum).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step_ms = time_per_call(timer_for(device), steps, warmup, step).ms
    n_params = model.num_params()
    tok_s = accum * shape[0] * shape[1] / (step_ms * 1e-3)
    flops_per_s = tok_s * flops_per_token(cfg.model, n_params, shape[1])
    return TrainRow(
        preset=preset, backend=backend, dtype=DTYPE_NAMES[dtype],
        micro_batch_size=shape[0], block_size=shape[1], n_params=n_params, step_ms=step_ms,
        tokens_per_s=tok_s, mfu=MfuMeter(device, dtype)(flops_per_s), accumulation=accum,
    )


def run_bench(
    *, device: str = "auto", backends: list[str] | None = None, dtypes: list[str] | None = None,
    shapes: list[str] | None = None, batch: int | None = None, repeats: int = 10,
    warmup: int = 3, preset: str | None = None, train_steps: int = 10, train_warmup: int = 3,
    train_overrides: list[str] | None = None, train: bool = True, quick: bool = False,
    log: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True),
) -> BenchResult:
    """Runs the benchmark; `log` gets one line per case as it finishes.

    quick: small enough for a 2-core CPU in about a minute (batch 1, only the dtype the preset
    trains in here, 3 repeats after 1 warm-up, training ANDREA-12M at micro-batch 2, one
    micro-batch a step, for 3 steps). The median of 3 keeps one timing slowed by other work on
    the machine out of the figure.
    """
    from andrea.config import load_config
    from andrea.train.device import pick_device

    dev = pick_device(device)
    if quick:
        batch = 1 if batch is None else batch
        repeats, warmup, train_steps, train_warmup = min(repeats, 3), 1, 3, 1
        train_overrides = ["train.micro_batch_size=2", "train.global_batch_tokens=0",
                           *(train_overrides or [])]
    _check_options(dev, backends, dtypes, shapes, batch, repeats, warmup)
    preset = preset or ("andrea-120m" if dev.type == "cuda" and not quick else "andrea-12m")
    overrides = train_overrides or []
    cfg = load_config(preset, overrides)
    dtypes, dtype_note = attention_dtypes(dtypes, quick, preset, cfg.train.precision, dev)
    wanted = backends or [b for b in BACKENDS if b != "sdpa_flash" or dev.type == "cuda"]
    bench = _Bench(dev, log, BenchResult(
        device=str(dev),
        device_name=torch.cuda.get_device_name(dev) if dev.type == "cuda" else cpu_name(),
        torch_version=torch.__version__, repeats=repeats, warmup=warmup,
        attention=[], train=[], skipped=[], dtype_note=dtype_note,
    ))
    for shape_name in shapes or list(SHAPES):
        for dtype_name in dtypes:
            for backend in wanted:
                bench.attention(shape_name, batch, dtype_name, backend, repeats, warmup)
    if train:
        head_dim = cfg.model.head_dim
        for backend in [b for b in wanted if b in ("cuda", "sdpa")]:
            if not bench.usable(backend, head_dim, "", f"train {preset}"):
                continue
            row = bench_train(preset, backend, dev, train_steps, train_warmup, overrides)
            bench.result.train.append(row)
            log(f"train {preset} {backend}: {row.tokens_per_s:,.0f} tokens/s")
    return bench.result


def attention_dtypes(
    asked: list[str] | None, quick: bool, preset: str, precision: str, dev: torch.device,
) -> tuple[list[str], str]:
    """The attention dtypes to time and the header's line saying which and why: --dtype's when
    given; else, with --quick, the one the training benchmark's preset computes in on this
    device (train.precision's own decision, so the attention timed is the one trained), and
    without --quick every dtype."""
    from andrea.train.device import choose_precision

    if asked:
        return asked, f"attention dtype{_s(len(asked))}: {', '.join(asked)} (asked for)"
    chosen = choose_precision(precision, dev)
    # choose_precision's reason for auto starts "auto: ", which the key's value says already.
    why = f"train.precision {precision}: {chosen.why.removeprefix('auto: ')}"
    if quick:
        return [chosen.name], (f"attention dtype: {chosen.name}, what {preset} trains in on "
                               f"this device ({why})")
    return list(DTYPES), (f"attention dtypes: {', '.join(DTYPES)} (all; {preset} trains in "
                          f"{chosen.name} on this device: {why})")


def _s(count: int) -> str:
    """The plural ending for `count` of a noun that takes -s."""
    return "" if count == 1 else "s"


def _check_options(
    dev: torch.device, backends: list[str] | None, dtypes: list[str] | None,
    shapes: list[str] | None, batch: int | None, repeats: int, warmup: int,
) -> None:
    """Refuse unknown names and impossible counts, and a backend asked for by name where it
    cannot run at all (the user's mistake, said at once)."""
    for name in backends or []:
        if name not in BACKENDS:
            raise UserError(f"--backend {name}: expected one of {', '.join(BACKENDS)}")
    for name in dtypes or []:
        if name not in DTYPES:
            raise UserError(f"--dtype {name}: expected one of {', '.join(DTYPES)}")
    for name in shapes or []:
        if name not in SHAPES:
            raise UserError(f"--shape {name}: expected one of {', '.join(SHAPES)}")
    if batch is not None and batch < 1:
        raise UserError(f"--batch {batch}: must be a positive integer")
    if repeats < 1:
        raise UserError(f"--repeats {repeats}: must be 1 or more")
    if warmup < 0:
        raise UserError(f"--warmup {warmup}: must be 0 or more")
    for name in ("cuda", "cuda_naive"):
        if backends and name in backends:
            why = cuda_unavailable_reason(64, dev)
            if why is not None:
                raise UserError(f"--backend {name} cannot run here: {why}")
    if backends and "sdpa_flash" in backends and dev.type != "cuda":
        raise UserError(f"--backend sdpa_flash needs a GPU; the device is {dev}")


@dataclass
class _Bench:
    """One benchmark under way: its device, its log and the result it fills."""

    dev: torch.device
    log: Callable[[str], None]
    result: BenchResult

    def skip(self, case: str, why: str) -> None:
        # Not logged as it happens: the table (or --json's `skipped`) says it, once; the log is
        # progress through the cases that take time.
        self.result.skipped.append(f"{case}: {why}")

    def usable(self, backend: str, head_dim: int, dtype_name: str, what: str) -> bool:
        """Whether the backend can run this case here; if not, the case is skipped (said)."""
        why = None
        if backend in ("cuda", "cuda_naive"):
            why = cuda_unavailable_reason(head_dim, self.dev)
        elif backend == "sdpa_flash" and (self.dev.type != "cuda" or dtype_name == "fp32"):
            why = "the flash SDPA kernel needs a GPU and bf16 or fp16"
        if why is None:
            return True
        self.skip(f"{what} {backend}", why)
        return False

    def attention(self, shape_name: str, batch: int | None, dtype_name: str, backend: str,
                  repeats: int, warmup: int) -> None:
        """One attention case timed into the result (or skipped, with why)."""
        b, h, t, d = SHAPES[shape_name]
        what = f"attention {shape_name} {dtype_name}"
        if not self.usable(backend, d, dtype_name, what):
            return
        try:
            row = bench_attention(shape_name, (batch or b, h, t, d), backend, dtype_name,
                                  self.dev, repeats, warmup)
        except RuntimeError as exc:  # e.g. no flash kernel for this GPU
            self.skip(f"{what} {backend}", str(exc).splitlines()[0])
            return
        self.result.attention.append(row)
        self.log(f"{what} {backend}: " + ", ".join(f"{m} {row.ms[m]:.3f} ms" for m in MODES))


def format_table(result: BenchResult) -> str:
    lines = [f"device: {result.device} ({result.device_name}), torch {result.torch_version}, "
             f"median of {result.repeats} timing{_s(result.repeats)} after {result.warmup} "
             f"warm-up call{_s(result.warmup)}; a timing: calls back to back for {TARGET_MS:g} ms "
             f"(at most {MAX_CALLS})"]
    if result.dtype_note:
        lines.append(result.dtype_note)
    if result.attention:
        f_b = {(r.shape, r.dtype, r.backend): r.ms["fwd_bwd"] for r in result.attention}
        # How many times faster cuda's fwd+bwd is than the naive kernels' (goal: >= 10x): a
        # column only where some row has it (none without a GPU).
        speedups = {}
        for r in result.attention:
            naive = f_b.get((r.shape, r.dtype, "cuda_naive"))
            if naive and r.backend == "cuda":
                speedups[id(r)] = f"{naive / r.ms['fwd_bwd']:.1f}x"
        naive_head = f" {'cuda vs naive':>13}" if speedups else ""
        lines.append("")
        lines.append(
            f"{'shape':<11} {'B,H,T,D':<15} {'dtype':<5} {'backend':<10} {'fwd ms':>9} "
            f"{'bwd ms':>9} {'f+b ms':>9} {'fwd TF/s':>9} {'bwd TF/s':>9} {'f+b TF/s':>9} "
            f"{'f+b vs sdpa':>11}{naive_head}"
        )
        for r in result.attention:
            base = f_b.get((r.shape, r.dtype, "sdpa"))
            ratio = f"{base / r.ms['fwd_bwd']:.2f}x" if base else "n/a"
            speedup = f" {speedups.get(id(r), ''):>13}" if speedups else ""
            dims = f"{r.batch},{r.n_head},{r.seq_len},{r.head_dim}"
            lines.append(
                f"{r.shape:<11} {dims:<15} {r.dtype:<5} {r.backend:<10} {r.ms['fwd']:>9.3f} "
                f"{r.ms['bwd']:>9.3f} {r.ms['fwd_bwd']:>9.3f} {r.tflops['fwd']:>9.3f} "
                f"{r.tflops['bwd']:>9.3f} {r.tflops['fwd_bwd']:>9.3f} {ratio:>11}{speedup}"
                .rstrip()
            )
    if result.train:
        lines.append("")
        lines.append(f"{'preset':<12} {'backend':<8} {'dtype':<9} {'batch x T x accum':<19} "
                     f"{'tokens/step':>11} {'step ms':>9} {'tokens/s':>11} {'MFU':>7}")
        for r in result.train:
            shape = f"{r.micro_batch_size} x {r.block_size} x {r.accumulation}"
            lines.append(
                f"{r.preset:<12} {r.backend:<8} {r.dtype:<9} {shape:<19} "
                f"{r.accumulation * r.micro_batch_size * r.block_size:>11,} {r.step_ms:>9.1f} "
                f"{r.tokens_per_s:>11,.0f} {format_mfu(r.mfu):>7}"
            )
        lines.append("a step: its tokens/step on one process (accum micro-batches, then one "
                     "optimizer step; the preset's own batch unless --quick or --set change it), "
                     "full-length windows")
        missing = [r for r in result.train if r.mfu is None]
        why = (no_mfu_reason(torch.device(result.device), TORCH_DTYPES[missing[0].dtype])
               if missing else None)
        if why:
            lines.append(why)
    if result.skipped:
        # One line per reason: the cases it skipped, then why (the reason is often the same
        # for every shape and dtype, e.g. no GPU for the cuda backends).
        cases: dict[str, list[str]] = {}
        for skipped in result.skipped:
            case, _, why = skipped.partition(": ")
            cases.setdefault(why, []).append(case)
        lines.append("")
        lines.extend(f"skipped: {', '.join(names)}: {why}" for why, names in cases.items())
    return "\n".join(lines)
