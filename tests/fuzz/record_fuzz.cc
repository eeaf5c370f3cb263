// libFuzzer target: the remote tier's session records. Each input is tried twice:
//  - as a whole stored value (magic, version, checksum, payload) through DecodeRecord;
//  - as a payload (a v1.SessionRecord) under a valid header, so that the checksum does not
//    hide the fields from the fuzzer: DecodeRecord, then Session::Import into a host tier of
//    8 MiB, a Select on every layer, and Close.
// A record that lies (sizes, positions, precisions, shapes) must be an error; after the
// session is gone the tiers must hold zero bytes. Every parsed record is also cut into the
// parts of an export (server/session/transfer.h) and put back together: the same record, or,
// only for one whose chunks hold under 4 bytes each, refused at its header; and stored in the
// form of a record past one frame (the same parts, EncodeRecord's "KVTX"), then decoded: the
// same record. The input itself is offered as a transfer part too.
//
// KVTIER_FUZZ_WRITE_SEEDS=DIR writes real records (sessions appended and demoted here) into
// DIR and exits: how tests/fuzz/corpus/record_fuzz was made, but for nan-mass-target (a record
// whose policy's mass_target is NaN, found by this target: it must survive the transfer too)
// and int4-semantic-stored-as-parts (int4-semantic as a whole stored value in the form of a
// record past one frame: EncodeRecord(record, 0)).
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <random>
#include <string>

#include "google/protobuf/stubs/logging.h"
#include "google/protobuf/util/field_comparator.h"
#include "google/protobuf/util/message_differencer.h"
#include "server/common/clock.h"
#include "server/common/log.h"
#include "server/config/policy.h"
#include "server/config/shape.h"
#include "server/session/lease_table.h"
#include "server/session/session.h"
#include "server/session/session_record.h"
#include "server/session/transfer.h"
#include "server/tier/promotion_cache.h"
#include "server/tier/tier.h"

namespace kvtier {
namespace {

TierOptions Opts(v1::Tier t, uint64_t capacity) {
  TierOptions o;
  o.tier = t;
  o.instance = "recfuzz-" + std::to_string(getpid());
  o.capacity_bytes = capacity;
  o.segment_bytes = 1 << 20;
  o.emulated = t == v1::TIER_DEVICE;
  return o;
}

// Tiers first: everything holding slots goes before them.
struct World {
  World() {
    env.host = &host;
    env.host_copies = &host_copies;
    env.device_copies = &device_copies;
    env.leases = &leases;
    env.clock = &SystemClock();
  }
  Tier host{Opts(v1::TIER_HOST, 8 << 20)};
  Tier device{Opts(v1::TIER_DEVICE, 4 << 20)};
  PromotionCache host_copies{&host, &SystemClock(), MakeLruPolicy()};
  PromotionCache device_copies{&device, &SystemClock(), MakeLruPolicy()};
  LeaseTable leases{&SystemClock()};
  SessionEnv env;
};

World& TheWorld() {
  static World* w = [] {
    (void)SetLogLevel("off");
    google::protobuf::SetLogHandler(nullptr);  // invalid UTF-8 in a string field is logged
    return new World;
  }();
  return *w;
}

std::string Header(std::string_view payload) {
  std::string out = "KVTR";
  const uint32_t version = kRecordVersion;
  const uint64_t sum = Fnv1a64(payload);
  out.append(reinterpret_cast<const char*>(&version), 4);  // little-endian hosts only
  out.append(reinterpret_cast<const char*>(&sum), 8);
  out.append(payload);
  return out;
}

void Exercise(const v1::SessionRecord& record) {
  World& w = TheWorld();
  {
    auto session = Session::Import(record, w.env);
    if (!session.ok()) return;
    const v1::ModelShape& shape = record.shape();
    const v1::SessionInfo info = (*session)->Info();
    (void)(*session)->ListChunks(std::nullopt, 4096);
    // Import accepted the shape, so its query has num_q_heads * head_dim floats.
    std::string query(size_t(shape.num_q_heads()) * shape.head_dim() * 4, '\0');
    for (size_t i = 0; i < query.size(); i += 4) {
      const float x = static_cast<float>((i * 2654435761u) % 17) / 8.f - 1.f;
      std::memcpy(&query[i], &x, 4);
    }
    for (uint32_t l = 0; l < shape.num_layers() && l < 64; ++l) {
      v1::SelectRequest req;
      req.set_session_id(info.session_id());
      req.set_layer(l);
      req.set_query(query);
      req.set_budget_tokens(64);
      v1::SelectResponse resp;
      if ((*session)->Select(req, &resp).ok()) {
        (void)w.leases.Release(info.tenant(), resp.lease_id());
      }
    }
    (*session)->Close();
  }
  if (w.host.Stats().used_bytes != 0 || w.device.Stats().used_bytes != 0 ||
      w.host.Stats().metadata_bytes != 0) {
    std::fprintf(stderr, "record_fuzz: %llu host and %llu device bytes left by a closed session\n",
                 static_cast<unsigned long long>(w.host.Stats().used_bytes),
                 static_cast<unsigned long long>(w.device.Stats().used_bytes));
    std::abort();
  }
}

void RoundTrip(v1::SessionRecord record) {
  record.DiscardUnknownFields();  // a stream's own unknown fields do not travel
  uint64_t chunks = 0, bytes = 0;
  for (const v1::StreamRecord& st : record.streams()) {
    chunks += st.chunks_size();
    for (const v1::ChunkRecord& c : st.chunks()) bytes += c.data().size();
  }
  TransferWriter writer(record);
  TransferReader reader(~uint64_t{0});
  std::string part;
  while (writer.Next(&part)) {
    if (const absl::Status s = reader.Add(part); !s.ok()) {
      if (chunks > bytes / 4) return;  // refused at its header, as it must be
      std::fprintf(stderr, "record_fuzz: a transfer refused its own parts: %s\n",
                   s.ToString().c_str());
      std::abort();
    }
  }
  absl::StatusOr<v1::SessionRecord> back = reader.Take();
  // Every field exactly, a NaN (a policy's mass_target, say) equal to itself: it went through
  // the parts bit for bit, though NaN != NaN.
  google::protobuf::util::DefaultFieldComparator exact;
  exact.set_treat_nan_as_equal(true);
  google::protobuf::util::MessageDifferencer differencer;
  differencer.set_field_comparator(&exact);
  if (!back.ok() || !differencer.Compare(*back, record)) {
    std::fprintf(stderr, "record_fuzz: a record did not survive its transfer parts\n");
    std::abort();
  }
  // The same parts as a stored record past one frame's size (EncodeRecord's KVTX form).
  absl::StatusOr<std::string> stored = EncodeRecord(record, /*max_frame_bytes=*/0);
  absl::StatusOr<v1::SessionRecord> decoded =
      stored.ok() ? DecodeRecord(*stored, "fuzz") : stored.status();
  if (!decoded.ok() || !differencer.Compare(*decoded, record)) {
    std::fprintf(stderr, "record_fuzz: a record did not survive its stored parts: %s\n",
                 decoded.status().ToString().c_str());
    std::abort();
  }
}

void WriteSeeds(const std::string& dir) {
  World& w = TheWorld();
  struct Seed {
    const char* name;
    v1::DType dtype;
    v1::Chunking chunking;
    bool lossless;
    v1::Precision cold;
  };
  const Seed seeds[] = {
      {"lossless-contiguous", v1::DTYPE_FP16, v1::CHUNKING_CONTIGUOUS, true, v1::PRECISION_FP16},
      {"int4-semantic", v1::DTYPE_FP16, v1::CHUNKING_SEMANTIC, false, v1::PRECISION_INT4},
      {"int8-boundary", v1::DTYPE_FP16, v1::CHUNKING_BOUNDARY, false, v1::PRECISION_INT8},
      {"bf16-int4", v1::DTYPE_BF16, v1::CHUNKING_CONTIGUOUS, false, v1::PRECISION_INT4},
  };
  std::mt19937 rng(7);
  for (const Seed& s : seeds) {
    v1::ModelShape shape;
    shape.set_num_layers(2);
    shape.set_num_q_heads(2);
    shape.set_num_kv_heads(1);
    shape.set_head_dim(16);
    shape.set_dtype(s.dtype);
    v1::SessionPolicy p;
    p.set_chunking(s.chunking);
    p.set_lossless(s.lossless);
    p.set_cold_precision(s.cold);
    p.set_recent_window(16);
    p.set_sink_tokens(4);
    if (s.chunking == v1::CHUNKING_BOUNDARY) p.add_delimiter_token_ids(13);
    auto policy = ResolvePolicy(p, BuiltinPolicy(), "policy");
    auto resolved = ResolveShape(shape);
    if (!policy.ok() || !resolved.ok()) std::abort();
    Session session(s.name, "t", *resolved, *policy, {}, w.env);
    const uint32_t tokens = 100;
    for (uint32_t l = 0; l < 2; ++l) {
      v1::AppendKVRequest req;
      req.set_session_id(s.name);
      req.set_layer(l);
      req.set_num_tokens(tokens);
      std::string k(tokens * 16 * 2, '\0'), v(tokens * 16 * 2, '\0');
      for (size_t i = 0; i < k.size(); i += 2) {
        const uint16_t hk = static_cast<uint16_t>((rng() & 0x83ff) | ((13 + rng() % 3) << 10));
        const uint16_t hv = static_cast<uint16_t>((rng() & 0x83ff) | ((13 + rng() % 3) << 10));
        std::memcpy(&k[i], &hk, 2);
        std::memcpy(&v[i], &hv, 2);
      }
      req.set_keys(k);
      req.set_values(v);
      for (uint32_t t = 0; t < tokens; ++t) req.add_token_ids(t % 7 == 6 ? 13 : 100 + t);
      if (!session.Append(req).ok()) std::abort();
    }
    v1::SessionRecord record;
    auto demoted = session.Demote([&](const v1::SessionRecord& r) {
      record = r;
      return absl::OkStatus();
    });
    if (!demoted.ok()) std::abort();
    std::ofstream(dir + "/" + s.name, std::ios::binary) << record.SerializeAsString();
  }
}

}  // namespace
}  // namespace kvtier

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  if (const char* dir = std::getenv("KVTIER_FUZZ_WRITE_SEEDS")) {
    kvtier::WriteSeeds(dir);
    std::exit(0);
  }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvtier;
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  if (auto whole = DecodeRecord(bytes, "fuzz"); whole.ok()) Exercise(*whole);
  TransferReader as_part(uint64_t{1} << 30);
  (void)as_part.Add(bytes);
  auto record = DecodeRecord(Header(bytes), "fuzz");
  if (!record.ok()) return 0;
  Exercise(*record);
  RoundTrip(*record);
  return 0;
}
