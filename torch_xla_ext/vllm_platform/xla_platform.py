"""XlaPlatform: vLLM's TpuPlatform on a non-TPU XLA device.

It keeps TpuPlatform's identity (PlatformEnum.TPU, device type "tpu"), so that every place in
vLLM that asks `current_platform.is_tpu()` takes its torch_xla path: the TPU worker and model
runner, the Pallas attention backend (whose torch.ops.xla.ragged_paged_attention runs ours off
TPUs: torch_xla_ops.py), XLA sampling. What differs:

- vllm/platforms/tpu.py imports `tpu_info` (TPU chip queries) when it is imported; a stand-in
  module that raises if it is ever used takes its place where the package is missing;
- the device's name comes from torch_xla, not tpu_info, and there is no torch.tpu to set a
  device on;
- the model keeps the dtype it is given (TpuPlatform turns float16 and float32 into bfloat16);
- the worker is worker.XlaWorker;
- the KV page size is one our attention kernels take: for max_model_len 2049-8192 the Pallas
  backend picks 256, and ours take 8-128 (their contract), so the largest of those under it;
- features it does not run are refused when the engine is configured, with a ValueError
  naming the feature, the value given and what is supported (unsupported_feature), rather
  than failing deep in the engine's start or first step, or running untested: pooling models,
  speculative decoding, M-RoPE models, LoRA, a kv_cache_dtype our kernels do not take
  (fp8_e5m2, or fp8 beside a float32 model) and a head size our attention does not take;
- sampling fields that vLLM's XLA sampler ignores are refused at the request, each by name
  (unsupported_sampling_fields), instead of returning plain greedy tokens;
- a prompt's token ids are checked against the model's vocabulary. vLLM checks them only
  against a tokenizer, and with `skip_tokenizer_init` has none; an XLA gather clamps an index
  out of range, so such a prompt would run on the wrong embeddings instead of failing;
- at the exit of a process that made an engine, the engine client shuts down before
  multiprocessing's exit handler terminates the engine process (_shut_down_before_exit):
  otherwise vLLM's monitor thread sees the engine die and logs "Engine core proc ... died
  unexpectedly" (an ERROR) for a clean exit.
"""

import atexit
import sys
import types


def _stand_in_for_tpu_info():
    def unavailable(*args, **kwargs):
        raise RuntimeError("tpu_info: TPU chip information is not available on a non-TPU "
                           "XLA device")

    package = types.ModuleType("tpu_info")
    package.device = types.ModuleType("tpu_info.device")
    package.metrics = types.ModuleType("tpu_info.metrics")
    package.device.get_local_chips = unavailable
    package.metrics.get_chip_usage = unavailable
    sys.modules.update({"tpu_info": package, "tpu_info.device": package.device,
                        "tpu_info.metrics": package.metrics})


try:
    import tpu_info  # noqa: F401
except ImportError:
    _stand_in_for_tpu_info()

from vllm.logger import init_logger  # noqa: E402

from torch_xla_ext import checks  # noqa: E402
from torch_xla_ext.dtypes import name as dtype_name  # noqa: E402
from vllm.platforms.tpu import TpuPlatform  # noqa: E402

# Under vLLM's logger hierarchy, whose handler prints INFO (a logger of our package's own name
# would print nothing below WARNING).
logger = init_logger("vllm.platforms.xla")

WORKER = "torch_xla_ext.vllm_platform.worker.XlaWorker"


def _shut_down_before_exit():
    """Each engine client, once it watches its engine processes, registers its own shutdown
    (the finalizer vLLM runs at exit anyway) as an exit handler: registered after
    multiprocessing's, it runs first, so the engine is shut down, not found dead."""
    from vllm.v1.engine import core_client

    watch = core_client.MPClient.start_engine_core_monitor
    if getattr(watch, "shuts_down_before_exit", False):
        return

    def start_engine_core_monitor(self):
        watch(self)
        atexit.register(self.resources)

    start_engine_core_monitor.shuts_down_before_exit = True
    core_client.MPClient.start_engine_core_monitor = start_engine_core_monitor


def unsupported_sampling_fields(params):
    """The SamplingParams fields set on `params` that vLLM 0.13's XLA sampler (vllm/v1/sample/
    tpu) does not apply, as `name=value`: the penalties, logit_bias, allowed_token_ids and
    bad_words are kept in its input batch but never reach the logits, and prompt_logprobs
    comes back with one entry for the whole prompt."""
    defaults = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0}
    set_fields = [f"{name}={getattr(params, name)}" for name, default in defaults.items()
                  if getattr(params, name) != default]
    for name in ("logit_bias", "allowed_token_ids", "bad_words", "prompt_logprobs"):
        if getattr(params, name, None):
            set_fields.append(f"{name}={getattr(params, name)!r}")
    return set_fields


# vLLM's Pallas backend pads a head size to a multiple of this, unless the worker keeps it as
# it is (worker._unpadded_heads: a size our attention takes).
PALLAS_HEAD_ALIGNMENT = 128


def _kv_cache_dtypes(model_dtype):
    """The kv_cache_dtype values our kernels take beside a model of `model_dtype`: "auto" and
    those vLLM's Pallas backend maps to the model's dtype or, beside a 16-bit model,
    float8_e4m3fn (the ragged attention's contract: kv_pages has q's dtype, or float8_e4m3fn
    beside a float16 or bfloat16 q)."""
    import typing

    from vllm.config.cache import CacheDType
    from vllm.v1.attention.backends.pallas import TPU_STR_DTYPE_TO_TORCH_DTYPE

    cache_dtypes = checks.supported(checks.RAGGED_PAGED_ATTENTION, "dtype", "kv_pages")
    taken = {dtype_name(model_dtype)} & set(cache_dtypes)
    if dtype_name(model_dtype) != "float32" and "float8_e4m3fn" in cache_dtypes:
        taken.add("float8_e4m3fn")
    return ["auto"] + [value for value in typing.get_args(CacheDType)
                       if value in TPU_STR_DTYPE_TO_TORCH_DTYPE
                       and dtype_name(TPU_STR_DTYPE_TO_TORCH_DTYPE[value]) in taken]


def unsupported_feature(vllm_config):
    """(the feature of `vllm_config` this platform does not run, named with the value given;
    what it supports instead) for the first such feature, or None."""
    model = vllm_config.model_config
    if model.runner_type != "generate":
        return f"pooling models (runner {model.runner_type!r})", "runner 'generate'"
    if vllm_config.speculative_config is not None:
        return (f"speculative decoding (speculative_config with method "
                f"{vllm_config.speculative_config.method!r})", "no speculative_config")
    if model.uses_mrope:  # vLLM's TPU model runner asserts it away in the engine process
        return (f"M-RoPE models ({', '.join(model.architectures)}, whose rope parameters have "
                "an mrope_section)", "rotary embeddings over one position axis")
    if vllm_config.lora_config is not None:
        return "LoRA (enable_lora)", "enable_lora off"
    cache_dtypes = _kv_cache_dtypes(model.dtype)
    if vllm_config.cache_config.cache_dtype not in cache_dtypes:
        return (f"kv_cache_dtype {vllm_config.cache_config.cache_dtype!r}",
                f"kv_cache_dtype {' or '.join(map(repr, cache_dtypes))} for a "
                f"{dtype_name(model.dtype)} model")
    head_size = model.get_head_size()
    head_sizes = checks.supported(checks.RAGGED_PAGED_ATTENTION, "head_dim", "q")
    padded = -(-head_size // PALLAS_HEAD_ALIGNMENT) * PALLAS_HEAD_ALIGNMENT
    if head_size not in head_sizes and padded not in head_sizes:
        return (f"head size {head_size}", f"head sizes {list(head_sizes)}, or one that vLLM's "
                f"Pallas backend pads to one of those (to a multiple of {PALLAS_HEAD_ALIGNMENT})")
    return None


class XlaPlatform(TpuPlatform):
    vocab_size = None  # the model's, once a config is checked in this process

    @classmethod
    def get_device_name(cls, device_id=0):
        from torch_xla import runtime

        return f"XLA {runtime.device_type()}"

    @classmethod
    def set_device(cls, device):
        pass  # one XLA device per worker process, torch_xla's own

    @classmethod
    def check_and_update_config(cls, vllm_config):
        model_config = vllm_config.model_config
        dtype = model_config.dtype if model_config is not None else None
        from torch_xla_ext.vllm_platform import kv_cache_update

        kv_cache_update.serve()  # TpuPlatform's check imports the Pallas backend
        unsupported = unsupported_feature(vllm_config) if model_config is not None else None
        if unsupported:
            feature, supported = unsupported
            raise ValueError(f"Not supported on the XLA platform: {feature}. Supported: "
                             f"{supported}.")
        _shut_down_before_exit()
        super().check_and_update_config(vllm_config)
        if dtype is not None and model_config.dtype != dtype:
            logger.info("XLA platform: keeping dtype %s (TpuPlatform's is bfloat16)", dtype)
            model_config.dtype = dtype
        if model_config is not None:
            cls.vocab_size = model_config.get_vocab_size()
        cache = vllm_config.cache_config
        page_sizes = checks.supported(checks.RAGGED_PAGED_ATTENTION, "page_size", "kv_pages")
        if cache.block_size not in page_sizes:
            chosen = max((p for p in page_sizes if p <= cache.block_size), default=min(page_sizes))
            logger.info("XLA platform: KV page size %d (the Pallas backend chose %d; our attention "
                        "kernels take %s)", chosen, cache.block_size, list(page_sizes))
            cache.block_size = chosen
        parallel = vllm_config.parallel_config
        if parallel.worker_cls in ("auto", "vllm.v1.worker.tpu_worker.TPUWorker"):
            parallel.worker_cls = WORKER

    @classmethod
    def validate_request(cls, prompt, params, processed_inputs):
        super().validate_request(prompt, params, processed_inputs)
        from vllm.sampling_params import SamplingParams

        if isinstance(params, SamplingParams):
            unsupported = unsupported_sampling_fields(params)
            if unsupported:
                raise ValueError(
                    f"Unsupported sampling parameters on the XLA platform: "
                    f"{', '.join(unsupported)}. vLLM's XLA sampler applies temperature, top_k, "
                    "top_p, min_p and logprobs only; leave these out.")
        ids = processed_inputs.get("prompt_token_ids") if isinstance(processed_inputs, dict) \
            else None
        if ids and cls.vocab_size is not None:
            bad = next((t for t in ids if not 0 <= t < cls.vocab_size), None)
            if bad is not None:
                raise ValueError(f"Token id {bad} is out of vocabulary: the model's token ids "
                                 f"are 0 ... {cls.vocab_size - 1}")
