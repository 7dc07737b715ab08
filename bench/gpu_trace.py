"""The GPU work of a piece of code, from torch.profiler's CUPTI trace, which records every
kernel launched in this process: torch's, and those of JAX executables (tp_bench, the torchax
serving loop)."""


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
