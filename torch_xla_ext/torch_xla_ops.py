"""torch_xla's own `torch.ops.xla.ragged_paged_attention` on XLA devices other than TPUs.

torch_xla 2.9 implements it with a Pallas kernel, which runs on TPUs only. After
`import torch_xla_ext` the op's XLA kernel runs ours (xla_ext.ragged_paged_attention) on other
XLA devices (the CPU, and GPUs through the PJRT plugin), so vLLM's TPU attention code runs
unchanged there; on a TPU it calls torch_xla's own implementation, as before. Its Pallas tuning
arguments (use_kernel, num_kv_pages_per_block, num_queries_per_block, vmem_limit_bytes) mean
nothing to our kernel and are accepted as given.
"""

import warnings

import torch

_lib = None


def _serve_ragged_paged_attention():
    global _lib
    from torch_xla import runtime
    from torch_xla.experimental import custom_kernel  # defines torch.ops.xla.ragged_paged_attention

    def on_xla(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale=1.0,
               sliding_window=None, soft_cap=None, mask_value=None, k_scale=None, v_scale=None,
               use_kernel=True, num_kv_pages_per_block=None, num_queries_per_block=None,
               vmem_limit_bytes=None):
        if runtime.device_type() == "TPU":
            return custom_kernel.ragged_paged_attention_xla(
                q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale,
                sliding_window, soft_cap, mask_value, k_scale, v_scale, use_kernel,
                num_kv_pages_per_block, num_queries_per_block, vmem_limit_bytes)
        return torch.ops.xla_ext.ragged_paged_attention(
            q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale, sliding_window,
            soft_cap, mask_value, k_scale, v_scale)

    _lib = torch.library.Library("xla", "IMPL")
    with warnings.catch_warnings():  # "Overriding a previously registered kernel": intended
        warnings.simplefilter("ignore", UserWarning)
        _lib.impl("ragged_paged_attention", on_xla, "XLA", allow_override=True)


_serve_ragged_paged_attention()
