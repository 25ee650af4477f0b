"""Stage 3, train: one run from config to checkpoints.

loop (the recipe: set-up, then per step batch, forward/backward, clip, step, log, eval,
checkpoint), device (device and precision choice), optim (AdamW groups), schedule (learning
rate), memory (the automatic micro-batch), checkpoint (safetensors checkpoints and exact
resume), rundir (a run folder's layout), distributed (torchrun set-up), flops (the MFU meter),
signals (Ctrl-C and SIGTERM), metrics (metrics.jsonl), tensorboard.

May import: andrea.model, andrea.data, andrea.cuda and the helpers. Not the verbs or the CLI.
"""
