// CUDA xla_ext.small_batch_linear: out^T = weight x^T on tensor cores, with the weight as the
// 16-row operand of mma.sync m16n8k16, so that a decode batch of up to 8 tokens fills one
// 8-column tile (the "swap AB" of skinny GEMMs). A CTA owns a tile: 16 outputs (for a gate,
// their 16 gate rows and 16 up rows) and up to 16 tokens; its 16 warps split in_features in
// 32-wide chunks, each with up to four chunks' loads in flight, add their sums in shared memory,
// and the epilogue (the residual, or the SwiGLU) stores the tile. Its time is the weight's
// bytes. (Measured on the H200 against this kernel, bench/linear_bench.py: 4-warp CTAs in
// clusters that split in_features, and one persistent CTA per SM streaming the weight through
// a TMA ring of shared memory, were both slower at every shape; so was a bulk L2 prefetch of
// the tile before the programmatic launch's wait.)
//
// A lane reads 16 contiguous bytes of a weight row and of a token's x (8 elements of k), and a
// chunk's two mma take them as they are: a dot product sums over k in any order, so the k
// order the fragments imply (lane t's k = 2t, 2t + 1, 2t + 8, 2t + 9 of a k16) may stand for
// k = 8t .. 8t + 7 of the weight and of x alike; no shuffle, no staging. x is read by every
// tile, from L1 and L2.
#include <algorithm>
#include <cstdint>
#include <iterator>

#include "kernels/common/cuda_utils.cuh"
#include "kernels/common/sm90.cuh"
#include "kernels/small_batch_linear/small_batch_linear.h"
#include "xla_ext/registry.h"

namespace xla_ext::small_batch_linear {
namespace {

constexpr int kChunk = 32;         // k elements a warp takes per step: two m16n8k16
constexpr int kMaxTokenTiles = 2;  // tokens per tile: 16
constexpr int kOutRows = 16;       // outputs per tile

struct Params {
  const uint16_t* x;
  const uint16_t* weight;
  const uint16_t* residual;  // nullptr: none
  uint16_t* out;
  int num_tokens;
  int in_features;
  int out_features;
};

template <typename T>
__device__ __forceinline__ float Rounded(float v) {
  return cuda::ToFloat(cuda::FromFloat<T>(v));
}

// Elements k .. k + 7 of `row` (zeros from k_size on). kVector: every row is 16-byte aligned
// and k_size a multiple of 8, so the 8 elements are in the row whole or not at all.
template <bool kVector>
__device__ __forceinline__ uint4 LoadK8(const uint16_t* row, int k, int k_size) {
  if constexpr (kVector) {
    if (k >= k_size) return make_uint4(0, 0, 0, 0);
    return __ldg(reinterpret_cast<const uint4*>(row + k));
  } else {
    uint32_t e[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) e[i] = k + i < k_size ? row[k + i] : 0u;
    return make_uint4(e[0] | e[1] << 16, e[2] | e[3] << 16, e[4] | e[5] << 16, e[6] | e[7] << 16);
  }
}

// One 32-wide chunk into the accumulators: a[rg][h] holds tile row rg * 16 + h * 8 + group,
// b[tt] token tt * 8 + group's x, each its 8 elements at k = 8 * quad of the chunk.
template <typename T, int kRowGroups, int kTokenTiles>
__device__ __forceinline__ void MultiplyChunk(const uint4 (&a)[kRowGroups][2],
                                              const uint4 (&b)[kTokenTiles],
                                              float (&acc)[kRowGroups][kTokenTiles][4]) {
#pragma unroll
  for (int rg = 0; rg < kRowGroups; ++rg) {
    const uint32_t low_k[4] = {a[rg][0].x, a[rg][1].x, a[rg][0].y, a[rg][1].y};
    const uint32_t high_k[4] = {a[rg][0].z, a[rg][1].z, a[rg][0].w, a[rg][1].w};
#pragma unroll
    for (int tt = 0; tt < kTokenTiles; ++tt) {
      cuda::sm90::Mma16816<T>(acc[rg][tt], low_k, b[tt].x, b[tt].y, acc[rg][tt]);
      cuda::sm90::Mma16816<T>(acc[rg][tt], high_k, b[tt].z, b[tt].w, acc[rg][tt]);
    }
  }
}

// Adds a warp's accumulators into the tile's sums [kRowGroups * 16][kTokenTiles * 8].
template <int kRowGroups, int kTokenTiles>
__device__ __forceinline__ void AddToSums(const float (&acc)[kRowGroups][kTokenTiles][4],
                                          float* sums, int group, int quad) {
  constexpr int kTokens = 8 * kTokenTiles;
#pragma unroll
  for (int rg = 0; rg < kRowGroups; ++rg) {
#pragma unroll
    for (int tt = 0; tt < kTokenTiles; ++tt) {
      float* at = sums + (rg * 16 + group) * kTokens + tt * 8 + 2 * quad;
      atomicAdd(at, acc[rg][tt][0]);
      atomicAdd(at + 1, acc[rg][tt][1]);
      atomicAdd(at + 8 * kTokens, acc[rg][tt][2]);
      atomicAdd(at + 8 * kTokens + 1, acc[rg][tt][3]);
    }
  }
}

// Output i of the tile (token i / 16, output i % 16) from its sums: the residual added, or
// the gate's SwiGLU.
template <typename T, int kTokenTiles, bool kGate>
__device__ __forceinline__ void StoreOutput(const Params& p, const float* sums, int out_first,
                                            int token_first, int i) {
  constexpr int kTokens = 8 * kTokenTiles;
  const int tile_token = i / kOutRows, tile_row = i % kOutRows;
  const float gate = sums[tile_row * kTokens + tile_token];
  const float up = kGate ? sums[(tile_row + 16) * kTokens + tile_token] : 0.0f;
  const int token = token_first + tile_token, out_row = out_first + tile_row;
  if (token >= p.num_tokens || out_row >= p.out_features) return;
  const int64_t at = static_cast<int64_t>(token) * p.out_features + out_row;
  float value = Rounded<T>(gate);
  if constexpr (kGate) {
    value = Rounded<T>(value / (1.0f + expf(-value))) * Rounded<T>(up);
  } else {
    if (p.residual != nullptr) value += cuda::ToFloat(reinterpret_cast<const T*>(p.residual)[at]);
  }
  reinterpret_cast<T*>(p.out)[at] = cuda::FromFloat<T>(value);
}

// The weight rows of tile row `row` (0..15) of tile `out_first`: its output's row, and for a
// gate the up row too (rows past the last output read the last one's; their outputs are
// dropped).
__device__ __forceinline__ int64_t WeightRow(const Params& p, int out_first, int row, int rg) {
  return min(out_first + row, p.out_features - 1) + static_cast<int64_t>(rg) * p.out_features;
}

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;

template <typename T, int kTokenTiles, bool kGate, bool kVector>
__global__ void __launch_bounds__(kThreads) Kernel(Params p) {
  constexpr int kRowGroups = kGate ? 2 : 1;
  constexpr int kTokens = 8 * kTokenTiles;
  // Chunks whose loads a warp has in flight at once: up to four, within about 64 registers of
  // loads (2 * kRowGroups + kTokenTiles 16-byte loads a chunk).
  constexpr int kUnroll = std::min(4, std::max(1, 16 / (2 * kRowGroups + kTokenTiles)));
  __shared__ float sums[16 * kRowGroups * kTokens];

  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int group = lane / 4, quad = lane % 4;
  const int out_first = blockIdx.x * kOutRows, token_first = blockIdx.y * kTokens;
  const int k_size = p.in_features;
  const uint16_t* weight_rows[kRowGroups][2];
#pragma unroll
  for (int rg = 0; rg < kRowGroups; ++rg) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      weight_rows[rg][h] = p.weight + WeightRow(p, out_first, h * 8 + group, rg) * k_size;
    }
  }
  const uint16_t* x_rows[kTokenTiles];
#pragma unroll
  for (int tt = 0; tt < kTokenTiles; ++tt) {
    x_rows[tt] = p.x + static_cast<int64_t>(min(token_first + tt * 8 + group,
                                                p.num_tokens - 1)) * k_size;
  }
  cuda::sm90::WaitForPrerequisiteGrid();
  cuda::sm90::LaunchDependents();
  for (int i = threadIdx.x; i < 16 * kRowGroups * kTokens; i += kThreads) sums[i] = 0;

  float acc[kRowGroups][kTokenTiles][4] = {};
  const int num_chunks = (k_size + kChunk - 1) / kChunk;
  for (int first = warp; first < num_chunks; first += kWarps * kUnroll) {
    uint4 a[kUnroll][kRowGroups][2];
    uint4 b[kUnroll][kTokenTiles];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      // A chunk past the last starts past k_size: zeros, no load.
      const int k = (first + u * kWarps) * kChunk + quad * 8;
#pragma unroll
      for (int rg = 0; rg < kRowGroups; ++rg) {
        a[u][rg][0] = LoadK8<kVector>(weight_rows[rg][0], k, k_size);
        a[u][rg][1] = LoadK8<kVector>(weight_rows[rg][1], k, k_size);
      }
#pragma unroll
      for (int tt = 0; tt < kTokenTiles; ++tt) b[u][tt] = LoadK8<kVector>(x_rows[tt], k, k_size);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) MultiplyChunk<T>(a[u], b[u], acc);
  }
  __syncthreads();  // the zeros are in place
  AddToSums(acc, sums, group, quad);
  __syncthreads();
  for (int i = threadIdx.x; i < kTokens * kOutRows; i += kThreads) {
    StoreOutput<T, kTokenTiles, kGate>(p, sums, out_first, token_first, i);
  }
}

template <typename T, int kTokenTiles, bool kGate>
void Launch(const Params& p, bool vector, cudaStream_t stream) {
  const dim3 grid(cuda::CeilDiv(p.out_features, kOutRows),
                  cuda::CeilDiv(p.num_tokens, 8 * kTokenTiles));
  if (vector) {
    cuda::LaunchProgrammatic(Kernel<T, kTokenTiles, kGate, true>, grid, dim3(kThreads), 0,
                             stream, p);
  } else {
    cuda::LaunchProgrammatic(Kernel<T, kTokenTiles, kGate, false>, grid, dim3(kThreads), 0,
                             stream, p);
  }
}

template <typename T, bool kGate>
void LaunchForTokens(const Params& p, bool vector, cudaStream_t stream) {
  if (p.num_tokens <= 8) return Launch<T, 1, kGate>(p, vector, stream);
  Launch<T, kMaxTokenTiles, kGate>(p, vector, stream);
}

bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

ffi::Error SmallBatchLinearCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer weight,
                                ffi::AnyBuffer residual, ffi::Result<ffi::AnyBuffer> out,
                                int32_t silu_gate) {
  Shapes s;
  XLA_EXT_RETURN_IF_ERROR(Check(x, weight, residual, *out, silu_gate, s));
  if (s.num_tokens == 0 || s.out_features == 0) return ffi::Error::Success();
  constexpr int64_t kMaxTokens = int64_t{65535} * 8 * kMaxTokenTiles;  // grid.y
  if (s.num_tokens > kMaxTokens) {
    return ArgumentError(kTarget, "x", "at most " + std::to_string(kMaxTokens) + " tokens",
                         "shape " + ShapeString(x.dimensions()));
  }
  const Params p{static_cast<const uint16_t*>(x.untyped_data()),
                 static_cast<const uint16_t*>(weight.untyped_data()),
                 s.residual ? static_cast<const uint16_t*>(residual.untyped_data()) : nullptr,
                 static_cast<uint16_t*>(out->untyped_data()),
                 static_cast<int>(s.num_tokens),
                 static_cast<int>(s.in_features),
                 static_cast<int>(s.out_features)};
  const bool vector = s.in_features % 8 == 0 && Aligned16(p.x) && Aligned16(p.weight);
  const auto launch = [&](auto zero) {
    using T = decltype(zero);
    s.silu_gate ? LaunchForTokens<T, true>(p, vector, stream)
                : LaunchForTokens<T, false>(p, vector, stream);
  };
  if (x.element_type() == ffi::DataType::BF16) {
    launch(__nv_bfloat16{});
  } else {
    launch(__half{});
  }
  return cuda::LastLaunchError(kTarget);
}

XLA_FFI_DEFINE_HANDLER(kSmallBatchLinearCuda, SmallBatchLinearCuda,
                       Bind(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                       {ffi::Traits::kCmdBufferCompatible});

}  // namespace

XLA_EXT_REGISTER_KERNEL(kTarget, "CUDA", kSmallBatchLinearCuda,
                        XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE);
XLA_EXT_REGISTER_CONTRACT(XlaExtContract{
    0, kTarget, static_cast<uint32_t>(std::size(kSupported)), kSupported, nullptr});

}  // namespace xla_ext::small_batch_linear
