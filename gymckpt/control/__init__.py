"""gymckpt.control (not built yet)."""
