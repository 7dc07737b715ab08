// A minimal XLA runtime for running one FFI handler (its execute stage) on caller-owned
// memory: what lets the torch CPU and CUDA ops (torch_ops.cc) execute exactly the handlers XLA
// runs. It implements the parts of XLA_FFI_Api a handler's execute stage uses: errors, the
// stream (the caller's, e.g. torch's current stream) and scratch memory (the caller's
// allocator, e.g. torch's caching allocator). The rest answers "unimplemented".
#ifndef TORCH_XLA_EXT_CSRC_EAGER_RUNTIME_H_
#define TORCH_XLA_EXT_CSRC_EAGER_RUNTIME_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "xla/ffi/api/c_api.h"

namespace xla_ext::eager {

// Where a handler's scratch memory comes from.
class ScratchAllocator {
 public:
  virtual ~ScratchAllocator() = default;
  // Null on failure.
  virtual void* Allocate(size_t size, size_t alignment) = 0;
  virtual void Free(void* data) = 0;
};

// Scratch from the C heap, for Host handlers.
class HostScratch final : public ScratchAllocator {
 public:
  void* Allocate(size_t size, size_t alignment) override;
  void Free(void* data) override;
};

// A handler's attributes as XLA passes them (sorted by name), built once and reused by every
// call that has the same attribute values.
class Attributes {
 public:
  Attributes() = default;
  // frame() points into the object itself.
  Attributes(const Attributes&) = delete;
  Attributes& operator=(const Attributes&) = delete;

  // A scalar attribute: `dtype` is its XLA_FFI_DataType, `bytes` its value.
  void AddScalar(std::string name, XLA_FFI_DataType dtype, std::string bytes);
  void AddString(std::string name, std::string value);
  // Sorts by name and lays the attributes out as XLA_FFI_Attrs; call once, after the Adds.
  void Finish();
  const XLA_FFI_Attrs& frame() const { return frame_; }

 private:
  struct Entry {
    std::string name;
    bool is_string;
    XLA_FFI_DataType dtype;
    std::string bytes;
  };
  std::vector<Entry> entries_;
  std::vector<XLA_FFI_AttrType> types_;
  std::vector<XLA_FFI_ByteSpan> names_, strings_;
  std::vector<XLA_FFI_ByteSpan*> name_ptrs_;
  std::vector<XLA_FFI_Scalar> scalars_;
  std::vector<void*> values_;
  XLA_FFI_Attrs frame_{};
};

// Runs `handler` once with `args` and `rets` (XLA_FFI_Buffers the caller filled in) on
// `stream` (null on the CPU). Returns an empty string, or the handler's error message.
std::string Call(XLA_FFI_Handler* handler, void* stream, int32_t device_ordinal,
                 std::vector<XLA_FFI_Buffer>& args, std::vector<XLA_FFI_Buffer>& rets,
                 const Attributes& attributes, ScratchAllocator& scratch);

}  // namespace xla_ext::eager

#endif  // TORCH_XLA_EXT_CSRC_EAGER_RUNTIME_H_
