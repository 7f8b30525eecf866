"""gymckpt.workers (not built yet)."""
