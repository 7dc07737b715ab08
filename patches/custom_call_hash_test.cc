// Tests the custom-call IR node hash that patch 0002 adds to torch_xla as
// torch_xla/csrc/ops/custom_call_hash.h (this very file's header, verbatim:
// patches_test.py checks that). Equal attributes must hash equal; changing any
// one attribute must change the hash, or two different custom calls share one
// compiled executable.

#include "patches/src/custom_call_hash.h"

#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

namespace {

using torch_xla::CustomCallHash;
using torch_xla::CustomCallKey;

int failures = 0;

void Expect(bool ok, const std::string& what) {
  if (!ok) {
    std::fprintf(stderr, "FAIL: %s\n", what.c_str());
    ++failures;
  }
}

CustomCallKey Base() {
  CustomCallKey key;
  key.call_target = "xla_ext.simple_add";
  key.backend_config = "{alpha = 1.0 : f32}";
  key.api_version = 4;
  key.has_side_effect = false;
  key.outputs = {{/*F32=*/11, {8, 128}}, {/*S32=*/4, {8}}};
  key.frontend_attributes = {{"_xla_stream_annotation", "1"}};
  key.output_operand_aliases = {{0, 1}};
  return key;
}

void ExpectChanges(const std::string& what,
                   const std::function<void(CustomCallKey&)>& change) {
  CustomCallKey key = Base();
  change(key);
  Expect(CustomCallHash(key) != CustomCallHash(Base()),
         "changing " + what + " changes the hash");
}

}  // namespace

int main() {
  // Equal keys hash equal, and the hash is a pure function of the key.
  Expect(CustomCallHash(Base()) == CustomCallHash(Base()), "equal keys");
  {
    // Frontend attributes are a map: insertion order does not matter.
    CustomCallKey a = Base(), b = Base();
    a.frontend_attributes = {{"x", "1"}, {"y", "2"}};
    b.frontend_attributes.clear();
    b.frontend_attributes.emplace("y", "2");
    b.frontend_attributes.emplace("x", "1");
    Expect(CustomCallHash(a) == CustomCallHash(b), "attribute order");
  }

  ExpectChanges("call_target", [](CustomCallKey& k) { k.call_target += "2"; });
  ExpectChanges("backend_config",
                [](CustomCallKey& k) { k.backend_config = "{alpha = 2.0 : f32}"; });
  ExpectChanges("backend_config to empty",
                [](CustomCallKey& k) { k.backend_config.clear(); });
  ExpectChanges("api_version", [](CustomCallKey& k) { k.api_version = 2; });
  ExpectChanges("has_side_effect", [](CustomCallKey& k) { k.has_side_effect = true; });
  ExpectChanges("an output dimension", [](CustomCallKey& k) { k.outputs[0].dimensions[1] = 256; });
  ExpectChanges("an output rank", [](CustomCallKey& k) { k.outputs[1].dimensions.push_back(1); });
  ExpectChanges("an output dtype", [](CustomCallKey& k) { k.outputs[0].element_type = 16; });
  ExpectChanges("the number of outputs", [](CustomCallKey& k) { k.outputs.pop_back(); });
  ExpectChanges("the order of outputs",
                [](CustomCallKey& k) { std::swap(k.outputs[0], k.outputs[1]); });
  ExpectChanges("a frontend attribute value",
                [](CustomCallKey& k) { k.frontend_attributes["_xla_stream_annotation"] = "2"; });
  ExpectChanges("a frontend attribute name", [](CustomCallKey& k) {
    k.frontend_attributes = {{"_xla_stream_annotatio", "n1"}};
  });
  ExpectChanges("an added frontend attribute",
                [](CustomCallKey& k) { k.frontend_attributes["_xla_compute_type"] = "host"; });
  ExpectChanges("no frontend attributes", [](CustomCallKey& k) { k.frontend_attributes.clear(); });
  ExpectChanges("an output/operand alias",
                [](CustomCallKey& k) { k.output_operand_aliases = {{1, 0}}; });
  ExpectChanges("no output/operand aliases",
                [](CustomCallKey& k) { k.output_operand_aliases.clear(); });

  // Field boundaries are unambiguous: moving bytes between the target and the
  // backend_config changes the hash.
  {
    CustomCallKey a = Base(), b = Base();
    a.call_target = "ab";
    a.backend_config = "c";
    b.call_target = "a";
    b.backend_config = "bc";
    Expect(CustomCallHash(a) != CustomCallHash(b), "target/backend_config boundary");
  }
  {
    CustomCallKey a = Base(), b = Base();
    a.outputs = {{11, {2, 3}}, {11, {4}}};
    b.outputs = {{11, {2}}, {11, {3, 4}}};
    Expect(CustomCallHash(a) != CustomCallHash(b), "dimension/output boundary");
  }

  if (failures == 0) {
    std::printf("custom_call_hash_test: all checks passed\n");
    return 0;
  }
  std::fprintf(stderr, "custom_call_hash_test: %d check(s) failed\n", failures);
  return 1;
}
