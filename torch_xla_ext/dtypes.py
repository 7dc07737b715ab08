"""The one dtype table of the Python side: each element type by its name, which torch, NumPy
and JAX share ("float32", "bfloat16", "float8_e4m3fn", ...), with its XLA FFI DataType
number (xla/ffi/api/c_api.h) and its MLIR element type."""

import collections
import functools

DType = collections.namedtuple("DType", "ffi_id mlir")

DTYPES = {
    "bool": DType(1, "i1"),
    "int8": DType(2, "i8"),
    "int16": DType(3, "i16"),
    "int32": DType(4, "i32"),
    "int64": DType(5, "i64"),
    "uint8": DType(6, "ui8"),
    "uint16": DType(7, "ui16"),
    "uint32": DType(8, "ui32"),
    "uint64": DType(9, "ui64"),
    "float16": DType(10, "f16"),
    "float32": DType(11, "f32"),
    "float64": DType(12, "f64"),
    "bfloat16": DType(16, "bf16"),
    "float8_e4m3fn": DType(20, "f8E4M3FN"),
}


@functools.lru_cache(maxsize=None)  # dtypes are few and hashable; called per argument per op
def name(dtype):
    """The table's name of a torch, NumPy or JAX dtype (or of an array's .dtype)."""
    return str(dtype).replace("torch.", "")


def lookup(dtype):
    """The table's entry for a dtype, or None."""
    return DTYPES.get(name(dtype))
