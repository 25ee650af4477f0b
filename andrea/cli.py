"""The `andrea` command: parses arguments and calls the package. No logic lives here."""

from __future__ import annotations

import json
import shlex
import sys
from collections.abc import Callable, Iterable
from typing import Annotated, Any

import click
import typer
from typer.core import TyperCommand

import andrea
from andrea import faults
from andrea.errors import Restarting, UserError

try:  # Typer >= 0.20 carries its own click; its parser errors derive from TyperException
    from typer import TyperException as ParserError
except ImportError:  # an older Typer on click
    from click.exceptions import ClickException as ParserError

# Plain (click-style) help: Typer's rich panels print a type placeholder even beside a flag
# (`--overwrite <bool>`), which reads as if the flag took a value.
app = typer.Typer(
    help="andrea: train, evaluate and sample ANDREA GPT-style language models.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)
config_app = typer.Typer(help="Inspect configs.", no_args_is_help=True, rich_markup_mode=None)
app.add_typer(config_app, name="config")


def _one_of(names: Iterable[str], last: str = "or") -> str:
    """'a, b or c'."""
    words = list(names)
    return f"{', '.join(words[:-1])} {last} {words[-1]}" if len(words) > 1 else "".join(words)


def _input_formats() -> str:
    from andrea.data.readers import COMPRESSIONS, READERS

    titles = [r.title or r.kind for r in READERS]
    packed = [r.title or r.kind for r in READERS if r.compressible]
    return f"{_one_of(titles)} ({_one_of(packed, 'and')} also {'/'.join(COMPRESSIONS)})"


def _tokenizers() -> str:
    from andrea.config import key_spec
    from andrea.data.tokenizer import KINDS

    default = key_spec("data.tokenizer").default
    return _one_of(f"{name} (default)" if name == default else name for name in KINDS)


def _task_kinds() -> str:
    from andrea.tasks import TASKS

    return _one_of(TASKS)


def _bench_backends() -> str:
    from andrea.bench import BACKENDS

    return _one_of(BACKENDS)


def _bench_dtypes(sep: str | None = None) -> str:
    from andrea.bench import DTYPES

    return sep.join(DTYPES) if sep else _one_of(DTYPES)


def _bench_shapes() -> str:
    from andrea.bench import SHAPES

    return _one_of(f"{name} ({','.join(map(str, dims))})" for name, dims in SHAPES.items())


# What a `{placeholder}` in an option's help or metavar stands for: the names a registry owns,
# read from it when the help is shown. The registries import numpy and torch, which every other
# start of the CLI (`andrea --version`, a parser error) would pay for if the help were built
# with the app.
REGISTRY_WORDS: dict[str, Callable[[], str]] = {
    "{input_formats}": _input_formats, "{tokenizers}": _tokenizers, "{task_kinds}": _task_kinds,
    "{backends}": _bench_backends, "{dtypes}": _bench_dtypes,
    "{dtypes|}": lambda: _bench_dtypes("|"), "{shapes}": _bench_shapes,
}


def _argument_name(param: Any, usage: bool = False) -> str:
    """An argument as the help writes it: its metavar (or name), `...` when it repeats; in the
    usage line in brackets when optional ([FILE]...)."""
    name = param.metavar or (param.name or "").upper()
    if usage and not param.required:
        name = f"[{name}]"
    return f"{name}..." if param.nargs != 1 else name


class PlainHelp(TyperCommand):
    """Help in the plain convention: an argument is NAME in the usage line when required,
    [NAME] when not, NAME... when it repeats, and its entry under Arguments names no Python
    type. (Typer writes {NAME} for a required one, [[NAME]...]... around a metavar that has
    brackets, and `NAME <list[str]>`.)"""

    def collect_usage_pieces(self, ctx: click.Context) -> list[str]:
        pieces = [self.options_metavar] if self.options_metavar else []
        for param in self.get_params(ctx):
            if param.param_type_name == "argument":
                pieces.append(_argument_name(param, usage=True))
            else:
                pieces.extend(param.get_usage_pieces(ctx))
        return pieces

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        args, opts = [], []
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is None:
                continue
            if param.param_type_name == "argument":
                args.append((_argument_name(param), record[1]))
            else:
                opts.append(record)
        for title, rows in (("Arguments", args), ("Options", opts)):
            if rows:
                with formatter.section(title):
                    formatter.write_dl(rows)


class RegistryHelp(PlainHelp):
    """A command whose options' help names a registry's values: each `{placeholder}` of
    REGISTRY_WORDS is filled in from the registry as the help is formatted."""

    def format_help(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        for param in self.params:
            for attr in ("help", "metavar"):
                text: Any = getattr(param, attr, None)
                for placeholder, words in REGISTRY_WORDS.items():
                    if isinstance(text, str) and placeholder in text:
                        text = text.replace(placeholder, words())
                        setattr(param, attr, text)
        super().format_help(ctx, formatter)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"andrea {andrea.__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    ctx: typer.Context,
    version: Annotated[
        bool | None,
        typer.Option("--version", "-V", callback=_print_version, is_eager=True,
                     help="Print andrea's version and exit."),
    ] = None,
) -> None:
    from andrea.train.torchrun import refuse_several_processes

    if ctx.invoked_subcommand != "train":
        refuse_several_processes(ctx.invoked_subcommand or "")

ConfigOpt = Annotated[
    str,
    typer.Option("--config", "-c", metavar="FILE|PRESET",
                 help="YAML config: a path, or a bundled preset name."),
]
SetOpt = Annotated[
    list[str] | None,
    typer.Option("--set", "-s", metavar="KEY=VALUE",
                 help="Override a key, e.g. --set train.lr=3e-4 (repeatable)."),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Machine-readable JSON output.")]
ProgressOpt = Annotated[bool, typer.Option(help="Show the progress bar.")]
DeviceOpt = Annotated[
    str, typer.Option("--device", metavar="auto|cpu|cuda", help="auto: a GPU if there is one.")
]
PrecisionOpt = Annotated[
    str, typer.Option("--precision", metavar="auto|fp32|bf16|fp16",
                      help="auto: bf16 where the hardware has fast bf16, fp16 on older "
                           "tensor-core GPUs (T4, V100), else fp32.")
]


def _config_registries() -> None:
    """Import the registries whose names a config is checked against wherever it is loaded
    (model.attention's backends, data.order's orders, data.tokenizer's kinds)."""
    from andrea.data import loader, tokenizer  # noqa: F401
    from andrea.model import attention  # noqa: F401


def _registries() -> None:
    """Import every registry whose names a config key allows: the ones above, and
    train.optimizer's and train.parallel's."""
    _config_registries()
    from andrea.train import optim, parallel  # noqa: F401


def _load(config: str, overrides: list[str] | None):
    from andrea.config import load_config, registered_keys

    _config_registries()
    cfg = load_config(config, overrides or [])
    if cfg.given & registered_keys():  # checked again with the registries (they import torch)
        _registries()
        cfg = load_config(config, overrides or [])
    return cfg


@config_app.command("show")
def config_show(config: ConfigOpt, set_: SetOpt = None) -> None:
    """Print the resolved config as YAML. The file, its overrides and the derived values, and
    (a YAML comment) the precision it trains in on this machine."""
    from andrea.train.device import precision_note

    cfg = _load(config, set_)
    typer.echo(cfg.to_yaml(), nl=False)
    typer.echo(f"# {precision_note(cfg.train.precision, cfg.train.device)}")


@config_app.command("keys")
def config_keys(
    as_json: JsonOpt = False,
    markdown: Annotated[
        bool, typer.Option("--markdown", help="docs/config.md's text: a table per section.")
    ] = False,
) -> None:
    """List every config key with its default and description."""
    from andrea.config.reference import keys_json, keys_markdown, keys_table

    _registries()
    if markdown:
        typer.echo(keys_markdown(), nl=False)
    else:
        typer.echo(keys_json() if as_json else keys_table())


@app.command("count-params")
def count_params_cmd(config: ConfigOpt, set_: SetOpt = None, as_json: JsonOpt = False) -> None:
    """Count a config's parameters by group. Built on the meta device and checked against the
    formula."""
    from andrea.model.params import count_params, format_counts

    counts = count_params(_load(config, set_).model)
    typer.echo(json.dumps(counts.as_dict(), indent=2) if as_json else format_counts(counts))


@app.command("train")
def train_cmd(
    config: Annotated[
        str | None,
        typer.Option("--config", "-c", metavar="FILE|PRESET",
                     help="YAML config: a path or a preset name."),
    ] = None,
    set_: SetOpt = None,
    resume: Annotated[
        str | None,
        typer.Option("--resume", metavar="RUN|STEP_DIR|auto",
                     help="Continue runs/<name> (or from one of its step folders), or 'auto': "
                          "the config's run if any."),
    ] = None,
    overwrite: Annotated[
        bool, typer.Option("--overwrite", help="Replace an existing run of the same name.")
    ] = False,
    progress: ProgressOpt = True,
    stop_after: Annotated[
        int | None,
        typer.Option("--stop-after", metavar="N",
                     min=1, help="Run at most N steps now, checkpoint, stop."),
    ] = None,
) -> None:
    """Train a model (also under torchrun for several processes)."""
    from andrea.streams import output_survives_closed_reader
    from andrea.train.loop import check_run_choice, train
    from andrea.train.resume import config_for_run  # loop's set-up imports the registries

    check_run_choice(resume, overwrite)  # before the config is read
    cfg = config_for_run(config, set_ or [], resume)
    with output_survives_closed_reader():
        result = train(
            cfg, resume=resume, overwrite=overwrite, progress=progress, stop_after=stop_after
        )
        result.say()
    raise typer.Exit(result.exit_code)


@app.command("runs", cls=PlainHelp)
def runs_cmd(
    root: Annotated[str, typer.Argument(metavar="DIR",
                                        help="Folder of run directories.")] = "runs",
    as_json: JsonOpt = False,
    verify: Annotated[bool, typer.Option(
        "--verify", help="Also hash each latest checkpoint's files against its checksums.json "
                         "(seconds a GB).")] = False,
) -> None:
    """List runs: steps, losses, speed, state, checkpoint. One row per run: steps, tokens, best
    val loss, last train loss, precision, speed, state and latest checkpoint."""
    from andrea.runs import format_json, format_table, list_runs, no_runs_line

    runs = list_runs(root, verify)
    if as_json:
        typer.echo(format_json(runs))  # [] for none: a reader's list, empty
    else:
        typer.echo(format_table(runs) if runs else no_runs_line(root))


@app.command("plot", cls=PlainHelp)
def plot_cmd(
    runs: Annotated[list[str], typer.Argument(metavar="RUN",
                                              help="Run directories (or names under runs/).")],
    out: Annotated[str, typer.Option("--out", "-o", metavar="FILE",
                                      help="Image file: .png, .svg or .pdf.")],
    x: Annotated[str, typer.Option("--x", metavar="tokens|step",
                                   help="Loss panel x axis: tokens or step.")] = "tokens",
) -> None:
    """Plot the training curves of one or more runs. Loss, learning rate, tokens/s and
    gradient norm, a panel each."""
    from andrea.plot import plot_runs

    typer.echo(f"wrote {plot_runs(runs, out, x=x)}")


@app.command("prepare", cls=RegistryHelp)
def prepare_cmd(
    config: Annotated[
        str | None,
        typer.Option("--config", "-c", metavar="FILE|PRESET",
                     help="Use this config's data section."),
    ] = None,
    set_: SetOpt = None,
    input: Annotated[
        str | None,
        typer.Option("--input", "-i", metavar="PATH",
                     help="A file, directory, glob or datasets folder: {input_formats}."),
    ] = None,
    tokenizer: Annotated[
        str | None, typer.Option("--tokenizer", "-t", metavar="NAME",
                                 help="{tokenizers}.")
    ] = None,
    out: Annotated[str | None, typer.Option("--out", "-o", metavar="DIR",
                                            help="Shard folder.")] = None,
    vocab_size: Annotated[
        int | None, typer.Option("--vocab-size", metavar="N",
                                 help="BPE ids incl. end-of-text (4096).")
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="Redo even if up to date.")] = False,
    errors: Annotated[
        str | None,
        typer.Option("--errors", metavar="strict|replace",
                     help="Invalid UTF-8 or a record without text: strict (fail) "
                     "or replace (U+FFFD; skip and count the record)."),
    ] = None,
    workers: Annotated[
        int | None, typer.Option("--workers", metavar="N",
                                 help="Encoding processes (0: automatic).")
    ] = None,
    tokenizer_file: Annotated[
        str | None,
        typer.Option("--tokenizer-file", metavar="FILE",
                     help="Use this BPE tokenizer.json instead of training."),
    ] = None,
    text_field: Annotated[
        str | None, typer.Option("--text-field", metavar="FIELD",
                                 help="JSON field / Parquet column (text); "
                                 "doc.body for a nested one.")
    ] = None,
    verify: Annotated[
        str | None,
        typer.Option("--verify", metavar="DIR",
                     help="Check a prepared folder's shards (checksums) and exit."),
    ] = None,
) -> None:
    """Tokenize text into token shards. The embedded Shakespeare corpus by default."""
    from andrea.data.prepare import prepare_command

    if verify is not None:
        from andrea.data.verify import verify_command

        others = (config, set_, input, tokenizer, out, vocab_size, force, errors, workers,
                  tokenizer_file, text_field)
        typer.echo(verify_command(verify, alone=all(o in (None, False, []) for o in others)))
        return
    if input is None:  # a config: its keys are checked against every registry's names
        _config_registries()
    else:  # --input's options name tokenizers alone: no torch (150 MiB and 1.5 s to import)
        import andrea.data.tokenizer  # noqa: F401  (not `from`: `tokenizer` is an option here)
    prepare_command(
        config, set_, input=input, tokenizer=tokenizer, out=out, vocab_size=vocab_size,
        force=force, errors=errors, workers=workers, tokenizer_file=tokenizer_file,
        text_field=text_field,
    )


CheckpointOpt = Annotated[
    str | None,
    typer.Option(
        "--checkpoint", metavar="RUN|STEP_DIR", help="runs/<name> or <name> (its latest) or "
        "runs/<name>/step-N; default: the most recent run under ./runs.",
    ),
]


@app.command("eval", cls=RegistryHelp)
def eval_cmd(
    files: Annotated[
        list[str] | None, typer.Argument(metavar="FILE",
                                         help="Task files, one per --task, in order.")
    ] = None,
    checkpoint: Annotated[
        list[str] | None,
        typer.Option("--checkpoint", metavar="RUN|STEP_DIR",
                     help="runs/<name> or <name> (its latest) or runs/<name>/step-N "
                     "(repeatable: one row each); default: the most recent run under ./runs."),
    ] = None,
    all_steps: Annotated[
        bool, typer.Option("--all-steps", help="Every step-N folder of each --checkpoint run.")
    ] = False,
    data: Annotated[
        str | None, typer.Option("--data", metavar="DIR",
                                 help="Prepared shard folder (default: the run's).")
    ] = None,
    split: Annotated[str, typer.Option("--split", metavar="val|train", help="The split.")] = "val",
    max_tokens: Annotated[
        int | None,
        typer.Option("--max-tokens", metavar="N",
                     help="N tokens spread over the split (per source), as "
                     "train.eval_tokens=N; default: all."),
    ] = None,
    source: Annotated[
        str | None, typer.Option("--source", metavar="NAME",
                                 help="Only this mixture source (its path).")
    ] = None,
    task: Annotated[
        list[str] | None,
        typer.Option("--task", metavar="KIND",
                     help="{task_kinds}, scored on the FILE in the same place (repeatable)."),
    ] = None,
    limit: Annotated[
        int | None, typer.Option("--limit", metavar="N", help="At most N examples per task.")
    ] = None,
    val: Annotated[
        bool | None,
        typer.Option("--val/--no-val", help="The val loss (default: on unless --task)."),
    ] = None,
    precision: PrecisionOpt = "auto",
    device: DeviceOpt = "auto",
    batch_size: Annotated[
        int, typer.Option("--batch-size", metavar="N", help="Windows (task sequences) per batch.")
    ] = 8,
    progress: ProgressOpt = True,
    as_json: JsonOpt = False,
) -> None:
    """Score checkpoints: val loss, bits per byte, tasks. Val loss, perplexity and bits per
    byte (per mixture source) and downstream tasks of one or more checkpoints; one table row
    per checkpoint."""
    from andrea.evaluate import EvalSettings, evaluate_checkpoints, format_results, task_pairs

    tasks = task_pairs(task, files)
    settings = EvalSettings(data, max_tokens, precision, device, batch_size, progress, split,
                            source, val=not tasks if val is None else val)
    results = evaluate_checkpoints(checkpoint or [], settings, all_steps=all_steps, tasks=tasks,
                                   limit=limit)
    typer.echo(format_results(results, as_json))


@app.command("generate")
def generate_cmd(
    checkpoint: CheckpointOpt = None,
    prompt: Annotated[
        str | None,
        typer.Option("--prompt", "-p", metavar="TEXT", help="Text to continue. None or empty: a "
                     "new document (unconditional, from the end-of-text token)."),
    ] = None,
    prompt_ids: Annotated[
        str | None,
        typer.Option("--prompt-ids", metavar="IDS", help="Token ids instead, e.g. '464,3290'; "
                     "empty as --prompt \"\"."),
    ] = None,
    max_new_tokens: Annotated[
        int, typer.Option("--max-new-tokens", "-n", metavar="N",
                          help="Tokens to add after the prompt (fewer if end-of-text stops "
                          "it); past the block size the context slides: with the cache, to "
                          "the last half block.")
    ] = 200,
    temperature: Annotated[
        float, typer.Option("--temperature", "-t", metavar="T", help="0: greedy.")
    ] = 0.8,
    top_k: Annotated[
        int | None, typer.Option("--top-k", metavar="K", help="Sample among the K likeliest.")
    ] = 200,
    top_p: Annotated[
        float | None, typer.Option("--top-p", metavar="P", help="Nucleus, in (0, 1].")
    ] = None,
    seed: Annotated[
        int | None,
        typer.Option("--seed", metavar="N", help="Repeat a sampling exactly (on any device); "
                     "default: random."),
    ] = None,
    num_samples: Annotated[
        int, typer.Option("--num-samples", metavar="N",
                          help="Samples of the same prompt, separated by '---'.")
    ] = 1,
    stop_at_eot: Annotated[
        bool, typer.Option("--stop-at-eot/--no-stop-at-eot", help="Stop at end-of-text.")
    ] = True,
    cache: Annotated[bool, typer.Option("--cache/--no-cache", help="Key/value cache.")] = True,
    device: DeviceOpt = "auto",
    precision: Annotated[
        str, typer.Option("--precision", metavar="fp32|auto|bf16|fp16",
                          help="fp32 (the default): the weights as trained; auto: bf16 where "
                               "the hardware has fast bf16, fp16 on older tensor-core GPUs "
                               "(T4, V100), else fp32; bf16, fp16: half the memory.")
    ] = "fp32",
) -> None:
    """Sample text from a checkpoint, streamed to stdout."""
    from andrea.generate import generate_command

    _config_registries()  # the checkpoint's config is checked as it is read
    generate_command(
        checkpoint, prompt, prompt_ids=prompt_ids, max_new_tokens=max_new_tokens,
        temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, num_samples=num_samples,
        stop_at_eot=stop_at_eot, use_cache=cache, device=device, precision=precision,
    )


FormatOpt = Annotated[str, typer.Option("--format", metavar="hf",
                                        help="hf: a transformers GPT-2 directory.")]


def _check_format(fmt: str) -> None:
    if fmt != "hf":
        raise UserError(f"--format {fmt}: the only format is 'hf'")


@app.command("export")
def export_cmd(
    out: Annotated[str, typer.Option("--out", "-o", metavar="DIR", help="Directory to write.")],
    checkpoint: CheckpointOpt = None,
    fmt: FormatOpt = "hf",
    force: Annotated[bool, typer.Option(
        "--force", help="Replace an earlier export at --out (never other files).")] = False,
) -> None:
    """Write a checkpoint as a transformers GPT-2 folder. A directory
    transformers.GPT2LMHeadModel loads."""
    from andrea.hf import export_hf

    _check_format(fmt)
    typer.echo(f"wrote {export_hf(checkpoint, out, force)}")


@app.command("import", cls=PlainHelp)
def import_cmd(
    src: Annotated[str, typer.Argument(metavar="SRC", help="A transformers GPT-2 directory.")],
    fmt: FormatOpt = "hf",
    out: Annotated[
        str | None, typer.Option("--out", "-o", metavar="DIR",
                                     help="Run directory (default runs/<SRC name>).")
    ] = None,
    set_: SetOpt = None,
    force: Annotated[bool, typer.Option(
        "--force", help="Replace the run at --out (never other files).")] = False,
) -> None:
    """Make a run from a transformers GPT-2 folder. The run holds it as step 0: eval or
    generate it, or fine-tune it with `andrea train --resume RUN`."""
    from andrea.hf import import_hf

    _check_format(fmt)
    ckpt = import_hf(src, out, set_ or [], force)
    typer.echo(f"wrote {ckpt}; fine-tune with: "
               f"{shlex.join(['andrea', 'train', '--resume', str(ckpt.parent)])}")


@app.command("bench", cls=RegistryHelp)
def bench_cmd(
    quick: Annotated[
        bool, typer.Option("--quick", help="Small sizes, only the dtype training uses here: "
                                           "under a minute on a CPU.")
    ] = False,
    device: DeviceOpt = "auto",
    backend: Annotated[
        list[str] | None,
        typer.Option("--backend", metavar="NAME",
                     help="{backends} (repeatable; default all that run here)."),
    ] = None,
    dtype: Annotated[
        list[str] | None, typer.Option("--dtype", metavar="{dtypes|}",
                                       help="{dtypes} (repeatable; default all).")
    ] = None,
    shape: Annotated[
        list[str] | None,
        typer.Option("--shape", metavar="NAME",
                     help="{shapes}."),
    ] = None,
    batch: Annotated[
        int | None, typer.Option("--batch", metavar="B", help="Override B of the attention shapes.")
    ] = None,
    repeats: Annotated[
        int, typer.Option("--repeats", metavar="N",
                          help="Timings (median), each of calls back to back for "
                          "at least 20 ms (at most 50 calls).")
    ] = 10,
    warmup: Annotated[int, typer.Option("--warmup", metavar="N", help="Untimed calls first.")] = 3,
    preset: Annotated[
        str | None,
        typer.Option("--preset", metavar="NAME",
                     help="Training benchmark preset (default andrea-120m on a GPU, "
                     "andrea-12m on a CPU)."),
    ] = None,
    train_steps: Annotated[int, typer.Option("--train-steps", metavar="N",
                                             help="Timed training steps.")] = 10,
    set_: SetOpt = None,
    train: Annotated[
        bool, typer.Option("--train/--no-train", help="Run the training-step benchmark.")
    ] = True,
    as_json: JsonOpt = False,
) -> None:
    """Time attention kernels and training steps. Attention forward, backward and both per
    backend, then training steps of a preset; a table at the end."""
    from andrea.bench import format_table, run_bench

    _config_registries()
    result = run_bench(
        device=device, backends=backend, dtypes=dtype, shapes=shape, batch=batch,
        repeats=repeats, warmup=warmup, preset=preset, train_steps=train_steps,
        train_overrides=set_, train=train, quick=quick,
    )
    typer.echo(result.to_json() if as_json else format_table(result))


def _parser_error_line(exc: Exception) -> str:
    """A parser error (unknown option, bad value, missing argument) as one line, with the command
    whose help lists what it accepts."""
    message = " ".join(exc.format_message().split())  # type: ignore[attr-defined]
    ctx = getattr(exc, "ctx", None)
    hint = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
    return f"error: {message}{hint}"


def main(argv: list[str] | None = None) -> None:
    """Entry point: bad input, ours or the parser's, becomes one line on stderr and exit code 2,
    never a traceback."""
    # Every call of a typer app sets sys.excepthook to typer's and leaves it there: a hook the
    # caller's process had (a notebook's, a sweep's crash logger) would be gone after the verb.
    excepthook = sys.excepthook
    try:
        with faults.installed_from_environment():
            code = app(args=argv, prog_name="andrea", standalone_mode=False)
    except UserError as exc:
        typer.echo(f"error: {exc}", err=True)
        sys.exit(exc.exit_code)
    except Restarting as exc:
        typer.echo(str(exc), err=True)
        sys.exit(exc.exit_code)
    except ParserError as exc:
        if type(exc).__name__ == "NoArgsIsHelpError":  # a bare `andrea config`: its help
            typer.echo(exc.format_message(), err=True)
        else:
            typer.echo(_parser_error_line(exc), err=True)
        sys.exit(UserError.exit_code)
    except typer.Abort:
        typer.echo("aborted", err=True)
        sys.exit(1)
    finally:
        sys.excepthook = excepthook
    sys.exit(code if isinstance(code, int) else 0)


