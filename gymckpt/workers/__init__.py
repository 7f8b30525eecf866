"""Several uvicorn workers per server: one participant across them (planned; a server with
checkpointing on refuses to start as one of several workers until this exists)."""
