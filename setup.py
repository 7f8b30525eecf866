"""The optional C accelerator of the records codec (gymckpt/store/_exact.c); everything else is in pyproject.toml.

Built at install where a C compiler works; where none does, the install goes on without it
and the codec uses its pure-Python walks (the same answers, slower). ``GYMCKPT_PURE_PYTHON=1``
makes a built accelerator unused at run time.
"""

from __future__ import annotations

import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ACCELERATOR = Extension(
    "gymckpt.store._exact",
    sources=["gymckpt/store/_exact.c"],
    optional=True,
    # IEEE double arithmetic as written (no fused multiply-add): the short float path relies on it
    extra_compile_args=["-O2", "-ffp-contract=off"] if sys.platform != "win32" else [],
)


class OptionalBuildExt(build_ext):
    """``build_ext`` that warns instead of failing when the accelerator cannot be compiled."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:
            self._skipped(exc)

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as exc:
            self._skipped(exc, ext.name)

    def _skipped(self, exc: BaseException, name: str = "the C accelerator") -> None:
        sys.stderr.write(f"warning: {name} was not built ({exc}); gymckpt uses its pure-Python codec walks\n")


setup(ext_modules=[ACCELERATOR], cmdclass={"build_ext": OptionalBuildExt})
