"""Downstream tasks for `andrea eval --task KIND FILE`: multiple choice and last-word accuracy.

Every task is scored completion-style, as llm.c scores HellaSwag: the context's tokens, then a
continuation's tokens (each encoded on its own), and the model's loss over the continuation's
tokens only, given everything before them.

- hellaswag: HellaSwag's own jsonl, one example a line: {"ctx": str, "endings": [str, ...],
  "label": int}. The continuation of ending i is " " + ending i. acc: the ending with the
  smallest summed loss is the label; acc_norm: the one with the smallest mean loss per token.
- choice: any multiple-choice jsonl, {"context": str, "choices": [str, ...], "label": int},
  scored as hellaswag.
- lambada: {"text": str} a line (OpenAI's lambada_test.jsonl); the continuation is the last
  word (" " + everything after the last space). acc: greedy decoding gives exactly its tokens
  (the argmax at every position of the word, given the true ones before it); loss: the word's
  summed nats, averaged over examples.
- arc: ARC-Easy's (and ARC-Challenge's) records, {"question": {"stem": str}, "choices":
  {"text": [str, ...], "label": ["A", ...]}, "answerKey": "B"}; also as AI2 ships them (the
  choices inside the question, a list of {"text", "label"}) and as Hugging Face does (the
  question a plain string). Labels are letters or "1".."4"; the answer is the choice whose
  label is answerKey. The context is "Question: <stem>\nAnswer:", each choice its
  continuation; scored as hellaswag.

A kind is one entry of TASKS: how to read a record (its Example, or why it is none) and how to
score the examples (the result's figures).

A continuation is appended with a space unless the context is empty or ends in whitespace, or
the continuation starts with it. An empty context starts from end-of-text. A sequence longer
than block_size + 1 tokens loses its context from the left (counted, reported); one whose
continuation alone does not fit is skipped. A record that is not the named format or whose
label is out of range is skipped, counted and reported per reason; a file with no example
that can be scored is an error.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from andrea.data.tokenizer import Tokenizer
from andrea.errors import UserError, counted

# logits [B, T, vocab] of token ids [B, T]: an andrea model or any other (e.g. transformers').
LogitsFn = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class Example:
    context: str
    continuations: list[str]  # the choices; lambada: the last word alone
    label: int  # lambada: 0
    line: int  # where in the file


@dataclass
class TaskFile:
    kind: str
    path: Path
    examples: list[Example]
    skipped: dict[str, list[int]] = field(default_factory=dict)  # reason -> line numbers

    def notes(self) -> list[str]:
        """One line per reason a record was skipped."""
        return [
            f"{self.path}: {len(lines)} record{'s' if len(lines) > 1 else ''} skipped, {reason} "
            f"(line {lines[0]}{', ...' if len(lines) > 1 else ''})"
            for reason, lines in self.skipped.items()
        ]


def _label(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():  # HF datasets: "3"
        return int(value)
    return None


def _read_choice(ctx_key: str, choices_key: str) -> Callable[[dict[str, Any]], Example | str]:
    """The reader of a multiple-choice record {ctx_key: str, choices_key: [str, ...],
    "label": int} (an int-like string counts: Hugging Face datasets write "3")."""

    def read(record: dict[str, Any]) -> Example | str:
        context, choices = record.get(ctx_key), record.get(choices_key)
        if not isinstance(context, str) or not _choice_texts(choices):
            return NOT_FORMAT
        label = _label(record.get("label"))
        if label is None:
            return ("no integer label ({kind} needs one: a test split without labels cannot be "
                    "scored)")
        if not 0 <= label < len(choices):
            return "label out of range"
        return Example(context, choices, label, 0)

    return read


def _choice_texts(choices: Any) -> bool:
    """Whether `choices` can be a record's choices: two or more non-blank strings."""
    return (isinstance(choices, list) and len(choices) >= 2
            and all(isinstance(c, str) and c.strip() for c in choices))


def _read_last_word(record: dict[str, Any]) -> Example | str:
    text = record.get("text")
    if not isinstance(text, str) or not text.strip():
        return NOT_FORMAT
    text = text.rstrip()
    cut = text.rfind(" ")
    if cut <= 0:
        return "no context before the last word"
    return Example(text[:cut], [text[cut:]], 0, 0)


def _read_arc(record: dict[str, Any]) -> Example | str:
    """An ARC record: the question's stem, and the choice whose label is answerKey."""
    question = record.get("question")
    stem = question.get("stem") if isinstance(question, dict) else question
    choices = record.get("choices")
    if choices is None and isinstance(question, dict):  # AI2's files: a list in the question
        listed = question.get("choices")
        if isinstance(listed, list) and all(isinstance(c, dict) for c in listed):
            choices = {"text": [c.get("text") for c in listed],
                       "label": [c.get("label") for c in listed]}
    texts = choices.get("text") if isinstance(choices, dict) else None
    labels = choices.get("label") if isinstance(choices, dict) else None
    if (not isinstance(stem, str) or not _choice_texts(texts) or not isinstance(labels, list)
            or len(labels) != len(texts)):
        return NOT_FORMAT
    answer = record.get("answerKey")
    if not isinstance(answer, str) or not answer.strip():
        return "no answerKey ({kind} needs one: a test split without answers cannot be scored)"
    labels = [str(label).strip() for label in labels]
    if answer.strip() not in labels:
        return "answerKey is none of the choices' labels"
    return Example(f"Question: {stem.strip()}\nAnswer:", texts, labels.index(answer.strip()), 0)


# What a reader returns for a record that is not its kind's format.
NOT_FORMAT = "not {a} {kind} record {format}"


def _score_choice(kept: list[tuple[Example, list[Scored]]]) -> dict[str, float]:
    """acc: the choice with the smallest summed loss is the label; acc_norm: the one with the
    smallest mean loss per token."""
    acc = float(np.mean([int(np.argmin([c.total for c in s])) == ex.label for ex, s in kept]))
    norm = float(np.mean([int(np.argmin([c.mean for c in s])) == ex.label for ex, s in kept]))
    return {"acc": acc, "acc_norm": norm}


def _score_last_word(kept: list[tuple[Example, list[Scored]]]) -> dict[str, float]:
    """acc: greedy decoding gives the word; loss: its summed nats, averaged over examples."""
    acc = float(np.mean([s[0].greedy for _, s in kept]))
    loss = float(np.mean([s[0].total for _, s in kept]))
    return {"acc": acc, "loss": loss}


@dataclass(frozen=True)
class TaskKind:
    """One kind of task file: the record it reads (`format`, quoted by the errors), how
    (`read`: the record's Example, its line left 0, or why it is none; a reason may name
    {kind}), and how its scored examples become the result's figures (`score`: TaskResult's
    acc and acc_norm or loss)."""

    format: str
    read: Callable[[dict[str, Any]], Example | str]
    score: Callable[[list[tuple[Example, list[Scored]]]], dict[str, float]]


# Every task kind `andrea eval --task` knows; a new kind is one entry (see the module doc).
TASKS: dict[str, TaskKind] = {
    "hellaswag": TaskKind('{"ctx": str, "endings": [str, ...], "label": int}',
                          _read_choice("ctx", "endings"), _score_choice),
    "choice": TaskKind('{"context": str, "choices": [str, ...], "label": int}',
                       _read_choice("context", "choices"), _score_choice),
    "lambada": TaskKind('{"text": str ending in the word to predict}', _read_last_word,
                        _score_last_word),
    "arc": TaskKind('{"question": {"stem": str}, "choices": {"text": [str, ...], "label": '
                    '["A", ...]}, "answerKey": "A"}', _read_arc, _score_choice),
}


def _parse(kind: str, record: Any, line: int) -> Example | str:
    """The example of one record, or why it cannot be one."""
    task_kind = TASKS[kind]
    parsed = task_kind.read(record) if isinstance(record, dict) else NOT_FORMAT
    if isinstance(parsed, str):
        a = "an" if kind[0] in "aeiou" else "a"
        return parsed.format(a=a, kind=kind, format=task_kind.format)
    parsed.line = line
    return parsed


def read_task(kind: str, path: str | Path, limit: int | None = None) -> TaskFile:
    """The examples of a task file (at most `limit`); see the module doc for the formats."""
    if kind not in TASKS:
        raise UserError(f"--task {kind}: not one of {', '.join(TASKS)}")
    path = Path(path)
    try:
        # utf-8-sig: a byte-order mark (Windows editors write one) is no part of line 1's JSON.
        lines = path.read_text(encoding="utf-8-sig").splitlines()
    except FileNotFoundError:
        raise UserError(f"{path}: no such task file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"{path}: cannot read it as UTF-8 text ({exc})") from None
    task = TaskFile(kind, path, [])
    for number, text in enumerate(lines, 1):
        if not text.strip():
            continue
        if limit is not None and len(task.examples) >= limit:
            break
        try:
            loaded = json.loads(text)
            # A \\ud800 escape is valid JSON but no Unicode text: no tokenizer takes it.
            json.dumps(loaded, ensure_ascii=False).encode("utf-8")
            parsed = _parse(kind, loaded, number)
        except UnicodeEncodeError:  # a ValueError too: caught first
            parsed = "not Unicode text (a lone surrogate)"
        except ValueError:
            parsed = "not JSON"
        if isinstance(parsed, str):
            task.skipped.setdefault(parsed, []).append(number)
        else:
            task.examples.append(parsed)
    if not task.examples:
        if not task.skipped:
            raise UserError(f"{path}: empty, no {kind} examples; expected one JSON object a "
                            f"line, {TASKS[kind].format}")
        reasons = "; ".join(f"{len(v)} {k} (first at line {v[0]})"
                            for k, v in task.skipped.items())
        raise UserError(f"{path}: no {kind} example can be scored: {reasons}")
    return task


def continuation_text(context: str, continuation: str) -> str:
    """The continuation as appended to the context: with a space between them unless one of
    them supplies the whitespace or the context is empty."""
    if not context or context[-1].isspace() or continuation[:1].isspace():
        return continuation
    return " " + continuation


@dataclass
class Scored:
    """One continuation's per-token nats (float64) and whether greedy decoding gives it."""

    nats: np.ndarray
    greedy: bool

    @property
    def total(self) -> float:
        return float(self.nats.sum())

    @property
    def mean(self) -> float:
        return float(self.nats.mean())


def encode_pairs(
    tok: Tokenizer, examples: list[Example], block_size: int
) -> tuple[list[list[tuple[list[int], int]]], int, list[int]]:
    """Per example, per continuation: (token ids, how many of them are the continuation), cut
    from the left to block_size + 1 tokens. Also how many examples lost context, and the line
    numbers of examples whose continuation alone does not fit (left out)."""
    out, truncated, too_long = [], 0, []
    for ex in examples:
        context = tok.encode(ex.context) if ex.context else [tok.eot_id]
        pairs, cut = [], False
        for cont_text in ex.continuations:
            cont = tok.encode(continuation_text(ex.context, cont_text))
            ids = context + cont
            if len(ids) > block_size + 1:
                ids, cut = ids[-(block_size + 1):], True
            pairs.append((ids, len(cont)))
        if any(n >= len(ids) for ids, n in pairs):
            too_long.append(ex.line)
            pairs = []
        truncated += cut and bool(pairs)
        out.append(pairs)
    return out, truncated, too_long


@torch.no_grad()
def score_sequences(
    logits_fn: LogitsFn, sequences: list[tuple[list[int], int]], *, batch_size: int,
    device: torch.device, progress: bool = False,
) -> list[Scored]:
    """Each (ids, n) scored over its last n tokens given the ones before; batched, padded on
    the right (causal attention: padding never reaches the positions scored). The log-softmax
    of the scored rows is taken in float64."""
    out: list[Scored] = []
    bar = tqdm(total=len(sequences), unit="seq", disable=not progress, dynamic_ncols=True,
               file=sys.stderr)
    for first in range(0, len(sequences), batch_size):
        group = sequences[first : first + batch_size]
        width = max(len(ids) for ids, _ in group) - 1
        x = torch.zeros(len(group), width, dtype=torch.int64)
        for row, (ids, _) in enumerate(group):
            x[row, : len(ids) - 1] = torch.tensor(ids[:-1])
        logits = logits_fn(x.to(device))
        for row, (ids, n) in enumerate(group):
            rows = logits[row, len(ids) - 1 - n : len(ids) - 1].double()
            target = torch.tensor(ids[-n:], device=rows.device)
            nats = -torch.log_softmax(rows, dim=-1).gather(1, target[:, None])[:, 0]
            greedy = bool((rows.argmax(dim=-1) == target).all())
            out.append(Scored(nats.cpu().numpy(), greedy))
        bar.update(len(group))
    bar.close()
    return out


@dataclass
class TaskResult:
    task: str
    file: str
    examples: int  # scored
    acc: float
    acc_norm: float | None = None  # multiple choice: by mean loss per token
    loss: float | None = None  # lambada: the last word's nats, averaged over examples
    truncated: int = 0  # examples whose context lost tokens on the left to fit block_size
    skipped: int = 0  # records not scored (bad records, continuations longer than the block)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def line(self) -> str:
        score = f"acc {self.acc:.4f}"
        if self.acc_norm is not None:
            score += f", acc_norm {self.acc_norm:.4f}"
        if self.loss is not None:
            score += f", loss {self.loss:.4f} (perplexity {math.exp(min(self.loss, 700)):.2f})"
        extra = "".join([
            f", {self.truncated} truncated from the left to fit the block" if self.truncated
            else "",
            f", {self.skipped} skipped" if self.skipped else "",
        ])
        return f"{self.task} {self.file}: {score} ({counted(self.examples, 'example')}{extra})"


def run_task(
    task: TaskFile, logits_fn: LogitsFn, tok: Tokenizer, *, block_size: int, batch_size: int,
    device: torch.device, progress: bool = False,
) -> tuple[TaskResult, list[list[Scored]]]:
    """Score every example of `task`; the result and each example's scored continuations."""
    encoded, truncated, too_long = encode_pairs(tok, task.examples, block_size)
    if too_long:
        task.skipped[f"continuation longer than the block of {block_size} tokens"] = too_long
    flat = [pair for pairs in encoded for pair in pairs]
    if not flat:
        raise UserError(f"{task.path}: no {task.kind} example fits the model's block of "
                        f"{block_size} tokens")
    scored_flat = iter(score_sequences(logits_fn, flat, batch_size=batch_size, device=device,
                                       progress=progress))
    scored = [[next(scored_flat) for _ in pairs] for pairs in encoded]
    kept = [(ex, s) for ex, s in zip(task.examples, scored, strict=True) if s]
    skipped = sum(len(v) for v in task.skipped.values())
    figures = TASKS[task.kind].score(kept)
    result = TaskResult(task.kind, str(task.path), len(kept), truncated=truncated,
                        skipped=skipped, **figures)
    return result, scored
