"""Checkpoints: the manager (save, publish, find, verify), the training state (save,
resume), the legacy per-rank format, and export."""
