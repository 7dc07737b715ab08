"""Each op's contract is declared once, in C++ (kernels/<op>/<op>.h), and exported through the
kernel table: the values read here are the ones the handlers' own checks accept and list, an
older library's smaller table reads as one without contracts, and the workspace query is one
generic entry point of the library."""

import ctypes

import jax
import numpy as np
import pytest

from tests.kernels.common import PLATFORM
from torch_xla_ext import _kernels, checks, op_catalog, workspace
from torch_xla_ext import jax_ops  # noqa: F401  (registers the handlers with JAX)
from torch_xla_ext.errors import TorchXlaExtError


def one_of(values):
    """The handlers' way of listing values: "8, 16 or 32"."""
    return ", ".join(str(v) for v in values[:-1]) + f" or {values[-1]}"


def test_the_library_declares_each_attention_ops_sizes_and_dtypes():
    library = _kernels.builtin_library()
    paged = library.contract(checks.PAGED_ATTENTION)
    ragged = library.contract(checks.RAGGED_PAGED_ATTENTION)
    assert paged.values("head_size", "query") == (64, 80, 96, 112, 128, 256)
    assert paged.values("block_size", "key_cache") == (8, 16, 32)
    assert ragged.values("head_dim", "q") == (64, 80, 96, 112, 128, 192, 256)
    assert ragged.values("page_size", "kv_pages") == (8, 16, 32, 64, 128)
    assert checks.supported(checks.PAGED_ATTENTION, "dtype", "query") == (
        "float32", "float16", "bfloat16")
    assert checks.supported(checks.RAGGED_PAGED_ATTENTION, "dtype", "kv_pages") == (
        "float32", "float16", "bfloat16", "float8_e4m3fn")
    with pytest.raises(TorchXlaExtError, match="lists no head_dim of 'query'"):
        paged.values("head_dim", "query")
    with pytest.raises(TorchXlaExtError, match="declares no contract for xla_ext.no_such_op"):
        library.contract("xla_ext.no_such_op")


def test_every_op_of_the_library_declares_its_contract():
    library = _kernels.builtin_library()
    assert sorted(library.contracts) == library.targets()
    assert checks.supported("XlaGpuSimpleAdd", "dtype", "a") == (
        "float32", "float16", "bfloat16")
    assert checks.supported("xla_ext.reshape_and_cache", "dtype", "key") == (
        "float32", "float16", "bfloat16")
    for target in ("xla_ext.kv_cache_update", "xla_ext.kv_cache_update_slices"):
        assert checks.supported(target, "dtype", "kv_cache") == (
            "float32", "float16", "bfloat16", "float8_e4m3fn")
    with pytest.raises(TorchXlaExtError, match=r"argument 'kv_cache': expected dtype float32, "
                                               r"float16, bfloat16 or float8_e4m3fn, got dtype int8"):
        checks.kv_cache_update(np.zeros((2, 2, 8), np.int8), np.zeros((2, 2, 8), np.int8),
                               np.zeros((4, 4, 4, 8), np.int8), np.zeros((2,), np.int32))


def test_the_cache_writes_handlers_refuse_what_their_contract_leaves_out():
    """Past Python's checks, the handler's own: a cache of int8 is no cache attention reads."""
    cache = np.zeros((4, 4, 4, 8), np.int8)
    call = jax.ffi.ffi_call("xla_ext.kv_cache_update", jax.ShapeDtypeStruct(cache.shape, np.int8))
    with pytest.raises(Exception, match=r"argument 'kv_cache': expected dtype f32, f16, bf16 or "
                                        r"f8e4m3fn"):
        jax.block_until_ready(jax.jit(call)(np.zeros((2, 2, 8), np.int8),
                                            np.zeros((2, 2, 8), np.int8), cache,
                                            np.zeros((2,), np.int32)))


def _handler_error(target, operands, attributes):
    """The message of the handler's own check (the target called directly, past Python's)."""
    out = jax.ShapeDtypeStruct(operands[0].shape, operands[0].dtype)
    call = jax.ffi.ffi_call(target, (out, jax.ShapeDtypeStruct((0,), np.uint8)))
    with pytest.raises(Exception) as error:
        jax.block_until_ready(jax.jit(lambda *a: call(*a, **attributes)[0])(*operands))
    return str(error.value)


def _paged_operands(head_size, block_size):
    return [np.zeros((2, 4, head_size), np.float32),
            np.zeros((4, block_size, 2, head_size), np.float32),
            np.zeros((4, block_size, 2, head_size), np.float32),
            np.zeros((2, 2), np.int32), np.ones((2,), np.int32), np.zeros((0,), np.float32)]


def test_the_handlers_check_and_list_the_values_the_library_exports():
    paged = checks.PAGED_ATTENTION
    attributes = dict(scale=np.float32(1.0), softcap=np.float32(0.0))
    head_sizes = checks.supported(paged, "head_size", "query")
    block_sizes = checks.supported(paged, "block_size", "key_cache")
    assert f"head_size (dim 2) {one_of(head_sizes)}, got 72" in _handler_error(
        paged, _paged_operands(72, 16), attributes)
    assert f"block_size (dim 1) {one_of(block_sizes)}, got 12" in _handler_error(
        paged, _paged_operands(64, 12), attributes)

    ragged = checks.RAGGED_PAGED_ATTENTION
    head_dims = checks.supported(ragged, "head_dim", "q")
    operands = [np.zeros((4, 4, 72), np.float32), np.zeros((4, 16, 4, 72), np.float32),
                np.ones((2,), np.int32), np.zeros((2, 2), np.int32),
                np.array([0, 1, 2], np.int32), np.array([2], np.int32)]
    attributes = dict(sm_scale=np.float32(1.0), sliding_window=np.int32(0),
                      soft_cap=np.float32(0.0), mask_value=np.float32(-1e38),
                      k_scale=np.float32(1.0), v_scale=np.float32(1.0),
                      max_q_len=np.int32(0))
    assert f"head_dim (dim 2) {one_of(head_dims)}, got 72" in _handler_error(
        ragged, operands, attributes)


def test_python_checks_name_the_contracts_values():
    query = np.zeros((2, 4, 72), np.float32)
    cache = np.zeros((4, 16, 2, 72), np.float32)
    head_sizes = list(checks.supported(checks.PAGED_ATTENTION, "head_size", "query"))
    with pytest.raises(TorchXlaExtError, match=rf"argument 'query': expected head_size in "
                                               rf"\[{', '.join(map(str, head_sizes))}\], got 72"):
        checks.paged_attention(query, cache, cache, np.zeros((2, 2), np.int32),
                               np.ones((2,), np.int32), 1.0, 0.0, None)


class _TableV1(ctypes.Structure):
    """XlaExtKernelTable as the first kernel_table.h laid it out: no contracts."""
    _fields_ = [("struct_size", ctypes.c_size_t), ("kernel_struct_size", ctypes.c_size_t),
                ("ffi_api_major", ctypes.c_int32), ("ffi_api_minor", ctypes.c_int32),
                ("num_kernels", ctypes.c_uint32), ("kernels", ctypes.c_void_p),
                ("error", ctypes.c_char_p)]


class _TableV2(ctypes.Structure):
    _fields_ = _TableV1._fields_ + [
        ("contract_struct_size", ctypes.c_size_t), ("num_contracts", ctypes.c_uint32),
        ("contracts", ctypes.c_void_p)]


def test_an_older_librarys_table_reads_as_one_without_contracts():
    binder = _kernels.binder_dll()
    old = _TableV1(ctypes.sizeof(_TableV1), 40, 0, 1, 0, None, None)
    assert binder.xla_ext_table_num_contracts(ctypes.addressof(old)) == 0
    # The same reader takes today's table, and its contract struct at the library's stride.
    table = _kernels.builtin_library().table_address
    current = _TableV2.from_address(table)
    assert current.struct_size == ctypes.sizeof(_TableV2)
    assert binder.xla_ext_table_num_contracts(table) == current.num_contracts >= 2


class _ContractV1(ctypes.Structure):
    """XlaExtContract as kernel_table.h first laid it out: no check."""
    _fields_ = [("struct_size", ctypes.c_size_t), ("target", ctypes.c_char_p),
                ("num_supported", ctypes.c_uint32), ("supported", ctypes.c_void_p),
                ("workspace_bytes", ctypes.c_void_p)]


def test_a_version_1_contract_reads_as_one_without_a_check():
    binder = _kernels.binder_dll()
    # Two version-1 contracts back to back: a reader that took the first one's check from
    # past its end would read the second one's struct_size, which is not zero.
    contracts = (_ContractV1 * 2)(*(_ContractV1(ctypes.sizeof(_ContractV1), b"user.old", 0,
                                                None, None) for _ in range(2)))
    table = _TableV2(ctypes.sizeof(_TableV2), 40, 0, 1, 0, None, None,
                     ctypes.sizeof(_ContractV1), 1, ctypes.addressof(contracts))
    assert binder.xla_ext_table_num_contracts(ctypes.addressof(table)) == 1
    assert _kernels._read_contract(binder, ctypes.addressof(table), 0) == \
        _kernels.Contract("user.old", (), None)
    # Today's contracts hold the field; our ops declare no check there (op_catalog checks
    # their calls).
    library = _kernels.builtin_library()
    assert all(c.check is None for c in library.contracts.values())


def test_the_workspace_query_is_one_generic_entry_point():
    library = _kernels.builtin_library()
    with pytest.raises(TorchXlaExtError, match="has no workspace query for xla_ext.simple_add"):
        library.workspace_bytes("xla_ext.simple_add", workspace.ANY_GPU, [], [])
    # A call its checks reject takes none (head_size 72).
    f32, s32 = 11, 4  # XLA FFI dtype numbers
    rejected = [(f32, (2, 4, 72)), (f32, (4, 16, 2, 72)), (f32, (4, 16, 2, 72)), (s32, (2, 2)),
                (s32, (2,)), (f32, (0,))]
    assert library.workspace_bytes(checks.PAGED_ATTENTION, workspace.ANY_GPU, rejected, []) == 0


@pytest.mark.skipif(PLATFORM != "cpu", reason="sizes on a GPU: test_workspace_size_is_what_"
                    "the_handler_takes in the ops' tests")
def test_no_visible_gpu_needs_no_workspace():
    op = op_catalog.PAGED_ATTENTION
    args = op.bind(_paged_operands(64, 16)[:5], {"scale": 1.0})
    assert op.handler_results(args, op.attribute_values(args), workspace.ANY_GPU)[-1] == ((0,),
                                                                                        "uint8")
