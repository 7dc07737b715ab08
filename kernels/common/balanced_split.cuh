// A balanced split of a batch's work over a fixed grid, made on the device from the actual
// lengths (an XLA custom call cannot synchronise to read them on the host). Sequence i brings
// units_of(i) units of work (the decode kernel's: 16-token stages); the units of all sequences,
// in order, form one list, and CTA k of the grid takes units [k * chunk, (k + 1) * chunk) with
// chunk = max(ceil(total / ctas), min_chunk). A CTA's range may cross sequences and a sequence
// may span CTAs (as in stream-K and FlashInfer's balanced scheduler): every CTA gets the same
// work however skewed the lengths, and the grid is sized from the GPU alone.
//
// The pieces a CTA makes are numbered `CTA + sequence`: distinct for every (CTA, sequence) pair
// that meets (two sequences i < j met by CTAs k and l with k + i == l + j would need l < k
// while j starts after i ends), consecutive for one sequence, and below ctas + num_seqs. So a
// split sequence's partial results have fixed places in a buffer the host sizes in advance.
#ifndef XLA_EXT_KERNELS_COMMON_BALANCED_SPLIT_CUH_
#define XLA_EXT_KERNELS_COMMON_BALANCED_SPLIT_CUH_

#include <cstdint>

namespace xla_ext::cuda::balanced {

constexpr unsigned kFullMask = 0xffffffffu;

// Ints of shared memory LocateRange needs for a CTA of `threads` threads.
constexpr int ScratchInts(int threads) { return (threads + 31) / 32 + 2; }

__device__ __forceinline__ int WarpInclusiveScan(int value) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int offset = 1; offset < 32; offset *= 2) {
    const int other = __shfl_up_sync(kFullMask, value, offset);
    if (lane >= offset) value += other;
  }
  return value;
}

// Inclusive prefix sum over the CTA's threads in order; `total` gets the CTA's sum. Every
// thread calls it; `scratch` holds a warp's sum each, and may be reused once it returns.
__device__ __forceinline__ int BlockInclusiveScan(int value, int* scratch, int& total) {
  const int warp = threadIdx.x / 32;
  const int warps = (blockDim.x + 31) / 32;
  const int inclusive = WarpInclusiveScan(value);
  if (threadIdx.x % 32 == 31 || threadIdx.x == blockDim.x - 1) scratch[warp] = inclusive;
  __syncthreads();
  int before = 0;
  total = 0;
  for (int w = 0; w < warps; ++w) {
    const int sum = scratch[w];
    if (w < warp) before += sum;
    total += sum;
  }
  __syncthreads();
  return before + inclusive;
}

// This CTA's units [begin, end); empty when begin >= end (more CTAs than work).
struct Range {
  int begin;
  int end;
  int chunk;            // units per CTA
  int first_seq;        // the sequence whose units hold `begin`
  int first_seq_begin;  // the unit where first_seq starts
};

// Every thread of the CTA calls it, with units_of(i) >= 0 for every i < num_seqs (read twice:
// the second time from L1). `scratch`: ScratchInts(blockDim.x) ints of shared memory. The
// units go to the first active_ctas(total) CTAs of the grid (every thread calls it, and may
// use `scratch` in it); the others get empty ranges.
template <typename UnitsOf, typename ActiveCtas>
__device__ Range LocateRange(int num_seqs, int min_chunk, UnitsOf units_of, int* scratch,
                             ActiveCtas active_ctas) {
  const int warps = (blockDim.x + 31) / 32;
  int local = 0;
  for (int i = threadIdx.x; i < num_seqs; i += blockDim.x) local += units_of(i);
  int total;
  BlockInclusiveScan(local, scratch, total);
  const int ctas = max(active_ctas(total), 1);

  Range range;
  range.chunk = max((total + ctas - 1) / ctas, min_chunk);
  range.begin = static_cast<int>(
      min(static_cast<int64_t>(blockIdx.x) * range.chunk, static_cast<int64_t>(total)));
  range.end = min(range.begin + range.chunk, total);
  range.first_seq = 0;
  range.first_seq_begin = 0;
  if (range.begin >= range.end) return range;

  // The sequence holding `begin`: scan tile by tile until the prefix passes it.
  int carry = 0;
  for (int tile = 0; tile < num_seqs && carry <= range.begin; tile += blockDim.x) {
    const int i = tile + threadIdx.x;
    const int units = i < num_seqs ? units_of(i) : 0;
    int tile_total;
    const int inclusive = carry + BlockInclusiveScan(units, scratch, tile_total);
    if (units > 0 && inclusive - units <= range.begin && range.begin < inclusive) {
      scratch[warps] = i;
      scratch[warps + 1] = inclusive - units;
    }
    carry += tile_total;
  }
  __syncthreads();
  range.first_seq = scratch[warps];
  range.first_seq_begin = scratch[warps + 1];
  return range;
}

// The units split over the whole grid.
template <typename UnitsOf>
__device__ Range LocateRange(int num_seqs, int min_chunk, UnitsOf units_of, int* scratch) {
  return LocateRange(num_seqs, min_chunk, units_of, scratch,
                     [](int) { return static_cast<int>(gridDim.x); });
}

// The sum of value over the CTA's threads, in every thread (scratch as BlockInclusiveScan's).
__device__ __forceinline__ int BlockSum(int value, int* scratch) {
  int total;
  BlockInclusiveScan(value, scratch, total);
  return total;
}

// One warp's walk over the units of consecutive sequences, from a given unit of a given
// sequence. Lane l holds the length of sequence `batch + l`; the next 32 lengths are loaded
// (one memory round trip) when the walk passes them. Every lane holds the same position.
template <typename LengthOf, typename UnitsOfLength>
struct SequenceWalk {
  LengthOf length_of;       // (sequence) -> its length
  UnitsOfLength units_of;   // (length) -> its units
  int num_seqs;
  int batch;         // the sequence lane 0 holds
  int lane_length;   // this lane's sequence's length
  int index;         // the lane holding the current sequence
  int seq;           // batch + index
  int unit;          // within it
  int length;        // its length
  int units;         // its units

  __device__ SequenceWalk(LengthOf length_fn, UnitsOfLength units_fn, int seqs, int first_seq,
                          int first_unit)
      : length_of(length_fn), units_of(units_fn), num_seqs(seqs) {
    Load(first_seq);
    index = 0;
    unit = first_unit;
    Describe();
  }

  // To the next unit; the caller knows there is one.
  __device__ void Next() {
    if (++unit < units) return;
    unit = 0;
    do {
      if (++index == 32) {
        Load(batch + 32);
        index = 0;
      }
      Describe();
    } while (units == 0);
  }

 private:
  __device__ void Load(int first) {
    batch = first;
    const int s = first + static_cast<int>(threadIdx.x % 32);
    lane_length = s < num_seqs ? length_of(s) : 0;
  }

  __device__ void Describe() {
    seq = batch + index;
    length = __shfl_sync(kFullMask, lane_length, index);
    units = units_of(length);
  }
};

}  // namespace xla_ext::cuda::balanced

#endif  // XLA_EXT_KERNELS_COMMON_BALANCED_SPLIT_CUH_
