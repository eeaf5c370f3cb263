// The GPU path on a GPU (skipped, with a message, where this process can use no CUDA device;
// the CPU twins are tier_test's and session_test's device-memory tests): device memory written
// and read back exactly, read by another process through its CUDA IPC handle, and a kvtierd on
// --device 0 whose device-placed Select hands out handles a worker maps and reads exactly; a
// promotion batch bit-identical to the CPU references; the crash test of device leases.
#include "server/transfer/gpu.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <random>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "kernels/quant.h"
#include "kvtier/client.h"
#include "kvtier/cuda_segments.h"
#include "server/common/fp16.h"
#include "server/common/status_macros.h"
#include "server/transfer/device_fill.h"
#include "tests/test_util.h"

namespace kvtier {
namespace {

using Code = absl::StatusCode;

// Where this process can use no CUDA device: skipped, saying why.
#define KVTIER_SKIP_WITHOUT_GPU()                                          \
  if (absl::StatusOr<std::vector<GpuInfo>> gpus = ProbeGpus(); !gpus.ok()) \
  GTEST_SKIP() << "no CUDA device (" << gpus.status().message()            \
               << "): the GPU path's CPU twins (tier_test, session_test) run instead"

std::vector<uint8_t> Pattern(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> out(n);
  for (auto& b : out) b = static_cast<uint8_t>(rng());
  return out;
}

v1::CreateSessionRequest SmallSession() {
  v1::CreateSessionRequest create;
  create.mutable_shape()->set_num_layers(1);
  create.mutable_shape()->set_num_q_heads(2);
  create.mutable_shape()->set_num_kv_heads(1);
  create.mutable_shape()->set_head_dim(64);
  create.mutable_shape()->set_dtype(v1::DTYPE_FP16);
  create.mutable_policy()->set_lossless(true);
  return create;
}

// K and V of one KV head, [tokens][64] each, appended at token 0 of layer 0, inline.
absl::Status AppendRows(Client& c, const std::string& sid, const std::vector<uint16_t>& k,
                        const std::vector<uint16_t>& v) {
  v1::AppendKVRequest a;
  a.set_session_id(sid);
  a.set_num_tokens(static_cast<uint32_t>(k.size() / 64));
  a.set_keys(reinterpret_cast<const char*>(k.data()), k.size() * 2);
  a.set_values(reinterpret_cast<const char*>(v.data()), v.size() * 2);
  return c.AppendKV({a}).status();
}

v1::SelectRequest DeviceSelect(const std::string& sid) {
  v1::SelectRequest s;
  s.set_session_id(sid);
  std::vector<float> q(2 * 64, 0.5f);
  s.set_query(reinterpret_cast<const char*>(q.data()), q.size() * 4);
  s.set_budget_tokens(256);
  s.set_placement(v1::TIER_DEVICE);
  s.set_lease_ms(600'000);
  return s;
}

TEST(GpuMemory, BytesWrittenAreReadBackExactlyAndPastTheEndIsRefused) {
  KVTIER_SKIP_WITHOUT_GPU();
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<DeviceMemory> m, AllocateGpuMemory(0, 3 << 20));
  EXPECT_EQ(m->ipc_handle().size(), kCudaIpcHandleBytes);
  const std::vector<uint8_t> bytes = Pattern(1 << 20, 1);
  ASSERT_OK(m->Write(12345, bytes.data(), bytes.size()));
  std::vector<uint8_t> back(bytes.size());
  ASSERT_OK(m->Read(12345, back.data(), back.size()));
  EXPECT_EQ(back, bytes);
  EXPECT_THAT(m->Write((3 << 20) - 10, bytes.data(), 11),
              testing::StatusIs(Code::kInvalidArgument, "pass"));
  EXPECT_THAT(AllocateGpuMemory(0, uint64_t{1} << 50), testing::StatusIs(Code::kResourceExhausted));
}

// A promotion batch on the GPU (pinned staging, one copy, the gather and dequantize kernels)
// fills its slots with the same bytes as the CPU reference path: fp16 chunks and int4 and int8
// chunks of odd sizes (1, 3, 7, 17 tokens; d 64 and 128) at scattered offsets.
TEST(GpuMemory, APromotionBatchIsBitIdenticalToTheCpuReferences) {
  KVTIER_SKIP_WITHOUT_GPU();
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<DeviceMemory> batched, AllocateGpuMemory(0, 8 << 20));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<DeviceMemory> reference, AllocateGpuMemory(0, 8 << 20));
  std::mt19937 rng(11);
  std::normal_distribution<float> g(0, 1);
  std::vector<std::vector<uint8_t>> sources;
  std::vector<DeviceFill> on_gpu, on_host;
  uint64_t at = 0;
  uint64_t id = 0;
  for (uint32_t d : {64u, 128u}) {
    for (uint32_t n : {1u, 3u, 7u, 17u}) {
      for (uint32_t bits : {0u, 4u, 8u}) {  // 0: fp16
        std::vector<uint16_t> rows(2 * n * d);
        for (auto& h : rows) h = FloatToHalf(g(rng));
        std::optional<QuantLayout> q;
        std::vector<uint8_t> src(rows.size() * 2);
        std::memcpy(src.data(), rows.data(), src.size());
        if (bits != 0) {
          q = QuantLayout{d, n, bits};
          src.assign(q->Bytes(), 0);
          QuantizeChunkReference(rows.data(), rows.data() + n * d, *q, src.data());
        }
        sources.push_back(std::move(src));
        const std::vector<uint8_t>& s = sources.back();
        on_gpu.push_back({batched.get(), at, s.data(), s.size(), q, ++id});
        on_host.push_back({reference.get(), at, s.data(), s.size(), q, id});
        at += 2 * n * d * 2 + 4096 * (id % 3);  // scattered
      }
    }
  }
  ASSERT_OK(FillDevice(on_gpu));
  ASSERT_OK(FillDeviceOnHost(on_host));
  std::vector<uint8_t> a(at), b(at);
  ASSERT_OK(batched->Read(0, a.data(), at));
  ASSERT_OK(reference->Read(0, b.data(), at));
  for (const DeviceFill& f : on_gpu) {
    const uint64_t bytes =
        f.quantized ? 4ull * f.quantized->num_tokens * f.quantized->head_dim : f.src_bytes;
    EXPECT_TRUE(
        std::equal(a.begin() + f.offset, a.begin() + f.offset + bytes, b.begin() + f.offset))
        << "chunk " << f.chunk_id;
  }
}

// The child side of the IPC test: run by the parent as this binary with the handle in the
// environment; skipped when run on its own.
TEST(GpuIpc, ChildReadsTheParentsBytes) {
  const char* hex = std::getenv("KVTIER_IPC_HANDLE");
  if (hex == nullptr) GTEST_SKIP() << "run by GpuIpc.AnotherProcessReadsThroughTheHandle";
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<GpuMapping> m,
                       GpuMapping::Open(0, absl::HexStringToBytes(hex)));
  const std::vector<uint8_t> want = Pattern(1 << 20, 2);
  std::vector<uint8_t> got(want.size());
  ASSERT_OK(m->Read(0, got.data(), got.size()));
  EXPECT_EQ(got, want);
}

TEST(GpuIpc, AnotherProcessReadsThroughTheHandle) {
  KVTIER_SKIP_WITHOUT_GPU();
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<DeviceMemory> m, AllocateGpuMemory(0, 1 << 20));
  const std::vector<uint8_t> bytes = Pattern(1 << 20, 2);
  ASSERT_OK(m->Write(0, bytes.data(), bytes.size()));
  auto [code, out] = testing::RunCommand(
      "KVTIER_IPC_HANDLE=" + absl::BytesToHexString(m->ipc_handle()) + " " +
      BinaryPath("gpu_path_gpu_test") + " --gtest_filter=GpuIpc.ChildReadsTheParentsBytes 2>&1");
  EXPECT_EQ(code, 0) << out;
  EXPECT_NE(out.find("[  PASSED  ] 1 test"), std::string::npos) << out;
}

// kvtierd on the GPU: a Select placed on the device tier names a device segment whose IPC
// handle this process (the worker) opens; the bytes at the handle's offset are the appended
// ones, the same as the inline copy.
TEST(GpuDaemon, DeviceHandlesAreReadThroughCudaIpcExactly) {
  KVTIER_SKIP_WITHOUT_GPU();
  LocalDaemon d("gpu", {"--device", "0", "--retained_segment_size", "0"});
  ASSERT_TRUE(d.started());
  ASSERT_OK_AND_ASSIGN(auto c, Client::Connect(d.address()));
  v1::CreateSessionRequest create = SmallSession();
  create.mutable_policy()->set_chunking(v1::CHUNKING_CONTIGUOUS);
  create.mutable_policy()->set_refine_factor(1);
  ASSERT_OK_AND_ASSIGN(auto session, c->CreateSession(create));
  std::mt19937 rng(5);
  std::vector<uint16_t> k(256 * 64), v(256 * 64);
  for (auto& x : k) x = static_cast<uint16_t>(rng() & 0x3bff);
  for (auto& x : v) x = static_cast<uint16_t>(rng() & 0x3bff);
  ASSERT_OK(AppendRows(*c, session.session_id(), k, v));
  v1::SelectRequest s = DeviceSelect(session.session_id());
  s.set_include_data(true);
  ASSERT_OK_AND_ASSIGN(v1::SelectResponse resp, c->Select(s));
  // Through the raw IPC handle (GpuMapping), and through the client's CudaSegments.
  ASSERT_OK_AND_ASSIGN(v1::ListSegmentsResponse segs, c->ListSegments());
  SegmentMap tables;
  CudaSegments gpu(&tables);
  int read = 0;
  for (const v1::BlockHandle& h : resp.heads(0).blocks()) {
    ASSERT_EQ(h.tier(), v1::TIER_DEVICE);
    const v1::Segment* seg = nullptr;
    for (const v1::Segment& x : segs.segments()) {
      if (x.segment_id() == h.segment_id()) seg = &x;
    }
    ASSERT_NE(seg, nullptr) << h.segment_id();
    EXPECT_EQ(seg->device(), 0);
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<GpuMapping> m,
                         GpuMapping::Open(0, seg->cuda_ipc_handle()));
    std::string bytes(h.length(), '\0');
    ASSERT_OK(m->Read(h.offset(), bytes.data(), bytes.size()));
    EXPECT_EQ(bytes, h.keys() + h.values());
    const size_t at = h.positions(0) * 64 * 2, n = h.keys().size();
    EXPECT_EQ(h.keys(), std::string(reinterpret_cast<const char*>(k.data()) + at, n));
    EXPECT_EQ(h.values(), std::string(reinterpret_cast<const char*>(v.data()) + at, n));
    ASSERT_OK_AND_ASSIGN(CudaChunk chunk, gpu.View(*c, h));
    std::string keys(chunk.bytes, '\0'), values(chunk.bytes, '\0');
    ASSERT_EQ(cudaMemcpy(keys.data(), chunk.keys, chunk.bytes, cudaMemcpyDeviceToHost),
              cudaSuccess);
    ASSERT_EQ(cudaMemcpy(values.data(), chunk.values, chunk.bytes, cudaMemcpyDeviceToHost),
              cudaSuccess);
    EXPECT_EQ(keys, h.keys());
    EXPECT_EQ(values, h.values());
    EXPECT_OK(tables.Recheck(h));
    EXPECT_THAT(tables.View(*c, h), testing::StatusIs(Code::kFailedPrecondition, "CUDA device"));
    ++read;
  }
  EXPECT_EQ(read, 16);        // 256 tokens, 16-token chunks
  EXPECT_EQ(gpu.open(), 1u);  // one segment, opened once
  // The copies evicted and the segment released: stale handles, and Prune closes it.
  ASSERT_OK(c->Release(resp.lease_id()));
  ASSERT_OK(c->Evict(session.session_id(), v1::TIER_DEVICE).status());
  EXPECT_FALSE(tables.Recheck(resp.heads(0).blocks(0)).ok());
  ASSERT_OK(gpu.Prune(*c));
  EXPECT_EQ(gpu.open(), 0u);
}

// GPU ingest: the worker's K and V in its own device memory, named by CUDA IPC handle, are
// stored exactly (read back by ReadChunks); a range past the allocation is that append's
// error, naming the field, and stores nothing.
TEST(GpuDaemon, AppendsFromTheWorkersDeviceMemoryAreStoredExactly) {
  KVTIER_SKIP_WITHOUT_GPU();
  LocalDaemon d("gpuingest", {"--device", "0"});
  ASSERT_TRUE(d.started());
  ASSERT_OK_AND_ASSIGN(auto c, Client::Connect(d.address()));
  v1::CreateSessionRequest create = SmallSession();
  create.mutable_policy()->set_chunking(v1::CHUNKING_CONTIGUOUS);
  ASSERT_OK_AND_ASSIGN(auto session, c->CreateSession(create));
  const std::vector<uint8_t> kv = Pattern(2 * 256 * 64 * 2, 9);  // K then V, [256][64] each
  std::vector<uint8_t> finite(kv.size());
  for (size_t i = 0; i < kv.size(); i += 2) {  // finite fp16: no exponent of all ones
    finite[i] = kv[i];
    finite[i + 1] = kv[i + 1] & 0x3b;
  }
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<DeviceMemory> buffer, AllocateGpuMemory(0, 1 << 20));
  ASSERT_OK(buffer->Write(4096, finite.data(), finite.size()));
  v1::AppendKVRequest a;
  a.set_session_id(session.session_id());
  a.set_num_tokens(256);
  a.mutable_device()->set_cuda_ipc_handle(buffer->ipc_handle());
  a.mutable_device()->set_keys_offset(4096);
  a.mutable_device()->set_values_offset(4096 + finite.size() / 2);
  ASSERT_OK(c->AppendKV({a}).status());
  v1::ListChunksRequest list;
  list.set_session_id(session.session_id());
  ASSERT_OK_AND_ASSIGN(v1::ListChunksResponse listed, c->ListChunks(list));
  std::vector<uint64_t> ids;
  for (const v1::ChunkInfo& info : listed.chunks()) ids.push_back(info.chunk_id());
  ASSERT_OK_AND_ASSIGN(std::vector<v1::BlockHandle> chunks,
                       c->ReadChunks(session.session_id(), ids));
  std::string k, v;
  for (const v1::BlockHandle& h : chunks) {
    k += h.keys();
    v += h.values();
  }
  const std::string want(reinterpret_cast<const char*>(finite.data()), finite.size());
  EXPECT_EQ(k + v, want);
  a.set_start_token(256);
  a.mutable_device()->set_keys_offset((1 << 20) - 100);
  EXPECT_THAT(c->AppendKV({a}), testing::StatusIs(Code::kInvalidArgument, "device.keys_offset"));
  ASSERT_OK_AND_ASSIGN(auto described, c->DescribeSession(session.session_id()));
  EXPECT_EQ(described.info().num_tokens(), 256u);
}

// A session moved GPU to GPU with NCCL: two daemons on the same device, each told it is on
// its own host (NCCL_HOSTID, read when a daemon starts: NCCL refuses two ranks of one host on
// one GPU), so that NCCL carries the chunks between them over its network transport. Every
// chunk arrives byte for byte, and the parts through this client held no chunk data.
TEST(GpuDaemon, ASessionMovesBetweenDaemonsOverNcclExactly) {
  KVTIER_SKIP_WITHOUT_GPU();
  // NCCL's socket transport on the loopback interface, whatever else the machine has.
  setenv("NCCL_SOCKET_IFNAME", "lo", 1);
  setenv("NCCL_IB_DISABLE", "1", 1);
  setenv("NCCL_HOSTID", "kvtier-test-export", 1);
  LocalDaemon from("gpunccla", {"--device", "0"});
  setenv("NCCL_HOSTID", "kvtier-test-import", 1);
  LocalDaemon to("gpuncclb", {"--device", "0"});
  for (const char* v : {"NCCL_HOSTID", "NCCL_SOCKET_IFNAME", "NCCL_IB_DISABLE"}) unsetenv(v);
  ASSERT_TRUE(from.started() && to.started());
  ASSERT_OK_AND_ASSIGN(auto a, Client::Connect(from.address()));
  ASSERT_OK_AND_ASSIGN(auto b, Client::Connect(to.address()));
  v1::CreateSessionRequest create = SmallSession();
  create.mutable_policy()->set_lossless(false);  // int4 chunks and fp16 ones
  ASSERT_OK_AND_ASSIGN(auto session, a->CreateSession(create));
  std::vector<uint16_t> k(6000 * 64), v(k.size());
  std::mt19937 rng(5);
  std::normal_distribution<float> normal;
  for (size_t i = 0; i < k.size(); ++i) {
    k[i] = FloatToHalf(normal(rng));
    v[i] = FloatToHalf(normal(rng));
  }
  ASSERT_OK(AppendRows(*a, session.session_id(), k, v));
  auto all_chunks = [](Client& c, const std::string& sid) -> absl::StatusOr<std::string> {
    v1::ListChunksRequest list;
    list.set_session_id(sid);
    list.set_limit(100000);
    ASSIGN_OR_RETURN(v1::ListChunksResponse listed, c.ListChunks(list));
    std::vector<uint64_t> ids;
    std::string out;
    for (const v1::ChunkInfo& info : listed.chunks()) {
      ids.push_back(info.chunk_id());
      out += absl::StrCat(info.chunk_id(), ":", info.precision(), ";");
    }
    ASSIGN_OR_RETURN(std::vector<v1::BlockHandle> chunks, c.ReadChunks(sid, ids));
    for (const v1::BlockHandle& h : chunks) out += h.keys() + h.values();
    return out;
  };
  ASSERT_OK_AND_ASSIGN(const std::string before, all_chunks(*a, session.session_id()));
  ASSERT_OK_AND_ASSIGN(auto moved,
                       a->MoveSession(session.session_id(), *b, "moved", v1::CHUNK_CARRIER_NCCL));
  EXPECT_EQ(moved.session_id(), "moved");
  ASSERT_OK_AND_ASSIGN(const std::string after, all_chunks(*b, "moved"));
  EXPECT_EQ(after.size(), before.size());
  EXPECT_TRUE(after == before) << "the chunks moved over NCCL differ";
}

// The worker of the crash test, run by it as this binary: an attached client holding a lease
// of ten minutes on device copies until it is killed.
TEST(GpuDaemon, WorkerHoldsADeviceLease) {
  const char* address = std::getenv("KVTIER_WORKER_ADDRESS");
  if (address == nullptr) GTEST_SKIP() << "run by GpuDaemon.AKilledWorkersDeviceLeasesEnd";
  ASSERT_OK_AND_ASSIGN(auto c, Client::Connect(address));
  ASSERT_OK_AND_ASSIGN(v1::SelectResponse r, c->Select(DeviceSelect(std::getenv("KVTIER_SID"))));
  std::printf("lease %s\n", r.lease_id().c_str());
  std::fflush(stdout);
  pause();
}

v1::TierStats DeviceStats(Client& c) {
  absl::StatusOr<v1::GetTierStatsResponse> r = c.GetTierStats();
  EXPECT_TRUE(r.ok()) << r.status();
  for (const v1::TierStats& t : r->tiers()) {
    if (t.tier() == v1::TIER_DEVICE) return t;
  }
  return {};
}

// The crash test on the GPU (its CPU twin: test_client.py's, on the emulated tier): a worker
// process holding device leases is killed; its leases end with its connection, nothing stays
// pinned, and the device copies are then evicted to the last byte.
TEST(GpuDaemon, AKilledWorkersDeviceLeasesEndAndTheDeviceMemoryComesBack) {
  KVTIER_SKIP_WITHOUT_GPU();
  LocalDaemon d("gpucrash", {"--device", "0", "--lease_ttl_ms", "600"});
  ASSERT_TRUE(d.started());
  ASSERT_OK_AND_ASSIGN(auto c, Client::Connect(d.address()));
  ASSERT_OK_AND_ASSIGN(auto session, c->CreateSession(SmallSession()));
  std::vector<uint16_t> k(1024 * 64, 0x3c00), v(1024 * 64, 0x3800);
  ASSERT_OK(AppendRows(*c, session.session_id(), k, v));
  int out[2];
  ASSERT_EQ(pipe(out), 0);
  const std::string self = BinaryPath("gpu_path_gpu_test");
  const std::string env_address = "KVTIER_WORKER_ADDRESS=" + d.address();
  const std::string env_sid = "KVTIER_SID=" + session.session_id();
  const pid_t worker = fork();
  if (worker == 0) {
    dup2(out[1], 1);
    putenv(const_cast<char*>(env_address.c_str()));
    putenv(const_cast<char*>(env_sid.c_str()));
    execl(self.c_str(), self.c_str(), "--gtest_filter=GpuDaemon.WorkerHoldsADeviceLease",
          static_cast<char*>(nullptr));
    _exit(127);
  }
  close(out[1]);
  std::string line;
  char ch;
  while (read(out[0], &ch, 1) == 1) {
    line += ch;
    if (line.rfind("lease ", 0) == 0 && ch == '\n') break;
  }
  close(out[0]);
  ASSERT_NE(line.find("lease "), std::string::npos) << line;
  EXPECT_GT(DeviceStats(*c).pinned_bytes(), 0u);
  EXPECT_GT(DeviceStats(*c).used_bytes(), 0u);
  kill(worker, SIGKILL);
  waitpid(worker, nullptr, 0);
  for (int i = 0; i < 250 && DeviceStats(*c).pinned_bytes() > 0; ++i) usleep(20'000);
  EXPECT_EQ(DeviceStats(*c).pinned_bytes(), 0u) << "the dead worker's device pins outlived it";
  ASSERT_OK_AND_ASSIGN(uint64_t moved, c->Evict(session.session_id(), v1::TIER_DEVICE));
  EXPECT_GT(moved, 0u);
  EXPECT_EQ(DeviceStats(*c).used_bytes(), 0u);
}

}  // namespace
}  // namespace kvtier
