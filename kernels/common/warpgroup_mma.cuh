// Thin wrappers over Hopper's warpgroup MMA (wgmma.mma_async): shared-memory matrix
// descriptors, the fences and waits around the asynchronous MMAs, the register moves between
// warpgroups (setmaxnreg), and m64nNk16 with A from registers or shared memory (f32
// accumulators, f16/bf16 inputs). Each wraps one instruction. wgmma exists only in sm_90a code
// (not in compute_90 PTX, nor on later GPUs): callers guard their use with
// `#if defined(__CUDA_ARCH_FEAT_SM90_ALL)` and launch it only on compute capability 9.x.
//
// Operand layouts (PTX ISA, "Asynchronous Warpgroup Level Matrix Multiply-Accumulate"): warp w
// of the warpgroup holds rows 16 w .. 16 w + 15 of A and D. A's four registers hold, as in
// mma.sync m16n8k16, rows lane / 4 and + 8, columns 2 (lane % 4) + {0, 1} and + 8. D's
// register 4 j + i holds row lane / 4 + 8 (i / 2), column 8 j + 2 (lane % 4) + i % 2.
#ifndef XLA_EXT_KERNELS_COMMON_WARPGROUP_MMA_CUH_
#define XLA_EXT_KERNELS_COMMON_WARPGROUP_MMA_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace xla_ext::cuda::warpgroup {

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// A shared-memory operand in the 128-byte swizzle layout: rows of 128 bytes whose 16-byte
// chunks are permuted by chunk ^= (row % 8) (address bits 4-6 ^= bits 7-9, so the 8-row atoms
// must be 1024-byte aligned). `leading_bytes` and `stride_bytes` are the strides the operand's
// major-ness gives them (a K-major operand: stride_bytes between 8-row groups; an MN-major one:
// leading_bytes between 64-element column blocks, stride_bytes between 8-row groups along K).
__device__ __forceinline__ uint64_t Swizzle128Descriptor(uint32_t address, uint32_t leading_bytes,
                                                         uint32_t stride_bytes) {
  return static_cast<uint64_t>((address & 0x3ffff) >> 4) |
         static_cast<uint64_t>((leading_bytes >> 4) & 0x3fff) << 16 |
         static_cast<uint64_t>((stride_bytes >> 4) & 0x3fff) << 32 | uint64_t{1} << 62;
}

// Before the first MMA that reads registers (accumulators, A) written by other instructions.
__device__ __forceinline__ void Fence() {
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}

// Closes the MMAs issued since the last commit into a group.
__device__ __forceinline__ void Commit() {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}

// Waits until at most kPending committed groups are still running; their accumulators may be
// read only after.
template <int kPending>
__device__ __forceinline__ void Wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(kPending) : "memory");
}

// Keeps the compiler from moving reads or writes of `d` across the point where it is called
// (it does not know that an MMA in flight writes them).
template <int kSize>
__device__ __forceinline__ void FenceOperands(float (&d)[kSize]) {
#pragma unroll
  for (int i = 0; i < kSize; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// Sets this warpgroup's registers per thread (a multiple of 8 in [24, 256]; every warp of the
// warpgroup calls it): up (kIncrease) waits until the registers are free, down frees them.
template <int kRegisters, bool kIncrease>
__device__ __forceinline__ void SetMaxRegisters() {
  if constexpr (kIncrease) {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegisters));
  } else {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegisters));
  }
}

// The accumulator operands of an m64nNk16 (N / 2 per thread): their place-holders in the
// instruction and their constraints.
#define XLA_EXT_WGMMA_D32                                                                          \
  " %0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"                         \
  " %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define XLA_EXT_WGMMA_D64                                                                          \
  XLA_EXT_WGMMA_D32 ","                                                                            \
  " %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47,"               \
  " %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define XLA_EXT_WGMMA_D32_OPERANDS                                                                 \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]),                                                  \
  "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),                                                  \
  "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),                                                \
  "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),                                              \
  "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]),                                              \
  "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),                                              \
  "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),                                              \
  "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define XLA_EXT_WGMMA_D64_OPERANDS                                                                 \
  XLA_EXT_WGMMA_D32_OPERANDS,                                                                      \
  "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]),                                              \
  "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),                                              \
  "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]),                                              \
  "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),                                              \
  "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]),                                              \
  "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),                                              \
  "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]),                                              \
  "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])

#define XLA_EXT_WGMMA_RS(SHAPE, TYPE, D, D_OPERANDS, A0, A1, A2, A3, B, ACCUMULATE, TRANSPOSE_B)   \
  asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, " ACCUMULATE ", 0;\n"                           \
               " wgmma.mma_async.sync.aligned." SHAPE ".f32." TYPE "." TYPE " {" D "},"            \
               " {" A0 ", " A1 ", " A2 ", " A3 "}, " B ", p, 1, 1, " TRANSPOSE_B ";\n}"            \
               : D_OPERANDS                                                                        \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate),              \
                 "n"(kTransposeB)                                                                  \
               : "memory")

#define XLA_EXT_WGMMA_SS(SHAPE, TYPE, D, D_OPERANDS, A, B, ACCUMULATE)                             \
  asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, " ACCUMULATE ", 0;\n"                           \
               " wgmma.mma_async.sync.aligned." SHAPE ".f32." TYPE "." TYPE " {" D "},"            \
               " " A ", " B ", p, 1, 1, 0, 0;\n}"                                                  \
               : D_OPERANDS                                                                        \
               : "l"(a), "l"(b), "r"(accumulate)                                                   \
               : "memory")

// d (64 x N, f32) = a (64 x 16, registers) * b (16 x N, descriptor) + (accumulate ? d : 0),
// issued asynchronously: b K-major (kTransposeB 0) or MN-major (1).
template <typename T, int N, int kTransposeB>
__device__ __forceinline__ void MmaAsync(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t b,
                                         int accumulate) {
  static_assert(std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>);
  static_assert(N == 64 || N == 128);
  constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;
  if constexpr (N == 64) {
    if constexpr (kBf16) {
      XLA_EXT_WGMMA_RS("m64n64k16", "bf16", XLA_EXT_WGMMA_D32, XLA_EXT_WGMMA_D32_OPERANDS, "%32",
                       "%33", "%34", "%35", "%36", "%37", "%38");
    } else {
      XLA_EXT_WGMMA_RS("m64n64k16", "f16", XLA_EXT_WGMMA_D32, XLA_EXT_WGMMA_D32_OPERANDS, "%32",
                       "%33", "%34", "%35", "%36", "%37", "%38");
    }
  } else {
    if constexpr (kBf16) {
      XLA_EXT_WGMMA_RS("m64n128k16", "bf16", XLA_EXT_WGMMA_D64, XLA_EXT_WGMMA_D64_OPERANDS,
                       "%64", "%65", "%66", "%67", "%68", "%69", "%70");
    } else {
      XLA_EXT_WGMMA_RS("m64n128k16", "f16", XLA_EXT_WGMMA_D64, XLA_EXT_WGMMA_D64_OPERANDS,
                       "%64", "%65", "%66", "%67", "%68", "%69", "%70");
    }
  }
}

// d (64 x 128, f32) = a (64 x 16, descriptor, K-major) * b (16 x 128, descriptor, K-major) +
// (accumulate ? d : 0), issued asynchronously.
template <typename T>
__device__ __forceinline__ void MmaAsync(float (&d)[64], uint64_t a, uint64_t b, int accumulate) {
  static_assert(std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>);
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    XLA_EXT_WGMMA_SS("m64n128k16", "bf16", XLA_EXT_WGMMA_D64, XLA_EXT_WGMMA_D64_OPERANDS, "%64",
                     "%65", "%66");
  } else {
    XLA_EXT_WGMMA_SS("m64n128k16", "f16", XLA_EXT_WGMMA_D64, XLA_EXT_WGMMA_D64_OPERANDS, "%64",
                     "%65", "%66");
  }
}

#undef XLA_EXT_WGMMA_D32
#undef XLA_EXT_WGMMA_D64
#undef XLA_EXT_WGMMA_D32_OPERANDS
#undef XLA_EXT_WGMMA_D64_OPERANDS
#undef XLA_EXT_WGMMA_RS
#undef XLA_EXT_WGMMA_SS

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

}  // namespace xla_ext::cuda::warpgroup

#endif  // XLA_EXT_KERNELS_COMMON_WARPGROUP_MMA_CUH_
