#include "model/data.hpp"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "core/error.hpp"
#include "core/rng.hpp"
#include "mla/ops_model.hpp"  // kIgnoreTarget
#include "mla/params.hpp"

namespace laga {

namespace {
constexpr std::int32_t kLlmcMagic = 20240520;
constexpr std::int64_t kLlmcHeaderBytes = 1024;  // 256 int32
// Version 1 or 2, a positive count and the rest of the header zero: llm.c's
// header whatever the magic says.
bool looks_like_llmc_header(const std::string& bytes) {
  if (static_cast<std::int64_t>(bytes.size()) < kLlmcHeaderBytes) return false;
  std::int32_t head[3];
  std::memcpy(head, bytes.data(), sizeof head);
  if ((head[1] != 1 && head[1] != 2) || head[2] <= 0) return false;
  for (std::int64_t i = 12; i < kLlmcHeaderBytes; ++i)
    if (bytes[static_cast<size_t>(i)] != 0) return false;
  return true;
}
bool ends_with(const std::string& s, const std::string& e) {
  return s.size() >= e.size() && s.compare(s.size() - e.size(), e.size(), e) == 0;
}
}  // namespace

PackedBatch pack_window(const std::int32_t* window, std::int64_t B, std::int64_t S,
                        std::int32_t eos) {
  std::vector<std::vector<std::int64_t>> rows;
  std::vector<std::int32_t> targets(static_cast<std::size_t>(B * S));
  std::int64_t counted = 0;
  for (std::int64_t b = 0; b < B; ++b) {
    const std::int32_t* ids = window + b * (S + 1);
    std::vector<std::int64_t> cu{0};
    for (std::int64_t t = 0; t < S; ++t) {
      const bool ends_document = ids[t] == eos;
      // A document ends after this token; the next starts at t + 1 (none
      // starts at S: the row ends there anyway).
      if (ends_document && t + 1 < S) cu.push_back(t + 1);
      targets[static_cast<std::size_t>(b * S + t)] = ends_document ? kIgnoreTarget : ids[t + 1];
      counted += ends_document ? 0 : 1;
    }
    cu.push_back(S);
    rows.push_back(std::move(cu));
  }
  return {Documents::from_cu_seqlens("--pack-eos", B, S, rows), std::move(targets), counted};
}

TokenSource TokenSource::random(std::int64_t vocab, std::uint64_t seed) {
  TokenSource t;
  t.vocab_ = vocab;
  t.seed_ = seed;
  return t;
}

TokenSource TokenSource::file(const std::string& path, const std::string& dtype_opt,
                              std::int64_t vocab, std::int64_t seq, std::uint64_t seed,
                              const std::string& option) {
  namespace fs = std::filesystem;
  TokenSource t;
  t.random_ = false;
  t.vocab_ = vocab;
  t.seed_ = seed;
  t.path_ = path;
  // stat, never open, before knowing it is a regular file: opening a FIFO
  // with no writer would block forever.
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  LAGA_CHECK(fs::exists(st), option, " '", path,
             "': no such file; give a flat binary of uint16/uint32 token ids (nanoGPT/llm.c "
             ".bin) or --data random");
  LAGA_CHECK(!fs::is_directory(st), option, " '", path,
             "' is a directory; give the token file inside it (a flat binary of uint16/uint32 "
             "ids)");
  LAGA_CHECK(fs::is_regular_file(st), option, " '", path,
             "' is not a regular file (a FIFO, socket or device); laga reads token data from a "
             "file whose size it knows: copy it to a file first");
  const auto size = static_cast<std::int64_t>(fs::file_size(path, ec));
  LAGA_CHECK(!ec && size > 0, option, " '", path,
             "' is empty; it must hold at least --seq + 1 = ", seq + 1, " token ids");
  std::ifstream in(path, std::ios::binary);
  LAGA_CHECK(in, option, " '", path, "': cannot open it for reading; check its permissions");
  std::string bytes(static_cast<size_t>(size), '\0');
  in.read(bytes.data(), size);
  LAGA_CHECK(in.gcount() == size, option, " '", path, "': read ", in.gcount(), " of ", size,
             " bytes; is the file being written?");

  std::int64_t header = 0;
  std::string dtype = dtype_opt;
  std::int32_t head[3] = {0, 0, 0};
  if (size >= kLlmcHeaderBytes) std::memcpy(head, bytes.data(), sizeof head);
  const bool llmc = size >= kLlmcHeaderBytes && head[0] == kLlmcMagic;
  // A header whose magic is wrong would otherwise be read as ids, and pass
  // when --vocab is large: refuse what looks like one (version 1 or 2, a
  // positive count, the rest of the 1024 bytes zero).
  if (!llmc && looks_like_llmc_header(bytes))
    fail(option, " '", path, "' starts with what looks like an llm.c header (version ", head[1],
         ", ", head[2], " tokens) but its magic is ", head[0], ", not ", kLlmcMagic,
         "; the file is damaged or of another format");
  if (dtype == "auto") {
    if (llmc) {
      LAGA_CHECK(head[1] == 1 || head[1] == 2, option, " '", path, "': llm.c header version ",
                 head[1],
                 " is not 1 (uint16) or 2 (uint32); pass --data-dtype u16|u32 for a raw file");
      dtype = head[1] == 1 ? "u16" : "u32";
      header = kLlmcHeaderBytes;
    } else {
      dtype = ends_with(path, ".u32") || ends_with(path, ".uint32") ? "u32" : "u16";
    }
  } else {
    LAGA_CHECK(!llmc, option, " '", path, "' has an llm.c header but --data-dtype ", dtype,
               " reads it as raw ids (the header would become tokens); use --data-dtype auto");
  }
  LAGA_CHECK(dtype == "u16" || dtype == "u32", "--data-dtype '", dtype,
             "' is not one of auto, u16, u32");
  t.dtype_ = dtype + (header ? " (llm.c header)" : "");
  const std::int64_t elem = dtype == "u16" ? 2 : 4;
  const std::int64_t body = size - header;
  LAGA_CHECK(body % elem == 0, option, " '", path, "': ", body,
             " bytes of ids is not a whole number of ", dtype, " ids; is it a ",
             dtype == "u16" ? "u32" : "u16", " file? (set --data-dtype)");
  const std::int64_t n = body / elem;
  // The header's count must be the body's: fewer ids means a truncated file,
  // more (e.g. twice as many: uint32 ids under a version-1 uint16 header)
  // means the body is not what the header says.
  if (header)
    LAGA_CHECK(head[2] == n, option, " '", path, "': the llm.c header says ", head[2],
               " tokens but the body holds ", n, " ", dtype, " ids",
               n > head[2] && head[2] > 0 && n == 2 * std::int64_t(head[2])
                   ? " (twice as many: uint32 ids under a version-1 header?)"
                   : "",
               "; the file is truncated or its header is wrong");
  LAGA_CHECK(n >= seq + 1, option, " '", path, "' holds ", n,
             " token ids but one window needs --seq + 1 = ", seq + 1,
             "; use a longer file or a smaller --seq");
  t.ids_.resize(static_cast<size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) {
    std::uint32_t id = 0;
    if (elem == 2) {
      std::uint16_t v;
      std::memcpy(&v, bytes.data() + header + 2 * i, 2);
      id = v;
    } else {
      std::memcpy(&id, bytes.data() + header + 4 * i, 4);
    }
    LAGA_CHECK(static_cast<std::int64_t>(id) < vocab, option, " '", path, "': token id ", id,
               " at position ", i, " is >= --vocab ", vocab, "; pass --vocab ",
               std::int64_t(id) + 1,
               " or more (the tokenizer's vocabulary size), or check --data-dtype");
    t.ids_[static_cast<size_t>(i)] = id;
  }
  return t;
}

void TokenSource::batch(std::int64_t cursor, std::int64_t B, std::int64_t S,
                        std::int32_t* out) const {
  for (std::int64_t b = 0; b < B; ++b) {
    std::int32_t* row = out + b * (S + 1);
    if (random_) {
      // The same rows every step: the memorisation task.
      static const std::uint64_t stream = name_stream("data.random");
      for (std::int64_t i = 0; i <= S; ++i) {
        const double u = rng_uniform(seed_, stream, static_cast<std::uint64_t>(b * (S + 1) + i));
        row[i] = static_cast<std::int32_t>(
            std::min<std::int64_t>(vocab_ - 1, static_cast<std::int64_t>(u * double(vocab_))));
      }
    } else {
      static const std::uint64_t stream = name_stream("data.window");
      const std::int64_t n = tokens(), span = n - S;  // start in [0, n - S - 1]
      const double u = rng_uniform(seed_, stream, static_cast<std::uint64_t>(cursor + b));
      const std::int64_t start =
          std::min<std::int64_t>(span - 1, static_cast<std::int64_t>(u * double(span)));
      for (std::int64_t i = 0; i <= S; ++i)
        row[i] = static_cast<std::int32_t>(ids_[static_cast<size_t>(start + i)]);
    }
  }
}

std::int64_t TokenSource::occurrences(std::int32_t id) const {
  if (random_) return -1;
  return std::count(ids_.begin(), ids_.end(), static_cast<std::uint32_t>(id));
}

std::string TokenSource::describe() const {
  if (random_) return cat("random (fixed, seed ", seed_, ", vocab ", vocab_, ")");
  return cat("file '", path_, "' (", ids_.size(), " ids, ", dtype_, ")");
}

}  // namespace laga
