#include "server/rpc/service.h"

#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "google/protobuf/arena.h"
#include "google/protobuf/descriptor.h"
#include "kvtier/channel_layout.h"
#include "server/common/error.h"
#include "server/common/log.h"
#include "server/common/mutex.h"
#include "server/common/names.h"
#include "server/common/status_macros.h"
#include "server/rpc/tls.h"

namespace kvtier {
absl::Status Draining() {
  return absl::UnavailableError("kvtierd is draining and takes no new calls");
}

namespace {

// A channel call's arena starts on this thread's own block, which it keeps between calls: a
// Select's response (some fifty handles) then allocates nothing from the heap.
google::protobuf::ArenaOptions ArenaStart() {
  constexpr size_t kBlock = 64 << 10;
  thread_local std::unique_ptr<char[]> block(new char[kBlock]);
  google::protobuf::ArenaOptions o;
  o.initial_block = block.get();
  o.initial_block_size = kBlock;
  return o;
}

// The series a tenant's metrics go to once max_tenant_series tenants have their own.
constexpr char kOtherTenants[] = "_other";

// The tenant the admin RPCs look sessions up as: an admin's call sees every tenant's (the
// empty tenant is SessionManager's admin view), any other only its own.
std::string Scope(const Caller& caller) { return caller.admin ? std::string() : caller.tenant; }

// PERMISSION_DENIED for a caller without the admin role.
absl::Status NeedAdmin(const Caller& caller, absl::string_view what) {
  if (caller.admin) return absl::OkStatus();
  return absl::PermissionDeniedError(absl::StrCat(
      what,
      " needs an admin credential (auth.unix_peers or auth.tokens with admin: true, or "
      "the daemon's own uid); tenant \"",
      caller.tenant, "\" has none"));
}

void ToProto(const SegmentInfo& s, v1::Segment* out) {
  out->set_segment_id(s.segment_id);
  out->set_tier(s.tier);
  out->set_shm_name(s.shm_name);
  out->set_size_bytes(s.size_bytes);
  // -1: host shared memory (the host tier, an emulated device tier); else the CUDA device whose
  // memory cuda_ipc_handle exports, the generation table in host shared memory (shm_name).
  out->set_device(s.device);
  out->set_cuda_ipc_handle(s.cuda_ipc_handle);
  out->set_generation(s.generation);
  out->set_generation_table_offset(s.generation_table_offset);
  out->set_stamp_offset(s.stamp_offset);
  out->set_stamp(s.stamp);
  out->set_tenant(s.tenant);
  out->set_slot_bytes(s.slot_bytes);
}

}  // namespace

absl::flat_hash_set<std::string> MetricTenants(const ServerOptions& options) {
  absl::flat_hash_set<std::string> out = {"default"};
  for (const auto& [tenant, quota] : options.quotas) {
    if (tenant != "*") out.insert(tenant);
  }
  for (const auto& [uid, grant] : options.unix_peers) out.insert(grant.tenant);
  for (const ServerOptions::Token& t : options.tokens) out.insert(t.grant.tenant);
  for (const auto& [subject, grant] : options.cert_subjects) out.insert(grant.tenant);
  return out;
}

grpc::Status ToGrpcStatus(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), std::string(s.message()));
}

KvTierService::KvTierService(ServiceEnv env) : env_(std::move(env)) {
  const auto* service = google::protobuf::DescriptorPool::generated_pool()->FindServiceByName(
      v1::KvTier::service_full_name());
  for (int i = 0; i < service->method_count(); ++i) {
    const std::string name = service->method(i)->name();
    auto m = std::make_unique<MethodMetrics>();
    m->latency =
        &env_.metrics->GetHistogram("kvtier_rpc_latency_seconds", "Server-side RPC latency",
                                    metrics::LatencyBuckets(), metrics::Labels{{"method", name}});
    method_metrics_.emplace(name, std::move(m));
  }
  for (const std::string& t : env_.metric_tenants) tenant_series_.emplace(t, TenantSeries());
  tenant_series_.emplace(kOtherTenants, TenantSeries());
  for (auto& [tenant, series] : tenant_series_) {
    const metrics::Labels labels{{"tenant", tenant}};
    series.selects =
        &env_.metrics->GetCounter("kvtier_selects_total", "Select calls served", labels);
    series.appended_tokens = &env_.metrics->GetCounter(
        "kvtier_appended_tokens_total", "Tokens received by AppendKV (per layer)", labels);
  }
  moved_out_bytes_ = &env_.metrics->GetCounter(
      "kvtier_moved_out_bytes_total", "Chunk data of sessions exported whole (ExportSession)");
  moved_in_bytes_ = &env_.metrics->GetCounter("kvtier_moved_in_bytes_total",
                                              "Chunk data of sessions imported (ImportSession)");
  idle_ended_ = &env_.metrics->GetCounter(
      "kvtier_transfers_idle_ended_total",
      "ExportSession and ImportSession calls cancelled after waiting on their caller for "
      "--transfer_idle_timeout_ms");
  import_bytes_gauge_ =
      &env_.metrics->GetGauge("kvtier_import_bytes",
                              "Bytes held by the ImportSession calls in progress (at most "
                              "--max_import_size)");
  if (env_.max_import_bytes == 0 && env_.host != nullptr) {
    env_.max_import_bytes = env_.host->options().capacity_bytes;
  }
}

const KvTierService::TenantSeries& KvTierService::SeriesOf(const std::string& tenant) const {
  // Only the config's tenants have series of their own, so that no caller can grow the
  // metrics by naming new tenants; the map is made whole at construction, read without a lock.
  auto it = tenant_series_.find(tenant);
  return it != tenant_series_.end() ? it->second : tenant_series_.at(kOtherTenants);
}

absl::StatusOr<Caller> KvTierService::Identify(const grpc::CallbackServerContext* ctx) const {
  const std::string peer = ctx->peer();
  CallCredentials call = CredentialsIn(ctx->client_metadata());
  // Only these are TCP; every other peer is one of the Unix socket's connections, or has no
  // credentials.
  call.tcp = absl::StartsWith(peer, "ipv4:") || absl::StartsWith(peer, "ipv6:");
  if (call.tcp) {
    call.cert_subject = ClientCertSubject(*ctx);
  } else if (env_.unix_peer) {
    call.unix_peer = env_.unix_peer(peer);
  }
  ASSIGN_OR_RETURN(Caller caller, env_.auth->Identify(call));
  caller.unix_peer = call.unix_peer;
  return caller;
}

absl::StatusOr<Caller> KvTierService::Admit(const grpc::CallbackServerContext* ctx) const {
  if (draining()) return Draining();
  absl::StatusOr<Caller> caller = Identify(ctx);
  // A call whose connection went as it started may have read the peer of a newer connection
  // given its number (see UnixListener): it is cancelled by then, and does nothing.
  if (caller.ok() && ctx->IsCancelled()) {
    return absl::CancelledError("the caller's connection went before the call started");
  }
  return caller;
}

void KvTierService::Record(const char* method, const absl::Status& s, absl::Duration elapsed) {
  MethodMetrics& m = *method_metrics_.at(method);  // every method is registered up front
  const size_t code = std::min<size_t>(static_cast<size_t>(s.code()), m.by_code.size() - 1);
  metrics::Counter* counter = m.by_code[code].load(std::memory_order_acquire);
  if (counter == nullptr) {  // first call with this code: the registry hands out one object
    counter = &env_.metrics->GetCounter(
        "kvtier_rpc_total", "RPCs finished, by method and status code",
        {{"method", method}, {"code", absl::StatusCodeToString(s.code())}});
    m.by_code[code].store(counter, std::memory_order_release);
  }
  counter->Inc();
  m.latency->Observe(absl::ToDoubleSeconds(elapsed));
  if (!s.ok()) {  // every failed call, its code and words, as an access log would
    KVLOG(info, "rpc.error", "method={} code={} ms={:.3f} message={}", method,
          absl::StatusCodeToString(s.code()), absl::ToDoubleMilliseconds(elapsed),
          LogValue(s.message()));
  }
}

void KvTierService::RecordRefused(absl::string_view method, const absl::Status& why) {
  KVTIER_TSAN_ACQUIRE(this);  // on a gRPC thread, as Enter
  auto it = method_metrics_.find(method);
  if (it != method_metrics_.end()) Record(it->first.c_str(), why, absl::ZeroDuration());
}

grpc::ServerGenericBidiReactor* KvTierService::AnswerApart(
    grpc::GenericCallbackServerContext* ctx) {
  KVTIER_TSAN_ACQUIRE(this);  // on a gRPC thread, as Enter
  class Answer final : public grpc::ServerGenericBidiReactor {
   public:
    explicit Answer(const grpc::Status& s) { Finish(s); }
    void OnDone() override { delete this; }
  };
  absl::string_view method = ctx->method();
  // As the daemon's server answers: a method the service does not have is UNIMPLEMENTED, and
  // a call while it drains UNAVAILABLE, before its credentials are looked at (Admit).
  if (!absl::ConsumePrefix(&method, kKvTierPathPrefix) || !method_metrics_.contains(method)) {
    return new Answer(grpc::Status(grpc::StatusCode::UNIMPLEMENTED, ""));
  }
  absl::Status s = draining() ? Draining() : Identify(ctx).status();
  // The connection's uid is granted nothing, but a call whose connection went as it started
  // may read the peer of a newer connection given its number (see UnixListener), one that
  // has credentials: it is told to try again, on a connection of its own.
  if (s.ok()) {
    s = absl::UnavailableError("the connection was served apart from the daemon's calls; retry");
  }
  RecordRefused(method, s);
  return new Answer(ToGrpcStatus(s));
}

template <typename Fn>
grpc::ServerUnaryReactor* KvTierService::Unary(grpc::CallbackServerContext* ctx, const char* method,
                                               Fn&& fn) {
  Enter();
  absl::Time start = absl::Now();
  // The caller once, at the start: every use in the call is this one.
  absl::StatusOr<Caller> caller = Admit(ctx);
  absl::Status s = caller.status();
  if (s.ok()) {
    if constexpr (std::is_invocable_v<Fn&, const Caller&>) {
      s = fn(*caller);
    } else {
      s = fn();
    }
  }
  Record(method, s, absl::Now() - start);
  grpc::ServerUnaryReactor* r = ctx->DefaultReactor();
  r->Finish(ToGrpcStatus(s));
  in_flight_.fetch_sub(1, std::memory_order_acq_rel);
  return r;
}

grpc::ServerUnaryReactor* KvTierService::CreateSession(grpc::CallbackServerContext* ctx,
                                                       const v1::CreateSessionRequest* req,
                                                       v1::CreateSessionResponse* resp) {
  return Unary(ctx, "CreateSession", [&](const Caller& caller) -> absl::Status {
    ASSIGN_OR_RETURN(*resp, env_.sessions->Create(caller.tenant, *req));
    return absl::OkStatus();
  });
}

absl::StatusOr<uint64_t> KvTierService::ApplyAppend(const std::string& tenant,
                                                    v1::AppendKVRequest* req,
                                                    DeviceSources* sources,
                                                    std::shared_ptr<Session>* session) {
  DeviceSources own;  // a lone append's device memory, mapped for this append alone
  absl::StatusOr<uint64_t> stored;
  RETURN_IF_ERROR(env_.sessions->Run(
      tenant, req->session_id(),
      [&](const std::shared_ptr<Session>& s) {
        // A GPU's bytes become its own.
        RETURN_IF_ERROR(
            s->Undevice(req, sources != nullptr ? sources : &own, env_.max_message_bytes));
        stored = s->Append(*req);
        return stored.status();
      },
      session));
  if (sources == nullptr) SeriesOf(tenant).appended_tokens->Inc(req->num_tokens());
  return stored;
}

// Applies each message as it arrives; the first error ends the stream with that status,
// and the messages before it stay applied (each append is idempotent, so a client resends).
//
// gRPC runs successive callbacks of one reactor on different threads, ordered by its own
// (uninstrumented) code; KVTIER_TSAN_RELEASE before each hand-back and KVTIER_TSAN_ACQUIRE
// at each callback tell ThreadSanitizer about that order.
class KvTierService::AppendReactor final
    : public Counted<grpc::ServerReadReactor<v1::AppendKVRequest>> {
 public:
  AppendReactor(KvTierService* svc, grpc::CallbackServerContext* ctx, v1::AppendKVResponse* resp)
      : Counted(svc, "AppendKV"), resp_(resp) {
    absl::StatusOr<Caller> caller = svc_->Identify(ctx);
    absl::Status s = caller.status();
    tenant_ok_ = s.ok();  // no tenant, no metric series
    if (s.ok()) tenant_ = std::move(caller->tenant);
    if (s.ok() && svc_->draining()) s = Draining();
    if (!s.ok()) {
      Done(s);
      return;
    }
    Read();
  }

  void OnReadDone(bool ok) override {
    KVTIER_TSAN_ACQUIRE(this);
    if (!ok) {  // the client closed its side: all applied
      Done(absl::OkStatus());
      return;
    }
    absl::Status s = Apply();
    if (!s.ok()) {
      Done(s);
      return;
    }
    Read();
  }

 private:
  void Read() {
    KVTIER_TSAN_RELEASE(this);
    StartRead(&req_);
  }

  absl::Status Apply() {
    ASSIGN_OR_RETURN(uint64_t stored,
                     svc_->ApplyAppend(tenant_, &req_, &device_sources_, &session_));
    resp_->set_num_tokens(stored);
    tokens_ += req_.num_tokens();
    return absl::OkStatus();
  }

  void Done(const absl::Status& s) {
    if (tenant_ok_) {
      svc_->SeriesOf(tenant_).appended_tokens->Inc(static_cast<double>(tokens_));
    }
    End(s);
  }

  std::string tenant_;  // set once, in the constructor
  v1::AppendKVResponse* const resp_;
  v1::AppendKVRequest req_;
  // The worker device memory this stream's appends named, mapped until the stream ends.
  DeviceSources device_sources_;
  std::shared_ptr<Session> session_;
  uint64_t tokens_ = 0;
  bool tenant_ok_ = false;
};

grpc::ServerReadReactor<v1::AppendKVRequest>* KvTierService::AppendKV(
    grpc::CallbackServerContext* ctx, v1::AppendKVResponse* resp) {
  return new AppendReactor(this, ctx, resp);
}

absl::Status KvTierService::SelectAndGuess(const std::shared_ptr<Session>& session,
                                           const v1::SelectRequest& req, v1::SelectResponse* resp,
                                           ReplyRoom* room) {
  if (!env_.prefetcher) return session->Select(req, resp, room);
  PrefetchGuess guess;
  RETURN_IF_ERROR(session->Select(req, resp, room, &guess, env_.prefetcher->extra_percent()));
  env_.prefetcher->Enqueue(session, std::move(guess));
  return absl::OkStatus();
}

absl::Status KvTierService::EndNamedLeases(const std::string& tenant,
                                           std::span<const v1::SelectRequest* const> requests) {
  bool any = false;
  for (size_t r = 0; r < requests.size(); ++r) {
    const auto& list = requests[r]->release_lease_ids();
    if (list.empty()) continue;  // the usual Select: nothing to look at
    any = true;
    const std::string where = requests.size() > 1 ? absl::StrCat("requests[", r, "].") : "";
    if (list.size() > kMaxReleasesPerSelect) {
      return absl::InvalidArgumentError(absl::StrCat(where, "release_lease_ids: ", list.size(),
                                                     " ids, at most ", kMaxReleasesPerSelect));
    }
    for (int i = 0; i < list.size(); ++i) {
      if (absl::Status s = env_.leases->CheckLive(tenant, list[i]); !s.ok()) {
        return absl::Status(s.code(),
                            absl::StrCat(where, "release_lease_ids[", i, "]: ", s.message()));
      }
    }
  }
  if (!any) return absl::OkStatus();
  // Every one checked: each ends now. One that ended meanwhile (it expired, or another call of
  // this tenant released it) has ended as asked.
  for (const v1::SelectRequest* req : requests) {
    for (const std::string& id : req->release_lease_ids()) {
      env_.leases->Release(tenant, id).IgnoreError();
    }
  }
  return absl::OkStatus();
}

absl::Status KvTierService::DoSelect(const std::string& tenant, const v1::SelectRequest& req,
                                     v1::SelectResponse* resp, uint64_t reply_limit) {
  const v1::SelectRequest* const one[] = {&req};
  RETURN_IF_ERROR(EndNamedLeases(tenant, one));
  // Session::Select clears the response it fills (a retried run included).
  RETURN_IF_ERROR(env_.sessions->Run(tenant, req.session_id(), [&](const auto& session) {
    ReplyRoom room{reply_limit, reply_limit};  // a retried run starts anew
    return SelectAndGuess(session, req, resp, &room);
  }));
  SeriesOf(tenant).selects->Inc();
  return absl::OkStatus();
}

absl::Status KvTierService::DoBatchSelect(const std::string& tenant,
                                          const v1::BatchSelectRequest& req,
                                          v1::BatchSelectResponse* resp, uint64_t reply_limit) {
  // The whole reply's bound first: a batch too large to send takes no lease at all. Each
  // reply's framing in the batch takes 8 bytes of the room besides.
  constexpr uint64_t kFraming = 8;
  const ReplyRoom whole{
      reply_limit, reply_limit - std::min<uint64_t>(reply_limit, kFraming * req.requests_size())};
  ReplyRoom first = whole;
  for (int i = 0; i < req.requests_size(); ++i) {
    const v1::SelectRequest& r = req.requests(i);
    auto session = env_.sessions->Get(tenant, r.session_id());
    if (!session.ok()) {
      return absl::Status(session.status().code(),
                          absl::StrCat("requests[", i, "].", session.status().message()));
    }
    RETURN_IF_ERROR(
        TakeReplyRoom(absl::StrCat("requests[", i, "]"), (*session)->ReplyBytesBound(r), &first));
  }
  // Then each Select takes its bound again, under its session's lock, from one room: appends
  // since the first look cannot grow the batch's reply past the limit.
  ReplyRoom room = whole;
  std::vector<const v1::SelectRequest*> all;
  all.reserve(req.requests_size());
  for (const v1::SelectRequest& r : req.requests()) all.push_back(&r);
  RETURN_IF_ERROR(EndNamedLeases(tenant, all));
  for (int i = 0; i < req.requests_size(); ++i) {
    const v1::SelectRequest& r = req.requests(i);
    absl::Status s = [&]() -> absl::Status {
      v1::SelectResponse* out = resp->add_responses();
      return env_.sessions->Run(tenant, r.session_id(), [&](const auto& session) {
        return SelectAndGuess(session, r, out, &room);  // Session::Select clears `out` first
      });
    }();
    if (!s.ok()) {
      // All or nothing: end the leases already granted in this batch.
      for (const auto& done : resp->responses()) {
        if (!done.lease_id().empty()) env_.leases->Release(tenant, done.lease_id()).IgnoreError();
      }
      resp->Clear();
      return absl::Status(s.code(), absl::StrCat("requests[", i, "].", s.message()));
    }
  }
  SeriesOf(tenant).selects->Inc(req.requests_size());
  return absl::OkStatus();
}

grpc::ServerUnaryReactor* KvTierService::Select(grpc::CallbackServerContext* ctx,
                                                const v1::SelectRequest* req,
                                                v1::SelectResponse* resp) {
  return Unary(ctx, "Select", [&](const Caller& caller) {
    return DoSelect(caller.tenant, *req, resp, env_.max_message_bytes);
  });
}

grpc::ServerUnaryReactor* KvTierService::BatchSelect(grpc::CallbackServerContext* ctx,
                                                     const v1::BatchSelectRequest* req,
                                                     v1::BatchSelectResponse* resp) {
  return Unary(ctx, "BatchSelect", [&](const Caller& caller) {
    return DoBatchSelect(caller.tenant, *req, resp, env_.max_message_bytes);
  });
}

absl::Status KvTierService::ServeChannel(const ChannelHub::Call& call, std::string* out) {
  const absl::Time start = absl::Now();
  Enter();
  const char* method = "Select";
  absl::Status s = [&]() -> absl::Status {
    if (draining()) return Draining();
    // The channel's worker names every Select that names none, so its leases end with it.
    auto with_worker = [&](v1::SelectRequest* r) {
      if (r->worker_id().empty()) r->set_worker_id(call.worker);
    };
    auto parse = [&](google::protobuf::Message* m) -> absl::Status {
      if (m->ParseFromArray(call.request.data(), static_cast<int>(call.request.size()))) {
        return absl::OkStatus();
      }
      return absl::InvalidArgumentError(
          absl::StrCat("request: not a ", m->GetDescriptor()->name(), " (op ", call.op, ")"));
    };
    switch (call.op) {
      case channel::kSelect: {
        v1::SelectRequest req;
        RETURN_IF_ERROR(parse(&req));
        with_worker(&req);
        // On an arena: a response's handles are many small messages, and the arena frees them
        // at once.
        google::protobuf::Arena arena(ArenaStart());
        auto* resp = google::protobuf::Arena::CreateMessage<v1::SelectResponse>(&arena);
        RETURN_IF_ERROR(DoSelect(call.tenant, req, resp, call.reply_limit));
        resp->SerializeToString(out);
        return absl::OkStatus();
      }
      case channel::kBatchSelect: {
        method = "BatchSelect";
        v1::BatchSelectRequest req;
        RETURN_IF_ERROR(parse(&req));
        for (v1::SelectRequest& r : *req.mutable_requests()) with_worker(&r);
        google::protobuf::Arena arena(ArenaStart());
        auto* resp = google::protobuf::Arena::CreateMessage<v1::BatchSelectResponse>(&arena);
        RETURN_IF_ERROR(DoBatchSelect(call.tenant, req, resp, call.reply_limit));
        resp->SerializeToString(out);
        return absl::OkStatus();
      }
      case channel::kRelease: {
        method = "Release";
        v1::ReleaseRequest req;
        RETURN_IF_ERROR(parse(&req));
        RETURN_IF_ERROR(env_.leases->Release(call.tenant, req.lease_id()));
        v1::ReleaseResponse().SerializeToString(out);
        return absl::OkStatus();
      }
      case channel::kAppendKV: {
        method = "AppendKV";
        v1::AppendKVRequest req;
        RETURN_IF_ERROR(parse(&req));
        ASSIGN_OR_RETURN(uint64_t stored, ApplyAppend(call.tenant, &req, nullptr));
        v1::AppendKVResponse resp;
        resp.set_num_tokens(stored);
        resp.SerializeToString(out);
        return absl::OkStatus();
      }
      default:
        return absl::InvalidArgumentError(absl::StrCat(
            "op: ", call.op, " is none of Select (1), BatchSelect (2), Release (3), AppendKV (4)"));
    }
  }();
  Record(method, s, absl::Now() - start);  // the same series as the gRPC calls'
  in_flight_.fetch_sub(1, std::memory_order_acq_rel);
  return s;
}

grpc::ServerUnaryReactor* KvTierService::Release(grpc::CallbackServerContext* ctx,
                                                 const v1::ReleaseRequest* req,
                                                 v1::ReleaseResponse* resp) {
  return Unary(ctx, "Release", [&](const Caller& caller) {
    return env_.leases->Release(caller.tenant, req->lease_id());
  });
}

class KvTierService::ReadChunksReactor final
    : public Counted<grpc::ServerWriteReactor<v1::BlockHandle>> {
 public:
  ReadChunksReactor(KvTierService* svc, grpc::CallbackServerContext* ctx,
                    const v1::ReadChunksRequest* req)
      : Counted(svc, "ReadChunks") {
    absl::StatusOr<Caller> caller = svc_->Admit(ctx);
    absl::Status s = caller.status();
    if (s.ok()) s = Load(caller->tenant, *req);
    if (!s.ok() || ids_.empty()) {
      End(s);
      return;
    }
    StartStream();
  }

  void OnSendInitialMetadataDone(bool ok) override { Next(ok, /*wrote=*/false); }
  void OnWriteDone(bool ok) override { Next(ok, /*wrote=*/true); }

 private:
  // The ids once each, in the order first named, all checked; each handle is read when it is
  // written, so the call holds one chunk's bytes at a time however many it names.
  absl::Status Load(const std::string& tenant, const v1::ReadChunksRequest& req) {
    ASSIGN_OR_RETURN(session_, svc_->env_.sessions->Get(tenant, req.session_id()));
    absl::flat_hash_set<uint64_t> seen;
    for (uint64_t id : req.chunk_ids()) {
      if (seen.insert(id).second) ids_.push_back(id);
    }
    return session_->CheckChunkIds(ids_);
  }

  // After the initial metadata (StartStream) or a handle written: the next handle, or the end.
  void Next(bool ok, bool wrote) {
    KVTIER_TSAN_ACQUIRE(this);
    if (!ok) {
      End(absl::CancelledError("ReadChunks: the client went away"));
      return;
    }
    if (wrote && ++next_ == ids_.size()) {
      End(absl::OkStatus());
      return;
    }
    Write();
  }

  void Write() {
    absl::StatusOr<std::vector<v1::BlockHandle>> h = session_->ReadChunks({ids_[next_]});
    if (!h.ok()) {  // the session closed meanwhile
      End(h.status());
      return;
    }
    handle_ = std::move(h->front());
    KVTIER_TSAN_RELEASE(this);
    StartWrite(&handle_);
    KVTIER_TSAN_RELEASE(this);  // after StartWrite's read of handle_, as ExportReactor::Write
  }

  std::shared_ptr<Session> session_;
  std::vector<uint64_t> ids_;
  v1::BlockHandle handle_;
  size_t next_ = 0;
};

grpc::ServerWriteReactor<v1::BlockHandle>* KvTierService::ReadChunks(
    grpc::CallbackServerContext* ctx, const v1::ReadChunksRequest* req) {
  return new ReadChunksReactor(this, ctx, req);
}

// One worker's Attach stream: the worker id is written at once, then the stream stays open
// until the client ends it (OnCancel: its process died, its connection dropped, or it
// cancelled) or the daemon drains (UNAVAILABLE). Either way the worker detaches in OnDone,
// ending its leases. Finish is called once, by whoever claims it first (Claim), and OnDone,
// which deletes the reactor, cannot come before Finish: so a claimed reactor stays alive
// until its claimer has called Finish. Attach streams are not in in_flight(): a drain ends
// them instead of waiting for them.
class KvTierService::AttachReactor final : public grpc::ServerWriteReactor<v1::AttachResponse> {
 public:
  AttachReactor(KvTierService* svc, grpc::CallbackServerContext* ctx) : svc_(svc) {
    KVTIER_TSAN_ACQUIRE(svc_);  // as Enter: not counted in flight (above)
    absl::StatusOr<Caller> caller = svc_->Admit(ctx);
    if (!caller.ok()) {  // counted and logged as a refused call of any other method is
      svc_->Record("Attach", caller.status(), absl::ZeroDuration());
      if (Claim()) Finish(ToGrpcStatus(caller.status()));
      return;
    }
    const std::string& tenant = caller->tenant;
    worker_ = svc_->env_.leases->Attach(tenant);
    resp_.set_worker_id(worker_);
    resp_.set_lease_ttl_ms(svc_->env_.lease_ttl_ms);
    {
      MutexLock lock(&svc_->attach_mu_);
      svc_->attached_.insert(this);
    }
    // A drain that began after the check above did not see this stream: end it here.
    if (svc_->draining()) {
      if (Claim()) End(Draining());
      return;
    }
    KVLOG(debug, "worker.attach", "worker={} tenant={}", worker_, LogValue(tenant));
    KVTIER_TSAN_RELEASE(this);
    StartWrite(&resp_);
  }

  void OnWriteDone(bool ok) override {
    KVTIER_TSAN_ACQUIRE(this);
    if (!ok && Claim()) Finish(grpc::Status(grpc::StatusCode::CANCELLED, "the worker went away"));
  }

  void OnCancel() override {
    KVTIER_TSAN_ACQUIRE(this);
    Detach();  // at once, not only when the last operation completes
    if (Claim()) Finish(grpc::Status(grpc::StatusCode::CANCELLED, "the worker went away"));
  }

  void OnDone() override {
    KVTIER_TSAN_ACQUIRE(this);
    {
      MutexLock lock(&svc_->attach_mu_);
      svc_->attached_.erase(this);
    }
    Detach();
    delete this;
  }

  // True for the one caller that may call Finish.
  bool Claim() {
    MutexLock lock(&mu_);
    if (finished_) return false;
    finished_ = true;
    return true;
  }
  void End(const absl::Status& s) {
    KVTIER_TSAN_RELEASE(this);
    Finish(ToGrpcStatus(s));
  }

 private:
  void Detach() {
    std::string worker;
    {
      MutexLock lock(&mu_);
      worker = std::exchange(worker_, "");
    }
    if (worker.empty()) return;
    const int ended = svc_->env_.leases->Detach(worker);
    KVLOG(debug, "worker.detach", "worker={} leases_ended={}", worker, ended);
  }

  KvTierService* const svc_;
  v1::AttachResponse resp_;
  absl::Mutex mu_;  // lock order 13 (server/common/lock_order.h)
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  std::string worker_;  // written before StartWrite; after, read and cleared under mu_
};

grpc::ServerWriteReactor<v1::AttachResponse>* KvTierService::Attach(
    grpc::CallbackServerContext* ctx, const v1::AttachRequest*) {
  return new AttachReactor(this, ctx);
}

void KvTierService::StartDraining() {
  draining_.store(true, std::memory_order_release);
  std::vector<AttachReactor*> claimed;
  {
    MutexLock lock(&attach_mu_);
    for (AttachReactor* r : attached_) {
      if (r->Claim()) claimed.push_back(r);
    }
  }
  // Outside attach_mu_: OnDone takes it.
  for (AttachReactor* r : claimed) r->End(Draining());
}

grpc::ServerUnaryReactor* KvTierService::ForkSession(grpc::CallbackServerContext* ctx,
                                                     const v1::ForkSessionRequest* req,
                                                     v1::CreateSessionResponse* resp) {
  return Unary(ctx, "ForkSession", [&](const Caller& caller) -> absl::Status {
    ASSIGN_OR_RETURN(*resp, env_.sessions->Fork(caller.tenant, *req));
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* KvTierService::CloseSession(grpc::CallbackServerContext* ctx,
                                                      const v1::CloseSessionRequest* req,
                                                      v1::CloseSessionResponse* resp) {
  return Unary(ctx, "CloseSession", [&](const Caller& caller) -> absl::Status {
    ASSIGN_OR_RETURN(bool existed, env_.sessions->Close(Scope(caller), req->session_id()));
    resp->set_existed(existed);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* KvTierService::ListSessions(grpc::CallbackServerContext* ctx,
                                                      const v1::ListSessionsRequest*,
                                                      v1::ListSessionsResponse* resp) {
  return Unary(ctx, "ListSessions", [&](const Caller& caller) {
    for (const auto& s : env_.sessions->List()) {
      if (caller.admin || s->tenant() == caller.tenant) *resp->add_sessions() = s->Info();
    }
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* KvTierService::DescribeSession(grpc::CallbackServerContext* ctx,
                                                         const v1::DescribeSessionRequest* req,
                                                         v1::DescribeSessionResponse* resp) {
  return Unary(ctx, "DescribeSession", [&](const Caller& caller) -> absl::Status {
    // Run: a session that moves to the remote tier meanwhile is looked up (restored) again.
    return env_.sessions->Run(Scope(caller), req->session_id(), [&](const auto& session) {
      resp->Clear();
      *resp->mutable_info() = session->Info();
      ASSIGN_OR_RETURN(std::vector<v1::LayerStats> layers, session->Layers());
      for (auto& l : layers) *resp->add_layers() = std::move(l);
      return absl::OkStatus();
    });
  });
}

grpc::ServerUnaryReactor* KvTierService::ListChunks(grpc::CallbackServerContext* ctx,
                                                    const v1::ListChunksRequest* req,
                                                    v1::ListChunksResponse* resp) {
  return Unary(ctx, "ListChunks", [&](const Caller& caller) -> absl::Status {
    std::optional<uint32_t> layer;
    if (req->has_layer()) layer = req->layer();
    return env_.sessions->Run(Scope(caller), req->session_id(), [&](const auto& session) {
      ASSIGN_OR_RETURN(*resp, session->ListChunks(layer, req->limit() ? req->limit() : 10000));
      return absl::OkStatus();
    });
  });
}

grpc::ServerUnaryReactor* KvTierService::GetTierStats(grpc::CallbackServerContext* ctx,
                                                      const v1::GetTierStatsRequest*,
                                                      v1::GetTierStatsResponse* resp) {
  return Unary(ctx, "GetTierStats", [&] {
    for (const PromotionCache* cache : {env_.device_copies, env_.host_copies}) {
      const Tier* t = cache->tier();
      TierSnapshot s = t->Stats();
      v1::TierStats* out = resp->add_tiers();
      const PromotionCache::Counters c = cache->counters();
      out->set_cached_copies(cache->size());
      out->set_cache_hits(c.hits);
      out->set_cache_misses(c.misses);
      out->set_prefetched(c.prefetched);
      out->set_prefetch_hits(c.prefetch_hits);
      out->set_eviction_policy(cache->policy().name());
      out->set_tier(s.tier);
      out->set_capacity_bytes(s.capacity_bytes);
      out->set_used_bytes(s.used_bytes);
      out->set_metadata_bytes(s.metadata_bytes);
      out->set_pinned_bytes(s.pinned_bytes);
      out->set_num_chunks(s.num_slots);
      out->set_promotions(c.promotions);
      out->set_evictions(c.evictions + c.drops);
      out->set_num_segments(s.num_segments);
      out->set_retained_bytes(s.retained_bytes);
      out->set_emulated(s.emulated);
    }
    if (env_.sessions->has_remote()) {  // what moved down and came back, as whole sessions
      const SessionManager::RemoteCounters r = env_.sessions->remote_counters();
      v1::TierStats* out = resp->add_tiers();
      out->set_tier(v1::TIER_REMOTE);
      out->set_promotions(r.restores);
      out->set_evictions(r.demotions);
    }
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* KvTierService::ListSegments(grpc::CallbackServerContext* ctx,
                                                      const v1::ListSegmentsRequest*,
                                                      v1::ListSegmentsResponse* resp) {
  return Unary(ctx, "ListSegments", [&](const Caller& caller) {
    for (const Tier* t : {env_.device, env_.host}) {
      for (const SegmentInfo& s : t->Segments()) {
        if (caller.admin || s.tenant == caller.tenant) ToProto(s, resp->add_segments());
      }
    }
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* KvTierService::ListLeases(grpc::CallbackServerContext* ctx,
                                                    const v1::ListLeasesRequest* req,
                                                    v1::ListLeasesResponse* resp) {
  return Unary(ctx, "ListLeases", [&](const Caller& caller) {
    const size_t limit = req->limit() ? req->limit() : 10000;
    size_t total = 0;
    for (const LeaseTable::Info& l : env_.leases->List(caller.admin ? nullptr : &caller.tenant,
                                                       req->session_id(), limit, &total)) {
      v1::LeaseInfo* out = resp->add_leases();
      out->set_lease_id(l.lease_id);
      out->set_tenant(l.tenant);
      out->set_session_id(l.session_id);
      out->set_worker_id(l.worker);
      out->set_slots(l.slots);
      out->set_pinned_bytes(l.pinned_bytes);
      out->set_expires_unix_ms(l.expires_unix_ms);
    }
    resp->set_total(total);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* KvTierService::OpenSegments(grpc::CallbackServerContext* ctx,
                                                      const v1::OpenSegmentsRequest* req,
                                                      v1::OpenSegmentsResponse* resp) {
  return Unary(ctx, "OpenSegments", [&](const Caller& caller) -> absl::Status {
    const std::optional<PeerCredentials>& cred = caller.unix_peer;  // the call's, from its start
    FdChannel* fds = env_.fds_of ? env_.fds_of() : nullptr;
    if (fds == nullptr || !cred.has_value()) {
      return absl::FailedPreconditionError(
          "OpenSegments: descriptors are handed over the Unix socket only; over TCP, ask for "
          "include_data");
    }
    constexpr int kMaxIds = 4096;
    if (req->segment_ids_size() > kMaxIds) {
      return absl::InvalidArgumentError(
          absl::StrCat("segment_ids: ", req->segment_ids_size(), " ids, at most ", kMaxIds));
    }
    // Only the caller's own tenant's segments, whoever it is (an admin's included).
    absl::flat_hash_map<uint64_t, SegmentInfo> mine;
    for (const Tier* t : {env_.device, env_.host}) {
      for (SegmentInfo& s : t->Segments()) {
        if (s.tenant == caller.tenant) mine.emplace(s.segment_id, std::move(s));
      }
    }
    std::vector<uint64_t> ids(req->segment_ids().begin(), req->segment_ids().end());
    if (ids.empty()) {
      for (const auto& [id, s] : mine) ids.push_back(id);
      if (ids.size() > kMaxIds) ids.resize(kMaxIds);
    }
    for (size_t i = 0; i < ids.size(); ++i) {
      auto it = mine.find(ids[i]);
      if (it == mine.end()) {
        return absl::NotFoundError(
            absl::StrCat("segment_ids[", i, "]: ", ids[i], " is not a segment of this tenant's"));
      }
      ToProto(it->second, resp->add_segments());
    }
    ASSIGN_OR_RETURN(*resp->mutable_ticket(),
                     fds->Issue(cred->pid, cred->uid, caller.tenant, std::move(ids)));
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* KvTierService::OpenStaging(grpc::CallbackServerContext* ctx,
                                                     const v1::OpenStagingRequest* req,
                                                     v1::OpenStagingResponse* resp) {
  return Unary(ctx, "OpenStaging", [&](const Caller& caller) -> absl::Status {
    const std::optional<PeerCredentials>& cred = caller.unix_peer;
    FdChannel* fds = env_.fds_of ? env_.fds_of() : nullptr;
    if (fds == nullptr || !cred.has_value() || env_.staging == nullptr) {
      return absl::FailedPreconditionError(
          "OpenStaging: staging areas are handed over the Unix socket only; over TCP, send the "
          "bytes in AppendKVRequest.keys and values");
    }
    if (env_.staging->max_bytes() == 0) {
      return absl::FailedPreconditionError(
          "OpenStaging: this daemon has no staging (--max_staging_size 0); send the bytes in "
          "AppendKVRequest.keys and values");
    }
    // The caller's own sessions only, an admin's too: the descriptor goes to its tenant.
    ASSIGN_OR_RETURN(auto session, env_.sessions->Get(caller.tenant, req->session_id()));
    ASSIGN_OR_RETURN(std::shared_ptr<StagingArea> area,
                     env_.staging->Create(caller.tenant, req->size_bytes()));
    resp->set_staging_id(area->id());
    resp->set_size_bytes(area->size());
    // The ticket first: a session's area is replaced only by one its worker can collect.
    ASSIGN_OR_RETURN(*resp->mutable_ticket(), fds->Issue(cred->pid, cred->uid, caller.tenant,
                                                         {area->id()}, FdChannel::Grant::kStaging));
    return session->SetStaging(std::move(area));
  });
}

grpc::ServerUnaryReactor* KvTierService::OpenChannel(grpc::CallbackServerContext* ctx,
                                                     const v1::OpenChannelRequest* req,
                                                     v1::OpenChannelResponse* resp) {
  return Unary(ctx, "OpenChannel", [&](const Caller& caller) -> absl::Status {
    const std::optional<PeerCredentials>& cred = caller.unix_peer;
    FdChannel* fds = env_.fds_of ? env_.fds_of() : nullptr;
    ChannelHub* hub = env_.channels_of ? env_.channels_of() : nullptr;
    if (fds == nullptr || hub == nullptr || !cred.has_value()) {
      return absl::FailedPreconditionError(
          "OpenChannel: channels are handed over the Unix socket only; over TCP, call Select");
    }
    ASSIGN_OR_RETURN(ChannelHub::Opened opened,
                     hub->Open(caller.tenant, req->size_bytes(), env_.max_message_bytes));
    resp->set_channel_id(opened.id);
    resp->set_size_bytes(opened.size_bytes);
    resp->set_worker_id(opened.worker_id);
    std::vector<uint64_t> ids(channel::kDescriptors, opened.id);
    absl::StatusOr<std::string> ticket =
        fds->Issue(cred->pid, cred->uid, caller.tenant, std::move(ids), FdChannel::Grant::kChannel);
    if (!ticket.ok()) {
      // Nobody can collect it: it ends now, rather than holding its place for kCollectWithin.
      hub->Abandon(opened.id);
      return ticket.status();
    }
    resp->set_ticket(*std::move(ticket));
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* KvTierService::Evict(grpc::CallbackServerContext* ctx,
                                               const v1::EvictRequest* req,
                                               v1::EvictResponse* resp) {
  return Unary(ctx, "Evict", [&](const Caller& caller) -> absl::Status {
    if (req->tier() == v1::TIER_HOST) {  // the whole session, down to the remote tier
      ASSIGN_OR_RETURN(uint64_t bytes, env_.sessions->Demote(Scope(caller), req->session_id()));
      resp->set_bytes_moved(bytes);
      return absl::OkStatus();
    }
    ASSIGN_OR_RETURN(auto session, env_.sessions->Get(Scope(caller), req->session_id()));
    ASSIGN_OR_RETURN(uint64_t bytes, session->Evict(req->tier()));
    resp->set_bytes_moved(bytes);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* KvTierService::SetPolicy(grpc::CallbackServerContext* ctx,
                                                   const v1::SetPolicyRequest* req,
                                                   v1::SetPolicyResponse* resp) {
  return Unary(ctx, "SetPolicy", [&](const Caller& caller) -> absl::Status {
    ASSIGN_OR_RETURN(auto session, env_.sessions->Get(Scope(caller), req->session_id()));
    ASSIGN_OR_RETURN(*resp->mutable_policy(), session->SetPolicy(req->policy()));
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* KvTierService::Drain(grpc::CallbackServerContext* ctx,
                                               const v1::DrainRequest*, v1::DrainResponse* resp) {
  bool granted = false;  // only a call that passed its checks drains
  grpc::ServerUnaryReactor* r = Unary(ctx, "Drain", [&](const Caller& caller) -> absl::Status {
    RETURN_IF_ERROR(NeedAdmin(caller, "Drain"));
    resp->set_sessions(static_cast<uint32_t>(env_.sessions->size()));
    granted = true;
    return absl::OkStatus();
  });
  if (granted && env_.on_drain) env_.on_drain();  // non-blocking: wakes the daemon's main thread
  return r;
}

grpc::ServerUnaryReactor* KvTierService::Echo(grpc::CallbackServerContext* ctx,
                                              const v1::EchoRequest* req, v1::EchoResponse* resp) {
  return Unary(ctx, "Echo", [&]() -> absl::Status {
    // The payload and its framing within the reply limit, checked before it is made.
    ReplyRoom room{env_.max_message_bytes, env_.max_message_bytes};
    RETURN_IF_ERROR(TakeReplyRoom("response_bytes", uint64_t{req->response_bytes()} + 16, &room));
    if (req->response_bytes() == 0) {
      resp->set_payload(req->payload());
    } else {
      resp->mutable_payload()->assign(req->response_bytes(), '\x5a');
    }
    return absl::OkStatus();
  });
}

}  // namespace kvtier
