"""EAGLE-3 draft training: data, loop (DeepSpeed ZeRO or DDP), evaluation, checkpoints, export."""
