// Ragged paged attention on Hopper's warpgroup MMA (wgmma, FlashAttention-3's operand layout)
// for f16/bf16 queries and caches of head_dim 64 and 128: prefill chunks (decodes go to the
// decode-step kernel: decode_steps.cuh) over the tiles and (tile, stage) units of
// tiled_batch.cuh, split between the CTAs on the device by the actual q and kv lengths.
// - A CTA is two consumer warpgroups and a producer warpgroup. A tile is 128 rows, 64 per consumer
//   warpgroup; its query rows wait in shared memory as wgmma's A operand for S = Q K^T
//   (m64n128k16, one stage's 128 positions), and P, rounded from S's accumulators in
//   registers, is the A operand of O += P V (m64nDk16). K and V are read by the MMAs from shared
//   memory through descriptors. The softmax works on S's accumulators in place (with Q in
//   registers, S and the weights apart and 64-position stages, as this kernel was first, it
//   took prefill 4 x 2048 517 us on the H100; each of those steps cost a copy or a wait per
//   stage). The mma.sync kernel
//   (tiled_tensor_core.cuh) loaded every B fragment with ldmatrix and stayed under a fifth
//   of the measured matmul rate on prefill.
// - Stages stream through a ring of kStages buffers, each a stage's K then its V in the
//   128-byte swizzle layout wgmma reads (per 64-column block, a position's row of 128 bytes,
//   its 16-byte chunks permuted by row): K-major for S, MN-major (transposed) for P V. The
//   producer warps write them with 16-byte cp.async copies, which can place each chunk where
//   the swizzle wants it (a bulk copy per row cannot) and write zeros instead of reading
//   positions past the tile's last one or in a page outside the cache (such positions also get
//   no weight, and stale cache bytes can hold NaNs that a zero weight would not cancel). A
//   buffer's `full` mbarrier completes when the producer's copies have landed (cp.async's
//   mbarrier arrive) and its positions' mask is written, its `empty` one when every consumer
//   thread's MMAs have read it.
// - A stage's P V runs on the tensor cores while the next stage's softmax runs on the
//   consumer's other units (FlashAttention-3's intra-warpgroup overlap), and the two consumer
//   warpgroups take turns to issue their MMAs (its ping-pong).
#ifndef XLA_EXT_KERNELS_ATTENTION_TILED_WARPGROUP_CUH_
#define XLA_EXT_KERNELS_ATTENTION_TILED_WARPGROUP_CUH_

#include <cmath>
#include <cstdint>

#include "kernels/attention/gpu_share.cuh"
#include "kernels/attention/tiled_batch.cuh"
#include "kernels/common/balanced_split.cuh"
#include "kernels/common/cuda_utils.cuh"
#include "kernels/common/sm90.cuh"
#include "kernels/common/warpgroup_mma.cuh"

namespace xla_ext::attention::ragged::warpgroup {

// Two consumer warpgroups and a producer warpgroup: 12 warps, three per SM sub-partition,
// which would cap every thread at 168 registers (O, S and Q take 128 at head_dim 128, and
// ptxas serialised the MMAs at 168). setmaxnreg moves them: a sub-partition's 16384 registers
// are one producer warp's 40 and two consumer warps' 232.
constexpr int kConsumerWarpgroups = 2;
constexpr int kConsumerThreads = kConsumerWarpgroups * 128;
constexpr int kProducerThreads = 128;
constexpr int kThreads = kConsumerThreads + kProducerThreads;
constexpr int kProducerRegisters = 40;
constexpr int kConsumerRegisters = 232;
constexpr int kTileRows = kConsumerWarpgroups * 64;
constexpr int kMaxStages = 4;
constexpr int kTurnBarrier = 1;   // named barriers 1 and 2: warpgroup 0's and 1's turn to issue
constexpr int kQueryBarrier = 3;  // 3 and 4: warpgroup 0's and 1's query rows are in place
constexpr int kStageTokens = 128;  // S is m64n128: one stage; P V takes it in 8 k16 steps
using tiled::Params;
using UnitWalk = tiled::UnitWalk<kStageTokens>;

// Head sizes it has: whole 128-byte swizzle rows, and O's accumulators within the registers.
constexpr bool HasHeadDim(int head_dim) { return head_dim == 64 || head_dim == 128; }

// Shared memory: per stage a `full` and an `empty` mbarrier and the mask of its positions that
// have a row, the scheduler's scratch, then (1024-byte aligned, as the swizzle needs) each
// consumer warpgroup's query rows and the stages, as many as fit (up to kMaxStages). All of it
// dynamic: static shared memory would lower the dynamic maximum.
constexpr int kMaxSharedBytes = 227 * 1024;  // a CTA's on compute capability 9.0
constexpr int kScheduleScratchInts = cuda::balanced::ScratchInts(kThreads);
constexpr int kSwizzleRowBytes = 128;
constexpr int kSwizzleAtomBytes = 8 * kSwizzleRowBytes;

template <typename T, int kHeadDim>
struct Layout {
  static_assert(sizeof(T) == 2 && HasHeadDim(kHeadDim));
  static constexpr int kBlockColumns = kSwizzleRowBytes / sizeof(T);
  static constexpr int kBlocks = kHeadDim / kBlockColumns;                // per row
  static constexpr int kQueryBlockBytes = 64 * kSwizzleRowBytes;          // a warpgroup's block
  static constexpr int kQueryBytes = kConsumerWarpgroups * kBlocks * kQueryBlockBytes;
  static constexpr int kBlockBytes = kStageTokens * kSwizzleRowBytes;     // a stage's block
  static constexpr int kPartBytes = kBlocks * kBlockBytes;                // a stage's K (or V)
  static constexpr int kStageBytes = 2 * kPartBytes;
  static constexpr int HeaderBytes(int stages) {
    return (stages * (2 * sizeof(uint64_t) + sizeof(uint4)) +
            kScheduleScratchInts * sizeof(int) + 15) / 16 * 16;
  }
  static constexpr int SharedBytes(int stages) {
    return HeaderBytes(stages) + kSwizzleAtomBytes + kQueryBytes + stages * kStageBytes;
  }
  static constexpr int kStages = SharedBytes(kMaxStages) <= kMaxSharedBytes ? kMaxStages
                                 : SharedBytes(3) <= kMaxSharedBytes        ? 3
                                                                            : 2;
  static constexpr int kHeaderBytes = HeaderBytes(kStages);
  static constexpr int kSharedBytes = SharedBytes(kStages);
  static_assert(kSharedBytes <= kMaxSharedBytes);
};

template <typename T, int kHeadDim>
__global__ void __launch_bounds__(kThreads, 1) AttendKernel(Params p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  namespace sm90 = cuda::sm90;
  namespace wg = cuda::warpgroup;
  using L = Layout<T, kHeadDim>;
  constexpr int kStages = L::kStages;
  constexpr int kSteps = kHeadDim / 16;          // k16 steps of Q K^T
  constexpr int kOutRegs = kHeadDim / 2;         // O's accumulators per thread
  constexpr int kScoreRegs = kStageTokens / 2;   // S's
  constexpr int kChunks = 2 * kHeadDim * sizeof(T) / 16;  // of a position's K and V rows
  constexpr int kPositionsPerCopy = 32 / kChunks;         // per cp.async of the warp
  extern __shared__ __align__(16) unsigned char smem[];
  uint64_t* full = reinterpret_cast<uint64_t*>(smem);  // a stage's rows have landed
  uint64_t* empty = full + kStages;                      // every consumer is done with it
  uint4* stage_masks = reinterpret_cast<uint4*>(empty + kStages);  // positions with a row
  int* schedule_scratch = reinterpret_cast<int*>(stage_masks + kStages);
  const uint32_t smem_address = sm90::SharedAddress(smem);
  const uint32_t query_address =
      (smem_address + L::kHeaderBytes + kSwizzleAtomBytes - 1) / kSwizzleAtomBytes *
      kSwizzleAtomBytes;
  const uint32_t stages_address = query_address + L::kQueryBytes;

  const int kv_head = blockIdx.y;
  // Broadcast from lane 0: ptxas then knows it is warp-uniform, and so are the branches on it
  // and what is computed under them (the MMA descriptors stay in uniform registers: 10 us
  // less on prefill 4 x 2048).
  const int warp = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x / 32), 0);
  const int lane = threadIdx.x % 32;
  const int group = p.group_size;
  if (threadIdx.x == 0) {
    for (int slot = 0; slot < kStages; ++slot) {
      // The producer threads' cp.async arrivals and each producer warp's lane 0's, which
      // publishes its quarter of the mask.
      sm90::BarrierInit(sm90::SharedAddress(&full[slot]), kProducerThreads + 4);
      sm90::BarrierInit(sm90::SharedAddress(&empty[slot]), kConsumerThreads);
    }
    sm90::FenceBarrierInit();
  }
  sm90::LaunchDependents();  // the decode-step kernel (gpu_share.cuh) or the combine
  const int num_seqs = NumSeqs(p);
  const OwnedRows owned_rows = OwnedRowsOf(p, num_seqs);
  // (Its barriers also publish the mbarrier initialisation to the CTA.)
  const cuda::balanced::Range range =
      LocateTiledRange<kStageTokens>(p, owned_rows, num_seqs, schedule_scratch);
  if (range.begin >= range.end) return;  // more CTAs than units
  const int num_iters = range.end - range.begin;

  if (warp >= kConsumerThreads / 32) {
    // Producer warpgroup; its registers go to the consumers. Producer warp w looks up, lane l,
    // the cache row of position 32 w + l of a stage (the page ids of the next stage before
    // waiting for its buffer); then each of its cp.async copies kPositionsPerCopy positions'
    // K and V rows, lane l taking chunk l % kChunks of position l / kChunks, its cache row
    // taken from the lane that looked it up.
    wg::SetMaxRegisters<kProducerRegisters, false>();
    const int producer_warp = warp - kConsumerThreads / 32;
    const int quarter = kStageTokens / 4 * producer_warp;  // the warp's first position
    const T* kv = static_cast<const T*>(p.kv_pages) + int64_t{2} * kv_head * kHeadDim;
    const int64_t position_stride = int64_t{2} * p.num_kv_heads * kHeadDim;  // elements
    const int chunk = lane % kChunks;
    const int part = chunk / (kChunks / 2);  // K or V
    const int part_chunk = chunk % (kChunks / 2);
    const int lane_pos = lane / kChunks;  // copy c's position is kPositionsPerCopy c + this
    const uint32_t lane_dst = part * L::kPartBytes + part_chunk / 8 * L::kBlockBytes +
                              (quarter + lane_pos) * kSwizzleRowBytes;
    // (kPositionsPerCopy c is even where lane_pos is not 0: their sum's last bits are an or.)
    const uint32_t lane_swizzle = ((part_chunk % 8) ^ lane_pos) << 4;
    const int lane_src = part * kHeadDim + part_chunk * 8;  // of the position's K row
    UnitWalk loads;
    loads.Start(p, owned_rows, range.first_seq, range.first_seq_begin, range.begin);
    // The cache row (page * page_size + offset: the host checks it fits in int) of position
    // quarter + lane, or -1: past the tile's last position or in a page outside the cache.
    const auto cache_row = [&]() {
      const int pos = loads.FirstPosition() + quarter + lane;
      const int32_t* pages = p.page_indices + static_cast<int64_t>(loads.seq) * p.pages_per_seq;
      const int page = pos < loads.t.first_pos + loads.t.tokens
                           ? __ldg(pages + (pos >> p.log2_page_size))
                           : -1;
      return page >= 0 && page < p.num_pages
                 ? (page << p.log2_page_size) + (pos & ((1 << p.log2_page_size) - 1))
                 : -1;
    };
    int row = cache_row();
    for (int iter = 0; iter < num_iters; ++iter) {
      const int slot = iter % kStages;
      // The looked-up position's K row (the cache's first when it has none: an address that
      // is not read), which each copy takes from the lane that looked it up, with its bit of
      // has_row.
      const uint64_t row_src = reinterpret_cast<uint64_t>(
          kv + static_cast<int64_t>(max(row, 0)) * position_stride);
      const uint32_t has_row = __ballot_sync(0xffffffffu, row >= 0);
      const uint32_t lane_has_row = has_row >> lane_pos;
      int next = -1;
      if (iter + 1 < num_iters) {
        loads.Next(p);
        next = cache_row();
      }
      if (iter >= kStages) {
        sm90::WaitParity(sm90::SharedAddress(&empty[slot]), (iter / kStages - 1) & 1);
      }
      const uint32_t stage = stages_address + slot * L::kStageBytes + lane_dst;
#pragma unroll
      for (int copy = 0; copy < kStageTokens / 4 / kPositionsPerCopy; ++copy) {
        const int first = copy * kPositionsPerCopy;  // the copy's first position, of the quarter
        const T* src =
            reinterpret_cast<const T*>(__shfl_sync(0xffffffffu, row_src, first + lane_pos));
        const uint32_t dst =
            stage + first * kSwizzleRowBytes + (lane_swizzle ^ ((first % 8) << 4));
        sm90::CopyAsync16(dst, src + lane_src, (lane_has_row >> first) & 1u ? 16 : 0);
      }
      const uint32_t barrier = sm90::SharedAddress(&full[slot]);
      sm90::CopyAsyncArrive(barrier);
      if (lane == 0) {
        reinterpret_cast<uint32_t*>(&stage_masks[slot])[producer_warp] = has_row;
        sm90::Arrive(barrier);
      }
      row = next;
    }
    return;
  }
  wg::SetMaxRegisters<kConsumerRegisters, true>();

  UnitWalk work;
  work.Start(p, owned_rows, range.first_seq, range.first_seq_begin, range.begin);
  const int warpgroup_index = warp / 4;
  if (warpgroup_index == 1) {  // the first turn is warpgroup 0's
    sm90::NamedBarrierArrive(kTurnBarrier, kConsumerThreads);
  }

  // Rows of this thread: lo = 64 * warpgroup + 16 * (warp % 4) + lane / 4 and hi = lo + 8; S's
  // and O's register 4 j + i holds row (lo, lo, hi, hi)[i], column 8 j + 2 * (lane % 4) + i % 2,
  // and P's A fragments columns 2 * (lane % 4) + {0, 1} and + 8 of each k16 step.
  const int col = 2 * (lane % 4);
  const int first_row = 64 * warpgroup_index;
  const int warp_row = first_row + 16 * (warp % 4);
  int rows[2] = {warp_row + lane / 4, warp_row + lane / 4 + 8};
  // The warpgroup's query rows, K-major in the swizzle layout (a block per 64 columns).
  const uint32_t query_rows = query_address + warpgroup_index * L::kBlocks * L::kQueryBlockBytes;
  unsigned char* query_smem = smem + (query_rows - smem_address);
  const uint64_t q_desc = wg::Swizzle128Descriptor(query_rows, 16, kSwizzleAtomBytes);
  float running_max[2], running_sum[2];
  // O; until the tile's first P V (which overwrites it) empty, reading as zeros: ptxas
  // serialised the MMAs when other instructions cleared the accumulators.
  float o[kOutRegs];
  bool o_empty = true;
  // The tile in progress: its rows' tokens (in the batch; -1: a row past its tokens) and
  // positions, and the positions the warpgroup's and the warp's rows may see (last -1: none).
  int row_token[2], row_pos[2];
  int group_first_pos = 0, group_last_pos = -1, warp_first_pos = 0, warp_last_pos = -1;
  int piece_first_unit = 0;  // where this CTA's piece of it started
  bool piece_from_start = false;

  // The query rows this thread copies to shared memory at each tile's start: 16-byte chunk
  // `q_chunk` of rows q_row + kRowsPerPass * pass of the warpgroup's, the first one's token
  // within the tile and query head within the group (the tile's layout is the same for every
  // tile: each pass steps them on, no division).
  constexpr int kRowChunks = kHeadDim / 8;
  constexpr int kRowsPerPass = 128 / kRowChunks;
  const int q_chunk = threadIdx.x % kRowChunks;
  const int q_row = threadIdx.x % 128 / kRowChunks;
  const int q_token = (first_row + q_row) / group;
  const int q_head = (first_row + q_row) % group;
  const int q_step_tokens = kRowsPerPass / group, q_step_heads = kRowsPerPass % group;

  const auto start_tile = [&](const UnitWalk& w) {
    const int first_token = w.s.q_start + w.t.first_token;
    // The warpgroup's query rows to shared memory (zeros for rows past the tile), once its MMAs
    // of the previous tile are done reading them.
    sm90::NamedBarrierSync(kQueryBarrier + warpgroup_index, 128);
    int token = q_token, head = q_head;
#pragma unroll
    for (int pass = 0; pass < 64 / kRowsPerPass; ++pass) {
      const int row = pass * kRowsPerPass + q_row;  // of the warpgroup's
      uint4 value = make_uint4(0u, 0u, 0u, 0u);
      if (token < w.t.tokens) {
        value = *reinterpret_cast<const uint4*>(
            static_cast<const T*>(p.q) +
            (static_cast<int64_t>(first_token + token) * p.num_q_heads + kv_head * group + head) *
                kHeadDim +
            q_chunk * 8);
      }
      *reinterpret_cast<uint4*>(query_smem + q_chunk / 8 * L::kQueryBlockBytes +
                                row * kSwizzleRowBytes + (((q_chunk % 8) ^ (row % 8)) << 4)) =
          value;
      token += q_step_tokens;
      head += q_step_heads;
      if (head >= group) {
        head -= group;
        ++token;
      }
    }
    // Written through the generic proxy, read by wgmma through the async one.
    sm90::FenceProxyAsync();
    sm90::NamedBarrierSync(kQueryBarrier + warpgroup_index, 128);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int token = rows[r] / group;
      row_token[r] = token < w.t.tokens ? first_token + token : -1;
      row_pos[r] = w.t.first_pos + token;
      running_max[r] = -INFINITY;
      running_sum[r] = 0.0f;
    }
    o_empty = true;
    // The positions of the first and last tokens among `count` rows from `row`.
    const auto span = [&](int row, int count, int& first_pos, int& last_pos) {
      first_pos = w.t.first_pos + row / group;
      last_pos = row / group < w.t.tokens
                     ? w.t.first_pos + min((row + count - 1) / group, w.t.tokens - 1)
                     : -1;
    };
    span(first_row, 64, group_first_pos, group_last_pos);
    span(warp_row, 16, warp_first_pos, warp_last_pos);
    tiled::AnnounceTile(p, w, range);
  };

  // Writes this CTA's piece of the tile: `out` itself when it is the whole tile, else its
  // record.
  const auto finish_tile = [&](bool whole) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      running_sum[r] += __shfl_xor_sync(0xffffffffu, running_sum[r], 1);
      running_sum[r] += __shfl_xor_sync(0xffffffffu, running_sum[r], 2);
      if (row_token[r] < 0) continue;
      const int head = kv_head * group + rows[r] % group;
      if (whole) {
        const float scale = running_sum[r] > 0.0f ? p.v_scale / running_sum[r] : 0.0f;
        uint32_t* dst = reinterpret_cast<uint32_t*>(
            static_cast<T*>(p.out) +
            (static_cast<int64_t>(row_token[r]) * p.num_q_heads + head) * kHeadDim + col);
#pragma unroll
        for (int n = 0; n < kHeadDim / 8; ++n) {
          dst[n * 4] = o_empty ? 0u
                               : sm90::Pack<T>(o[4 * n + 2 * r] * scale,
                                               o[4 * n + 2 * r + 1] * scale);
        }
      } else {
        const int64_t at = tiled::RecordRow(p, range, piece_first_unit, rows[r]);
        float2* dst = reinterpret_cast<float2*>(p.partial_out + at * kHeadDim + col);
#pragma unroll
        for (int n = 0; n < kHeadDim / 8; ++n) {
          dst[n * 4] = o_empty ? make_float2(0.0f, 0.0f)
                               : make_float2(o[4 * n + 2 * r], o[4 * n + 2 * r + 1]);
        }
        if (lane % 4 == 0) {
          p.partial_max[at] = running_max[r];
          p.partial_sum[at] = running_sum[r];
        }
      }
    }
  };

  // A score's logit in log2 units: scaled (or soft-capped), times log2 e.
  const float log2_scale = p.score_scale * cuda::kLog2e;
  const float cap_scale = p.soft_cap > 0.0f ? p.score_scale / p.soft_cap : 0.0f;
  const float log2_cap = p.soft_cap * cuda::kLog2e;

  // O += P V for the stage in `slot`, V MN-major: a k16 step is 16 rows of 128 bytes, column
  // blocks kBlockBytes apart. Issued only; the caller commits and waits.
  // (A descriptor's address field is the address / 16 in its low bits: offsets within the
  // shared memory add to it.)
  const auto issue_pv = [&](const uint32_t (&pa)[kStageTokens / 16][4], int slot) {
    const uint64_t v_desc =
        wg::Swizzle128Descriptor(stages_address + slot * L::kStageBytes + L::kPartBytes,
                                 L::kBlockBytes, kSwizzleAtomBytes);
#pragma unroll
    for (int step = 0; step < kStageTokens / 16; ++step) {
      wg::MmaAsync<T, kHeadDim, 1>(o, pa[step], v_desc + step * 16 * kSwizzleRowBytes / 16,
                                   step > 0 || !o_empty);
    }
    o_empty = false;
  };
  const auto release = [&](int slot) { sm90::Arrive(sm90::SharedAddress(&empty[slot])); };

  // A stage's P V is issued with the next stage's S and runs while that S's softmax does (as in
  // FlashAttention-3): P waits in `pa` meanwhile, its V in `pending_slot`, whose buffer is
  // released when the MMA is done.
  uint32_t pa[kStageTokens / 16][4];
  int pending_slot = -1;
  const auto flush_pv = [&] {
    if (pending_slot < 0) return;
    wg::FenceOperands(o);
    wg::Fence();
    issue_pv(pa, pending_slot);
    wg::Commit();
    wg::Wait<0>();
    wg::FenceOperands(o);
    release(pending_slot);
    pending_slot = -1;
  };

  for (int iter = 0; iter < num_iters; ++iter) {
    const int slot = iter % kStages;
    sm90::WaitParity(sm90::SharedAddress(&full[slot]), (iter / kStages) & 1);
    const uint4 mask = stage_masks[slot];

    if (work.stage == 0 || iter == 0) {
      start_tile(work);
      piece_first_unit = range.begin + iter;
      piece_from_start = work.stage == 0;
    }
    const int first_pos = work.FirstPosition();
    // The same for the 4 warps of the warpgroup, whose MMAs are collective.
    const bool visible =
        first_pos <= group_last_pos &&
        (p.sliding_window == 0 ||
         first_pos + kStageTokens - 1 > group_first_pos - p.sliding_window);
    // The consumer warpgroups take turns to issue their MMAs (FlashAttention-3's ping-pong), so
    // that one's softmax runs while the other's MMAs do; every stage, visible or not.
    sm90::NamedBarrierSync(kTurnBarrier + warpgroup_index, kConsumerThreads);
    if (visible) {
      // cp.async wrote the stage through the generic proxy; wgmma reads it through the async
      // one.
      sm90::FenceProxyAsync();
      const uint64_t k_desc = wg::Swizzle128Descriptor(stages_address + slot * L::kStageBytes,
                                                       16, kSwizzleAtomBytes);

      // S (64 rows x 128 positions) = Q K^T, both K-major: a k16 step is 32 bytes of a 128-byte
      // row; then the previous stage's P V. S's accumulators (step 0 overwrites them) become
      // the weights in place.
      float s[kScoreRegs];
      const auto issue_s = [&] {
        wg::FenceOperands(o);
        wg::Fence();
#pragma unroll
        for (int step = 0; step < kSteps; ++step) {
          wg::MmaAsync<T>(s, q_desc + (step / 4 * L::kQueryBlockBytes + step % 4 * 32) / 16,
                          k_desc + (step / 4 * L::kBlockBytes + step % 4 * 32) / 16, step > 0);
        }
        wg::Commit();
      };
      // (Each branch a whole sequence of issues and a wait: ptxas serialises MMAs issued
      // under a condition between others.)
      if (pending_slot >= 0) {
        issue_s();
        issue_pv(pa, pending_slot);
        wg::Commit();
        sm90::NamedBarrierArrive(kTurnBarrier + 1 - warpgroup_index, kConsumerThreads);
        wg::Wait<1>();  // S; P V may still run
      } else {
        issue_s();
        sm90::NamedBarrierArrive(kTurnBarrier + 1 - warpgroup_index, kConsumerThreads);
        wg::Wait<0>();
      }

      // Scores masked (causal, window, positions without a page, rows past the tile) unless
      // every row of the warp sees the whole stage, then the online softmax in log2 units:
      // weights exp2(s * row_scale - max), the scale folded into the exponent's FMA (so the row
      // maxima are taken before it: a positive scale keeps them). A soft cap, or a scale that is
      // not positive, turns the scores into logits first. Each choice is made once per stage,
      // not per score: the per-score branches of the soft cap made the loop large enough to
      // stall on instruction fetch, as Nsight Compute's stall reasons showed.
      float row_scale = log2_scale;
      if (p.soft_cap > 0.0f) {
#pragma unroll
        for (int i = 0; i < kScoreRegs; ++i) s[i] = log2_cap * tanhf(s[i] * cap_scale);
        row_scale = 1.0f;
      } else if (!(log2_scale > 0.0f)) {
#pragma unroll
        for (int i = 0; i < kScoreRegs; ++i) s[i] = s[i] * log2_scale;
        row_scale = 1.0f;
      }
      const bool unmasked =
          (mask.x & mask.y & mask.z & mask.w) == 0xffffffffu &&
          first_pos + kStageTokens - 1 <= warp_first_pos &&
          (p.sliding_window == 0 || first_pos > warp_last_pos - p.sliding_window);
      if (!unmasked) {
        // Score i's position is first_pos + c + col, c = 8 (i / 4) + i % 2 (a constant): per
        // row, the visible c are [lo, hi], and its mask bit is bit c % 32 of word c / 32
        // shifted by col.
        int lo[2], hi[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          hi[r] = row_token[r] >= 0 ? row_pos[r] - first_pos - col : -kStageTokens;
          lo[r] = p.sliding_window > 0 ? row_pos[r] - p.sliding_window + 1 - first_pos - col
                                       : -kStageTokens;
        }
        const uint32_t words[4] = {mask.x >> col, mask.y >> col, mask.z >> col, mask.w >> col};
#pragma unroll
        for (int i = 0; i < kScoreRegs; ++i) {
          const int r = i % 4 / 2;
          const int c = i / 4 * 8 + i % 2;
          if (c < lo[r] || c > hi[r] || !((words[c / 32] >> (c % 32)) & 1u)) s[i] = -INFINITY;
        }
      }
      // Row maxima and sums in four partial chains each: short dependency chains.
      float tile_max[2][4];
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        float& m = tile_max[i % 4 / 2][i / 4 * 2 % 4 + i % 2];
        m = i < 8 ? s[i] : fmaxf(m, s[i]);
      }
#pragma unroll
      for (int i = 16; i < kScoreRegs; ++i) {
        float& m = tile_max[i % 4 / 2][i / 4 * 2 % 4 + i % 2];
        m = fmaxf(m, s[i]);
      }
      float scale_old[2], base[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float row_max = fmaxf(fmaxf(tile_max[r][0], tile_max[r][1]),
                              fmaxf(tile_max[r][2], tile_max[r][3]));
        row_max = fmaxf(row_max, __shfl_xor_sync(0xffffffffu, row_max, 1));
        row_max = fmaxf(row_max, __shfl_xor_sync(0xffffffffu, row_max, 2));
        const float new_max = fmaxf(running_max[r], row_max * row_scale);
        base[r] = new_max == -INFINITY ? 0.0f : new_max;  // nothing seen yet: all weights 0
        scale_old[r] = cuda::Exp2(running_max[r] - base[r]);
        running_max[r] = new_max;
      }
      float tile_sum[2][4];
#pragma unroll
      for (int i = 0; i < kScoreRegs; ++i) {
        s[i] = cuda::Exp2(fmaf(s[i], row_scale, -base[i % 4 / 2]));
        float& sum = tile_sum[i % 4 / 2][i / 4 * 2 % 4 + i % 2];
        sum = i < 8 ? s[i] : sum + s[i];
      }
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        running_sum[r] = running_sum[r] * scale_old[r] +
                         ((tile_sum[r][0] + tile_sum[r][1]) + (tile_sum[r][2] + tile_sum[r][3]));
      }
      wg::Wait<0>();  // the previous stage's P V (unconditional: ptxas tracks it so)
      wg::FenceOperands(o);
      if (pending_slot >= 0) release(pending_slot);
      // Once a prefill row's maximum has settled, most stages leave it alone.
      if (!o_empty && !__all_sync(0xffffffffu, scale_old[0] == 1.0f && scale_old[1] == 1.0f)) {
#pragma unroll
        for (int i = 0; i < kOutRegs; ++i) o[i] *= scale_old[i % 4 / 2];
      }
      // P's A fragment is the weights, rounded to T.
#pragma unroll
      for (int step = 0; step < kStageTokens / 16; ++step) {
        pa[step][0] = sm90::Pack<T>(s[8 * step + 0], s[8 * step + 1]);
        pa[step][1] = sm90::Pack<T>(s[8 * step + 2], s[8 * step + 3]);
        pa[step][2] = sm90::Pack<T>(s[8 * step + 4], s[8 * step + 5]);
        pa[step][3] = sm90::Pack<T>(s[8 * step + 6], s[8 * step + 7]);
      }
      pending_slot = slot;
    } else {
      sm90::NamedBarrierArrive(kTurnBarrier + 1 - warpgroup_index, kConsumerThreads);
      release(slot);  // nothing of it read
    }

    const bool tile_done = work.stage == work.t.stages - 1;
    if (tile_done || iter == num_iters - 1) {
      flush_pv();
      finish_tile(piece_from_start && tile_done);
    }
    if (iter + 1 < num_iters) work.Next(p);
  }
#else
  __trap();  // launched only on compute capability 9.x (see the plan)
#endif
}

}  // namespace xla_ext::attention::ragged::warpgroup

#endif  // XLA_EXT_KERNELS_ATTENTION_TILED_WARPGROUP_CUH_
