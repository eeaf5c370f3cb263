// Integration: the real kvtierd binary on a temporary socket, driven by the C++ client.
#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <set>
#include <thread>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/match.h"
#include "kvtier/channel_layout.h"
#include "kvtier/client.h"
#include "kvtier/local_daemon.h"
#include "server/config/config.h"
#include "server/transfer/gpu.h"
#include "tests/test_util.h"

namespace kvtier {
namespace {

using testing::AsBytes;
using testing::DaemonProcess;
using testing::RandomHalfs;
using testing::Slice;
using testing::StatusIs;
using Code = absl::StatusCode;

constexpr int kLayers = 4, kQ = 9, kKv = 3, kD = 64;

std::unique_ptr<Client> Connect(const DaemonProcess& d, const std::string& tenant = "") {
  ClientOptions o;
  o.tenant = tenant;
  o.timeout = absl::Seconds(30);
  auto c = Client::Connect(d.address(), o);
  EXPECT_TRUE(c.ok());
  return std::move(*c);
}

v1::CreateSessionRequest Shape(int layers = kLayers, int q = kQ, int kv = kKv, int d = kD) {
  v1::CreateSessionRequest r;
  r.mutable_shape()->set_num_layers(layers);
  r.mutable_shape()->set_num_q_heads(q);
  r.mutable_shape()->set_num_kv_heads(kv);
  r.mutable_shape()->set_head_dim(d);
  r.mutable_shape()->set_dtype(v1::DTYPE_FP16);
  r.mutable_policy()->set_lossless(true);  // these tests check bytes exactly
  // ... of whole contiguous chunks (the daemon's default is semantic, with refined rows)
  r.mutable_policy()->set_chunking(v1::CHUNKING_CONTIGUOUS);
  r.mutable_policy()->set_refine_factor(1);
  return r;
}

struct Data {
  int total;
  std::vector<std::vector<uint16_t>> k, v;  // [layer][kv][total][d]
};

Data MakeData(int total, uint32_t seed = 5) {
  std::mt19937 rng(seed);
  Data d{total, {}, {}};
  for (int l = 0; l < kLayers; ++l) {
    d.k.push_back(RandomHalfs(size_t(kKv) * total * kD, rng));
    d.v.push_back(RandomHalfs(size_t(kKv) * total * kD, rng));
  }
  return d;
}

v1::AppendKVRequest Append(const std::string& sid, const Data& data, int layer, int start, int n) {
  v1::AppendKVRequest r;
  r.set_session_id(sid);
  r.set_layer(layer);
  r.set_start_token(start);
  r.set_num_tokens(n);
  r.set_keys(AsBytes(Slice(data.k[layer], kKv, data.total, kD, start, n)));
  r.set_values(AsBytes(Slice(data.v[layer], kKv, data.total, kD, start, n)));
  // Aged before the reply, so that consecutive Selects here see the same statistics (the aging
  // pool itself is tested in aging_pool_test, concurrency_test and the Python tests).
  r.set_wait_aged(true);
  return r;
}

std::vector<v1::AppendKVRequest> AllLayers(const std::string& sid, const Data& data, int start,
                                           int n) {
  std::vector<v1::AppendKVRequest> out;
  for (int l = 0; l < kLayers; ++l) out.push_back(Append(sid, data, l, start, n));
  return out;
}

v1::SelectRequest Select(const std::string& sid, int layer, uint32_t budget, bool data = false) {
  v1::SelectRequest r;
  r.set_session_id(sid);
  r.set_layer(layer);
  std::vector<float> q(kQ * kD, 0.25f);
  r.set_query(std::string(reinterpret_cast<const char*>(q.data()), q.size() * 4));
  r.set_budget_tokens(budget);
  r.set_include_data(data);
  return r;
}

// A new session (Shape()) holding `tokens` tokens of MakeData(tokens) in every layer; with
// `aged`, once every chunk out of the window is aged (no chunk regrouped after it returns).
std::string SessionWithTokens(Client& c, int tokens, bool aged = false) {
  auto created = c.CreateSession(Shape());
  EXPECT_TRUE(created.ok()) << created.status();
  if (!created.ok()) return "";
  const Data data = MakeData(tokens);
  std::vector<v1::AppendKVRequest> appends = AllLayers(created->session_id(), data, 0, tokens);
  for (auto& a : appends) a.set_wait_aged(aged);
  EXPECT_OK(c.AppendKV(appends).status());
  return created->session_id();
}

std::vector<std::string> ShmEntries(const std::string& instance) {
  std::vector<std::string> out;
  DIR* dir = opendir("/dev/shm");
  while (dirent* e = readdir(dir)) {
    if (std::string(e->d_name).rfind("kvtier-" + instance + "-", 0) == 0) out.push_back(e->d_name);
  }
  closedir(dir);
  return out;
}

// Client::Select's second form parses each answer into the response it is given, as a decode
// loop passes one call after call: every answer there is the one the first form returns (but
// for its lease), whatever the response held before, and an error leaves it empty.
TEST(Daemon, SelectIntoAReusedResponseIsTheFreshAnswer) {
  DaemonProcess d;
  ASSERT_TRUE(d.started());
  auto c = Connect(d);
  const std::string sid = SessionWithTokens(*c, 700, /*aged=*/true);  // the same chunks throughout
  ASSERT_FALSE(sid.empty());
  auto without_lease = [](v1::SelectResponse r) {
    r.clear_lease_id();
    r.clear_lease_expires_unix_ms();
    return r.SerializeAsString();
  };
  v1::SelectResponse reused;
  // Large and small answers in turn (with bytes inline, then without, then everything), so
  // that each finds the response holding more handles, or other fields, than it has.
  const std::vector<v1::SelectRequest> turns = {Select(sid, 3, 256, /*data=*/true),
                                                Select(sid, 2, 96), Select(sid, 0, 1000),
                                                Select(sid, 3, 128, /*data=*/true)};
  for (const v1::SelectRequest& req : turns) {
    ASSERT_OK(c->Select(req, &reused));
    ASSERT_FALSE(reused.lease_id().empty());
    EXPECT_OK(c->Release(reused.lease_id()));
    ASSERT_OK_AND_ASSIGN(auto fresh, c->Select(req));
    EXPECT_OK(c->Release(fresh.lease_id()));
    EXPECT_GT(fresh.heads(0).blocks_size(), 0);
    EXPECT_EQ(without_lease(reused), without_lease(fresh)) << "layer " << req.layer();
  }
  EXPECT_THAT(c->Select(Select(sid, 3, 32), &reused),
              StatusIs(Code::kInvalidArgument, "budget_tokens"));
  EXPECT_EQ(reused.ByteSizeLong(), 0u);
}

TEST(Daemon, HandlesAreReadableFromThisProcessThroughSharedMemory) {
  DaemonProcess d;
  ASSERT_TRUE(d.started());
  auto c = Connect(d);
  ASSERT_OK_AND_ASSIGN(auto created, c->CreateSession(Shape()));
  const std::string sid = created.session_id();
  Data data = MakeData(700);
  ASSERT_OK_AND_ASSIGN(uint64_t stored, c->AppendKV(AllLayers(sid, data, 0, 500)));
  EXPECT_EQ(stored, 500u);
  ASSERT_OK_AND_ASSIGN(stored, c->AppendKV(AllLayers(sid, data, 500, 200)));
  EXPECT_EQ(stored, 700u);

  ASSERT_OK_AND_ASSIGN(auto sel, c->Select(Select(sid, 3, 256)));
  SegmentMap segments;
  int checked = 0;
  for (const auto& head : sel.heads()) {
    std::set<int64_t> seen;
    for (const auto& b : head.blocks()) {
      EXPECT_TRUE(b.keys().empty()) << "no inline bytes without include_data";
      ASSERT_OK_AND_ASSIGN(ChunkView view, segments.View(*c, b));
      const int64_t p0 = b.positions(0);
      for (int64_t i = 0; i < b.num_tokens(); ++i) EXPECT_EQ(b.positions(i), p0 + i);
      auto want_k = Slice(data.k[3], kKv, 700, kD, p0, b.num_tokens());
      auto want_v = Slice(data.v[3], kKv, 700, kD, p0, b.num_tokens());
      const size_t off = size_t(head.kv_head()) * b.num_tokens() * kD;
      ASSERT_EQ(view.keys.size(), b.num_tokens() * size_t(kD));
      EXPECT_TRUE(std::equal(view.keys.begin(), view.keys.end(), want_k.begin() + off));
      EXPECT_TRUE(std::equal(view.values.begin(), view.values.end(), want_v.begin() + off));
      seen.insert(b.positions().begin(), b.positions().end());
      ++checked;
    }
    EXPECT_LE(seen.size(), 256u);
    for (int t = 0; t < 16; ++t) EXPECT_TRUE(seen.count(t));
    for (int t = 700 - 64; t < 700; ++t) EXPECT_TRUE(seen.count(t));
  }
  EXPECT_GT(checked, 10);
  EXPECT_OK(c->Release(sel.lease_id()));
  EXPECT_THAT(c->Release(sel.lease_id()), StatusIs(Code::kNotFound));

  // ReadChunks streams the same bytes with data.
  std::vector<uint64_t> ids;
  for (const auto& b : sel.heads(1).blocks()) ids.push_back(b.chunk_id());
  ASSERT_OK_AND_ASSIGN(auto read, c->ReadChunks(sid, ids));
  ASSERT_EQ(read.size(), ids.size());
  for (size_t i = 0; i < read.size(); ++i) {
    ASSERT_OK_AND_ASSIGN(ChunkView view, segments.View(*c, sel.heads(1).blocks(i)));
    EXPECT_EQ(read[i].keys(),
              std::string(reinterpret_cast<const char*>(view.keys.data()), view.keys.size() * 2));
  }
}

// With segment_memory memfd nothing of the daemon's memory has a name: no file in /dev/shm,
// ListSegments names none, the daemon holds memfds, and this process (the daemon's own uid)
// reads every handle's exact bytes through descriptors it collected.
TEST(Daemon, MemfdSegmentsHaveNoNameAndAreReadByDescriptor) {
  DaemonProcess d({"--segment_memory", "memfd"});
  ASSERT_TRUE(d.started());
  auto c = Connect(d, "alice");
  const std::string sid = SessionWithTokens(*c, 300);
  ASSERT_OK_AND_ASSIGN(auto listed, c->ListSegments());
  ASSERT_GT(listed.segments_size(), 0);
  for (const v1::Segment& s : listed.segments()) EXPECT_EQ(s.shm_name(), "") << s.segment_id();
  EXPECT_TRUE(ShmEntries(d.instance()).empty());
  // The daemon holds them as memfds (its descriptors' targets say so).
  int memfds = 0;
  const std::string fd_dir = "/proc/" + std::to_string(d.pid()) + "/fd";
  DIR* dir = opendir(fd_dir.c_str());
  ASSERT_NE(dir, nullptr);
  while (dirent* e = readdir(dir)) {
    char target[256] = {};
    const std::string link = fd_dir + "/" + e->d_name;
    if (readlink(link.c_str(), target, sizeof target - 1) > 0 &&
        absl::StartsWith(target, "/memfd:kvtier-" + d.instance() + "-")) {
      ++memfds;
    }
  }
  closedir(dir);
  EXPECT_EQ(memfds, listed.segments_size());

  ASSERT_OK_AND_ASSIGN(auto sel, c->Select(Select(sid, 2, 96, /*data=*/true)));
  SegmentMap segments;
  int checked = 0;
  for (const auto& head : sel.heads()) {
    for (const auto& b : head.blocks()) {
      ASSERT_OK_AND_ASSIGN(ChunkView view, segments.View(*c, b));
      EXPECT_EQ(b.keys(),
                std::string(reinterpret_cast<const char*>(view.keys.data()), view.keys.size() * 2));
      EXPECT_EQ(b.values(), std::string(reinterpret_cast<const char*>(view.values.data()),
                                        view.values.size() * 2));
      ++checked;
    }
  }
  EXPECT_GT(checked, 3);
}

// A worker whose /dev/shm is not the daemon's (the daemon in a container) finds no file of a
// segment's name, or someone else's file under it, whose stamp differs: either way it reads the
// daemon's own bytes, by descriptor. The reading thread gets a private mount namespace with its
// own /dev/shm (unshare(CLONE_NEWNS) is per thread); root only.
TEST(Daemon, ASegmentNotInThisDevShmOrAnotherDaemonsIsReadByDescriptor) {
  DaemonProcess d;
  ASSERT_TRUE(d.started());
  auto c = Connect(d, "alice");
  const std::string sid = SessionWithTokens(*c, 300);
  ASSERT_OK_AND_ASSIGN(auto sel, c->Select(Select(sid, 2, 96, /*data=*/true)));
  ASSERT_OK_AND_ASSIGN(auto listed, c->ListSegments());
  // The stamp is in the daemon's file, where it says.
  for (const v1::Segment& s : listed.segments()) {
    const int fd = shm_open(s.shm_name().c_str(), O_RDONLY, 0);
    ASSERT_GE(fd, 0) << s.shm_name();
    uint64_t stamp = 0;
    EXPECT_EQ(pread(fd, &stamp, 8, static_cast<off_t>(s.stamp_offset())), 8);
    close(fd);
    EXPECT_EQ(stamp, s.stamp()) << s.shm_name();
  }
  std::string skipped;
  int checked = 0;
  auto read_all = [&](const char* how) {
    SegmentMap segments;
    for (const auto& head : sel.heads()) {
      for (const auto& b : head.blocks()) {
        auto view = segments.View(*c, b);
        ASSERT_TRUE(view.ok()) << how << ": " << view.status();
        EXPECT_EQ(b.keys(), std::string(reinterpret_cast<const char*>(view->keys.data()),
                                        view->keys.size() * 2))
            << how;
        ++checked;
      }
    }
  };
  std::thread([&] {
    if (geteuid() != 0 || unshare(CLONE_NEWNS) != 0 ||
        mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0 ||
        mount("tmpfs", "/dev/shm", "tmpfs", 0, "size=64m") != 0) {
      skipped = std::strerror(errno);
      return;
    }
    read_all("no file of that name");
    for (const v1::Segment& s : listed.segments()) {  // as big, other bytes
      const int fd = shm_open(s.shm_name().c_str(), O_RDWR | O_CREAT, 0600);
      ASSERT_GE(fd, 0);
      std::string other(s.size_bytes(), '\x3c');
      ASSERT_EQ(write(fd, other.data(), other.size()), static_cast<ssize_t>(other.size()));
      close(fd);
    }
    read_all("another daemon's file of that name");
  }).join();
  if (!skipped.empty()) GTEST_SKIP() << "needs root and a private /dev/shm: " << skipped;
  EXPECT_GT(checked, 6);
}

// The prefetcher's guesses run only on a core nothing else wants: its thread is named and
// scheduled SCHED_IDLE, so that it never takes a busy machine's time from the Selects.
TEST(Daemon, ThePrefetcherRunsAtIdlePriority) {
  DaemonProcess d;
  ASSERT_TRUE(d.started());
  const std::string tasks = "/proc/" + std::to_string(d.pid()) + "/task";
  DIR* dir = opendir(tasks.c_str());
  ASSERT_NE(dir, nullptr);
  int found = 0;
  while (dirent* e = readdir(dir)) {
    std::ifstream comm(tasks + "/" + e->d_name + "/comm");
    std::string name;
    if (!std::getline(comm, name) || name != "kvtier-prefetch") continue;
    ++found;
    EXPECT_EQ(sched_getscheduler(std::stoi(e->d_name)), SCHED_IDLE);
  }
  closedir(dir);
  EXPECT_EQ(found, 1);
}

// Each slot's generation lives in shared memory: a reader holding a handle whose slot was
// freed, or freed and reused by another session, finds out after copying, never uses it.
TEST(Daemon, StaleHandlesAreDetectedAfterTheSlotIsFreedOrReused) {
  DaemonProcess d;
  ASSERT_TRUE(d.started());
  auto c = Connect(d);
  Data data = MakeData(200);
  v1::CreateSessionRequest req = Shape();
  req.mutable_policy()->set_lossless(true);                // every chunk in the same slot size
  ASSERT_OK_AND_ASSIGN(auto keep, c->CreateSession(req));  // keeps the segment alive
  ASSERT_OK(c->AppendKV(AllLayers(keep.session_id(), data, 0, 200)).status());
  ASSERT_OK_AND_ASSIGN(auto a, c->CreateSession(req));
  ASSERT_OK(c->AppendKV(AllLayers(a.session_id(), data, 0, 200)).status());
  ASSERT_OK_AND_ASSIGN(auto sel, c->Select(Select(a.session_id(), 3, 1000)));
  SegmentMap segments;
  const v1::BlockHandle h = sel.heads(0).blocks(2);
  std::vector<uint16_t> k(h.num_tokens() * kD), v(k.size());
  ASSERT_OK(segments.CopyOut(*c, h, k, v));
  const auto want = Slice(data.k[3], kKv, 200, kD, 32, 16);  // [kv_heads][16][d]: head 0 first
  EXPECT_TRUE(std::equal(k.begin(), k.end(), want.begin()));
  ASSERT_OK(c->Release(sel.lease_id()));
  ASSERT_OK(c->CloseSession(a.session_id()).status());  // its slots go back: generation 0
  EXPECT_THAT(segments.Recheck(h), StatusIs(Code::kAborted, "freed"));
  EXPECT_THAT(segments.View(*c, h), StatusIs(Code::kAborted, "stale handle"));
  // Its id again: the same shard of the tier, so the new session takes the freed slots (a
  // session takes a tier's warm slots first: freed ones, then a closed session's segment).
  v1::CreateSessionRequest again = req;
  again.set_session_id(a.session_id());
  ASSERT_OK_AND_ASSIGN(auto b, c->CreateSession(again));
  ASSERT_OK(c->AppendKV(AllLayers(b.session_id(), data, 0, 200)).status());
  EXPECT_THAT(segments.Recheck(h), StatusIs(Code::kAborted, "now holds generation"));
  EXPECT_THAT(segments.CopyOut(*c, h, k, v), StatusIs(Code::kAborted));
  // A live handle checks clean.
  ASSERT_OK_AND_ASSIGN(auto fresh, c->Select(Select(b.session_id(), 3, 1000)));
  ASSERT_OK(segments.CopyOut(*c, fresh.heads(0).blocks(2), k, v));
  ASSERT_OK(c->Release(fresh.lease_id()));
}

TEST(Daemon, EveryBadInputGetsItsCodeAndNamesTheField) {
  DaemonProcess d({"--max_sessions", "3", "--max_message_size", "1M", "--host_capacity", "700K"});
  ASSERT_TRUE(d.started());
  auto c = Connect(d);
  // Shapes.
  EXPECT_THAT(c->CreateSession(Shape(2, 4, 3, 64)),
              StatusIs(Code::kInvalidArgument, "num_q_heads"));
  EXPECT_THAT(c->CreateSession(Shape(2, 4, 2, 0)), StatusIs(Code::kInvalidArgument, "head_dim"));
  EXPECT_THAT(c->CreateSession(Shape(2, 4, 2, 513)), StatusIs(Code::kInvalidArgument, "head_dim"));
  EXPECT_THAT(c->CreateSession(Shape(0)), StatusIs(Code::kInvalidArgument, "num_layers"));

  ASSERT_OK_AND_ASSIGN(auto created, c->CreateSession(Shape()));
  const std::string sid = created.session_id();
  Data data = MakeData(400);
  ASSERT_OK(c->AppendKV(AllLayers(sid, data, 0, 100)).status());

  auto wrong_len = Append(sid, data, 0, 100, 4);
  wrong_len.set_keys("0123456789");
  EXPECT_THAT(c->AppendKV({wrong_len}), StatusIs(Code::kInvalidArgument, "keys"));
  auto bad_layer = Append(sid, data, 0, 100, 4);
  bad_layer.set_layer(kLayers);
  EXPECT_THAT(c->AppendKV({bad_layer}), StatusIs(Code::kInvalidArgument, "layer"));
  auto zero = Append(sid, data, 0, 100, 4);
  zero.set_num_tokens(0);
  EXPECT_THAT(c->AppendKV({zero}), StatusIs(Code::kInvalidArgument, "num_tokens"));
  EXPECT_THAT(c->AppendKV({Append("nope", data, 0, 0, 4)}), StatusIs(Code::kNotFound, "nope"));
  EXPECT_THAT(c->AppendKV({Append(sid, data, 0, 150, 4)}), StatusIs(Code::kOutOfRange, "gap"));
  auto conflict = Append(sid, data, 0, 0, 4);
  conflict.set_keys(AsBytes(Slice(data.k[1], kKv, 400, kD, 0, 4)));
  EXPECT_THAT(c->AppendKV({conflict}), StatusIs(Code::kFailedPrecondition, "start_token"));
  EXPECT_OK(c->AppendKV({Append(sid, data, 0, 0, 4)}).status());  // identical: a no-op
  // A stream stops at its first bad message; what came before it stays.
  EXPECT_THAT(c->AppendKV({Append(sid, data, 1, 100, 10), bad_layer}),
              StatusIs(Code::kInvalidArgument));
  ASSERT_OK_AND_ASSIGN(auto chunks, c->ListChunks([&] {
    v1::ListChunksRequest r;
    r.set_session_id(sid);
    r.set_layer(1);
    return r;
  }()));
  EXPECT_EQ(chunks.total(), 3u * 7);  // 110 tokens: 7 chunks per KV head

  // Oversized: a 1.5 MiB message against --max_message_size 1M.
  v1::AppendKVRequest huge = Append(sid, data, 0, 100, 4);
  huge.set_keys(std::string(3 << 19, '\0'));
  EXPECT_THAT(c->AppendKV({huge}), StatusIs(Code::kResourceExhausted));

  // Select errors.
  EXPECT_THAT(c->Select(Select("nope", 0, 8)), StatusIs(Code::kNotFound));
  auto badq = Select(sid, 0, 256);
  badq.set_query("abc");
  EXPECT_THAT(c->Select(badq), StatusIs(Code::kInvalidArgument, "query"));
  EXPECT_THAT(c->Select(Select(sid, 3, 32)), StatusIs(Code::kInvalidArgument, "budget_tokens"));

  // Tenants.
  auto mallory = Connect(d, "mallory");
  EXPECT_THAT(mallory->Select(Select(sid, 3, 256)), StatusIs(Code::kPermissionDenied));
  EXPECT_THAT(mallory->CloseSession(sid), StatusIs(Code::kPermissionDenied));

  // A full host tier: 700 KiB holds slots of 4 KiB (16 tokens x 64 x 2 bytes, K and V) and the
  // session's metadata (each stream's index, each chunk's record and statistics): it holds 4
  // layers x 3 heads x 7 chunks = 84, not the 228 more that 300 more tokens take. The stream
  // stops at the first layer's append that does not fit, which stores nothing; those before
  // it stay, each whole (how many fit depends on the metadata's bytes).
  auto before = c->DescribeSession(sid);
  ASSERT_OK(before.status());
  EXPECT_THAT(c->AppendKV(AllLayers(sid, data, 100, 300)),
              StatusIs(Code::kResourceExhausted, "full"));
  ASSERT_OK_AND_ASSIGN(auto after, c->DescribeSession(sid));
  int grown = 0;
  for (int l = 0; l < kLayers; ++l) {
    if (after.layers(l).num_tokens() == 400u) {
      EXPECT_EQ(grown++, l) << "layer " << l << " grew after one that did not";
      EXPECT_EQ(after.layers(l).chunks(), 3u * 25);
      continue;
    }
    EXPECT_EQ(after.layers(l).num_tokens(), before->layers(l).num_tokens());
    EXPECT_EQ(after.layers(l).chunks(), before->layers(l).chunks());
  }
  EXPECT_LT(grown, kLayers);
  ASSERT_OK_AND_ASSIGN(auto tiers, c->GetTierStats());
  for (const auto& t : tiers.tiers()) EXPECT_LE(t.used_bytes(), t.capacity_bytes());

  // Too many sessions.
  ASSERT_OK(c->CreateSession(Shape()).status());
  ASSERT_OK(c->CreateSession(Shape()).status());
  EXPECT_THAT(c->CreateSession(Shape()), StatusIs(Code::kResourceExhausted, "max_sessions"));

  // Evict from host with no remote tier.
  EXPECT_THAT(c->Evict(sid, v1::TIER_HOST), StatusIs(Code::kFailedPrecondition));

  // Close is idempotent; a closed session is gone.
  ASSERT_OK_AND_ASSIGN(bool existed, c->CloseSession(sid));
  EXPECT_TRUE(existed);
  ASSERT_OK_AND_ASSIGN(existed, c->CloseSession(sid));
  EXPECT_FALSE(existed);
  EXPECT_THAT(c->Select(Select(sid, 0, 8)), StatusIs(Code::kNotFound));
}

// One bad or hostile call costs its caller an error and nobody else anything: each request
// below crashed the daemon, or took memory no limit counted, before its cost was bounded.
TEST(Daemon, OneHostileRequestCostsItsCallerAnErrorAndNothingElse) {
  const int port = testing::FreePort();
  DaemonProcess d({"--max_message_size", "1M", "--metrics_port", std::to_string(port)});
  ASSERT_TRUE(d.started());
  auto c = Connect(d);
  ASSERT_OK_AND_ASSIGN(auto created, c->CreateSession(Shape()));
  const std::string sid = created.session_id();
  Data data = MakeData(1400);
  for (int at = 0; at < 1400; at += 700) {  // messages within 1 MiB
    ASSERT_OK(c->AppendKV(AllLayers(sid, data, at, 700)).status());
  }

  // An echo of 2 GiB: refused before it is made.
  EXPECT_THAT(c->Echo("", (1u << 31) - 1),
              StatusIs(Code::kResourceExhausted, "response_bytes: a reply of up to"));
  // A dense layer's every row with data: 1400 x 3 heads x 256 bytes pass 1 MiB.
  EXPECT_THAT(c->Select(Select(sid, 0, 256, /*data=*/true)),
              StatusIs(Code::kResourceExhausted, "max_message_size 1048576"));
  // 260 requests with data in one batch: refused as a whole, no lease left behind.
  v1::BatchSelectRequest batch;
  for (int i = 0; i < 260; ++i) *batch.add_requests() = Select(sid, 3, 256, /*data=*/true);
  EXPECT_THAT(c->BatchSelect(batch), StatusIs(Code::kResourceExhausted, "max_message_size"));
  ASSERT_OK_AND_ASSIGN(auto described, c->DescribeSession(sid));
  EXPECT_EQ(described.info().active_leases(), 0u);
  ASSERT_OK_AND_ASSIGN(auto tiers, c->GetTierStats());
  for (const auto& t : tiers.tiers()) EXPECT_EQ(t.pinned_bytes(), 0u);
  // Without data the same batch fits and is served.
  for (auto& r : *batch.mutable_requests()) r.set_include_data(false);
  batch.mutable_requests()->DeleteSubrange(8, 252);
  ASSERT_OK_AND_ASSIGN(auto served, c->BatchSelect(batch));
  EXPECT_EQ(served.responses_size(), 8);
  for (const auto& r : served.responses()) ASSERT_OK(c->Release(r.lease_id()));

  // One chunk id named 100000 times: read once.
  ASSERT_OK_AND_ASSIGN(auto listed, c->ListChunks([&] {
    v1::ListChunksRequest r;
    r.set_session_id(sid);
    r.set_limit(1);
    return r;
  }()));
  ASSERT_EQ(listed.chunks_size(), 1);
  const std::vector<uint64_t> same(100000, listed.chunks(0).chunk_id());
  ASSERT_OK_AND_ASSIGN(auto handles, c->ReadChunks(sid, same));
  EXPECT_EQ(handles.size(), 1u);

  // 4096 layers of 4096 KV heads: refused by the stream limit, not allocated.
  EXPECT_THAT(c->CreateSession(Shape(4096, 4096, 4096, 64)),
              StatusIs(Code::kInvalidArgument, "streams; at most 65536 per session"));
  // Labels past their limits.
  v1::CreateSessionRequest labelled = Shape();
  (*labelled.mutable_labels())["team"] = std::string(300 << 10, 'x');
  EXPECT_THAT(c->CreateSession(labelled), StatusIs(Code::kInvalidArgument, "labels: value of"));
  labelled.clear_labels();
  for (int i = 0; i < 40; ++i) (*labelled.mutable_labels())["k" + std::to_string(i)] = "v";
  EXPECT_THAT(c->CreateSession(labelled), StatusIs(Code::kInvalidArgument, "40 labels"));
  // An id of 600 KB: the error quotes a bounded prefix of it.
  auto long_id = c->Select(Select(std::string(600 << 10, 'a'), 3, 256));
  EXPECT_THAT(long_id, StatusIs(Code::kNotFound, "(614400 bytes) not found"));
  EXPECT_LT(long_id.status().message().size(), 512u);

  // A tenant name that could forge a log field or a metric label: refused, naming the header.
  auto forged = Connect(d, "alice level=error msg=\"x\"");
  EXPECT_THAT(forged->Select(Select(sid, 3, 256)),
              StatusIs(Code::kInvalidArgument, "x-kvtier-tenant: \"alice level"));
  EXPECT_THAT(forged->AppendKV({Append(sid, data, 0, 0, 4)}),
              StatusIs(Code::kInvalidArgument, "x-kvtier-tenant"));
  EXPECT_THAT(Connect(d, std::string(200, 't'))->Echo("x"),
              StatusIs(Code::kInvalidArgument, "must be 1..128"));

  // Tenants the config does not name share one metric series.
  for (int i = 0; i < 70; ++i) {
    auto t = Connect(d, "t" + std::to_string(i));
    EXPECT_THAT(t->AppendKV({Append("nope", data, 0, 0, 4)}), StatusIs(Code::kNotFound));
  }
  const std::string body = testing::HttpGet(port, "/metrics");
  std::set<std::string> series;
  for (size_t at = body.find("kvtier_appended_tokens_total{tenant=\""); at != std::string::npos;
       at = body.find("kvtier_appended_tokens_total{tenant=\"", at + 1)) {
    const size_t from = at + std::strlen("kvtier_appended_tokens_total{tenant=\"");
    series.insert(body.substr(from, body.find('"', from) - from));
  }
  EXPECT_EQ(series, (std::set<std::string>{"default", "_other"})) << body.substr(0, 2000);

  // And the daemon still serves everyone.
  ASSERT_OK_AND_ASSIGN(std::string echoed, c->Echo("still here"));
  EXPECT_EQ(echoed, "still here");
  ASSERT_OK(c->Select(Select(sid, 3, 256)).status());
}

TEST(Daemon, SigtermRemovesSocketAndSegmentsAndExitsZero) {
  DaemonProcess d;
  ASSERT_TRUE(d.started());
  auto c = Connect(d);
  const std::string sid = SessionWithTokens(*c, 100);
  ASSERT_OK(c->Select(Select(sid, 3, 256)).status());  // a live lease too
  EXPECT_FALSE(ShmEntries(d.instance()).empty());
  ASSERT_OK_AND_ASSIGN(bool serving, c->Health());
  EXPECT_TRUE(serving);
  EXPECT_EQ(d.Terminate(), 0);
  struct stat st {};
  EXPECT_NE(stat(d.socket().c_str(), &st), 0) << "socket left behind";
  EXPECT_TRUE(ShmEntries(d.instance()).empty()) << "segments left behind";
}

// Starts kvtierd on the Unix socket `socket` as instance `instance` (after another daemon of
// them was killed): its pid.
pid_t StartDaemonOn(const std::string& socket, const std::string& instance) {
  const std::string kvtierd = BinaryPath("kvtierd");
  const std::string listen = "unix:" + socket;
  const pid_t pid = fork();
  if (pid == 0) {
    execl(kvtierd.c_str(), kvtierd.c_str(), "--listen", listen.c_str(), "--instance",
          instance.c_str(), "--log_level", "warn", static_cast<char*>(nullptr));
    _exit(127);
  }
  return pid;
}

// Whether `c`'s daemon answers Health as serving within 10 s.
bool Serving(Client& c) {
  for (int i = 0; i < 500; ++i) {
    absl::StatusOr<bool> health = c.Health();
    if (health.ok() && *health) return true;
    usleep(20'000);
  }
  return false;
}

// SIGTERM to the daemon `pid`, which must exit 0.
void ExpectStopsCleanly(pid_t pid) {
  kill(pid, SIGTERM);
  int status = 0;
  waitpid(pid, &status, 0);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
}

// A worker keeps its segment mappings across a daemon's restart on the same socket; the new
// daemon's segments reuse the ids. A handle of the new daemon is never read through the old
// mapping: its generation is not there, so the segment is mapped anew and the bytes read are
// the new session's.
TEST(Daemon, AWorkersMappingsOfARestartedDaemonAreReplacedNotUsed) {
  auto first = std::make_unique<DaemonProcess>();  // NOLINT: killed, and its directory kept
  ASSERT_TRUE(first->started());
  const std::string socket = first->socket(), instance = first->instance();
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Client> c, Client::Connect(first->address()));
  SegmentMap segments;  // the worker's mappings, kept across the restart
  auto read_first_block = [&](const Data& data, int tokens, uint64_t* segment) {
    ASSERT_OK_AND_ASSIGN(auto created, c->CreateSession(Shape()));
    ASSERT_OK(c->AppendKV(AllLayers(created.session_id(), data, 0, tokens)).status());
    ASSERT_OK_AND_ASSIGN(auto sel, c->Select(Select(created.session_id(), 3, 256)));
    const v1::BlockHandle& b = sel.heads(0).blocks(0);
    *segment = b.segment_id();
    ASSERT_OK_AND_ASSIGN(ChunkView view, segments.View(*c, b));
    auto want = Slice(data.k[3], kKv, tokens, kD, b.positions(0), b.num_tokens());
    EXPECT_TRUE(std::equal(view.keys.begin(), view.keys.end(), want.begin()));
  };
  uint64_t before = 0, after = 0;
  read_first_block(MakeData(300, 1), 300, &before);
  EXPECT_EQ(first->Kill(), 128 + SIGKILL);  // (its directory, with the socket, stays)
  const pid_t second = StartDaemonOn(socket, instance);
  ASSERT_OK_AND_ASSIGN(c, Client::Connect("unix:" + socket));
  ASSERT_TRUE(Serving(*c)) << "the second kvtierd did not serve on " << socket;
  read_first_block(MakeData(300, 2), 300, &after);
  EXPECT_EQ(after, before) << "the scenario needs the id reused";
  // The first daemon's mapping, set aside, holds its memory (unlinked by the second daemon)
  // until Prune lets it go; what the second daemon lists stays mapped.
  auto mapped = [&](bool unlinked) {  // this process's mappings of the instance's segments
    std::ifstream maps("/proc/self/maps");
    int n = 0;
    for (std::string line; std::getline(maps, line);) {
      n += absl::StrContains(line, "/kvtier-" + instance + "-") &&
           absl::EndsWith(line, " (deleted)") == unlinked;
    }
    return n;
  };
  EXPECT_EQ(mapped(true), 1);
  EXPECT_EQ(mapped(false), 1);
  ASSERT_OK_AND_ASSIGN(const size_t pruned, segments.Prune(*c));
  EXPECT_EQ(pruned, 1u);
  EXPECT_EQ(mapped(true), 0) << "the first daemon's memory is still mapped";
  EXPECT_EQ(mapped(false), 1);
  read_first_block(MakeData(300, 3), 300, &after);  // the second daemon's bytes, still
  ExpectStopsCleanly(second);
}

// The threads of this process whose name is `name` (/proc/self/task/*/comm).
int ThreadsNamed(const std::string& name) {
  int n = 0;
  for (const auto& task : std::filesystem::directory_iterator("/proc/self/task")) {
    std::ifstream comm(task.path() / "comm");
    std::string got;
    std::getline(comm, got);
    n += got == name;
  }
  return n;
}

// A worker's client keeps its Attach stream without a thread of gRPC's waiting on it (gRPC's
// callback API would start its callback queue's two threads, "nexting_thread", which then take
// the socket's events from the worker's calls), and still sees the stream end: after the
// daemon is killed and another starts on its socket, the same client attaches anew and its
// Selects name the new worker.
TEST(Daemon, AWorkerWaitsOnItsAttachStreamInNoThreadAndReattachesAfterARestart) {
  auto first = std::make_unique<DaemonProcess>();  // NOLINT: killed, and its directory kept
  ASSERT_TRUE(first->started());
  const std::string socket = first->socket(), instance = first->instance();
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Client> c, Client::Connect("unix:" + socket));
  auto select_once = [&](int seed) {
    ASSERT_OK_AND_ASSIGN(auto created, c->CreateSession(Shape()));
    ASSERT_OK(c->AppendKV(AllLayers(created.session_id(), MakeData(300, seed), 0, 300)).status());
    ASSERT_OK_AND_ASSIGN(auto sel, c->Select(Select(created.session_id(), 3, 256)));
    ASSERT_OK(c->Release(sel.lease_id()));
  };
  select_once(1);
  ASSERT_OK_AND_ASSIGN(const std::string before, c->WorkerId());
  EXPECT_TRUE(absl::StartsWith(before, "w-")) << before;
  ASSERT_OK(c->Health().status());
  EXPECT_EQ(ThreadsNamed("nexting_thread"), 0) << "gRPC's callback threads run in the worker";

  EXPECT_EQ(first->Kill(), 128 + SIGKILL);
  const pid_t second = StartDaemonOn(socket, instance);
  ASSERT_TRUE(Serving(*c)) << "the second kvtierd did not serve on " << socket;
  select_once(2);
  ASSERT_OK_AND_ASSIGN(const std::string after, c->WorkerId());
  EXPECT_TRUE(absl::StartsWith(after, "w-")) << after;
  EXPECT_NE(after, before) << "the client kept the dead daemon's worker id";
  EXPECT_EQ(ThreadsNamed("nexting_thread"), 0);
  c.reset();
  ExpectStopsCleanly(second);
}

// A daemon killed with SIGKILL leaves its segments in /dev/shm; the next kvtierd to start, of
// any instance, removes them (the dead daemon's instance lock is free), and never those of a
// daemon that is alive.
TEST(Daemon, AKilledDaemonsSegmentsGoWhenAnyDaemonStarts) {
  DaemonProcess killed, live;
  ASSERT_TRUE(killed.started() && live.started());
  auto ck = Connect(killed), cl = Connect(live);
  SessionWithTokens(*ck, 100);
  SessionWithTokens(*cl, 100);
  const std::vector<std::string> left = ShmEntries(killed.instance());
  ASSERT_FALSE(left.empty());
  EXPECT_EQ(killed.Kill(), 128 + SIGKILL);
  EXPECT_EQ(ShmEntries(killed.instance()), left) << "nothing removes them by itself";
  DaemonProcess next;
  ASSERT_TRUE(next.started());
  EXPECT_TRUE(ShmEntries(killed.instance()).empty()) << "a dead daemon's segments stayed";
  EXPECT_FALSE(ShmEntries(live.instance()).empty());
  const std::string log = next.Log();
  const size_t reclaimed = log.find("shm.reclaimed instances=");
  ASSERT_NE(reclaimed, std::string::npos) << log;
  EXPECT_NE(log.substr(reclaimed, log.find('\n', reclaimed) - reclaimed).find(killed.instance()),
            std::string::npos)
      << log;
  // The dead instance's lock file goes too (unlinked under its lock); the live one's stays.
  struct stat st {};
  EXPECT_NE(stat(("/dev/shm/kvtier-" + killed.instance() + ".lock").c_str(), &st), 0);
  EXPECT_EQ(stat(("/dev/shm/kvtier-" + live.instance() + ".lock").c_str(), &st), 0);
  ASSERT_OK(cl->ListSessions().status());  // the live one serves on
}

// Leases a tenant holds are bounded: past --max_leases_per_tenant a Select is refused before it
// pins anything, for that tenant only, and a Release makes room again.
TEST(Daemon, ATenantsLiveLeasesAreBounded) {
  DaemonProcess d({"--max_leases_per_tenant", "3"});
  ASSERT_TRUE(d.started());
  auto a = Connect(d, "a"), b = Connect(d, "b");
  ASSERT_OK_AND_ASSIGN(auto sa, a->CreateSession(Shape()));
  ASSERT_OK_AND_ASSIGN(auto sb, b->CreateSession(Shape()));
  Data data = MakeData(400);
  ASSERT_OK(a->AppendKV(AllLayers(sa.session_id(), data, 0, 400)).status());
  ASSERT_OK(b->AppendKV(AllLayers(sb.session_id(), data, 0, 400)).status());
  std::vector<std::string> held;
  for (int i = 0; i < 3; ++i) {
    ASSERT_OK_AND_ASSIGN(auto r, a->Select(Select(sa.session_id(), 3, 256)));
    held.push_back(r.lease_id());
  }
  EXPECT_THAT(a->Select(Select(sa.session_id(), 3, 256)),
              StatusIs(Code::kResourceExhausted, "max_leases_per_tenant 3: tenant \"a\" holds 3"));
  ASSERT_OK_AND_ASSIGN(auto described, a->DescribeSession(sa.session_id()));
  EXPECT_EQ(described.info().active_leases(), 3u);  // the refused call pinned nothing
  ASSERT_OK(b->Select(Select(sb.session_id(), 3, 256)).status());  // another tenant's own room
  ASSERT_OK(a->Release(held.back()));
  ASSERT_OK(a->Select(Select(sa.session_id(), 3, 256)).status());
}

// A Select ends the leases it names (release_lease_ids) before it is served: a decode loop's
// previous step's lease goes in the same call. All are checked first: an unknown one, or
// another tenant's, is NOT_FOUND naming it, and nothing ends and nothing is selected; too many
// is INVALID_ARGUMENT. Checked, they end even if the Select then fails, as a Release before it
// would. The same in a BatchSelect (every request's, before any is served) and through a
// Select channel.
TEST(Daemon, ASelectEndsTheLeasesItNames) {
  DaemonProcess d;
  ASSERT_TRUE(d.started());
  auto a = Connect(d, "a"), b = Connect(d, "b");
  const std::string sid = SessionWithTokens(*a, 400);
  const std::string bobs = SessionWithTokens(*b, 100);
  auto live = [&]() -> uint32_t {
    auto described = a->DescribeSession(sid);
    return described.ok() ? described->info().active_leases() : 9999;
  };
  ASSERT_OK_AND_ASSIGN(auto first, a->Select(Select(sid, 3, 256)));
  v1::SelectRequest next = Select(sid, 3, 256);
  next.add_release_lease_ids(first.lease_id());
  ASSERT_OK_AND_ASSIGN(auto second, a->Select(next));
  EXPECT_EQ(live(), 1u) << "the first lease should have ended with the second Select";
  EXPECT_THAT(a->Release(first.lease_id()), StatusIs(Code::kNotFound, "not a live lease"));

  // Unknown, or another tenant's: nothing selected, nothing ended.
  ASSERT_OK_AND_ASSIGN(auto bobs_lease, b->Select(Select(bobs, 3, 256)));
  for (const std::string& bad : {std::string("no-such-lease"), bobs_lease.lease_id()}) {
    v1::SelectRequest r = Select(sid, 3, 256);
    r.add_release_lease_ids(second.lease_id());
    r.add_release_lease_ids(bad);
    EXPECT_THAT(a->Select(r), StatusIs(Code::kNotFound, "release_lease_ids[1]: lease_id: "));
    EXPECT_EQ(live(), 1u);
  }
  ASSERT_OK(b->Release(bobs_lease.lease_id()));  // still bob's, still live

  v1::SelectRequest crowded = Select(sid, 3, 256);
  for (int i = 0; i < 65; ++i) crowded.add_release_lease_ids(second.lease_id());
  EXPECT_THAT(a->Select(crowded),
              StatusIs(Code::kInvalidArgument, "release_lease_ids: 65 ids, at most 64"));
  EXPECT_EQ(live(), 1u);

  // A batch: its second request names an unknown lease, then the lease of the Select above.
  v1::BatchSelectRequest batch;
  *batch.add_requests() = Select(sid, 2, 256);
  *batch.add_requests() = Select(sid, 3, 256);
  batch.mutable_requests(1)->add_release_lease_ids("no-such-lease");
  EXPECT_THAT(a->BatchSelect(batch),
              StatusIs(Code::kNotFound, "requests[1].release_lease_ids[0]: lease_id: "));
  EXPECT_EQ(live(), 1u);
  batch.mutable_requests(1)->set_release_lease_ids(0, second.lease_id());
  ASSERT_OK_AND_ASSIGN(auto served, a->BatchSelect(batch));
  EXPECT_EQ(live(), 2u) << "the batch's two leases, the one it named ended";
  EXPECT_THAT(a->Release(second.lease_id()), StatusIs(Code::kNotFound));

  // Through a Select channel: the same field, the same checks.
  ASSERT_OK_AND_ASSIGN(auto ch, a->OpenChannel());
  v1::SelectRequest by_channel = Select(sid, 3, 256);
  by_channel.add_release_lease_ids(served.responses(0).lease_id());
  by_channel.add_release_lease_ids(served.responses(1).lease_id());
  ASSERT_OK_AND_ASSIGN(auto third, ch->Select(by_channel));
  EXPECT_EQ(live(), 1u);
  by_channel.clear_release_lease_ids();
  by_channel.add_release_lease_ids("no-such-lease");
  EXPECT_THAT(ch->Select(by_channel), StatusIs(Code::kNotFound, "release_lease_ids[0]"));
  EXPECT_EQ(live(), 1u);
  // Checked, they end before the Select is served, as a Release before it would: also when
  // the Select then fails (a layer past the session's).
  v1::SelectRequest failing = Select(sid, 999, 256);
  failing.add_release_lease_ids(third.lease_id());
  EXPECT_THAT(a->Select(failing), StatusIs(Code::kInvalidArgument, "layer"));
  EXPECT_EQ(live(), 0u);
}

// A client attaches on its first Select and names its worker in every Select; when it goes
// away its leases end at once, however long they were to last, and a drain ends every
// Attach stream (UNAVAILABLE) instead of waiting for it.
TEST(Daemon, AClientsLeasesEndWithItsConnection) {
  DaemonProcess d;
  ASSERT_TRUE(d.started());
  auto admin = Connect(d, "a");
  ASSERT_OK_AND_ASSIGN(auto s, admin->CreateSession(Shape()));
  Data data = MakeData(400);
  ASSERT_OK(admin->AppendKV(AllLayers(s.session_id(), data, 0, 400)).status());
  auto pinned = [&]() -> uint64_t {
    auto stats = admin->GetTierStats();
    uint64_t n = 0;
    for (const auto& t : stats->tiers()) n += t.pinned_bytes();
    return n;
  };
  {
    auto worker = Connect(d, "a");
    auto req = Select(s.session_id(), 3, 256);
    req.set_lease_ms(600'000);
    ASSERT_OK(worker->Select(req).status());
    ASSERT_OK(worker->Select(req).status());
    ASSERT_OK_AND_ASSIGN(std::string id, worker->WorkerId());
    EXPECT_TRUE(absl::StartsWith(id, "w-")) << id;
    ASSERT_OK_AND_ASSIGN(auto described, admin->DescribeSession(s.session_id()));
    EXPECT_EQ(described.info().active_leases(), 2u);
    EXPECT_GT(pinned(), 0u);
    // Another tenant cannot take leases under this worker.
    auto other = Connect(d, "b");
    ASSERT_OK_AND_ASSIGN(auto so, other->CreateSession(Shape()));
    ASSERT_OK(other->AppendKV(AllLayers(so.session_id(), data, 0, 400)).status());
    auto stolen = Select(so.session_id(), 3, 256);
    stolen.set_worker_id(id);
    EXPECT_THAT(other->Select(stolen), StatusIs(Code::kNotFound, "worker_id"));
  }  // the worker's client goes: its Attach stream ends
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  while (pinned() > 0 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(10));
  EXPECT_EQ(pinned(), 0u) << "ten-minute leases outlived their worker";
  ASSERT_OK_AND_ASSIGN(auto described, admin->DescribeSession(s.session_id()));
  EXPECT_EQ(described.info().active_leases(), 0u);

  // A client that does not attach keeps TTL-only leases.
  ClientOptions o;
  o.tenant = "a";
  o.attach = false;
  ASSERT_OK_AND_ASSIGN(auto plain, Client::Connect(d.address(), o));
  ASSERT_OK_AND_ASSIGN(std::string none, plain->WorkerId());
  EXPECT_EQ(none, "");
  ASSERT_OK_AND_ASSIGN(auto r, plain->Select(Select(s.session_id(), 3, 256)));
  plain.reset();
  absl::SleepFor(absl::Milliseconds(300));
  EXPECT_GT(pinned(), 0u);

  // The drain ends the open streams at once: the daemon exits well within its drain timeout.
  auto held = Connect(d, "a");
  ASSERT_OK(held->Select(Select(s.session_id(), 3, 256)).status());
  const absl::Time t0 = absl::Now();
  // Tenant "a" may not drain the daemon; the daemon's own uid naming no tenant (an admin) may.
  EXPECT_THAT(admin->Drain(), StatusIs(Code::kPermissionDenied, "admin credential"));
  ASSERT_OK(Connect(d)->Drain().status());
  EXPECT_EQ(d.WaitForExit(8), 0);  // the default drain timeout is 10 s
  EXPECT_LT(absl::Now() - t0, absl::Seconds(8));
}

// A second kvtierd of the same instance, or on the same socket, refuses to start and touches
// nothing of the first (before, it unlinked the live segments and took the socket over); a
// file at the listen path that is not a socket is never removed.
TEST(Daemon, ASecondDaemonOnTheSameInstanceOrSocketRefusesAndTouchesNothing) {
  DaemonProcess d;
  ASSERT_TRUE(d.started());
  auto c = Connect(d);
  const std::string sid = SessionWithTokens(*c, 100);
  const std::vector<std::string> before = ShmEntries(d.instance());
  ASSERT_FALSE(before.empty());
  TempDir dir;
  const std::string kvtierd = BinaryPath("kvtierd");
  const std::string other = "collide-" + std::to_string(getpid());
  auto [same_instance, out1] = testing::RunCommand(kvtierd + " --listen unix:" + dir.path() +
                                                   "/b.sock --instance " + d.instance() + " 2>&1");
  EXPECT_NE(same_instance, 0);
  EXPECT_NE(out1.find("instance: another kvtierd (pid"), std::string::npos) << out1;
  EXPECT_EQ(ShmEntries(d.instance()), before);
  auto [same_socket, out2] = testing::RunCommand(kvtierd + " --listen unix:" + d.socket() +
                                                 " --instance " + other + " 2>&1");
  EXPECT_NE(same_socket, 0);
  EXPECT_NE(out2.find("listen: another kvtierd (pid"), std::string::npos) << out2;
  // The first still serves, on its socket, with its chunks.
  ASSERT_OK(c->Select(Select(sid, 3, 256)).status());
  ASSERT_OK_AND_ASSIGN(bool serving, Connect(d)->Health());
  EXPECT_TRUE(serving);
  EXPECT_EQ(ShmEntries(d.instance()), before);
  // A regular file where the socket would go.
  const std::string file = dir.path() + "/not-a-socket";
  { std::ofstream(file) << "keep me"; }
  auto [on_file, out3] =
      testing::RunCommand(kvtierd + " --listen unix:" + file + " --instance " + other + " 2>&1");
  EXPECT_NE(on_file, 0);
  EXPECT_NE(out3.find("is not a socket; it is not removed"), std::string::npos) << out3;
  std::ifstream kept(file);
  std::string text((std::istreambuf_iterator<char>(kept)), std::istreambuf_iterator<char>());
  EXPECT_EQ(text, "keep me");
}

// The sockets are mode 0660; the segments 0600, so that only the daemon's uid opens them by
// name, and every other worker gets read-only descriptors of its own tenant's (OpenSegments).
TEST(Daemon, SocketsAre0660AndSegmentsOwnerOnly) {
  DaemonProcess d;
  ASSERT_TRUE(d.started());
  for (const std::string& sock : {d.socket(), d.socket() + ".fds"}) {
    struct stat st {};
    ASSERT_EQ(stat(sock.c_str(), &st), 0) << sock;
    EXPECT_EQ(st.st_mode & 0777, 0660u) << sock;
  }
  auto c = Connect(d, "alice");
  SessionWithTokens(*c, 100);
  const std::vector<std::string> segs = ShmEntries(d.instance());
  ASSERT_FALSE(segs.empty());
  for (const std::string& name : segs) {
    struct stat st {};
    ASSERT_EQ(stat(("/dev/shm/" + name).c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 0777, 0600u) << name;
  }
}

// The descriptor socket's address.
sockaddr_un UnixAddress(const std::string& path) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.data(), std::min(path.size(), sizeof(addr.sun_path) - 1));
  return addr;
}

// A connection to `addr`, or -1. System calls only: safe in a child after fork.
int ConnectTo(const sockaddr_un& addr) {
  const int sock = socket(AF_UNIX, SOCK_STREAM, 0);
  if (connect(sock, reinterpret_cast<const sockaddr*>(&addr), sizeof addr) != 0) {
    close(sock);
    return -1;
  }
  return sock;
}

// One message from `sock` into `buf`: its length (<= 0: none) and the descriptors it carried,
// which are closed. System calls only: safe in a child after fork.
struct Received {
  ssize_t bytes;
  int fds;
};
Received ReceiveOne(int sock, char* buf, size_t size) {
  iovec iov{buf, size};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * 4)];
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof control;
  const ssize_t n = recvmsg(sock, &msg, 0);
  int fds = 0;
  if (n <= 0) msg.msg_controllen = 0;  // nothing received: no control data to read
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    const int here = static_cast<int>((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));
    fds += here;
    for (int i = 0; i < here; ++i) {
      int fd;
      std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof fd);
      close(fd);
    }
  }
  return {n, fds};
}

// OpenSegments hands the caller's own segments as read-only descriptors over <socket>.fds: the
// bytes are the named segment's, no mapping of them can be made writable, a ticket serves
// once and only the process that asked, and another tenant's segment is NOT_FOUND.
TEST(Daemon, SegmentDescriptorsAreReadOnlyAndTheirTenantsOnly) {
  DaemonProcess d;
  ASSERT_TRUE(d.started());
  auto alice = Connect(d, "alice");
  auto bob = Connect(d, "bob");
  const std::string sid = SessionWithTokens(*alice, 300);
  SessionWithTokens(*bob, 100);
  ASSERT_OK_AND_ASSIGN(auto listed, alice->ListSegments());
  ASSERT_GT(listed.segments_size(), 0);
  const v1::Segment& seg = listed.segments(0);
  ASSERT_OK_AND_ASSIGN(auto opened, alice->OpenSegments({}));  // every one of alice's
  ASSERT_EQ(opened.size(), static_cast<size_t>(listed.segments_size()));
  for (const Client::SegmentFd& f : opened) {
    EXPECT_EQ(f.segment.tenant(), "alice");
    EXPECT_EQ(fcntl(f.fd, F_GETFL) & O_ACCMODE, O_RDONLY);
    void* w = mmap(nullptr, f.segment.size_bytes(), PROT_READ | PROT_WRITE, MAP_SHARED, f.fd, 0);
    EXPECT_EQ(w, MAP_FAILED) << "a writable shared mapping of a read-only descriptor";
    EXPECT_EQ(errno, EACCES);
    if (f.segment.segment_id() == seg.segment_id()) {
      // The same bytes as the named file's.
      const int named = shm_open(seg.shm_name().c_str(), O_RDONLY, 0);
      ASSERT_GE(named, 0);
      void* a = mmap(nullptr, seg.size_bytes(), PROT_READ, MAP_SHARED, f.fd, 0);
      void* b = mmap(nullptr, seg.size_bytes(), PROT_READ, MAP_SHARED, named, 0);
      ASSERT_NE(a, MAP_FAILED);
      ASSERT_NE(b, MAP_FAILED);
      EXPECT_EQ(std::memcmp(a, b, seg.size_bytes()), 0);
      void* rw = a;
      EXPECT_NE(mprotect(rw, seg.size_bytes(), PROT_READ | PROT_WRITE), 0);
      munmap(a, seg.size_bytes());
      munmap(b, seg.size_bytes());
      close(named);
    }
    close(f.fd);
  }
  ASSERT_OK_AND_ASSIGN(auto bobs, bob->ListSegments());
  ASSERT_GT(bobs.segments_size(), 0);
  EXPECT_THAT(alice->OpenSegments({bobs.segments(0).segment_id()}),
              StatusIs(Code::kNotFound, "is not a segment of this tenant's"));

  // A ticket is one process's, once: the raw protocol, from a child process and then twice.
  v1::OpenSegmentsRequest req;
  req.add_segment_ids(seg.segment_id());
  auto ticket = [&] {
    grpc::ClientContext ctx;
    ctx.AddMetadata("x-kvtier-tenant", "alice");
    v1::OpenSegmentsResponse resp;
    alice->stub().OpenSegments(&ctx, req, &resp);  // checked where it matters: by collecting
    return resp.ticket();
  };
  const sockaddr_un fd_addr = UnixAddress(d.socket() + ".fds");
  auto collect = [&](const std::string& t) {  // the first message's text and descriptor count
    const int sock = ConnectTo(fd_addr);
    EXPECT_GE(sock, 0);
    const std::string line = t + "\n";  // the daemon may have closed it: no SIGPIPE
    send(sock, line.data(), line.size(), MSG_NOSIGNAL);
    char buf[256];
    const Received r = ReceiveOne(sock, buf, sizeof buf);
    close(sock);
    return std::make_pair(std::string(buf, r.bytes > 0 ? static_cast<size_t>(r.bytes) : 0), r.fds);
  };
  // Another process of the same uid is refused. The child makes only system calls (this
  // process has other threads, so it may not allocate after fork).
  const std::string line1 = ticket() + "\n";
  const pid_t child = fork();
  if (child == 0) {
    const int sock = ConnectTo(fd_addr);
    if (sock < 0) _exit(2);
    if (write(sock, line1.data(), line1.size()) != static_cast<ssize_t>(line1.size())) _exit(3);
    char buf[64];
    const Received r = ReceiveOne(sock, buf, sizeof buf);
    _exit(r.bytes > 0 && buf[0] == 'e' && r.fds == 0 ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "the child got descriptors";
  const std::string t2 = ticket();
  EXPECT_EQ(collect(t2), std::make_pair(std::string("k"), 1));
  EXPECT_EQ(collect(t2).second, 0);  // used
  EXPECT_EQ(collect("0123").second, 0);

  // Idle connections cost their uid only: with three open the fourth slot still serves; with
  // four the next is closed at once; they end by themselves within the read timeout. A slow
  // machine can let an idle connection time out before the collection it should crowd, so
  // each case holds only if every idle one was still open after the collection's answer (then
  // the daemon counted them all when it took the collection: it takes connections in order),
  // and is tried again otherwise.
  auto idle = [&] {
    const int sock = ConnectTo(fd_addr);
    EXPECT_GE(sock, 0);
    return sock;
  };
  auto open_still = [](int sock) {  // nothing to read and not closed
    char c;
    return recv(sock, &c, 1, MSG_PEEK | MSG_DONTWAIT) < 0 && errno == EAGAIN;
  };
  auto with_idle = [&](int n) -> std::optional<std::pair<std::string, int>> {
    for (int attempt = 0; attempt < 5; ++attempt) {
      absl::SleepFor(absl::Milliseconds(600));  // earlier connections' slots are given back
      const std::string t = ticket();
      std::vector<int> idlers;
      for (int i = 0; i < n; ++i) idlers.push_back(idle());
      const auto got = collect(t);
      const bool held = std::all_of(idlers.begin(), idlers.end(), open_still);
      for (int sock : idlers) close(sock);
      if (held) return got;
    }
    return std::nullopt;
  };
  EXPECT_EQ(with_idle(3), std::make_optional(std::make_pair(std::string("k"), 1)))
      << "three idle connections leave the fourth slot";
  const auto fifth = with_idle(4);
  ASSERT_TRUE(fifth.has_value()) << "four idle connections never stayed open together";
  EXPECT_EQ(fifth->second, 0) << "a fifth connection of one uid is closed";
  EXPECT_THAT(fifth->first, ::testing::StartsWith("buid "))  // busy: the clients' UNAVAILABLE
      << "a fifth connection is told why it is closed";
  EXPECT_THAT(fifth->first, ::testing::HasSubstr("descriptor connections open, unread ones "
                                                 "included (at most 4"));
  std::vector<int> idlers = {idle(), idle(), idle(), idle()};
  for (int sock : idlers) {  // the daemon ends each, with its refusal, within the read timeout
    pollfd p{sock, POLLIN, 0};
    EXPECT_EQ(poll(&p, 1, 10000), 1) << "an idle connection was not ended";
    close(sock);
  }
  // Their slots come back once their serving threads end (a refused collection keeps its
  // ticket, so the same one is tried again).
  const std::string after = ticket();
  std::pair<std::string, int> served;
  for (int i = 0; i < 50 && served.second == 0; ++i) {
    absl::SleepFor(absl::Milliseconds(100));
    served = collect(after);
  }
  EXPECT_EQ(served, std::make_pair(std::string("k"), 1));

  // Tickets a uid leaves uncollected are bounded.
  for (int i = 0; i < 20; ++i) ticket();  // past the cap: the later calls fail (not checked)
  grpc::ClientContext over;
  over.AddMetadata("x-kvtier-tenant", "alice");
  v1::OpenSegmentsResponse none;
  const grpc::Status capped = alice->stub().OpenSegments(&over, req, &none);
  EXPECT_EQ(capped.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(capped.error_message().find("tickets outstanding"), std::string::npos);
  // A channel whose ticket is refused ends at once: more of them than a tenant may hold open
  // are each refused for the ticket, never for the channels (each held its place for 15 s).
  for (int i = 0; i < 70; ++i) {  // past ChannelHub::kMaxPerTenant (64)
    grpc::ClientContext ctx;
    ctx.AddMetadata("x-kvtier-tenant", "alice");
    v1::OpenChannelResponse opened;
    const grpc::Status refused = alice->stub().OpenChannel(&ctx, v1::OpenChannelRequest(), &opened);
    ASSERT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << i;
    ASSERT_THAT(refused.error_message(), ::testing::HasSubstr("tickets outstanding")) << i;
  }
}

// Descriptors sent and not read are in flight, counted by the kernel against the daemon's uid:
// past its RLIMIT_NOFILE every send fails, for every tenant. A connection whose client does not
// read stays open and holds its uid's place until the client reads or hangs up, so one uid
// holds at most four such messages (before, each connection closed once sent, and a client
// could pile up unread descriptors without bound).
TEST(Daemon, DescriptorsAClientDoesNotReadHoldOnlyItsOwnConnections) {
  DaemonProcess d;
  ASSERT_TRUE(d.started());
  auto alice = Connect(d, "alice");
  SessionWithTokens(*alice, 300);
  ASSERT_OK_AND_ASSIGN(auto listed, alice->ListSegments());
  ASSERT_GT(listed.segments_size(), 0);
  v1::OpenSegmentsRequest req;
  req.add_segment_ids(listed.segments(0).segment_id());
  auto ticket = [&] {
    grpc::ClientContext ctx;
    ctx.AddMetadata("x-kvtier-tenant", "alice");
    v1::OpenSegmentsResponse resp;
    EXPECT_TRUE(alice->stub().OpenSegments(&ctx, req, &resp).ok());
    return resp.ticket();
  };
  const sockaddr_un fd_addr = UnixAddress(d.socket() + ".fds");
  auto send_ticket = [&](const std::string& t) {
    const int sock = ConnectTo(fd_addr);
    EXPECT_GE(sock, 0);
    const std::string line = t + "\n";
    send(sock, line.data(), line.size(), MSG_NOSIGNAL);
    return sock;
  };
  std::vector<int> unread;
  for (int i = 0; i < 4; ++i) unread.push_back(send_ticket(ticket()));
  for (int sock : unread) {  // each sent (an end shut before its send gets nothing at all)
    pollfd p{sock, POLLIN, 0};
    ASSERT_EQ(poll(&p, 1, 10000), 1);
  }
  // An end shut for writing, or both ways, keeps what it has not read (in flight still).
  shutdown(unread[0], SHUT_WR);
  shutdown(unread[1], SHUT_RDWR);
  absl::SleepFor(absl::Milliseconds(1500));  // past the daemon's wait for them to be read
  for (int sock : {unread[0], unread[2], unread[3]}) {  // sent: a message waits
    char c;
    EXPECT_EQ(recv(sock, &c, 1, MSG_PEEK | MSG_DONTWAIT), 1);
  }
  char buf[256];
  const int fifth = send_ticket(ticket());
  const Received busy = ReceiveOne(fifth, buf, sizeof buf);
  close(fifth);
  ASSERT_GT(busy.bytes, 0);
  EXPECT_EQ(busy.fds, 0);
  EXPECT_THAT(std::string(buf, static_cast<size_t>(busy.bytes)),
              ::testing::StartsWith("buid "));  // the clients' UNAVAILABLE, try again
  // Read (and closed), one gives its place back: the next collection is served.
  const Received read = ReceiveOne(unread[0], buf, sizeof buf);
  EXPECT_EQ(read.fds, 1);
  close(unread[0]);
  const int next = send_ticket(ticket());
  const Received served = ReceiveOne(next, buf, sizeof buf);
  close(next);
  EXPECT_EQ(served.fds, 1);
  EXPECT_EQ(std::string(buf, served.bytes > 0 ? static_cast<size_t>(served.bytes) : 0), "k");
  for (size_t i = 1; i < unread.size(); ++i) close(unread[i]);
  // The client library, which reads what it is sent, is served as before.
  ASSERT_OK_AND_ASSIGN(auto opened, alice->OpenSegments({}));
  for (const Client::SegmentFd& f : opened) close(f.fd);
}

// The inline append `r` as a staged one: its keys and values written into `area` at 0 and at
// the keys' size, and named there.
// Two Selects (with data) of two sessions that should hold the same rows: the same handles'
// bytes and positions, head by head.
void ExpectSameRows(const v1::SelectResponse& a, const v1::SelectResponse& b, int layer) {
  ASSERT_EQ(a.heads_size(), b.heads_size());
  for (int h = 0; h < a.heads_size(); ++h) {
    ASSERT_EQ(a.heads(h).blocks_size(), b.heads(h).blocks_size()) << "layer " << layer;
    for (int i = 0; i < a.heads(h).blocks_size(); ++i) {
      const v1::BlockHandle &x = a.heads(h).blocks(i), &y = b.heads(h).blocks(i);
      EXPECT_EQ(x.keys(), y.keys()) << "layer " << layer;
      EXPECT_EQ(x.values(), y.values()) << "layer " << layer;
      EXPECT_EQ(std::vector<int64_t>(x.positions().begin(), x.positions().end()),
                std::vector<int64_t>(y.positions().begin(), y.positions().end()));
    }
  }
}

v1::AppendKVRequest Staged(v1::AppendKVRequest r, const StagingBuffer& area) {
  std::memcpy(area.data(), r.keys().data(), r.keys().size());
  std::memcpy(area.data() + r.keys().size(), r.values().data(), r.values().size());
  r.mutable_staged()->set_staging_id(area.id());
  r.mutable_staged()->set_keys_offset(0);
  r.mutable_staged()->set_values_offset(r.keys().size());
  r.clear_keys();
  r.clear_values();
  return r;
}

// Zero-copy ingest: appends whose bytes a worker wrote into its session's staging area store
// what the same bytes sent inline store, and fail with the inline path's errors; the area is
// an unnamed memfd of the daemon's, handed read-write to its tenant only, one per session,
// and its bytes are bounded by --max_staging_size and given back with the session.
TEST(Daemon, StagedAppendsStoreWhatInlineOnesStore) {
  DaemonProcess d({"--max_staging_size", "1M"});
  ASSERT_TRUE(d.started());
  auto alice = Connect(d, "alice");
  auto bob = Connect(d, "bob");
  ASSERT_OK_AND_ASSIGN(auto staged, alice->CreateSession(Shape()));
  ASSERT_OK_AND_ASSIGN(auto inline_, alice->CreateSession(Shape()));
  const std::string sid = staged.session_id();
  const Data data = MakeData(700);  // 600 stored; the refusals below name tokens 600..603
  ASSERT_OK_AND_ASSIGN(auto area, alice->OpenStaging(sid, 600 * 1024));
  EXPECT_EQ(area->size(), 600u * 1024);  // whole pages
  // In parts, as an engine's prefill does: every layer of [0, 300) then of [300, 600).
  for (int start : {0, 300}) {
    for (int l = 0; l < kLayers; ++l) {
      ASSERT_OK(alice->AppendKV({Staged(Append(sid, data, l, start, 300), *area)}).status());
    }
  }
  ASSERT_OK(alice->AppendKV(AllLayers(inline_.session_id(), data, 0, 600)).status());
  for (int l = 0; l < kLayers; ++l) {
    ASSERT_OK_AND_ASSIGN(auto a, alice->Select(Select(sid, l, 256, /*data=*/true)));
    ASSERT_OK_AND_ASSIGN(auto b, alice->Select(Select(inline_.session_id(), l, 256, true)));
    ExpectSameRows(a, b, l);
  }
  // A repeat with the same bytes is a no-op; other bytes are refused, as inline.
  ASSERT_OK(alice->AppendKV({Staged(Append(sid, data, 0, 0, 10), *area)}).status());
  const Data other = MakeData(600, 9);
  auto refusal = [&](v1::AppendKVRequest r) { return alice->AppendKV({r}).status(); };
  const absl::Status inline_rewrite = refusal(Append(sid, other, 0, 0, 10));
  EXPECT_THAT(inline_rewrite, StatusIs(Code::kFailedPrecondition));
  EXPECT_EQ(refusal(Staged(Append(sid, other, 0, 0, 10), *area)), inline_rewrite);
  // NaN: the same message naming the same element.
  v1::AppendKVRequest nan = Append(sid, data, 1, 600, 4);
  (*nan.mutable_values())[2 * 70 + 1] = static_cast<char>(0x7e);  // 0x7eXX: fp16 NaN
  const absl::Status inline_nan = refusal(nan);
  EXPECT_THAT(inline_nan, StatusIs(Code::kInvalidArgument, "values: element 70"));
  EXPECT_EQ(refusal(Staged(nan, *area)), inline_nan);
  // Fields of the staged form.
  v1::AppendKVRequest past = Staged(Append(sid, data, 1, 600, 4), *area);
  past.mutable_staged()->set_values_offset(area->size() - 100);
  EXPECT_THAT(refusal(past), StatusIs(Code::kInvalidArgument, "staged.values_offset"));
  past.mutable_staged()->set_values_offset(~uint64_t{0});
  EXPECT_THAT(refusal(past), StatusIs(Code::kInvalidArgument, "staged.values_offset"));
  v1::AppendKVRequest both = Staged(Append(sid, data, 1, 600, 4), *area);
  both.set_keys("xx");
  EXPECT_THAT(refusal(both), StatusIs(Code::kInvalidArgument, "keys: bytes sent inline"));
  v1::AppendKVRequest elsewhere = Staged(Append(inline_.session_id(), data, 1, 600, 4), *area);
  EXPECT_THAT(refusal(elsewhere), StatusIs(Code::kNotFound, "it has none"));

  // The daemon's descriptor of it is a memfd with no name; the worker's is read-write.
  int memfds = 0;
  const std::string fd_dir = absl::StrCat("/proc/", d.pid(), "/fd");
  DIR* dir = opendir(fd_dir.c_str());
  ASSERT_NE(dir, nullptr);
  while (dirent* e = readdir(dir)) {
    char target[256] = {};
    if (readlink((fd_dir + "/" + e->d_name).c_str(), target, sizeof target - 1) > 0 &&
        absl::StrContains(target, "-staging-")) {
      EXPECT_TRUE(absl::StartsWith(target, "/memfd:kvtier-")) << target;
      ++memfds;
    }
  }
  closedir(dir);
  EXPECT_EQ(memfds, 1);
  EXPECT_TRUE(ShmEntries(d.instance() + "-staging").empty());

  // Another tenant cannot open a staging area of alice's session, nor name hers.
  EXPECT_THAT(bob->OpenStaging(sid, 4096).status(), StatusIs(Code::kPermissionDenied));
  ASSERT_OK_AND_ASSIGN(auto bobs, bob->CreateSession(Shape()));
  v1::AppendKVRequest theirs = Staged(Append(bobs.session_id(), data, 0, 0, 4), *area);
  EXPECT_THAT(bob->AppendKV({theirs}).status(), StatusIs(Code::kNotFound));

  // Bounded: 1M in all. A new area replaces the session's last (whose id is then unknown).
  EXPECT_THAT(alice->OpenStaging(sid, 2 << 20).status(),
              StatusIs(Code::kInvalidArgument, "size_bytes"));
  EXPECT_THAT(alice->OpenStaging(inline_.session_id(), 600 * 1024).status(),
              StatusIs(Code::kResourceExhausted, "max_staging_size"));
  ASSERT_OK_AND_ASSIGN(auto small, alice->OpenStaging(sid, 4096));
  EXPECT_THAT(refusal(Staged(Append(sid, data, 1, 600, 4), *area)),
              StatusIs(Code::kNotFound, absl::StrCat("it has ", small->id())));
  ASSERT_OK_AND_ASSIGN(auto second, alice->OpenStaging(inline_.session_id(), 600 * 1024));
  ASSERT_OK(alice->CloseSession(inline_.session_id()).status());  // gives its area back
  ASSERT_OK_AND_ASSIGN(auto next, alice->CreateSession(Shape()));
  EXPECT_OK(alice->OpenStaging(next.session_id(), 600 * 1024).status());
}

// An AppendKV stream held open (Client::OpenAppend) stores each message as it comes, as
// AppendKV's stream does; a refused message ends it (Write false, Finish the refusal, what
// came before it stored), and a writer dropped unfinished cancels its stream, what it sent
// before staying stored.
TEST(Daemon, AnOpenAppendStreamStoresEachMessageAsItComes) {
  DaemonProcess d;
  ASSERT_TRUE(d.started());
  auto alice = Connect(d, "alice");
  ASSERT_OK_AND_ASSIGN(auto session, alice->CreateSession(Shape()));
  const std::string sid = session.session_id();
  const Data data = MakeData(300);
  auto stored = [&] { return alice->DescribeSession(sid)->info().num_tokens(); };
  {
    std::unique_ptr<AppendWriter> w = alice->OpenAppend();
    for (int l = 0; l < kLayers; ++l) ASSERT_TRUE(w->Write(Append(sid, data, l, 0, 100)));
    absl::StatusOr<uint64_t> finished = w->Finish();
    ASSERT_OK(finished.status());
    EXPECT_EQ(*finished, 100u);
    EXPECT_THAT(w->Finish().status(), StatusIs(Code::kFailedPrecondition));
    EXPECT_FALSE(w->Write(Append(sid, data, 0, 100, 100)));  // finished: nothing sent
  }
  EXPECT_EQ(stored(), 100u);
  {
    std::unique_ptr<AppendWriter> w = alice->OpenAppend();
    ASSERT_TRUE(w->Write(Append(sid, data, 0, 100, 100)));
    ASSERT_TRUE(w->Write(Append(sid, data, 1, 150, 10)));  // a gap: refused
    for (int i = 0; i < 100 && w->Write(Append(sid, data, 2, 100, 100)); ++i) {
      absl::SleepFor(absl::Milliseconds(10));  // until the refusal ends the stream
    }
    EXPECT_FALSE(w->Write(Append(sid, data, 3, 100, 100)));
    EXPECT_THAT(w->Finish().status(), StatusIs(Code::kOutOfRange, "start_token: 150"));
  }
  // The message before the refusal is stored: other bytes for its tokens are refused.
  EXPECT_THAT(alice->AppendKV({Append(sid, MakeData(300, 9), 0, 100, 100)}).status(),
              StatusIs(Code::kFailedPrecondition));
  {
    std::unique_ptr<AppendWriter> w = alice->OpenAppend();
    ASSERT_TRUE(w->Write(Append(sid, data, 1, 100, 100)));
  }  // dropped unfinished: the stream ends, and this client goes on
  for (int l = 1; l < kLayers; ++l) {
    EXPECT_OK(alice->AppendKV({Append(sid, data, l, 100, 100)}).status());  // or a no-op rewrite
  }
  EXPECT_EQ(stored(), 200u);
}

// The leases a session holds now (SessionInfo.active_leases), polled until `want` (a channel's
// end is seen by its thread, not by the call that closed it) or 10 s.
uint32_t LeasesBecome(Client& c, const std::string& sid, uint32_t want) {
  uint32_t n = ~0u;
  for (int i = 0; i < 200 && n != want; ++i) {
    auto d = c.DescribeSession(sid);
    if (!d.ok()) return ~0u;
    n = d->info().active_leases();
    if (n != want) absl::SleepFor(absl::Milliseconds(50));
  }
  return n;
}

// A channel call waits as long as the client's timeout says, however long that is: past
// poll's 24.8 days it sleeps in parts (a timeout of 2^32 ms and 200 ms once wrapped to a 200 ms
// wait, and a call to a daemon busy for longer failed DEADLINE_EXCEEDED at once).
TEST(Daemon, AChannelCallWaitsOutATimeoutLongerThanPollTakes) {
  DaemonProcess d;
  ASSERT_TRUE(d.started());
  ClientOptions o;
  o.tenant = "alice";
  o.timeout = absl::Milliseconds((int64_t{1} << 32) + 200);
  ASSERT_OK_AND_ASSIGN(auto alice, Client::Connect(d.address(), o));
  const std::string sid = SessionWithTokens(*alice, 300);
  ASSERT_OK_AND_ASSIGN(auto ch, alice->OpenChannel());
  ASSERT_OK(ch->Select(Select(sid, 0, 64)).status());
  ASSERT_EQ(kill(d.pid(), SIGSTOP), 0);  // busy, as far as the worker can tell, for a second
  absl::StatusOr<v1::SelectResponse> got;
  std::thread call([&] { got = ch->Select(Select(sid, 1, 64)); });
  absl::SleepFor(absl::Seconds(1));
  ASSERT_EQ(kill(d.pid(), SIGCONT), 0);
  call.join();
  EXPECT_OK(got.status());
  // An infinite timeout (no deadline at all), over gRPC and the channel alike.
  o.timeout = absl::InfiniteDuration();
  ASSERT_OK_AND_ASSIGN(auto patient, Client::Connect(d.address(), o));
  ASSERT_OK(patient->DescribeSession(sid).status());
  ASSERT_OK_AND_ASSIGN(auto forever, patient->OpenChannel());
  EXPECT_OK(forever->Select(Select(sid, 1, 64)).status());
}

// The shared-memory Select channel answers as the RPCs do (the same handles, the same errors,
// its tenant's sessions only); its Selects' leases end when its worker closes it, even in the
// middle of a call, and a drain hangs it up.
TEST(Daemon, SelectChannelAnswersAsTheRpcsAndEndsWithItsWorker) {
  DaemonProcess d;
  ASSERT_TRUE(d.started());
  auto alice = Connect(d, "alice");
  auto bob = Connect(d, "bob");
  const std::string sid = SessionWithTokens(*alice, 700);
  const std::string bobs = SessionWithTokens(*bob, 100);
  ASSERT_OK_AND_ASSIGN(auto ch, alice->OpenChannel());
  EXPECT_FALSE(ch->worker_id().empty());
  for (int layer : {0, 3}) {
    ASSERT_OK_AND_ASSIGN(auto a, ch->Select(Select(sid, layer, 256, /*data=*/true)));
    ASSERT_OK_AND_ASSIGN(auto b, alice->Select(Select(sid, layer, 256, true)));
    EXPECT_FALSE(a.lease_id().empty());
    EXPECT_NE(a.lease_id(), b.lease_id());
    ASSERT_EQ(a.heads_size(), b.heads_size());
    for (int h = 0; h < a.heads_size(); ++h) {
      ASSERT_EQ(a.heads(h).blocks_size(), b.heads(h).blocks_size());
      for (int i = 0; i < a.heads(h).blocks_size(); ++i) {
        const v1::BlockHandle &x = a.heads(h).blocks(i), &y = b.heads(h).blocks(i);
        EXPECT_EQ(x.chunk_id(), y.chunk_id());
        EXPECT_EQ(x.keys(), y.keys());
        EXPECT_EQ(x.values(), y.values());
      }
    }
    EXPECT_OK(ch->Release(b.lease_id()));  // a lease of the tenant's, whichever way it came
    EXPECT_OK(alice->Release(a.lease_id()));
  }
  // Into one response reused (a decode loop's): each answer whole, nothing of the one before
  // it left (a larger budget's first, then a smaller one), and an error leaves it empty.
  {
    v1::SelectResponse reused;
    for (uint32_t budget : {512u, 128u}) {
      ASSERT_OK(ch->Select(Select(sid, budget == 512 ? 3 : 0, budget, true), &reused));
      ASSERT_OK_AND_ASSIGN(auto alone,
                           ch->Select(Select(sid, budget == 512 ? 3 : 0, budget, true)));
      ASSERT_EQ(reused.heads_size(), alone.heads_size());
      for (int h = 0; h < reused.heads_size(); ++h) {
        ASSERT_EQ(reused.heads(h).blocks_size(), alone.heads(h).blocks_size()) << budget;
        for (int i = 0; i < reused.heads(h).blocks_size(); ++i) {
          const v1::BlockHandle &x = reused.heads(h).blocks(i), &y = alone.heads(h).blocks(i);
          EXPECT_EQ(x.chunk_id(), y.chunk_id());
          EXPECT_EQ(x.keys(), y.keys());
          EXPECT_EQ(std::vector<int64_t>(x.positions().begin(), x.positions().end()),
                    std::vector<int64_t>(y.positions().begin(), y.positions().end()));
        }
      }
      EXPECT_OK(ch->Release(reused.lease_id()));
      EXPECT_OK(ch->Release(alone.lease_id()));
    }
    EXPECT_THAT(ch->Select(Select(sid, kLayers, 128), &reused), StatusIs(Code::kInvalidArgument));
    EXPECT_EQ(reused.heads_size(), 0);
    EXPECT_TRUE(reused.lease_id().empty());
  }
  v1::BatchSelectRequest batch;
  for (int l = 0; l < kLayers; ++l) *batch.add_requests() = Select(sid, l, 128);
  ASSERT_OK_AND_ASSIGN(auto all, ch->BatchSelect(batch));
  EXPECT_EQ(all.responses_size(), kLayers);
  EXPECT_EQ(LeasesBecome(*alice, sid, kLayers), static_cast<uint32_t>(kLayers));
  // The RPCs' errors, word for word.
  for (const v1::SelectRequest& bad : {Select(sid, kLayers, 128), Select(bobs, 0, 128)}) {
    const absl::Status over_grpc = alice->Select(bad).status();
    EXPECT_FALSE(over_grpc.ok());
    EXPECT_EQ(ch->Select(bad).status(), over_grpc);
  }
  EXPECT_THAT(ch->Release("no-such-lease"), StatusIs(Code::kNotFound));

  // Closing the channel ends the leases of its Selects (the batch's), and only those.
  ASSERT_OK_AND_ASSIGN(auto kept, alice->Select(Select(sid, 1, 128)));
  ch.reset();
  EXPECT_EQ(LeasesBecome(*alice, sid, 1), 1u);
  EXPECT_OK(alice->Release(kept.lease_id()));

  // A worker that goes away in the middle of a call: the raw protocol, rung and then closed.
  {
    v1::OpenChannelResponse opened;
    grpc::ClientContext ctx;
    ctx.AddMetadata("x-kvtier-tenant", "alice");
    ASSERT_TRUE(alice->stub().OpenChannel(&ctx, v1::OpenChannelRequest(), &opened).ok());
    const int sock = ConnectTo(UnixAddress(d.socket() + ".fds"));
    ASSERT_GE(sock, 0);
    const std::string line = opened.ticket() + "\n";
    ASSERT_EQ(write(sock, line.data(), line.size()), static_cast<ssize_t>(line.size()));
    char byte;
    iovec iov{&byte, 1};
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * 4)];
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof control;
    ASSERT_EQ(recvmsg(sock, &msg, 0), 1);
    close(sock);
    ASSERT_EQ(byte, 'k');
    int fds[4];
    ASSERT_EQ(CMSG_FIRSTHDR(&msg)->cmsg_len, CMSG_LEN(sizeof fds));
    std::memcpy(fds, CMSG_DATA(CMSG_FIRSTHDR(&msg)), sizeof fds);
    struct stat st {};
    ASSERT_EQ(fstat(fds[0], &st), 0);
    EXPECT_EQ(static_cast<uint64_t>(st.st_size), opened.size_bytes());
    auto* mem = static_cast<uint8_t*>(
        mmap(nullptr, st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, fds[0], 0));
    ASSERT_NE(mem, MAP_FAILED);
    channel::Header h;
    std::memcpy(&h, mem, sizeof h);
    EXPECT_EQ(h.magic, channel::kMagic);
    // Bytes that are no request, and an op that is none, are refused by name.
    auto answer = [&](uint32_t op, const std::string& bytes, uint64_t seq) {
      std::memcpy(mem + h.request_offset, bytes.data(), bytes.size());
      auto* shared = reinterpret_cast<channel::Header*>(mem);
      shared->op = op;
      shared->request_bytes = static_cast<uint32_t>(bytes.size());
      __atomic_store_n(&shared->seq, seq, __ATOMIC_RELEASE);
      const uint64_t one = 1;
      EXPECT_EQ(write(fds[1], &one, sizeof one), 8);
      for (int i = 0; i < 100 && __atomic_load_n(&shared->answered_seq, __ATOMIC_ACQUIRE) != seq;
           ++i) {
        pollfd p{fds[2], POLLIN, 0};
        uint64_t rung;
        if (poll(&p, 1, 100) == 1) {
          EXPECT_EQ(read(fds[2], &rung, sizeof rung), 8);
        }
      }
      EXPECT_EQ(shared->answered_seq, seq);
      return std::make_pair(shared->code,
                            std::string(reinterpret_cast<const char*>(mem + h.response_offset),
                                        shared->response_bytes));
    };
    auto [code, message] = answer(channel::kSelect, "\xff\xff\xff", 1);
    EXPECT_EQ(code, static_cast<int>(Code::kInvalidArgument));
    EXPECT_TRUE(absl::StrContains(message, "not a SelectRequest")) << message;
    std::tie(code, message) = answer(7, "", 2);
    EXPECT_EQ(code, static_cast<int>(Code::kInvalidArgument));
    EXPECT_TRUE(absl::StrContains(message, "op: 7")) << message;
    // A Select answered (its lease taken) and never released, then one rung and left: the
    // worker goes with both.
    std::tie(code, message) = answer(channel::kSelect, Select(sid, 2, 128).SerializeAsString(), 3);
    EXPECT_EQ(code, 0) << message;
    EXPECT_EQ(LeasesBecome(*alice, sid, 1), 1u);
    const std::string req = Select(sid, 1, 128).SerializeAsString();
    std::memcpy(mem + h.request_offset, req.data(), req.size());
    auto* shared = reinterpret_cast<channel::Header*>(mem);
    shared->op = channel::kSelect;
    shared->request_bytes = static_cast<uint32_t>(req.size());
    __atomic_store_n(&shared->seq, 4, __ATOMIC_RELEASE);  // last: the daemon may be watching
    const uint64_t one = 1;
    ASSERT_EQ(write(fds[1], &one, sizeof one), 8);
    munmap(mem, st.st_size);
    for (int fd : fds) close(fd);  // gone before the answer
    EXPECT_EQ(LeasesBecome(*alice, sid, 0), 0u) << "the dead worker's Select kept its lease";
  }

  // Another tenant's channel reaches its own sessions only; a drain hangs every channel up.
  ASSERT_OK_AND_ASSIGN(auto bobs_channel, bob->OpenChannel());
  EXPECT_THAT(bobs_channel->Select(Select(sid, 0, 128)), StatusIs(Code::kPermissionDenied));
  EXPECT_OK(bobs_channel->Select(Select(bobs, 0, 128)).status());
  EXPECT_THAT(bob->OpenChannel(1024).status(), StatusIs(Code::kInvalidArgument, "size_bytes"));
  ASSERT_OK_AND_ASSIGN(auto admin, Client::Connect(d.address()));
  ASSERT_OK(admin->Drain().status());  // the drain starts on the daemon's main thread, soon
  absl::Status after;
  for (int i = 0; i < 200 && after.ok(); ++i) {
    after = bobs_channel->Select(Select(bobs, 0, 128)).status();
    if (after.ok()) absl::SleepFor(absl::Milliseconds(50));
  }
  EXPECT_TRUE(after.code() == Code::kUnavailable) << after;  // draining, or hung up
  EXPECT_EQ(d.WaitForExit(20), 0);
}

// Appends through the shared-memory channel (a decode loop's, one layer at a time, inline or
// staged) store what the AppendKV stream stores, refuse what it refuses with its words, and
// reach the channel's tenant's sessions only.
TEST(Daemon, ChannelAppendsStoreWhatTheStreamStores) {
  DaemonProcess d;
  ASSERT_TRUE(d.started());
  auto alice = Connect(d, "alice");
  auto bob = Connect(d, "bob");
  ASSERT_OK_AND_ASSIGN(auto by_channel, alice->CreateSession(Shape()));
  ASSERT_OK_AND_ASSIGN(auto by_stream, alice->CreateSession(Shape()));
  const std::string sid = by_channel.session_id(), other = by_stream.session_id();
  const std::string bobs = SessionWithTokens(*bob, 100);
  const Data data = MakeData(700);
  ASSERT_OK_AND_ASSIGN(auto ch, alice->OpenChannel());
  ASSERT_OK_AND_ASSIGN(auto area, alice->OpenStaging(sid, 600 * 1024));
  // A prefill layer by layer from the staging area (the tokens stored in every layer come
  // with the last), then decode steps of one token a layer, inline.
  for (int l = 0; l < kLayers; ++l) {
    ASSERT_OK_AND_ASSIGN(uint64_t stored,
                         ch->AppendKV(Staged(Append(sid, data, l, 0, 500), *area)));
    EXPECT_EQ(stored, l + 1 == kLayers ? 500u : 0u) << "layer " << l;
  }
  for (int t = 500; t < 520; ++t) {
    for (int l = 0; l < kLayers; ++l) {
      ASSERT_OK_AND_ASSIGN(uint64_t stored, ch->AppendKV(Append(sid, data, l, t, 1)));
      EXPECT_EQ(stored, l + 1 == kLayers ? uint64_t(t + 1) : uint64_t(t));
    }
  }
  ASSERT_OK_AND_ASSIGN(uint64_t stored, alice->AppendKV(AllLayers(other, data, 0, 520)));
  EXPECT_EQ(stored, 520u);
  for (int l = 0; l < kLayers; ++l) {
    ASSERT_OK_AND_ASSIGN(auto a, alice->Select(Select(sid, l, 256, /*data=*/true)));
    ASSERT_OK_AND_ASSIGN(auto b, alice->Select(Select(other, l, 256, true)));
    ExpectSameRows(a, b, l);
    EXPECT_OK(alice->Release(a.lease_id()));
    EXPECT_OK(alice->Release(b.lease_id()));
  }
  // The stream's refusals, word for word: a rewrite with other bytes, a NaN, a layer past the
  // shape, another tenant's session, a staged append naming a session without an area.
  const Data changed = MakeData(700, 9);
  v1::AppendKVRequest nan = Append(sid, data, 1, 520, 4);
  (*nan.mutable_values())[2 * 70 + 1] = static_cast<char>(0x7e);  // 0x7eXX: fp16 NaN
  v1::AppendKVRequest past_layers = Append(sid, data, 0, 520, 4);
  past_layers.set_layer(kLayers);
  for (const v1::AppendKVRequest& bad :
       {Append(sid, changed, 0, 10, 5), nan, past_layers, Append(bobs, data, 0, 100, 2),
        Staged(Append(other, data, 0, 520, 2), *area)}) {
    const absl::Status over_stream = alice->AppendKV({bad}).status();
    EXPECT_FALSE(over_stream.ok());
    EXPECT_EQ(ch->AppendKV(bad).status(), over_stream);
  }
  ASSERT_OK_AND_ASSIGN(auto described, alice->DescribeSession(sid));
  EXPECT_EQ(described.info().num_tokens(), 520u);  // nothing of the refused ones stored
  ASSERT_OK_AND_ASSIGN(auto bobs_described, bob->DescribeSession(bobs));
  EXPECT_EQ(bobs_described.info().num_tokens(), 100u);
}

TEST(Daemon, DrainStopsNewCallsAndExits) {
  DaemonProcess d({"--drain_timeout_ms", "2000"});
  ASSERT_TRUE(d.started());
  auto c = Connect(d);
  ASSERT_OK(c->CreateSession(Shape()).status());
  ASSERT_OK_AND_ASSIGN(uint32_t sessions, c->Drain());
  EXPECT_EQ(sessions, 1u);
  // The daemon goes away by itself, cleanly; anything after is refused.
  EXPECT_EQ(d.WaitForExit(10), 0);
  EXPECT_THAT(c->CreateSession(Shape()), StatusIs(Code::kUnavailable));
  EXPECT_TRUE(ShmEntries(d.instance()).empty());
  struct stat st {};
  EXPECT_NE(stat(d.socket().c_str(), &st), 0);
}

TEST(Daemon, ForkDevicePlacementAndAdminCalls) {
  DaemonProcess d;
  ASSERT_TRUE(d.started());
  auto c = Connect(d);
  auto req = Shape();
  req.set_session_id("parent");
  (*req.mutable_labels())["model"] = "smollm2";
  ASSERT_OK(c->CreateSession(req).status());
  Data data = MakeData(300);
  ASSERT_OK(c->AppendKV(AllLayers("parent", data, 0, 300)).status());
  v1::ForkSessionRequest fork;
  fork.set_session_id("parent");
  fork.set_num_tokens(200);
  fork.set_new_session_id("child");
  ASSERT_OK_AND_ASSIGN(auto forked, c->ForkSession(fork));
  EXPECT_EQ(forked.session_id(), "child");
  auto sel = Select("child", 2, 1000, true);
  sel.set_placement(v1::TIER_DEVICE);
  ASSERT_OK_AND_ASSIGN(auto resp, c->Select(sel));
  EXPECT_EQ(resp.context_tokens(), 200u);
  SegmentMap segments;
  for (const auto& b : resp.heads(0).blocks()) {
    EXPECT_EQ(b.tier(), v1::TIER_DEVICE);
    ASSERT_OK_AND_ASSIGN(ChunkView view, segments.View(*c, b));
    EXPECT_EQ(std::string(reinterpret_cast<const char*>(view.keys.data()), view.keys.size() * 2),
              b.keys());
  }
  ASSERT_OK_AND_ASSIGN(auto list, c->ListSessions());
  ASSERT_EQ(list.sessions_size(), 2);
  EXPECT_EQ(list.sessions(1).session_id(), "parent");
  EXPECT_EQ(list.sessions(1).labels().at("model"), "smollm2");
  EXPECT_EQ(list.sessions(0).bytes_by_tier().at("TIER_DEVICE"), 3u * 13 * 4096);
  EXPECT_EQ(list.sessions(1).chunks_by_precision().at("PRECISION_FP16"), 4u * 3 * 19);
  ASSERT_OK_AND_ASSIGN(auto tiers, c->GetTierStats());
  ASSERT_EQ(tiers.tiers_size(), 2);
  EXPECT_EQ(tiers.tiers(0).tier(), v1::TIER_DEVICE);
  EXPECT_TRUE(tiers.tiers(0).emulated());
  EXPECT_EQ(tiers.tiers(0).promotions(), 3u * 13);
  EXPECT_EQ(tiers.tiers(0).pinned_bytes(), 3u * 13 * 4096);
  ASSERT_OK_AND_ASSIGN(uint64_t moved, c->Evict("child", v1::TIER_DEVICE));
  EXPECT_EQ(moved, 3u * 13 * 4096);
  ASSERT_OK_AND_ASSIGN(auto segs, c->ListSegments());
  std::set<uint64_t> ids;
  for (const auto& s : segs.segments()) EXPECT_TRUE(ids.insert(s.segment_id()).second);
  v1::SessionPolicy p;
  p.set_recent_window(32);
  ASSERT_OK_AND_ASSIGN(auto policy, c->SetPolicy("parent", p));
  EXPECT_EQ(policy.recent_window(), 32u);
  v1::BatchSelectRequest batch;
  *batch.add_requests() = Select("parent", 3, 128);
  *batch.add_requests() = Select("child", 3, 128);
  ASSERT_OK_AND_ASSIGN(auto both, c->BatchSelect(batch));
  EXPECT_EQ(both.responses_size(), 2);
  *batch.add_requests() = Select("ghost", 3, 128);
  EXPECT_THAT(c->BatchSelect(batch), StatusIs(Code::kNotFound, "requests[2]"));
  ASSERT_OK_AND_ASSIGN(std::string echo, c->Echo("ping"));
  EXPECT_EQ(echo, "ping");
}

// --device: "auto" runs the device tier on a CUDA device this process can use, else emulated,
// and the start-up log says which and why; a GPU index the machine does not have is a start-up
// error naming `device`, never a silent fallback.
TEST(Daemon, TheDeviceTierIsAGpuOrEmulatedAndStartUpSaysWhich) {
  const bool gpu = ProbeGpus().ok();
  TempDir dir;
  const std::string base = testing::BinaryPath("kvtierd") + " --listen unix:" + dir.path() +
                           "/d.sock --instance devflag-" + std::to_string(getpid());
  auto [code, out] = testing::RunCommand("timeout -s TERM 3 " + base + " 2>&1");
  EXPECT_NE(out.find(gpu ? "event=device.tier mode=cuda device=0"
                         : "event=device.tier mode=emulated reason="),
            std::string::npos)
      << out;
  EXPECT_NE(out.find(gpu ? " device=cuda:0 " : " device=emulated "), std::string::npos) << out;
  std::tie(code, out) =
      testing::RunCommand("timeout -s TERM 3 " + base + " --device emulated 2>&1");
  EXPECT_NE(out.find("mode=emulated reason=\"--device emulated\""), std::string::npos) << out;
  std::tie(code, out) = testing::RunCommand("timeout -s TERM 3 " + base + " --device 63 2>&1");
  EXPECT_EQ(code, 1) << out;  // no machine here has 64 GPUs
  EXPECT_NE(out.find("device: 63 names"), std::string::npos) << out;
  EXPECT_EQ(out.find("event=daemon.start"), std::string::npos) << out;
  std::tie(code, out) = testing::RunCommand(base + " --device gpu0 2>&1");
  EXPECT_EQ(code, 2) << out;
  EXPECT_NE(out.find("device: \"gpu0\" is not auto, emulated or a CUDA device index"),
            std::string::npos)
      << out;
}

// An append from a worker's device memory reaches a daemon without a GPU as FAILED_PRECONDITION
// naming `device`; on a GPU a handle that is no allocation cannot be opened, and names the
// handle. Either way nothing is stored and the stream's error is that append's.
TEST(Daemon, AnAppendFromDeviceMemoryNamesTheDevice) {
  DaemonProcess d;
  ASSERT_TRUE(d.started());
  auto c = Connect(d);
  ASSERT_OK_AND_ASSIGN(auto created, c->CreateSession(Shape()));
  v1::AppendKVRequest r;
  r.set_session_id(created.session_id());
  r.set_num_tokens(16);
  r.mutable_device()->set_cuda_ipc_handle(std::string(kCudaIpcHandleBytes, 'h'));
  const bool gpu = ProbeGpus().ok();
  EXPECT_THAT(c->AppendKV({r}), StatusIs(gpu ? Code::kInvalidArgument : Code::kFailedPrecondition,
                                         gpu ? "device.cuda_ipc_handle" : "runs no GPU"));
  ASSERT_OK_AND_ASSIGN(auto described, c->DescribeSession(created.session_id()));
  EXPECT_EQ(described.info().num_tokens(), 0u);
}

TEST(Daemon, BadConfigurationExitsTwoNamingTheField) {
  auto [code, out] = testing::RunCommand(testing::BinaryPath("kvtierd") +
                                         " --listen unix:/tmp/x.sock --host_capacity 12Q");
  EXPECT_EQ(code, 2);
  EXPECT_NE(out.find("host_capacity"), std::string::npos) << out;
  std::tie(code, out) = testing::RunCommand(testing::BinaryPath("kvtierd") + " --bogus 1");
  EXPECT_EQ(code, 2);
  EXPECT_NE(out.find("bogus"), std::string::npos) << out;
  std::tie(code, out) =
      testing::RunCommand(testing::BinaryPath("kvtierd") + " --print_default_config");
  EXPECT_EQ(code, 0);
  ASSERT_OK_AND_ASSIGN(v1::Config printed, ParseConfigText(out));
  EXPECT_EQ(printed.host_capacity(), "4G");
}

// Unix-socket callers are who the kernel says they are (SO_PEERCRED): a uid named in
// auth.unix_peers acts as its tenant and may not name another, a uid named nowhere is
// UNAUTHENTICATED, and the daemon's own uid names its tenant in the metadata unless
// auth.same_uid_by_metadata is off. Other uids are played by kvtierctl under setpriv, so the
// test needs root (skipped otherwise).
TEST(Auth, UnixPeersAreTheirUidsTenantsAndOthersAreUnauthenticated) {
  if (getuid() != 0 || access("/usr/bin/setpriv", X_OK) != 0) {
    GTEST_SKIP() << "needs root and setpriv to connect as other uids";
  }
  const std::string dir = "/tmp/kvtier-auth-" + std::to_string(getpid());
  ASSERT_EQ(mkdir(dir.c_str(), 0755), 0);
  // A copy anyone may run: the build tree may sit where other uids cannot reach.
  const std::string ctl_bin = dir + "/kvtierctl";
  ASSERT_EQ(testing::RunCommand("cp " + testing::BinaryPath("kvtierctl") + " " + ctl_bin).first, 0);
  const std::string config = dir + "/kvtierd.conf";
  std::ofstream(config) << "auth { unix_peers { uid: 65534 tenant: \"team-nobody\" } }\n";
  DaemonProcess d({"--config", config});
  ASSERT_TRUE(d.started());
  const std::string sock = d.address().substr(5);
  // The test reaches past the socket's 0660 and its private directory.
  ASSERT_EQ(chmod(sock.c_str(), 0666), 0);
  ASSERT_EQ(chmod(sock.substr(0, sock.rfind('/')).c_str(), 0755), 0);
  auto as = [&](int uid, const std::string& args) {
    const std::string id = std::to_string(uid);
    return testing::RunCommand("/usr/bin/setpriv --reuid=" + id + " --regid=" + id +
                               " --clear-groups " + ctl_bin + " --addr " + d.address() + " " +
                               args);
  };
  auto c = Connect(d, "alice");  // the daemon's own uid: the tenant it names
  ASSERT_FALSE(SessionWithTokens(*c, 100).empty());

  auto [code, out] = as(65534, "-o json sessions");
  EXPECT_EQ(code, 0) << out;
  auto [code2, out2] = as(65534, "--tenant alice sessions");
  EXPECT_EQ(code2, 1) << out2;
  EXPECT_NE(out2.find("PERMISSION_DENIED"), std::string::npos) << out2;
  EXPECT_NE(out2.find("team-nobody"), std::string::npos) << out2;
  auto [code3, out3] = as(65533, "sessions");
  EXPECT_EQ(code3, 1) << out3;
  EXPECT_NE(out3.find("UNAUTHENTICATED"), std::string::npos) << out3;
  EXPECT_NE(out3.find("uid 65533"), std::string::npos) << out3;
  // The mapped uid's sessions are its tenant's.
  auto [code4, out4] = as(65534, "close no-such-session");
  EXPECT_EQ(code4, 0) << out4;
  // Nor can another uid open a segment by name (mode 0600), even in the daemon's group.
  const std::vector<std::string> segs = ShmEntries(d.instance());
  ASSERT_FALSE(segs.empty());
  auto [code5, out5] =
      testing::RunCommand("/usr/bin/setpriv --reuid=65534 --regid=" + std::to_string(getgid()) +
                          " --clear-groups cat /dev/shm/" + segs.front() + " > /dev/null");
  EXPECT_NE(code5, 0) << out5;

  // With the own-uid exception off, the daemon's own uid needs an entry too.
  const std::string strict = dir + "/strict.conf";
  std::ofstream(strict) << "auth { same_uid_by_metadata: \"off\" }\n";
  DaemonProcess s({"--config", strict});
  ASSERT_TRUE(s.started());
  EXPECT_THAT(Connect(s, "alice")->CreateSession(Shape()).status(),
              StatusIs(Code::kUnauthenticated, "auth.unix_peers"));
  ASSERT_EQ(testing::RunCommand("rm -rf " + dir).first, 0);
}

// Bearer tokens and roles, per RPC: with the own-uid exception off, a call without a token
// is UNAUTHENTICATED on either listener; tenants alice and bob touch only their own sessions,
// leases and segments; the admin (tenant ops) sees and steers every tenant's, and alone may
// Drain. The config's entries come from `kvtierctl token hash`, as an operator makes them.
TEST(Auth, EveryRpcAnswersEachCallerWithItsCode) {
  TempDir dir;
  std::string entries;
  for (const auto& [name, flags] :
       std::vector<std::pair<std::string, std::string>>{{"alice", "--tenant alice"},
                                                        {"bob", "--tenant bob"},
                                                        {"admin", "--tenant ops --admin"}}) {
    std::ofstream(dir.path() + "/" + name) << name << "-token-0123456789\n";
    auto [code, out] = testing::RunCommand(testing::BinaryPath("kvtierctl") + " token hash " +
                                           flags + " < " + dir.path() + "/" + name);
    ASSERT_EQ(code, 0) << out;
    EXPECT_EQ(out.find("-token-"), std::string::npos) << "the entry holds no token: " << out;
    entries += out;
  }
  const std::string config = dir.path() + "/kvtierd.conf";
  std::ofstream(config) << "auth { same_uid_by_metadata: \"off\" " << entries << "}\n";
  const int port = testing::FreePort();
  DaemonProcess d({"--config", config, "--tcp_listen", absl::StrCat("127.0.0.1:", port),
                   "--tcp_plaintext", "on"});
  ASSERT_TRUE(d.started()) << d.Log();
  auto client = [&](const std::string& token, const std::string& tenant = "",
                    const std::string& address = "") {
    ClientOptions o;
    o.token = token.empty() ? "" : token + "-token-0123456789";
    o.tenant = tenant;
    o.timeout = absl::Seconds(30);
    return std::move(*Client::Connect(address.empty() ? d.address() : address, o));
  };
  auto none = client(""), alice = client("alice"), bob = client("bob"), admin = client("admin");

  const Data data = MakeData(300);
  auto session_of = [&](Client& c) {
    auto created = c.CreateSession(Shape());
    EXPECT_OK(created.status());
    EXPECT_OK(c.AppendKV(AllLayers(created->session_id(), data, 0, 300)).status());
    return created->session_id();
  };
  const std::string a = session_of(*alice), b = session_of(*bob);
  ASSERT_OK_AND_ASSIGN(auto chunks, alice->ListChunks([&] {
    v1::ListChunksRequest r;
    r.set_session_id(a);
    return r;
  }()));
  ASSERT_GT(chunks.chunks_size(), 0);
  const uint64_t chunk = chunks.chunks(0).chunk_id();

  using Call = std::function<absl::Status(Client&)>;
  struct Row {
    const char* rpc;
    Call call;
    Code none, alice, bob, admin;
  };
  const Code kOk = Code::kOk, kUnauth = Code::kUnauthenticated, kDenied = Code::kPermissionDenied;
  std::vector<Row> rows = {
      {"CreateSession", [&](Client& c) { return c.CreateSession(Shape()).status(); }, kUnauth, kOk,
       kOk, kOk},
      {"AppendKV", [&](Client& c) { return c.AppendKV(AllLayers(a, data, 0, 16)).status(); },
       kUnauth, kOk, kDenied, kDenied},
      {"Select", [&](Client& c) { return c.Select(Select(a, 3, 128)).status(); }, kUnauth, kOk,
       kDenied, kDenied},
      {"BatchSelect",
       [&](Client& c) {
         v1::BatchSelectRequest r;
         *r.add_requests() = Select(a, 3, 128);
         return c.BatchSelect(r).status();
       },
       kUnauth, kOk, kDenied, kDenied},
      // A lease of alice's: another tenant is told it does not exist.
      {"Release",
       [&](Client& c) {
         auto lease = alice->Select(Select(a, 3, 128));
         if (!lease.ok()) return lease.status();
         absl::Status s = c.Release(lease->lease_id());
         if (!s.ok()) {
           EXPECT_OK(alice->Release(lease->lease_id()));
         }
         return s;
       },
       kUnauth, kOk, Code::kNotFound, Code::kNotFound},
      {"ReadChunks", [&](Client& c) { return c.ReadChunks(a, {chunk}).status(); }, kUnauth, kOk,
       kDenied, kDenied},
      {"ForkSession",
       [&](Client& c) {
         v1::ForkSessionRequest r;
         r.set_session_id(a);
         r.set_num_tokens(100);
         return c.ForkSession(r).status();
       },
       kUnauth, kOk, kDenied, kDenied},
      {"CloseSession",
       [&](Client& c) {
         const std::string victim = session_of(*alice);
         absl::StatusOr<bool> r = c.CloseSession(victim);
         if (r.ok()) {
           EXPECT_TRUE(*r);
         }
         return r.status();
       },
       kUnauth, kOk, kDenied, kOk},
      {"ListSessions", [&](Client& c) { return c.ListSessions().status(); }, kUnauth, kOk, kOk,
       kOk},
      {"DescribeSession", [&](Client& c) { return c.DescribeSession(a).status(); }, kUnauth, kOk,
       kDenied, kOk},
      {"ListChunks",
       [&](Client& c) {
         v1::ListChunksRequest r;
         r.set_session_id(a);
         return c.ListChunks(r).status();
       },
       kUnauth, kOk, kDenied, kOk},
      {"GetTierStats", [&](Client& c) { return c.GetTierStats().status(); }, kUnauth, kOk, kOk,
       kOk},
      {"ListSegments", [&](Client& c) { return c.ListSegments().status(); }, kUnauth, kOk, kOk,
       kOk},
      {"ListLeases", [&](Client& c) { return c.ListLeases().status(); }, kUnauth, kOk, kOk, kOk},
      {"Evict", [&](Client& c) { return c.Evict(a, v1::TIER_DEVICE).status(); }, kUnauth, kOk,
       kDenied, kOk},
      {"SetPolicy",
       [&](Client& c) {
         v1::SessionPolicy p;
         p.set_recent_window(64);
         return c.SetPolicy(a, p).status();
       },
       kUnauth, kOk, kDenied, kOk},
      // The caller's own sessions only, an admin's too (the area is handed to its tenant).
      {"OpenStaging", [&](Client& c) { return c.OpenStaging(a, 4096).status(); }, kUnauth, kOk,
       kDenied, kDenied},
      {"OpenChannel", [&](Client& c) { return c.OpenChannel().status(); }, kUnauth, kOk, kOk, kOk},
      {"Echo", [&](Client& c) { return c.Echo("hi").status(); }, kUnauth, kOk, kOk, kOk},
      {"Attach", [&](Client& c) { return c.WorkerId().status(); }, kUnauth, kOk, kOk, kOk},
      {"Drain (refused)", [&](Client& c) { return c.Drain().status(); }, kUnauth, kDenied, kDenied,
       Code::kOk /* run last, below */},
  };
  for (const Row& r : rows) {
    std::vector<std::pair<Client*, Code>> cells = {
        {none.get(), r.none}, {alice.get(), r.alice}, {bob.get(), r.bob}};
    if (std::string(r.rpc) != "Drain (refused)") cells.push_back({admin.get(), r.admin});
    const char* who[] = {"none", "alice", "bob", "admin"};
    for (size_t i = 0; i < cells.size(); ++i) {
      const absl::Status got = r.call(*cells[i].first);
      EXPECT_EQ(got.code(), cells[i].second) << r.rpc << " as " << who[i] << ": " << got;
    }
  }

  // What each sees: its own sessions and segments, and the admin every tenant's.
  auto tenants_of_sessions = [](Client& c) {
    std::set<std::string> out;
    auto r = c.ListSessions();
    EXPECT_OK(r.status());
    if (r.ok()) {
      for (const auto& s : r->sessions()) out.insert(s.tenant());
    }
    return out;
  };
  auto tenants_of_segments = [](Client& c) {
    std::set<std::string> out;
    auto r = c.ListSegments();
    EXPECT_OK(r.status());
    if (r.ok()) {
      for (const auto& s : r->segments()) out.insert(s.tenant());
    }
    return out;
  };
  EXPECT_EQ(tenants_of_sessions(*alice), (std::set<std::string>{"alice"}));
  EXPECT_EQ(tenants_of_sessions(*bob), (std::set<std::string>{"bob"}));
  EXPECT_EQ(tenants_of_sessions(*admin), (std::set<std::string>{"alice", "bob", "ops"}));
  EXPECT_EQ(tenants_of_segments(*alice), (std::set<std::string>{"alice"}));
  EXPECT_EQ(tenants_of_segments(*bob), (std::set<std::string>{"bob"}));
  EXPECT_TRUE(tenants_of_segments(*admin).contains("bob"));
  EXPECT_TRUE(tenants_of_segments(*admin).contains("alice"));
  // Leases likewise: alice's lease is hers and the admin's to see, never bob's.
  ASSERT_OK_AND_ASSIGN(auto held, alice->Select(Select(a, 3, 128)));
  auto lease_tenants = [&](Client& c) {
    std::set<std::string> out;
    auto r = c.ListLeases(a);
    EXPECT_OK(r.status());
    if (r.ok()) {
      for (const auto& l : r->leases()) {
        if (l.lease_id() == held.lease_id()) out.insert(l.tenant());
      }
    }
    return out;
  };
  EXPECT_EQ(lease_tenants(*alice), (std::set<std::string>{"alice"}));
  EXPECT_TRUE(lease_tenants(*bob).empty());
  EXPECT_EQ(lease_tenants(*admin), (std::set<std::string>{"alice"}));
  ASSERT_OK(alice->Release(held.lease_id()));

  // An admin that names a tenant acts as that tenant only; others may not name another.
  auto as_alice = client("admin", "alice");
  EXPECT_OK(as_alice->Select(Select(a, 3, 128)).status());
  EXPECT_THAT(as_alice->Drain(), StatusIs(Code::kPermissionDenied, "admin credential"));
  EXPECT_THAT(client("bob", "alice")->Select(Select(a, 3, 128)),
              StatusIs(Code::kPermissionDenied, "x-kvtier-tenant"));
  EXPECT_THAT(client("nobody")->ListSessions(),
              StatusIs(Code::kUnauthenticated, "matches no entry of auth.tokens"));

  // TCP: a token or nothing.
  const std::string tcp = absl::StrCat("127.0.0.1:", port);
  EXPECT_THAT(client("", "", tcp)->ListSessions(), StatusIs(Code::kUnauthenticated, "TCP"));
  ASSERT_OK_AND_ASSIGN(auto over_tcp, client("bob", "", tcp)->Select(Select(b, 3, 128)));
  EXPECT_GT(over_tcp.heads_size(), 0);

  // The kvtierctl of an operator: its token file, and its refusals by name.
  const std::string ctl = testing::BinaryPath("kvtierctl") + " --addr " + d.address();
  auto [code, out] = testing::RunCommand(ctl + " --token-file " + dir.path() + "/bob sessions");
  EXPECT_EQ(code, 0) << out;
  EXPECT_NE(out.find(b), std::string::npos) << out;
  EXPECT_EQ(out.find(a), std::string::npos) << out;
  auto [code2, out2] = testing::RunCommand(ctl + " sessions");
  EXPECT_EQ(code2, 1) << out2;
  EXPECT_NE(out2.find("UNAUTHENTICATED"), std::string::npos) << out2;

  // The admin alone drains; the daemon then exits 0.
  ASSERT_OK(admin->Drain().status());
  EXPECT_EQ(d.WaitForExit(20), 0);
}

// A test PKI made here with openssl: CA `name` (ca-<name>.pem, .key), and leaf certificates
// it signs.
class TestPki {
 public:
  explicit TestPki(const std::string& dir) : dir_(dir) {}
  void Ca(const std::string& name) {
    Run("openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 1 "
        "-subj /CN=kvtier-test-" +
        name + " -keyout " + Path("ca-" + name + ".key") + " -out " + Path("ca-" + name + ".pem"));
  }
  // <leaf>.pem and <leaf>.key, subject `subj` ("/O=team-a/CN=alice"), signed by CA `ca`; a
  // server's leaf names 127.0.0.1 and localhost.
  void Leaf(const std::string& leaf, const std::string& subj, const std::string& ca) {
    std::ofstream(Path(leaf + ".ext")) << "subjectAltName=IP:127.0.0.1,DNS:localhost\n";
    Run("openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -subj " + subj +
        " -keyout " + Path(leaf + ".key") + " -out " + Path(leaf + ".csr"));
    Run("openssl x509 -req -days 1 -in " + Path(leaf + ".csr") + " -CA " +
        Path("ca-" + ca + ".pem") + " -CAkey " + Path("ca-" + ca + ".key") +
        " -CAcreateserial -extfile " + Path(leaf + ".ext") + " -out " + Path(leaf + ".pem"));
  }
  std::string Path(const std::string& file) const { return dir_ + "/" + file; }

 private:
  void Run(const std::string& cmd) {
    auto [code, out] = testing::RunCommand(cmd + " 2>&1");
    ASSERT_EQ(code, 0) << cmd << "\n" << out;
  }
  std::string dir_;
};

// TCP is TLS: a client that trusts the daemon's CA and shows a certificate whose subject the
// config maps acts as that tenant; a client without a certificate, with one of another CA,
// speaking plaintext, or not trusting the daemon gets no call through; a subject in no entry is
// UNAUTHENTICATED. A renewed certificate is served after SIGHUP without a restart, and a
// broken one is refused by name while the last good one stays.
TEST(Tls, MutualTlsMapsTheCertificateSubjectToItsTenant) {
  if (access("/usr/bin/openssl", X_OK) != 0) GTEST_SKIP() << "needs openssl";
  TempDir dir;
  TestPki pki(dir.path());
  pki.Ca("a");
  pki.Ca("rogue");
  pki.Leaf("server", "/CN=localhost", "a");
  pki.Leaf("alice", "/O=team-a/CN=alice", "a");
  pki.Leaf("bob", "/O=team-b/CN=bob", "a");
  pki.Leaf("mallory", "/O=team-a/CN=alice", "rogue");  // alice's subject, another CA
  const std::string config = pki.Path("kvtierd.conf");
  std::ofstream(config) << "tls { cert_file: \"" << pki.Path("server.pem") << "\" key_file: \""
                        << pki.Path("server.key") << "\" client_ca_file: \"" << pki.Path("ca-a.pem")
                        << "\" refresh_s: 1 }\n"
                        << "auth { same_uid_by_metadata: \"off\" cert_subjects { subject: "
                           "\"CN=alice,O=team-a\" tenant: \"alice\" } }\n";
  const int port = testing::FreePort();
  const std::string tcp = absl::StrCat("127.0.0.1:", port);
  DaemonProcess d({"--config", config, "--tcp_listen", tcp});
  ASSERT_TRUE(d.started()) << d.Log();
  // The Unix socket comes first; the TCP port follows.
  for (int i = 0; i < 100 && testing::RunCommand("bash -c 'exec 3<>/dev/tcp/127.0.0.1/" +
                                                 std::to_string(port) + "' 2>/dev/null")
                                     .first != 0;
       ++i) {
    absl::SleepFor(absl::Milliseconds(50));
  }
  auto client = [&](const std::string& ca, const std::string& leaf) {
    ClientOptions o;
    o.timeout = absl::Seconds(5);
    if (!ca.empty()) o.tls_ca_file = pki.Path("ca-" + ca + ".pem");
    if (!leaf.empty()) {
      o.tls_cert_file = pki.Path(leaf + ".pem");
      o.tls_key_file = pki.Path(leaf + ".key");
    }
    auto c = Client::Connect(tcp, o);
    EXPECT_OK(c.status());
    return std::move(*c);
  };
  auto alice = client("a", "alice");
  ASSERT_OK_AND_ASSIGN(auto created, alice->CreateSession(Shape()));
  ASSERT_OK_AND_ASSIGN(auto listed, alice->ListSessions());
  ASSERT_EQ(listed.sessions_size(), 1);
  EXPECT_EQ(listed.sessions(0).tenant(), "alice");
  EXPECT_THAT(client("a", "bob")->ListSessions(),
              StatusIs(Code::kUnauthenticated, "\"CN=bob,O=team-b\" is in no entry"));
  for (const auto& [ca, leaf] : std::vector<std::pair<std::string, std::string>>{
           {"a", ""}, {"a", "mallory"}, {"rogue", "alice"}, {"", ""}}) {
    EXPECT_THAT(client(ca, leaf)->Echo("x"), StatusIs(Code::kUnavailable))
        << "ca " << ca << " leaf " << leaf;
  }
  // The Unix socket is not TLS, and there this process's uid has no entry.
  EXPECT_THAT(Connect(d)->Echo("x"), StatusIs(Code::kUnauthenticated, "auth.unix_peers"));

  // Renewal: a certificate of another CA written over the files is served after SIGHUP.
  pki.Ca("b");
  pki.Leaf("renewed", "/CN=localhost", "b");
  ASSERT_EQ(testing::RunCommand("cp " + pki.Path("renewed.key") + " " + pki.Path("server.key") +
                                " && cp " + pki.Path("renewed.pem") + " " + pki.Path("server.pem"))
                .first,
            0);
  ASSERT_EQ(kill(d.pid(), SIGHUP), 0);
  absl::Status renewed = absl::UnknownError("not tried");
  for (int i = 0; i < 50 && !renewed.ok(); ++i) {
    absl::SleepFor(absl::Milliseconds(200));
    renewed = client("b", "alice")->Echo("x").status();
  }
  EXPECT_OK(renewed);
  EXPECT_THAT(client("a", "alice")->Echo("x"), StatusIs(Code::kUnavailable));  // the old CA's
  // A broken key file: SIGHUP says so by field, and the last good certificate stays served.
  std::ofstream(pki.Path("server.key")) << "not a key\n";
  ASSERT_EQ(kill(d.pid(), SIGHUP), 0);
  absl::SleepFor(absl::Milliseconds(2500));
  EXPECT_NE(d.Log().find("tls.reload"), std::string::npos) << d.Log();
  EXPECT_NE(d.Log().find("tls.key_file"), std::string::npos) << d.Log();
  EXPECT_OK(client("b", "alice")->Echo("x").status()) << d.Log();
}

// TCP without TLS is a start-up error unless plaintext is asked for; bad TLS files are named.
TEST(Tls, ATcpListenerNeedsTlsOrTheExplicitFlag) {
  TempDir dir;
  TestPki pki(dir.path());
  pki.Ca("a");
  pki.Leaf("server", "/CN=localhost", "a");
  pki.Leaf("other", "/CN=localhost", "a");
  const std::string tcp = absl::StrCat("127.0.0.1:", testing::FreePort());
  auto start = [&](const std::string& config, const std::vector<std::string>& flags) {
    std::ofstream(pki.Path("c.conf")) << config;
    std::string cmd = testing::BinaryPath("kvtierd") + " --listen unix:" + pki.Path("s.sock") +
                      " --instance tls-" + std::to_string(getpid()) + " --config " +
                      pki.Path("c.conf");
    for (const std::string& f : flags) cmd += " " + f;
    return testing::RunCommand(cmd + " 2>&1");
  };
  auto [code, out] = start("", {"--tcp_listen", tcp});
  EXPECT_EQ(code, 2) << out;
  EXPECT_NE(out.find("tcp_listen"), std::string::npos) << out;
  EXPECT_NE(out.find("--tcp_plaintext on"), std::string::npos) << out;
  const std::string mismatched = "tls { cert_file: \"" + pki.Path("server.pem") +
                                 "\" key_file: \"" + pki.Path("other.key") + "\" }";
  auto [code2, out2] = start(mismatched, {"--tcp_listen", tcp});
  EXPECT_EQ(code2, 2) << out2;
  EXPECT_NE(out2.find("tls.key_file"), std::string::npos) << out2;
  auto [code3, out3] = start("auth { cert_subjects { subject: \"CN=x\" tenant: \"x\" } }",
                             {"--tcp_listen", tcp, "--tcp_plaintext", "on"});
  EXPECT_EQ(code3, 2) << out3;
  EXPECT_NE(out3.find("tls.client_ca_file"), std::string::npos) << out3;
  DaemonProcess plain({"--tcp_listen", tcp, "--tcp_plaintext", "on"});
  EXPECT_TRUE(plain.started()) << plain.Log();
}

TEST(Kvtierctl, TablesJsonAndErrors) {
  DaemonProcess d;
  ASSERT_TRUE(d.started());
  auto c = Connect(d);
  auto req = Shape();
  req.set_session_id("ctl-session");
  ASSERT_OK(c->CreateSession(req).status());
  ASSERT_OK(c->AppendKV(AllLayers("ctl-session", MakeData(40), 0, 40)).status());
  const std::string ctl = testing::BinaryPath("kvtierctl") + " --addr " + d.address() + " ";
  auto [code, out] = testing::RunCommand(ctl + "health");
  EXPECT_EQ(code, 0);
  EXPECT_EQ(out, "SERVING\n");
  std::tie(code, out) = testing::RunCommand(ctl + "sessions");
  EXPECT_EQ(code, 0);
  EXPECT_NE(out.find("ctl-session"), std::string::npos) << out;
  EXPECT_NE(out.find("144.0 KiB"), std::string::npos)
      << out;  // 4 layers x 3 heads x 3 slots x 4 KiB
  std::tie(code, out) = testing::RunCommand(ctl + "-o json session ctl-session");
  EXPECT_EQ(code, 0);
  EXPECT_NE(out.find("\"num_tokens\": \"40\""), std::string::npos) << out;
  v1::SessionPolicy refine;
  refine.set_refine_factor(8);
  refine.set_refine_score(v1::REFINE_SCORE_MAX);
  refine.set_mass_target(0.95f);
  refine.set_layer_budget(v1::LAYER_BUDGET_BY_NEED);
  ASSERT_OK(c->SetPolicy("ctl-session", refine).status());
  std::tie(code, out) = testing::RunCommand(ctl + "session ctl-session");
  EXPECT_EQ(code, 0);
  EXPECT_NE(out.find("rows from a pool of 8x the budget, by max, mass target 0.95, layer "
                     "budgets by need"),
            std::string::npos)
      << out;
  EXPECT_NE(out.find("NEED"), std::string::npos) << out;  // and the layers' needs and shares
  EXPECT_NE(out.find("aging backlog"), std::string::npos) << out;
  EXPECT_NE(out.find("1.00x"), std::string::npos) << out;
  std::tie(code, out) = testing::RunCommand(ctl + "chunks ctl-session --layer 1");
  EXPECT_EQ(code, 0);
  EXPECT_NE(out.find("32..39"), std::string::npos) << out;
  std::tie(code, out) = testing::RunCommand(ctl + "tiers");
  EXPECT_NE(out.find("device (emulated)"), std::string::npos) << out;
  std::tie(code, out) = testing::RunCommand(ctl + "segments");
  EXPECT_NE(out.find("/kvtier-" + d.instance() + "-host-"), std::string::npos) << out;
  std::tie(code, out) = testing::RunCommand(ctl + "session no-such");
  EXPECT_EQ(code, 1);
  EXPECT_NE(out.find("NOT_FOUND"), std::string::npos) << out;
  EXPECT_NE(out.find("no-such"), std::string::npos) << out;
  std::tie(code, out) = testing::RunCommand(ctl + "close ctl-session");
  EXPECT_EQ(code, 0);
  EXPECT_EQ(out, "closed ctl-session\n");
  std::tie(code, out) = testing::RunCommand(ctl + "frobnicate");
  EXPECT_EQ(code, 2);
}

// MoveSession relays ExportSession's parts from one daemon into ImportSession on another:
// every chunk arrives with its bytes, the copy takes appends, and the source is untouched.
TEST(Daemon, AMovedSessionHasEveryChunkOnTheOtherDaemon) {
  DaemonProcess a, b;
  ASSERT_TRUE(a.started() && b.started());
  auto from = Connect(a), to = Connect(b);
  const Data data = MakeData(700);
  ASSERT_OK_AND_ASSIGN(auto created, from->CreateSession(Shape()));
  const std::string sid = created.session_id();
  ASSERT_OK(from->AppendKV(AllLayers(sid, data, 0, 700)).status());

  ASSERT_OK_AND_ASSIGN(auto moved, from->MoveSession(sid, *to, "moved"));
  EXPECT_EQ(moved.session_id(), "moved");
  v1::ListChunksRequest list;
  list.set_session_id("moved");
  list.set_limit(100000);
  ASSERT_OK_AND_ASSIGN(auto chunks, to->ListChunks(list));
  std::vector<uint64_t> ids;
  for (const auto& c : chunks.chunks()) ids.push_back(c.chunk_id());
  EXPECT_EQ(ids.size(), size_t(kLayers) * kKv * ((700 + 15) / 16));
  ASSERT_OK_AND_ASSIGN(auto there, to->ReadChunks("moved", ids));
  ASSERT_EQ(there.size(), ids.size());
  for (const auto& h : there) {
    const int64_t p0 = h.positions(0);
    const auto want = Slice(data.k[h.layer()], kKv, 700, kD, p0, h.num_tokens());
    const size_t off = size_t(h.kv_head()) * h.num_tokens() * kD;
    EXPECT_EQ(h.keys(), std::string(reinterpret_cast<const char*>(want.data() + off),
                                    size_t(h.num_tokens()) * kD * 2));
  }
  ASSERT_OK_AND_ASSIGN(uint64_t stored, to->AppendKV(AllLayers("moved", MakeData(720), 700, 20)));
  EXPECT_EQ(stored, 720u);
  ASSERT_OK_AND_ASSIGN(auto source, from->DescribeSession(sid));
  EXPECT_EQ(source.info().num_tokens(), 700u);

  EXPECT_THAT(from->MoveSession(sid, *to, "moved"), StatusIs(Code::kAlreadyExists, "moved"));
  EXPECT_THAT(from->MoveSession("no-such", *to), StatusIs(Code::kNotFound, "no-such"));
  ASSERT_OK_AND_ASSIGN(auto listed, to->ListSessions());
  ASSERT_EQ(listed.sessions_size(), 1);
  EXPECT_EQ(listed.sessions(0).session_id(), "moved");
}

// A process stopped (SIGSTOP) until Resume or the guard goes, and at most `at_most`: a call
// that waits for it (the hang a test looks for) then ends, and fails the test's time check,
// instead of holding the test for good.
class Stopped {
 public:
  Stopped(int pid, absl::Duration at_most) : pid_(pid) {
    EXPECT_EQ(kill(pid, SIGSTOP), 0);
    watchdog_ = std::thread([this, at_most] {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait_for(lock, absl::ToChronoNanoseconds(at_most), [&] { return resumed_; });
      kill(pid_, SIGCONT);
    });
  }
  ~Stopped() { Resume(); }
  void Resume() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      resumed_ = true;
    }
    cv_.notify_all();
    if (watchdog_.joinable()) watchdog_.join();
  }

 private:
  const int pid_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool resumed_ = false;
  std::thread watchdog_;
};

// A move's timeout bounds the wait for each part, not the whole move (which grows with the
// session): one that takes longer than the timeout, its parts coming within it, completes.
// Before, the whole move ran under one deadline, and a large session could never be moved.
// Two daemons, a client of each with a 1 s timeout, and a session of `tokens` tokens on the
// first (`sid`, empty when any step failed).
struct MoveBetween {
  explicit MoveBetween(int tokens) {
    EXPECT_TRUE(a.started() && b.started());
    ClientOptions o;
    o.timeout = absl::Seconds(1);
    auto f = Client::Connect(a.address(), o), t = Client::Connect(b.address(), o);
    if (!f.ok() || !t.ok()) return;
    from = *std::move(f);
    to = *std::move(t);
    auto created = from->CreateSession(Shape());
    if (!created.ok()) return;
    if (from->AppendKV(AllLayers(created->session_id(), MakeData(tokens), 0, tokens)).ok()) {
      sid = created->session_id();
    }
  }
  DaemonProcess a, b;
  std::unique_ptr<Client> from, to;
  std::string sid;
};

TEST(Daemon, AMoveLongerThanTheTimeoutGoesOnWhileItsPartsMove) {
  MoveBetween m(700);
  ASSERT_FALSE(m.sid.empty());
  Client* from = m.from.get();
  Client* to = m.to.get();
  const std::string& sid = m.sid;
  std::vector<std::pair<uint64_t, uint64_t>> seen;  // (parts, bytes) after each part
  ASSERT_OK_AND_ASSIGN(auto moved, from->MoveSession(sid, *to, "slow", v1::CHUNK_CARRIER_PARTS,
                                                     [&](uint64_t parts, uint64_t bytes) {
                                                       seen.emplace_back(parts, bytes);
                                                       absl::SleepFor(absl::Milliseconds(400));
                                                     }));
  EXPECT_EQ(moved.session_id(), "slow");
  // At least four parts, each followed by 400 ms: the move took 1.6 s or more.
  ASSERT_GE(seen.size(), 4u);
  for (size_t i = 0; i < seen.size(); ++i) {
    EXPECT_EQ(seen[i].first, i + 1);
    if (i > 0) {
      EXPECT_GT(seen[i].second, seen[i - 1].second) << i;
    }
  }
  EXPECT_GT(seen.back().second, uint64_t{700} * kLayers * kKv * kD * 2 * 2);  // K and V, fp16
  ASSERT_OK_AND_ASSIGN(auto there, to->DescribeSession("slow"));
  EXPECT_EQ(there.info().num_tokens(), 700u);
}

// A move whose daemon stalls (here: the importing one stopped) ends DEADLINE_EXCEEDED once
// nothing has moved for the timeout, and nothing is imported. Before, it never ended: a write
// into a connection whose peer stopped reading completes only when the peer reads, and the
// call's deadline did not end the wait for it.
TEST(Daemon, AMoveWhoseDaemonStallsEndsAfterTheTimeout) {
  MoveBetween m(1500);
  ASSERT_FALSE(m.sid.empty());
  Client* from = m.from.get();
  Client* to = m.to.get();
  const std::string& sid = m.sid;
  DaemonProcess& b = m.b;
  ASSERT_OK(to->ListSessions().status());  // its connection made
  Stopped stopped(b.pid(), absl::Seconds(10));
  const absl::Time t0 = absl::Now();
  EXPECT_THAT(from->MoveSession(sid, *to, "stalled"),
              StatusIs(Code::kDeadlineExceeded, "nothing moved for 1s"));
  EXPECT_LT(absl::Now() - t0, absl::Seconds(8));
  stopped.Resume();
  // Asked with the longer default timeout: the daemon first reads what the move left it.
  ASSERT_OK_AND_ASSIGN(auto listed, Connect(b)->ListSessions());
  EXPECT_EQ(listed.sessions_size(), 0);
}

// A move whose mover stops between parts (here: in its progress callback, 2.5 s) is ended by
// the daemons once it has waited on its caller for --transfer_idle_timeout_ms (1 s): the move
// fails CANCELLED, nothing is imported, and the next move goes through. Before, a stuck mover
// held the exporter's copy and the importer's parts for as long as it lived.
TEST(Daemon, AMoveWhoseMoverStopsIsCancelledByTheDaemons) {
  DaemonProcess a({"--transfer_idle_timeout_ms", "1000"});
  DaemonProcess b({"--transfer_idle_timeout_ms", "1000"});
  ASSERT_TRUE(a.started() && b.started());
  auto from = Connect(a), to = Connect(b);
  ASSERT_OK_AND_ASSIGN(auto created, from->CreateSession(Shape()));
  const std::string sid = created.session_id();
  ASSERT_OK(from->AppendKV(AllLayers(sid, MakeData(1500), 0, 1500)).status());
  bool slept = false;
  EXPECT_THAT(from->MoveSession(sid, *to, "stuck", v1::CHUNK_CARRIER_PARTS,
                                [&](uint64_t, uint64_t) {
                                  if (!std::exchange(slept, true)) {
                                    absl::SleepFor(absl::Milliseconds(2500));
                                  }
                                }),
              StatusIs(Code::kCancelled));
  EXPECT_TRUE(slept);
  ASSERT_OK_AND_ASSIGN(auto listed, to->ListSessions());
  EXPECT_EQ(listed.sessions_size(), 0);
  ASSERT_OK_AND_ASSIGN(auto moved, from->MoveSession(sid, *to, "moved"));
  EXPECT_EQ(moved.session_id(), "moved");
}

// An AppendKV stream into a daemon that stopped reading ends DEADLINE_EXCEEDED about a second
// past the client's timeout. Before, it waited for as long as the daemon was stopped: a write
// into a connection whose peer stopped reading ends only when the peer reads, and the call's
// deadline did not end the blocking client's wait for it. The daemon then takes appends again.
TEST(Daemon, AnAppendToAStalledDaemonEndsPastTheTimeout) {
  DaemonProcess d;
  ASSERT_TRUE(d.started());
  ClientOptions o;
  o.timeout = absl::Seconds(1);
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Client> c, Client::Connect(d.address(), o));
  ASSERT_OK_AND_ASSIGN(auto created, c->CreateSession(Shape()));
  Stopped stopped(d.pid(), absl::Seconds(10));
  const absl::Time t0 = absl::Now();
  EXPECT_THAT(c->AppendKV(AllLayers(created.session_id(), MakeData(1500), 0, 1500)),
              StatusIs(Code::kDeadlineExceeded));
  EXPECT_LT(absl::Now() - t0, absl::Seconds(8));
  stopped.Resume();
  // With the longer default timeout: the daemon first reads what the append left it.
  std::unique_ptr<Client> after = Connect(d);
  ASSERT_OK_AND_ASSIGN(auto other, after->CreateSession(Shape()));
  ASSERT_OK_AND_ASSIGN(uint64_t stored,
                       after->AppendKV(AllLayers(other.session_id(), MakeData(32), 0, 32)));
  EXPECT_EQ(stored, 32u);
}

// Whether process `pid` still runs: gone, or a zombie nobody reaped yet, is not running.
bool Runs(int pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(stat, line)) return false;
  const size_t close = line.rfind(')');  // "pid (comm) state ..."
  return close != std::string::npos && close + 2 < line.size() && line[close + 2] != 'Z';
}

// A test or benchmark killed midway takes its daemon with it: the process that made a
// LocalDaemon is killed by SIGKILL (no destructor runs) and the daemon ends by itself. The
// process is a clean re-run of this test binary (a threadsafe death test), which writes the
// daemon's pid to a file this test names in the environment the re-run inherits.
TEST(LocalDaemon, EndsWhenTheProcessThatMadeItIsKilled) {
  constexpr char kPidFile[] = "KVTIER_TEST_DAEMON_PID_FILE";
  const char* given = getenv(kPidFile);  // set: this is the re-run
  const std::string pid_file =
      given != nullptr ? given : "/tmp/kvtier-test-daemon-" + std::to_string(getpid()) + ".pid";
  setenv(kPidFile, pid_file.c_str(), 1);
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        DaemonProcess d;
        std::ofstream(pid_file) << (d.started() ? d.pid() : -1) << "\n";
        raise(SIGKILL);
      },
      ::testing::KilledBySignal(SIGKILL), "");
  unsetenv(kPidFile);
  int pid = -1;
  std::ifstream(pid_file) >> pid;
  std::remove(pid_file.c_str());
  ASSERT_GT(pid, 0) << "the daemon did not start";
  bool runs = true;
  for (int i = 0; i < 300 && runs; ++i) {  // up to 30 s: a drain on a loaded machine
    runs = Runs(pid);
    if (runs) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_FALSE(runs) << "kvtierd " << pid << " outlived the process that made it";
  if (runs) kill(pid, SIGKILL);
}

}  // namespace
}  // namespace kvtier
