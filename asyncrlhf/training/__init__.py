"""Training: batch assembly, objectives (composing `asyncrlhf.algorithms`), the trainer, the DeepSpeed
engine, supervised loops for the offline stages, and the checkpoint layout (`checkpoint`, its one owner)."""
