// Thin wrappers over the PTX that Hopper kernels stream memory with: mbarriers, TMA bulk copies
// (cp.async.bulk) and cp.async, named barriers, ldmatrix and the m16n8k16 tensor-core MMA.
// Each compiles to one instruction; callers guard their use with `#if __CUDA_ARCH__ >= 900`
// (ldmatrix and mma exist from sm_80).
#ifndef XLA_EXT_KERNELS_COMMON_SM90_CUH_
#define XLA_EXT_KERNELS_COMMON_SM90_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace xla_ext::cuda::sm90 {

__device__ __forceinline__ uint32_t SharedAddress(const void* pointer) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(pointer));
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900

__device__ __forceinline__ void BarrierInit(uint32_t barrier, uint32_t arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(barrier), "r"(arrivals));
}

// Makes initialised mbarriers visible to the async (TMA) proxy.
__device__ __forceinline__ void FenceBarrierInit() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// Orders this thread's earlier shared-memory writes before later TMA writes to the same bytes.
__device__ __forceinline__ void FenceProxyAsync() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// One arrival that also announces `bytes` of copies the current phase must wait for.
__device__ __forceinline__ void ArriveExpectBytes(uint32_t barrier, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(barrier), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void Arrive(uint32_t barrier) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(barrier) : "memory");
}

__device__ __forceinline__ void WaitParity(uint32_t barrier, uint32_t parity) {
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        " selp.u32 %0, 1, 0, p;\n}"
        : "=r"(done)
        : "r"(barrier), "r"(parity)
        : "memory");
  } while (!done);
}

// L2 cache policies (createpolicy): the lines an access under EvictFirstPolicy touches are the
// first L2 evicts (data read once), those under EvictLastPolicy the last (data read again soon).
__device__ __forceinline__ uint64_t EvictFirstPolicy() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  return policy;
}
__device__ __forceinline__ uint64_t EvictLastPolicy() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(policy));
  return policy;
}

// Global stores under an L2 policy.
__device__ __forceinline__ void Store(float* dst, float value, uint64_t policy) {
  asm volatile("st.global.L2::cache_hint.f32 [%0], %1, %2;" ::"l"(dst), "f"(value), "l"(policy)
               : "memory");
}
__device__ __forceinline__ void Store(float2* dst, float2 value, uint64_t policy) {
  asm volatile("st.global.L2::cache_hint.v2.f32 [%0], {%1, %2}, %3;" ::"l"(dst), "f"(value.x),
               "f"(value.y), "l"(policy)
               : "memory");
}

// TMA: copies `bytes` (a multiple of 16, both addresses 16-byte aligned) from global to shared
// memory under an L2 policy and counts them against the barrier's current phase.
__device__ __forceinline__ void BulkCopyToShared(uint32_t dst, const void* src, uint32_t bytes,
                                                 uint32_t barrier, uint64_t policy) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
      " [%0], [%1], %2, [%3], %4;" ::"r"(dst),
      "l"(src), "r"(bytes), "r"(barrier), "l"(policy)
      : "memory");
}

// cp.async of 16 bytes (both addresses 16-byte aligned): src_bytes 16 copies them, 0 writes
// zeros without reading `src`.
__device__ __forceinline__ void CopyAsync16(uint32_t dst, const void* src, uint32_t src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src),
               "r"(src_bytes)
               : "memory");
}

// One arrival on the barrier, made once this thread's earlier cp.async copies have landed
// (.noinc: it is one of the arrivals the barrier was initialised to expect).
__device__ __forceinline__ void CopyAsyncArrive(uint32_t barrier) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(barrier) : "memory");
}

// Starts bringing `bytes` (a multiple of 16) of global memory into L2.
__device__ __forceinline__ void PrefetchToL2(const void* src, uint32_t bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(src), "r"(bytes) : "memory");
}

// Waits until `threads` threads (a multiple of 32) of the CTA have reached named barrier `id`
// (1-15; __syncthreads is barrier 0): a barrier for some of a CTA's warps.
__device__ __forceinline__ void NamedBarrierSync(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// Counts this warp's threads towards named barrier `id` without waiting for it.
__device__ __forceinline__ void NamedBarrierArrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

#endif  // __CUDA_ARCH__ >= 900

// Programmatic dependent launch (cuda::LaunchProgrammatic): a kernel so launched waits here for
// the previous kernel on the stream to finish and its writes to be visible; without it, a
// no-op. LaunchDependents lets the next such kernel start launching before this one ends.
__device__ __forceinline__ void WaitForPrerequisiteGrid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void LaunchDependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Four 8x8 b16 matrices; lane i gives the address of row i % 8 of matrix i / 8. Volatile with a
// memory clobber, as the mbarrier wait is: a load must not move above the wait for its bytes.
__device__ __forceinline__ void LoadMatrixX4(uint32_t (&r)[4], uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address)
               : "memory");
}

__device__ __forceinline__ void LoadMatrixX4Transposed(uint32_t (&r)[4], uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address)
               : "memory");
}

// d = a * b + c with a 16x16 (row-major), b 16x8 (column-major), c and d 16x8 in f32.
template <typename T>
__device__ __forceinline__ void Mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1, const float (&c)[4]);

template <>
__device__ __forceinline__ void Mma16816<__nv_bfloat16>(float (&d)[4], const uint32_t (&a)[4],
                                                        uint32_t b0, uint32_t b1,
                                                        const float (&c)[4]) {
  asm(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%10, %11, %12, %13};"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(c[0]), "f"(c[1]),
        "f"(c[2]), "f"(c[3]));
}

template <>
__device__ __forceinline__ void Mma16816<__half>(float (&d)[4], const uint32_t (&a)[4],
                                                 uint32_t b0, uint32_t b1, const float (&c)[4]) {
  asm(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%10, %11, %12, %13};"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(c[0]), "f"(c[1]),
        "f"(c[2]), "f"(c[3]));
}

// Two floats as one register of two 16-bit values, `lo` in the low half.
template <typename T>
__device__ __forceinline__ uint32_t Pack(float lo, float hi);

template <>
__device__ __forceinline__ uint32_t Pack<__nv_bfloat16>(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

template <>
__device__ __forceinline__ uint32_t Pack<__half>(float lo, float hi) {
  const __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

}  // namespace xla_ext::cuda::sm90

#endif  // XLA_EXT_KERNELS_COMMON_SM90_CUH_
