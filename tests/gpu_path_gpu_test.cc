// The GPU path on a GPU (skipped, with a message, where this process can use no CUDA device;
// the CPU twins are tier_test's and session_test's device-memory tests): device memory written
// and read back exactly, read by another process through its CUDA IPC handle, and a kvtierd on
// --device 0 whose device-placed Select hands out handles a worker maps and reads exactly.
#include "server/transfer/gpu.h"

#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <random>

#include "absl/strings/escaping.h"
#include "kvtier/client.h"
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
  LocalDaemon d("gpu", {"--device", "0"});
  ASSERT_TRUE(d.started());
  ASSERT_OK_AND_ASSIGN(auto c, Client::Connect(d.address()));
  v1::CreateSessionRequest create;
  create.mutable_shape()->set_num_layers(1);
  create.mutable_shape()->set_num_q_heads(2);
  create.mutable_shape()->set_num_kv_heads(1);
  create.mutable_shape()->set_head_dim(64);
  create.mutable_shape()->set_dtype(v1::DTYPE_FP16);
  create.mutable_policy()->set_lossless(true);
  create.mutable_policy()->set_chunking(v1::CHUNKING_CONTIGUOUS);
  create.mutable_policy()->set_refine_factor(1);
  ASSERT_OK_AND_ASSIGN(auto session, c->CreateSession(create));
  std::mt19937 rng(5);
  std::vector<uint16_t> k(256 * 64), v(256 * 64);
  for (auto& x : k) x = static_cast<uint16_t>(rng() & 0x3bff);
  for (auto& x : v) x = static_cast<uint16_t>(rng() & 0x3bff);
  v1::AppendKVRequest a;
  a.set_session_id(session.session_id());
  a.set_num_tokens(256);
  a.set_keys(reinterpret_cast<const char*>(k.data()), k.size() * 2);
  a.set_values(reinterpret_cast<const char*>(v.data()), v.size() * 2);
  ASSERT_OK(c->AppendKV({a}).status());
  v1::SelectRequest s;
  s.set_session_id(session.session_id());
  std::vector<float> q(2 * 64, 0.5f);
  s.set_query(reinterpret_cast<const char*>(q.data()), q.size() * 4);
  s.set_budget_tokens(256);
  s.set_placement(v1::TIER_DEVICE);
  s.set_include_data(true);
  ASSERT_OK_AND_ASSIGN(v1::SelectResponse resp, c->Select(s));
  ASSERT_OK_AND_ASSIGN(v1::ListSegmentsResponse segs, c->ListSegments());
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
    ++read;
  }
  EXPECT_EQ(read, 16);  // 256 tokens, 16-token chunks
}

}  // namespace
}  // namespace kvtier
