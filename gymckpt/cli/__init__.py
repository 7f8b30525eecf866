"""The ``gymckpt`` command: verify and inspect checkpoints offline, serve, run the demo, collect.

One module per command group; what they share is in the private modules:

- :mod:`gymckpt.cli._errors`: the one place for failure (a typed error or a usage mistake →
  one line on stderr → an exit code);
- :mod:`gymckpt.cli._output`: the consoles, plain lines, table cells of data, JSON;
- :mod:`gymckpt.cli._options`: storage options, ``--log-level``, ``--keep-alive``;
- :mod:`gymckpt.cli.verify`, :mod:`~gymckpt.cli.inspect`, :mod:`~gymckpt.cli.serve`
  (``serve`` and ``stack up``), :mod:`~gymckpt.cli.demo`, :mod:`~gymckpt.cli.collect`.

Exit codes: 0 clean, 1 damage found (errors), 2 usage error, bad setting or unreachable
storage. Errors are one line on stderr, never a traceback; text from data (paths, URLs,
details) is never read as rich markup and reaches the terminal only escaped
(:func:`~gymckpt.store.printable.printable`). ``--json`` output is written by the store's own
document encoder; under ``--json`` an exit-2 error is also written on stdout as
``{"error": {"code": ..., "detail": ...}}``.
"""

from __future__ import annotations

from gymckpt.cli._group import main

__all__ = ["main"]
