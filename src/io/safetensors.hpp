// safetensors — the weight format of Hugging Face checkpoints (and so of
// DeepSeek's), read and written without any third-party safetensors code.
//
// Layout: u64 little-endian N; N bytes of UTF-8 JSON mapping each tensor name
// to {"dtype", "shape", "data_offsets": [begin, end]} plus an optional
// "__metadata__" string→string map; then the data section, where each tensor
// occupies bytes [begin, end) counted from the first byte after the header,
// row-major, little-endian.
//
// SafetensorsFile::open validates the whole header up front (every entry,
// every byte range against the file size, overlaps), so a file that opens can
// only fail a later read if it is changed underneath us or a dtype cannot be
// converted. Tensor bytes are read on demand, one tensor at a time, from the
// descriptor opened by open(): replacing the file on disk afterwards (as an
// atomic save does) does not change what this object reads. Copies share the
// descriptor; reads are positional, so threads may read concurrently.
//
// Every error is a laga::Error naming the file, the tensor where there is one,
// and what to do.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.hpp"

namespace laga {

struct SafetensorsTensorInfo {
  std::string dtype;  // as in the file: "F32", "BF16", "I64", ...
  Shape shape;
  // Byte range [data_begin, data_end) relative to the start of the data section.
  std::uint64_t data_begin = 0;
  std::uint64_t data_end = 0;

  std::int64_t numel() const;
  std::uint64_t bytes() const { return data_end - data_begin; }
};

// The dtypes read() converts to float/double; every other dtype of the format
// is accepted by open() (so a checkpoint with integer buffers still opens) but
// refused by read().
inline constexpr const char* kSafetensorsReadableDtypes = "F32, F64, BF16, F16";

// One F8_E4M3 code as a float, exactly: PyTorch's float8_e4m3fn, which
// DeepSeek-V3's weights use (1 sign bit, 4 exponent bits biased by 7, 3
// mantissa bits; subnormals; no infinities; 0x7F and 0xFF are NaN). read()
// refuses F8_E4M3 because a block-scaled weight means nothing without its
// scale: SafetensorsSet (safetensors_set.hpp) reads the pair.
float f8_e4m3_to_float(std::uint8_t code);

class SafetensorsFile {
 public:
  using TensorInfo = SafetensorsTensorInfo;

  static SafetensorsFile open(const std::string& path);

  const std::string& path() const { return path_; }
  // Sorted by name.
  std::vector<std::string> names() const;
  bool contains(const std::string& name) const { return tensors_.count(name) != 0; }
  const TensorInfo& info(const std::string& name) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

  // Converts F32, F64, BF16 and F16 to T (F64 → float rounds to nearest).
  // Under a count-only pool the tensor is accounted but not backed, and the
  // file's bytes are still range-checked but not read.
  template <class T>
  Tensor<T> read(const std::string& name, MemCategory cat = MemCategory::parameters) const;

  // As read(), after checking the stored shape is `expected` exactly.
  template <class T>
  Tensor<T> read(const std::string& name, const Shape& expected,
                 MemCategory cat = MemCategory::parameters) const;

  // Loads into an existing (e.g. parameter) tensor whose shape must match.
  template <class T>
  void read_into(const std::string& name, Tensor<T>& destination) const;

  // An index tensor (I32 or I64, any shape), flattened: the only integer
  // reader, for things like cu_seqlens. Other dtypes are an error naming it.
  std::vector<std::int64_t> read_indices(const std::string& name) const;

  // The stored bytes [begin, begin + size) of a tensor's data, any dtype, as
  // they are: for decoders that live outside this file (fp8 with a scale).
  void read_raw(const std::string& name, std::uint64_t begin, std::uint64_t size,
                void* destination) const;

 private:
  struct Descriptor;

  SafetensorsFile() = default;
  void check_readable(const std::string& name, const TensorInfo& entry) const;
  const SafetensorsTensorInfo& find(const std::string& name) const;
  void check_shape(const std::string& name, const Shape& expected) const;
  template <class T>
  void fill_from_file(const std::string& name, const SafetensorsTensorInfo& entry,
                      T* destination) const;

  std::string path_;
  std::shared_ptr<const Descriptor> descriptor_;
  std::uint64_t data_start_ = 0;  // 8 + header length
  std::map<std::string, SafetensorsTensorInfo> tensors_;
  std::map<std::string, std::string> metadata_;
};

// Collects tensors and metadata, then writes one safetensors file atomically
// (write_file_atomic). Tensors are copied on add(), so they need not outlive
// the writer. As the reference implementation does, the data section holds
// the tensors by descending element size, then by name, back to back from
// offset 0, and the header is padded with spaces to a multiple of 8 bytes.
class SafetensorsWriter {
 public:
  void add(const std::string& name, const Tensor<float>& tensor);   // stored as F32
  void add(const std::string& name, const Tensor<double>& tensor);  // stored as F64
  // An index tensor of this shape, stored as I64.
  void add_indices(const std::string& name, const Shape& shape,
                   const std::vector<std::int64_t>& values);
  void add_metadata(const std::string& key, const std::string& value);

  std::size_t size() const { return tensors_.size(); }
  // The complete file contents, as write() would store them.
  std::string serialize() const;
  void write(const std::string& path) const;

 private:
  struct Pending {
    std::string dtype;
    std::size_t element_size = 0;
    Shape shape;
    std::string bytes;
  };
  void add_bytes(const std::string& name, const char* dtype, std::size_t element_size,
                 const Shape& shape, const void* data, std::int64_t byte_count, bool backed);
  std::string header() const;
  std::vector<const std::pair<const std::string, Pending>*> data_order() const;

  std::map<std::string, Pending> tensors_;
  std::map<std::string, std::string> metadata_;
};

extern template Tensor<float> SafetensorsFile::read<float>(const std::string&, MemCategory) const;
extern template Tensor<double> SafetensorsFile::read<double>(const std::string&, MemCategory) const;
extern template Tensor<float> SafetensorsFile::read<float>(const std::string&, const Shape&,
                                                           MemCategory) const;
extern template Tensor<double> SafetensorsFile::read<double>(const std::string&, const Shape&,
                                                             MemCategory) const;
extern template void SafetensorsFile::read_into<float>(const std::string&, Tensor<float>&) const;
extern template void SafetensorsFile::read_into<double>(const std::string&, Tensor<double>&) const;

}  // namespace laga
