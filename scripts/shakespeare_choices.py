"""A HellaSwag-format jsonl from the embedded Shakespeare's held-out tail, for scoring a model
trained on that corpus with `andrea eval --task hellaswag` and with lm-evaluation-harness when
the real HellaSwag file cannot be downloaded (docs/evaluation.md).

Each record: `ctx` three lines of a play's last tenth, `endings` the line that follows and three
lines drawn from elsewhere in the last tenths, `label` where the true one is. Fixed by --seed.

    python scripts/shakespeare_choices.py --out shakespeare_hs.jsonl [--n 300] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from andrea.data.corpus import shakespeare


def held_out_lines(fraction: float = 0.1) -> list[list[str]]:
    """Each play's last `fraction` of lines, speech lines only (no blank or ALL-CAPS names)."""
    plays = []
    for _, text in shakespeare():
        lines = [x.strip() for x in text.splitlines()]
        tail = lines[int(len(lines) * (1 - fraction)):]
        plays.append([x for x in tail if len(x) > 20 and not x.isupper()])
    return plays


def make_records(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    plays = [p for p in held_out_lines() if len(p) > 10]
    pool = [x for p in plays for x in p]
    out = []
    while len(out) < n:
        play = rng.choice(plays)
        i = rng.randrange(3, len(play))
        endings = [play[i]] + [x for x in rng.sample(pool, 8) if x != play[i]][:3]
        order = list(range(4))
        rng.shuffle(order)
        out.append({"ctx": " ".join(play[i - 3:i]), "endings": [endings[k] for k in order],
                    "label": order.index(0)})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--n", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    records = make_records(args.n, args.seed)
    args.out.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    print(f"{args.out}: {len(records)} records")


if __name__ == "__main__":
    main()
