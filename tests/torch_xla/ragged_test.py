"""torch_xla's own torch.ops.xla.ragged_paged_attention, served by our kernel on a non-TPU XLA
device (PJRT_DEVICE=CPU), and torch.ops.xla_ext.ragged_paged_attention on XLA and CPU tensors,
against torch_xla's pure-torch reference `_ragged_paged_attention_nonkernel`."""

import pytest
import torch

from torch_xla_ext import sample_inputs

MIX = sample_inputs.MIXED_BATCH


def _reference(inputs, **attrs):
    from torch_xla.experimental.custom_kernel import _ragged_paged_attention_nonkernel

    args = {k: v.cpu() for k, v in inputs.items()}
    out = _ragged_paged_attention_nonkernel(
        args["q"], args["kv_pages"], args["kv_lens"], args["page_indices"], args["cu_q_lens"],
        args["num_seqs"], attrs.pop("k_scale", None), attrs.pop("v_scale", None), **attrs)
    rows = int(args["cu_q_lens"][int(args["num_seqs"][0])])
    return out, rows


@pytest.mark.parametrize("attrs", [
    dict(sm_scale=0.125),
    dict(sm_scale=0.125, sliding_window=8, soft_cap=30.0),
    dict(sm_scale=0.2, sliding_window=200),  # longer than every sequence
], ids=["plain", "window+softcap", "long_window"])
def test_torch_xla_op_runs_our_kernel_off_tpu(xla_device, attrs):
    import torch_xla

    inputs = sample_inputs.ragged_paged_attention(**MIX, num_q_heads=8, num_kv_heads=2,
                                                  head_dim=64, page_size=16,
                                                  dtype=torch.float32, max_num_seqs=8,
                                                  padding_rows=5)
    want, rows = _reference(inputs, **attrs)
    on_xla = {k: v.to(xla_device) for k, v in inputs.items()}
    got = torch.ops.xla.ragged_paged_attention(**on_xla, **attrs)
    hlo = torch_xla._XLAC._get_xla_tensors_hlo([got])
    assert 'custom_call_target="xla_ext.ragged_paged_attention"' in hlo
    got = got.cpu()
    torch.testing.assert_close(got[:rows], want, atol=2e-5, rtol=2e-5)
    assert torch.count_nonzero(got[rows:]) == 0  # padding rows
    eager = torch.ops.xla_ext.ragged_paged_attention(**inputs, **attrs)
    torch.testing.assert_close(eager[:rows], want, atol=2e-5, rtol=2e-5)


def test_fp8_cache_with_scales(xla_device):
    inputs = sample_inputs.ragged_paged_attention(**MIX, num_q_heads=8, num_kv_heads=2,
                                                  head_dim=128, page_size=16,
                                                  dtype=torch.bfloat16,
                                                  kv_dtype=torch.float8_e4m3fn)
    attrs = dict(sm_scale=0.1, k_scale=0.5, v_scale=2.0)
    want, rows = _reference({**inputs, "q": inputs["q"].float(),
                             "kv_pages": inputs["kv_pages"].float()}, **attrs)
    got = torch.ops.xla.ragged_paged_attention(
        **{k: v.to(xla_device) for k, v in inputs.items()}, **attrs).cpu()
    atol, rtol = sample_inputs.TOLERANCES[torch.bfloat16]
    torch.testing.assert_close(got[:rows].double(), want.double(), atol=atol, rtol=rtol)


def test_opcheck(xla_device):
    inputs = sample_inputs.ragged_paged_attention(**MIX, num_q_heads=4, num_kv_heads=2,
                                                  head_dim=64, page_size=8, dtype=torch.float32)
    torch.library.opcheck(torch.ops.xla_ext.ragged_paged_attention.default,
                          tuple(inputs.values()), {"sm_scale": 0.125, "soft_cap": 20.0})


def test_bad_arguments_name_the_argument(xla_device):
    from torch_xla_ext import TorchXlaExtError

    inputs = sample_inputs.ragged_paged_attention(**MIX, num_q_heads=8, num_kv_heads=2,
                                                  head_dim=64, page_size=16,
                                                  dtype=torch.float32)
    on_xla = {k: v.to(xla_device) for k, v in inputs.items()}
    bad_pages = inputs["page_indices"].clone()
    bad_pages[2, 3] = 999
    cases = [
        (dict(page_indices=bad_pages.to(xla_device)), r"argument 'page_indices'.*\[2\]\[3\] = 999"),
        (dict(kv_lens=inputs["kv_lens"].long().to(xla_device)), "argument 'kv_lens': expected dtype int32"),
        (dict(q=on_xla["q"][:, :, :48].contiguous()), "argument 'q': expected head_dim in"),
        (dict(num_seqs=torch.tensor([99], dtype=torch.int32).to(xla_device)), "argument 'num_seqs'"),
    ]
    for change, message in cases:
        with pytest.raises(TorchXlaExtError, match=message):
            torch.ops.xla.ragged_paged_attention(**{**on_xla, **change}, sm_scale=0.1)
