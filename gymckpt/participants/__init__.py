"""gymckpt.participants (not built yet)."""
