"""The ANDREA transformer: a decoder-only, GPT-2-style model (docs/model.md).

Pre-LayerNorm blocks, learned absolute positions, GELU MLP of width 4·d_model, LM head tied to
the token embedding, no biases by default. Attention uses one fused Q|K|V projection, heads as a
reshape/transpose, one causal attention call over all heads, then W_O to mix them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from andrea.config import ModelConfig
from andrea.model.attention import BACKENDS, AttentionBackend

# Rows of the LM head's output the loss holds at a time: about 32M logits (128 MiB in float32),
# so the full [B*T, vocab] matrix (3.3 GB for 16 x 1024 x 50,304) never exists.
LOSS_CHUNK_LOGITS = 1 << 25


def loss_chunk_rows(vocab_size: int, setting: int | str = "auto") -> int | None:
    """Rows per chunk of the loss for train.loss_chunk_rows: auto, about LOSS_CHUNK_LOGITS logits
    a chunk; 0, None: the whole logits at once (the plain form); n: n rows."""
    if setting == "auto":
        return max(1, LOSS_CHUNK_LOGITS // vocab_size)
    return int(setting) or None


@dataclass
class KVCache:
    """Keys and values of the positions seen so far, per layer: [B, n_head, max_len, head_dim]."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    length: int = 0  # positions filled

    @classmethod
    def empty(
        cls, cfg: ModelConfig, batch: int, max_len: int, device: torch.device, dtype: torch.dtype
    ) -> KVCache:
        shape = (batch, cfg.n_head, max_len, cfg.head_dim)
        return cls(
            keys=[torch.empty(shape, device=device, dtype=dtype) for _ in range(cfg.n_layer)],
            values=[torch.empty(shape, device=device, dtype=dtype) for _ in range(cfg.n_layer)],
        )


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: str = "sdpa") -> None:
        super().__init__()
        self.n_head, self.head_dim, self.d_model = cfg.n_head, cfg.head_dim, cfg.d_model
        # One [d_model, 3*d_model] projection; nn.Linear stores it as [3*d_model, d_model].
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=cfg.bias)
        self.out = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)  # W_O
        self.dropout = cfg.dropout
        self.backend = backend

    @property
    def backend(self) -> str:
        """The attention backend's name (model.attention's value, resolved)."""
        return self.attend.name

    @backend.setter
    def backend(self, name: str) -> None:
        # Looked up once here, not by name on every forward.
        if name not in BACKENDS:
            raise ValueError(f"unknown attention backend {name!r}; expected sdpa, math or cuda")
        self.attend: AttentionBackend = BACKENDS[name]

    def per_head_weights(self) -> dict[str, list[torch.Tensor]]:
        """W_Q^h, W_K^h, W_V^h for every head h, each [d_model, head_dim]: views, not copies."""
        w = self.qkv.weight.t()  # [d_model, 3*d_model]: columns q heads | k heads | v heads
        views: dict[str, list[torch.Tensor]] = {}
        for i, name in enumerate(("q", "k", "v")):
            base = i * self.d_model
            views[name] = [
                w[:, base + h * self.head_dim : base + (h + 1) * self.head_dim]
                for h in range(self.n_head)
            ]
        return views

    def split_heads(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, d_model] -> [B, n_head, T, head_dim], a view of x: no copy. SDPA reads the
        strided heads as they are; a backend that wants them row-major copies them itself."""
        b, t, _ = x.shape
        return x.view(b, t, self.n_head, self.head_dim).transpose(1, 2)

    def merge_heads(self, y: torch.Tensor) -> torch.Tensor:
        """[B, n_head, T, head_dim] -> [B, T, n_head * head_dim]: the concatenation of the heads."""
        b, _, t, _ = y.shape
        return y.transpose(1, 2).reshape(b, t, self.d_model)

    def forward(
        self, x: torch.Tensor, cache: KVCache | None = None, layer: int = 0
    ) -> torch.Tensor:
        qkv = self.qkv(x)  # [B, T, 3*d_model]
        q, k, v = qkv.split(self.d_model, dim=2)  # each [B, T, d_model]
        q, k, v = self.split_heads(q), self.split_heads(k), self.split_heads(v)
        if cache is not None:
            start, end = cache.length, cache.length + x.shape[1]
            cache.keys[layer][:, :, start:end] = k
            cache.values[layer][:, :, start:end] = v
            k, v = cache.keys[layer][:, :, :end], cache.values[layer][:, :, :end]
        dropout = self.dropout if self.training else 0.0
        y = self.attend.run(q, k, v, dropout)  # [B, n_head, T, head_dim]
        return self.out(self.merge_heads(y))  # heads mix only here


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.up = nn.Linear(cfg.d_model, 4 * cfg.d_model, bias=cfg.bias)
        self.act = nn.GELU(approximate="tanh" if cfg.activation == "gelu_tanh" else "none")
        self.down = nn.Linear(4 * cfg.d_model, cfg.d_model, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.up(x)))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: str) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg, backend)
        self.ln2 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.mlp = MLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(
        self, x: torch.Tensor, cache: KVCache | None = None, layer: int = 0
    ) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x), cache, layer))
        return x + self.drop(self.mlp(self.ln2(x)))


def _compute_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The dtype autocast would run the LM head's matmul in (the weight's dtype without it)."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return dtype


def softmax_chunk(
    logits: torch.Tensor,  # [rows, vocab] in the matmul's dtype
    targets: torch.Tensor,  # [rows, 1], ignored rows clamped to 0
    valid: torch.Tensor,  # [rows], 1 for a counted row, 0 for an ignored one
    count: torch.Tensor,  # what the gradient is divided by: the loss's counted rows
    wants_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One chunk of ChunkedCrossEntropy between its matmuls: (the chunk's summed negative
    log-likelihood, d loss / d logits in the logits' dtype or None). The softmax runs in float32
    (float64 stays float64). Under fp16, `count` is fp16_grad_divisor's power of two instead
    (ChunkedCrossEntropy divides by the rest after the matmuls). Under a compiled model this runs
    as one compiled graph (its elementwise passes fused), called for every chunk with the same
    shapes."""
    softmax_dtype = torch.promote_types(logits.dtype, torch.float32)
    # One fused, vectorised pass (the cast included): logsumexp, then subtracting and
    # exponentiating in separate passes took about twice as long on a CPU.
    log_probs = torch.log_softmax(logits, dim=1, dtype=softmax_dtype)
    picked = log_probs.gather(1, targets)
    nll = -(picked.squeeze(1) * valid).sum()
    if not wants_grad:
        return nll, None
    # d loss / d logits = (softmax - one_hot(target)) / count, zero on ignored rows.
    scale = (valid / count).unsqueeze(1)
    if torch.compiler.is_compiling():
        # The same arithmetic, pointwise: inductor fuses it with the softmax into one pass that
        # writes only the result. The scatter below made it keep a float32 [rows, vocab] buffer
        # and read it back (docs/log.md, 2026-12-06, the loss's compiled chunk).
        probs = log_probs.exp()
        is_target = torch.arange(logits.shape[1], device=logits.device) == targets
        return nll, (torch.where(is_target, probs - 1, probs) * scale).to(logits.dtype)
    # Eager, in place: each pass over [rows, vocab] is the cost (the form above: 2.3x slower).
    grad_logits = log_probs.exp_()
    grad_logits.scatter_add_(1, targets, -torch.ones_like(picked))
    return nll, grad_logits.mul_(scale).to(logits.dtype)


# fp16's d loss / d logits: rows times the multiplier (fp16_grad_divisor's inverse) at most this,
# and rows x the multiplier x |hidden| at most FP16_PRODUCT (half of fp16's largest, 65,504).
FP16_GRAD_ROWS = 1024
FP16_PRODUCT = 2.0**15


def fp16_grad_divisor(rows: int, hidden: torch.Tensor) -> torch.Tensor:
    """Under fp16, what ChunkedCrossEntropy divides a chunk's d loss / d logits by before its
    cast, in place of the count of rows: a power of two, 2^ceil(log2(rows / FP16_GRAD_ROWS)),
    larger where |hidden| is above 32 (a 0-dim tensor on hidden's device: no host read).

    fp16 ends at 6e-8, and (softmax - one_hot) / count flushes to zero there before the loss
    scale reaches it (GradScaler scales the loss's gradient in backward, after these matmuls):
    at 4,096 rows 74% of the entries did, and a whole model's gradient was 6% off float64 against
    the plain form's 0.05%. Multiplied by about FP16_GRAD_ROWS / rows instead, the gradient is
    the plain form's to fp16's rounding (256 to 16,384 gave the same errors, docs/log.md). A
    chunk's weight-gradient product is at most rows x the multiplier x max |hidden| (every row
    with the same target): held to FP16_PRODUCT, it cannot overflow. The loss scale is not in
    it, so GradScaler could never cure an overflow there: it would halve the scale every step
    until the run stopped."""
    largest = hidden.detach().abs().amax().float().clamp(min=1.0)
    needed = torch.clamp(rows * largest / FP16_PRODUCT, min=rows / FP16_GRAD_ROWS)
    return torch.exp2(torch.ceil(torch.log2(needed)))


# Under a compiled model, the chunks' weight-gradient products (in the compute dtype) are added
# into the float32 sum this many at a time, in one pass (add_in_order): [vocab, d_model] float32
# is read and written once a group, not once a chunk, with the same bits. On an H100 the add a
# chunk took 160 us at 120M's vocabulary, twice its matmul (docs/log.md, 2026-12-06).
WEIGHT_GRAD_GROUP = 4


def add_in_order(total: torch.Tensor, products: list[torch.Tensor]) -> None:
    """total += each of products, one after the other, in total's dtype: the bits of adding
    them one at a time. Compiled (train/compiled.py), one pass over total for them all."""
    for product in products:
        total += product


def add_weight_grad(grad_weight: torch.Tensor, grad_logits: torch.Tensor,
                    h: torch.Tensor) -> None:
    """grad_weight += grad_logits.T @ h, one chunk's share of the tied embedding's gradient,
    summed in grad_weight's dtype (float32 under autocast: the chunks' sum is not rounded to
    bf16 each time)."""
    if grad_weight.dtype == h.dtype:  # no rounded [vocab, d_model] temporary
        grad_weight.addmm_(grad_logits.t(), h)
    else:
        grad_weight += grad_logits.t() @ h


class ChunkedCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of logits = hidden @ weight.T against targets (-1: ignored), computed
    chunk_rows rows at a time, so only one chunk's logits exist at once.

    When gradients are wanted, forward also computes each chunk's share of d loss / d hidden and
    d loss / d weight (the tied embedding) while the chunk's softmax is at hand; backward only
    scales them by the incoming gradient. That costs the same three matmuls as the plain form
    and keeps nothing of size [rows, vocab]. Same numbers as
    F.cross_entropy(F.linear(hidden, weight).float(), targets): the matmuls run in autocast's
    dtype, the softmax in float32 (float64 stays float64). `chunk_fn` is softmax_chunk, or its
    compiled form under a compiled model; with `add_products` (add_in_order compiled), the
    weight gradient's products in the compute dtype are added WEIGHT_GRAD_GROUP at a time, in
    chunk order, so with the bits of one at a time.
    """

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        hidden: torch.Tensor,  # [N, d_model]
        weight: torch.Tensor,  # [vocab, d_model]
        targets: torch.Tensor,  # [N]
        chunk_rows: int,
        chunk_fn: Callable[..., tuple[torch.Tensor, torch.Tensor | None]] = softmax_chunk,
        add_products: Callable[[torch.Tensor, list[torch.Tensor]], None] | None = None,
    ) -> torch.Tensor:
        compute = _compute_dtype(hidden.device, weight.dtype)
        softmax_dtype = torch.promote_types(compute, torch.float32)
        w = weight.to(compute)
        valid = (targets != -1).to(softmax_dtype)
        safe_targets = targets.clamp(min=0).unsqueeze(1)
        count = valid.sum()
        # What the gradient is divided by before its cast; under fp16 the rest after the matmuls.
        divisor = count
        if compute == torch.float16:
            divisor = fp16_grad_divisor(min(chunk_rows, hidden.shape[0]), hidden)
        total = torch.zeros((), dtype=softmax_dtype, device=hidden.device)
        wants_grad = any(ctx.needs_input_grad[:2])
        if wants_grad:
            grad_hidden = torch.empty_like(hidden)
            grad_weight = torch.zeros(weight.shape, dtype=softmax_dtype, device=weight.device)
        # (a group of 1: each chunk's through add_weight_grad, as without add_products)
        grouped = add_products is not None and softmax_dtype != compute and WEIGHT_GRAD_GROUP > 1
        pending: list[torch.Tensor] = []  # the group's products not yet added
        for start in range(0, hidden.shape[0], chunk_rows):
            rows = slice(start, start + chunk_rows)
            h = hidden[rows].to(compute)
            nll, grad_logits = chunk_fn(F.linear(h, w), safe_targets[rows], valid[rows],
                                        divisor, wants_grad)
            total += nll
            if grad_logits is not None:
                grad_hidden[rows] = (grad_logits @ w).to(hidden.dtype)
                if not grouped:
                    add_weight_grad(grad_weight, grad_logits, h)
                    continue
                pending.append(grad_logits.t() @ h)
                if len(pending) == WEIGHT_GRAD_GROUP:
                    add_products(grad_weight, pending)
                    pending = []
        if len(pending) > 1:
            add_products(grad_weight, pending)
        elif pending:  # one alone: as add_weight_grad adds it, no compiled graph for it
            grad_weight += pending[0]
        if wants_grad:
            if divisor is not count:  # (hidden is float32 under autocast: rest keeps)
                rest = divisor / count
                grad_hidden.mul_(rest)
                grad_weight.mul_(rest)
            ctx.save_for_backward(grad_hidden, grad_weight.to(weight.dtype))
        return total / count

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad_loss: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, None, None, None, None]:
        grad_hidden, grad_weight = ctx.saved_tensors
        return grad_hidden * grad_loss, grad_weight * grad_loss, None, None, None, None


class Andrea(nn.Module):
    def __init__(self, cfg: ModelConfig, attention_backend: str = "sdpa") -> None:
        super().__init__()
        assert cfg.d_model == cfg.n_head * cfg.head_dim, "validate the config first"
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg, attention_backend) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.tok_emb.weight  # tied
        # Rows per chunk of the loss; None computes the full logits first (the plain form).
        self.loss_chunk_rows: int | None = loss_chunk_rows(cfg.vocab_size)
        # What each chunk of the loss runs between its matmuls (compiled with the model).
        self.loss_chunk_fn: Callable[..., tuple[torch.Tensor, torch.Tensor | None]] = (
            softmax_chunk)
        # What adds the chunks' weight-gradient products a group at a time (add_in_order,
        # compiled with the model); None: each chunk's added as it comes.
        self.loss_add_products: Callable[[torch.Tensor, list[torch.Tensor]], None] | None = None
        # Recompute each block in backward (train.activation_checkpointing: blocks).
        self.checkpoint_blocks = False
        self.reset_parameters()

    @property
    def attention_backend(self) -> str:
        return self.blocks[0].attn.backend if len(self.blocks) else "sdpa"

    def set_attention_backend(self, backend: str) -> None:
        for block in self.blocks:
            block.attn.backend = backend

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """GPT-2 init: N(0, 0.02); residual output projections scaled by 1/sqrt(2*n_layer)."""
        std = self.cfg.init_std
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=std)
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        # Each block adds two residual branches; keep the stream's variance from growing with depth.
        for block in self.blocks:
            for proj in (block.attn.out, block.mlp.down):
                nn.init.normal_(proj.weight, mean=0.0, std=std / math.sqrt(2 * self.cfg.n_layer))

    @torch.no_grad()
    def zero_output_projections(self) -> None:
        """train.zero_init_output: every residual branch starts at zero, so each block begins as
        the identity and the first steps train the embeddings through an exact shortcut."""
        for block in self.blocks:
            for proj in (block.attn.out, block.mlp.down):
                nn.init.zeros_(proj.weight)
                if proj.bias is not None:
                    nn.init.zeros_(proj.bias)

    def embed(self, idx: torch.Tensor, start: int) -> torch.Tensor:
        """Token plus position embeddings of idx [B, T] at positions start.. -> [B, T, d_model].
        A compiled model runs it outside its graph (train/compiled.py, OUTSIDE_THE_GRAPH)."""
        pos = torch.arange(start, start + idx.shape[1], device=idx.device)
        return self.drop(self.tok_emb(idx) + self.pos_emb(pos))

    def chunked_loss(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of the LM head over hidden [N, d_model] against targets [N], a
        chunk of rows at a time (ChunkedCrossEntropy). A compiled model runs it outside its graph
        and its chunks through a compiled loss_chunk_fn and loss_add_products
        (train/compiled.py)."""
        weight = self.lm_head.weight
        if not torch.is_grad_enabled():  # validation: no gradients to compute beside the loss
            hidden, weight = hidden.detach(), weight.detach()
        return ChunkedCrossEntropy.apply(hidden, weight, targets,
                                         self.loss_chunk_rows, self.loss_chunk_fn,
                                         self.loss_add_products)

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        cache: KVCache | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """idx [B, T] token ids -> (logits [B, T, vocab], None), or with targets (None, mean
        cross-entropy), computed in chunks of rows so the logits are never all in memory.

        With a cache, idx holds only the new positions; they follow the cache's `length` ones.
        """
        b, t = idx.shape
        start = cache.length if cache is not None else 0
        if start + t > self.cfg.block_size:
            raise ValueError(
                f"sequence of {start + t} positions exceeds block_size {self.cfg.block_size}"
            )
        x = self.embed(idx, start)  # [B, T, d_model]
        recompute = self.checkpoint_blocks and self.training and torch.is_grad_enabled()
        for layer, block in enumerate(self.blocks):
            if recompute:
                x = checkpoint(block, x, None, layer, use_reentrant=False)
            else:
                x = block(x, cache, layer)
        if cache is not None:
            cache.length += t
        x = self.ln_f(x)
        if targets is None:
            return self.lm_head(x), None  # [B, T, vocab]
        if self.loss_chunk_rows is None:
            logits = self.lm_head(x)
            loss = F.cross_entropy(
                logits.float().view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1
            )
            return None, loss
        return None, self.chunked_loss(x.reshape(-1, x.size(-1)), targets.reshape(-1))

    def num_params(self) -> int:
        """Unique parameters (the tied LM head counted once)."""
        return sum(p.numel() for p in self.parameters())
