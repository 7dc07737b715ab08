/* The C ABI between a kernel library and torch_xla_ext: the table of handlers and of the ops'
 * contracts a library exports as `xla_ext_kernel_table()` (registry.h fills it;
 * torch_xla_ext's binder reads it), and the library's generic workspace query.
 *
 * Versioned by size, append-only: each struct that begins with a struct_size holds its size
 * as the library was built, a new field only ever goes at the end, and a reader reads a field
 * only when the struct it was given is large enough to hold it. `kernels` and `contracts` are
 * arrays with the strides `kernel_struct_size` and `contract_struct_size`, so that a library
 * built with larger structs stays readable. The small structs without a struct_size
 * (XlaExtSupportedValues, and the workspace query's call description) keep their layout: a
 * new field would come in a new struct. */
#ifndef XLA_EXT_KERNEL_TABLE_H_
#define XLA_EXT_KERNEL_TABLE_H_

#include <stddef.h>
#include <stdint.h>

#include "xla/ffi/api/c_api.h"

#ifdef __cplusplus
extern "C" {
#endif

#define XLA_EXT_KERNEL_TABLE_SYMBOL "xla_ext_kernel_table"
#define XLA_EXT_NO_TRAITS 0u

typedef struct XlaExtKernel {
  size_t struct_size;        /* sizeof(XlaExtKernel) where the library was built */
  const char* target;        /* custom-call target name, e.g. "xla_ext.paged_attention" */
  const char* platform;      /* XLA platform name: "Host" or "CUDA" */
  XLA_FFI_Handler* handler;  /* execute stage */
  uint32_t traits;           /* XLA_FFI_Handler_TraitsBits */
} XlaExtKernel;

/* An op's contract, declared once in C++ beside its handlers' checks: the values its sizes and
 * dtypes may take, which the front ends read for their checks, error messages and tests, and
 * how large a call's workspace result must be. */
typedef struct XlaExtSupportedValues {
  const char* name;       /* what is constrained, e.g. "head_size", or "dtype" for a dtype */
  const char* argument;   /* the argument it belongs to, e.g. "query" */
  uint32_t num_values;
  const int64_t* values;  /* sizes, or XLA_FFI_DataType values for a "dtype" */
} XlaExtSupportedValues;

/* A call as a workspace query or a check sees it: its operands' dtypes and dimensions (no
 * data), in the order the handler binds them, and its scalar attributes by name and type. A workspace
 * query is given the op's arguments; a check is given its arguments, then its results. */
typedef struct XlaExtOperandShape {
  int32_t dtype;  /* XLA_FFI_DataType */
  uint32_t rank;
  const int64_t* dims;
} XlaExtOperandShape;

typedef struct XlaExtScalarAttribute {
  const char* name;
  int32_t dtype;  /* XLA_FFI_DataType of the attribute as the call gives it, e.g. F32, S64 */
  double value;   /* holds every f32 and s32 value exactly */
} XlaExtScalarAttribute;

typedef struct XlaExtCallShape {
  uint32_t num_operands;
  const XlaExtOperandShape* operands;
  uint32_t num_attributes;
  const XlaExtScalarAttribute* attributes;
} XlaExtCallShape;

/* Bytes of workspace a call needs on CUDA device `device` (-1: the most any visible device
 * needs); 0 where no device is visible or where the handler rejects the call (it says why
 * itself). */
typedef int64_t (*XlaExtWorkspaceBytesFn)(int device, const XlaExtCallShape* call);

/* The handler's own shape check, run by the front ends at the call, before anything is
 * recorded: NULL when the call (arguments, then results; see XlaExtCallShape) is accepted,
 * else a message naming the argument, what was expected and what was given, in storage the
 * library owns (static or thread-local) and that stays valid until the thread's next check. */
typedef const char* (*XlaExtCheckFn)(const XlaExtCallShape* call);

typedef struct XlaExtContract {
  size_t struct_size;  /* sizeof(XlaExtContract) where the library was built */
  const char* target;
  uint32_t num_supported;
  const XlaExtSupportedValues* supported;
  XlaExtWorkspaceBytesFn workspace_bytes;  /* NULL: the op has no workspace result */
  /* Since version 2: */
  XlaExtCheckFn check;                     /* NULL: the call is checked when it runs */
} XlaExtContract;

typedef struct XlaExtKernelTable {
  size_t struct_size;         /* sizeof(XlaExtKernelTable) where the library was built */
  size_t kernel_struct_size;  /* the stride of `kernels` */
  int32_t ffi_api_major;      /* XLA_FFI_API_MAJOR/MINOR of the headers the handlers were */
  int32_t ffi_api_minor;      /* compiled against */
  uint32_t num_kernels;
  const XlaExtKernel* kernels;
  const char* error;          /* non-null when a registration was refused (a duplicate) */
  /* Since version 2: the ops' contracts, an array with a stride of contract_struct_size. */
  size_t contract_struct_size;
  uint32_t num_contracts;
  const XlaExtContract* contracts;
} XlaExtKernelTable;

/* The sizes of the first version: what a reader needs at least. */
#define XLA_EXT_KERNEL_STRUCT_SIZE_V1 (offsetof(XlaExtKernel, traits) + sizeof(uint32_t))
#define XLA_EXT_KERNEL_TABLE_STRUCT_SIZE_V1 \
  (offsetof(XlaExtKernelTable, error) + sizeof(const char*))
/* Version 2 added the contracts: a smaller table has none. */
#define XLA_EXT_KERNEL_TABLE_STRUCT_SIZE_V2 \
  (offsetof(XlaExtKernelTable, contracts) + sizeof(const XlaExtContract*))
#define XLA_EXT_CONTRACT_STRUCT_SIZE_V1 \
  (offsetof(XlaExtContract, workspace_bytes) + sizeof(XlaExtWorkspaceBytesFn))
/* Version 2 of the contract added the check: a smaller contract has none. */
#define XLA_EXT_CONTRACT_STRUCT_SIZE_V2 (offsetof(XlaExtContract, check) + sizeof(XlaExtCheckFn))

/* The generic workspace query a library exports beside the table (registry.h defines it):
 *   int64_t xla_ext_workspace_bytes(const char* target, int device, const XlaExtCallShape*);
 * the contract of `target` answers; -1 where the library has no workspace query for it. */

typedef const XlaExtKernelTable* (*XlaExtKernelTableFn)(void);

#ifdef __cplusplus
}  /* extern "C" */
#endif

#endif  /* XLA_EXT_KERNEL_TABLE_H_ */
