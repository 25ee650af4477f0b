"""The model's attention, exactly as docs/model.md describes it, checked in float64."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import load_script

from andrea.config import load_config
from andrea.model.attention import math_attention, sdpa_attention
from andrea.model.transformer import Andrea, KVCache


def tiny_model(attention: str = "sdpa", **overrides) -> Andrea:
    sets = [f"model.{k}={v}" for k, v in overrides.items()]
    torch.manual_seed(0)
    return Andrea(load_config("andrea-tiny", sets).model, attention_backend=attention).double()


def test_fused_projection_equals_per_head_matmuls():
    model = tiny_model()
    attn = model.blocks[0].attn
    x = torch.randn(2, 5, attn.d_model, dtype=torch.float64)
    q, k, v = attn.qkv(x).split(attn.d_model, dim=2)
    heads = attn.per_head_weights()
    for name, fused in (("q", q), ("k", k), ("v", v)):
        per_head = [x @ w for w in heads[name]]  # n_head separate [B, T, head_dim] matmuls
        torch.testing.assert_close(torch.cat(per_head, dim=-1), fused, rtol=1e-12, atol=1e-12)


def test_per_head_weights_are_views_not_copies():
    attn = tiny_model().blocks[0].attn
    storage = attn.qkv.weight.untyped_storage().data_ptr()
    heads = attn.per_head_weights()
    assert len(heads["q"]) == attn.n_head
    for name in "qkv":
        for w in heads[name]:
            assert w.shape == (attn.d_model, attn.head_dim)
            assert w.untyped_storage().data_ptr() == storage
    with torch.no_grad():  # writing through a view changes the fused weight
        heads["k"][1][3, 2] = 123.0
    assert attn.qkv.weight[attn.d_model + attn.head_dim + 2, 3] == 123.0


def test_split_heads_is_a_view_per_head_and_merge_inverts_it():
    attn = tiny_model().blocks[0].attn
    x = torch.randn(3, 7, attn.d_model, dtype=torch.float64)
    heads = attn.split_heads(x)
    assert heads.shape == (3, attn.n_head, 7, attn.head_dim)
    assert heads.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()  # no copy
    for b in range(3):
        for h in range(attn.n_head):
            torch.testing.assert_close(
                heads[b, h], x[b, :, h * attn.head_dim : (h + 1) * attn.head_dim], rtol=0, atol=0
            )
    assert torch.equal(attn.merge_heads(heads), x)


def test_sdpa_attention_copies_no_activations():
    """On a GPU every copy is a launch and a pass over memory. The heads go to SDPA as strided
    views of the QKV projection; its output keeps the queries' layout, so merging the heads
    back is a view too. (Copies to make the heads row-major were 3 a layer, and the merge a
    fourth.)"""
    counts = load_script("step_op_counts")
    attn = tiny_model().blocks[0].attn
    x = torch.randn(2, 9, attn.d_model, dtype=torch.float64)
    with counts.OpCounter() as counter:
        y = attn(x)
    copies = {op: n for op, n in counter.ops.items() if op in ("clone", "contiguous", "copy_")}
    assert copies == {}, copies
    q, k, v = attn.qkv(x).split(attn.d_model, dim=2)
    expected = math_attention(attn.split_heads(q), attn.split_heads(k), attn.split_heads(v))
    torch.testing.assert_close(y, attn.out(attn.merge_heads(expected)), rtol=1e-12, atol=1e-12)


def test_math_reference_equals_the_formula_and_sdpa():
    torch.manual_seed(1)
    q, k, v = (torch.randn(2, 3, 9, 8, dtype=torch.float64) for _ in range(3))
    expected = torch.empty_like(q)
    for i in range(9):  # row by row, straight from the definition
        scores = (q[:, :, i : i + 1] @ k[:, :, : i + 1].transpose(-2, -1)) / math.sqrt(8)
        expected[:, :, i : i + 1] = torch.softmax(scores, dim=-1) @ v[:, :, : i + 1]
    torch.testing.assert_close(math_attention(q, k, v), expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(sdpa_attention(q, k, v), expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("backend", ["sdpa", "math"])
def test_causality(backend):
    model = tiny_model(attention=backend)
    idx = torch.randint(0, 256, (2, 20))
    logits, _ = model(idx)
    for t in (0, 7, 18):
        changed = idx.clone()
        changed[:, t + 1] = (changed[:, t + 1] + 1) % 256
        new_logits, _ = model(changed)
        torch.testing.assert_close(new_logits[:, : t + 1], logits[:, : t + 1], rtol=0, atol=0)
        assert not torch.allclose(new_logits[:, t + 1], logits[:, t + 1])


def test_backends_agree_on_the_whole_model():
    model = tiny_model()
    idx = torch.randint(0, 256, (2, 33))
    targets = torch.randint(0, 256, (2, 33))
    model.set_attention_backend("sdpa")
    logits_sdpa, _ = model(idx)
    model.set_attention_backend("math")
    logits_math, _ = model(idx)
    _, loss_math = model(idx, targets)
    torch.testing.assert_close(logits_sdpa, logits_math, rtol=1e-10, atol=1e-10)
    # The loss is the mean cross-entropy over every position.
    manual = -torch.log_softmax(logits_math, -1).gather(-1, targets[..., None]).mean()
    torch.testing.assert_close(loss_math.double(), manual, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("attention", ["sdpa", "math"])
def test_kv_cache_matches_the_full_forward(attention):
    """A prefill, then one token at a time; and a prefill, then a chunk of several tokens at
    once (queries 5..8 over keys 0..8: the causal mask aligned to the bottom right, which a
    token at a time never tests), then two more."""
    model = tiny_model(attention).eval()
    idx = torch.randint(0, 256, (2, 12))
    full, _ = model(idx)
    cache = KVCache.empty(model.cfg, 2, model.cfg.block_size, torch.device("cpu"), torch.float64)
    prefill, _ = model(idx[:, :5], cache=cache)
    steps = [model(idx[:, t : t + 1], cache=cache)[0] for t in range(5, 12)]
    torch.testing.assert_close(torch.cat([prefill, *steps], 1), full, rtol=1e-10, atol=1e-10)
    cache = KVCache.empty(model.cfg, 2, model.cfg.block_size, torch.device("cpu"), torch.float64)
    prefill, _ = model(idx[:, :5], cache=cache)
    chunk, _ = model(idx[:, 5:9], cache=cache)
    torch.testing.assert_close(torch.cat([prefill, chunk], 1), full[:, :9], rtol=1e-10,
                               atol=1e-10)
    pair, _ = model(idx[:, 9:11], cache=cache)  # two queries: the first must not see the second
    torch.testing.assert_close(pair, full[:, 9:11], rtol=1e-10, atol=1e-10)


def test_init_follows_gpt2():
    torch.manual_seed(0)
    cfg = load_config("andrea-12m").model
    model = Andrea(cfg)
    assert model.lm_head.weight is model.tok_emb.weight
    std = model.blocks[0].mlp.up.weight.std().item()
    assert abs(std - 0.02) < 0.002
    residual = model.blocks[0].attn.out.weight.std().item()
    assert abs(residual - 0.02 / math.sqrt(2 * cfg.n_layer)) < 0.001


def test_an_attention_backend_is_one_entry_in_its_registry(monkeypatch):
    """A throwaway backend added to model.attention.BACKENDS alone: model.attention allows it
    (validation and the key's listing), it resolves to itself, and a model built with it runs
    it, looked up once when the model is built, not by name on every forward."""
    from andrea.config import key_spec
    from andrea.model import attention

    calls = []

    def counted(q, k, v, dropout_p=0.0):
        calls.append(q.shape)
        return math_attention(q, k, v, dropout_p)

    monkeypatch.setitem(attention.BACKENDS, "counted",
                        attention.AttentionBackend("counted", counted))
    cfg = load_config("andrea-tiny", ["model.attention=counted"]).model
    assert key_spec("model.attention").allowed == "auto, cuda, sdpa, math, counted"
    assert attention.resolve_backend("counted", cfg.head_dim, torch.device("cpu"),
                                     torch.float32) == ("counted", "model.attention")
    model = Andrea(cfg, attention_backend="counted").double()
    monkeypatch.delitem(attention.BACKENDS, "counted")
    model(torch.randint(0, 256, (2, 7)))
    assert calls == [(2, cfg.n_head, 7, cfg.head_dim)] * cfg.n_layer
    assert model.attention_backend == "counted"


def test_a_loaded_checkpoint_is_its_weights_tied_and_leaves_the_callers_generator(tmp_path):
    """trained.load_model draws the model's initial values from a generator of its own (they
    advanced the caller's), then loads every tensor: the checkpoint's values, the LM head the
    embedding's one tensor, the caller's generator untouched."""
    from conftest import make_checkpoint

    from andrea.train.checkpoint import read_model_checkpoint
    from andrea.trained import load_model

    ckpt = make_checkpoint(tmp_path, seed=3)
    stored = read_model_checkpoint(ckpt)[0]
    torch.manual_seed(0)
    before = torch.get_rng_state()
    model, _, _ = load_model(ckpt)
    assert torch.equal(torch.get_rng_state(), before)
    assert model.lm_head.weight is model.tok_emb.weight
    state = model.state_dict()
    assert stored and all(torch.equal(state[k], v) for k, v in stored.items())
    assert model.num_params() == sum(v.numel() for v in stored.values())


def test_a_checkpoint_recording_auto_names_it_as_no_backend_that_ran():
    """A checkpoint records the backend that ran, never `auto` (which picks another): a
    recorded `auto` is refused by trainer_state's check and named by the resume's."""
    from andrea.config.declare import registry
    from andrea.model.attention import recorded_backend_problem

    assert list(registry("trainer_state.attention")) == ["cuda", "sdpa", "math"]
    cpu = torch.device("cpu")
    assert recorded_backend_problem("auto", 64, cpu) == "auto is not a backend of this andrea"
    assert recorded_backend_problem("sdpa", 64, cpu) is None


def test_the_cuda_backend_leaves_attention_dropout_to_sdpa(monkeypatch):
    """andrea's kernels have no dropout: with attention dropout on, the cuda backend runs
    PyTorch's attention instead (and its kernels where dropout is off)."""
    import andrea.cuda.attention
    from andrea.model.attention import cuda_or_sdpa_attention

    monkeypatch.setattr(andrea.cuda.attention, "cuda_attention", lambda q, k, v: "kernels")
    q = k = v = torch.randn(1, 2, 4, 8)
    assert cuda_or_sdpa_attention(q, k, v, 0.0) == "kernels"
    out = cuda_or_sdpa_attention(q, k, v, 0.1)
    assert isinstance(out, torch.Tensor) and out.shape == q.shape
