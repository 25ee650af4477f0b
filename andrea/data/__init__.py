"""Stage 1, data: text in, token shards out, batches to the trainer.

corpus (the embedded Shakespeare), inputs (which files an input names), readers (the formats:
txt, JSONL, Parquet, CSV, Arrow; compressed or not), tokenizer (gpt2, bpe, byte), shards (the
shard and manifest format), prepare (text to shards, resumable), loader (deterministic batches
per (seed, step); a data dir is a mixture of one source).

May import: andrea.config, andrea.errors, andrea.fileio, andrea.resources. Nothing above.
"""
