#!/usr/bin/env bash
# Compile cuda_ext/gather_scatter.cu to an object file on a machine without a GPU, to catch compile errors
# before a (scarce) GPU session: nvcc and the CUDA headers come from PyPI wheels (about 300 MB, cached in
# .cuda-toolkit/, git-ignored); torch's own headers come from .venv. It does not link or run anything.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh test 2> >(grep -v "is ignored: it is neither" >&2)
tk=.cuda-toolkit
if [ ! -x "$tk/nvidia/cu13/bin/nvcc" ]; then
  .venv/bin/pip install -q --target "$tk" "nvidia-cuda-nvcc==13.*" "nvidia-cuda-runtime==13.*" "nvidia-cuda-cccl==13.*" \
    2> >(grep -v "is ignored: it is neither" >&2)
fi
cu="$tk/nvidia/cu13"
torch_inc=$(.venv/bin/python -c "import torch, os; print(os.path.join(os.path.dirname(torch.__file__), 'include'))")
py_inc=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['include'])")
# A CPU build of torch lacks one generated CUDA header; an empty stand-in is enough to compile.
mkdir -p "$tk/stub/c10/cuda/impl"
[ -f "$torch_inc/c10/cuda/impl/cuda_cmake_macros.h" ] || printf '#pragma once\n' > "$tk/stub/c10/cuda/impl/cuda_cmake_macros.h"
t0=$(date +%s)
"$cu/bin/nvcc" -c cuda_ext/gather_scatter.cu -o "$tk/gather_scatter.o" -std=c++20 -arch=sm_90 \
  --expt-relaxed-constexpr -Xcompiler -fPIC -DTORCH_EXTENSION_NAME=_cuda_ext -DTORCH_API_INCLUDE_EXTENSION_H \
  -I"$tk/stub" -I"$torch_inc" -I"$torch_inc/torch/csrc/api/include" -I"$py_inc" -I"$cu/include"
echo "cuda_ext compiles (sm_90, nvcc $("$cu/bin/nvcc" --version | grep -o 'release [0-9.]*'), torch headers $(.venv/bin/python -c 'import torch; print(torch.__version__)')) in $(( $(date +%s) - t0 )) s"
