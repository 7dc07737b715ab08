// Where a small decode batch's attention call spends its time: the ragged op's decode-only path
// (decode_steps.cuh's DecodeOnlySteps on decode_tensor_core.cuh's kernel, the split sequences
// merged in the kernel), launched straight from CUDA with no framework around it.
//
//   nvcc ... -DXLA_EXT_DECODE_PHASE_STAMPS bench/decode_latency_probe.cu -o probe   (as
//   tools/device/run.sh decode_latency builds it)
//   ./probe [--batch B] [--length L] [--max-num-seqs M] [--padding-rows R] [--copies C]
//
// The 1B-class Llama's heads (32 query, 8 kv, head size 64), bf16, pages of 16 tokens, B
// sequences of L tokens among M slots (the engine pads its batch), one query row each. It
// prints:
// - the output's largest difference from a float64 reference on the host (the first 4
//   sequences' rows, the last one's, and the padding rows, which must be zeros), after the
//   first call and again after the timed ones;
// - the time per call of 20 calls replayed in a CUDA graph, each call on its own copy of the
//   cache (C copies: by default enough to exceed the L2, as in a serving step, where 15 other
//   layers' caches and all the weights pass through it between two calls of one layer), and
//   again with every call on one copy (its K/V stay in the L2);
// - built with XLA_EXT_DECODE_PHASE_STAMPS, each phase's time from a CTA's entry (the kernel's
//   StampPhase list), the median and the largest over the CTAs with work, of one call launched
//   after 19 others in a graph, and the spread of the CTAs' entries.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kernels/attention/batch_params.cuh"
#include "kernels/attention/decode_steps.cuh"
#include "kernels/attention/decode_tensor_core.cuh"
#include "kernels/common/cuda_utils.cuh"

namespace {

namespace tc = xla_ext::attention::decode::tensor_core;
using xla_ext::attention::ragged::BatchParams;
using xla_ext::attention::ragged::DecodeOnlySteps;
using T = __nv_bfloat16;

constexpr int kHeads = 32, kKvHeads = 8, kHeadSize = 64, kPageSize = 16, kLog2PageSize = 4;
constexpr int kCalls = 20;  // per graph

#define CHECK_CUDA(call)                                                                   \
  do {                                                                                     \
    const cudaError_t error = (call);                                                      \
    if (error != cudaSuccess) {                                                            \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call,                   \
                   cudaGetErrorString(error));                                             \
      std::exit(1);                                                                        \
    }                                                                                      \
  } while (false)

template <typename V>
V* DeviceCopy(const std::vector<V>& host) {
  V* device = nullptr;
  CHECK_CUDA(cudaMalloc(&device, std::max<size_t>(host.size(), 1) * sizeof(V)));
  CHECK_CUDA(cudaMemcpy(device, host.data(), host.size() * sizeof(V), cudaMemcpyHostToDevice));
  return device;
}

int IntFlag(int argc, char** argv, const char* name, int fallback) {
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::strcmp(argv[i], name) == 0) {
      const int value = std::atoi(argv[i + 1]);
      if (value < 0) {
        std::fprintf(stderr, "%s: expected a number >= 0, got %s\n", name, argv[i + 1]);
        std::exit(2);
      }
      return value;
    }
  }
  return fallback;
}

}  // namespace

int main(int argc, char** argv) {
  const int batch = IntFlag(argc, argv, "--batch", 1);
  const int length = IntFlag(argc, argv, "--length", 2048);
  if (batch < 1 || length < 1) {
    std::fprintf(stderr, "--batch and --length: expected at least 1, got %d and %d\n", batch,
                 length);
    return 2;
  }
  const int max_num_seqs = std::max(IntFlag(argc, argv, "--max-num-seqs", 64), batch);
  const int padding_rows = IntFlag(argc, argv, "--padding-rows", batch < 16 ? 16 - batch : 0);
  const int pages_per_seq = (length + kPageSize - 1) / kPageSize;
  const int64_t cache_bytes_per_copy =
      int64_t{batch} * pages_per_seq * kPageSize * 2 * kKvHeads * kHeadSize * sizeof(T);
  const int copies = std::max(
      1, IntFlag(argc, argv, "--copies",
                 static_cast<int>(std::min<int64_t>(64, (256 << 20) / cache_bytes_per_copy + 1))));
  const int num_tokens = batch + padding_rows;
  const int num_pages = copies * batch * pages_per_seq;
  const int64_t slot_elements = int64_t{2} * kKvHeads * kHeadSize;

  std::mt19937 rng(1234);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<T> q(int64_t{num_tokens} * kHeads * kHeadSize);
  for (T& x : q) x = __float2bfloat16(normal(rng));
  std::vector<T> kv(int64_t{num_pages} * kPageSize * slot_elements);
  for (T& x : kv) x = __float2bfloat16(normal(rng));
  // Copy c's table: sequence i's pages, shuffled within the copy's pages.
  std::vector<std::vector<int32_t>> tables(copies);
  for (int c = 0; c < copies; ++c) {
    std::vector<int32_t> pages(batch * pages_per_seq);
    for (size_t i = 0; i < pages.size(); ++i) pages[i] = c * batch * pages_per_seq + i;
    std::shuffle(pages.begin(), pages.end(), rng);
    tables[c].assign(int64_t{max_num_seqs} * pages_per_seq, 0);
    for (int s = 0; s < batch; ++s) {
      std::copy_n(pages.begin() + s * pages_per_seq, pages_per_seq,
                  tables[c].begin() + int64_t{s} * pages_per_seq);
    }
  }
  std::vector<int32_t> kv_lens(max_num_seqs, 0), cu_q_lens(max_num_seqs + 1, batch);
  for (int s = 0; s < batch; ++s) kv_lens[s] = length;
  for (int s = 0; s <= batch; ++s) cu_q_lens[s] = s;

  BatchParams batch_params{};
  batch_params.q = DeviceCopy(q);
  batch_params.kv_pages = DeviceCopy(kv);
  batch_params.kv_lens = DeviceCopy(kv_lens);
  batch_params.cu_q_lens = DeviceCopy(cu_q_lens);
  batch_params.num_seqs = DeviceCopy(std::vector<int32_t>{batch});
  std::vector<const int32_t*> table_of_copy;
  for (const auto& table : tables) table_of_copy.push_back(DeviceCopy(table));
  void* out = nullptr;
  CHECK_CUDA(cudaMalloc(&out, q.size() * sizeof(T)));
  batch_params.out = out;
  batch_params.num_tokens = num_tokens;
  batch_params.num_q_heads = kHeads;
  batch_params.num_kv_heads = kKvHeads;
  batch_params.group_size = kHeads / kKvHeads;
  batch_params.num_pages = num_pages;
  batch_params.log2_page_size = kLog2PageSize;
  batch_params.pages_per_seq = pages_per_seq;
  batch_params.max_num_seqs = max_num_seqs;
  batch_params.score_scale = 1.0f / std::sqrt(static_cast<float>(kHeadSize));
  batch_params.mask_value = -INFINITY;
  batch_params.v_scale = 1.0f;

  const std::optional<xla_ext::cuda::DeviceInfo> device = xla_ext::cuda::CurrentDeviceInfo();
  if (!device.has_value()) {
    std::fprintf(stderr, "no CUDA device\n");
    return 1;
  }
  const std::optional<tc::Plan> plan = tc::MakePlan<T, kHeadSize, DecodeOnlySteps>(
      kKvHeads, kHeads / kKvHeads, /*kv_interleaved=*/true, kPageSize, *device);
  if (!plan.has_value()) {
    std::fprintf(stderr, "the decode kernel has no plan on this device\n");
    return 1;
  }
  xla_ext::attention::decode::Params params =
      xla_ext::attention::ragged::DecodeStepParams(batch_params);
  params.num_records = static_cast<int>(tc::NumRecords(*plan, max_num_seqs));
  std::vector<int2> no_records(max_num_seqs);
  params.seq_records = DeviceCopy(no_records);
  const int64_t slots = int64_t{kHeads} * params.num_records;
  CHECK_CUDA(cudaMalloc(&params.partial_out, slots * kHeadSize * sizeof(float)));
  CHECK_CUDA(cudaMalloc(&params.partial_max, slots * sizeof(float)));
  CHECK_CUDA(cudaMalloc(&params.partial_sum, slots * sizeof(float)));
  params.fused_combine = true;
  std::printf("decode B=%d of %d slots, L=%d, %d padding rows, heads %d/%d/%d bf16: %d CTAs x %d "
              "kv-head groups of %d kv heads, %d stages of %d bytes, %d CTAs per SM; %d cache "
              "copies of %.1f MB\n",
              batch, max_num_seqs, length, padding_rows, kHeads, kKvHeads, kHeadSize,
              plan->workers, kKvHeads / plan->kv_heads_per_cta, plan->kv_heads_per_cta,
              plan->num_stages, plan->layout.stage_bytes, plan->ctas_per_sm, copies,
              cache_bytes_per_copy / 1e6);

  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const auto launch = [&](int copy) {
    xla_ext::attention::decode::Params p = params;
    BatchParams b = batch_params;
    b.page_indices = table_of_copy[copy];
    p.block_tables = b.page_indices;
    tc::LaunchAttention<T, kHeadSize>(p, DecodeOnlySteps{b}, *plan, stream);
    CHECK_CUDA(cudaGetLastError());
  };

  // The output of a call on copy 0 against a float64 reference: the largest difference.
  const auto check = [&]() {
    std::vector<T> poison(q.size(), __float2bfloat16(NAN));
    CHECK_CUDA(cudaMemcpy(out, poison.data(), poison.size() * sizeof(T), cudaMemcpyHostToDevice));
    launch(0);
    CHECK_CUDA(cudaStreamSynchronize(stream));
    std::vector<T> got(q.size());
    CHECK_CUDA(cudaMemcpy(got.data(), out, got.size() * sizeof(T), cudaMemcpyDeviceToHost));
    // Token t of sequence s in copy 0's table: its slot's first element (K of kv head 0).
    const auto token_row = [&](int s, int t) {
      const int64_t page = tables[0][int64_t{s} * pages_per_seq + t / kPageSize];
      return (page * kPageSize + t % kPageSize) * slot_elements;
    };
    double worst = 0.0;
    for (int s = 0; s < num_tokens; ++s) {
      if (s >= 4 && s < batch - 1) continue;  // the first 4 sequences, the last, the padding
      for (int h = 0; h < kHeads; ++h) {
        const int kv_head = h / (kHeads / kKvHeads);
        const int64_t k_offset = 2 * kv_head * kHeadSize, v_offset = k_offset + kHeadSize;
        std::vector<double> weights(s < batch ? length : 0);
        double top = -INFINITY;
        for (int t = 0; t < static_cast<int>(weights.size()); ++t) {
          double dot = 0.0;
          for (int d = 0; d < kHeadSize; ++d) {
            dot += double(__bfloat162float(q[(int64_t{s} * kHeads + h) * kHeadSize + d])) *
                   __bfloat162float(kv[token_row(s, t) + k_offset + d]);
          }
          weights[t] = dot * batch_params.score_scale;  // the logit, until the loop below
          top = std::max(top, weights[t]);
        }
        double den = 0.0;
        for (double& w : weights) {
          w = std::exp(w - top);
          den += w;
        }
        for (int d = 0; d < kHeadSize; ++d) {
          double num = 0.0;
          for (int t = 0; t < static_cast<int>(weights.size()); ++t) {
            num += weights[t] * __bfloat162float(kv[token_row(s, t) + v_offset + d]);
          }
          const double want = den > 0.0 ? num / den : 0.0;  // rows of no sequence are zeros
          const double diff = std::fabs(
              double(__bfloat162float(got[(int64_t{s} * kHeads + h) * kHeadSize + d])) - want);
          if (!(diff <= worst)) worst = std::isnan(diff) ? INFINITY : diff;
        }
      }
    }
    return worst;
  };
  const double worst_first = check();
  std::printf("largest difference from the float64 reference: %.3g (bf16 output)%s\n",
              worst_first, worst_first < 2e-2 ? "" : "  <-- WRONG");

  // Time per call: kCalls calls in a graph, replayed.
  const auto graph_us = [&](bool rotate) {
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CHECK_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    for (int i = 0; i < kCalls; ++i) launch(rotate ? i % copies : 0);
    CHECK_CUDA(cudaStreamEndCapture(stream, &graph));
    CHECK_CUDA(cudaGraphInstantiate(&exec, graph, 0));
    for (int i = 0; i < 5; ++i) CHECK_CUDA(cudaGraphLaunch(exec, stream));
    cudaEvent_t start, stop;
    CHECK_CUDA(cudaEventCreate(&start));
    CHECK_CUDA(cudaEventCreate(&stop));
    std::vector<float> times;
    for (int rep = 0; rep < 21; ++rep) {
      CHECK_CUDA(cudaEventRecord(start, stream));
      for (int i = 0; i < 10; ++i) CHECK_CUDA(cudaGraphLaunch(exec, stream));
      CHECK_CUDA(cudaEventRecord(stop, stream));
      CHECK_CUDA(cudaEventSynchronize(stop));
      float ms = 0.0f;
      CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
      times.push_back(1e3f * ms / (10 * kCalls));
    }
    std::sort(times.begin(), times.end());
    CHECK_CUDA(cudaGraphExecDestroy(exec));
    CHECK_CUDA(cudaGraphDestroy(graph));
    return std::make_pair(times[times.size() / 2], times.back() - times.front());
  };
  const auto [cold_us, cold_spread] = graph_us(true);
  const auto [warm_us, warm_spread] = graph_us(false);
  std::printf("us per call, %d calls in a CUDA graph: %.2f on %d cache copies (spread %.2f), "
              "%.2f on one (K/V in the L2; spread %.2f)\n",
              kCalls, cold_us, copies, cold_spread, warm_us, warm_spread);

#ifdef XLA_EXT_DECODE_PHASE_STAMPS
  // The stamps of the last of kCalls calls on rotating copies, in a graph.
  {
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CHECK_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    for (int i = 0; i < kCalls; ++i) launch(i % copies);
    CHECK_CUDA(cudaStreamEndCapture(stream, &graph));
    CHECK_CUDA(cudaGraphInstantiate(&exec, graph, 0));
    CHECK_CUDA(cudaGraphLaunch(exec, stream));
    CHECK_CUDA(cudaStreamSynchronize(stream));
  }
  const int stamped = std::min(plan->workers, tc::kMaxStampedCtas);
  std::vector<long long> stamps(int64_t{stamped} * tc::kStampSlots);
  CHECK_CUDA(cudaMemcpyFromSymbol(stamps.data(), tc::phase_stamps,
                                  stamps.size() * sizeof(long long)));
  int clock_khz = 0;
  CHECK_CUDA(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, device->id));
  const char* names[] = {"previous grid done", "range located", "block table read",
                         "first copies issued", "first stage landed", "first stage done",
                         "all stages done", "records counted in", "merged (last piece)", "exit"};
  long long first_entry = INT64_MAX, last_entry = 0;
  int working = 0;
  for (int cta = 0; cta < stamped; ++cta) {
    const long long* s = &stamps[int64_t{cta} * tc::kStampSlots];
    if (s[tc::kStampFirstFull] < 0) continue;  // a CTA with no stages
    ++working;
    first_entry = std::min(first_entry, s[tc::kStampEntryNs]);
    last_entry = std::max(last_entry, s[tc::kStampEntryNs]);
  }
  std::printf("phase stamps: %d CTAs with stages, their entries %.2f us apart (%%globaltimer); "
              "us from a CTA's entry at the %d MHz clock rate (SM cycles / rate):\n",
              working, (last_entry - first_entry) / 1e3, clock_khz / 1000);
  std::printf("  %-22s %8s %8s %8s %6s\n", "phase", "min", "median", "max", "CTAs");
  for (int phase = 0; phase < tc::kStampEntryNs; ++phase) {
    std::vector<double> us;
    for (int cta = 0; cta < stamped; ++cta) {
      const long long* s = &stamps[int64_t{cta} * tc::kStampSlots];
      if (s[tc::kStampFirstFull] >= 0 && s[phase] >= 0) us.push_back(s[phase] * 1e3 / clock_khz);
    }
    if (us.empty()) continue;
    std::sort(us.begin(), us.end());
    std::printf("  %-22s %8.2f %8.2f %8.2f %6zu\n", names[phase], us.front(), us[us.size() / 2],
                us.back(), us.size());
  }
#endif
  // Again after every call above (the fused combine's counters start each call at 0).
  const double worst_last = check();
  std::printf("after the timed calls: largest difference %.3g%s\n", worst_last,
              worst_last < 2e-2 ? "" : "  <-- WRONG");
  return worst_first < 2e-2 && worst_last < 2e-2 ? 0 : 1;
}
