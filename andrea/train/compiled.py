"""train.compile: whether a run compiles its model, and how (torch.compile, inductor).

`auto` compiles on one CUDA process: there the compiled step brings andrea nearest a
hand-written compiled loop (on an H200, ANDREA-120M at 0.58 of it eager and 0.84 compiled:
docs/log.md, 2026-12-04, the fastest step on one GPU; 0.80 on an H100, 2026-12-06). Not on a
CPU, where a compile costs minutes of a short run and gains little, and not yet under torchrun,
where the compiled step has not been measured or resumed on GPUs (`true` asks for it anyway).
The embeddings and the loss stay out of the compiled graph (OUTSIDE_THE_GRAPH); the loss's
chunks run through a compiled softmax_chunk, and their weight-gradient products are added into
the float32 sum a group at a time (add_in_order, compiled: one pass a group, the same bits).
Inductor keeps what it compiled under andrea's cache folder, so a second run of the same model
compiles in seconds.

train.compile_mode is torch.compile's mode. reduce-overhead also replays each step as CUDA
graphs, for a model whose step is too short to keep the GPU busy between kernel launches (the
12M preset sets it: 8.4 s of training become 5.9 s on an H100, with the same loss at every
step, docs/log.md, 2026-12-06); only on one CUDA process, where it was measured.
"""

from __future__ import annotations

import os
import tempfile

import torch
import torch.nn as nn

from andrea.model.transformer import Andrea, add_in_order, softmax_chunk
from andrea.resources import cache_dir
from andrea.train.torchrun import DistInfo

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


def choose_compile(setting: bool | str, mode: str, device: torch.device,
                   dist: DistInfo) -> tuple[str | None, str]:
    """(torch.compile's mode, None for no compile; why) for train.compile = true, false or auto
    and train.compile_mode. CUDA graphs (reduce-overhead) replay one process's steps on a GPU:
    elsewhere the mode is the default."""
    if setting is False:
        return None, "train.compile: false"
    why = "train.compile: true"
    if setting == "auto":
        if device.type != "cuda":
            return None, f"auto: not on {device.type}"
        if dist.enabled:
            return None, "auto: not under torchrun yet; train.compile=true asks for it"
        why = "auto: one CUDA process"
    if mode == "reduce-overhead" and (device.type != "cuda" or dist.enabled):
        return "default", (f"{why}; train.compile_mode reduce-overhead: CUDA graphs are for one "
                           f"process on a GPU, so the default mode")
    return mode, why


def inductor_cache() -> tuple[str, str | None]:
    """(where inductor keeps what it compiled, why not in andrea's folder or None):
    $TORCHINDUCTOR_CACHE_DIR as the user set it, else andrea's cache folder's `inductor`, set
    here, so that it outlives /tmp and a second run reuses it; torch's own where that folder
    cannot be written (a read-only home, as on some clusters: inductor's traceback otherwise),
    said in the plan's compile line. (torch sets the variable to its /tmp default when inductor
    is imported, which andrea's imports do: that value counts as unset.)"""
    current = os.environ.get(INDUCTOR_CACHE_VARIABLE)
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        torch_default = default_cache_dir()
    except ImportError:  # another torch's layout: take only an unset variable
        torch_default = None
    unwritable = None
    if not current or current == torch_default:
        try:
            folder = cache_dir() / "inductor"
            folder.mkdir(parents=True, exist_ok=True)
            if not os.access(folder, os.W_OK):
                raise PermissionError(f"{folder}: not writable")
        except (OSError, RuntimeError) as exc:  # RuntimeError: Path.home() of no home
            unwritable = str(exc)
            os.environ[INDUCTOR_CACHE_VARIABLE] = torch_default or os.path.join(
                tempfile.gettempdir(), "torchinductor")
        else:
            os.environ[INDUCTOR_CACHE_VARIABLE] = str(folder)
    return os.environ[INDUCTOR_CACHE_VARIABLE], unwritable


def keep_outside_the_graph(model: Andrea) -> None:
    """Make a compiled `model` call OUTSIDE_THE_GRAPH's methods eagerly (a graph break each);
    uncompiled, they run as before."""
    for name in OUTSIDE_THE_GRAPH:
        if name not in vars(model):  # once: the instance's own attribute is the wrapped method
            setattr(model, name, torch.compiler.disable(getattr(model, name)))


def compile_model(model: nn.Module, mode: str = "default") -> nn.Module:
    """The compiled module the steps call, in torch.compile's `mode`; an Andrea's loss chunks
    run compiled too, and its weight gradient's products are added a group at a time."""
    inductor_cache()
    if isinstance(model, Andrea):
        keep_outside_the_graph(model)
        if model.loss_chunk_fn is softmax_chunk:
            model.loss_chunk_fn = torch.compile(softmax_chunk, dynamic=False, mode=mode)
        if model.loss_add_products is None:
            # The default mode whatever the model's: it changes its input in place, which CUDA
            # graphs would skip with a message; one launch a group leaves nothing to replay away.
            model.loss_add_products = torch.compile(add_in_order, dynamic=False)
    # Static shapes: each window length (a sequence warm-up's, the run's, evaluation's) gets a
    # graph of its own, the same whatever came before. With dynamo's default the second length
    # a process sees turns the graph dynamic for every later one, so which kernels a step runs
    # would depend on the process's history (a resumed process starts without it). Both
    # resumed bit for bit on a CPU (docs/log.md, 2026-12-04); static makes it hold by design.
    return torch.compile(model, mode=mode, dynamic=False)


def compile_line(mode: str | None, why: str) -> str:
    """The plan's line: what is compiled, and what that costs before the first step."""
    if mode is None:
        return f"compile: off ({why})"
    graphs = ", its steps replayed as CUDA graphs" if mode == "reduce-overhead" else ""
    cache, unwritable = inductor_cache()
    if unwritable is not None:
        cache += (f", torch's own: andrea's could not be written ({unwritable}); set "
                  f"ANDREA_CACHE_DIR to a writable folder to keep it past /tmp")
    return (f"compile: torch.compile{graphs} ({why}); the first step of each window length "
            f"compiles first, for up to a minute or two on a first run; inductor's cache "
            f"({cache}) keeps it for the next")
