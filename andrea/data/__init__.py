"""Stage 1, data: text in, token shards out, batches to the trainer.

corpus (the embedded Shakespeare), readers (txt, JSONL, Parquet, Arrow; compressed or not),
tokenizer (gpt2, bpe, byte), shards (the shard and manifest format), prepare (text to shards,
resumable), loader (deterministic batches per (seed, step), mixtures).

May import: andrea.config, andrea.errors, andrea.fileio, andrea.resources. Nothing above.
"""
