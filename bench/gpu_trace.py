"""The GPU work of a piece of code, from torch.profiler's CUPTI trace, which records every
kernel launched in this process: torch's, and those of JAX executables (tp_bench, the torchax
serving loop); and the copy bandwidth the benchmarks set their rows beside."""

import re


# Collective kernels in a trace: NCCL's, and XLA's own (e.g. "all_reduce_32_fusion_1", which
# XLA GPU runs instead of NCCL for small buffers between the GPUs of one host).
COLLECTIVE_KERNEL = re.compile(r"nccl|all.?reduce|all.?gather|reduce.?scatter|all.?to.?all|"
                               r"collective", re.IGNORECASE)
# What a kernel does, by its name, in that order: collectives, our attention ops (the K/V write
# included), the matrix products (XLA's, cuBLAS's, our small_batch_linear), copies and
# memsets; anything else (XLA's elementwise and reduction fusions: norms, RoPE, residual adds,
# activations) is "other".
KERNEL_KINDS = (
    ("collectives", COLLECTIVE_KERNEL),
    ("attention", re.compile(r"xla_ext::(attention|kv_cache_update|reshape_and_cache|"
                             r"paged_attention|ragged_paged_attention)")),
    ("GEMMs", re.compile(r"gemm|nvjet|cublas|cutlass|xmma|matmul|dot|small_batch_linear",
                         re.IGNORECASE)),
    ("copies", re.compile(r"memcpy|memset", re.IGNORECASE)),
)


def kernel_kind(name):
    """The first of KERNEL_KINDS whose pattern `name` matches, else "other"."""
    return next((kind for kind, pattern in KERNEL_KINDS if pattern.search(name)), "other")


def gpu_events(run):
    """Calls run() under the profiler and returns the trace's device events (kernels, copies,
    memsets); raises if it has none. run must not return before its GPU work is done (block
    on its results), or the trace misses what is still in flight."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
    # Device events are not always typed CUDA: the torchax serving loop's trace (torchax
    # registers a "jax" accelerator) had no CUDA-typed events on the H100 while tp_bench's
    # (JAX alone) had them. Everything not on the host is on a GPU.
    events = prof.events()
    on_gpus = [e for e in events if e.device_type.name != "CPU"]
    if not on_gpus:
        raise RuntimeError(f"torch.profiler's trace holds {len(events)} host events and none "
                           "on a GPU (is CUPTI available to it?)")
    return on_gpus


def captured_graph(call, calls):
    """`calls` calls of call() captured in a CUDA graph (after warm-up calls on a side stream,
    which capture requires), replayed once and finished."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            call()
    graph.replay()
    torch.cuda.synchronize()
    return graph


def graph_seconds(call, calls, reps):
    """GPU seconds per call of call(): `calls` calls captured in a CUDA graph (launched one by
    one, calls of a few microseconds would time the host), the median of `reps` replays."""
    import statistics

    import torch

    graph = captured_graph(call, calls)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times) / calls


def print_graph_timeline(call, calls, label):
    """Replays `calls` calls of call(), captured in a CUDA graph, once under the trace and
    prints every GPU event's start and end (µs from the first start): the calls back to back
    with no host gaps, as a compiled XLA chain runs them. Programmatically launched kernels
    start early and wait on the GPU, so their durations include that wait; read the ends."""
    import torch

    graph = captured_graph(call, calls)

    def replay():
        graph.replay()
        torch.cuda.synchronize()

    events = sorted(gpu_events(replay), key=lambda e: e.time_range.start)
    origin = events[0].time_range.start
    print(f"{label}: {calls} calls in a CUDA graph, {len(events)} GPU events, first start to "
          f"last end {max(e.time_range.end for e in events) - origin:.1f} us")
    for e in events:
        print(f"  start {e.time_range.start - origin:8.1f}  end {e.time_range.end - origin:8.1f}"
              f"  {e.name[:90]}")


def copy_gbps():
    """Device-to-device copy bandwidth (bytes read + written per second / 1e9) of a 1 GiB
    copy launched eagerly (a copy captured in a CUDA graph reads about 20% low), or None
    without a GPU."""
    import torch

    if not torch.cuda.is_available():
        return None
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        dst.copy_(src)
    end.record()
    end.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / 20
    del src, dst
    torch.cuda.empty_cache()
    return 2 * (1 << 30) / seconds / 1e9
