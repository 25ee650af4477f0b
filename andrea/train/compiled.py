"""train.compile: whether a run compiles its model, and how (torch.compile, inductor).

`auto` compiles on one CUDA process: there the compiled step is what makes andrea as fast as a
hand-written compiled loop (docs/log.md, 2026-12-04, the fastest step on one GPU). Not on a
CPU, where a compile costs minutes of a short run and gains little, and not yet under torchrun,
where the compiled step has not been measured or resumed on GPUs (`true` asks for it anyway).
The embeddings and the loss stay out of the compiled graph (OUTSIDE_THE_GRAPH); the loss's
chunks run through a compiled softmax_chunk. Inductor keeps what it compiled under andrea's
cache folder, so a second run of the same model compiles in seconds.
"""

from __future__ import annotations

import os

import torch
import torch.nn as nn

from andrea.model.transformer import Andrea, softmax_chunk
from andrea.resources import cache_dir
from andrea.train.torchrun import DistInfo

# torch.compile's mode for the model. scripts/gpu_speed.py sets other modes side by side with
# this one ("reduce-overhead": CUDA graphs) to measure them.
MODE = "default"
INDUCTOR_CACHE_VARIABLE = "TORCHINDUCTOR_CACHE_DIR"

# The parts of an Andrea a compiled model runs eagerly, and why. Kept out here rather than by
# decorators in the model file: torch.compiler.disable imports dynamo, 1.4 s of every process's
# start, which evaluation and sampling never need.
OUTSIDE_THE_GRAPH = (
    # Inductor's backward of an embedding adds each row's gradients with atomics, in whatever
    # order the threads come, so a compiled step's last bits would differ from run to run and a
    # resume would not repeat it; eager's is deterministic.
    "embed",
    # Its loop over the chunks would be unrolled there (25 chunks a micro-batch of 16 x 1024 at
    # vocab 50,304), a graph of many small matmuls that took minutes to compile.
    "chunked_loss",
)


def choose_compile(setting: bool | str, device: torch.device, dist: DistInfo) -> tuple[bool, str]:
    """(compile?, why) for train.compile = true, false or auto."""
    if setting is True or setting is False:
        return setting, f"train.compile: {str(setting).lower()}"
    if device.type != "cuda":
        return False, f"auto: not on {device.type}"
    if dist.enabled:
        return False, "auto: not under torchrun yet; train.compile=true asks for it"
    return True, "auto: one CUDA process"


def inductor_cache() -> str:
    """Where inductor keeps what it compiled: $TORCHINDUCTOR_CACHE_DIR as the user set it, else
    andrea's cache folder's `inductor`, set here, so that it outlives /tmp and a second run
    reuses it. (torch sets the variable to its /tmp default when inductor is imported, which
    andrea's imports do: that value counts as unset.)"""
    current = os.environ.get(INDUCTOR_CACHE_VARIABLE)
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        torch_default = default_cache_dir()
    except ImportError:  # another torch's layout: take only an unset variable
        torch_default = None
    if current is None or current == torch_default:
        os.environ[INDUCTOR_CACHE_VARIABLE] = str(cache_dir() / "inductor")
    return os.environ[INDUCTOR_CACHE_VARIABLE]


def keep_outside_the_graph(model: Andrea) -> None:
    """Make a compiled `model` call OUTSIDE_THE_GRAPH's methods eagerly (a graph break each);
    uncompiled, they run as before."""
    for name in OUTSIDE_THE_GRAPH:
        if name not in vars(model):  # once: the instance's own attribute is the wrapped method
            setattr(model, name, torch.compiler.disable(getattr(model, name)))


def compile_model(model: nn.Module) -> nn.Module:
    """The compiled module the steps call; an Andrea's loss chunks run compiled too."""
    inductor_cache()
    if isinstance(model, Andrea):
        keep_outside_the_graph(model)
        if model.loss_chunk_fn is softmax_chunk:
            model.loss_chunk_fn = torch.compile(softmax_chunk, dynamic=False, mode=MODE)
    # Static shapes: each window length (a sequence warm-up's, the run's, evaluation's) gets a
    # graph of its own, the same whatever came before. With dynamo's default the second length
    # a process sees turns the graph dynamic for every later one, so which kernels a step runs
    # would depend on the process's history (a resumed process starts without it). Both
    # resumed bit for bit on a CPU (docs/log.md, 2026-12-04); static makes it hold by design.
    return torch.compile(model, mode=MODE, dynamic=False)


def compile_line(compiling: bool, why: str) -> str:
    """The plan's line: what is compiled, and what that costs before the first step."""
    if not compiling:
        return f"compile: off ({why})"
    return (f"compile: torch.compile ({why}); the first step of each window length compiles "
            f"first, for up to a minute or two on a first run; inductor's cache "
            f"({inductor_cache()}) keeps it for the next")
