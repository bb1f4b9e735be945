// The token-file reader's strictness (issue 10, items 12 and 13): an llm.c
// header must agree with its body, a damaged header is not read as ids, and a
// directory or FIFO is named as such before anything is opened.
#include "model/data.hpp"

#include <gtest/gtest.h>
#include <sys/stat.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "common/error_of.hpp"
#include "common/scratch.hpp"
#include "core/error.hpp"
#include "kernels/cross_entropy.hpp"

namespace laga {
namespace {

namespace fs = std::filesystem;

fs::path scratch(const std::string& name) {
  return test::scratch_dir("model_data_", name);
}

using test::error_of;

// An llm.c file: 256 int32 header (magic, version, count) then the ids.
template <class Id>
void write_llmc(const fs::path& path, std::int32_t magic, std::int32_t version, std::int32_t count,
                const std::vector<Id>& ids) {
  std::vector<std::int32_t> head(256, 0);
  head[0] = magic, head[1] = version, head[2] = count;
  std::ofstream f(path, std::ios::binary);
  f.write(reinterpret_cast<const char*>(head.data()), 1024);
  f.write(reinterpret_cast<const char*>(ids.data()), std::streamsize(ids.size() * sizeof(Id)));
}

constexpr std::int32_t kMagic = 20240520;

TokenSource open(const fs::path& p, const std::string& dtype = "auto", std::int64_t vocab = 100) {
  return TokenSource::file(p.string(), dtype, vocab, 16, 1);
}

TEST(PackWindow, DocumentsEndAtEachEosAndItsTargetIsIgnored) {
  // Two rows of S + 1 = 7 ids, EOS = 9. Row 0: "1 2 9 | 3 9 | 4" + next id 5:
  // documents [0, 3), [3, 5), [5, 6); the targets of the EOS inputs (3, 4)
  // are ignored. Row 1 ends with an EOS input: no cut at S, its target (the
  // window's last id) ignored; a leading EOS makes a one-token document.
  const std::int32_t eos = 9;
  const std::vector<std::int32_t> window{1, 2, 9, 3, 9, 4, 5,  //
                                         9, 6, 7, 8, 6, 9, 2};
  const PackedBatch p = pack_window(window.data(), 2, 6, eos);
  EXPECT_EQ(p.documents.cu_seqlens(0), (std::vector<std::int64_t>{0, 3, 5, 6}));
  EXPECT_EQ(p.documents.cu_seqlens(1), (std::vector<std::int64_t>{0, 1, 6}));
  const std::int32_t x = kIgnoreTarget;
  EXPECT_EQ(p.targets, (std::vector<std::int32_t>{2, 9, x, 9, x, 5,  //
                                                  x, 7, 8, 6, 9, x}));
  EXPECT_EQ(p.counted, 8);
  // No EOS: one document per row, every target counted, exactly the unpacked window.
  const std::vector<std::int32_t> plain{1, 2, 3, 4};
  const PackedBatch q = pack_window(plain.data(), 1, 3, eos);
  EXPECT_EQ(q.documents.cu_seqlens(0), (std::vector<std::int64_t>{0, 3}));
  EXPECT_EQ(q.targets, (std::vector<std::int32_t>{2, 3, 4}));
  EXPECT_EQ(q.counted, 3);
}

TEST(TokenFile, LlmcHeaderCountMustMatchTheBody) {
  const fs::path dir = scratch("count");
  const std::vector<std::uint16_t> ids(4000, 7);
  write_llmc(dir / "ok.bin", kMagic, 1, 4000, ids);
  EXPECT_EQ(open(dir / "ok.bin").tokens(), 4000);

  for (std::int32_t count : {100, -5, 0, 5000}) {
    write_llmc(dir / "bad.bin", kMagic, 1, count, ids);
    const std::string e = error_of([&] { open(dir / "bad.bin"); });
    EXPECT_NE(e.find(cat("the llm.c header says ", count, " tokens but the body holds 4000")),
              std::string::npos)
        << count << ": " << e;
  }
}

TEST(TokenFile, Uint32BodyUnderVersion1HeaderIsRefused) {
  const fs::path dir = scratch("u32v1");
  write_llmc(dir / "t.bin", kMagic, 1, 500, std::vector<std::uint32_t>(500, 3));
  const std::string e = error_of([&] { open(dir / "t.bin"); });
  EXPECT_NE(e.find("uint32 ids under a version-1 header"), std::string::npos) << e;
}

TEST(TokenFile, HeaderWithWrongMagicIsNotReadAsIds) {
  const fs::path dir = scratch("magic");
  write_llmc(dir / "t.bin", kMagic + 1, 1, 600, std::vector<std::uint16_t>(600, 3));
  // A vocabulary large enough for the header's halves to pass as ids.
  const std::string e = error_of([&] { open(dir / "t.bin", "auto", 1 << 30); });
  EXPECT_NE(e.find("looks like an llm.c header"), std::string::npos) << e;
  EXPECT_NE(e.find("20240521"), std::string::npos) << e;
}

TEST(TokenFile, ExplicitDtypeOnAHeaderedFileIsRefused) {
  const fs::path dir = scratch("explicit");
  write_llmc(dir / "t.bin", kMagic, 1, 600, std::vector<std::uint16_t>(600, 3));
  const std::string e = error_of([&] { open(dir / "t.bin", "u16", 1 << 30); });
  EXPECT_NE(e.find("has an llm.c header but --data-dtype u16"), std::string::npos) << e;
  EXPECT_EQ(open(dir / "t.bin", "auto").tokens(), 600);
}

TEST(TokenFile, DirectoryAndFifoAreNamedAndNeverOpened) {
  const fs::path dir = scratch("special");
  std::string e = error_of([&] { open(dir); });
  EXPECT_NE(e.find("is a directory"), std::string::npos) << e;
  const fs::path fifo = dir / "fifo";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  // Opening a FIFO with no writer blocks; this returns because it never opens.
  e = error_of([&] { open(fifo); });
  EXPECT_NE(e.find("is not a regular file"), std::string::npos) << e;
  e = error_of([&] { open(dir / "none.bin"); });
  EXPECT_NE(e.find("no such file"), std::string::npos) << e;
}

}  // namespace
}  // namespace laga
