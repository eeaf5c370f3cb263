// libFuzzer target: programs of RPCs (fuzz.proto, text format) against one in-process
// kvtierd over its Unix socket, every request going through gRPC, the service's checks and
// the sessions as a worker's would. Besides what ASan and UBSan catch, each call must end
// in time with a status a caller can act on: a hang (the deadline passed), UNKNOWN,
// INTERNAL or DATA_LOSS (there is no remote tier), or a message past 2 KiB aborts. After
// each program every lease is released and every session closed, and then both tiers must
// hold zero bytes.
//
// The daemon is small on purpose (a 48 MiB host tier, 16 MiB of device, 8 MiB messages,
// a tenant "small" with a quota), so that inputs reach the limits, not only the happy path.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "google/protobuf/io/tokenizer.h"
#include "google/protobuf/stubs/logging.h"
#include "google/protobuf/text_format.h"
#include "grpcpp/grpcpp.h"
#include "kvtier/v1/kvtier.grpc.pb.h"
#include "server/common/log.h"
#include "server/rpc/daemon.h"
#include "tests/fuzz/fuzz.pb.h"

namespace kvtier {
namespace {

constexpr uint32_t kMaxSynth = 1u << 18;  // halves or floats a seed may ask the harness for
constexpr size_t kMaxCalls = 24;
constexpr uint64_t kMaxMessage = 8ull << 20;

struct World {
  std::string dir;
  std::unique_ptr<Daemon> daemon;
  std::unique_ptr<v1::KvTier::Stub> stub;
};

World& TheWorld() {
  static World* w = [] {
    auto* world = new World;
    char tmpl[] = "/tmp/kvtier-fuzz-XXXXXX";
    if (mkdtemp(tmpl) == nullptr) std::abort();
    world->dir = tmpl;
    (void)SetLogLevel("off");
    google::protobuf::SetLogHandler(nullptr);  // invalid UTF-8 in a string field is logged
    ServerOptions o;
    o.listen = "unix:" + world->dir + "/kvtier.sock";
    o.instance = "fuzz-" + std::to_string(getpid());
    o.host_capacity = 48ull << 20;
    o.device_capacity = 16ull << 20;
    o.segment_size = 4ull << 20;
    o.max_message_size = kMaxMessage;
    o.max_sessions = 64;
    o.max_leases_per_tenant = 256;
    o.quotas["small"] = {.host_bytes = 1ull << 20, .device_bytes = 1ull << 20, .max_sessions = 2};
    o.log_level = "off";
    auto d = Daemon::Start(o);
    if (!d.ok()) {
      std::fprintf(stderr, "rpc_fuzz: daemon: %s\n", d.status().ToString().c_str());
      std::abort();
    }
    world->daemon = std::move(*d);
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(static_cast<int>(2 * kMaxMessage));
    args.SetMaxSendMessageSize(static_cast<int>(2 * kMaxMessage));
    world->stub = v1::KvTier::NewStub(
        grpc::CreateCustomChannel(o.listen, grpc::InsecureChannelCredentials(), args));
    return world;
  }();
  return *w;
}

// A status no input may cause: the daemon hung, crashed in a handler, or lost data.
void Check(const char* method, const grpc::Status& s) {
  switch (s.error_code()) {
    case grpc::StatusCode::DEADLINE_EXCEEDED:
    case grpc::StatusCode::UNKNOWN:
    case grpc::StatusCode::INTERNAL:
    case grpc::StatusCode::DATA_LOSS:
      std::fprintf(stderr, "rpc_fuzz: %s returned %d: %s\n", method, s.error_code(),
                   s.error_message().c_str());
      std::abort();
    default:
      break;
  }
  // Errors quote a bounded prefix of what they name (server/common/error.h: Quoted), so that
  // they fit gRPC's metadata and the caller sees the error the daemon meant.
  if (s.error_message().size() > 2048) {
    std::fprintf(stderr, "rpc_fuzz: %s returned a %zu-byte message: %.200s...\n", method,
                 s.error_message().size(), s.error_message().c_str());
    std::abort();
  }
}

std::unique_ptr<grpc::ClientContext> Context(const std::string& tenant) {
  auto ctx = std::make_unique<grpc::ClientContext>();
  ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  if (!tenant.empty()) ctx->AddMetadata("x-kvtier-tenant", tenant);
  return ctx;
}

std::string Synth(uint32_t n, size_t elem, std::mt19937& rng) {
  std::string out(size_t(std::min(n, kMaxSynth)) * elem, '\0');
  std::normal_distribution<float> g(0, 1);
  for (size_t i = 0; i < out.size(); i += elem) {
    const float x = g(rng);
    if (elem == 4) {
      std::memcpy(&out[i], &x, 4);
    } else {  // an fp16 of a small value: exponent 13..16, any sign and mantissa
      const uint16_t h = static_cast<uint16_t>((rng() & 0x83ff) | ((13 + rng() % 4) << 10));
      std::memcpy(&out[i], &h, 2);
    }
  }
  return out;
}

struct Lease {
  std::string tenant, id;
};

// An open Attach stream: the harness's worker.
struct Worker {
  std::unique_ptr<grpc::ClientContext> ctx;
  std::unique_ptr<grpc::ClientReader<v1::AttachResponse>> reader;
  std::string id;
};

// "@N" names the Nth worker's id; anything else is sent as it is.
void NameWorker(const std::vector<Worker>& workers, v1::SelectRequest* r) {
  const std::string& w = r->worker_id();
  if (w.size() < 2 || w[0] != '@') return;
  const size_t n = static_cast<size_t>(w[1] - '0');
  if (n < workers.size()) r->set_worker_id(workers[n].id);
}

void Cancel(Worker& w) {
  if (w.ctx == nullptr) return;
  w.ctx->TryCancel();
  v1::AttachResponse more;
  while (w.reader->Read(&more)) {
  }
  const grpc::Status s = w.reader->Finish();
  if (s.error_code() != grpc::StatusCode::CANCELLED) Check("Attach", s);
  w.reader.reset();
  w.ctx.reset();
}

// What gRPC lets a client send as an ASCII header value (it asserts on anything else), so
// the only tenant names that reach the daemon.
bool Sendable(const std::string& value) {
  for (char c : value) {
    if (c < 0x20 || c > 0x7e) return false;
  }
  return true;
}

void Run(const fuzz::Call& call, std::mt19937& rng, std::vector<Lease>* leases,
         std::vector<Worker>* workers) {
  if (!Sendable(call.tenant())) return;
  v1::KvTier::Stub& stub = *TheWorld().stub;
  auto ctx = Context(call.tenant());
  switch (call.op_case()) {
    case fuzz::Call::kCreate: {
      v1::CreateSessionResponse r;
      Check("CreateSession", stub.CreateSession(ctx.get(), call.create(), &r));
      break;
    }
    case fuzz::Call::kAppend: {
      v1::AppendKVResponse r;
      auto writer = stub.AppendKV(ctx.get(), &r);
      for (v1::AppendKVRequest req : call.append().requests()) {
        if (req.keys().empty() && req.values().empty() && call.append().synth_halves() > 0) {
          req.set_keys(Synth(call.append().synth_halves(), 2, rng));
          req.set_values(Synth(call.append().synth_halves(), 2, rng));
        }
        if (!writer->Write(req)) break;
      }
      writer->WritesDone();
      Check("AppendKV", writer->Finish());
      break;
    }
    case fuzz::Call::kSelect: {
      v1::SelectRequest req = call.select().request();
      if (req.query().empty()) req.set_query(Synth(call.select().synth_floats(), 4, rng));
      NameWorker(*workers, &req);
      v1::SelectResponse r;
      grpc::Status s = stub.Select(ctx.get(), req, &r);
      Check("Select", s);
      if (s.ok()) leases->push_back({call.tenant(), r.lease_id()});
      break;
    }
    case fuzz::Call::kBatchSelect: {
      v1::BatchSelectRequest req = call.batch_select().request();
      for (auto& q : *req.mutable_requests()) {
        if (q.query().empty()) q.set_query(Synth(call.batch_select().synth_floats(), 4, rng));
        NameWorker(*workers, &q);
      }
      v1::BatchSelectResponse r;
      grpc::Status s = stub.BatchSelect(ctx.get(), req, &r);
      Check("BatchSelect", s);
      for (const auto& one : r.responses()) leases->push_back({call.tenant(), one.lease_id()});
      break;
    }
    case fuzz::Call::kRelease: {
      v1::ReleaseResponse r;
      Check("Release", stub.Release(ctx.get(), call.release(), &r));
      break;
    }
    case fuzz::Call::kReadChunks: {
      auto reader = stub.ReadChunks(ctx.get(), call.read_chunks());
      v1::BlockHandle h;
      while (reader->Read(&h)) {
      }
      Check("ReadChunks", reader->Finish());
      break;
    }
    case fuzz::Call::kFork: {
      v1::CreateSessionResponse r;
      Check("ForkSession", stub.ForkSession(ctx.get(), call.fork(), &r));
      break;
    }
    case fuzz::Call::kClose: {
      v1::CloseSessionResponse r;
      Check("CloseSession", stub.CloseSession(ctx.get(), call.close(), &r));
      break;
    }
    case fuzz::Call::kList: {
      v1::ListSessionsResponse r;
      Check("ListSessions", stub.ListSessions(ctx.get(), call.list(), &r));
      break;
    }
    case fuzz::Call::kDescribe: {
      v1::DescribeSessionResponse r;
      Check("DescribeSession", stub.DescribeSession(ctx.get(), call.describe(), &r));
      break;
    }
    case fuzz::Call::kListChunks: {
      v1::ListChunksResponse r;
      Check("ListChunks", stub.ListChunks(ctx.get(), call.list_chunks(), &r));
      break;
    }
    case fuzz::Call::kTierStats: {
      v1::GetTierStatsResponse r;
      Check("GetTierStats", stub.GetTierStats(ctx.get(), call.tier_stats(), &r));
      break;
    }
    case fuzz::Call::kSegments: {
      v1::ListSegmentsResponse r;
      Check("ListSegments", stub.ListSegments(ctx.get(), call.segments(), &r));
      break;
    }
    case fuzz::Call::kEvict: {
      v1::EvictResponse r;
      Check("Evict", stub.Evict(ctx.get(), call.evict(), &r));
      break;
    }
    case fuzz::Call::kSetPolicy: {
      v1::SetPolicyResponse r;
      Check("SetPolicy", stub.SetPolicy(ctx.get(), call.set_policy(), &r));
      break;
    }
    case fuzz::Call::kEcho: {
      v1::EchoResponse r;
      Check("Echo", stub.Echo(ctx.get(), call.echo(), &r));
      break;
    }
    case fuzz::Call::kAttach: {
      if (workers->size() >= 4) break;
      Worker w;
      w.ctx = std::make_unique<grpc::ClientContext>();  // no deadline: held for the program
      if (!call.tenant().empty()) w.ctx->AddMetadata("x-kvtier-tenant", call.tenant());
      w.reader = stub.Attach(w.ctx.get(), call.attach());
      v1::AttachResponse first;
      if (w.reader->Read(&first)) {
        w.id = first.worker_id();
      } else {
        Check("Attach", w.reader->Finish());
        break;
      }
      workers->push_back(std::move(w));
      break;
    }
    case fuzz::Call::kDetach:
      if (call.detach() < workers->size()) Cancel((*workers)[call.detach()]);
      break;
    case fuzz::Call::OP_NOT_SET:
      break;
  }
}

// Releases every lease the program took and closes every session, then requires both tiers
// to be empty: anything left is memory that no caller can free.
void Reset(const std::vector<Lease>& leases, std::vector<Worker>& workers) {
  v1::KvTier::Stub& stub = *TheWorld().stub;
  for (Worker& w : workers) Cancel(w);  // their leases end with them
  for (const Lease& l : leases) {
    v1::ReleaseRequest req;
    req.set_lease_id(l.id);
    v1::ReleaseResponse r;
    auto ctx = Context(l.tenant);
    Check("Release", stub.Release(ctx.get(), req, &r));
  }
  v1::ListSessionsResponse list;
  {
    auto ctx = Context("");
    grpc::Status s = stub.ListSessions(ctx.get(), {}, &list);
    Check("ListSessions", s);
    if (!s.ok()) std::abort();
  }
  for (const auto& info : list.sessions()) {
    v1::CloseSessionRequest req;
    req.set_session_id(info.session_id());
    v1::CloseSessionResponse r;
    auto ctx = Context(info.tenant() == "default" ? "" : info.tenant());
    grpc::Status s = stub.CloseSession(ctx.get(), req, &r);
    Check("CloseSession", s);
    if (!s.ok() || !r.existed()) {
      std::fprintf(stderr, "rpc_fuzz: session %s of %s could not be closed: %s\n",
                   info.session_id().c_str(), info.tenant().c_str(), s.error_message().c_str());
      std::abort();
    }
  }
  // A detached worker's leases end as the daemon sees its stream end: allow it a moment.
  v1::GetTierStatsResponse stats;
  for (int i = 0; i < 200; ++i) {
    stats.Clear();
    auto ctx = Context("");
    Check("GetTierStats", stub.GetTierStats(ctx.get(), {}, &stats));
    bool empty = true;
    for (const auto& t : stats.tiers()) {
      empty &= t.tier() == v1::TIER_REMOTE || t.used_bytes() + t.metadata_bytes() == 0;
    }
    if (empty) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  for (const auto& t : stats.tiers()) {
    if (t.tier() != v1::TIER_REMOTE && t.used_bytes() + t.metadata_bytes() != 0) {
      std::fprintf(stderr,
                   "rpc_fuzz: tier %s holds %llu bytes (%llu of metadata) with no session and no "
                   "lease\n",
                   v1::Tier_Name(t.tier()).c_str(), static_cast<unsigned long long>(t.used_bytes()),
                   static_cast<unsigned long long>(t.metadata_bytes()));
      std::abort();
    }
  }
}

class Quiet : public google::protobuf::io::ErrorCollector {
 public:
  void AddError(int, google::protobuf::io::ColumnNumber, const std::string&) override {}
  void AddWarning(int, google::protobuf::io::ColumnNumber, const std::string&) override {}
};

}  // namespace
}  // namespace kvtier

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvtier;
  fuzz::Program program;
  google::protobuf::TextFormat::Parser parser;
  Quiet quiet;
  parser.RecordErrorsTo(&quiet);
  if (!parser.ParseFromString(std::string(reinterpret_cast<const char*>(data), size), &program)) {
    return -1;  // not a program: kept out of the corpus
  }
  if (static_cast<size_t>(program.calls_size()) > kMaxCalls) return -1;
  TheWorld();
  std::mt19937 rng(static_cast<uint32_t>(size));
  std::vector<Lease> leases;
  std::vector<Worker> workers;
  for (const auto& call : program.calls()) Run(call, rng, &leases, &workers);
  Reset(leases, workers);
  return 0;
}
