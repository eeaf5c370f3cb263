// The C++ client against a daemon that lies: an in-process KvTier service whose
// ListSegments names paths, links and files smaller than it claims. The client must answer
// each with an error naming the segment, never map another file or fault past a file's end,
// and refuse a handle whose offset + length wraps around 2^64.
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>
#include <thread>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "client/cpp/socket_io.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "kvtier/client.h"
#include "kvtier/v1/kvtier.grpc.pb.h"
#include "tests/test_util.h"

namespace kvtier {
namespace {

class LyingDaemon final : public v1::KvTier::Service {
 public:
  grpc::Status ListSegments(grpc::ServerContext*, const v1::ListSegmentsRequest*,
                            v1::ListSegmentsResponse* out) override {
    for (const auto& [id, name, bytes, slot_bytes, table] : segments) {
      v1::Segment* s = out->add_segments();
      s->set_segment_id(id);
      s->set_shm_name(name);
      s->set_size_bytes(bytes);
      s->set_slot_bytes(slot_bytes);
      s->set_generation_table_offset(table);
    }
    return grpc::Status::OK;
  }
  // id, name, size_bytes, slot_bytes, generation_table_offset
  std::vector<std::tuple<uint64_t, std::string, uint64_t, uint64_t, uint64_t>> segments;
};

TEST(ClientTrust, NamesSizesAndOffsetsFromTheDaemonAreChecked) {
  const std::string pid = std::to_string(getpid());
  const std::string small = "/kvtier-trust-" + pid, link = "/kvtier-trustlink-" + pid;
  const int fd = shm_open(small.c_str(), O_CREAT | O_RDWR, 0600);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(ftruncate(fd, 4096), 0);
  close(fd);
  ASSERT_EQ(symlink("/etc/passwd", ("/dev/shm" + link).c_str()), 0);

  LyingDaemon service;
  service.segments = {{1, "/kvtier-x/../../../etc/passwd", 4096, 0, 0},
                      {2, "/../etc/passwd", 4096, 0, 0},
                      {3, link, 4096, 0, 0},
                      {4, small, 1 << 20, 0, 0},
                      {5, small, 4096, 0, 0},
                      // A generation table whose cell's address wraps around to the start.
                      {6, small, 4096, 16, ~uint64_t{0} - 7},
                      {7, small, 4096, 16, 4096 - 8},
                      {8, small, 4096, 16, 3}};
  const std::string sock = "/tmp/kvtier-trust-" + pid + ".sock";
  grpc::ServerBuilder builder;
  builder.AddListeningPort("unix:" + sock, grpc::InsecureServerCredentials());
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  ClientOptions options;
  options.attach = false;
  auto client = Client::Connect("unix:" + sock, options);
  ASSERT_TRUE(client.ok()) << client.status();

  SegmentMap map;
  auto view = [&](uint64_t segment, uint64_t offset, uint64_t length) {
    v1::BlockHandle h;
    h.set_segment_id(segment);
    h.set_offset(offset);
    h.set_length(length);
    h.set_num_tokens(1);
    return map.View(**client, h);
  };
  for (auto [segment, code] : {std::pair{1, absl::StatusCode::kFailedPrecondition},
                               std::pair{2, absl::StatusCode::kFailedPrecondition},
                               std::pair{3, absl::StatusCode::kNotFound},
                               std::pair{4, absl::StatusCode::kFailedPrecondition}}) {
    const auto v = view(segment, 0, 16);
    EXPECT_EQ(v.status().code(), code) << segment << ": " << v.status();
    EXPECT_NE(v.status().message().find("segment " + std::to_string(segment)), std::string::npos)
        << v.status();
  }
  ASSERT_TRUE(view(5, 0, 16).ok());
  // offset + length wraps to 8: inside the segment, were the sum trusted.
  EXPECT_EQ(view(5, ~uint64_t{0} - 7, 16).status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(view(5, 4096 - 12, 16).status().code(), absl::StatusCode::kOutOfRange);
  // The generation cell: the table's offset wraps (6), the slot's cell lies past the end (7:
  // slot 1's cell would be at 4096), a misaligned table (8). Slot 0 of 7 has its cell, read
  // as the zeros the file holds, which the handle's generation 0 matches.
  EXPECT_EQ(view(6, 0, 16).status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(view(7, 16, 16).status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(view(8, 0, 16).status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_TRUE(view(7, 0, 16).ok());

  server->Shutdown();
  shm_unlink(small.c_str());
  unlink(("/dev/shm" + link).c_str());
  unlink(sock.c_str());
}

// The client's one send on a socket (the ticket line on the descriptor socket): a daemon that
// closed the connection first (past its per-uid limit, or draining) is an error of that call,
// never a SIGPIPE, which would end the worker's process (this test's process does not ignore
// it, as a worker need not). A send larger than the socket takes goes on until all is sent.
TEST(ClientTrust, ASendToAClosedSocketIsAnErrorNotASignal) {
  const auto before = signal(SIGPIPE, SIG_DFL);
  ASSERT_NE(before, SIG_ERR);
  absl::Cleanup restore = [before] { signal(SIGPIPE, before); };
  int sv[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
  close(sv[1]);
  EXPECT_THAT(client_internal::SendAll(sv[0], "ticket\n", "descriptor socket /x.fds"),
              testing::StatusIs(absl::StatusCode::kUnavailable,
                                "descriptor socket /x.fds: Broken pipe (7 bytes unsent)"));
  close(sv[0]);

  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
  std::string big(4 << 20, '\0');
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<char>(i * 131 % 251);
  std::string got;
  std::thread reader([&] {
    char buf[65536];
    for (ssize_t n; (n = read(sv[1], buf, sizeof buf)) > 0;)
      got.append(buf, static_cast<size_t>(n));
  });
  EXPECT_TRUE(client_internal::SendAll(sv[0], big, "big").ok());
  close(sv[0]);
  reader.join();
  close(sv[1]);
  EXPECT_TRUE(got == big) << got.size() << " bytes of " << big.size();
}

}  // namespace
}  // namespace kvtier
