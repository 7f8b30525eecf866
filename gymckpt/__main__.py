"""``python -m gymckpt``: the same as the ``gymckpt`` command."""

from gymckpt.cli import main

main()
