"""The speed reference for ANDREA-120M on one GPU: a plain nanoGPT-style training loop.

    python scripts/reference_gpt.py [--steps 16] [--json OUT.json]

Deliberately independent of andrea (no andrea import) and fixed in this file, so it cannot
drift weaker than what a user would write by hand: GPT-2 small's shape (12 layers x 768, 12
heads of 64, T 1024, vocab 50,304) without biases, LayerNorm without bias, exact GELU MLP of
4 x 768, learned positions, the LM head tied to the token embedding; 16 x 1024 tokens a
micro-batch, 4 micro-batches a step; bf16 autocast; F.scaled_dot_product_attention(is_causal=
True); torch.optim.AdamW(fused=True) at lr 6e-4, weight decay 0.1 on matrices; clip at 1.0; the
whole model under torch.compile (default mode); the logits to F.cross_entropy in float32; random
tokens. Prints the first (compiling) step's seconds and the median tokens/s of steps 5-16, the
figures scripts/gpu_speed.py sets andrea beside.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

N_LAYER, N_HEAD, D_MODEL, BLOCK, VOCAB = 12, 12, 768, 1024, 50304
MICRO_BATCH, ACCUM = 16, 4
LR, WEIGHT_DECAY, CLIP = 6e-4, 0.1, 1.0
# --dry-run (no GPU): the same code on a CPU at a toy size, uncompiled, to check it runs.
DRY_RUN = dict(N_LAYER=2, N_HEAD=2, D_MODEL=64, BLOCK=64, VOCAB=512, MICRO_BATCH=2, ACCUM=2)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(D_MODEL, bias=False)
        self.qkv = nn.Linear(D_MODEL, 3 * D_MODEL, bias=False)
        self.proj = nn.Linear(D_MODEL, D_MODEL, bias=False)
        self.ln2 = nn.LayerNorm(D_MODEL, bias=False)
        self.up = nn.Linear(D_MODEL, 4 * D_MODEL, bias=False)
        self.down = nn.Linear(4 * D_MODEL, D_MODEL, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, N_HEAD, c // N_HEAD).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, D_MODEL)
        self.wpe = nn.Embedding(BLOCK, D_MODEL)
        self.blocks = nn.ModuleList(Block() for _ in range(N_LAYER))
        self.ln_f = nn.LayerNorm(D_MODEL, bias=False)
        self.head = nn.Linear(D_MODEL, VOCAB, bias=False)
        self.head.weight = self.wte.weight
        for name, p in self.named_parameters():
            if p.dim() == 2:
                residual = name.endswith(("proj.weight", "down.weight"))
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * N_LAYER) if residual else 0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.float().view(-1, VOCAB), targets.view(-1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--json", help="write the figures here too")
    parser.add_argument("--dry-run", action="store_true", help="a toy size on the CPU")
    args = parser.parse_args()
    device = torch.device("cpu" if args.dry_run else "cuda")
    if args.dry_run:
        globals().update(DRY_RUN)
        args.steps = 5
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = True
    model = GPT().to(device)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WEIGHT_DECAY},
                             {"params": rest, "weight_decay": 0.0}],
                            lr=LR, betas=(0.9, 0.95), fused=True)
    compiled = model if args.dry_run else torch.compile(model)
    tokens_per_step = MICRO_BATCH * BLOCK * ACCUM
    seconds = []
    for _ in range(args.steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(ACCUM):
            x = torch.randint(0, VOCAB, (MICRO_BATCH, BLOCK), device=device)
            y = torch.randint(0, VOCAB, (MICRO_BATCH, BLOCK), device=device)
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = compiled(x, y)
            (loss / ACCUM).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
        seconds.append(time.perf_counter() - t0)
    timed = seconds[4:] or seconds
    result = {
        "what": "reference", "tokens_per_step": tokens_per_step,
        "first_step_s": round(seconds[0], 2),
        "median_tokens_per_s": round(statistics.median(tokens_per_step / s for s in timed), 1),
        "steps": len(seconds), "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None,
    }
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
