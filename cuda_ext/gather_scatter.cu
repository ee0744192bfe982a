// Batched gather / scatter of KV blocks between per-layer caches [H, T, D] and the canonical block
// layout [N, L, 2, B, H, D], in one kernel launch each. Built with TIERKV_BUILD_CUDA=1 (or compiled at
// import with TIERKV_CUDA_JIT=1); tierkv/kernels.py falls back to torch indexing otherwise and has the
// same interface. NOT YET VERIFIED ON A GPU: scripts/gpu_check.sh compares it with the fallback bit for bit.
#include <torch/extension.h>
#include <cuda_runtime.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>
#include <vector>

namespace {

// One thread block per (block n, layer l, k/v); threads stride over the block's B*H rows of W words (a row
// is one head's head_dim elements, contiguous in both layouts). Bytes are moved, not values: the word is
// the widest of 16, 8, 4 or 2 bytes that divides a row and every pointer's alignment.
template <typename word_t>
__global__ void gather_kernel(const word_t* const* srcs, word_t* out, const int64_t* starts, int64_t L,
                              int64_t B, int64_t H, int64_t W, int64_t T) {
  const int64_t n = blockIdx.x, l = blockIdx.y, kv = blockIdx.z;
  const word_t* src = srcs[l * 2 + kv];                    // [H, T, W]
  word_t* dst = out + (((n * L + l) * 2 + kv) * B) * H * W;  // [B, H, W]
  const int64_t t0 = starts[n];
  for (int64_t i = threadIdx.x; i < B * H * W; i += blockDim.x) {
    const int64_t b = i / (H * W), h = (i / W) % H, w = i % W;
    dst[i] = src[(h * T + t0 + b) * W + w];
  }
}

template <typename word_t>
__global__ void scatter_kernel(word_t* const* dsts, const word_t* blocks, const int64_t* starts, int64_t L,
                               int64_t B, int64_t H, int64_t W, int64_t T) {
  const int64_t n = blockIdx.x, l = blockIdx.y, kv = blockIdx.z;
  word_t* dst = dsts[l * 2 + kv];
  const word_t* src = blocks + (((n * L + l) * 2 + kv) * B) * H * W;
  const int64_t t0 = starts[n];
  for (int64_t i = threadIdx.x; i < B * H * W; i += blockDim.x) {
    const int64_t b = i / (H * W), h = (i / W) % H, w = i % W;
    dst[(h * T + t0 + b) * W + w] = src[i];
  }
}

struct Table {
  torch::Tensor ptrs;  // int64 [2L] on the device: layer l's keys at 2l, values at 2l+1
  int64_t word_nbytes;
};

Table pointer_table(const std::vector<torch::Tensor>& keys, const std::vector<torch::Tensor>& values,
                    const torch::Tensor& blocks, int64_t row_nbytes) {
  std::vector<int64_t> ptrs;
  uint64_t align = reinterpret_cast<uint64_t>(blocks.data_ptr()) | static_cast<uint64_t>(row_nbytes);
  for (size_t l = 0; l < keys.size(); ++l) {
    TORCH_CHECK(keys[l].is_cuda() && values[l].is_cuda(), "caches must be on the GPU");
    TORCH_CHECK(keys[l].is_contiguous() && values[l].is_contiguous(), "caches must be contiguous");
    TORCH_CHECK(keys[l].sizes() == keys[0].sizes() && values[l].sizes() == keys[0].sizes(),
                "every layer's keys and values must have one shape");
    ptrs.push_back(reinterpret_cast<int64_t>(keys[l].data_ptr()));
    ptrs.push_back(reinterpret_cast<int64_t>(values[l].data_ptr()));
    align |= reinterpret_cast<uint64_t>(keys[l].data_ptr()) | reinterpret_cast<uint64_t>(values[l].data_ptr());
  }
  int64_t word = 16;
  while (word > 2 && (align % word) != 0) word /= 2;
  TORCH_CHECK(align % word == 0, "rows of an odd number of bytes are not supported (the torch fallback is)");
  // From pageable memory cudaMemcpyAsync returns once the bytes are staged (the temporary may go), and it
  // does not wait for the compute stream as a blocking copy would.
  auto table = torch::tensor(ptrs, torch::dtype(torch::kInt64)).to(keys[0].device(), /*non_blocking=*/true);
  return {table, word};
}

template <typename word_t>
void launch_gather(const Table& t, torch::Tensor& out, const torch::Tensor& starts, int64_t N, int64_t L,
                   int64_t B, int64_t H, int64_t W, int64_t T, cudaStream_t stream) {
  dim3 grid(N, L, 2);
  gather_kernel<word_t><<<grid, 256, 0, stream>>>(reinterpret_cast<const word_t* const*>(t.ptrs.data_ptr()),
      reinterpret_cast<word_t*>(out.data_ptr()), starts.data_ptr<int64_t>(), L, B, H, W, T);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename word_t>
void launch_scatter(const Table& t, const torch::Tensor& blocks, const torch::Tensor& starts, int64_t N,
                    int64_t L, int64_t B, int64_t H, int64_t W, int64_t T, cudaStream_t stream) {
  dim3 grid(N, L, 2);
  scatter_kernel<word_t><<<grid, 256, 0, stream>>>(reinterpret_cast<word_t* const*>(t.ptrs.data_ptr()),
      reinterpret_cast<const word_t*>(blocks.data_ptr()), starts.data_ptr<int64_t>(), L, B, H, W, T);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Calls f with a value of the word type of that many bytes (16, 8, 4, else 2).
template <typename F>
void with_word(int64_t word_nbytes, F&& f) {
  switch (word_nbytes) {
    case 16: f(uint4{}); break;
    case 8: f(uint2{}); break;
    case 4: f(uint32_t{}); break;
    default: f(uint16_t{}); break;
  }
}

}  // namespace

void gather(std::vector<torch::Tensor> keys, std::vector<torch::Tensor> values, torch::Tensor starts,
            int64_t block_tokens, torch::Tensor out) {
  const at::cuda::OptionalCUDAGuard guard(keys[0].device());
  const int64_t L = keys.size(), H = keys[0].size(0), T = keys[0].size(1), D = keys[0].size(2);
  const int64_t N = starts.numel(), row_nbytes = D * keys[0].element_size();
  TORCH_CHECK(out.is_contiguous() && out.numel() == N * L * 2 * block_tokens * H * D, "gather: bad out");
  TORCH_CHECK(starts.is_cuda() && starts.scalar_type() == torch::kInt64, "gather: starts must be int64 on the GPU");
  if (N == 0) return;
  const Table t = pointer_table(keys, values, out, row_nbytes);
  const int64_t W = row_nbytes / t.word_nbytes;
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  with_word(t.word_nbytes, [&](auto word) {
    launch_gather<decltype(word)>(t, out, starts, N, L, block_tokens, H, W, T, stream);
  });
}

void scatter(torch::Tensor blocks, std::vector<torch::Tensor> keys, std::vector<torch::Tensor> values,
             torch::Tensor starts) {
  const at::cuda::OptionalCUDAGuard guard(blocks.device());
  const int64_t N = blocks.size(0), L = blocks.size(1), B = blocks.size(3), H = blocks.size(4), D = blocks.size(5);
  const int64_t T = keys[0].size(1), row_nbytes = D * blocks.element_size();
  TORCH_CHECK(blocks.is_contiguous(), "scatter: blocks must be contiguous");
  TORCH_CHECK(starts.is_cuda() && starts.scalar_type() == torch::kInt64, "scatter: starts must be int64 on the GPU");
  if (N == 0) return;
  const Table t = pointer_table(keys, values, blocks, row_nbytes);
  const int64_t W = row_nbytes / t.word_nbytes;
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  with_word(t.word_nbytes, [&](auto word) {
    launch_scatter<decltype(word)>(t, blocks, starts, N, L, B, H, W, T, stream);
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gather", &gather, "gather KV blocks from per-layer caches into the canonical layout");
  m.def("scatter", &scatter, "scatter canonical KV blocks into per-layer caches");
}
