"""Run bookkeeping: the skeleton every training command shares, its Ray session and clean-up, run-level checkpoints, tracking (metrics, TensorBoard, W&B, curves) and failures told in one line."""
