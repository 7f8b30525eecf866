"""gymckpt's tests: a package, so every test module is imported by its dotted name (``tests.…``)."""
