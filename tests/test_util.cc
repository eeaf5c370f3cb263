#include "tests/test_util.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstdio>

#include "server/common/fp16.h"

namespace kvtier::testing {

std::vector<uint16_t> RandomHalfs(size_t n, std::mt19937& rng) {
  std::normal_distribution<float> dist(0.f, 1.f);
  std::vector<uint16_t> out(n);
  for (auto& h : out) h = FloatToHalf(std::clamp(dist(rng), -4.f, 4.f));
  return out;
}

std::string AsBytes(const std::vector<uint16_t>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * 2);
}

std::vector<uint16_t> Slice(const std::vector<uint16_t>& all, int kv_heads, int total, int d,
                            int start, int n) {
  std::vector<uint16_t> out;
  out.reserve(static_cast<size_t>(kv_heads) * n * d);
  for (int h = 0; h < kv_heads; ++h) {
    auto begin = all.begin() + (static_cast<size_t>(h) * total + start) * d;
    out.insert(out.end(), begin, begin + static_cast<size_t>(n) * d);
  }
  return out;
}

DaemonProcess::DaemonProcess(const std::vector<std::string>& extra) : LocalDaemon("test", extra) {
  if (!started()) ADD_FAILURE() << "kvtierd did not start: " << Log();
}

DaemonProcess::~DaemonProcess() {
  if (running()) {
    int code = Terminate();
    if (code != 0) ADD_FAILURE() << "kvtierd exited " << code << ": " << Log();
  }
}

std::pair<int, std::string> RunCommand(const std::string& cmd) {
  std::string out;
  FILE* p = popen((cmd + " 2>&1").c_str(), "r");
  if (p == nullptr) return {-1, ""};
  std::array<char, 4096> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) out.append(buf.data(), n);
  int status = pclose(p);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

int FreePort() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  socklen_t len = sizeof a;
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  close(fd);
  return ntohs(a.sin_port);
}

std::string HttpGet(int port, const std::string& path) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    close(fd);
    return "";
  }
  std::string req = "GET " + path + " HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n";
  (void)!write(fd, req.data(), req.size());
  std::string out;
  char buf[4096];
  ssize_t n;
  while ((n = read(fd, buf, sizeof buf)) > 0) out.append(buf, n);
  close(fd);
  return out;
}

}  // namespace kvtier::testing
