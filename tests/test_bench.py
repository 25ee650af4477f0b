"""`andrea bench`'s choices and output (andrea/bench.py), run in-process at a tiny shape: which
dtype it times, and what its table says. Nothing here depends on how fast anything runs."""

from __future__ import annotations

import json

import pytest
import torch

from andrea import bench
from andrea.bench import AttentionRow, BenchResult, format_table, run_bench
from andrea.config import load_config
from andrea.errors import UserError
from andrea.train import device as train_device

TINY = (1, 1, 8, 4)  # B, H, T, D: microseconds a call, so a run takes well under a second


@pytest.fixture
def tiny_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench, "SHAPES", {"tiny": TINY})


def quick(log: list[str] | None = None, **kwargs: object) -> BenchResult:
    """`andrea bench --quick --device cpu --no-train` at the tiny shape, in-process."""
    sink = log if log is not None else []
    return run_bench(device="cpu", quick=True, train=False, log=sink.append,
                     **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("bf16_units", [False, True])
def test_quick_times_the_dtype_training_computes_in_here(
    tiny_shape: None, monkeypatch: pytest.MonkeyPatch, bf16_units: bool,
) -> None:
    """--quick's attention dtype is train.precision's choice for the preset on this device
    (andrea.train.device.choose_precision): fp32 on a CPU without bf16 units, bf16 with them."""
    monkeypatch.setattr(train_device, "cpu_has_bf16", lambda: bf16_units)
    cfg = load_config("andrea-12m", [])  # --quick's preset on a CPU
    chosen = train_device.choose_precision(cfg.train.precision, torch.device("cpu"))
    assert chosen.name == ("bf16" if bf16_units else "fp32")
    result = quick(backends=["math"])
    assert {r.dtype for r in result.attention} == {chosen.name}
    header = format_table(result).splitlines()[:2]
    assert any(f"attention dtype: {chosen.name}" in line and chosen.why in line
               for line in header)


def test_an_explicit_dtype_is_obeyed_and_said(tiny_shape: None) -> None:
    result = quick(backends=["math"], dtypes=["bf16", "fp32"])
    assert [r.dtype for r in result.attention] == ["bf16", "fp32"]
    assert "attention dtypes: bf16, fp32 (asked for)" in format_table(result)


def test_the_attention_dtype_follows_the_training_benchmarks_precision(tiny_shape: None) -> None:
    """One decision: a --set train.precision=... for the training benchmark sets it too."""
    result = quick(backends=["math"], train_overrides=["train.precision=fp16"])
    assert [r.dtype for r in result.attention] == ["fp16"]
    assert "train.precision fp16: asked for" in result.dtype_note


def result_with(rows: list[AttentionRow], warmup: int = 3, repeats: int = 10,
                skipped: list[str] | None = None) -> BenchResult:
    return BenchResult(device="cpu", device_name="test CPU", torch_version="2", repeats=repeats,
                       warmup=warmup, attention=rows, train=[], skipped=skipped or [])


def row(backend: str, fwd_bwd: float) -> AttentionRow:
    ms = {"fwd": 1.0, "bwd": 2.0, "fwd_bwd": fwd_bwd}
    return AttentionRow("tiny", backend, "fp32", *TINY, ms=ms, tflops=dict.fromkeys(ms, 1.0),
                        calls=dict.fromkeys(ms, 1))


def test_the_header_counts_in_the_singular_and_the_plural() -> None:
    assert "median of 3 timings after 1 warm-up call;" in format_table(result_with([], 1, 3))
    assert "median of 1 timing after 2 warm-up calls;" in format_table(result_with([], 2, 1))
    assert "after 0 warm-up calls;" in format_table(result_with([], 0, 3))


def test_the_cuda_vs_naive_column_is_shown_only_with_values() -> None:
    cpu = format_table(result_with([row("sdpa", 4.0), row("math", 8.0)])).splitlines()
    head = next(line for line in cpu if line.startswith("shape "))
    assert "cuda vs naive" not in head
    assert head.split()[-3:] == ["f+b", "vs", "sdpa"]  # the last column: nothing after it
    gpu = format_table(result_with([row("sdpa", 4.0), row("cuda", 2.0), row("cuda_naive", 20.0)]))
    lines = gpu.splitlines()
    assert next(line for line in lines if line.startswith("shape ")).endswith("cuda vs naive")
    cuda = next(line for line in lines if line.split()[3:4] == ["cuda"])
    assert cuda.split()[-2:] == ["2.00x", "10.0x"]


def test_each_skip_and_its_reason_is_printed_once(
    tiny_shape: None, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A skip is said once: in the table (and --json's `skipped`), not also in the progress
    log; a reason shared by several cases is written once, with the cases."""
    # --quick times the dtype training takes here: fp32 on every CPU for this test (a CPU with
    # bf16 units would time bf16, and the cases below would not be these).
    monkeypatch.setattr(train_device, "cpu_has_bf16", lambda: False)
    log: list[str] = []
    result = quick(log, backends=None)
    why = "no GPU: the CUDA kernels need one"
    assert result.skipped == [f"attention tiny fp32 {b}: {why}" for b in ("cuda", "cuda_naive")]
    table = format_table(result)
    printed = "\n".join([*log, table])
    assert printed.count(why) == 1
    for case in ("attention tiny fp32 cuda", "attention tiny fp32 cuda_naive"):
        assert printed.count(case + ",") + printed.count(case + ":") == 1
    assert "skipped: attention tiny fp32 cuda, attention tiny fp32 cuda_naive: " + why in table


def test_json_written_before_the_dtype_note_still_loads() -> None:
    result = result_with([row("sdpa", 4.0)])
    assert BenchResult.from_json(result.to_json()) == result
    old = json.loads(result.to_json())
    old.pop("dtype_note", None)
    assert BenchResult.from_json(json.dumps(old)).attention == result.attention


def test_a_bad_count_names_the_option_given(tiny_shape: None) -> None:
    """--repeats 0 named a --warmup the user never gave ("--repeats 0 / --warmup 1")."""
    with pytest.raises(UserError, match=r"^--repeats 0: must be 1 or more$"):
        quick(backends=["math"], repeats=0)


def test_a_train_row_spells_its_dtype_as_the_attention_rows_do() -> None:
    """One spelling in --json: a train row said "float32" beside the attention rows' "fp32"."""
    row = bench.bench_train("andrea-tiny", "math", torch.device("cpu"), steps=1, warmup=0,
                            overrides=["train.precision=fp32", "train.global_batch_tokens=512"])
    assert row.dtype == "fp32" and row.mfu is None
    assert "MFU is n/a on a CPU" in format_table(BenchResult(
        device="cpu", device_name="test CPU", torch_version="2", repeats=1, warmup=0,
        attention=[], train=[row], skipped=[]))



# ----------------------------------------------------------------------------- the bench scripts

CPU = "Test CPU 9000 @ 1.00GHz"  # what the helper says here, so the line shows it was asked


def bench_script(name: str, argv: list[str], monkeypatch: pytest.MonkeyPatch) -> object:
    """scripts/NAME.py, to run with ARGV, the CPU helper it imports saying CPU (the caller
    replaces its slow parts, then calls its main)."""
    from conftest import load_script

    script = load_script(name)
    monkeypatch.setattr(script, "cpu_name", lambda: CPU)  # absent: the script names no CPU
    monkeypatch.setattr("sys.argv", [f"{name}.py", *argv])
    return script


def test_every_bench_script_prints_its_speeds_with_the_cpus_name(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path,
) -> None:
    """The project's rule: a speed is printed with the CPU's name (andrea.resources.cpu_name,
    which `andrea bench` and the other scripts use). bench_generate, bench_train and
    bench_tokenize printed theirs without it: a figure nobody could place later. Their slow
    parts (preparing data, training, tokenizing a corpus) are replaced; generate runs at the
    tiny preset."""
    from andrea.data import encode

    generate = bench_script("bench_generate", ["--models", "andrea-tiny", "--prompts", "4",
                                               "--new-tokens", "2", "--repeats", "1"],
                            monkeypatch)
    generate.main()
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"{CPU}, ") and "andrea-tiny" in out[-1], out

    train = bench_script("bench_train", ["--preset", "andrea-tiny", "--rounds", "1", "--json"],
                         monkeypatch)
    monkeypatch.setattr(train, "ensure_prepared", lambda cfg: None)
    monkeypatch.setattr(train, "plain_loop", lambda *args: [1000.0])
    monkeypatch.setattr(train, "trainer_loop", lambda *args: [900.0])
    with monkeypatch.context() as scratch:  # its folder for data and runs, left empty here
        scratch.setattr(train.tempfile, "mkdtemp", lambda prefix: str(tmp_path))
        train.main()
    out = capsys.readouterr().out.splitlines()
    table = next(i for i, line in enumerate(out) if line.startswith("precision"))
    assert f"on {CPU}, " in out[table - 1] and "10.0%" in out[table + 1], out
    assert json.loads(out[-1])["cpu"] == CPU

    tokenize = bench_script("bench_tokenize", ["--workers", "1", "--repeat", "1"], monkeypatch)
    monkeypatch.setattr(encode, "train_texts", lambda *args: iter(()))
    monkeypatch.setattr(tokenize, "train_bpe", lambda *args: None)
    monkeypatch.setattr(tokenize, "encode_seconds", lambda *args: (0.5, 1000))
    tokenize.main()
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"cpu: {CPU}, ") and "MB/s" in out[-1], out
