"""Builds the native record reader and writer (``native/*.c`` -> ``tierkv._native``), and on request
the optional CUDA extension (``TIERKV_BUILD_CUDA=1 pip install -e . --no-build-isolation``: setup
imports torch).

The native module is optional: where no C compiler is found the install goes on without it and tierkv
uses its Python data path (``tierkv stats`` and the server's start-up line say which one runs). A plain
install never needs nvcc or a CUDA build of torch: everything else is in pyproject.toml.
"""

import os

from setuptools import Extension, setup

ext_modules = [
    Extension(
        "tierkv._native",
        [f"native/{part}.c" for part in ("module", "common", "read", "write", "copy")],
        depends=["native/native.h"],
        extra_compile_args=[
            "-O2",
            "-std=gnu11",
            "-fvisibility=hidden",  # the parts share their symbols with each other, not with other libraries
            "-Wall",
            "-Wextra",
            "-Wno-unused-parameter",
            "-Wno-missing-field-initializers",
        ],
        libraries=["dl", "pthread"],
        optional=os.environ.get("TIERKV_REQUIRE_NATIVE") != "1",
    )
]
cmdclass = {}
if os.environ.get("TIERKV_BUILD_CUDA") == "1":
    from setuptools.command.build_ext import build_ext
    from torch.utils.cpp_extension import BuildExtension, CUDAExtension

    class Build(BuildExtension):
        """torch's build for the CUDA extension only: with ninja it compiles every source with the C++
        compiler, and native/*.c is C (C11 atomics), so the native module takes setuptools' own build."""

        def build_extensions(self) -> None:
            # The native module first: torch's build_extensions patches the compiler for what follows.
            every = self.extensions
            try:
                self.extensions = [e for e in every if e.name == "tierkv._native"]
                build_ext.build_extensions(self)
                self.extensions = [e for e in every if e.name != "tierkv._native"]
                super().build_extensions()
            finally:
                self.extensions = every

    ext_modules.append(CUDAExtension("tierkv._cuda_ext", ["cuda_ext/gather_scatter.cu"]))
    cmdclass = {"build_ext": Build}

setup(ext_modules=ext_modules, cmdclass=cmdclass)
