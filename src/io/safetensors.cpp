#include "io/safetensors.hpp"

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <limits>
#include <optional>
#include <set>
#include <type_traits>
#include <vector>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include "core/error.hpp"
#include "io/atomic_file.hpp"
#include "io/json_repeated_keys.hpp"

namespace laga {

// The data section is copied byte for byte into host floats.
static_assert(std::endian::native == std::endian::little,
              "safetensors data is little-endian; a big-endian host needs byte swapping here");

namespace {

using Json = nlohmann::json;

// The reference implementation refuses larger headers; so do we, so that a
// corrupt length cannot make us allocate gigabytes before parsing anything.
constexpr std::uint64_t kMaxHeaderBytes = 100'000'000;
constexpr const char* kMetadataKey = "__metadata__";
// Conversions stream through a buffer this big rather than one the size of
// the tensor, so loading a large BF16 weight does not need twice its memory.
constexpr std::size_t kConversionChunkBytes = 1 << 20;

struct DtypeSpec {
  const char* name;
  std::size_t element_size;
};

// Every byte-sized dtype of the format. Sub-byte ones (F4, F6_*) are absent:
// their byte count is not numel * size, and no weight laga reads uses them.
constexpr DtypeSpec kDtypes[] = {
    {"BOOL", 1}, {"U8", 1},  {"I8", 1},  {"F8_E5M2", 1}, {"F8_E4M3", 1}, {"F8_E8M0", 1},
    {"I16", 2},  {"U16", 2}, {"F16", 2}, {"BF16", 2},    {"I32", 4},     {"U32", 4},
    {"F32", 4},  {"I64", 8}, {"U64", 8}, {"F64", 8},     {"C64", 8},
};

const DtypeSpec* find_dtype(const std::string& name) {
  for (const DtypeSpec& d : kDtypes) {
    if (name == d.name) return &d;
  }
  return nullptr;
}

std::string known_dtype_list() {
  std::string list;
  for (const DtypeSpec& d : kDtypes) {
    if (!list.empty()) list += ", ";
    list += d.name;
  }
  return list;
}

bool readable_dtype(const std::string& dtype) {
  return dtype == "F32" || dtype == "F64" || dtype == "BF16" || dtype == "F16";
}

std::uint64_t decode_u64_le(const unsigned char* bytes) {
  std::uint64_t value = 0;
  for (int i = 7; i >= 0; --i) value = (value << 8) | bytes[i];
  return value;
}

std::string encode_u64_le(std::uint64_t value) {
  std::string bytes(8, '\0');
  for (int i = 0; i < 8; ++i)
    bytes[static_cast<std::size_t>(i)] = static_cast<char>((value >> (8 * i)) & 0xff);
  return bytes;
}

float bf16_to_float(std::uint16_t bits) {
  return std::bit_cast<float>(static_cast<std::uint32_t>(bits) << 16);
}

float f16_to_float(std::uint16_t bits) {
  const std::uint32_t sign = static_cast<std::uint32_t>(bits & 0x8000u) << 16;
  const std::uint32_t exponent = (bits >> 10) & 0x1fu;
  std::uint32_t mantissa = bits & 0x3ffu;
  std::uint32_t out;
  if (exponent == 0x1f) {
    out = sign | 0x7f800000u | (mantissa << 13);  // inf, or NaN keeping its payload
  } else if (exponent != 0) {
    out = sign | ((exponent + 112) << 23) | (mantissa << 13);  // rebias 15 → 127
  } else if (mantissa == 0) {
    out = sign;
  } else {
    // Subnormal half: normalise, since every one of them is normal in float.
    std::uint32_t shift = 0;
    while ((mantissa & 0x400u) == 0) {
      mantissa <<= 1;
      ++shift;
    }
    out = sign | ((113 - shift) << 23) | ((mantissa & 0x3ffu) << 13);
  }
  return std::bit_cast<float>(out);
}

}  // namespace

float f8_e4m3_to_float(std::uint8_t code) {
  const std::uint32_t sign = static_cast<std::uint32_t>(code & 0x80u) << 24;
  const std::uint32_t exponent = (code >> 3) & 0xfu;
  const std::uint32_t mantissa = code & 0x7u;
  if (exponent == 0xf && mantissa == 0x7) return std::numeric_limits<float>::quiet_NaN();
  if (exponent != 0)  // rebias 7 → 127; the 3 mantissa bits lead float's 23
    return std::bit_cast<float>(sign | ((exponent + 120) << 23) | (mantissa << 20));
  // Subnormal (or zero): mantissa · 2^-9, exact in float.
  const float magnitude = static_cast<float>(mantissa) * 0x1p-9f;
  return sign ? -magnitude : magnitude;
}

namespace {

// Element product of a shape with every extent already known non-negative;
// nullopt when it does not fit in int64 (a corrupt or hostile header).
std::optional<std::int64_t> checked_numel(const Shape& shape) {
  std::int64_t n = 1;
  for (std::int64_t extent : shape) {
    if (extent == 0) return 0;
  }
  for (std::int64_t extent : shape) {
    if (__builtin_mul_overflow(n, extent, &n)) return std::nullopt;
  }
  return n;
}

class HeaderParser {
 public:
  HeaderParser(const std::string& path, std::uint64_t data_bytes)
      : path_(path), data_bytes_(data_bytes) {}

  [[noreturn]] void fail_file(const std::string& what) const {
    fail("safetensors '", path_, "': ", what);
  }
  [[noreturn]] void fail_tensor(const std::string& name, const std::string& what) const {
    fail("safetensors '", path_, "': tensor '", name, "' ", what,
         "; the file is corrupt or was not written as safetensors, re-export it");
  }

  std::map<std::string, SafetensorsTensorInfo> parse_tensors(const Json& header) const {
    std::map<std::string, SafetensorsTensorInfo> tensors;
    for (const auto& [name, entry] : header.items()) {
      if (name == kMetadataKey) continue;
      tensors.emplace(name, parse_entry(name, entry));
    }
    check_no_overlap(tensors);
    check_nothing_after_last(tensors);
    return tensors;
  }

  std::map<std::string, std::string> parse_metadata(const Json& header) const {
    std::map<std::string, std::string> metadata;
    auto found = header.find(kMetadataKey);
    if (found == header.end()) return metadata;
    if (!found->is_object()) {
      fail_file(cat("\"", kMetadataKey, "\" is a JSON ", found->type_name(),
                    ", not an object of string values; the header is corrupt"));
    }
    for (const auto& [key, value] : found->items()) {
      if (!value.is_string()) {
        fail_file(cat("metadata entry '", key, "' is a JSON ", value.type_name(),
                      ", but safetensors metadata values must be strings; re-export the file"));
      }
      metadata.emplace(key, value.get<std::string>());
    }
    return metadata;
  }

 private:
  SafetensorsTensorInfo parse_entry(const std::string& name, const Json& entry) const {
    if (!entry.is_object()) {
      fail_tensor(name, cat("is described by a JSON ", entry.type_name(),
                            " instead of an object with dtype, shape and data_offsets"));
    }
    SafetensorsTensorInfo info;
    const Json& dtype = required_field(name, entry, "dtype");
    if (!dtype.is_string()) {
      fail_tensor(name, cat("has a dtype that is a JSON ", dtype.type_name(), ", not a string"));
    }
    info.dtype = dtype.get<std::string>();
    const DtypeSpec* spec = find_dtype(info.dtype);
    if (!spec) {
      fail("safetensors '", path_, "': tensor '", name, "' has unknown dtype '", info.dtype,
           "'; laga reads ", kSafetensorsReadableDtypes, " and recognises ", known_dtype_list(),
           "; convert the checkpoint to one of those");
    }

    const Json& shape = required_field(name, entry, "shape");
    if (!shape.is_array()) {
      fail_tensor(name, cat("has a shape that is a JSON ", shape.type_name(), ", not an array"));
    }
    for (std::size_t i = 0; i < shape.size(); ++i) {
      const Json& extent = shape[i];
      if (!extent.is_number_integer()) {
        fail_tensor(name, cat("has shape entry ", i, " that is a JSON ", extent.type_name(),
                              ", not an integer"));
      }
      if (extent.is_number_unsigned()) {
        std::uint64_t value = extent.get<std::uint64_t>();
        if (value > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) {
          fail_tensor(name, cat("has shape entry ", i, " = ", value, ", too large for a tensor"));
        }
        info.shape.push_back(static_cast<std::int64_t>(value));
      } else {
        std::int64_t value = extent.get<std::int64_t>();
        if (value < 0) fail_tensor(name, cat("has negative extent ", value, " in its shape"));
        info.shape.push_back(value);
      }
    }

    const Json& offsets = required_field(name, entry, "data_offsets");
    if (!offsets.is_array() || offsets.size() != 2 || !offsets[0].is_number_integer() ||
        !offsets[1].is_number_integer()) {
      fail_tensor(name, cat("has data_offsets ", offsets.dump(),
                            ", but they must be two integers [begin, end]"));
    }
    if (offsets[0].get<std::int64_t>() < 0 && !offsets[0].is_number_unsigned()) {
      fail_tensor(name, cat("has negative data_offsets begin ", offsets[0].dump()));
    }
    if (offsets[1].get<std::int64_t>() < 0 && !offsets[1].is_number_unsigned()) {
      fail_tensor(name, cat("has negative data_offsets end ", offsets[1].dump()));
    }
    info.data_begin = offsets[0].get<std::uint64_t>();
    info.data_end = offsets[1].get<std::uint64_t>();
    if (info.data_begin > info.data_end) {
      fail_tensor(name, cat("has data_offsets [", info.data_begin, ", ", info.data_end,
                            "] with begin after end"));
    }
    if (info.data_end > data_bytes_) {
      fail("safetensors '", path_, "': tensor '", name, "' has data_offsets [", info.data_begin,
           ", ", info.data_end, "] but the data section holds only ", data_bytes_,
           " bytes; the file is truncated, download or copy it again");
    }

    std::optional<std::int64_t> element_count = checked_numel(info.shape);
    std::uint64_t expected_bytes = 0;
    if (!element_count || __builtin_mul_overflow(static_cast<std::uint64_t>(*element_count),
                                                 spec->element_size, &expected_bytes)) {
      fail_tensor(name, cat("has shape ", to_string(info.shape), " whose size overflows"));
    }
    if (expected_bytes != info.bytes()) {
      fail_tensor(name, cat("has shape ", to_string(info.shape), " and dtype ", info.dtype,
                            ", which need ", expected_bytes, " bytes, but its data_offsets [",
                            info.data_begin, ", ", info.data_end, "] span ", info.bytes()));
    }
    return info;
  }

  const Json& required_field(const std::string& name, const Json& entry, const char* field) const {
    auto found = entry.find(field);
    if (found == entry.end()) fail_tensor(name, cat("has no \"", field, "\" field"));
    return *found;
  }

  void check_no_overlap(const std::map<std::string, SafetensorsTensorInfo>& tensors) const {
    std::vector<const std::pair<const std::string, SafetensorsTensorInfo>*> by_offset;
    for (const auto& entry : tensors) {
      // An empty tensor occupies no bytes, so it cannot collide with anything.
      if (entry.second.bytes() > 0) by_offset.push_back(&entry);
    }
    std::sort(by_offset.begin(), by_offset.end(), [](const auto* a, const auto* b) {
      return a->second.data_begin < b->second.data_begin;
    });
    for (std::size_t i = 1; i < by_offset.size(); ++i) {
      const auto& previous = *by_offset[i - 1];
      const auto& current = *by_offset[i];
      if (current.second.data_begin < previous.second.data_end) {
        fail("safetensors '", path_, "': tensor '", current.first, "' (bytes [",
             current.second.data_begin, ", ", current.second.data_end, ")) overlaps tensor '",
             previous.first, "' (bytes [", previous.second.data_begin, ", ",
             previous.second.data_end, ")); the file is corrupt, re-export it");
      }
    }
  }

  // Bytes past the end of the last tensor belong to no tensor: a file
  // appended to, or a header that lost an entry. The format forbids them (its
  // reference reader refuses an incompletely indexed buffer), so does laga.
  // Gaps between tensors stay accepted (SafetensorsRead.UnpaddedHeaderAndGaps).
  void check_nothing_after_last(const std::map<std::string, SafetensorsTensorInfo>& tensors) const {
    std::uint64_t end = 0;
    for (const auto& entry : tensors) end = std::max(end, entry.second.data_end);
    if (end < data_bytes_) {
      fail_file(cat("the data section holds ", data_bytes_, " bytes but its tensors end at byte ",
                    end, "; ", data_bytes_ - end,
                    " bytes after the last tensor belong to none: the file was appended to or "
                    "its header lost an entry, re-export it"));
    }
  }

  const std::string& path_;
  std::uint64_t data_bytes_;
};

Json parse_header_json(const std::string& path, const std::string& text) {
  // nlohmann keeps the last of duplicated keys silently; a duplicated tensor
  // name would hide one of two tensors, a duplicated field (dtype, shape)
  // one of two values, so both are refused (io/json_repeated_keys.hpp).
  RepeatedKeys repeated;
  bool duplicate_is_tensor = false;  // the first repeat is a tensor's name (depth 1)
  auto note_duplicates = [&](int depth, Json::parse_event_t event, Json& parsed) {
    const bool first = repeated.first().empty();
    if (repeated.observe(event, parsed) && first) duplicate_is_tensor = depth == 1;
    return true;
  };
  Json header;
  try {
    header = Json::parse(text, note_duplicates);
  } catch (const Json::exception& e) {
    fail("safetensors '", path, "': the header is not valid JSON (", e.what(),
         "); the file is corrupt or not safetensors");
  }
  if (!header.is_object()) {
    fail("safetensors '", path, "': the header is a JSON ", header.type_name(),
         ", not an object mapping tensor names to entries; the file is not safetensors");
  }
  if (const std::string& duplicate = repeated.first(); !duplicate.empty()) {
    fail("safetensors '", path, "': ", duplicate_is_tensor ? "tensor '" : "key '", duplicate,
         "' appears twice in ", duplicate_is_tensor ? "the header" : "one object of the header",
         "; the file is corrupt, re-export it");
  }
  return header;
}

std::string describe_names(const std::map<std::string, SafetensorsTensorInfo>& tensors) {
  if (tensors.empty()) return "the file holds no tensors";
  constexpr std::size_t kShown = 8;
  std::string list = cat("it holds ", tensors.size(), " tensors: ");
  std::size_t shown = 0;
  for (const auto& entry : tensors) {
    if (shown == kShown) break;
    if (shown) list += ", ";
    list += cat("'", entry.first, "'");
    ++shown;
  }
  if (tensors.size() > kShown) list += ", ...";
  return list;
}

// Reads up to `size` bytes at `offset`, retrying short reads; returns how
// many arrived (fewer only at end of file) or throws on an I/O error.
std::size_t read_at(int fd, const std::string& path, void* destination, std::size_t size,
                    std::uint64_t offset) {
  char* next = static_cast<char*>(destination);
  std::size_t done = 0;
  while (done < size) {
    ssize_t got = ::pread(fd, next + done, size - done, static_cast<off_t>(offset + done));
    if (got < 0) {
      if (errno == EINTR) continue;
      int err = errno;
      fail("safetensors '", path, "': reading ", size, " bytes at offset ", offset,
           " failed: ", std::strerror(err), "; check the disk or filesystem");
    }
    if (got == 0) break;
    done += static_cast<std::size_t>(got);
  }
  return done;
}

// Reads `count` stored elements at `offset` and converts them into
// `destination`; returns how many bytes arrived.
template <class Stored, class T, class Convert>
std::uint64_t read_converted(int fd, const std::string& path, std::uint64_t offset, T* destination,
                             std::int64_t count, Convert convert) {
  constexpr std::size_t kPerChunk = kConversionChunkBytes / sizeof(Stored);
  std::vector<Stored> chunk(std::min<std::size_t>(kPerChunk, static_cast<std::size_t>(count)));
  std::size_t done = 0;
  const std::size_t total = static_cast<std::size_t>(count);
  while (done < total) {
    const std::size_t want = std::min(chunk.size(), total - done);
    const std::size_t got =
        read_at(fd, path, chunk.data(), want * sizeof(Stored), offset + done * sizeof(Stored)) /
        sizeof(Stored);
    for (std::size_t i = 0; i < got; ++i) destination[done + i] = convert(chunk[i]);
    done += got;
    if (got < want) break;
  }
  return done * sizeof(Stored);
}

}  // namespace

struct SafetensorsFile::Descriptor {
  explicit Descriptor(int descriptor) : fd(descriptor) {}
  Descriptor(const Descriptor&) = delete;
  Descriptor& operator=(const Descriptor&) = delete;
  ~Descriptor() { ::close(fd); }
  int fd;
};

std::int64_t SafetensorsTensorInfo::numel() const {
  return laga::numel(shape);
}

SafetensorsFile SafetensorsFile::open(const std::string& path) {
  // O_NONBLOCK so that a FIFO given by mistake is refused below instead of
  // blocking the open; it changes nothing for regular files.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    int err = errno;
    fail("safetensors '", path, "': cannot open for reading: ", std::strerror(err),
         err == ENOENT ? "; check the path" : "; check its permissions");
  }
  auto descriptor = std::make_shared<const Descriptor>(fd);
  struct stat status {};
  if (::fstat(fd, &status) != 0) {
    int err = errno;
    fail("safetensors '", path, "': cannot determine the file size: ", std::strerror(err));
  }
  if (!S_ISREG(status.st_mode)) {
    fail("safetensors '", path, "': not a regular file; give the path of a .safetensors file");
  }
  const std::uint64_t file_size = static_cast<std::uint64_t>(status.st_size);

  if (file_size < 8) {
    fail("safetensors '", path, "': the file is ", file_size,
         " bytes, shorter than the 8-byte header length that starts every safetensors file; "
         "it is truncated or not safetensors");
  }
  unsigned char length_bytes[8];
  if (read_at(fd, path, length_bytes, 8, 0) != 8) {
    fail("safetensors '", path,
         "': the file ended while reading the header length; was it "
         "modified while being opened?");
  }
  const std::uint64_t header_length = decode_u64_le(length_bytes);
  if (header_length > kMaxHeaderBytes) {
    fail("safetensors '", path, "': the header claims ", header_length,
         " bytes, more than the 100 MB limit; the file is corrupt or not safetensors");
  }
  if (header_length > file_size - 8) {
    fail("safetensors '", path, "': the header claims ", header_length, " bytes but the file has ",
         file_size - 8, " after the length; the file is truncated, copy it again");
  }
  std::string header_text(static_cast<std::size_t>(header_length), '\0');
  if (read_at(fd, path, header_text.data(), header_text.size(), 8) != header_length) {
    fail("safetensors '", path, "': the file ended while reading its ", header_length,
         "-byte header; was it modified while being opened?");
  }

  const Json header = parse_header_json(path, header_text);
  SafetensorsFile file;
  file.path_ = path;
  file.descriptor_ = std::move(descriptor);
  file.data_start_ = 8 + header_length;
  HeaderParser parser(path, file_size - file.data_start_);
  file.tensors_ = parser.parse_tensors(header);
  file.metadata_ = parser.parse_metadata(header);
  return file;
}

std::vector<std::string> SafetensorsFile::names() const {
  std::vector<std::string> result;
  result.reserve(tensors_.size());
  for (const auto& entry : tensors_) result.push_back(entry.first);
  return result;
}

const SafetensorsTensorInfo& SafetensorsFile::find(const std::string& name) const {
  auto found = tensors_.find(name);
  if (found == tensors_.end()) {
    fail("safetensors '", path_, "': no tensor '", name, "'; ", describe_names(tensors_),
         "; check the name and that this is the right checkpoint");
  }
  return found->second;
}

const SafetensorsTensorInfo& SafetensorsFile::info(const std::string& name) const {
  return find(name);
}

void SafetensorsFile::check_shape(const std::string& name, const Shape& expected) const {
  const SafetensorsTensorInfo& entry = find(name);
  if (entry.shape != expected) {
    fail("safetensors '", path_, "': tensor '", name, "' has shape ", to_string(entry.shape),
         " but ", to_string(expected),
         " is expected; check that the checkpoint matches the model config");
  }
}

void SafetensorsFile::check_readable(const std::string& name, const TensorInfo& entry) const {
  if (entry.dtype == "F8_E4M3") {
    fail("safetensors '", path_, "': tensor '", name,
         "' has dtype F8_E4M3, a block-scaled weight that is read only together with its '", name,
         "_scale_inv' (as --weights does); it reads ", kSafetensorsReadableDtypes, " alone");
  }
  if (!readable_dtype(entry.dtype)) {
    fail("safetensors '", path_, "': tensor '", name, "' has dtype ", entry.dtype,
         ", which laga cannot convert to floating point; it reads ", kSafetensorsReadableDtypes);
  }
}

template <class T>
void SafetensorsFile::fill_from_file(const std::string& name, const SafetensorsTensorInfo& entry,
                                     T* destination) const {
  const std::int64_t count = entry.numel();
  if (count == 0) return;
  const int fd = descriptor_->fd;
  const std::uint64_t offset = data_start_ + entry.data_begin;

  std::uint64_t got_bytes = 0;
  const bool same_type = (entry.dtype == "F32" && std::is_same_v<T, float>) ||
                         (entry.dtype == "F64" && std::is_same_v<T, double>);
  if (same_type) {
    got_bytes = read_at(fd, path_, destination, static_cast<std::size_t>(entry.bytes()), offset);
  } else if (entry.dtype == "F32") {
    got_bytes = read_converted<float>(fd, path_, offset, destination, count,
                                      [](float v) { return static_cast<T>(v); });
  } else if (entry.dtype == "F64") {
    got_bytes = read_converted<double>(fd, path_, offset, destination, count,
                                       [](double v) { return static_cast<T>(v); });
  } else if (entry.dtype == "BF16") {
    got_bytes = read_converted<std::uint16_t>(
        fd, path_, offset, destination, count,
        [](std::uint16_t v) { return static_cast<T>(bf16_to_float(v)); });
  } else {
    got_bytes = read_converted<std::uint16_t>(
        fd, path_, offset, destination, count,
        [](std::uint16_t v) { return static_cast<T>(f16_to_float(v)); });
  }
  if (got_bytes != entry.bytes()) {
    fail("safetensors '", path_, "': tensor '", name, "' needs ", entry.bytes(), " bytes but only ",
         got_bytes, " could be read; the file was truncated or changed after it was opened");
  }
}

template <class T>
Tensor<T> SafetensorsFile::read(const std::string& name, MemCategory cat) const {
  const SafetensorsTensorInfo& entry = find(name);
  check_readable(name, entry);
  Tensor<T> tensor(entry.shape, cat);
  if (tensor.data()) fill_from_file(name, entry, tensor.data());
  return tensor;
}

template <class T>
Tensor<T> SafetensorsFile::read(const std::string& name, const Shape& expected,
                                MemCategory cat) const {
  check_shape(name, expected);
  return read<T>(name, cat);
}

template <class T>
void SafetensorsFile::read_into(const std::string& name, Tensor<T>& destination) const {
  check_shape(name, destination.shape());
  const SafetensorsTensorInfo& entry = find(name);
  check_readable(name, entry);
  if (destination.data()) fill_from_file(name, entry, destination.data());
}

std::vector<std::int64_t> SafetensorsFile::read_indices(const std::string& name) const {
  const SafetensorsTensorInfo& entry = find(name);
  const std::int64_t count = entry.numel();
  std::vector<std::int64_t> values(static_cast<std::size_t>(count));
  std::uint64_t got_bytes = 0;
  if (entry.dtype == "I64")
    got_bytes = read_at(descriptor_->fd, path_, values.data(), entry.bytes(),
                        data_start_ + entry.data_begin);
  else if (entry.dtype == "I32")
    got_bytes = read_converted<std::int32_t>(descriptor_->fd, path_, data_start_ + entry.data_begin,
                                             values.data(), count,
                                             [](std::int32_t v) { return std::int64_t(v); });
  else
    fail("safetensors '", path_, "': tensor '", name, "' has dtype ", entry.dtype,
         " but it holds indices; store it as I32 or I64");
  LAGA_CHECK(got_bytes == entry.bytes(), "safetensors '", path_, "': tensor '", name, "' needs ",
             entry.bytes(), " bytes but only ", got_bytes,
             " could be read; the file was truncated or changed after it was opened");
  return values;
}

void SafetensorsFile::read_raw(const std::string& name, std::uint64_t begin, std::uint64_t size,
                               void* destination) const {
  const SafetensorsTensorInfo& entry = find(name);
  LAGA_CHECK(begin <= entry.bytes() && size <= entry.bytes() - begin, "safetensors '", path_,
             "': bytes [", begin, ", ", begin + size, ") of tensor '", name,
             "' asked for, but it holds ", entry.bytes(), " (a laga bug)");
  const std::size_t got =
      read_at(descriptor_->fd, path_, destination, static_cast<std::size_t>(size),
              data_start_ + entry.data_begin + begin);
  LAGA_CHECK(got == size, "safetensors '", path_, "': tensor '", name, "' needs ", entry.bytes(),
             " bytes but only ", begin + got,
             " could be read; the file was truncated or changed after it was opened");
}

template Tensor<float> SafetensorsFile::read<float>(const std::string&, MemCategory) const;
template Tensor<double> SafetensorsFile::read<double>(const std::string&, MemCategory) const;
template Tensor<float> SafetensorsFile::read<float>(const std::string&, const Shape&,
                                                    MemCategory) const;
template Tensor<double> SafetensorsFile::read<double>(const std::string&, const Shape&,
                                                      MemCategory) const;
template void SafetensorsFile::read_into<float>(const std::string&, Tensor<float>&) const;
template void SafetensorsFile::read_into<double>(const std::string&, Tensor<double>&) const;

// ---------------------------------------------------------------------------

void SafetensorsWriter::add_bytes(const std::string& name, const char* dtype,
                                  std::size_t element_size, const Shape& shape, const void* data,
                                  std::int64_t byte_count, bool backed) {
  LAGA_CHECK(!name.empty(), "safetensors writer: a tensor name must not be empty");
  LAGA_CHECK(name != kMetadataKey, "safetensors writer: '", kMetadataKey,
             "' is reserved for metadata; use add_metadata() or another tensor name");
  LAGA_CHECK(tensors_.count(name) == 0, "safetensors writer: tensor '", name,
             "' was already added; each name may appear once");
  try {
    (void)Json(name).dump();
  } catch (const Json::exception&) {
    fail("safetensors writer: tensor name '", name, "' is not valid UTF-8; rename it");
  }
  LAGA_CHECK(backed, "safetensors writer: tensor '", name, "' of shape ", to_string(shape),
             " has no storage (allocated under a count-only pool); allocate it normally to save "
             "it");
  Pending pending;
  pending.dtype = dtype;
  pending.element_size = element_size;
  pending.shape = shape;
  pending.bytes.assign(static_cast<const char*>(data), static_cast<std::size_t>(byte_count));
  tensors_.emplace(name, std::move(pending));
}

void SafetensorsWriter::add(const std::string& name, const Tensor<float>& tensor) {
  LAGA_CHECK(tensor.defined() || tensor.numel() > 0, "safetensors writer: tensor '", name,
             "' is empty (default-constructed or reset); give it a shape before adding it");
  add_bytes(name, "F32", sizeof(float), tensor.shape(), tensor.data(), tensor.bytes(),
            tensor.data() != nullptr || tensor.numel() == 0);
}

void SafetensorsWriter::add(const std::string& name, const Tensor<double>& tensor) {
  LAGA_CHECK(tensor.defined() || tensor.numel() > 0, "safetensors writer: tensor '", name,
             "' is empty (default-constructed or reset); give it a shape before adding it");
  add_bytes(name, "F64", sizeof(double), tensor.shape(), tensor.data(), tensor.bytes(),
            tensor.data() != nullptr || tensor.numel() == 0);
}

void SafetensorsWriter::add_indices(const std::string& name, const Shape& shape,
                                    const std::vector<std::int64_t>& values) {
  std::int64_t numel = 1;
  for (std::int64_t d : shape) numel *= d;
  LAGA_CHECK(numel == std::int64_t(values.size()), "safetensors writer: tensor '", name,
             "' has shape ", to_string(shape), " but ", values.size(), " values");
  add_bytes(name, "I64", sizeof(std::int64_t), shape, values.data(),
            std::int64_t(values.size() * sizeof(std::int64_t)), true);
}

void SafetensorsWriter::add_metadata(const std::string& key, const std::string& value) {
  try {
    (void)Json(key).dump();
    (void)Json(value).dump();
  } catch (const Json::exception&) {
    fail("safetensors writer: metadata '", key, "' is not valid UTF-8; metadata must be text");
  }
  metadata_[key] = value;
}

std::vector<const std::pair<const std::string, SafetensorsWriter::Pending>*>
SafetensorsWriter::data_order() const {
  std::vector<const std::pair<const std::string, Pending>*> order;
  for (const auto& entry : tensors_) order.push_back(&entry);
  // Wider elements first keeps every tensor aligned to its element size for
  // readers that map the file, as the reference implementation arranges.
  std::stable_sort(order.begin(), order.end(), [](const auto* a, const auto* b) {
    return a->second.element_size > b->second.element_size;
  });
  return order;
}

std::string SafetensorsWriter::header() const {
  Json header = Json::object();
  if (!metadata_.empty()) header[kMetadataKey] = metadata_;
  std::uint64_t offset = 0;
  for (const auto* entry : data_order()) {
    const Pending& pending = entry->second;
    const std::uint64_t end = offset + pending.bytes.size();
    header[entry->first] = {
        {"dtype", pending.dtype}, {"shape", pending.shape}, {"data_offsets", {offset, end}}};
    offset = end;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  return text;
}

std::string SafetensorsWriter::serialize() const {
  const std::string header_text = header();
  std::string bytes = encode_u64_le(header_text.size()) + header_text;
  for (const auto* entry : data_order()) bytes += entry->second.bytes;
  return bytes;
}

void SafetensorsWriter::write(const std::string& path) const {
  const std::string header_text = header();
  const std::string length = encode_u64_le(header_text.size());
  std::vector<std::string_view> pieces{length, header_text};
  for (const auto* entry : data_order()) pieces.push_back(entry->second.bytes);
  write_file_atomic(path, pieces);
}

}  // namespace laga
