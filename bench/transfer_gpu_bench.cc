// GPU: the daemon's promotion to the device tier and a device-placed Select. Prints one JSON
// line per figure, each against a baseline of the same run (median of repetitions):
//   promotion_h2d (int4 and fp16 chunks): FillDevice of a Select's worth of chunks (pinned
//     staging, one copy, gather/dequantize kernels), as GB/s of the bytes moved over PCIe,
//     against a pinned cudaMemcpyAsync of the same bytes;
//   ingest_d2h: AppendKV from the worker's device memory (AppendKVRequest.device; a prefill's
//     K and V of the SmolLM2 shape, 4096 tokens, one stream), acknowledged, against a
//     device-to-host cudaMemcpyAsync of the same bytes into pinned memory;
//   select_device_p50: Select with placement TIER_DEVICE on kvtierd --device 0 (copies cached
//     after the first), against the same Select placed on the host tier.
// Exits 0 printing a note, and no figure, where this process can use no CUDA device.
#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>
#include <random>

#include "bench/bench_util.h"
#include "bench/cuda_check.h"
#include "kernels/quant.h"
#include "kvtier/client.h"
#include "server/common/fp16.h"
#include "server/transfer/device_fill.h"

using namespace kvtier;
using namespace kvtier::bench;

namespace {

void Promotion(bool int4) {
  constexpr uint32_t kD = 128, kN = 16;
  constexpr int kChunks = 2048;  // 32 layers x 8 KV heads x 8 chunks: one step's selection
  const QuantLayout layout{kD, kN, 4};
  const uint64_t fp16_bytes = 2ull * kN * kD * 2;
  const uint64_t src_bytes = int4 ? layout.Bytes() : fp16_bytes;
  std::mt19937 rng(3);
  std::normal_distribution<float> g(0, 1);
  std::vector<uint16_t> rows(2 * kN * kD);
  std::vector<std::vector<uint8_t>> sources(kChunks, std::vector<uint8_t>(src_bytes));
  for (auto& s : sources) {
    for (auto& h : rows) h = FloatToHalf(g(rng));
    if (int4) {
      QuantizeChunkReference(rows.data(), rows.data() + kN * kD, layout, s.data());
    } else {
      std::memcpy(s.data(), rows.data(), src_bytes);
    }
  }
  auto memory = AllocateGpuMemory(0, fp16_bytes * kChunks);
  if (!memory.ok()) std::exit(1);
  std::vector<DeviceFill> fills;
  for (int c = 0; c < kChunks; ++c) {
    fills.push_back({memory->get(), ((c * 7919ull) % kChunks) * fp16_bytes, sources[c].data(),
                     src_bytes, int4 ? std::optional<QuantLayout>(layout) : std::nullopt,
                     uint64_t(c)});
  }
  uint8_t *pinned = nullptr, *device = nullptr;
  const uint64_t total = src_bytes * kChunks;
  CHECK_CUDA(cudaHostAlloc(&pinned, total, cudaHostAllocDefault));
  CHECK_CUDA(cudaMalloc(&device, total));
  for (int c = 0; c < kChunks; ++c)
    std::memcpy(pinned + c * src_bytes, sources[c].data(), src_bytes);
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  std::vector<double> fill_s, copy_s;
  for (int rep = 0; rep < 11; ++rep) {
    double t0 = NowSeconds();
    if (!FillDevice(fills).ok()) std::exit(1);
    double t1 = NowSeconds();
    CHECK_CUDA(cudaMemcpyAsync(device, pinned, total, cudaMemcpyHostToDevice, stream));
    CHECK_CUDA(cudaStreamSynchronize(stream));
    double t2 = NowSeconds();
    if (rep > 0) {  // the first grows the staging
      fill_s.push_back(t1 - t0);
      copy_s.push_back(t2 - t1);
    }
  }
  Print({"promotion_h2d",
         total / Median(fill_s) / 1e9,
         "GB/s",
         total / Median(copy_s) / 1e9,
         "pinned_cudaMemcpyAsync",
         {{"chunks", std::to_string(kChunks)},
          {"head_dim", std::to_string(kD)},
          {"chunk_tokens", std::to_string(kN)},
          {"stored", int4 ? "int4 (dequantized on the device)" : "fp16"},
          {"reps", "10"},
          {"target_ratio", "0.8"}}});
  cudaFreeHost(pinned);
  cudaFree(device);
  cudaStreamDestroy(stream);
}

void IngestDevice() {
  constexpr int kLayers = 30, kKv = 3, kD = 64, kTokens = 4096, kStep = 256;
  const uint64_t half = uint64_t{kKv} * kStep * kD * 2;  // K (or V) of one message
  const uint64_t total = 2 * half * kLayers * (kTokens / kStep);
  auto buffer = AllocateGpuMemory(0, total);
  if (!buffer.ok()) std::exit(1);
  std::mt19937 rng(3);
  std::vector<uint16_t> halfs(total / 2);
  for (auto& h : halfs) h = static_cast<uint16_t>(rng() & 0x3bff);  // finite fp16
  if (!(*buffer)->Write(0, halfs.data(), total).ok()) std::exit(1);
  Daemon d({"--device", "0", "--host_capacity", "4G"});
  auto client = Client::Connect(d.address());
  if (!client.ok()) std::exit(1);
  Client& c = **client;
  uint8_t* pinned = nullptr;
  CHECK_CUDA(cudaHostAlloc(&pinned, total, cudaHostAllocDefault));
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  std::vector<double> ingest_s, copy_s;
  for (int rep = 0; rep < 5; ++rep) {
    auto s = c.CreateSession(SmolLm2Session());
    if (!s.ok()) std::exit(1);
    std::vector<v1::AppendKVRequest> reqs;
    uint64_t at = 0;
    for (int start = 0; start < kTokens; start += kStep) {
      for (int l = 0; l < kLayers; ++l, at += 2 * half) {
        v1::AppendKVRequest r;
        r.set_session_id(s->session_id());
        r.set_layer(l);
        r.set_start_token(start);
        r.set_num_tokens(kStep);
        r.mutable_device()->set_cuda_ipc_handle((*buffer)->ipc_handle());
        r.mutable_device()->set_keys_offset(at);
        r.mutable_device()->set_values_offset(at + half);
        reqs.push_back(std::move(r));
      }
    }
    double t0 = NowSeconds();
    if (!c.AppendKV(reqs).ok()) std::exit(1);
    double t1 = NowSeconds();
    CHECK_CUDA(cudaMemcpyAsync(pinned, (*buffer)->data(), total, cudaMemcpyDeviceToHost, stream));
    CHECK_CUDA(cudaStreamSynchronize(stream));
    double t2 = NowSeconds();
    ingest_s.push_back(t1 - t0);
    copy_s.push_back(t2 - t1);
    (void)c.CloseSession(s->session_id());
  }
  Print({"ingest_d2h",
         total / Median(ingest_s) / 1e9,
         "GB/s",
         total / Median(copy_s) / 1e9,
         "device_to_host_cudaMemcpyAsync",
         {{"tokens", std::to_string(kTokens)},
          {"layers", std::to_string(kLayers)},
          {"kv_heads", std::to_string(kKv)},
          {"head_dim", std::to_string(kD)},
          {"tokens_per_message", std::to_string(kStep)},
          {"reps", "5"},
          {"target_ratio", "0.8"}}});
  cudaFreeHost(pinned);
  cudaStreamDestroy(stream);
}

void SelectDevice() {
  Daemon d({"--device", "0", "--device_capacity", "4G"});
  auto client = Client::Connect(d.address());
  if (!client.ok()) std::exit(1);
  Client& c = **client;
  auto s = c.CreateSession(SmolLm2Session());
  if (!s.ok()) std::exit(1);
  constexpr int kLayers = 30, kKv = 3, kD = 64, kTokens = 4096;
  std::mt19937 rng(5);
  std::vector<uint16_t> halfs(size_t(kKv) * kTokens * kD);
  for (auto& h : halfs) h = static_cast<uint16_t>(rng() & 0x3bff);
  const std::string bytes(reinterpret_cast<const char*>(halfs.data()), halfs.size() * 2);
  std::vector<v1::AppendKVRequest> reqs;
  for (int l = 0; l < kLayers; ++l) {
    v1::AppendKVRequest r;
    r.set_session_id(s->session_id());
    r.set_layer(l);
    r.set_num_tokens(kTokens);
    r.set_keys(bytes);
    r.set_values(bytes);
    r.set_wait_aged(true);
    reqs.push_back(std::move(r));
  }
  if (!c.AppendKV(reqs).ok()) std::exit(1);
  std::vector<float> q(9 * kD);
  for (auto& x : q) x = std::normal_distribution<float>(0, 1)(rng);
  auto timed = [&](v1::Tier placement) {
    std::vector<double> t;
    for (int i = 0; i < 200; ++i) {
      v1::SelectRequest r;
      r.set_session_id(s->session_id());
      r.set_layer(i % kLayers);
      r.set_query(reinterpret_cast<const char*>(q.data()), q.size() * 4);
      r.set_budget_tokens(256);
      r.set_placement(placement);
      double t0 = NowSeconds();
      auto resp = c.Select(r);
      if (!resp.ok()) std::exit(1);
      t.push_back((NowSeconds() - t0) * 1e6);
      (void)c.Release(resp->lease_id());
    }
    return Median(t);
  };
  const double device = timed(v1::TIER_DEVICE), host = timed(v1::TIER_HOST);
  Print({"select_device_p50",
         device,
         "us",
         host,
         "select_host_p50",
         {{"tokens", std::to_string(kTokens)}, {"budget", "256"}, {"selects", "200"}}});
}

}  // namespace

int main() {
  if (absl::StatusOr<std::vector<GpuInfo>> gpus = ProbeGpus(); !gpus.ok()) {
    std::fprintf(stderr, "transfer_gpu_bench: no CUDA device (%s); no figures\n",
                 std::string(gpus.status().message()).c_str());
    return 0;
  }
  Promotion(/*int4=*/true);
  Promotion(/*int4=*/false);
  IngestDevice();
  SelectDevice();
  return 0;
}
