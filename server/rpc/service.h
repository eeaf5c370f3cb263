// The gRPC edge: KvTier on the callback API. absl::Status becomes grpc::Status here and
// nowhere else. Handlers do bounded work (memcpy-sized, under one session's lock) and never
// wait on anything else, so they run on gRPC's callback threads.
#ifndef KVTIER_SERVER_RPC_SERVICE_H_
#define KVTIER_SERVER_RPC_SERVICE_H_

#include <array>
#include <atomic>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "grpcpp/generic/async_generic_service.h"
#include "grpcpp/grpcpp.h"
#include "kvtier/v1/kvtier.grpc.pb.h"
#include "server/common/mutex.h"
#include "server/metrics/registry.h"
#include "server/rpc/auth.h"
#include "server/rpc/fd_channel.h"
#include "server/rpc/select_channel.h"
#include "server/rpc/unix_listener.h"
#include "server/session/prefetcher.h"
#include "server/session/session_manager.h"
#include "server/tier/staging.h"
#include "server/transfer/carrier.h"

namespace kvtier {

// The one place absl codes become gRPC codes (their numbers agree).
grpc::Status ToGrpcStatus(const absl::Status& s);
// UNAVAILABLE: what every call gets once the daemon drains.
absl::Status Draining();

struct ServiceEnv {
  SessionManager* sessions = nullptr;
  LeaseTable* leases = nullptr;
  Tier* host = nullptr;
  Tier* device = nullptr;
  PromotionCache* host_copies = nullptr;
  PromotionCache* device_copies = nullptr;
  metrics::Registry* metrics = nullptr;
  // Null: no prefetch after Select.
  Prefetcher* prefetcher = nullptr;
  // Called once by the Drain RPC, after its reply is queued.
  std::function<void()> on_drain;
  // The largest message the server sends (--max_message_size): replies that could pass it are
  // refused before any work.
  uint64_t max_message_bytes = 64ull << 20;
  // --lease_ttl_ms, told to each attached worker.
  uint32_t lease_ttl_ms = 30'000;
  // Tenants with series of their own in the per-tenant metrics: those the config names
  // (MetricTenants); every other shares "_other", so that no caller makes labels.
  absl::flat_hash_set<std::string> metric_tenants;
  // Who calls: calls on the Unix socket (peers "fd:N") carry their connection's credentials
  // (unix_peer; nullopt: unknown), and `auth` judges them with the call's metadata.
  std::function<std::optional<PeerCredentials>(absl::string_view peer)> unix_peer;
  const Authenticator* auth = nullptr;
  // The descriptor socket OpenSegments issues tickets for (null: none, no Unix socket); asked
  // per call, since the daemon makes it after the service.
  std::function<FdChannel*()> fds_of;
  // The shared-memory Select channels OpenChannel makes (null: none, no Unix socket); asked per
  // call, like fds_of.
  std::function<ChannelHub*()> channels_of;
  // Where OpenStaging makes areas (null: it is refused).
  StagingRegistry* staging = nullptr;
  // What the ImportSession calls in progress may hold at once (--max_import_size; 0: the host
  // tier's capacity), and how long a transfer may wait on its caller (0: for ever).
  uint64_t max_import_bytes = 0;
  uint32_t transfer_idle_timeout_ms = 60'000;
};

// The tenants the config names ("default", quotas' keys, auth's unix_peers, tokens and
// cert_subjects).
absl::flat_hash_set<std::string> MetricTenants(const ServerOptions& options);

class KvTierService final : public v1::KvTier::CallbackService {
 public:
  explicit KvTierService(ServiceEnv env);

  // New calls get UNAVAILABLE from now on, and every Attach stream ends (UNAVAILABLE).
  void StartDraining();
  bool draining() const { return draining_.load(std::memory_order_acquire); }
  // Calls whose handler or reactor has not finished.
  int in_flight() const { return in_flight_.load(std::memory_order_acquire); }
  // Cancels each ExportSession and ImportSession that has waited on its caller (to take its
  // next part, or to send one) for longer than the transfer idle timeout: what it held goes
  // as its reactor ends. The daemon calls it every 100 ms. The number cancelled.
  int EndIdleTransfers();
  // One call of a shared-memory Select channel (ChannelHub::Hooks::serve): the same checks,
  // leases and metrics as the gRPC call of its op.
  absl::Status ServeChannel(const ChannelHub::Call& call, std::string* out);
  // A call of `method` ("Select") refused before it reached the service (the TLS listeners'
  // credentials check, TcpCredentials): logged and counted as every failed call is. An
  // unknown method is left out (gRPC answers it UNIMPLEMENTED), so that no caller can grow
  // the metrics.
  void RecordRefused(absl::string_view method, const absl::Status& why);
  // A call on a connection served apart (Daemon: a Unix-socket peer the config grants
  // nothing, Authenticator::GrantsNothingTo), answered at once, its message never read: with
  // Identify's words (UNAUTHENTICATED naming the uid; INVALID_ARGUMENT for a bad tenant
  // header; UNAVAILABLE while draining), logged and counted as refused, when it names a kvtier
  // method; UNIMPLEMENTED, as gRPC answers an unknown method, otherwise.
  grpc::ServerGenericBidiReactor* AnswerApart(grpc::GenericCallbackServerContext* ctx);

  grpc::ServerUnaryReactor* CreateSession(grpc::CallbackServerContext* ctx,
                                          const v1::CreateSessionRequest* req,
                                          v1::CreateSessionResponse* resp) override;
  grpc::ServerReadReactor<v1::AppendKVRequest>* AppendKV(grpc::CallbackServerContext* ctx,
                                                         v1::AppendKVResponse* resp) override;
  grpc::ServerUnaryReactor* Select(grpc::CallbackServerContext* ctx, const v1::SelectRequest* req,
                                   v1::SelectResponse* resp) override;
  grpc::ServerUnaryReactor* BatchSelect(grpc::CallbackServerContext* ctx,
                                        const v1::BatchSelectRequest* req,
                                        v1::BatchSelectResponse* resp) override;
  grpc::ServerUnaryReactor* Release(grpc::CallbackServerContext* ctx, const v1::ReleaseRequest* req,
                                    v1::ReleaseResponse* resp) override;
  grpc::ServerWriteReactor<v1::BlockHandle>* ReadChunks(grpc::CallbackServerContext* ctx,
                                                        const v1::ReadChunksRequest* req) override;
  grpc::ServerUnaryReactor* ForkSession(grpc::CallbackServerContext* ctx,
                                        const v1::ForkSessionRequest* req,
                                        v1::CreateSessionResponse* resp) override;
  grpc::ServerWriteReactor<v1::ExportSessionResponse>* ExportSession(
      grpc::CallbackServerContext* ctx, const v1::ExportSessionRequest* req) override;
  grpc::ServerReadReactor<v1::ImportSessionRequest>* ImportSession(
      grpc::CallbackServerContext* ctx, v1::CreateSessionResponse* resp) override;
  grpc::ServerUnaryReactor* CloseSession(grpc::CallbackServerContext* ctx,
                                         const v1::CloseSessionRequest* req,
                                         v1::CloseSessionResponse* resp) override;
  grpc::ServerUnaryReactor* ListSessions(grpc::CallbackServerContext* ctx,
                                         const v1::ListSessionsRequest* req,
                                         v1::ListSessionsResponse* resp) override;
  grpc::ServerUnaryReactor* DescribeSession(grpc::CallbackServerContext* ctx,
                                            const v1::DescribeSessionRequest* req,
                                            v1::DescribeSessionResponse* resp) override;
  grpc::ServerUnaryReactor* ListChunks(grpc::CallbackServerContext* ctx,
                                       const v1::ListChunksRequest* req,
                                       v1::ListChunksResponse* resp) override;
  grpc::ServerUnaryReactor* GetTierStats(grpc::CallbackServerContext* ctx,
                                         const v1::GetTierStatsRequest* req,
                                         v1::GetTierStatsResponse* resp) override;
  grpc::ServerUnaryReactor* ListSegments(grpc::CallbackServerContext* ctx,
                                         const v1::ListSegmentsRequest* req,
                                         v1::ListSegmentsResponse* resp) override;
  grpc::ServerUnaryReactor* ListLeases(grpc::CallbackServerContext* ctx,
                                       const v1::ListLeasesRequest* req,
                                       v1::ListLeasesResponse* resp) override;
  grpc::ServerUnaryReactor* OpenSegments(grpc::CallbackServerContext* ctx,
                                         const v1::OpenSegmentsRequest* req,
                                         v1::OpenSegmentsResponse* resp) override;
  grpc::ServerUnaryReactor* OpenChannel(grpc::CallbackServerContext* ctx,
                                        const v1::OpenChannelRequest* req,
                                        v1::OpenChannelResponse* resp) override;
  grpc::ServerUnaryReactor* OpenStaging(grpc::CallbackServerContext* ctx,
                                        const v1::OpenStagingRequest* req,
                                        v1::OpenStagingResponse* resp) override;
  grpc::ServerUnaryReactor* Evict(grpc::CallbackServerContext* ctx, const v1::EvictRequest* req,
                                  v1::EvictResponse* resp) override;
  grpc::ServerUnaryReactor* SetPolicy(grpc::CallbackServerContext* ctx,
                                      const v1::SetPolicyRequest* req,
                                      v1::SetPolicyResponse* resp) override;
  grpc::ServerUnaryReactor* Drain(grpc::CallbackServerContext* ctx, const v1::DrainRequest* req,
                                  v1::DrainResponse* resp) override;
  grpc::ServerUnaryReactor* Echo(grpc::CallbackServerContext* ctx, const v1::EchoRequest* req,
                                 v1::EchoResponse* resp) override;
  grpc::ServerWriteReactor<v1::AttachResponse>* Attach(grpc::CallbackServerContext* ctx,
                                                       const v1::AttachRequest* req) override;

 private:
  // A streaming call's reactor, counted in in_flight() from its construction until gRPC is
  // done with it (OnDone), when it deletes itself; End records the call's metrics (`method`,
  // the time since construction) and finishes it. `Base` is a grpc::Server*Reactor.
  template <typename Base>
  class Counted : public Base {
   protected:
    Counted(KvTierService* svc, const char* method)
        : svc_(svc), method_(method), start_(absl::Now()) {
      svc_->Enter();
    }
    void OnDone() override {
      KVTIER_TSAN_ACQUIRE(this);
      svc_->in_flight_.fetch_sub(1, std::memory_order_acq_rel);
      delete this;
    }
    void End(const absl::Status& s) {
      svc_->Record(method_, s, absl::Now() - start_);
      KVTIER_TSAN_RELEASE(this);
      this->Finish(ToGrpcStatus(s));
    }
    // A stream's first write, from its constructor: gRPC holds a write started there until it
    // has bound the reactor, and then serializes the message on its own thread, out of
    // ThreadSanitizer's sight (the next OnWriteDone, on another thread, may free the bytes it
    // read). So the constructor sends the initial metadata alone, and the reactor writes from
    // OnSendInitialMetadataDone.
    void StartStream() {
      KVTIER_TSAN_RELEASE(this);
      this->StartSendInitialMetadata();
    }
    KvTierService* const svc_;

   private:
    const char* const method_;
    const absl::Time start_;
  };
  class AppendReactor;
  class ReadChunksReactor;
  class ExportReactor;  // service_transfer.cc
  class ImportReactor;
  class AttachReactor;
  class Carried;     // what a transfer with a carrier holds (service_transfer.cc)
  class IdleWatch;   // a transfer's waits on its caller, for EndIdleTransfers (service_transfer.cc)
  class ImportHold;  // an import's bytes, held against max_import_bytes (service_transfer.cc)
  // Runs `fn` on a thread of its own (a carried transfer's pump).
  void StartPump(std::function<void()> fn);

 public:
  // Joins every pump thread: after the server's Wait, so that none is still inside a gRPC call
  // of the server when the daemon deletes it.
  void JoinPumps();

 private:
  // A call begins: counted in in_flight(), and, for ThreadSanitizer, after the daemon made
  // the service (server/rpc/daemon.cc releases it before the server starts).
  void Enter() {
    KVTIER_TSAN_ACQUIRE(this);
    in_flight_.fetch_add(1, std::memory_order_acq_rel);
  }
  // Runs `fn` unless draining, records the call's metrics, and finishes the default reactor.
  template <typename Fn>
  grpc::ServerUnaryReactor* Unary(grpc::CallbackServerContext* ctx, const char* method, Fn&& fn);
  void Record(const char* method, const absl::Status& s, absl::Duration elapsed);
  // What a call acts as (Authenticator::Identify on its peer and metadata). Taken once per
  // call, at its start (Unary hands it to its function; the reactors keep it), so that a
  // call never acts as two tenants.
  absl::StatusOr<Caller> Identify(const grpc::CallbackServerContext* ctx) const;
  // UNAVAILABLE while draining, else Identify: what a new call checks first.
  absl::StatusOr<Caller> Admit(const grpc::CallbackServerContext* ctx) const;

  // One append as `tenant`, for the AppendKV stream and the channels alike: the tokens now
  // stored in every layer. `sources` keeps the worker device memory it names mapped (a
  // stream's, until it ends); null: mapped for this append alone, and the tenant's appended
  // tokens are counted here (a stream counts its own at its end). `session`: as
  // SessionManager::Run's `cached`.
  absl::StatusOr<uint64_t> ApplyAppend(const std::string& tenant, v1::AppendKVRequest* req,
                                       DeviceSources* sources,
                                       std::shared_ptr<Session>* session = nullptr);
  // The bodies of Select and BatchSelect as `tenant`, for gRPC and the channels alike; a reply
  // that may pass `reply_limit` bytes is RESOURCE_EXHAUSTED before any work.
  absl::Status DoSelect(const std::string& tenant, const v1::SelectRequest& req,
                        v1::SelectResponse* resp, uint64_t reply_limit);
  absl::Status DoBatchSelect(const std::string& tenant, const v1::BatchSelectRequest& req,
                             v1::BatchSelectResponse* resp, uint64_t reply_limit);
  // The leases the requests name in release_lease_ids (SelectRequest): every one checked live
  // (the first that is not fails the call naming it, nothing ended), then all ended, before
  // the Select is served (its slots free for it to reuse, as a Release before it would).
  static constexpr int kMaxReleasesPerSelect = 64;
  absl::Status EndNamedLeases(const std::string& tenant,
                              std::span<const v1::SelectRequest* const> requests);
  // One Select of `session`, its reply's bound taken from `room`, and, with a prefetcher, the
  // promotion of its guess queued.
  absl::Status SelectAndGuess(const std::shared_ptr<Session>& session, const v1::SelectRequest& req,
                              v1::SelectResponse* resp, ReplyRoom* room);

  // The per-tenant counters of `tenant` (of "_other" for a tenant the config does not name).
  struct TenantSeries {
    metrics::Counter* selects = nullptr;
    metrics::Counter* appended_tokens = nullptr;
  };
  const TenantSeries& SeriesOf(const std::string& tenant) const;

  // Metric handles per method, made once: a call touches no label maps or registry locks.
  struct MethodMetrics {
    metrics::Histogram* latency = nullptr;
    std::array<std::atomic<metrics::Counter*>, 17> by_code{};  // absl::StatusCode 0..16
  };

  ServiceEnv env_;
  absl::flat_hash_map<std::string, std::unique_ptr<MethodMetrics>> method_metrics_;
  // Chunk data of the sessions ExportSession sent and ImportSession made (whole moves only).
  metrics::Counter* moved_out_bytes_ = nullptr;
  metrics::Counter* moved_in_bytes_ = nullptr;
  // Every series SeriesOf hands out, made at construction and never changed (no lock).
  absl::flat_hash_map<std::string, TenantSeries> tenant_series_;
  absl::Mutex attach_mu_;  // lock order 12 (server/common/lock_order.h)
  absl::flat_hash_set<AttachReactor*> attached_ ABSL_GUARDED_BY(attach_mu_);
  std::atomic<bool> draining_{false};
  std::atomic<int> in_flight_{0};
  // Exports and imports with a carrier in progress: each holds a thread of its own while it
  // waits for the other daemon, so their number is bounded (service_transfer.cc).
  std::atomic<int> carried_{0};
  // The threads that run carried transfers (their pumps), joined when they are done: the next
  // start joins those that finished, JoinPumps all of them.
  struct Pump {
    std::thread thread;
    std::shared_ptr<std::atomic<bool>> done;
  };
  absl::Mutex pumps_mu_;  // lock order 22 (server/common/lock_order.h)
  std::vector<Pump> pumps_ ABSL_GUARDED_BY(pumps_mu_);
  // The transfers in progress, each from its reactor's construction to its OnDone (so that
  // EndIdleTransfers, under the lock, cancels only calls gRPC has not let go).
  absl::Mutex watched_mu_;  // lock order 23 (server/common/lock_order.h)
  absl::flat_hash_set<IdleWatch*> watched_ ABSL_GUARDED_BY(watched_mu_);
  metrics::Counter* idle_ended_ = nullptr;
  // The bytes imports in progress hold, each import's reserved as its parts come.
  std::atomic<uint64_t> import_bytes_{0};
  metrics::Gauge* import_bytes_gauge_ = nullptr;
};

// The service of the gRPC server for connections served apart: every call is AnswerApart's.
class ApartService final : public grpc::CallbackGenericService {
 public:
  explicit ApartService(KvTierService* service) : service_(service) {}
  grpc::ServerGenericBidiReactor* CreateReactor(grpc::GenericCallbackServerContext* ctx) override {
    KVTIER_TSAN_ACQUIRE(this);  // on a gRPC thread: what the daemon made it with
    return service_->AnswerApart(ctx);
  }

 private:
  KvTierService* const service_;
};

}  // namespace kvtier

#endif  // KVTIER_SERVER_RPC_SERVICE_H_
