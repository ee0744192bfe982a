// Batched gather / scatter of KV blocks between per-layer caches [H, T, D] and the canonical block
// layout [N, L, 2, B, H, D], in one kernel launch each. Built only with TIERKV_BUILD_CUDA=1 on a CUDA
// machine; tierkv/kernels.py falls back to torch indexing otherwise and has the same interface.
// NOT YET VERIFIED ON A GPU: scripts/gpu_check.sh compares it with the fallback bit for bit.
#include <torch/extension.h>
#include <cuda_runtime.h>
#include <c10/cuda/CUDAStream.h>

namespace {

// One thread block per (block n, layer l, k/v); threads stride over B*H*D elements, copied as 16-bit or
// 32-bit words (dtype-agnostic: bytes are moved, not values).
template <typename word_t>
__global__ void gather_kernel(const word_t* const* srcs, word_t* out, const int64_t* starts, int64_t N, int64_t L,
                              int64_t B, int64_t H, int64_t D, int64_t T) {
  const int64_t n = blockIdx.x, l = blockIdx.y, kv = blockIdx.z;
  const word_t* src = srcs[l * 2 + kv];  // [H, T, D]
  word_t* dst = out + (((n * L + l) * 2 + kv) * B) * H * D;  // [B, H, D]
  const int64_t t0 = starts[n];
  for (int64_t i = threadIdx.x; i < B * H * D; i += blockDim.x) {
    const int64_t b = i / (H * D), h = (i / D) % H, d = i % D;
    dst[i] = src[(h * T + t0 + b) * D + d];
  }
}

template <typename word_t>
__global__ void scatter_kernel(word_t* const* dsts, const word_t* blocks, const int64_t* starts, int64_t N,
                               int64_t L, int64_t B, int64_t H, int64_t D, int64_t T) {
  const int64_t n = blockIdx.x, l = blockIdx.y, kv = blockIdx.z;
  word_t* dst = dsts[l * 2 + kv];
  const word_t* src = blocks + (((n * L + l) * 2 + kv) * B) * H * D;
  const int64_t t0 = starts[n];
  for (int64_t i = threadIdx.x; i < B * H * D; i += blockDim.x) {
    const int64_t b = i / (H * D), h = (i / D) % H, d = i % D;
    dst[(h * T + t0 + b) * D + d] = src[i];
  }
}

torch::Tensor pointer_table(const std::vector<torch::Tensor>& keys, const std::vector<torch::Tensor>& values) {
  std::vector<int64_t> ptrs;
  for (size_t l = 0; l < keys.size(); ++l) {
    TORCH_CHECK(keys[l].is_contiguous() && values[l].is_contiguous(), "caches must be contiguous");
    ptrs.push_back(reinterpret_cast<int64_t>(keys[l].data_ptr()));
    ptrs.push_back(reinterpret_cast<int64_t>(values[l].data_ptr()));
  }
  return torch::tensor(ptrs, torch::dtype(torch::kInt64)).to(keys[0].device(), /*non_blocking=*/true);
}

}  // namespace

void gather(std::vector<torch::Tensor> keys, std::vector<torch::Tensor> values, torch::Tensor starts,
            int64_t block_tokens, torch::Tensor out) {
  const int64_t L = keys.size(), H = keys[0].size(0), T = keys[0].size(1), D = keys[0].size(2);
  const int64_t N = starts.numel(), elem = keys[0].element_size();
  TORCH_CHECK(elem == 2 || elem == 4, "gather: 16- or 32-bit KV only");
  auto table = pointer_table(keys, values);
  dim3 grid(N, L, 2);
  auto stream = c10::cuda::getCurrentCUDAStream();
  if (elem == 2) {
    gather_kernel<uint16_t><<<grid, 256, 0, stream>>>(reinterpret_cast<const uint16_t* const*>(table.data_ptr()),
        reinterpret_cast<uint16_t*>(out.data_ptr()), starts.data_ptr<int64_t>(), N, L, block_tokens, H, D, T);
  } else {
    gather_kernel<uint32_t><<<grid, 256, 0, stream>>>(reinterpret_cast<const uint32_t* const*>(table.data_ptr()),
        reinterpret_cast<uint32_t*>(out.data_ptr()), starts.data_ptr<int64_t>(), N, L, block_tokens, H, D, T);
  }
}

void scatter(torch::Tensor blocks, std::vector<torch::Tensor> keys, std::vector<torch::Tensor> values,
             torch::Tensor starts) {
  const int64_t N = blocks.size(0), L = blocks.size(1), B = blocks.size(3), H = blocks.size(4), D = blocks.size(5);
  const int64_t T = keys[0].size(1), elem = blocks.element_size();
  TORCH_CHECK(elem == 2 || elem == 4, "scatter: 16- or 32-bit KV only");
  auto table = pointer_table(keys, values);
  dim3 grid(N, L, 2);
  auto stream = c10::cuda::getCurrentCUDAStream();
  if (elem == 2) {
    scatter_kernel<uint16_t><<<grid, 256, 0, stream>>>(reinterpret_cast<uint16_t* const*>(table.data_ptr()),
        reinterpret_cast<const uint16_t*>(blocks.data_ptr()), starts.data_ptr<int64_t>(), N, L, B, H, D, T);
  } else {
    scatter_kernel<uint32_t><<<grid, 256, 0, stream>>>(reinterpret_cast<uint32_t* const*>(table.data_ptr()),
        reinterpret_cast<const uint32_t*>(blocks.data_ptr()), starts.data_ptr<int64_t>(), N, L, B, H, D, T);
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gather", &gather, "gather KV blocks from per-layer caches into the canonical layout");
  m.def("scatter", &scatter, "scatter canonical KV blocks into per-layer caches");
}
