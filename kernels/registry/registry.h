// The static handler table of a kernel library (its C ABI: kernel_table.h).
//
// XLA_FFI_REGISTER_HANDLER needs the runtime's XLA_FFI_Api* at load time, and no runtime that
// loads our library exports one. So each handler is added here to a table instead, beside its
// definition, and the library exports one C function returning that table. torch_xla_ext's
// binders push the table into every XLA runtime of the process (torch_xla, PJRT plugins, JAX).
//
// Use from a kernel library (ours, or a user's built outside this tree):
//
//   #include "xla_ext/registry.h"
//   XLA_FFI_DEFINE_HANDLER(kMyAddHost, MyAddHost, ffi::Ffi::Bind()...);
//   XLA_EXT_REGISTER_KERNEL("my_add", "Host", kMyAddHost, XLA_EXT_NO_TRAITS);
//
// and, optionally, the op's contract (kernel_table.h: its supported values, its workspace
// query, its shape check): XLA_EXT_REGISTER_CONTRACT(XlaExtContract{0, "my_add", 1, kSupported,
// nullptr, MyAddCheck}); or, for a target whose contract is only its check,
// XLA_EXT_REGISTER_CHECK("my_add", MyAddCheck). The front ends run the check at the call; the
// handler may call it too, so that both accept the same calls.
//
// then `torch_xla_ext.load_kernels("libmy_kernels.so")`.
#ifndef XLA_EXT_REGISTRY_H_
#define XLA_EXT_REGISTRY_H_

#include <cstring>
#include <string>
#include <vector>

#include "xla_ext/kernel_table.h"

namespace xla_ext::registry {

// One registry per shared object: hidden, so that two kernel libraries in one process never
// share (or interpose) each other's tables.
struct __attribute__((visibility("hidden"))) Registry {
  std::vector<XlaExtKernel> kernels;
  std::vector<XlaExtContract> contracts;
  std::string error;
  XlaExtKernelTable table{};

  static Registry& Get() {
    static Registry registry;
    return registry;
  }

  bool Add(const char* target, const char* platform, XLA_FFI_Handler* handler,
           uint32_t traits) {
    for (const XlaExtKernel& k : kernels) {
      if (std::strcmp(k.target, target) == 0 && std::strcmp(k.platform, platform) == 0) {
        if (error.empty()) {
          error = std::string("duplicate registration of target '") + target +
                  "' for platform '" + platform + "'";
        }
        return false;
      }
    }
    kernels.push_back(XlaExtKernel{sizeof(XlaExtKernel), target, platform, handler, traits});
    return true;
  }

  bool AddContract(const XlaExtContract& contract) {
    if (Contract(contract.target) != nullptr) {
      if (error.empty()) {
        error = std::string("duplicate contract of target '") + contract.target + "'";
      }
      return false;
    }
    contracts.push_back(contract);
    contracts.back().struct_size = sizeof(XlaExtContract);
    return true;
  }

  const XlaExtContract* Contract(const char* target) const {
    for (const XlaExtContract& c : contracts) {
      if (std::strcmp(c.target, target) == 0) return &c;
    }
    return nullptr;
  }

  const XlaExtKernelTable* Table() {
    table.struct_size = sizeof(XlaExtKernelTable);
    table.kernel_struct_size = sizeof(XlaExtKernel);
    table.ffi_api_major = XLA_FFI_API_MAJOR;
    table.ffi_api_minor = XLA_FFI_API_MINOR;
    table.num_kernels = static_cast<uint32_t>(kernels.size());
    table.kernels = kernels.data();
    table.error = error.empty() ? nullptr : error.c_str();
    table.contract_struct_size = sizeof(XlaExtContract);
    table.num_contracts = static_cast<uint32_t>(contracts.size());
    table.contracts = contracts.data();
    return &table;
  }
};

}  // namespace xla_ext::registry

// Weak, so that every translation unit including this header may define it and the linker
// keeps one per shared object.
extern "C" __attribute__((weak, visibility("default"))) const XlaExtKernelTable*
xla_ext_kernel_table(void) {
  return ::xla_ext::registry::Registry::Get().Table();
}

// The generic workspace query of this shared object (kernel_table.h), weak as the table is.
extern "C" __attribute__((weak, visibility("default"))) int64_t xla_ext_workspace_bytes(
    const char* target, int device, const XlaExtCallShape* call) {
  const XlaExtContract* contract = ::xla_ext::registry::Registry::Get().Contract(target);
  if (contract == nullptr || contract->workspace_bytes == nullptr) return -1;
  return contract->workspace_bytes(device, call);
}

// An op's contract (an XlaExtContract; its struct_size is filled in), once per target.
#define XLA_EXT_REGISTER_CONTRACT(...) XLA_EXT_REGISTER_CONTRACT_(__COUNTER__, __VA_ARGS__)
#define XLA_EXT_REGISTER_CONTRACT_(N, ...) XLA_EXT_REGISTER_CONTRACT__(N, __VA_ARGS__)
#define XLA_EXT_REGISTER_CONTRACT__(N, ...)                                      \
  __attribute__((unused)) static const bool xla_ext_contract_registered_##N##_ = \
      ::xla_ext::registry::Registry::Get().AddContract(__VA_ARGS__)

// A target's shape check (an XlaExtCheckFn), as a contract that declares nothing else. A
// target with supported values or a workspace query gives its check in its one contract.
#define XLA_EXT_REGISTER_CHECK(TARGET, CHECK) \
  XLA_EXT_REGISTER_CONTRACT(XlaExtContract{0, TARGET, 0, nullptr, nullptr, CHECK})

#define XLA_EXT_REGISTER_KERNEL(TARGET, PLATFORM, HANDLER, TRAITS) \
  XLA_EXT_REGISTER_KERNEL_(TARGET, PLATFORM, HANDLER, TRAITS, __COUNTER__)
#define XLA_EXT_REGISTER_KERNEL_(TARGET, PLATFORM, HANDLER, TRAITS, N) \
  XLA_EXT_REGISTER_KERNEL__(TARGET, PLATFORM, HANDLER, TRAITS, N)
#ifdef XLA_EXT_REGISTER_WITH_XLA_FFI_API
// Linked into torch_xla's _XLAC by patches/ (XLA in-process): also register directly with
// XLA's own FFI registry, as XLA_FFI_REGISTER_HANDLER does.
#include "xla/ffi/api/api.h"
#define XLA_EXT_REGISTER_KERNEL__(TARGET, PLATFORM, HANDLER, TRAITS, N)          \
  XLA_EXT_ADD_TO_TABLE_(TARGET, PLATFORM, HANDLER, TRAITS, N);                  \
  XLA_FFI_REGISTER_HANDLER(XLA_FFI_GetApi(), TARGET, PLATFORM, HANDLER,         \
                           static_cast<XLA_FFI_Handler_Traits>(TRAITS))
#else
#define XLA_EXT_REGISTER_KERNEL__(TARGET, PLATFORM, HANDLER, TRAITS, N) \
  XLA_EXT_ADD_TO_TABLE_(TARGET, PLATFORM, HANDLER, TRAITS, N)
#endif
#define XLA_EXT_ADD_TO_TABLE_(TARGET, PLATFORM, HANDLER, TRAITS, N)              \
  __attribute__((unused)) static const bool xla_ext_kernel_registered_##N##_ = \
      ::xla_ext::registry::Registry::Get().Add(TARGET, PLATFORM, HANDLER, TRAITS)

#endif  // XLA_EXT_REGISTRY_H_
