// write_file_atomic — replace a file so that readers (and a crash) see either
// the old contents or the complete new ones, never a torn mix.
//
// The bytes go to a temporary file beside `path` (`<path>.tmp.<pid>.<n>`, so
// it lives on the same filesystem and the rename cannot become a copy), which
// is fsynced, renamed over `path`, and then the directory is fsynced so the
// rename itself is durable. If anything fails before the rename the temporary
// is removed and `path` is untouched; the error names the path, the step and
// the system's reason.
//
// An existing file keeps its permission bits. A symlink at `path` is replaced
// by a regular file rather than written through.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace laga {

void write_file_atomic(const std::string& path, std::string_view bytes);

// The file's contents are the pieces in order; lets a caller with a header and
// large payloads avoid concatenating them into one buffer first.
void write_file_atomic(const std::string& path, const std::vector<std::string_view>& pieces);

}  // namespace laga
