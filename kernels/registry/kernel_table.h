/* The C ABI between a kernel library and torch_xla_ext: the table of handlers a library
 * exports as `xla_ext_kernel_table()` (registry.h fills it; torch_xla_ext's binder reads it).
 *
 * Versioned by size, append-only: each struct begins with its size as the library was built,
 * a new field only ever goes at the end, and a reader reads a field only when the struct it
 * was given is large enough to hold it. `kernels` is an array with a stride of
 * `kernel_struct_size`, so that a library built with a larger XlaExtKernel stays readable. */
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

typedef struct XlaExtKernelTable {
  size_t struct_size;         /* sizeof(XlaExtKernelTable) where the library was built */
  size_t kernel_struct_size;  /* the stride of `kernels` */
  int32_t ffi_api_major;      /* XLA_FFI_API_MAJOR/MINOR of the headers the handlers were */
  int32_t ffi_api_minor;      /* compiled against */
  uint32_t num_kernels;
  const XlaExtKernel* kernels;
  const char* error;          /* non-null when a registration was refused (a duplicate) */
} XlaExtKernelTable;

/* The sizes of the first version: what a reader needs at least. */
#define XLA_EXT_KERNEL_STRUCT_SIZE_V1 (offsetof(XlaExtKernel, traits) + sizeof(uint32_t))
#define XLA_EXT_KERNEL_TABLE_STRUCT_SIZE_V1 \
  (offsetof(XlaExtKernelTable, error) + sizeof(const char*))

typedef const XlaExtKernelTable* (*XlaExtKernelTableFn)(void);

#ifdef __cplusplus
}  /* extern "C" */
#endif

#endif  /* XLA_EXT_KERNEL_TABLE_H_ */
