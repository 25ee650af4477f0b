"""The `andrea` command: parses arguments and calls the package. No logic lives here."""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer

from andrea import faults
from andrea.errors import UserError

app = typer.Typer(
    help="andrea: train, evaluate and sample ANDREA GPT-style language models.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
config_app = typer.Typer(help="Inspect configs.", no_args_is_help=True)
app.add_typer(config_app, name="config")

ConfigOpt = Annotated[
    str, typer.Option("--config", "-c", help="YAML config: a path, or a bundled preset name.")
]
SetOpt = Annotated[
    list[str] | None,
    typer.Option("--set", "-s", help="Override a key, e.g. --set train.lr=3e-4 (repeatable)."),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Machine-readable JSON output.")]


def _load(config: str, overrides: list[str] | None):
    from andrea.config import load_config

    return load_config(config, overrides or [])


@config_app.command("show")
def config_show(config: ConfigOpt, set_: SetOpt = None) -> None:
    """Print the resolved config (file + overrides + derived values) as YAML."""
    typer.echo(_load(config, set_).to_yaml(), nl=False)


@config_app.command("keys")
def config_keys(
    as_json: JsonOpt = False,
    markdown: Annotated[
        bool, typer.Option("--markdown", help="docs/config.md's text: a table per section.")
    ] = False,
) -> None:
    """List every config key with its default and description."""
    from andrea.config.reference import keys_json, keys_markdown, keys_table

    if markdown:
        typer.echo(keys_markdown(), nl=False)
    else:
        typer.echo(keys_json() if as_json else keys_table())


@app.command("count-params")
def count_params_cmd(config: ConfigOpt, set_: SetOpt = None, as_json: JsonOpt = False) -> None:
    """Count parameters by group (built on the meta device; checked against the formula)."""
    from andrea.model.params import count_params, format_counts

    counts = count_params(_load(config, set_).model)
    typer.echo(json.dumps(counts.as_dict(), indent=2) if as_json else format_counts(counts))


@app.command("train")
def train_cmd(
    config: Annotated[
        str | None, typer.Option("--config", "-c", help="YAML config: a path or a preset name.")
    ] = None,
    set_: SetOpt = None,
    resume: Annotated[
        str | None,
        typer.Option("--resume", help="Continue runs/<name>, or 'auto': the config's run if any."),
    ] = None,
    overwrite: Annotated[
        bool, typer.Option("--overwrite", help="Replace an existing run of the same name.")
    ] = False,
    progress: Annotated[bool, typer.Option(help="Show the progress bar.")] = True,
    stop_after: Annotated[
        int | None,
        typer.Option("--stop-after", min=1, help="Run at most N steps now, checkpoint, stop."),
    ] = None,
) -> None:
    """Train a model (also under torchrun for several processes)."""
    from andrea.train.loop import summary_line, train
    from andrea.train.resume import config_for_run

    cfg = config_for_run(config, set_ or [], resume)
    result = train(
        cfg, resume=resume, overwrite=overwrite, progress=progress, stop_after=stop_after
    )
    if result.is_main:
        if result.message and result.exit_code:
            # A stop the user asked for (Ctrl-C, a scheduler's SIGTERM) is no error.
            prefix = "" if result.state == "interrupted" else "error: "
            typer.echo(f"{prefix}{result.message}", err=True)
        typer.echo(summary_line(result))
    raise typer.Exit(result.exit_code)


@app.command("runs")
def runs_cmd(
    root: Annotated[str, typer.Argument(help="Folder of run directories.")] = "runs",
    as_json: JsonOpt = False,
) -> None:
    """List runs: steps, tokens, best val loss, speed, state, latest checkpoint."""
    from andrea.runs import format_json, format_table, list_runs

    runs = list_runs(root)
    typer.echo(format_json(runs) if as_json else format_table(runs))


@app.command("plot")
def plot_cmd(
    runs: Annotated[list[str], typer.Argument(help="Run directories (or names under runs/).")],
    out: Annotated[str, typer.Option("--out", "-o", help="Image file: .png, .svg or .pdf.")],
    x: Annotated[str, typer.Option("--x", help="Loss panel x axis: tokens or step.")] = "tokens",
) -> None:
    """Plot loss, learning rate, tokens/s and gradient norm of one or more runs."""
    from andrea.plot import plot_runs

    typer.echo(f"wrote {plot_runs(runs, out, x=x)}")


@app.command("prepare")
def prepare_cmd(
    config: Annotated[
        str | None, typer.Option("--config", "-c", help="Use this config's data section.")
    ] = None,
    set_: SetOpt = None,
    input: Annotated[
        str | None,
        typer.Option("--input", "-i", help="A file, directory, glob or datasets folder: text, "
                     "JSON Lines, Parquet (+.gz/.zst)."),
    ] = None,
    tokenizer: Annotated[
        str | None, typer.Option("--tokenizer", "-t", help="gpt2, bpe (default) or byte.")
    ] = None,
    out: Annotated[str | None, typer.Option("--out", "-o", help="Shard folder.")] = None,
    vocab_size: Annotated[
        int | None, typer.Option("--vocab-size", help="BPE ids incl. end-of-text (4096).")
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="Redo even if up to date.")] = False,
    errors: Annotated[
        str | None,
        typer.Option("--errors", help="Invalid UTF-8 or a record without text: strict (fail) "
                     "or replace (U+FFFD; skip and count the record)."),
    ] = None,
    workers: Annotated[
        int | None, typer.Option("--workers", help="Encoding processes (0: automatic).")
    ] = None,
    tokenizer_file: Annotated[
        str | None,
        typer.Option("--tokenizer-file", help="Use this BPE tokenizer.json instead of training."),
    ] = None,
    text_field: Annotated[
        str | None, typer.Option("--text-field", help="JSON field / Parquet column (text); "
                                   "doc.body for a nested one.")
    ] = None,
) -> None:
    """Tokenize text into shards (the embedded Shakespeare corpus by default)."""
    from andrea.data.prepare import prepare_command

    prepare_command(
        config, set_, input, tokenizer, out, vocab_size, force, errors, workers, tokenizer_file,
        text_field,
    )


CheckpointOpt = Annotated[
    str | None,
    typer.Option(
        "--checkpoint", help="runs/<name> (its latest) or runs/<name>/step-N; default: the "
        "most recent run under ./runs.",
    ),
]


@app.command("eval")
def eval_cmd(
    files: Annotated[
        list[str] | None, typer.Argument(help="Task files, one per --task, in order.")
    ] = None,
    checkpoint: Annotated[
        list[str] | None,
        typer.Option("--checkpoint", help="runs/<name> (its latest) or runs/<name>/step-N "
                     "(repeatable: one row each); default: the most recent run under ./runs."),
    ] = None,
    all_steps: Annotated[
        bool, typer.Option("--all-steps", help="Every step-N folder of each --checkpoint run.")
    ] = False,
    data: Annotated[
        str | None, typer.Option("--data", help="Prepared shard folder (default: the run's).")
    ] = None,
    split: Annotated[str, typer.Option("--split", help="val or train.")] = "val",
    max_tokens: Annotated[
        int | None,
        typer.Option("--max-tokens", help="N tokens spread over the split (per source), as "
                     "train.eval_tokens=N; default: all."),
    ] = None,
    source: Annotated[
        str | None, typer.Option("--source", help="Only this mixture source (its path).")
    ] = None,
    task: Annotated[
        list[str] | None,
        typer.Option("--task", help="hellaswag, choice, lambada or arc, scored on the FILE in the "
                     "same place (repeatable)."),
    ] = None,
    limit: Annotated[
        int | None, typer.Option("--limit", help="At most N examples per task.")
    ] = None,
    val: Annotated[
        bool | None,
        typer.Option("--val/--no-val", help="The val loss (default: on unless --task)."),
    ] = None,
    precision: Annotated[str, typer.Option("--precision", help="auto, fp32 or bf16.")] = "auto",
    device: Annotated[str, typer.Option("--device", help="auto, cpu or cuda.")] = "auto",
    batch_size: Annotated[
        int, typer.Option("--batch-size", help="Windows (task sequences) per batch.")
    ] = 8,
    progress: Annotated[bool, typer.Option(help="Show the progress bar.")] = True,
    as_json: JsonOpt = False,
) -> None:
    """Val loss, perplexity and bits per byte (per mixture source) and downstream tasks of
    one or more checkpoints; one table row per checkpoint."""
    from andrea.evaluate import EvalSettings, evaluate_checkpoints, format_results

    task, files = task or [], files or []
    if len(task) != len(files):
        raise UserError(f"--task: {len(task)} task(s) but {len(files)} file(s); give one file "
                        "per --task, e.g. andrea eval --task hellaswag hellaswag_val.jsonl")
    settings = EvalSettings(data, max_tokens, precision, device, batch_size, progress, split,
                            source, val=not task if val is None else val)
    results = evaluate_checkpoints(checkpoint or [], settings, all_steps=all_steps,
                                   tasks=list(zip(task, files, strict=True)), limit=limit)
    typer.echo(format_results(results, as_json))


@app.command("generate")
def generate_cmd(
    checkpoint: CheckpointOpt = None,
    prompt: Annotated[
        str | None,
        typer.Option("--prompt", "-p", help="Text to continue. None or empty: a new document "
                     "(unconditional, from the end-of-text token)."),
    ] = None,
    prompt_ids: Annotated[
        str | None,
        typer.Option("--prompt-ids", help="Token ids instead, e.g. '464,3290'; empty as "
                     "--prompt \"\"."),
    ] = None,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", "-n")] = 200,
    temperature: Annotated[float, typer.Option("--temperature", "-t", help="0: greedy.")] = 0.8,
    top_k: Annotated[int | None, typer.Option("--top-k")] = 200,
    top_p: Annotated[float | None, typer.Option("--top-p", help="Nucleus, in (0, 1].")] = None,
    seed: Annotated[int | None, typer.Option("--seed")] = None,
    num_samples: Annotated[int, typer.Option("--num-samples")] = 1,
    stop_at_eot: Annotated[
        bool, typer.Option("--stop-at-eot/--no-stop-at-eot", help="Stop at end-of-text.")
    ] = True,
    cache: Annotated[bool, typer.Option("--cache/--no-cache", help="Key/value cache.")] = True,
    device: Annotated[str, typer.Option("--device", help="auto, cpu or cuda.")] = "auto",
    precision: Annotated[str, typer.Option("--precision", help="fp32, bf16 or auto.")] = "fp32",
) -> None:
    """Sample text from a checkpoint, streamed to stdout."""
    from andrea.generate import generate_command

    generate_command(
        checkpoint, prompt, prompt_ids, max_new_tokens, temperature, top_k, top_p, seed,
        num_samples, stop_at_eot, cache, device, precision,
    )


FormatOpt = Annotated[str, typer.Option("--format", help="hf: a transformers GPT-2 directory.")]


def _check_format(fmt: str) -> None:
    if fmt != "hf":
        raise UserError(f"--format {fmt}: the only format is 'hf'")


@app.command("export")
def export_cmd(
    out: Annotated[str, typer.Option("--out", "-o", help="Directory to write.")],
    checkpoint: CheckpointOpt = None,
    fmt: FormatOpt = "hf",
    force: Annotated[bool, typer.Option("--force", help="Replace --out if it exists.")] = False,
) -> None:
    """Write a checkpoint as a directory transformers.GPT2LMHeadModel loads."""
    from andrea.hf import export_hf

    _check_format(fmt)
    typer.echo(f"wrote {export_hf(checkpoint, out, force)}")


@app.command("import")
def import_cmd(
    src: Annotated[str, typer.Argument(help="A transformers GPT-2 directory.")],
    fmt: FormatOpt = "hf",
    out: Annotated[
        str | None, typer.Option("--out", "-o", help="Run directory (default runs/<SRC name>).")
    ] = None,
    set_: SetOpt = None,
    force: Annotated[bool, typer.Option("--force", help="Replace --out if it exists.")] = False,
) -> None:
    """Make a run (step 0) from a GPT-2 directory: eval/generate it, or fine-tune it with
    `andrea train --resume RUN`."""
    from andrea.hf import import_hf

    _check_format(fmt)
    ckpt = import_hf(src, out, set_ or [], force)
    typer.echo(f"wrote {ckpt}; fine-tune with: andrea train --resume {ckpt.parent}")


@app.command("bench")
def bench_cmd(
    quick: Annotated[
        bool, typer.Option("--quick", help="Small sizes, bf16 only: about a minute on a CPU.")
    ] = False,
    device: Annotated[str, typer.Option("--device", help="auto, cpu or cuda.")] = "auto",
    backend: Annotated[
        list[str] | None,
        typer.Option("--backend", help="cuda, cuda_naive, sdpa, sdpa_flash or math (repeatable; "
                     "default all that run here)."),
    ] = None,
    dtype: Annotated[
        list[str] | None, typer.Option("--dtype", help="bf16 or fp32 (repeatable; default both).")
    ] = None,
    shape: Annotated[
        list[str] | None,
        typer.Option("--shape", help="gpt2 (8,12,1024,64) or andrea-12m (8,12,256,32)."),
    ] = None,
    batch: Annotated[
        int | None, typer.Option("--batch", help="Override B of the attention shapes.")
    ] = None,
    repeats: Annotated[
        int, typer.Option("--repeats", help="Timings (median), each of calls back to back for "
                          "at least 20 ms (at most 50 calls).")
    ] = 10,
    warmup: Annotated[int, typer.Option("--warmup", help="Untimed calls first.")] = 3,
    preset: Annotated[
        str | None,
        typer.Option("--preset", help="Training benchmark preset (default andrea-120m on a GPU, "
                     "andrea-12m on a CPU)."),
    ] = None,
    train_steps: Annotated[int, typer.Option("--train-steps", help="Timed training steps.")] = 10,
    set_: SetOpt = None,
    train: Annotated[
        bool, typer.Option("--train/--no-train", help="Run the training-step benchmark.")
    ] = True,
    as_json: JsonOpt = False,
) -> None:
    """Time attention (fwd, bwd, fwd+bwd per backend) and training steps; a table at the end."""
    from andrea.bench import format_table, run_bench

    result = run_bench(
        device=device, backends=backend, dtypes=dtype, shapes=shape, batch=batch,
        repeats=repeats, warmup=warmup, preset=preset, train_steps=train_steps,
        train_overrides=set_, train=train, quick=quick,
    )
    typer.echo(result.to_json() if as_json else format_table(result))


def main() -> None:
    """Entry point: bad input becomes one line on stderr and exit code 2, never a traceback."""
    try:
        faults.install_from_environment()
        app()
    except UserError as exc:
        typer.echo(f"error: {exc}", err=True)
        sys.exit(exc.exit_code)


