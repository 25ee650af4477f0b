"""Parameter accounting: counted from the model on the meta device, checked against the formula."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from andrea.config import ModelConfig
from andrea.errors import UserError
from andrea.model.transformer import Andrea


@dataclass
class ParamCounts:
    token_embedding: int
    position_embedding: int
    w_q: int  # per layer, each of W_Q, W_K, W_V, W_O is d_model x d_model
    w_k: int
    w_v: int
    w_o: int
    attention_bias: int  # per layer (0 without biases)
    attention_per_layer: int
    attention_total: int
    mlp_per_layer: int
    mlp_total: int
    norms_total: int
    total: int
    n_layer: int

    @property
    def attention_share(self) -> float:
        return self.attention_total / self.total

    def as_dict(self) -> dict[str, int | float]:
        out: dict[str, int | float] = dict(self.__dict__)
        out["attention_share"] = self.attention_share
        return out


def closed_form_total(cfg: ModelConfig) -> int:
    """V·d + T·d + n_layer·(4d² + 8d² + 2d) + d, plus the bias terms when biases are on."""
    d = cfg.d_model
    total = cfg.vocab_size * d + cfg.block_size * d + cfg.n_layer * (12 * d * d + 2 * d) + d
    if cfg.bias:
        # qkv 3d + W_O d + MLP 4d + d + two LayerNorm biases 2d per layer; the final norm's d.
        total += cfg.n_layer * 11 * d + d
    return total


def check_stored_shape(
    cfg: ModelConfig,
    shapes: Mapping[str, Sequence[int]],
    origin: str,
    names: tuple[str, str, str] = ("tok_emb.weight", "pos_emb.weight", "blocks."),
    advice: str = "the file is damaged or not one model's, so no model is built from it",
) -> None:
    """Refuse a config that does not describe the stored weights, before a model is built.

    A checkpoint's or an imported config.json's model section is untrusted: one asking for
    10^6 layers would otherwise allocate them before any tensor is compared. shapes: each
    stored tensor's shape by name (from the file's header); names: the token embedding, the
    position embedding and the block prefix as the file spells them (GPT-2: wte, wpe, h.);
    advice: what the message says after the mismatches (why, and what to do).
    """
    tok_name, pos_name, prefix = names
    blocks = {key[len(prefix):].split(".", 1)[0] for key in shapes if key.startswith(prefix)}
    n_blocks = len({b for b in blocks if b.isdigit()})
    tok, pos = list(shapes.get(tok_name, [])), list(shapes.get(pos_name, []))
    wrong = []
    if n_blocks != cfg.n_layer or blocks != {str(i) for i in range(n_blocks)}:
        wrong.append(f"n_layer {cfg.n_layer} (the file holds {n_blocks} blocks)")
    if tok != [cfg.vocab_size, cfg.d_model]:
        wrong.append(f"vocab_size x d_model {cfg.vocab_size} x {cfg.d_model} ({tok_name} is "
                     f"{tok or 'missing'})")
    if pos != [cfg.block_size, cfg.d_model]:
        wrong.append(f"block_size x d_model {cfg.block_size} x {cfg.d_model} ({pos_name} is "
                     f"{pos or 'missing'})")
    if wrong:
        raise UserError(f"{origin}: the config does not describe the stored weights: "
                        f"{'; '.join(wrong)}; {advice}")


def _norm_params(module: torch.nn.Module) -> int:
    """The parameters of the LayerNorms in `module`."""
    return sum(p.numel() for m in module.modules() if isinstance(m, torch.nn.LayerNorm)
               for p in m.parameters())


def count_params(cfg: ModelConfig) -> ParamCounts:
    """Count every group from a model built on the meta device (no memory even for 120M),
    with one block: the blocks are alike, so the others are that one's count again. Building
    all of them, even on meta, took 4 GB and over 5 minutes for model.n_layer 10^6."""
    built = min(cfg.n_layer, 1)
    with torch.device("meta"):
        model = Andrea(dataclasses.replace(cfg, n_layer=built))
    more = cfg.n_layer - built  # blocks counted as copies of blocks[0]
    block = model.blocks[0]
    attn = block.attn
    d = cfg.d_model
    w_q, w_k, w_v = (attn.qkv.weight[i * d : (i + 1) * d].numel() for i in range(3))
    attn_bias = sum(m.bias.numel() for m in (attn.qkv, attn.out) if m.bias is not None)
    attention_per_layer = attn.qkv.weight.numel() + attn.out.weight.numel() + attn_bias
    mlp_per_layer = sum(p.numel() for p in block.mlp.parameters())
    norms = _norm_params(model) + more * _norm_params(block)
    counts = ParamCounts(
        token_embedding=model.tok_emb.weight.numel(),
        position_embedding=model.pos_emb.weight.numel(),
        w_q=w_q,
        w_k=w_k,
        w_v=w_v,
        w_o=attn.out.weight.numel(),
        attention_bias=attn_bias,
        attention_per_layer=attention_per_layer,
        attention_total=attention_per_layer * cfg.n_layer,
        mlp_per_layer=mlp_per_layer,
        mlp_total=mlp_per_layer * cfg.n_layer,
        norms_total=norms,
        total=model.num_params() + more * sum(p.numel() for p in block.parameters()),
        n_layer=cfg.n_layer,
    )
    parts = (
        counts.token_embedding
        + counts.position_embedding
        + counts.attention_total
        + counts.mlp_total
        + counts.norms_total
    )
    expected = closed_form_total(cfg)
    if not (counts.total == parts == expected):
        raise RuntimeError(
            f"parameter count mismatch: model {counts.total:,}, sum of groups {parts:,}, "
            f"closed form {expected:,}; the model and docs/model.md's formula disagree"
        )
    return counts


def format_counts(c: ParamCounts) -> str:
    rows = [
        ("token embedding", c.token_embedding),
        ("position embedding", c.position_embedding),
        ("W_Q per layer", c.w_q),
        ("W_K per layer", c.w_k),
        ("W_V per layer", c.w_v),
        ("W_O per layer", c.w_o),
    ]
    if c.attention_bias:
        rows.append(("attention biases per layer", c.attention_bias))
    rows += [
        ("attention per layer", c.attention_per_layer),
        (f"attention, {c.n_layer} layers", c.attention_total),
        ("MLP per layer", c.mlp_per_layer),
        (f"MLP, {c.n_layer} layers", c.mlp_total),
        ("norms", c.norms_total),
        ("total", c.total),
    ]
    width = max(len(name) for name, _ in rows)
    lines = [f"{name:<{width}}  {value:>13,}" for name, value in rows]
    lines.append(f"{'attention share':<{width}}  {c.attention_share:>13.2%}")
    return "\n".join(lines)
