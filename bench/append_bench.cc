// AppendKV ingest bandwidth (K and V bytes per second, one client stream, over the Unix
// socket) against memcpy of the same bytes in this process. Median over repetitions.
// appendkv_ingest: until the stream is acknowledged (the rows stored in fp16 and selectable);
// appendkv_to_indexed: until the daemon's aging pool (--aging_threads 2) has also regrouped,
// quantized and indexed every chunk that left the recent window (its backlog is 0).
// appendkv_ingest_shm: the same appends by zero-copy ingest (OpenStaging): the worker writes
// each layer's K and V into its staging area (timed) and then sends the message that names
// them (AppendKVRequest.staged) on one open stream (Client::OpenAppend), as a prefill does
// layer by layer: the daemon stores one while the worker writes the next.
// appendkv_decode_shm_p50/p99: a decode loop's appends, one token a layer, each through the
// shared-memory channel (SelectChannel::AppendKV), against the same messages each sent as an
// AppendKV stream of one message over gRPC (Client::AppendKV), alternated step by step after
// a 4K-token prefill.
#include <cstring>
#include <random>
#include <thread>

#include "bench/bench_util.h"
#include "kvtier/client.h"

using namespace kvtier;
using namespace kvtier::bench;

int main() {
  constexpr int kLayers = 30, kKv = 3, kD = 64, kTokens = 4096, kStep = 256;  // SmolLm2Session
  Daemon d({"--host_capacity", "4G", "--aging_threads", "2"});
  auto client = Client::Connect(d.address());
  if (!client.ok()) return 1;
  Client& c = **client;
  std::mt19937 rng(3);
  std::vector<uint16_t> halfs(size_t(kKv) * kStep * kD);
  for (auto& h : halfs) h = static_cast<uint16_t>(rng() & 0x3bff);  // finite fp16
  const std::string bytes(reinterpret_cast<const char*>(halfs.data()), halfs.size() * 2);
  const double total = 2.0 * bytes.size() * kLayers * (kTokens / kStep);  // K and V

  std::vector<double> append_bw, indexed_bw, shm_bw, memcpy_bw;
  for (int rep = 0; rep < 5; ++rep) {
    auto s = c.CreateSession(SmolLm2Session());
    if (!s.ok()) return 1;
    std::vector<v1::AppendKVRequest> reqs;
    for (int start = 0; start < kTokens; start += kStep) {
      for (int l = 0; l < kLayers; ++l) {
        v1::AppendKVRequest r;
        r.set_session_id(s->session_id());
        r.set_layer(l);
        r.set_start_token(start);
        r.set_num_tokens(kStep);
        r.set_keys(bytes);
        r.set_values(bytes);
        reqs.push_back(std::move(r));
      }
    }
    double t0 = NowSeconds();
    if (!c.AppendKV(reqs).ok()) return 1;
    double t1 = NowSeconds();
    append_bw.push_back(total / (t1 - t0) / 1e9);
    for (;;) {
      auto described = c.DescribeSession(s->session_id());
      if (!described.ok()) return 1;
      if (described->info().aging_backlog_tokens() == 0) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    indexed_bw.push_back(total / (NowSeconds() - t0) / 1e9);
    (void)c.CloseSession(s->session_id());

    // Zero-copy: a staging area the size of the prefill's K and V, already in use (its pages
    // touched, as a long-running worker's area is), the bytes written into it, one stream.
    auto z = c.CreateSession(SmolLm2Session());
    if (!z.ok()) return 1;
    auto area = c.OpenStaging(z->session_id(), static_cast<uint64_t>(total));
    if (!area.ok()) return 1;
    std::memset((*area)->data(), 0, (*area)->size());
    double t4 = NowSeconds();
    std::unique_ptr<AppendWriter> writer = c.OpenAppend();  // each layer sent once written
    uint64_t at = 0;
    for (const v1::AppendKVRequest& r : reqs) {
      v1::AppendKVRequest m;
      m.set_session_id(z->session_id());
      m.set_layer(r.layer());
      m.set_start_token(r.start_token());
      m.set_num_tokens(r.num_tokens());
      std::memcpy((*area)->data() + at, bytes.data(), bytes.size());
      std::memcpy((*area)->data() + at + bytes.size(), bytes.data(), bytes.size());
      m.mutable_staged()->set_staging_id((*area)->id());
      m.mutable_staged()->set_keys_offset(at);
      m.mutable_staged()->set_values_offset(at + bytes.size());
      at += 2 * bytes.size();
      if (!writer->Write(m)) break;  // Finish says why
    }
    if (!writer->Finish().ok()) return 1;
    shm_bw.push_back(total / (NowSeconds() - t4) / 1e9);
    (void)c.CloseSession(z->session_id());

    // The same bytes through memcpy into fresh destination memory, as the daemon's are.
    std::vector<char> dst(static_cast<size_t>(total));
    double t2 = NowSeconds();
    size_t off = 0;
    for (size_t i = 0; i < reqs.size(); ++i) {
      std::memcpy(dst.data() + off, bytes.data(), bytes.size());
      std::memcpy(dst.data() + off + bytes.size(), bytes.data(), bytes.size());
      off += 2 * bytes.size();
    }
    double t3 = NowSeconds();
    memcpy_bw.push_back(total / (t3 - t2) / 1e9);
    if (dst[off / 2] == 42) std::puts("");  // keep the copy
  }
  std::map<std::string, std::string> params = {
      {"tokens", std::to_string(kTokens)},
      {"layers", std::to_string(kLayers)},
      {"kv_heads", std::to_string(kKv)},
      {"head_dim", std::to_string(kD)},
      {"tokens_per_message", std::to_string(kStep)},
      {"reps", "5"},
      {"aging_threads", "2"},
      {"segments",
       "retained: each session's slots reuse the closed one's (--retained_segment_size)"},
      {"policy", "default: int4 cold chunks, semantic regrouping, LSE-peak peaks, cluster index"},
      {"target_ratio", "0.25"}};
  Print({"appendkv_ingest", Median(append_bw), "GB/s", Median(memcpy_bw), "memcpy", params});
  params["target_ratio"] = "0.2";
  Print({"appendkv_to_indexed", Median(indexed_bw), "GB/s", Median(memcpy_bw), "memcpy", params});
  params["target_ratio"] = "0.6";
  params["path"] =
      "staging area (OpenStaging), pages touched before; the worker's writes timed, each "
      "layer's message sent once its bytes are written";
  Print({"appendkv_ingest_shm", Median(shm_bw), "GB/s", Median(memcpy_bw), "memcpy", params});

  // Decode steps: one token a layer, on a session that holds the prefill.
  auto s = c.CreateSession(SmolLm2Session());
  auto ch = c.OpenChannel();
  if (!s.ok() || !ch.ok()) return 1;
  std::vector<v1::AppendKVRequest> prefill;
  for (int l = 0; l < kLayers; ++l) {
    v1::AppendKVRequest r;
    r.set_session_id(s->session_id());
    r.set_layer(l);
    r.set_start_token(0);
    r.set_num_tokens(kTokens);
    std::string kv;
    for (int i = 0; i < kTokens / kStep; ++i) kv += bytes;  // [kv][256][d] repeated: any finite
    r.set_keys(kv);
    r.set_values(kv);
    prefill.push_back(std::move(r));
  }
  if (!c.AppendKV(prefill).ok()) return 1;
  const std::string row(bytes.data(), size_t(kKv) * kD * 2);  // one token of each KV head
  std::vector<double> over_shm, over_rpc;
  constexpr int kSteps = 200;
  for (int step = 0; step < kSteps; ++step) {
    const bool shm = step % 2 == 0;
    for (int l = 0; l < kLayers; ++l) {
      v1::AppendKVRequest r;
      r.set_session_id(s->session_id());
      r.set_layer(l);
      r.set_start_token(kTokens + step);
      r.set_num_tokens(1);
      r.set_keys(row);
      r.set_values(row);
      const double t0 = NowSeconds();
      const bool ok = shm ? (*ch)->AppendKV(r).ok() : c.AppendKV({r}).ok();
      if (!ok) return 1;
      (shm ? over_shm : over_rpc).push_back((NowSeconds() - t0) * 1e6);
    }
  }
  std::map<std::string, std::string> decode = {
      {"context_tokens", std::to_string(kTokens)},
      {"layers", std::to_string(kLayers)},
      {"kv_heads", std::to_string(kKv)},
      {"head_dim", std::to_string(kD)},
      {"tokens_per_message", "1"},
      {"steps", std::to_string(kSteps) + ", alternating the paths"},
      {"target_ratio", "reported"}};
  Print({"appendkv_decode_shm_p50", Quantile(over_shm, 0.5), "us", Quantile(over_rpc, 0.5),
         "appendkv_decode_rpc_p50", decode});
  Print({"appendkv_decode_shm_p99", Quantile(over_shm, 0.99), "us", Quantile(over_rpc, 0.99),
         "appendkv_decode_rpc_p99", decode});
  return 0;
}
