"""Builds moed's native CPU kernels (native/cpu/*.c) with the system C compiler at install time.

Everything else is in pyproject.toml. The library is plain C loaded with ctypes
(moed/kernels/native_cpu.py), not a Python extension module; it is optional: without a compiler
the install still succeeds and the numba kernels run instead (`moed bench kernels` says which).
"""

import glob
import os

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class OptionalBuildExt(build_ext):
    """A failed compile is a warning, never a failed install (the numba kernels are the fallback)."""

    def run(self):
        try:
            super().run()
        except Exception as exc:  # no compiler, unsupported platform
            self.warn(f"moed: the native CPU kernels were not built ({exc}); the numba kernels will be used")

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as exc:
            self.warn(f"moed: the native CPU kernels were not built ({exc}); the numba kernels will be used")

    def get_export_symbols(self, ext):
        return []  # a plain C library: no PyInit_ function to export


here = os.path.dirname(os.path.abspath(__file__))
sources = sorted(os.path.relpath(p, here) for p in glob.glob(os.path.join(here, "native", "cpu", "*.c")))
setup(
    ext_modules=[
        Extension(
            "moed._cpu_kernels",
            sources=sources,
            include_dirs=["native/cpu"],
            depends=sorted(glob.glob(os.path.join("native", "cpu", "*.h"))),
            extra_compile_args=["-O3", "-std=c11", "-pthread", "-fvisibility=default", "-Wall"],
            extra_link_args=["-pthread", "-lm"],
            optional=True,
        )
    ],
    cmdclass={"build_ext": OptionalBuildExt},
)
