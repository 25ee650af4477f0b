"""Stage 3, train: one run from config to checkpoints. Its modules by concern:

- the run: loop (the recipe: set-up, then per step batch, forward/backward, clip, step, log,
  eval, checkpoint), setup (run folder, data, model, optimizer; rank 0's start files and
  plan lines), session (what a process holds while it trains), signals (Ctrl-C and
  SIGTERM), runlock (one writer per run folder), rundata (a run's data when its folder is not
  here);
- one step's numbers: device (device and precision), scaling (fp16's loss scaling), optim and
  muon (the optimizers), schedule (the learning rate), batch (micro-batch and
  accumulation steps), memory (the estimate the automatic micro-batch fits),
  spike (the loss-spike guard), validation (the val loss), flops (MFU);
- checkpoints: training_state (what a checkpoint holds of a session as one object,
  TrainingState, with every rank's generator states), checkpoint (its files' tensors, their
  size), checkpoint_room (room on disk for them), rundir (the run folder and checkpoint format,
  no torch), resume;
- several processes: parallel (one process, ddp or fsdp), torchrun (its environment, the
  ranks), restarts (torchrun's restarts, a lost rank), process_group, collectives, sharding
  (FSDP2);
- reporting: metrics (metrics.jsonl and its sinks, tokens/s), progress (the bar).

docs/architecture.md maps them. May import: andrea.model, andrea.data, andrea.cuda and the
helpers. Not the verbs or the CLI.
"""
