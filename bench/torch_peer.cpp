#include "torch_peer.hpp"

#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>
#include <csignal>

#include <nlohmann/json.hpp>

#include "core/error.hpp"

namespace laga::bench {

TorchPeer::TorchPeer(const std::string& command) : command_(command) {
  // A peer that dies must surface as the error below, not as SIGPIPE killing
  // the harness on its next write.
  std::signal(SIGPIPE, SIG_IGN);
  int in[2], out[2];  // in: parent -> peer stdin; out: peer stdout -> parent
  LAGA_CHECK(pipe2(in, O_CLOEXEC) == 0 && pipe2(out, O_CLOEXEC) == 0,
             "laga_bench: pipe() failed starting '", command, "'");
  pid_ = fork();
  LAGA_CHECK(pid_ >= 0, "laga_bench: fork() failed starting '", command, "'");
  if (pid_ == 0) {
    // dup2 clears O_CLOEXEC on the new descriptors; the originals close at exec.
    dup2(in[0], STDIN_FILENO);
    dup2(out[1], STDOUT_FILENO);
    execl("/bin/sh", "sh", "-c", command.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  close(in[0]);
  close(out[1]);
  to_ = fdopen(in[1], "w");
  from_ = fdopen(out[0], "r");
  LAGA_CHECK(to_ && from_, "laga_bench: fdopen() failed for '", command, "'");
  const auto ready = nlohmann::json::parse(read_line(), nullptr, false);
  LAGA_CHECK(!ready.is_discarded() && ready.value("ready", false), "laga_bench: '", command,
             "' did not report ready; run it by hand to see its error");
  version_ = ready.value("torch", std::string("?"));
}

TorchPeer::~TorchPeer() {
  if (to_) std::fclose(to_);  // EOF on the peer's stdin ends its loop
  if (from_) std::fclose(from_);
  if (pid_ > 0) {
    int status = 0;
    waitpid(pid_, &status, 0);
  }
}

std::string TorchPeer::read_line() {
  std::string line;
  int c;
  while ((c = std::fgetc(from_)) != EOF && c != '\n') line.push_back(static_cast<char>(c));
  LAGA_CHECK(c == '\n', "laga_bench: '", command_,
             "' ended or closed its output early; run it by hand to see its error");
  return line;
}

double TorchPeer::step() {
  LAGA_CHECK(std::fputs("step\n", to_) >= 0 && std::fflush(to_) == 0, "laga_bench: '", command_,
             "' is no longer reading its input");
  const auto reply = nlohmann::json::parse(read_line(), nullptr, false);
  LAGA_CHECK(!reply.is_discarded() && reply.contains("ms"), "laga_bench: '", command_,
             "' answered a step with something other than {\"ms\": ...}");
  return reply.at("ms").get<double>();
}

}  // namespace laga::bench
