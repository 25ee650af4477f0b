"""The "cuda" attention as a torch.library.custom_op inside torch.compile, on the CPU through the
kernel emulator: no graph break, and the compiled model gives the eager result (fp32).

Inductor generates and compiles C++ for the compiled model: 30 s of CPU on a cold cache, as on
CI. A process started with the session (tests/background.py) compiles the same model into
inductor's on-disk cache first, and the test runs after all others; its own compile then loads
that code, as a user's second run does. Where that process has not run (or its cache missed),
the test compiles it all itself.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import background
import pytest
import torch
from test_cuda_backend import assert_close

from andrea.config import load_config
from andrea.cuda import attention as ca
from andrea.model.transformer import Andrea, softmax_chunk
from andrea.train.compiled import compile_model, keep_outside_the_graph

pytestmark = pytest.mark.skipif(
    shutil.which("g++") is None, reason="the kernel emulator and inductor's CPU code need g++"
)


def tiny_model() -> tuple[Andrea, torch.Tensor]:
    """One layer of 2 heads of 32 on 16 positions, and a batch: the tests' model, and the one the
    warm-up compiles (the same graph, so the same cache entries)."""
    cfg = load_config("andrea-tiny", ["model.n_layer=1", "model.n_head=2", "model.head_dim=32",
                                      "model.block_size=16"]).model
    torch.manual_seed(0)
    model = Andrea(cfg, attention_backend="cuda")
    x = torch.randint(cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    return model, x


def compile_the_tiny_model() -> None:
    """The warm-up process's work: one compiled step of tiny_model on the emulator."""
    emu = ca.EmulatorLauncher()
    ca.default_launcher = lambda device: emu
    model, x = tiny_model()
    compile_model(model)(x, x)[1].backward()


def warm_inductors_cache() -> subprocess.CompletedProcess:
    background.result("emulator")
    # a process of its own: it inherits this thread's nice
    code = "import test_cuda_compile as t; t.compile_the_tiny_model()"
    return background.run_process([sys.executable, "-c", code], cwd=Path(__file__).parent)


if shutil.which("g++"):
    background.declare("inductor-tiny-model", warm_inductors_cache, late=True,
                       wanted_by=["test_cuda_compile.py::test_compiled_model_gives_the_eager_result"])


@pytest.fixture
def tiny_cuda_model(monkeypatch):
    background.result("emulator")
    emu = ca.EmulatorLauncher()
    monkeypatch.setattr(ca, "default_launcher", lambda device: emu)
    return tiny_model()


def test_op_matches_the_float64_reference_through_autograd(tiny_cuda_model):
    from andrea.model.attention import math_attention

    q, k, v = (torch.randn(1, 2, 9, 32, generator=torch.Generator().manual_seed(s))
               .requires_grad_() for s in range(3))
    out = ca.cuda_attention(q, k, v)
    assert out.grad_fn is not None
    out.sum().backward()
    qr, kr, vr = (x.detach().double().requires_grad_() for x in (q, k, v))
    math_attention(qr, kr, vr).sum().backward()
    assert_close("o", out.detach(), math_attention(qr, kr, vr).detach(), 1e-5)
    for name, got, want in (("dq", q, qr), ("dk", k, kr), ("dv", v, vr)):
        assert_close(name, got.grad, want.grad, 1e-5)


def test_a_training_step_leaves_only_the_embeddings_and_the_loss_out(tiny_cuda_model):
    """The model's one graph runs from the embeddings' output to the final norm. The embeddings
    stay out on purpose (Andrea.embed: inductor's embedding backward adds with atomics, so a
    compiled step was not repeatable bit for bit, and a resume did not repeat the run), and so
    does the loss (Andrea.chunked_loss: its loop over chunks, unrolled, took minutes to
    compile): compile_model keeps them out (compiled.OUTSIDE_THE_GRAPH)."""
    model, x = tiny_cuda_model
    keep_outside_the_graph(model)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(x, x)
    reasons = explained.break_reasons
    assert all("torch.compiler.disable" in r.reason for r in reasons), reasons
    calls = [frame.line for r in reasons for frame in r.user_stack]
    assert any("chunked_loss(" in call for call in calls), calls
    assert explained.graph_count == 1
    ops = [str(n.target) for g in explained.graphs for n in g.graph.nodes]
    assert any("andrea.causal_attention" in op for op in ops), ops  # in the graph, not around it
    assert not any("embedding" in op.lower() for op in ops), ops


def test_compiled_model_gives_the_eager_result(tiny_cuda_model):
    from torch._dynamo.utils import counters

    warm_up = background.result("inductor-tiny-model")
    assert warm_up.returncode == 0, warm_up.stdout[-4000:]  # the same compile, in its process
    model, x = tiny_cuda_model
    _, eager_loss = model(x, x)
    eager_loss.backward()
    eager_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    torch._dynamo.reset()
    counters.clear()
    _, loss = compile_model(model)(x, x)
    loss.backward()  # the backward op runs inside the compiled backward graph
    assert model.loss_chunk_fn is not softmax_chunk  # the loss's chunks ran compiled too
    # the embeddings and the loss, kept out on purpose
    assert sum(counters["graph_break"].values()) == 2, dict(counters["graph_break"])
    assert abs(loss.item() - eager_loss.item()) <= 1e-5 * max(1.0, abs(eager_loss.item()))
    for name, p in model.named_parameters():
        assert_close(name, p.grad, eager_grads[name].double(), 1e-5)
