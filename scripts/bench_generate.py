"""Generation speed with and without the key/value cache (random weights; not a test).

    python scripts/bench_generate.py [--models andrea-12m andrea-120m] [--new-tokens 32]

For each model and prompt length, greedy-decodes --new-tokens tokens and reports the time to the
first new token (the prefill, or the first full forward without the cache) and the decode rate
after it: (new_tokens - 1) / time from the first to the last new token; best of --repeats. The
first line names the CPU the figures are of.
Prompt lengths are 16 and 512; a model whose block is too short for 512 + new tokens
(ANDREA-12M: 256) uses the longest prompt that fits, block_size - new_tokens, and says so.
"""

from __future__ import annotations

import argparse
import time

import torch

from andrea.config import load_config
from andrea.generate import generate
from andrea.model.transformer import Andrea
from andrea.resources import cpu_name


def run_once(model: Andrea, prompt: list[int], new_tokens: int, use_cache: bool):
    t0 = time.perf_counter()
    stamps = []
    for _ in generate(model, prompt, new_tokens, temperature=0, use_cache=use_cache,
                      stop_at_eot=False):
        stamps.append(time.perf_counter())
    first = stamps[0] - t0
    rate = (len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 else float("nan")
    return first, rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["andrea-12m", "andrea-120m"])
    parser.add_argument("--prompts", nargs="+", type=int, default=[16, 512])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    args = parser.parse_args()
    dtype = torch.float32 if args.dtype == "fp32" else torch.bfloat16
    print(f"{cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
          f"{args.dtype}, greedy, {args.new_tokens} new tokens, batch 1")
    print(f"{'model':<12} {'prompt':>7} {'cache':>6} {'first token s':>14} {'decode tok/s':>13}")
    for name in args.models:
        cfg = load_config(name, ["model.attention=sdpa"])
        torch.manual_seed(0)
        model = Andrea(cfg.model).to(dtype).eval()
        for asked in args.prompts:
            length = min(asked, cfg.model.block_size - args.new_tokens)
            note = f" (asked {asked}; block {cfg.model.block_size})" if length != asked else ""
            prompt = torch.randint(0, cfg.model.vocab_size, (length,)).tolist()
            for use_cache in (True, False):
                run_once(model, prompt, 3, use_cache)  # warm-up: oneDNN builds per shape
                # Best of --repeats: the machine is shared, the best run is the least disturbed.
                runs = [run_once(model, prompt, args.new_tokens, use_cache)
                        for _ in range(args.repeats)]
                first, rate = min(r[0] for r in runs), max(r[1] for r in runs)
                print(f"{name:<12} {length:>7} {'yes' if use_cache else 'no':>6} "
                      f"{first:>14.3f} {rate:>13.1f}{note}", flush=True)


if __name__ == "__main__":
    main()
