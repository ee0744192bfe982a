"""Only here to build the optional CUDA extension (``TIERKV_BUILD_CUDA=1 pip install -e .``).

A plain install never needs nvcc or a CUDA build of torch: everything else is in pyproject.toml.
"""

import os

from setuptools import setup

ext_modules = []
cmdclass = {}
if os.environ.get("TIERKV_BUILD_CUDA") == "1":
    from torch.utils.cpp_extension import BuildExtension, CUDAExtension

    ext_modules = [CUDAExtension("tierkv._cuda_ext", ["cuda_ext/gather_scatter.cu"])]
    cmdclass = {"build_ext": BuildExtension}

setup(ext_modules=ext_modules, cmdclass=cmdclass)
