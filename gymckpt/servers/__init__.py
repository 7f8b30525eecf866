"""gymckpt.servers (not built yet)."""
