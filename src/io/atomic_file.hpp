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
// An existing file keeps its permission bits. Before anything is written,
// resolve_output_path() vets `path` (below): a symlink is written through (its
// target is replaced, the link stays), anything but a regular file is refused,
// and so is a file this process reads as an input.
#pragma once

#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace laga {

// The one check every writer of a user-named file runs (write_file_atomic
// calls it; so do the tools for their outputs up front, before any work, and
// for the --log they append to). Returns the path to write: `path` itself, or
// for a symlink (chains included) the file it finally names, which may not
// exist yet. Refuses with laga::Error, naming `what` ("--output", "--log", ...):
//   - an existing path that is not a regular file: directory, FIFO, device
//     node, socket (replacing one would destroy it: as root, /dev/null);
//   - a path that is the same file (device and inode, so through symlinks and
//     hard links) as one of the inputs protected by a live ProtectedInputs.
std::string resolve_output_path(const std::string& path, const std::string& what = "output");
// Creates and removes a file in the directory `path` would be written in (the
// way write_file_atomic's temporary is made), so an output that cannot be
// written is refused before the work that produces it; the error names
// `what`, the directory and the system's reason.
void probe_writable_directory(const std::string& path, const std::string& what);

// While alive, the named input files may not be written by any writer of this
// process (resolve_output_path refuses them). Each entry: the path and what it
// is ("--weights", "--data", "the resume checkpoint"); paths that do not exist
// (yet) protect nothing. Tools hold one for the whole command.
// With `missing_too`, a path that does not exist is protected by its name
// (resolved: absolute, symlinks followed as far as they exist): a file a set
// of inputs names but lacks (a shard not downloaded) may not be created by an
// output either, where it would pose as that input.
class ProtectedInputs {
 public:
  explicit ProtectedInputs(const std::vector<std::pair<std::string, std::string>>& inputs,
                           bool missing_too = false);
  ~ProtectedInputs();
  ProtectedInputs(const ProtectedInputs&) = delete;
  ProtectedInputs& operator=(const ProtectedInputs&) = delete;

 private:
  std::vector<unsigned long> ids_;
};

void write_file_atomic(const std::string& path, std::string_view bytes);

// The file's contents are the pieces in order; lets a caller with a header and
// large payloads avoid concatenating them into one buffer first.
void write_file_atomic(const std::string& path, const std::vector<std::string_view>& pieces);

}  // namespace laga
