"""Resume rules: which run to continue, and which config changes it accepts (the keys declared
`resumable` in andrea/config/sections.py)."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

from andrea.config import (
    Config,
    ModelConfig,
    config_from_dict,
    key_spec,
    key_specs,
    load_config,
    load_run_config,
    value_text,
)
from andrea.data.loader import mixture_shares
from andrea.errors import UserError
from andrea.model.params import check_stored_shape
from andrea.train.checkpoint import read_model_checkpoint
from andrea.train.restarts import attempt
from andrea.train.rundir import (
    CONFIG,
    LATEST,
    MODEL_FILE,
    OVERWRITTEN,
    TrainerState,
    checkpoint_problem,
    checksums_problem,
    is_step_dir,
    newest_intact,
    read_latest,
    resolve_checkpoint,
    run_path,
    set_aside_run,
    start_over_command,
    step_dirs,
    stored_shapes,
)
from andrea.train.torchrun import torchrun_env


def config_changes(stored: Config, given: Config) -> dict[str, tuple[Any, Any]]:
    """Dotted key -> (the run's value, the given value), for every key that differs."""
    old, new = stored.to_dict(), given.to_dict()
    locations = {spec.dotted for spec in key_specs() if spec.rule.location}
    return {
        f"{section}.{key}": (value, new[section][key])
        for section, keys in old.items()
        for key, value in keys.items()
        if f"{section}.{key}" not in locations and new[section][key] != value
    }


def change_text(key: str, old: Any, new: Any) -> str:
    """One change of a resume as its lines say it, `train.compile false -> auto`: the values
    as the user writes them (value_text), not as Python prints them (False)."""
    return f"{key} {value_text(old)} -> {value_text(new)}"


def check_resume_changes(
    stored: Config, given: Config, run_dir: Path, trained: bool,
    record: TrainerState | None = None,
) -> dict[str, list[Any]]:
    """The allowed changes as {key: [old, new]}; a UserError naming every refused key.

    A run that has not trained yet (an import: its checkpoint is at step 0) may still change
    its schedule and data, everything but the model the weights fix. `record`: the
    checkpoint's trainer state, whose resolved `auto`s a key may be pinned to."""
    refused = [f"{k} ({value_text(a)} -> {value_text(b)})"
               for k, (a, b) in _refused(stored, given, trained, record).items()]
    if refused:
        raise UserError(
            f"{run_dir}: resuming cannot change {', '.join(refused)}: these keys define the run; "
            f"leave them as the run has them ({shlex.join(['--resume', str(run_dir)])} alone "
            f"continues its own config.yaml) or start a new run"
        )
    return {k: [a, b] for k, (a, b) in config_changes(stored, given).items()}


def _refused(
    old: Config, new: Config, trained: bool, record: TrainerState | None
) -> dict[str, tuple[Any, Any]]:
    """The changes from `old` to `new` a resume may not make: all but those a key's
    declaration allows (Rule.may_change) and the pins of an `auto` to what it resolved to in
    the run (`record`: the checkpoint's trainer state), and, while the run has not trained (an
    import, at step 0), any outside `model`."""
    return {k: (a, b) for k, (a, b) in config_changes(old, new).items()
            if not (key_spec(k).rule.may_change(a, b) or _pins_resolved_auto(k, a, b, record))
            and (trained or k.startswith("model."))}


def _pins_resolved_auto(key: str, old: Any, new: Any, record: TrainerState | None) -> bool:
    """Whether `key` changes from `auto` to the value it resolved to in the run, as `record`
    has it (the key's declared `recorded_auto`): a run of train.precision auto that trained in
    fp32 (a CPU without bf16 units), pinned to fp32, computes on as it did. A pin to anything
    else is a change like any other."""
    recorded = key_spec(key).rule.recorded_auto
    return (old == "auto" and recorded is not None and record is not None
            and getattr(record, recorded) == new)


def trained_config(checkpoint: Path) -> Config:
    """The config `checkpoint` was trained with: its weights' metadata (the header alone)."""
    return read_model_checkpoint(checkpoint, tensors=False)[1]


def check_run_config(
    stored: Config, checkpoint: Path, run_dir: Path, trained: bool,
    record: TrainerState | None = None,
) -> None:
    """The run's config.yaml against the config `checkpoint` was trained with (its weights'
    metadata): a key that defines the run, edited in config.yaml between stop and resume, is
    refused as its --set is (`record`: the checkpoint's trainer state, as check_resume_changes
    takes it). Unchecked, an edited train.lr trained on silently (the schedule jumping to it)
    and an edited train.optimizer called the optimizer state damaged."""
    trained_with = trained_config(checkpoint)
    edited = [f"{k} {value_text(b)} where {checkpoint} was trained with {value_text(a)}"
              for k, (a, b) in _refused(trained_with, stored, trained, record).items()]
    if edited:
        raise UserError(
            f"{run_dir / CONFIG}: {'; '.join(edited)}: these keys define the run, so a resume "
            f"cannot change them, by --set or in {CONFIG}; put them back as the run trained "
            f"them, or start a new run"
        )


# The keys a resume may change that make the val set another: its windows (train.eval_tokens of
# them), and a mixture's weights, by which its val loss averages the sources'.
VAL_SET_KEYS = ("train.eval_tokens", "data.sources")


def new_val_set(
    stored: Config, trained_with: Config, cfg: Config, recorded: list[dict[str, str]] | None,
    found: list[dict[str, str]],
) -> list[str]:
    """Why a resume with `cfg`, reading the data `found` (loader.data_record), evaluates on
    another val set than the checkpoint trained with `trained_with` and recording the data
    `recorded` measured its val losses on, and so its best val: each change of VAL_SET_KEYS
    (from the checkpoint's config, so an edited config.yaml counts as a --set), a val split
    with other shards (prepared again, or another folder named), and a run of an andrea from
    before 2026-12-01 (its config.yaml, `stored`, gives train.eval_batches and no eval_tokens),
    which scored the split's first windows where the same budget now spreads over all of it;
    none: the same set."""
    causes = [change_text(key, old, new) for key, (old, new) in
              config_changes(trained_with, cfg).items()
              if key in VAL_SET_KEYS and not (key == "data.sources" and same_shares(old, new))]
    if "train.eval_batches" in stored.given and "train.eval_tokens" not in stored.given:
        tokens = stored.train.eval_tokens
        causes.append(f"the run scored its val loss on the val split's first {tokens:,} tokens "
                      f"(train.eval_batches, an andrea before 2026-12-01), now on {tokens:,} "
                      f"spread over the whole split (train.eval_tokens)")
    for old, new in zip(recorded or [], found, strict=False):  # data.sources is the run's own
        if old["val"] != new["val"]:
            causes.append(f"the val split in {new['dir']} is not the one the run evaluated on")
    return causes


def same_shares(old: list[dict[str, Any]], new: list[dict[str, Any]]) -> bool:
    """Whether two data.sources of the same paths (a resume keeps them) weigh the sources
    alike: weights 1, 1 and 2, 2 are one mixture, its windows and val loss the same."""
    return bool((mixture_shares([s["weight"] for s in old])
                 == mixture_shares([s["weight"] for s in new])).all())


def new_val_set_line(causes: list[str], step: int) -> str:
    """The one line of a resume whose val set is another (new_val_set's causes), from `step`."""
    return (f"resume: {'; '.join(causes)}: a new val set, so the val losses after step {step} "
            f"are not comparable with the earlier ones, and the best val starts again from them")


def config_for_run(config: str | None, overrides: list[str], resume: str | None) -> Config:
    """The config to train with: --config (+ --set), or a resumed run's own config.yaml (+ --set,
    which train() then checks against the keys declared resumable)."""
    if config is not None:
        return load_config(config, overrides)
    if resume is None or resume == "auto":
        raise UserError("andrea train needs --config (a path or a preset name) or --resume RUN_DIR")
    store = attempt().store
    if store is None:
        return _run_config(resume, overrides)
    return _run_config_from_rank0(store, resume, overrides)


def _run_config(resume: str, overrides: list[str]) -> Config:
    aside = set_aside_run(run_path(resume))
    if aside is not None and (aside / OVERWRITTEN / CONFIG).is_file():
        # An --overwrite stopped during its set-up: the run it set aside is the one resumed
        # (open_run puts it back, holding the run's lock), not the new run's start files.
        return load_run_config(aside / OVERWRITTEN / CONFIG, overrides)
    return load_run_config(locate_run(resume, None) / CONFIG, overrides)


def _run_config_from_rank0(store: Any, resume: str, overrides: list[str]) -> Config:
    """`--resume RUN_DIR` under torchrun: rank 0 reads the run's config.yaml and every rank
    trains with it, so a node whose runs_dir holds no copy (ddp with the run on node 0 alone)
    continues the same run; rank 0's error is every rank's, so no rank waits for another."""
    env = torchrun_env()
    key = "andrea/resume-config"  # under this attempt's prefix
    if env.rank == 0:
        try:
            cfg = _run_config(resume, overrides)
        except UserError as exc:
            store.set(key, json.dumps({"error": str(exc)}))
            raise
        store.set(key, json.dumps({"config": cfg.to_dict(), "source": cfg.source}))
        return cfg
    sent = json.loads(store.get(key))
    if "error" in sent:
        raise UserError(sent["error"])
    return config_from_dict(sent["config"], sent["source"])


def has_checkpoint(run_dir: Path) -> bool:
    """Whether the run has any checkpoint to resume: `latest`, or a step folder (a damaged
    `latest` is named with the newest intact step later, by resume_checkpoint)."""
    return read_latest(run_dir) is not None or bool(step_dirs(run_dir))


def find_run_to_resume(resume: str, cfg: Config | None) -> Path | None:
    """`--resume runs/<name>`, `--resume runs/<name>/step-N` (that checkpoint of the run) or
    `--resume auto` (the config's run, if it has a checkpoint): the run directory."""
    if resume == "auto":
        if cfg is None:
            raise UserError("--resume auto needs --config to know the run's name")
        run_dir = Path(cfg.train.runs_dir) / cfg.train.name
        return run_dir if has_checkpoint(run_dir) else None
    run_dir = locate_run(resume, cfg)
    if not has_checkpoint(run_dir):
        raise UserError(
            f"--resume {resume}: the run was started but stopped before its first checkpoint "
            f"({shlex.join(['andrea', 'runs', str(run_dir)])} says how), so there is nothing to "
            f"continue; start it over with: "
            f"{start_over_command(run_dir)}"
        )
    return run_dir


def locate_run(resume: str, cfg: Config | None) -> Path:
    """The run folder `--resume PATH` names (a step folder's run), refused unless it is a run
    folder. Whether it has a checkpoint to continue is find_run_to_resume's to say, once the
    run's lock is held: a live run has none yet, and is then refused as in use."""
    run_dir = run_path(resume, cfg.train.runs_dir if cfg is not None else "runs")
    if is_step_dir(run_dir) and (run_dir.parent / CONFIG).is_file():
        run_dir = run_dir.parent
    if run_dir.exists() and not run_dir.is_dir():
        raise UserError(f"--resume {resume}: {run_dir} is a file; give a run folder "
                        f"(train.runs_dir/train.name, e.g. runs/NAME) or a step folder of one")
    if not run_dir.is_dir():
        elsewhere = ""
        if torchrun_env().world_size > 1:  # a node with its own runs_dir
            elsewhere = (" on this node; where train.runs_dir is on node 0 alone, give every "
                         "node --config CONFIG --resume auto")
        raise UserError(f"--resume {resume}: no such run directory{elsewhere}")
    if not (run_dir / CONFIG).is_file():
        raise UserError(f"--resume {resume}: {run_dir} is not a run folder (it has no {CONFIG})")
    return run_dir


def resume_checkpoint(resume: str, run_dir: Path) -> Path:
    """The checkpoint `--resume` continues from: the step folder it names, else the run's
    latest; a damaged one is refused naming the newest intact step (resolve_checkpoint). A
    worker torchrun restarted takes the newest intact one instead, its files' checksums
    verified too: nobody is there to choose, and a checkpoint whose files merely read (a
    flipped byte keeps every header sound) was refused at its load in every restart, until
    torchrun had none left."""
    named = Path(resume)
    where = run_dir / named.name if is_step_dir(named) else run_dir
    use = "andrea train --resume {}"
    if not attempt().number:
        return resolve_checkpoint(where, use=use, for_resume=True)
    try:
        checkpoint = resolve_checkpoint(where, use=use, for_resume=True)
    except UserError:
        verified = newest_intact(run_dir, for_resume=True, verify=True)
        if verified is None:
            raise
        return verified
    if checksums_problem(checkpoint, for_resume=True) is None:
        return checkpoint
    # Where none verifies, this one: its load refuses it in one line naming the file.
    return newest_intact(run_dir, for_resume=True, verify=True) or checkpoint


def passed_over(run_dir: Path, checkpoint: Path) -> str | None:
    """Why a torchrun restart continues from `checkpoint` and not from the one the run's
    `latest` names, in words (that one's damage, as checkpoint_problem says it, its checksums
    verified); None when `latest` names `checkpoint`."""
    named = read_latest(run_dir)
    if named is None:
        return f"the run's '{LATEST}' file names no checkpoint"
    problem = None if named == checkpoint else checkpoint_problem(named, for_resume=True,
                                                                  verify=True)
    return None if problem is None else f"passed over {named.name}, which '{LATEST}' names: " \
        f"{problem}"


def check_checkpoint_shape(model: ModelConfig, checkpoint: Path, run_dir: Path) -> None:
    """The resumed run's model keys against the shapes `checkpoint` stores, read from its
    weights file's header alone, before any model is built. A resume takes the run's
    config.yaml as the run's own (check_resume_changes compares --set with it, not with the
    weights), so a config.yaml edited to model.n_layer 10^6 was built whole, taking memory
    without end, before load_weights compared a tensor with it."""
    path = checkpoint / MODEL_FILE
    check_stored_shape(
        model, stored_shapes(path), str(run_dir / CONFIG),
        advice=(f"{path} holds another model, so none is built; put the model keys of "
                f"{run_dir / CONFIG} back as the run trained them, or start a new run"))


def restart_resume(resume: str | None, overwrite: bool) -> tuple[str | None, bool]:
    """(--resume, --overwrite) as this process takes them. A worker torchrun restarted after a
    failure continues the run the first launch trained, from its newest checkpoint (a
    `--resume RUN/step-N` means RUN then, and --overwrite would throw away what the first
    launch trained); a first launch takes them as given."""
    if not attempt().number:
        return resume, overwrite
    if resume is None or resume == "auto":
        return "auto", False
    named = Path(resume)
    if is_step_dir(named) and (named.parent / CONFIG).is_file():
        return str(named.parent), False
    return resume, False
