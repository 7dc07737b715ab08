// Hopper decode attention for f16/bf16 with GQA groups of up to 16 query heads. Decode reads
// every K and V byte once and does little arithmetic per byte, so the kernel spends as few
// instructions as possible per byte and keeps plenty of bytes in flight:
// - The batch is a type (split_kv.cuh's SeqLensBatch for paged_attention; the decode steps of
//   a ragged batch for ragged_paged_attention) that says each sequence's length and row.
// - The grid fills the GPU once: gridDim.y groups of kv_heads_per_cta consecutive kv heads,
//   and gridDim.x CTAs that split the batch's actual tokens evenly between them, in stages of
//   kStageTokens tokens of one sequence (kernels/common/balanced_split.cuh: a CTA's stages may
//   cross sequences, a long sequence spans many CTAs, the lengths are read on the device). A
//   sequence a CTA holds whole is written to the output directly; the pieces of a split one go
//   to CombinePartitionsKernel. One warp per kv head; a token's rows for the CTA's kv heads are
//   contiguous in the NHD cache (with K and V interleaved, as in the ragged op's cache, its
//   (K, V) pairs of the CTA's kv heads are one run), and with every kv head in the CTA so are
//   those of consecutive tokens of one block: one TMA bulk copy moves a run of 2 or 4 tokens
//   into shared memory (Layout says which).
// - Stages (their K and V rows) stream through a ring of num_stages buffers. A producer warp
//   walks the CTA's stages and issues the copies, telling the consumers which sequence and
//   tokens each stage holds; a buffer's `full` mbarrier completes when its
//   bytes have landed, its `empty` one when every consumer thread is done with it, and only
//   then does the producer refill it. No CTA-wide barrier in the loop. Every thread arrives
//   for itself: an arrive releases only the arriving thread's accesses.
// - Tensor cores (mma.sync m16n8k16, FlashAttention-2 layout): S = Q K^T with the warp's query
//   heads as the 16 rows of A (rows past the group are zero); an online softmax in registers;
//   O += P V with P taken straight from S's accumulators.
// - L2 policies: the K and V copies mark their lines evict-first (each byte is read once), the
//   split-KV partials are stored evict-last (the combine kernel reads them right after), so the
//   stream of the cache does not push the partials out to DRAM. Measured on an H100 against no
//   policies: B=1, L=32768 -2.5 to -3.3 us per call, the other shapes unchanged or faster; the
//   copies' policy alone made B=32 2-3 us slower, and reading the partials back evict-first in
//   the combine kernel was no better.
// Shared-memory runs of tokens are padded by 16 bytes so that ldmatrix's 8 rows of 8 even (or
// odd) tokens fall in distinct banks, or two to a bank with runs of 4 (Layout). Measured on an
// H100: one L2 prefetch per block-sized run of tokens, a stage ahead, raised B=32, L=4096 from
// 82% to 88% of copy bandwidth in the same timing; copies of one kv head's 256-byte rows
// reached only about 50%.
// Before the batch was split by its actual lengths, partitions were sized from the longest
// possible sequence, and one long sequence beside short ones ran at 6% of copy bandwidth.
#ifndef XLA_EXT_KERNELS_ATTENTION_DECODE_TENSOR_CORE_CUH_
#define XLA_EXT_KERNELS_ATTENTION_DECODE_TENSOR_CORE_CUH_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <type_traits>

#include "kernels/attention/split_kv.cuh"
#include "kernels/common/balanced_split.cuh"
#include "kernels/common/cuda_utils.cuh"
#include "kernels/common/sm90.cuh"
#include "kernels/common/tuning.h"

namespace xla_ext::attention::decode::tensor_core {

constexpr int kStageTokens = 16;  // one k16 step of P V; two n8 tiles of S
constexpr int kMaxStages = 16;
constexpr int kMaxKvHeadsPerCta = 8;
constexpr int kMaxGroupSize = 16;  // the rows of an m16n8k16 A tile
// A stage's tokens as the producer describes them to the consumers.
struct StageInfo {
  int seq;
  int first_token;  // within the sequence
  int seq_len;
  int flags;        // kFirstStage | kLastStage of the sequence
};
constexpr int kFirstStage = 1;
constexpr int kLastStage = 2;
// Barriers, per-stage StageInfos and token masks, and the scheduler's scratch come first in
// shared memory, then the stages. (All of it dynamic: static shared memory would lower the
// dynamic maximum a kernel may opt in to.)
constexpr int kScheduleScratchInts = cuda::balanced::ScratchInts((kMaxKvHeadsPerCta + 1) * 32);
constexpr int kHeaderBytes =
    (kMaxStages * (2 * sizeof(uint64_t) + sizeof(StageInfo) + sizeof(uint32_t)) +
     kScheduleScratchInts * sizeof(int) + 15) / 16 * 16;
static_assert(kHeaderBytes % 16 == 0, "stage buffers start 16-byte aligned");

// A stage in shared memory: its tokens in runs of R = run_tokens consecutive ones (2 or 4), each
// run the R tokens' rows (a token's row: the CTA's kv heads' K rows, or with K and V interleaved
// in the cache their (K, V) pairs), the runs padded by 16 bytes; with K and V apart,
// kStageTokens / R runs of K, then as many of V. Token t of a stage sits at
// (t / R) * run_stride + (t % R) * token_bytes. Where a CTA holds every kv head a run's rows are
// contiguous in the cache (its tokens are in one block: runs start at multiples of R, stages at
// multiples of kStageTokens, and blocks hold a power of two of at least R tokens), so one copy
// moves them. The copies are issued one lane at a time, and while they are small their count,
// not their bytes, limits the stream (on the H100: one 1 KB copy per token reached 73% of copy
// bandwidth, 2 KB pair copies 86-89%; in the serving loop's decode step, 16 layers, two 1 KB
// copies per token took 1926 us, one 2 KB copy 1672 us). So R is the smaller of 2 and 4 whose
// copy reaches kDecodeMinCopyBytes (tuning.h), else 4; 2 where tokens are copied one by one
// anyway (a CTA without every kv head) or blocks are shorter than 4 tokens. On the H100, runs
// of 4 of paged_attention's 1 KB K (and V) rows, head_dim 64 and 8 kv heads, 64 x 2048, took
// 98.5 us against 109.2 with pairs (91% of copy bandwidth against 82%); runs of 4 of the ragged
// op's 2 KB (K, V) rows, 8 KB copies, were no faster than pairs there (1B step shape 109.3 us
// against 106.5). On the H200, whose bandwidth is 1.4x the H100's at the same SM clock, they
// are: the 1B model's decode-only call at B=64 took 87.1 us against 90.8 with pairs, at B=16
// 27.5 against 28.3, at B=1 level (bench/decode_latency_probe.cu, one lease), and
// paged_attention's mixes with 2 KB rows (head_dim 128) were level or up to 2% faster; so the
// default threshold is 8 KB.
// The padding puts the runs' starts in distinct 16-byte bank groups (their stride is an odd
// multiple of 16 modulo 128), so with R = 2 the consumers' ldmatrix rows, 8 even or 8 odd tokens
// (an S tile's 8 columns are the stage's even tokens or its odd ones), fall in distinct banks;
// with R = 4 two of them share a run, a 2-way bank conflict, taken for the fewer copies.
struct Layout {
  static constexpr int kRunPadding = 16;  // bytes
  int token_bytes;  // one token's copied row
  int run_tokens;   // R
  int run_stride;   // bytes of a run in shared memory, padded
  int stage_bytes;

  static Layout For(int kv_heads_per_cta, int num_kv_heads, int head_size, int element_size,
                    bool kv_interleaved, int block_size) {
    const int row_bytes = kv_heads_per_cta * head_size * element_size;
    const int token_bytes = kv_interleaved ? 2 * row_bytes : row_bytes;
    const bool whole_rows = kv_heads_per_cta == num_kv_heads;  // a run's rows are contiguous
    const int run_tokens =
        whole_rows && block_size >= 4 && 2 * token_bytes < tuning::kDecodeMinCopyBytes ? 4 : 2;
    const int run_stride = run_tokens * token_bytes + kRunPadding;
    const int runs = (kv_interleaved ? 1 : 2) * kStageTokens / run_tokens;
    return {token_bytes, run_tokens, run_stride, runs * run_stride};
  }
};
static_assert(kStageTokens % 4 == 0, "runs of 2 or 4 tokens tile a stage");

inline int SharedBytes(const Layout& layout, int num_stages) {
  return kHeaderBytes + num_stages * layout.stage_bytes;
}

// Stages of a sequence of `length` tokens.
__device__ __forceinline__ int StagesOf(int length) {
  return (length + kStageTokens - 1) / kStageTokens;
}

// The fewest stages a CTA takes (short pieces cost more in partials than they save): the
// tuning knob (kernels/common/tuning.h), or XLA_EXT_DECODE_MIN_CTA_STAGES (1 to 64) for a sweep
// without a rebuild. (Params::min_cta_stages; LaunchAttention sets it.)
constexpr int kMinCtaStages = tuning::kDecodeMinCtaStages;
inline int MinCtaStages() {
  static const int stages = [] {
    const char* set = std::getenv("XLA_EXT_DECODE_MIN_CTA_STAGES");
    const int value = set != nullptr ? std::atoi(set) : 0;
    return value >= 1 && value <= 64 ? value : kMinCtaStages;
  }();
  return stages;
}

// Stages of a sequence of `length` tokens that its window (split_kv.cuh) leaves out.
__device__ __forceinline__ int SkippedStages(int window, int length) {
  return WindowStart(window, length) / kStageTokens;
}

// The kernel's units of work of a sequence of `length` tokens (every thread of every CTA
// computes the same): its stages that the window keeps.
__device__ __forceinline__ int UnitsOf(int window, int length) {
  return StagesOf(length) - SkippedStages(window, length);
}

// The fused combine (Params::fused_combine): one arrival counter per (sequence, kv head). Each
// piece of a split sequence, once its records are stored, counts itself in; the one that
// completes the count merges the sequence's records for that kv head's query heads into the
// output and sets the counter back to 0 for the next call. A module's globals start zeroed, so
// the counters need no clearing launch of their own; they are shared by every call on the
// device, which must therefore run one after another (as XLA runs a graph's calls in its
// stream): two such calls at once on two streams would count into each other's. On the
// H100 the combine kernel behind the attention kernel cost a launch and a wait at every call
// (4.4 us of a 26 us layer's attention in the 1B model's B=1 serving step).
inline constexpr int kMaxPieceArrivals = 1 << 16;
namespace {
__device__ int piece_arrivals[kMaxPieceArrivals];
}  // namespace

// The fused combine's merge, by the warp that completes a split sequence's count: out =
// out_scale * sum_i w_i o_i / sum_i w_i l_i over the sequence's `records` records (as
// split_kv.cuh's CombinePartitions) for `heads` query heads from `first_head`, their records
// from `first_record` (CTA + sequence) on. Every load of a chunk of records is issued before
// any is used (16 records of a row at head sizes up to 128), and a head's row takes
// kLanesPerRow lanes, so that a warp merges 32 / kLanesPerRow rows at once (two at head size
// 64): on the H200, merging the rows one after another, 16 records a round trip, took the B=1
// decode step's attention call (1B model, 2k context; main's kernels 15.7 us) to 16.6 us; two
// rows at once, 14.5 us.
template <typename T, int kHeadSize>
__device__ __forceinline__ void MergeSplitSequence(const Params& p, int64_t out_row,
                                                   int first_head, int heads,
                                                   int64_t first_record, int records) {
  constexpr int kColumns4 = kHeadSize / 4;  // float4 columns of a row
  constexpr int kLanesPerRow = kColumns4 < 32 ? kColumns4 : 32;
  constexpr int kRowsAtOnce = 32 / kLanesPerRow;
  constexpr int kVecs = (kColumns4 + kLanesPerRow - 1) / kLanesPerRow;
  // Records a lane loads at once, into 16 float4 registers (32 made ptxas spill up to 540
  // bytes of the kernel's registers).
  constexpr int kChunk = 16 / kVecs;
  // Record j's statistics are in lane j % kLanesPerRow of its row, entry j / kLanesPerRow.
  constexpr int kStatsPerLane = (kChunk + kLanesPerRow - 1) / kLanesPerRow;
  const int lane = threadIdx.x % 32;
  const int slot = lane / kLanesPerRow;  // the row of this lane within the rows at once
  const int column = lane % kLanesPerRow;
  const int slot_lane = slot * kLanesPerRow;  // the row's first lane
  for (int base_head = 0; base_head < heads; base_head += kRowsAtOnce) {
    const int head = base_head + slot;
    const bool active = slot < kRowsAtOnce && head < heads;
    const int64_t first = static_cast<int64_t>(first_head + (active ? head : 0)) * p.num_records +
                          first_record;
    const float4* partial = reinterpret_cast<const float4*>(p.partial_out + first * kHeadSize);
    float m = -INFINITY, l = 0.0f;
    float4 acc[kVecs];
#pragma unroll
    for (int v = 0; v < kVecs; ++v) acc[v] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    for (int base = 0; base < records; base += kChunk) {
      // Through L2 (ld.global.cg): other SMs wrote the records during this grid.
      float chunk_max[kStatsPerLane], chunk_sum[kStatsPerLane];
#pragma unroll
      for (int e = 0; e < kStatsPerLane; ++e) {
        const int j = e * kLanesPerRow + column;
        const bool has_stats = active && j < kChunk && base + j < records;
        chunk_max[e] = has_stats ? __ldcg(p.partial_max + first + base + j) : -INFINITY;
        chunk_sum[e] = has_stats ? __ldcg(p.partial_sum + first + base + j) : 0.0f;
      }
      float4 values[kChunk][kVecs];
#pragma unroll
      for (int j = 0; j < kChunk; ++j)
#pragma unroll
        for (int v = 0; v < kVecs; ++v) {
          const int c = v * kLanesPerRow + column;
          values[j][v] = active && base + j < records && c < kColumns4
                             ? __ldcg(partial + (base + j) * kColumns4 + c)
                             : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
      float new_max = m;
#pragma unroll
      for (int j = 0; j < kChunk; ++j) {
        new_max = fmaxf(new_max, __shfl_sync(0xffffffffu, chunk_max[j / kLanesPerRow],
                                             slot_lane + j % kLanesPerRow));
      }
      // A record whose tokens were all skipped has max -inf and sum 0: weight 0.
      const float rescale = new_max == -INFINITY ? 0.0f : __expf(m - new_max);
#pragma unroll
      for (int v = 0; v < kVecs; ++v) {
        acc[v] = make_float4(acc[v].x * rescale, acc[v].y * rescale, acc[v].z * rescale,
                             acc[v].w * rescale);
      }
      l *= rescale;
#pragma unroll
      for (int j = 0; j < kChunk; ++j) {
        const int holder = slot_lane + j % kLanesPerRow;
        const float record_max = __shfl_sync(0xffffffffu, chunk_max[j / kLanesPerRow], holder);
        const float record_sum = __shfl_sync(0xffffffffu, chunk_sum[j / kLanesPerRow], holder);
        const float w = record_max == -INFINITY ? 0.0f : __expf(record_max - new_max);
        l += w * record_sum;
#pragma unroll
        for (int v = 0; v < kVecs; ++v) {
          acc[v] = make_float4(acc[v].x + w * values[j][v].x, acc[v].y + w * values[j][v].y,
                               acc[v].z + w * values[j][v].z, acc[v].w + w * values[j][v].w);
        }
      }
      m = new_max;
    }
    if (!active) continue;
    const float inv_sum = l > 0.0f ? p.out_scale / l : 0.0f;
    T* out = static_cast<T*>(p.out) + (out_row * p.num_heads + first_head + head) * kHeadSize;
#pragma unroll
    for (int v = 0; v < kVecs; ++v) {
      const int c = v * kLanesPerRow + column;
      if (c >= kColumns4) continue;
      out[4 * c] = cuda::FromFloat<T>(acc[v].x * inv_sum);
      out[4 * c + 1] = cuda::FromFloat<T>(acc[v].y * inv_sum);
      out[4 * c + 2] = cuda::FromFloat<T>(acc[v].z * inv_sum);
      out[4 * c + 3] = cuda::FromFloat<T>(acc[v].w * inv_sum);
    }
  }
}

// Writes `value` into every element of output row `row` ([num_heads, head_size]), with 16-byte
// stores spread over the CTA's threads.
template <typename T, int kHeadSize>
__device__ __forceinline__ void FillRow(const Params& p, int64_t row, float value) {
  constexpr int kPerVector = 16 / sizeof(T);
  static_assert(kHeadSize % kPerVector == 0, "a head's row is whole 16-byte vectors");
  T element[kPerVector];
#pragma unroll
  for (int i = 0; i < kPerVector; ++i) element[i] = cuda::FromFloat<T>(value);
  uint4 vector;
  memcpy(&vector, element, sizeof(vector));
  const int vectors = p.num_heads * kHeadSize / kPerVector;
  uint4* dst = reinterpret_cast<uint4*>(static_cast<T*>(p.out) + row * p.num_heads * kHeadSize);
  for (int i = threadIdx.x; i < vectors; i += blockDim.x) dst[i] = vector;
}

// Phase stamps, for bench/decode_latency_probe.cu only: built with
// -DXLA_EXT_DECODE_PHASE_STAMPS, the kernel records in phase_stamps, for each CTA of kv-head
// group 0, the SM clock (clock64) at each phase below less its value at the CTA's entry, and
// the entry's %globaltimer (ns). Consumer phases are warp 0's (kv head 0), lane 0. Without the
// macro the stamps compile to nothing.
enum StampPhase : int {
  kStampWaited,        // the previous grid has finished (or the batch does not wait)
  kStampLocated,       // the CTA knows its range of stages
  kStampTableRead,     // the producer has its first stage's block-table entries
  kStampCopiesIssued,  // ... has issued that stage's copies, and has the next stage's entries
  kStampFirstFull,     // the first stage's bytes have landed (consumer)
  kStampFirstStage,    // its first stage is done (the query loaded, S, softmax, P V)
  kStampStagesDone,    // every stage is done
  kStampCounted,       // its last piece's records are stored and counted in (fused combine)
  kStampMerged,        // it merged a split sequence (the last piece to count in only)
  kStampExit,
  kStampEntryNs,       // the entry's %globaltimer
  kStampSlots
};
#ifdef XLA_EXT_DECODE_PHASE_STAMPS
constexpr int kMaxStampedCtas = 2048;
__device__ long long phase_stamps[kMaxStampedCtas][kStampSlots];
#define XLA_EXT_DECODE_STAMP(condition, phase)                              \
  do {                                                                      \
    if ((condition) && blockIdx.y == 0 && blockIdx.x < kMaxStampedCtas) {  \
      phase_stamps[blockIdx.x][phase] = clock64() - stamp_entry;            \
    }                                                                       \
  } while (false)
#else
#define XLA_EXT_DECODE_STAMP(condition, phase) \
  do {                                         \
  } while (false)
#endif

// kHighRows: the GQA group has more than 8 heads, so rows 8-15 of the MMA tiles are used.
// (At least 1 CTA per SM is said explicitly: without it ptxas gave the head_size 256, kHighRows
// kernel 32 registers and 4.6 KB of spills.)
template <typename T, int kHeadSize, bool kHighRows, typename Batch>
__global__ void __launch_bounds__((kMaxKvHeadsPerCta + 1) * 32, 1)
    AttendTensorCoreKernel(Params p, Batch batch, Layout layout, int num_stages) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  namespace sm90 = cuda::sm90;
  constexpr int kSteps = kHeadSize / 16;  // k16 steps of Q K^T
  constexpr int kTiles = kHeadSize / 8;   // n8 tiles of O
#ifdef XLA_EXT_DECODE_PHASE_STAMPS
  const long long stamp_entry = clock64();
  if (threadIdx.x == 0 && blockIdx.y == 0 && blockIdx.x < kMaxStampedCtas) {
    long long now_ns;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now_ns));
    for (int phase = 0; phase < kStampEntryNs; ++phase) phase_stamps[blockIdx.x][phase] = -1;
    phase_stamps[blockIdx.x][kStampEntryNs] = now_ns;
  }
#endif
  extern __shared__ __align__(16) unsigned char smem[];
  uint64_t* full = reinterpret_cast<uint64_t*>(smem);  // a stage's bytes have landed
  uint64_t* empty = full + kMaxStages;                   // every consumer is done with it
  StageInfo* stage_infos = reinterpret_cast<StageInfo*>(empty + kMaxStages);
  uint32_t* valid_masks = reinterpret_cast<uint32_t*>(stage_infos + kMaxStages);
  int* schedule_scratch = reinterpret_cast<int*>(valid_masks + kMaxStages);
  unsigned char* stages = smem + kHeaderBytes;

  const int kv_heads_per_cta = blockDim.x / 32 - 1;  // consumer warps; the last warp produces
  const int first_kv_head = blockIdx.y * kv_heads_per_cta;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int group = p.num_heads / p.num_kv_heads;
  const int first_head = (first_kv_head + warp) * group;  // this warp's query heads
  if (threadIdx.x == 0) {
    for (int s = 0; s < num_stages; ++s) {
      sm90::BarrierInit(sm90::SharedAddress(&full[s]), 32);  // the producer warp's lanes
      sm90::BarrierInit(sm90::SharedAddress(&empty[s]), kv_heads_per_cta * 32);
    }
    sm90::FenceBarrierInit();
  }
  // Launched programmatically: the set-up above overlaps the previous kernel's tail; global
  // memory only after it has finished, unless the batch runs beside it (then every exit waits
  // for it, so that this grid ends after it: the kernels behind this one wait for this one).
  if constexpr (Batch::kWaitsBeforeReading) sm90::WaitForPrerequisiteGrid();
  XLA_EXT_DECODE_STAMP(threadIdx.x == 0, kStampWaited);
  const auto finish = [] {
    if constexpr (!Batch::kWaitsBeforeReading) sm90::WaitForPrerequisiteGrid();
  };
  const auto length_of = [&](int seq) { return batch.Length(p, seq); };
  const auto units_of = [&](int length) { return UnitsOf(p.window, length); };
  int active_ctas = 0;
  const cuda::balanced::Range range = cuda::balanced::LocateRange(
      p.num_seqs, p.min_cta_stages, [&](int seq) { return units_of(length_of(seq)); },
      schedule_scratch, [&](int units) {
        return active_ctas = batch.ActiveCtas(p, units, schedule_scratch);
      });
  XLA_EXT_DECODE_STAMP(threadIdx.x == 0, kStampLocated);
  if constexpr (Batch::kFillsOtherRows) {
    // The output rows no sequence of this grid writes (the batch says which, and what).
    batch.ForEachOtherRow(blockIdx.y * gridDim.x + blockIdx.x, gridDim.x * gridDim.y,
                          [&](int64_t row, float value) { FillRow<T, kHeadSize>(p, row, value); });
  }
  if (range.begin >= range.end) {  // more CTAs than stages
    finish();
    return;
  }
  const int num_iters = range.end - range.begin;

  if (warp == kv_heads_per_cta) {
    // Producer: of a stage's runs of R tokens (Layout), kStageTokens / R, lane i copies the K
    // rows of run i (tokens R * i to R * i + R - 1), lane runs + i their V rows (interleaved:
    // lane i their (K, V) pairs, lanes runs + i nothing); the other lanes only arrive. A run is
    // one copy where its rows are contiguous in the cache (every kv head in the CTA) and all its
    // tokens are copied, else one copy per token. The next stage's block-table entries are
    // loaded before waiting for its buffer. With every kv head in the CTA, a block's rows are
    // contiguous: one L2 prefetch per block-sized run of tokens, a stage ahead, turns the next
    // stage's copies into L2 hits. Only while the grid streams alone: on a share of it, beside
    // the ragged tiled kernel, the prefetches' L2 traffic slowed that kernel more than they sped
    // this one (4 chunks of 256 + 60 decodes x 1024: 126.5-129.3 us with them, 123.6-123.7
    // without, on the H100). Tokens before the window are skipped.
    const int run_tokens = layout.run_tokens;
    const int runs = kStageTokens / run_tokens;
    const int run = lane % runs;
    const int part = lane / runs;  // 0: K (or K and V), 1: V
    const bool copier = part == 0 || (part == 1 && !p.kv_interleaved);
    const bool whole_rows = kv_heads_per_cta == p.num_kv_heads;
    const uint32_t token_bytes = layout.token_bytes;
    const int64_t slot_elements =
        (p.kv_interleaved ? 2 : 1) * static_cast<int64_t>(p.num_kv_heads) * kHeadSize;
    const T* cache = p.kv_interleaved ? static_cast<const T*>(p.key_cache) +
                                            2 * first_kv_head * kHeadSize
                                      : static_cast<const T*>(part == 0 ? p.key_cache
                                                                        : p.value_cache) +
                                            first_kv_head * kHeadSize;
    const uint64_t read_once = sm90::EvictFirstPolicy();
    const bool alone = active_ctas == static_cast<int>(gridDim.x);
    const int prefetch_run = whole_rows && alone ? min(1 << p.log2_block_size, kStageTokens) : 0;
    const uint32_t prefetch_bytes = copier ? prefetch_run * token_bytes : 0;
    cuda::balanced::SequenceWalk walk(length_of, units_of, p.num_seqs, range.first_seq,
                                      range.begin - range.first_seq_begin);
    const auto first_token = [&]() {
      return (SkippedStages(p.window, walk.length) + walk.unit) * kStageTokens;
    };
    // This lane's run in the walk's stage: which of its tokens are copied (bit k: its token k,
    // inside the sequence and the window, of a block in the cache), and the element offset of
    // its first token's row (its tokens share a block: their rows follow it slot by slot).
    struct RunRows {
      uint32_t tokens = 0;
      int64_t first = 0;
    };
    const auto run_rows = [&]() {
      RunRows rows;
      const int t = first_token() + run * run_tokens;
      if (!copier || t >= walk.length) return rows;
      const int block = p.block_tables[static_cast<int64_t>(walk.seq) * p.max_blocks_per_seq +
                                       (t >> p.log2_block_size)];
      if (block < 0 || block >= p.num_blocks) return rows;
      const int64_t slot = (static_cast<int64_t>(block) << p.log2_block_size) +
                           (t & ((1 << p.log2_block_size) - 1));
      const int begin = max(WindowStart(p, walk.length) - t, 0);
      const int end = min(walk.length - t, run_tokens);
      if (begin < end) rows.tokens = (1u << end) - (1u << begin);
      rows.first = slot * slot_elements;
      return rows;
    };
    RunRows rows = run_rows();
    XLA_EXT_DECODE_STAMP(lane == 0 && rows.first >= 0, kStampTableRead);
    for (int iter = 0; iter < num_iters; ++iter) {
      const int slot = iter % num_stages;
      const StageInfo info{walk.seq, first_token(), walk.length,
                           (walk.unit == 0 ? kFirstStage : 0) |
                               (walk.unit == walk.units - 1 ? kLastStage : 0)};
      if (walk.unit == 0 && blockIdx.y == 0 && lane == 0) {
        // This CTA holds the sequence's first stage: say where its records are.
        const int last_cta = (range.begin + iter + walk.units - 1) / range.chunk;
        p.seq_records[walk.seq] =
            make_int2(blockIdx.x + walk.seq, last_cta - static_cast<int>(blockIdx.x) + 1);
      }
      RunRows next;
      if (iter + 1 < num_iters) {
        walk.Next();
        next = run_rows();
      }
      if (iter >= num_stages) {
        sm90::WaitParity(sm90::SharedAddress(&empty[slot]), (iter / num_stages - 1) & 1);
      }
      // Bit i: token 2i (S tile 0's column i); bit 8 + i: token 2i + 1 (tile 1's). Each lane
      // gives its run's bits (a V lane the same as its K lane).
      uint32_t mine = 0;
      for (int k = 0; k < run_tokens; ++k) {
        const int token = run * run_tokens + k;
        if ((rows.tokens >> k) & 1u) mine |= 1u << ((token % 2) * (kStageTokens / 2) + token / 2);
      }
      const uint32_t valid = __reduce_or_sync(0xffffffffu, mine);
      const bool joined = whole_rows && rows.tokens == (1u << run_tokens) - 1;
      const uint32_t total = __reduce_add_sync(0xffffffffu, __popc(rows.tokens) * token_bytes);
      const uint32_t barrier = sm90::SharedAddress(&full[slot]);
      unsigned char* dst =
          stages + slot * layout.stage_bytes + (part * runs + run) * layout.run_stride;
      // Every lane arrives (lane 0 releasing the stage's description and token mask). A
      // skipped token's rows are not written: the consumers replace its scores and mask its V
      // rows.
      if (lane == 0) {
        stage_infos[slot] = info;
        valid_masks[slot] = valid;
        sm90::ArriveExpectBytes(barrier, total);
      } else {
        sm90::Arrive(barrier);
      }
      __syncwarp();  // the bytes are expected before any copy can complete
      if (joined) {
        sm90::BulkCopyToShared(sm90::SharedAddress(dst), cache + rows.first,
                               run_tokens * token_bytes, barrier, read_once);
      } else {
        for (int k = 0; k < run_tokens; ++k) {
          if ((rows.tokens >> k) & 1u) {
            sm90::BulkCopyToShared(sm90::SharedAddress(dst + k * token_bytes),
                                   cache + rows.first + k * slot_elements, token_bytes, barrier,
                                   read_once);
          }
        }
      }
      // One prefetch per block-sized run of the next stage's tokens, where its first is copied.
      if (prefetch_bytes > 0 && (next.tokens & 1u) && (run * run_tokens) % prefetch_run == 0) {
        sm90::PrefetchToL2(cache + next.first, prefetch_bytes);
      }
      XLA_EXT_DECODE_STAMP(lane == 0 && iter == 0, kStampCopiesIssued);
      rows = next;
    }
    finish();
    return;
  }

  // Q as MMA A fragments: lane holds rows lane/4 and lane/4 + 8, columns 2*(lane%4) + {0,1}
  // and + 8 of each 16-column step. Rows past the group are zero.
  const int row = lane / 4;
  const int col = 2 * (lane % 4);
  uint32_t qa[kSteps][4];
  const auto load_query = [&](int seq) {
    const T* q = static_cast<const T*>(p.query) +
                 (batch.Row(p, seq) * p.num_heads + first_head) * kHeadSize;
    const uint32_t* q_lo = reinterpret_cast<const uint32_t*>(q + row * kHeadSize + col);
    const uint32_t* q_hi = reinterpret_cast<const uint32_t*>(q + (row + 8) * kHeadSize + col);
#pragma unroll
    for (int s = 0; s < kSteps; ++s) {
      qa[s][0] = row < group ? q_lo[s * 8] : 0u;
      qa[s][2] = row < group ? q_lo[s * 8 + 4] : 0u;
      qa[s][1] = kHighRows && row + 8 < group ? q_hi[s * 8] : 0u;
      qa[s][3] = kHighRows && row + 8 < group ? q_hi[s * 8 + 4] : 0u;
    }
  };

  // Online softmax state of rows `row` (lo) and `row + 8` (hi); O's accumulators per n8 tile:
  // [0..1] row lo, [2..3] row hi (kept only with kHighRows), columns col + {0,1}.
  constexpr int kRows = kHighRows ? 2 : 1;
  float running_max[kRows], running_sum[kRows];
  float o[kTiles][4];  // rows hi are dead code without kHighRows
  const auto reset = [&]() {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      running_max[r] = -INFINITY;
      running_sum[r] = 0.0f;
    }
#pragma unroll
    for (int n = 0; n < kTiles; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i) o[n][i] = 0.0f;
  };

  // Where the piece in progress's sequence starts in the batch's list of units, and its length.
  int seq_first_unit = 0;
  int seq_len = 0;
  // The fused combine: counts this warp's piece of `seq` in (its records stored); the last of
  // the sequence's pieces merges its records into the output rows of this warp's query heads.
  // The pieces are those of CTAs first_cta ... last_cta (balanced_split.cuh), record CTA + seq.
  const auto merge_if_last = [&](int seq) {
    const int first_cta = seq_first_unit / range.chunk;
    const int pieces =
        (seq_first_unit + UnitsOf(p.window, seq_len) - 1) / range.chunk - first_cta + 1;
    int* arrivals =
        &piece_arrivals[static_cast<int64_t>(seq) * p.num_kv_heads + first_kv_head + warp];
    __threadfence();  // this lane's records, before the count
    __syncwarp();
    int arrived = 0;
    if (lane == 0) arrived = atomicAdd(arrivals, 1);
    const bool last = __shfl_sync(0xffffffffu, arrived, 0) == pieces - 1;
    XLA_EXT_DECODE_STAMP(threadIdx.x == 0, kStampCounted);
    if (!last) return;
    if (lane == 0) *arrivals = 0;  // every piece of this call has counted: the next call's
    __threadfence();               // the other pieces' records, after their counts
    MergeSplitSequence<T, kHeadSize>(p, batch.Row(p, seq), first_head, group,
                                     int64_t{first_cta} + seq, pieces);
    XLA_EXT_DECODE_STAMP(threadIdx.x == 0, kStampMerged);
  };

  // Writes this CTA's piece of `seq`: the output itself when the piece is the whole sequence,
  // else its record for the combine (fused: merge_if_last).
  T* out = static_cast<T*>(p.out);
  const auto write_piece = [&](int seq, bool whole) {
    // Each row's sum is spread over its 4 lanes.
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      running_sum[r] += __shfl_xor_sync(0xffffffffu, running_sum[r], 1);
      running_sum[r] += __shfl_xor_sync(0xffffffffu, running_sum[r], 2);
    }
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int head_row = row + 8 * r;
      if (head_row >= group) continue;
      const int head = first_head + head_row;
      if (whole) {
        const float inv_sum = running_sum[r] > 0.0f ? p.out_scale / running_sum[r] : 0.0f;
        uint32_t* dst = reinterpret_cast<uint32_t*>(
            out + (batch.Row(p, seq) * p.num_heads + head) * kHeadSize + col);
#pragma unroll
        for (int n = 0; n < kTiles; ++n) {
          dst[n * 4] = sm90::Pack<T>(o[n][2 * r] * inv_sum, o[n][2 * r + 1] * inv_sum);
        }
      } else {
        const uint64_t read_soon = sm90::EvictLastPolicy();
        const int64_t record =
            static_cast<int64_t>(head) * p.num_records + blockIdx.x + seq;
        float2* dst = reinterpret_cast<float2*>(p.partial_out + record * kHeadSize + col);
#pragma unroll
        for (int n = 0; n < kTiles; ++n) {
          sm90::Store(&dst[n * 4], make_float2(o[n][2 * r], o[n][2 * r + 1]), read_soon);
        }
        if (lane % 4 == 0) {
          sm90::Store(&p.partial_max[record], running_max[r], read_soon);
          sm90::Store(&p.partial_sum[record], running_sum[r], read_soon);
        }
      }
    }
    if (!whole && p.fused_combine) merge_if_last(seq);
  };

  // Where this warp's kv head's K and V rows sit in a token's row of a stage (Layout).
  const uint32_t k_offset = (p.kv_interleaved ? 2 * warp : warp) * kHeadSize * sizeof(T);
  const uint32_t v_offset =
      p.kv_interleaved
          ? (2 * warp + 1) * kHeadSize * sizeof(T)
          : kStageTokens / layout.run_tokens * layout.run_stride + warp * kHeadSize * sizeof(T);

  // ldmatrix row addresses of this lane, relative to the warp's first K or V element; row r of
  // an 8 x 8 matrix is token 2r (S tile 0, P V's k rows 0-7) or 2r + 1 (tile 1, k rows 8-15).
  // K (B of Q K^T, not transposed): matrix j = lane/8 is (tile j/2, columns 8*(j%2)..).
  // V (B of P V, transposed): matrix j is (k rows 8*(j%2).., columns 8*(j/2)..).
  const int j = lane / 8;
  const auto token_at = [&](int t) {  // token t's row in a stage (Layout)
    return t / layout.run_tokens * layout.run_stride + t % layout.run_tokens * layout.token_bytes;
  };
  const int k_lane = token_at(2 * (lane % 8) + j / 2) + (j % 2) * 8 * sizeof(T);
  const int v_lane = token_at(2 * (lane % 8) + j % 2) + (j / 2) * 8 * sizeof(T);

  // The range's first sequence's query rows, loaded while its first stage's K/V are on their
  // way (loaded at the stage, they were one more round trip between the copy and the first
  // product).
  load_query(range.first_seq);
  int query_seq = range.first_seq;
  int seq = -1;             // the sequence of the piece in progress
  bool piece_from_start = false;  // it began with the sequence's first stage
  bool piece_to_end = false;      // its last stage so far is the sequence's last
  for (int iter = 0; iter < num_iters; ++iter) {
    const int slot = iter % num_stages;
    sm90::WaitParity(sm90::SharedAddress(&full[slot]), (iter / num_stages) & 1);
    XLA_EXT_DECODE_STAMP(threadIdx.x == 0 && iter == 0, kStampFirstFull);
    const StageInfo info = stage_infos[slot];
    const uint32_t valid = valid_masks[slot];
    if (info.seq != seq) {
      if (seq >= 0) write_piece(seq, piece_from_start && piece_to_end);
      seq = info.seq;
      seq_len = info.seq_len;
      seq_first_unit =
          range.begin + iter -
          (info.first_token / kStageTokens - SkippedStages(p.window, info.seq_len));
      piece_from_start = (info.flags & kFirstStage) != 0;
      if (seq != query_seq) {
        load_query(seq);
        query_seq = seq;
      }
      reset();
    }
    piece_to_end = (info.flags & kLastStage) != 0;
    const uint32_t stage_base = sm90::SharedAddress(stages + slot * layout.stage_bytes);
    const uint32_t k_base = stage_base + k_offset;
    const uint32_t v_base = stage_base + v_offset;

    // S (16 query rows x 16 tokens) = Q K^T, as two n8 tiles of tokens.
    float s[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
#pragma unroll
    for (int step = 0; step < kSteps; ++step) {
      uint32_t b[4];
      sm90::LoadMatrixX4(b, k_base + k_lane + step * 16 * sizeof(T));
      sm90::Mma16816<T>(s[0], qa[step], b[0], b[1], s[0]);
      sm90::Mma16816<T>(s[1], qa[step], b[2], b[3], s[1]);
    }

    // Logits, masked; then the online softmax update per row.
    // Calls fn(n, i, r) for each of this lane's scores s[n][i]; r: its row, 0 (lo) or 1 (hi).
    const auto for_each_score = [&](auto fn) {
#pragma unroll
      for (int n = 0; n < 2; ++n)
#pragma unroll
        for (int i = 0; i < 2 * kRows; ++i) fn(n, i, i / 2);
    };
    float tile_max[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) tile_max[r] = -INFINITY;
    for_each_score([&](int n, int i, int r) {
      const int column = col + i % 2;  // of tile n: token 2 * column + n of the stage
      // Padding rows still need a finite logit; their results are never written.
      const int head = first_head + min(row + 8 * r, group - 1);
      const float logit =
          (valid >> (n * 8 + column)) & 1u
              ? Logit(p, s[n][i], head, info.first_token + 2 * column + n, info.seq_len)
              : -INFINITY;
      s[n][i] = logit;
      tile_max[r] = fmaxf(tile_max[r], logit);
    });
    float scale_old[kRows], base[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 1));
      tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 2));
      const float new_max = fmaxf(running_max[r], tile_max[r]);
      base[r] = new_max == -INFINITY ? 0.0f : new_max;  // nothing valid yet: all weights 0
      scale_old[r] = __expf(running_max[r] - base[r]);
      running_max[r] = new_max;
      running_sum[r] *= scale_old[r];
    }
    for_each_score([&](int n, int i, int r) {
      s[n][i] = __expf(s[n][i] - base[r]);
      running_sum[r] += s[n][i];
    });
#pragma unroll
    for (int n = 0; n < kTiles; ++n)
#pragma unroll
      for (int i = 0; i < 2 * kRows; ++i) o[n][i] *= scale_old[i / 2];

    // O += P V: P's A fragment is S's accumulators (k rows 0-7: tile 0, 8-15: tile 1),
    // rounded to T.
    const uint32_t pa[4] = {
        sm90::Pack<T>(s[0][0], s[0][1]), kHighRows ? sm90::Pack<T>(s[0][2], s[0][3]) : 0u,
        sm90::Pack<T>(s[1][0], s[1][1]), kHighRows ? sm90::Pack<T>(s[1][2], s[1][3]) : 0u};
    // A skipped token's V row holds whatever the buffer held (at first, anything; a NaN times
    // P's 0 is NaN): its elements are cleared in the B fragments, which hold k rows col and
    // col + 1 (low and high halves), and 8 more. (The producer zeroing them holds up the
    // stage's arrive: on 64 x 1 + 16 x 4096, whose one-token stages skip 15 tokens, 132-145 us
    // against 107-111 us this way on the H100.)
    const auto row_pair_mask = [&](int k) {
      return ((valid >> k) & 1u ? 0x0000ffffu : 0u) | ((valid >> (k + 1)) & 1u ? 0xffff0000u : 0u);
    };
    const uint32_t v_mask_lo = row_pair_mask(col);
    const uint32_t v_mask_hi = row_pair_mask(col + 8);
#pragma unroll
    for (int n = 0; n < kTiles; n += 2) {
      uint32_t b[4];
      sm90::LoadMatrixX4Transposed(b, v_base + v_lane + n * 8 * sizeof(T));
      b[0] &= v_mask_lo;  // k rows 0-7 (matrices 0 and 2), then 8-15
      b[1] &= v_mask_hi;
      b[2] &= v_mask_lo;
      b[3] &= v_mask_hi;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        float* acc = o[n + half];
        float c[4] = {acc[0], acc[1], kHighRows ? acc[2] : 0.0f, kHighRows ? acc[3] : 0.0f};
        sm90::Mma16816<T>(c, pa, b[2 * half], b[2 * half + 1], c);
        acc[0] = c[0];
        acc[1] = c[1];
        if constexpr (kHighRows) {
          acc[2] = c[2];
          acc[3] = c[3];
        }
      }
    }

    // This thread is done with the buffer; the producer refills it once every consumer is.
    sm90::Arrive(sm90::SharedAddress(&empty[slot]));
    XLA_EXT_DECODE_STAMP(threadIdx.x == 0 && iter == 0, kStampFirstStage);
  }
  XLA_EXT_DECODE_STAMP(threadIdx.x == 0, kStampStagesDone);

  // The combine kernel may start launching (it waits for this grid to finish).
  sm90::LaunchDependents();
  write_piece(seq, piece_from_start && piece_to_end);
  finish();
  XLA_EXT_DECODE_STAMP(threadIdx.x == 0, kStampExit);
#else
  __trap();  // launched only on sm_90 and newer (see Supported)
#endif
}

// The tuning knobs (kernels/common/tuning.h): kv heads per CTA at most, and the shared memory a
// CTA's stage ring may use.
constexpr int kKvHeadsPerCta = tuning::kDecodeKvHeadsPerCta;
constexpr int kSharedBudgetBytes = tuning::kDecodeSharedKb * 1024;
// Consumer warps (one per kv head of a CTA) an SM should hold at least: a CTA of fewer kv heads
// gets a smaller share of shared memory, so that more CTAs fit. With one CTA of the largest
// ring per SM, a GPU holding one kv head (a tensor-parallel shard) has one consumer warp per
// SM, whose stages' arithmetic runs one after another (H100, TP=8 shard of the decode mixes:
// 22.9 us at 1, 14.0 at 8; TP=2: 42.5 and 36.0; 8 kv heads per GPU do not change).
constexpr int kMinConsumerWarpsPerSm = tuning::kDecodeMinConsumerWarpsPerSm;
static_assert(kKvHeadsPerCta >= 1 && kKvHeadsPerCta <= kMaxKvHeadsPerCta,
              "the kernel's launch bounds allow at most kMaxKvHeadsPerCta consumer warps");

// Shared memory the driver keeps for itself per resident CTA (sm_80 and later).
constexpr int kReservedSharedBytes = 1024;

// A call's launch: its CTA shape, and the CTAs that share the batch's tokens (per group of kv
// heads).
struct Plan {
  int kv_heads_per_cta = 1;
  int num_stages = 0;
  int workers = 1;
  int ctas_per_sm = 1;
  Layout layout{};
};

// The plan with `kv_heads` consecutive kv heads per CTA (nullopt if two stages do not fit in
// shared memory): as many stages as the budget holds, and as many CTAs as fill every CTA slot
// of the GPU once (each CTA keeps several stages in flight, so one wave streams at full
// bandwidth, and a single wave has no tail). The kernel splits the tokens between them.
template <typename T, int kHeadSize, bool kHighRows, typename Batch>
std::optional<Plan> PlanFor(int num_kv_heads, bool kv_interleaved, int block_size,
                            const cuda::DeviceInfo& device, int kv_heads) {
  Plan plan;
  plan.kv_heads_per_cta = kv_heads;
  plan.layout = Layout::For(kv_heads, num_kv_heads, kHeadSize, sizeof(T), kv_interleaved,
                            block_size);
  const int ctas_per_sm_wanted =
      cuda::CeilDiv(kMinConsumerWarpsPerSm, kv_heads);
  const int share = ctas_per_sm_wanted == 1
                        ? device.max_shared_bytes
                        : device.max_shared_bytes / ctas_per_sm_wanted - kReservedSharedBytes;
  const int budget = std::min(kSharedBudgetBytes, share);
  plan.num_stages =
      std::clamp((budget - kHeaderBytes) / plan.layout.stage_bytes, 2, kMaxStages);
  while (plan.num_stages >= 2 &&
         SharedBytes(plan.layout, plan.num_stages) > device.max_shared_bytes) {
    --plan.num_stages;
  }
  if (plan.num_stages < 2) return std::nullopt;

  const int ctas_per_sm = cuda::CtasPerSm(
      reinterpret_cast<const void*>(&AttendTensorCoreKernel<T, kHeadSize, kHighRows, Batch>),
      device, (kv_heads + 1) * 32, SharedBytes(plan.layout, plan.num_stages));
  if (ctas_per_sm == 0) return std::nullopt;
  plan.ctas_per_sm = ctas_per_sm;
  plan.workers = static_cast<int>(
      std::max<int64_t>(1, int64_t{device.sms} * ctas_per_sm / (num_kv_heads / kv_heads)));
  return plan;
}

// The plan for f16/bf16 on Hopper and newer with GQA groups of up to kMaxGroupSize, or nullopt.
// Every kv head of a token in one CTA (up to the knob) streams whole token rows and lets the
// kernel prefetch whole blocks into L2.
template <typename T, int kHeadSize, typename Batch>
std::optional<Plan> MakePlan(int num_kv_heads, int group_size, bool kv_interleaved,
                             int block_size, const cuda::DeviceInfo& device) {
  if constexpr (std::is_same_v<T, float>) {
    return std::nullopt;
  } else {
    if (device.major < 9 || group_size > kMaxGroupSize) return std::nullopt;
    const auto plan_for = [&](int kv_heads) {
      return group_size > 8 ? PlanFor<T, kHeadSize, true, Batch>(
                                  num_kv_heads, kv_interleaved, block_size, device, kv_heads)
                            : PlanFor<T, kHeadSize, false, Batch>(
                                  num_kv_heads, kv_interleaved, block_size, device, kv_heads);
    };
    int kv_heads = kKvHeadsPerCta;
    while (kv_heads > 1 && num_kv_heads % kv_heads != 0) kv_heads /= 2;
    std::optional<Plan> plan = plan_for(kv_heads);
    while (!plan.has_value() && kv_heads > 1) {
      kv_heads /= 2;
      plan = plan_for(kv_heads);
    }
    return plan;
  }
}

// Records the plan's pieces need per query head: CTA + sequence (balanced_split.cuh).
inline int64_t NumRecords(const Plan& plan, int64_t num_seqs) { return plan.workers + num_seqs; }

// Launches the attention kernel. `p` holds the records (NumRecords) and seq_records
// (num_seqs); the combine (LaunchCombine, or the caller's) must come behind it.
template <typename T, int kHeadSize, typename Batch>
void LaunchAttention(const Params& params, const Batch& batch, const Plan& plan,
                     cudaStream_t stream) {
  Params p = params;
  p.min_cta_stages = MinCtaStages();
  const dim3 grid(static_cast<unsigned>(plan.workers),
                  static_cast<unsigned>(p.num_kv_heads / plan.kv_heads_per_cta));
  const int shared_bytes = SharedBytes(plan.layout, plan.num_stages);
  const dim3 block((plan.kv_heads_per_cta + 1) * 32);
  if (p.num_heads / p.num_kv_heads > 8) {
    cuda::LaunchProgrammatic(AttendTensorCoreKernel<T, kHeadSize, true, Batch>, grid, block,
                             shared_bytes, stream, p, batch, plan.layout, plan.num_stages);
  } else {
    cuda::LaunchProgrammatic(AttendTensorCoreKernel<T, kHeadSize, false, Batch>, grid, block,
                             shared_bytes, stream, p, batch, plan.layout, plan.num_stages);
  }
}

// Launches the attention kernel and, behind it, the combine.
template <typename T, int kHeadSize, typename Batch>
void Launch(const Params& p, const Batch& batch, const Plan& plan, cudaStream_t stream) {
  LaunchAttention<T, kHeadSize>(p, batch, plan, stream);
  LaunchCombine<T, kHeadSize>(p, batch, static_cast<int64_t>(p.num_seqs) * p.num_heads, stream);
}

}  // namespace xla_ext::attention::decode::tensor_core

#endif  // XLA_EXT_KERNELS_ATTENTION_DECODE_TENSOR_CORE_CUH_
