// Test helper: rewrites a training checkpoint with one value replaced, as a
// run that had already diverged would have saved it (so its manifest's size
// and hashes are right, and only the non-finite check can refuse it).
//
//   laga_test_poison_checkpoint DIR TENSOR INDEX VALUE
//
// DIR is a --checkpoint directory; its latest checkpoint's tensors file is
// rewritten with the SafetensorsWriter, element INDEX of TENSOR (e.g.
// param.layers.0.ffn.w1.weight, adam_v.head.weight) set to VALUE (nan, inf,
// -inf or a number), and its manifest (step-<N>.json and latest.json)
// rewritten for the new file.
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <string>

#include "core/error.hpp"
#include "io/atomic_file.hpp"
#include "io/safetensors.hpp"
#include "model/checkpoint.hpp"

int main(int argc, char** argv) {
  namespace fs = std::filesystem;
  if (argc != 5) {
    std::cerr << "usage: laga_test_poison_checkpoint DIR TENSOR INDEX VALUE\n";
    return 2;
  }
  try {
    const std::string dir = argv[1], target = argv[2];
    const std::int64_t index = std::stoll(argv[3]);
    const float value = std::stof(argv[4]);  // "nan", "inf" and "-inf" parse
    laga::CheckpointManifest m = laga::read_checkpoint_manifest(dir);
    laga::SafetensorsWriter w;
    {
      const laga::SafetensorsFile f = laga::SafetensorsFile::open(m.tensors);
      LAGA_CHECK(f.contains(target), "no tensor '", target, "' in ", m.tensors);
      for (const std::string& name : f.names()) {
        laga::Tensor<float> t = f.read<float>(name);
        if (name == target) {
          LAGA_CHECK(index >= 0 && index < t.numel(), "index ", index, " is outside '", name,
                     "' of ", t.numel(), " elements");
          t[index] = value;
        }
        w.add(name, t);
      }
      for (const auto& [key, text] : f.metadata()) w.add_metadata(key, text);
    }
    w.write(m.tensors);
    m.tensors_bytes = static_cast<std::int64_t>(fs::file_size(m.tensors));
    m.tensors_fnv1a64 = laga::fnv1a64_hex(laga::file_fnv1a64(m.tensors));
    const std::string text = laga::format_checkpoint_manifest(m);
    fs::path own = m.tensors;
    own.replace_extension(".json");
    laga::write_file_atomic(own.string(), text);
    laga::write_file_atomic((fs::path(dir) / "latest.json").string(), text);
  } catch (const std::exception& e) {
    std::cerr << "laga_test_poison_checkpoint: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
