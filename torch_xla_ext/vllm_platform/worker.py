"""XlaWorker: vLLM's TPUWorker on a non-TPU XLA device, and vLLM's KV-cache write on our op.

The worker differs from TPUWorker in:
- `init_device`: TPUWorker's, without setting PJRT_DEVICE=TPU and libtpu's flags, and without
  the usage report (which asks tpu_info for the chip); on the CPU, dynamo's symbolic-shape
  guards stay in Python (torch 2.9 builds them as C++ with a compiler run per graph, seconds
  each, for guards that check a few sizes);
- `determine_available_memory`: what vLLM's `kv_cache_memory_bytes` says, where set. Else on
  the CPU, whose XLA client keeps no allocator statistics (xm.get_memory_info fails there),
  enough for max_num_seqs sequences of max_model_len tokens, within the budget vLLM's own CPU
  backend uses: VLLM_CPU_KVCACHE_SPACE GiB where set, else half the host's memory. On a GPU,
  after TPUWorker's profile run, what the client's allocator limit leaves beside the profile
  run's peak, less a slack (gpu_kv_cache_bytes, from xm.get_memory_info: the PJRT plugin's
  statistics). That limit is gpu_memory_utilization of the GPU's memory, as vLLM's users mean
  it: init_device sets torch_xla's PJRT_ALLOCATOR_FRACTION to it unless the user set it
  (XLA's own default is 0.75), and the share is applied there only. Both log what they
  chose;
- the model runner (XlaModelRunner) makes the KV cache on the device: vLLM's TPU runner makes
  it with torch.zeros on the host, then moves it, and a cache sized from a GPU's free memory
  (0.9 of an H200's 141 GB) outgrew the host's memory and the engine process was killed;
- it returns logprobs as the arrays vLLM's engine can send: vLLM 0.13's TPU runner returned
  lists of numpy rows, the engine's output thread died encoding them, and a request with
  `logprobs` hung its caller, and every later one, for good (sample_tokens); and a float32
  model's logprobs are the model's, as other dtypes' are: vLLM's XLA sampler scaled and
  masked float32 logits in place, so they came after temperature and top_k
  (sample_from_logits);
- the head size stays unpadded where our kernels take it as it is: vLLM's Pallas backend pads
  every head to a multiple of 128 (a TPU's lanes), so head size 64 ran as 128 with zeros, its
  cache twice the size; for a head size our ragged attention takes (its contract's head_dim)
  the backend's alignment becomes that size (_unpadded_heads), in the worker's process, where
  the cache is sized and the model built.

A worker that vLLM started as a child process (its engine core, with one worker in it) ends
with its parent, even one killed with SIGKILL: the kernel sends it SIGKILL then
(PR_SET_PDEATHSIG), so no engine process outlives its `LLM` or `vllm serve`.
"""

import ctypes
import multiprocessing
import os
import signal

import numpy as np
import psutil
import torch

from torch_xla_ext import checks
from torch_xla_ext.vllm_platform import kv_cache_update, xla_platform  # noqa: F401  (tpu_info)
from torch_xla_ext.vllm_platform.xla_platform import logger

kv_cache_update.serve()  # before TPUWorker's import of the model runner imports pallas.py

import torch_xla  # noqa: E402
import torch_xla.core.xla_model as xm  # noqa: E402
import torch_xla.runtime as xr  # noqa: E402
import vllm.envs as envs  # noqa: E402
import vllm.v1.attention.backends.pallas as pallas  # noqa: E402
import vllm.v1.worker.tpu_worker as tpu_worker  # noqa: E402
from vllm.model_executor import set_random_seed  # noqa: E402
from vllm.utils.math_utils import cdiv  # noqa: E402
from vllm.v1.outputs import LogprobsLists  # noqa: E402
from vllm.v1.worker.tpu_model_runner import TPUModelRunner  # noqa: E402
from vllm.v1.worker.tpu_worker import TPUWorker  # noqa: E402


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _end_with_parent():
    parent = multiprocessing.parent_process()
    if parent is None:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if not parent.is_alive():  # it ended before the request took effect
        os._exit(1)


def _unpadded_heads(model_config):
    head_size = model_config.get_head_size()
    if head_size in checks.supported(checks.RAGGED_PAGED_ATTENTION, "head_dim", "q"):
        pallas.TPU_HEAD_SIZE_ALIGNMENT = tpu_worker.TPU_HEAD_SIZE_ALIGNMENT = head_size


# The share of the GPU allocator's limit that the KV cache leaves free beside the profile run's
# peak: the allocator's rounding and fragmentation, and the scratch buffers of the compiles
# that warm-up runs after the cache exists (autotuning), which the profile run does not see.
GPU_SLACK = 0.02


def gpu_kv_cache_bytes(memory):
    """The KV cache's bytes on a GPU, from the allocator's statistics after the profile run
    (xm.get_memory_info): its limit less the run's peak, which holds the weights and the
    largest step's working memory (every later step allocates that again), less GPU_SLACK of
    the limit. TPUWorker takes the limit less the bytes in use after the run, 2% over: on an
    H200 that left no room for a step, and the cache's own allocation ran out of memory."""
    limit = memory["bytes_limit"]
    peak = max(int(memory.get("peak_bytes_used", 0)), int(memory["bytes_used"]))
    return max(int(limit - peak - GPU_SLACK * limit), 0)


class XlaModelRunner(TPUModelRunner):

    def sample_tokens(self, grammar_output):
        output = super().sample_tokens(grammar_output)
        if output is not None and output.logprobs is not None:
            # vLLM 0.13's TPU runner joins them as lists of numpy rows and scalars, which the
            # engine's output encoder cannot send; arrays, as LogprobsLists declares them.
            lists = output.logprobs
            output.logprobs = LogprobsLists(
                np.asarray(lists.logprob_token_ids), np.asarray(lists.logprobs),
                np.asarray(lists.sampled_token_ranks), lists.cu_num_generated_tokens)
        return output

    def sample_from_logits(self, logits, sampling_metadata):
        # vLLM's XLA sampler scales and masks its float32 logits in place (its .to(float32)
        # copies other dtypes only), and the runner takes the logprobs it returns from the
        # same logits afterwards: on a copy, they stay the model's, as vLLM documents them.
        return super().sample_from_logits(logits.clone(), sampling_metadata)

    def initialize_kv_cache(self, kv_cache_config):
        # torch.zeros without a device, inside, makes each layer's cache on this device; the
        # sync makes the caches device buffers before the first step.
        with torch.device(self.device):
            super().initialize_kv_cache(kv_cache_config)
        torch_xla.sync()


class XlaWorker(TPUWorker):

    def init_device(self):
        _end_with_parent()
        if os.environ.get("PJRT_DEVICE", "").upper() == "GPU":  # before the client starts
            os.environ.setdefault("PJRT_ALLOCATOR_FRACTION",
                                  str(self.cache_config.gpu_memory_utilization))
        _unpadded_heads(self.model_config)
        torch.set_grad_enabled(False)
        torch.set_default_dtype(self.model_config.dtype)
        self._init_tpu_worker_distributed_environment(
            self.vllm_config, self.rank, self.distributed_init_method, self.local_rank)
        self.device = xm.xla_device()
        self.device_config.device = self.device
        set_random_seed(self.model_config.seed)
        xm.set_rng_state(self.model_config.seed, self.device)
        torch._dynamo.config.cache_size_limit = 128  # as TPUWorker: a graph per padded shape
        if xr.device_type() == "CPU":
            torch._dynamo.config.enable_cpp_symbolic_shape_guards = False
        if envs.VLLM_XLA_CACHE_PATH:  # per device type, rank and world size
            xr.initialize_cache(os.path.join(
                envs.VLLM_XLA_CACHE_PATH, f"{xr.device_type()}_tp"
                f"{self.parallel_config.world_size}_rank{xr.global_ordinal()}"), readonly=False)
        self.model_runner = XlaModelRunner(self.vllm_config, self.device,
                                           self.original_parallel_config)

    def determine_available_memory(self):
        if self.cache_config.kv_cache_memory_bytes:
            return int(self.cache_config.kv_cache_memory_bytes)
        if xr.device_type() != "CPU":
            super().determine_available_memory()  # for its profile run; its sizing is not ours
            memory = xm.get_memory_info(self.device)
            available = gpu_kv_cache_bytes(memory)
            logger.info("XLA platform: %.2f GiB of the GPU for the KV cache: the allocator's "
                        "limit is %.2f GiB (PJRT_ALLOCATOR_FRACTION=%s), the profile run's peak "
                        "%.2f GiB, %.2f GiB in use after it", available / 2**30,
                        memory["bytes_limit"] / 2**30, os.environ.get("PJRT_ALLOCATOR_FRACTION"),
                        int(memory.get("peak_bytes_used", 0)) / 2**30,
                        int(memory["bytes_used"]) / 2**30)
            return available
        specs = self.model_runner.get_kv_cache_spec().values()
        blocks = self.scheduler_config.max_num_seqs * cdiv(self.model_config.max_model_len,
                                                            self.cache_config.block_size)
        needed = blocks * sum(spec.page_size_bytes for spec in specs)
        if envs.VLLM_CPU_KVCACHE_SPACE is not None:
            budget, source = envs.VLLM_CPU_KVCACHE_SPACE * 2**30, "VLLM_CPU_KVCACHE_SPACE"
        else:
            budget, source = psutil.virtual_memory().total // 2, "half the host's memory"
        logger.info("XLA platform: %.2f GiB for the KV cache on the CPU: %d sequences of %d "
                    "tokens need %.2f GiB; the budget is %.2f GiB (%s)",
                    min(needed, budget) / 2**30, self.scheduler_config.max_num_seqs,
                    self.model_config.max_model_len, needed / 2**30, budget / 2**30, source)
        return min(needed, budget)
