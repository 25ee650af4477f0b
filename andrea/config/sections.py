"""Every config key, declared once: the sections `model`, `data`, `train` of a YAML config.

A key is one `key(default, description, ...)` field below: its type (the annotation), default,
allowed values (`choices`) or constraint (`check`), whether `--resume` may change it, and a
one-line description. Loading, validation, the resume rules, `andrea config keys` and
docs/config.md all read these declarations; adding a key is one field here plus its use.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import yaml

from andrea.config.declare import (
    POSITIVE_INT,
    Check,
    KeySpec,
    Registered,
    ResumeChange,
    fraction,
    key,
    non_negative,
    not_blank,
    positive,
    section_keys,
)

# train.precision; eval and generate take the same as --precision.
PRECISIONS = ("auto", "bf16", "fp16", "fp32")
# The torch dtype each precision computes in, by name: records (metrics.jsonl's "precision")
# are read with these where torch is not imported (andrea runs).
PRECISION_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
# train.muon_ns_precision: no fp16, whose range the Newton-Schulz iterations would not keep.
NS_PRECISIONS = ("auto", "bf16", "fp32")


@dataclass
class ModelConfig:
    n_layer: int = key(6, "transformer blocks", check=POSITIVE_INT)
    n_head: int = key(12, "attention heads per block", check=POSITIVE_INT)
    head_dim: int = key(32, "width of one attention head", check=POSITIVE_INT)
    d_model: int | None = key(
        None, "model width, derived as n_head * head_dim; may be given, but then must agree",
        check=POSITIVE_INT)
    block_size: int = key(256, "context length in tokens (learned positions)",
                          check=POSITIVE_INT)
    vocab_size: int = key(4096, "vocabulary size (the bpe tokenizer trains to it)",
                          check=POSITIVE_INT)
    dropout: float = key(0.0, "dropout probability", check=fraction())
    bias: bool = key(False, "biases in the linear layers and norms")
    activation: str = key(
        "gelu", "MLP activation: gelu is the exact erf form, gelu_tanh GPT-2's tanh approximation",
        choices=("gelu", "gelu_tanh"))
    attention: str = key(
        "auto", "attention backend: sdpa (torch), cuda (andrea's kernels), math (the reference); "
        "auto: by the measured table for the GPU, dtype and head_dim, else sdpa",
        choices=Registered("model.attention"), resumable=True)  # model.attention.BACKENDS
    init_std: float = key(0.02, "standard deviation of the initial weights", check=positive())


def _same_paths(old: list, new: list) -> bool:
    """data.sources on resume: the same sources in the same order, their weights free to
    change (a mixture shifted late in a run, as annealing on the best data does)."""
    return [s["path"] for s in old] == [s["path"] for s in new]


@dataclass
class DataConfig:
    source: str = key(
        "shakespeare", "the text: shakespeare (the embedded corpus), or a file, directory or glob",
        check=not_blank("shakespeare, or a file, directory or glob"), path=True)
    tokenizer: str = key("bpe", "gpt2 (tiktoken's), bpe (trained on the source), or byte",
                         choices=Registered("data.tokenizer"))  # data.tokenizer.KINDS
    dir: str = key(
        "", "where the shards go; empty: data/<source>-<tokenizer>[-<vocab>] under the working "
        "directory (data/<source>-bpe-tok<hash> with tokenizer_file)", resumable=True, path=True)
    tokenizer_file: str = key(
        "", "for tokenizer bpe: an existing HF tokenizer.json (byte-level BPE, <|endoftext|> "
        "last) to use as is, e.g. an imported model's; empty: train one", path=True)
    val_fraction: float = key(0.1, "share of the documents held out for validation",
                              check=Check(lambda x: 0 < x < 1, "in (0, 1)"))
    shard_tokens: int = key(50_000_000, "tokens per shard file", check=POSITIVE_INT)
    workers: int = key(0, "processes that tokenize; 0: automatic",
                       check=non_negative("0 (automatic) or a positive integer"), resumable=True)
    errors: str = key(
        "strict", "strict: invalid UTF-8 or a record without a string text field stops the "
        "prepare; replace: such bytes become U+FFFD, such records are skipped and counted",
        choices=("strict", "replace"))
    text_field: str = key("text", "the JSON field / Parquet or Arrow column that holds the text",
                          check=not_blank("a field's name"))
    sources: list = key(
        [], "a mixture: a list of {path, weight}, each prepared on its own, each training "
        "window drawn from source i with probability weight_i / sum(weights); empty: source alone",
        resumable=ResumeChange(_same_paths, "its weights may change"))
    order: str = key(
        "random", "the training windows' order: random draws each step's afresh (over a run some "
        "come more often than others); epochs takes every window of the split once a pass, "
        "in a new order and at a new offset each pass (one data dir, not data.sources)",
        choices=Registered("data.order"))  # data.loader.ORDERS


@dataclass
class TrainConfig:
    name: str = key("", "run name (runs_dir/name), a folder name of at most 255 bytes; "
                    "empty: the config file's stem", location=True)
    runs_dir: str = key("runs", "folder that holds the run folders", location=True, path=True)
    seed: int = key(1337, "seed of the initial weights, the data order and dropout",
                    check=non_negative("a non-negative integer"))
    device: str = key("auto", "auto: cuda when there is a GPU, else cpu",
                      choices=("auto", "cpu", "cuda"), resumable=True)
    precision: str = key(
        "auto", "autocast dtype; fp16 trains with dynamic loss scaling; auto: bf16 on a GPU of "
        "compute capability 8.0+ or a CPU with bf16 units, fp16 on 7.x GPUs and P100, else fp32",
        choices=PRECISIONS, recorded_auto="precision")
    compile: bool | str = key(
        "auto", "torch.compile the model (its first steps compile); auto: on one CUDA process, "
        "not on a CPU and not yet under torchrun",
        check=Check(lambda x: x == "auto" or isinstance(x, bool), "auto, true or false"),
        resumable=True)
    compile_mode: str = key(
        "default", "torch.compile's mode; reduce-overhead also replays each step as CUDA graphs "
        "(one process on a GPU; elsewhere the default), for a model too small to keep the GPU "
        "busy between kernel launches", choices=("default", "reduce-overhead"), resumable=True)
    micro_batch_size: int | str = key(
        8, "sequences per forward/backward; auto: the largest that divides the per-process "
        "batch and fits the device's memory, resolved once per run and kept on resume",
        check=Check(lambda x: x == "auto" or (isinstance(x, int) and x > 0),
                    "auto or a positive integer"), resumable=True)
    loss_chunk_rows: int | str = key(
        "auto", "rows of the LM head's output the loss computes at a time (the rest never exist "
        "at once); auto: about 32M logits a chunk (667 rows at vocab 50,304); 0: no chunks, the "
        "whole [tokens, vocab] logits at once; the chunks order the weight gradient's sums",
        check=Check(lambda x: x == "auto" or (isinstance(x, int) and not isinstance(x, bool)
                                              and x >= 0), "auto or an integer of 0 or more"),
        resumable=True)
    activation_checkpointing: str = key(
        "none", "blocks: recompute each block's activations in backward instead of keeping them",
        choices=("none", "blocks"), resumable=True)
    parallel: str = key(
        "ddp", "under torchrun: ddp keeps a whole copy of the model, gradients and optimizer "
        "state on every process; fsdp shards all three over the processes (FSDP2)",
        choices=Registered("train.parallel"), resumable=True)  # parallel.MODES
    global_batch_tokens: int = key(
        0, "tokens per optimizer step over all processes; 0: one micro-batch per process",
        check=non_negative("0 (no accumulation) or a positive integer"))
    batch_warmup_tokens: int = key(
        0, "batch-size warm-up: the first batch_warmup_steps steps take this many tokens each "
        "(0: off, and so is a value not below global_batch_tokens)",
        check=non_negative("0 (off) or a positive integer"))
    batch_warmup_steps: int = key(0, "steps of the batch-size warm-up (0: off)",
                                  check=non_negative())
    seq_warmup_length: int = key(
        0, "sequence-length warm-up: the first seq_warmup_steps steps train on windows this "
        "long, as many tokens a step (0: off, and so is a length not below block_size)",
        check=non_negative("0 (off) or a positive integer"))
    seq_warmup_steps: int = key(0, "steps of the sequence-length warm-up (0: off)",
                                check=non_negative())
    max_steps: int = key(1000, "optimizer steps of the run", check=POSITIVE_INT, resumable=True)
    lr: float = key(6e-4, "peak learning rate (AdamW's)", check=positive())
    min_lr: float = key(6e-5, "learning rate at the end of the decay", check=non_negative())
    schedule: str = key(
        "cosine", "cosine decay, constant, or wsd (warmup-stable-decay)",
        choices=("cosine", "constant", "wsd"))
    warmup_steps: int = key(100, "steps of linear learning-rate warm-up", check=non_negative())
    decay_fraction: float = key(
        0.2, "wsd: the fraction of max_steps spent decaying at the end",
        check=Check(lambda x: 0 < x <= 1, "in (0, 1]"))
    weight_decay: float = key(0.1, "AdamW's decoupled weight decay", check=non_negative())
    decay_embeddings: bool = key(False, "apply weight decay to the embeddings too")
    beta1: float = key(0.9, "AdamW's beta1", check=fraction())
    beta2: float = key(0.95, "AdamW's beta2", check=fraction())
    eps: float = key(1e-8, "AdamW's epsilon", check=positive())
    grad_clip: float = key(1.0, "clip the global gradient norm to this",
                           check=non_negative("non-negative (0 turns clipping off)"))
    eval_every: int = key(
        100, "steps between val evaluations (and at the last step)",
        check=non_negative("non-negative (0 turns evaluation off)"), resumable=True)
    eval_tokens: int = key(
        32768, "the val set: this many target tokens in windows spread over the whole val "
        "split (of every mixture source); 0: the whole split",
        check=non_negative("0 (the whole val split) or a positive integer"), resumable=True)
    # It counted micro-batches, so the val set moved with the micro-batch size; validate turns
    # an old config's value into the eval_tokens it named.
    eval_batches: int | None = key(
        None, "deprecated: becomes eval_tokens = eval_batches x micro_batch_size (8 for auto) "
        "x block_size, unless eval_tokens is given (a --set of it where the file gives "
        "eval_tokens: refused)",
        check=positive("a positive integer (deprecated: use train.eval_tokens)"), resumable=True)
    checkpoint_every: int = key(
        200, "steps between checkpoints (and at the last step)",
        check=non_negative("non-negative (0: only at the end)"), resumable=True)
    keep_last: int = key(3, "step checkpoints kept", check=POSITIVE_INT, resumable=True)
    join_timeout: int = key(
        300, "seconds a process under torchrun waits for every other to join the process group "
        "before it stops with one line, instead of waiting silently (a restart the launcher "
        "could not bring together)", check=POSITIVE_INT, resumable=True)
    log_every: int = key(10, "steps between printed and logged training records",
                         check=POSITIVE_INT, resumable=True)
    skip_nonfinite: bool = key(
        False, "a step whose loss or gradient is not finite is skipped instead of stopping "
        "the run", resumable=True)
    tensorboard: bool = key(False, "also write TensorBoard event files", resumable=True)
    wandb: str = key(
        "off", "also log to Weights & Biases: online, or offline (W&B's files under the run "
        "folder, uploaded later by `wandb sync`); needs pip install -e '.[wandb]'",
        choices=("off", "online", "offline"), resumable=True)
    wandb_project: str = key("andrea", "the W&B project", resumable=True)
    wandb_name: str | None = key(None, "the W&B run's name (default: the run's name)",
                                 resumable=True)
    wandb_entity: str | None = key(
        None, "the W&B entity, a team or user (default: your W&B account's)", resumable=True)
    optimizer: str = key(
        "adamw", "adamw for every parameter; muon: Muon for the 2-D matrices inside the blocks, "
        "AdamW for the rest", choices=Registered("train.optimizer"))  # optim.OPTIMIZERS
    muon_lr: float = key(0.02, "Muon's peak learning rate; the schedule scales it as it scales lr",
                         check=positive())
    muon_weight_decay: float = key(0.01, "Muon's decoupled weight decay", check=non_negative())
    muon_momentum: float = key(0.95, "Muon's momentum", check=fraction())
    muon_ns_precision: str = key(
        "auto", "dtype of Muon's Newton-Schulz iterations; auto: bf16 where the device has fast "
        "bf16 matmuls, else fp32", choices=NS_PRECISIONS, recorded_auto="muon_ns_precision")
    muon_ns_coefficients: str = key(
        "quintic", "quintic: torch's fixed (3.4445, -4.775, 2.0315); polar_express: the Polar "
        "Express paper's per-iteration quintics (arXiv:2505.16932); 5 iterations each",
        choices=("quintic", "polar_express"), resumable=True)
    muon_neuron_beta2: float = key(
        0.0, "NorMuon when > 0: each output neuron's update divided by the root of a running "
        "mean (this decay) of its squares, keeping the norm; 0: plain Muon; not under fsdp",
        check=fraction("in [0, 1) (0: off; NorMuon uses 0.95)"))
    muon_cautious_weight_decay: bool = key(
        False, "decay only the matrix entries whose update has the same sign (towards zero too)",
        resumable=True)
    zero_init_output: bool = key(
        False, "start every residual branch (attention W_O, MLP down projection) at zero; "
        "false: GPT-2's N(0, 0.02 / sqrt(2 n_layer))", resumable=True)
    spike_guard: str = key(
        "skip", "loss-spike guard: skip an outlier step; rollback: as skip, and after "
        "spike_patience outliers in a row back to the last checkpoint with a lower lr; a run "
        "from before the guard (2026-12-01) resumes with off, as it trained",
        choices=("off", "skip", "rollback"), resumable=True, before="off")
    spike_z: float = key(6.0, "z-score over the last spike_window steps that makes an outlier",
                         check=positive("positive (a z-score, e.g. 6)"), resumable=True)
    spike_window: int = key(50, "steps the spike guard's statistics cover",
                            check=Check(lambda x: x >= 2, "an integer of at least 2"),
                            resumable=True)
    spike_patience: int = key(3, "outliers in a row before a rollback", check=POSITIVE_INT,
                              resumable=True)
    spike_lr_factor: float = key(0.5, "lr multiplier after a rollback",
                                 check=Check(lambda x: 0 < x <= 1, "in (0, 1]"), resumable=True)
    spike_lr_steps: int = key(100, "steps the lower lr lasts after a rollback",
                              check=non_negative(), resumable=True)


SECTIONS: dict[str, type] = {"model": ModelConfig, "data": DataConfig, "train": TrainConfig}


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    # Where the config came from (a path, or "<defaults>"); not a YAML key.
    source: str = field(default="<defaults>", compare=False)
    # The dotted keys the file or --set gave (not YAML keys): to tell a default from a choice.
    given: set[str] = field(default_factory=set, compare=False, repr=False)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {name: dataclasses.asdict(getattr(self, name)) for name in SECTIONS}

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


def key_specs() -> list[KeySpec]:
    """Every config key, section by section, in declaration order."""
    return [spec for section, cls in SECTIONS.items() for spec in section_keys(section, cls)]


def key_spec(dotted: str) -> KeySpec:
    """The declaration of one key, e.g. key_spec('train.precision').choices."""
    for spec in key_specs():
        if spec.dotted == dotted:
            return spec
    raise KeyError(dotted)


def registered_keys() -> set[str]:
    """The keys whose allowed values are a registry's names (`choices=Registered(...)`)."""
    return {spec.dotted for spec in key_specs() if isinstance(spec.rule.options, Registered)}
