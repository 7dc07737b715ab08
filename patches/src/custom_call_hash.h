#ifndef XLA_TORCH_XLA_CSRC_OPS_CUSTOM_CALL_HASH_H_
#define XLA_TORCH_XLA_CSRC_OPS_CUSTOM_CALL_HASH_H_

// The identity of a custom-call IR node: every attribute that changes the HLO
// it lowers to. The node's hash seeds the graph hash that keys the compilation
// cache, so leaving one of these out makes two different calls share one
// compiled executable.
//
// Standard library only, so that it can be unit-tested on its own.

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace torch_xla {

struct CustomCallOutputSpec {
  int element_type = 0;  // xla::PrimitiveType
  std::vector<int64_t> dimensions;
};

struct CustomCallKey {
  std::string call_target;
  std::string backend_config;
  int api_version = 0;
  bool has_side_effect = false;
  std::vector<CustomCallOutputSpec> outputs;
  // Ordered, so that the hash does not depend on insertion order.
  std::map<std::string, std::string> frontend_attributes;
  // (output_index, operand_index) pairs.
  std::vector<std::pair<int64_t, int64_t>> output_operand_aliases;
};

namespace custom_call_hash_internal {

// FNV-1a over the bytes; every variable-length field is prefixed with its
// length so that field boundaries are unambiguous.
inline uint64_t MixBytes(uint64_t h, const void* data, size_t size) {
  const unsigned char* bytes = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < size; ++i) {
    h ^= bytes[i];
    h *= 0x100000001b3ULL;
  }
  return h;
}

inline uint64_t MixU64(uint64_t h, uint64_t value) {
  unsigned char bytes[8];
  for (int i = 0; i < 8; ++i) {
    bytes[i] = static_cast<unsigned char>(value >> (8 * i));
  }
  return MixBytes(h, bytes, sizeof(bytes));
}

inline uint64_t MixString(uint64_t h, const std::string& s) {
  h = MixU64(h, s.size());
  return MixBytes(h, s.data(), s.size());
}

}  // namespace custom_call_hash_internal

inline uint64_t CustomCallHash(const CustomCallKey& key) {
  using namespace custom_call_hash_internal;
  uint64_t h = 0xcbf29ce484222325ULL;
  h = MixString(h, key.call_target);
  h = MixString(h, key.backend_config);
  h = MixU64(h, static_cast<uint64_t>(static_cast<int64_t>(key.api_version)));
  h = MixU64(h, key.has_side_effect ? 1 : 0);
  h = MixU64(h, key.outputs.size());
  for (const CustomCallOutputSpec& output : key.outputs) {
    h = MixU64(h, static_cast<uint64_t>(static_cast<int64_t>(output.element_type)));
    h = MixU64(h, output.dimensions.size());
    for (int64_t dim : output.dimensions) {
      h = MixU64(h, static_cast<uint64_t>(dim));
    }
  }
  h = MixU64(h, key.frontend_attributes.size());
  for (const auto& [name, value] : key.frontend_attributes) {
    h = MixString(h, name);
    h = MixString(h, value);
  }
  h = MixU64(h, key.output_operand_aliases.size());
  for (const auto& [output_index, operand_index] : key.output_operand_aliases) {
    h = MixU64(h, static_cast<uint64_t>(output_index));
    h = MixU64(h, static_cast<uint64_t>(operand_index));
  }
  return h;
}

}  // namespace torch_xla

#endif  // XLA_TORCH_XLA_CSRC_OPS_CUSTOM_CALL_HASH_H_
