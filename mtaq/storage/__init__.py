"""The only file-system code of mtaq: segment files, the log, group commit (and, later, checkpoints)."""
