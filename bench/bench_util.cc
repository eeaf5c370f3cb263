#include "bench/bench_util.h"

#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <stdexcept>
#include <thread>

namespace kvtier::bench {

Daemon::Daemon(const std::vector<std::string>& flags) {
  char tmpl[] = "/tmp/kvtier-bench-XXXXXX";
  dir_ = mkdtemp(tmpl);
  socket_ = dir_ + "/kvtier.sock";
  auto self = std::filesystem::read_symlink("/proc/self/exe").parent_path();
  std::vector<std::string> args = {(self / "kvtierd").string(), "--listen", "unix:" + socket_,
                                   "--instance", "bench-" + std::to_string(getpid()),
                                   "--log_level", "warn"};
  args.insert(args.end(), flags.begin(), flags.end());
  pid_ = fork();
  if (pid_ == 0) {
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    execv(argv[0], argv.data());
    _exit(127);
  }
  for (int i = 0; i < 200; ++i) {
    struct stat st {};
    if (stat(socket_.c_str(), &st) == 0) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  throw std::runtime_error("kvtierd did not start");
}

Daemon::~Daemon() {
  if (pid_ > 0) {
    kill(pid_, SIGTERM);
    waitpid(pid_, nullptr, 0);
  }
  std::error_code ec;
  std::filesystem::remove_all(dir_, ec);
}

double Quantile(std::vector<double> v, double q) {
  if (v.empty()) return NAN;
  std::sort(v.begin(), v.end());
  size_t rank = static_cast<size_t>(std::ceil(q * v.size()));
  return v[std::clamp<size_t>(rank, 1, v.size()) - 1];
}

double Median(std::vector<double> v) { return Quantile(std::move(v), 0.5); }

void Print(const Figure& f) {
  std::string params;
  for (const auto& [k, v] : f.parameters) {
    params += (params.empty() ? "" : ", ") + ("\"" + k + "\": ") +
              (std::all_of(v.begin(), v.end(),
                           [](char c) { return std::isdigit(c) || c == '.' || c == '-'; }) &&
                       !v.empty()
                   ? v
                   : "\"" + v + "\"");
  }
  std::printf(
      "{\"name\": \"%s\", \"value\": %.6g, \"unit\": \"%s\", \"baseline\": %.6g, "
      "\"baseline_name\": \"%s\", \"ratio\": %.4f, \"parameters\": {%s}}\n",
      f.name.c_str(), f.value, f.unit.c_str(), f.baseline, f.baseline_name.c_str(),
      f.baseline != 0 ? f.value / f.baseline : NAN, params.c_str());
  std::fflush(stdout);
}

}  // namespace kvtier::bench
