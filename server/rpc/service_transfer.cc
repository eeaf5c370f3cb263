// ExportSession and ImportSession: a session moved between daemons as the parts of
// server/session/transfer.h, relayed by the caller.
#include <algorithm>
#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>

#include "absl/strings/str_format.h"
#include "server/common/log.h"
#include "server/common/mutex.h"
#include "server/common/size.h"
#include "server/common/status_macros.h"
#include "server/rpc/service.h"
#include "server/session/transfer.h"
#include "server/transfer/carrier.h"

namespace kvtier {
namespace {

CarrierKind CarrierOf(v1::ChunkCarrier c) {
  return c == v1::CHUNK_CARRIER_NCCL ? CarrierKind::kNccl : CarrierKind::kSocket;
}

}  // namespace

void KvTierService::StartPump(std::function<void()> fn) {
  auto done = std::make_shared<std::atomic<bool>>(false);
  std::thread t([fn = std::move(fn), done] {
    fn();
    done->store(true, std::memory_order_release);
  });
  MutexLock lock(&pumps_mu_);
  std::erase_if(pumps_, [](Pump& p) {
    if (!p.done->load(std::memory_order_acquire)) return false;
    p.thread.join();  // it has finished: at once
    return true;
  });
  pumps_.push_back(Pump{std::move(t), std::move(done)});
}

void KvTierService::JoinPumps() {
  std::vector<Pump> pumps;
  {
    MutexLock lock(&pumps_mu_);
    pumps.swap(pumps_);
  }
  for (Pump& p : pumps) p.thread.join();
}

// Carried transfers at once, exports and imports together: each holds a thread of its own
// while it waits on the other daemon, for up to the carrier's timeout per wait.
constexpr int kMaxCarried = 4;

// What a transfer with a carrier holds beside its reactor. Such a transfer waits for the other
// daemon (to join, to take bytes, to acknowledge), which gRPC's own threads must never do: it
// runs on a thread of its own (its pump), and its reactions only hand their outcome over.
class KvTierService::Carried {
 public:
  explicit Carried(KvTierService* svc) : svc_(svc) {}
  ~Carried() { Release(); }

  // A place among the daemon's carried transfers: RESOURCE_EXHAUSTED past kMaxCarried.
  absl::Status Count() {
    if (svc_->carried_.fetch_add(1, std::memory_order_acq_rel) >= kMaxCarried) {
      svc_->carried_.fetch_sub(1, std::memory_order_acq_rel);
      return absl::ResourceExhaustedError(absl::StrCat(
          "carrier: ", kMaxCarried,
          " transfers with a carrier are in progress on this daemon, the most it runs at once; "
          "retry, or move with CHUNK_CARRIER_PARTS"));
    }
    counted_ = true;
    return absl::OkStatus();
  }
  // What the carrier runs on here: this daemon's GPU, and this call's cancellation.
  CarrierOptions Options() const {
    CarrierOptions o;
    o.gpu = svc_->env_.device != nullptr ? svc_->env_.device->options().gpu : -1;
    o.cancelled = &cancelled_;
    return o;
  }
  // Runs the transfer on its pump from here on (it touches nothing of the reactor after End).
  void StartPump(std::function<void()> pump) {
    pumped_ = true;
    svc_->StartPump(std::move(pump));
  }
  // In a reaction: true once the pump runs the transfer, `ok` handed over to it.
  bool Reacted(bool ok) {
    if (!pumped_) return false;
    MutexLock lock(&mu_);
    ok_ = ok;
    cv_.Signal();
    return true;
  }
  // On the pump: the next reaction's outcome, once it came (gRPC always delivers one).
  bool Take() {
    MutexLock lock(&mu_);
    while (!ok_.has_value()) WaitOn(&cv_, &mu_);
    return *std::exchange(ok_, std::nullopt);
  }
  // May run beside another reaction: ends the carrier's waits within about 100 ms.
  void Cancel() { cancelled_.store(true, std::memory_order_relaxed); }
  // The carrier goes (aborted unless it finished), and the place with it.
  void Release() {
    carrier.reset();
    if (std::exchange(counted_, false)) svc_->carried_.fetch_sub(1, std::memory_order_acq_rel);
  }

  std::unique_ptr<ByteCarrier> carrier;

 private:
  KvTierService* const svc_;
  std::atomic<bool> cancelled_{false};  // read by the carrier to its end (Release, at the latest)
  bool counted_ = false;
  bool pumped_ = false;  // set before the pump starts
  absl::Mutex mu_;       // lock order 21 (server/common/lock_order.h)
  absl::CondVar cv_;
  std::optional<bool> ok_ ABSL_GUARDED_BY(mu_);
};

// A transfer's waits on its caller, for EndIdleTransfers. The reactor marks each wait before it
// starts a read or a write (Wait) and each reaction (Woke). The watch is one word, the time the
// wait began (ms) << 2 | its state, so that EndIdleTransfers' look at it and its claim are one
// step: a wait begun again meanwhile has another time, and a reaction that came first makes it
// busy. A call is cancelled at most once, only while it waits, and a reaction that finds it
// cancelled ends the call and does nothing else (an import makes no session).
class KvTierService::IdleWatch {
 public:
  IdleWatch(KvTierService* svc, grpc::CallbackServerContext* ctx) : svc_(svc), ctx_(ctx) {
    MutexLock lock(&svc_->watched_mu_);
    svc_->watched_.insert(this);
  }
  // From the reactor's OnDone, before it is counted out: gRPC lets the call go after.
  void Forget() {
    MutexLock lock(&svc_->watched_mu_);
    svc_->watched_.erase(this);
  }
  void Wait() { word_.store(NowMs() << 2 | kWaiting, std::memory_order_release); }
  // False once EndIdleTransfers cancelled the call.
  bool Woke() {
    uint64_t w = word_.load(std::memory_order_acquire);
    while ((w & 3) == kWaiting) {
      if (word_.compare_exchange_weak(w, kBusy, std::memory_order_acq_rel)) return true;
    }
    return (w & 3) != kEnded;
  }
  bool ended() const { return (word_.load(std::memory_order_acquire) & 3) == kEnded; }
  // Under watched_mu_ (the call not let go): cancels it if it has waited since `cut_ms`.
  bool EndIfWaitingSince(uint64_t cut_ms) {
    uint64_t w = word_.load(std::memory_order_acquire);
    if ((w & 3) != kWaiting || (w >> 2) > cut_ms) return false;
    if (!word_.compare_exchange_strong(w, kEnded, std::memory_order_acq_rel)) return false;
    svc_->idle_ended_->Inc();  // counted before its caller can see it end
    ctx_->TryCancel();         // the pending read or write ends, and its reaction finds kEnded
    return true;
  }
  // The status a call cancelled idle ends with, in the daemon's log and metrics (its caller
  // sees gRPC's CANCELLED).
  absl::Status Idle(const char* method) const {
    return absl::CancelledError(
        absl::StrCat(method, ": the caller moved no part for ", svc_->env_.transfer_idle_timeout_ms,
                     " ms (--transfer_idle_timeout_ms); cancelled, nothing kept"));
  }
  static uint64_t NowMs() {
    return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                     std::chrono::steady_clock::now().time_since_epoch())
                                     .count());
  }

 private:
  static constexpr uint64_t kBusy = 0, kWaiting = 1, kEnded = 2;
  KvTierService* const svc_;
  grpc::CallbackServerContext* const ctx_;
  std::atomic<uint64_t> word_{kBusy};
};

int KvTierService::EndIdleTransfers() {
  const uint32_t timeout = env_.transfer_idle_timeout_ms;
  const uint64_t now = IdleWatch::NowMs();
  if (timeout == 0 || now < timeout) return 0;
  int n = 0;
  {
    MutexLock lock(&watched_mu_);
    for (IdleWatch* w : watched_) n += w->EndIfWaitingSince(now - timeout) ? 1 : 0;
  }
  if (n > 0) KVLOG(warn, "transfer.idle", "cancelled={} idle_timeout_ms={}", n, timeout);
  return n;
}

// An import's bytes, held against ServiceEnv::max_import_bytes from its header (the chunk data
// it names) and grown as its parts come (what they hold, with their records); given back when
// the import ends.
class KvTierService::ImportHold {
 public:
  explicit ImportHold(KvTierService* svc) : svc_(svc) {}
  ~ImportHold() { Release(); }
  // Holds `bytes` in all; RESOURCE_EXHAUSTED naming max_import_size when the imports in
  // progress would pass it (this one's hold unchanged).
  absl::Status GrowTo(uint64_t bytes) {
    if (bytes <= held_) return absl::OkStatus();
    const uint64_t max = svc_->env_.max_import_bytes;
    if (bytes > max) {
      return absl::ResourceExhaustedError(
          absl::StrFormat("ImportSession: the session's parts come to at least %d bytes, more than "
                          "--max_import_size %d lets imports hold at once; nothing is imported",
                          bytes, max));
    }
    const uint64_t more = bytes - held_;
    if (uint64_t all; !ClaimBytes(&svc_->import_bytes_, more, max, &all)) {
      return absl::ResourceExhaustedError(absl::StrFormat(
          "ImportSession: the imports in progress hold %d bytes of --max_import_size %d, and "
          "this one needs %d more; nothing is imported (retry once they end)",
          all, max, more));
    }
    held_ = bytes;
    svc_->import_bytes_gauge_->Add(static_cast<double>(more));
    return absl::OkStatus();
  }
  void Release() {
    if (held_ == 0) return;
    svc_->import_bytes_.fetch_sub(held_, std::memory_order_relaxed);
    svc_->import_bytes_gauge_->Add(-static_cast<double>(held_));
    held_ = 0;
  }

 private:
  KvTierService* const svc_;
  uint64_t held_ = 0;
};

// Writes the parts one at a time: the record is taken under the session's lock when the call
// starts, and each part's chunk data leaves it as the part is made.
class KvTierService::ExportReactor final
    : public Counted<grpc::ServerWriteReactor<v1::ExportSessionResponse>> {
 public:
  ExportReactor(KvTierService* svc, grpc::CallbackServerContext* ctx,
                const v1::ExportSessionRequest* req)
      : Counted(svc, "ExportSession"), watch_(svc, ctx) {
    absl::Status s = Start(ctx, *req);
    if (!s.ok()) {
      Done(s);
      return;
    }
    if (carried_.carrier) {
      carried_.StartPump([this] { Pump(); });
      return;
    }
    watch_.Wait();
    StartStream();
  }

  // The initial metadata sent (StartStream): the first part, as after a part written.
  void OnSendInitialMetadataDone(bool ok) override { OnWriteDone(ok); }

  void OnWriteDone(bool ok) override {
    KVTIER_TSAN_ACQUIRE(this);
    const bool woke = watch_.Woke();
    if (carried_.Reacted(ok && woke)) return;
    if (!woke) {
      Done(watch_.Idle("ExportSession"));
      return;
    }
    if (!ok) {
      Done(absl::CancelledError("ExportSession: the client went away"));
      return;
    }
    Write();
  }

  void OnCancel() override { carried_.Cancel(); }

  void OnDone() override {
    watch_.Forget();
    Counted::OnDone();
  }

 private:
  absl::Status Start(grpc::CallbackServerContext* ctx, const v1::ExportSessionRequest& req) {
    ASSIGN_OR_RETURN(Caller caller, svc_->Admit(ctx));
    if (!v1::ChunkCarrier_IsValid(req.carrier())) {
      return absl::InvalidArgumentError(
          absl::StrCat("carrier: ", req.carrier(), " is not a ChunkCarrier"));
    }
    ASSIGN_OR_RETURN(v1::SessionRecord record,
                     svc_->env_.sessions->Export(caller.tenant, req.session_id()));
    std::string bootstrap;
    if (req.carrier() != v1::CHUNK_CARRIER_PARTS) {
      RETURN_IF_ERROR(carried_.Count());
      ASSIGN_OR_RETURN(OfferedCarrier offered,
                       OfferCarrier(CarrierOf(req.carrier()), carried_.Options()));
      carried_.carrier = std::move(offered.carrier);
      bootstrap = std::move(offered.bootstrap);
    }
    writer_ =
        std::make_unique<TransferWriter>(std::move(record), req.carrier(), std::move(bootstrap));
    return absl::OkStatus();
  }

  void Write() {
    if (!writer_->Next(resp_.mutable_part())) {
      Done(absl::OkStatus());
      return;
    }
    watch_.Wait();
    KVTIER_TSAN_RELEASE(this);
    StartWrite(&resp_);
    // StartWrite serialized resp_ on this thread, and OnWriteDone, on another, writes it next:
    // released again after that read. Only the address is named (the reactor may be gone).
    KVTIER_TSAN_RELEASE(this);
  }

  // A carried export, on its own thread: each part's bytes go to the carrier before the part
  // goes to the caller; after the end part, the move is done when the importer acknowledges.
  void Pump() {
    std::string carried;
    while (writer_->Next(resp_.mutable_part(), &carried)) {
      if (!carried.empty()) {
        absl::Status s = carried_.carrier->Send(std::move(carried));
        if (!s.ok()) {
          Done(s);
          return;
        }
      }
      watch_.Wait();
      KVTIER_TSAN_RELEASE(this);
      StartWrite(&resp_);
      if (!carried_.Take()) {
        Done(watch_.ended() ? watch_.Idle("ExportSession")
                            : absl::CancelledError("ExportSession: the client went away"));
        return;
      }
    }
    Done(carried_.carrier->Finish());
  }

  void Done(const absl::Status& s) {
    if (s.ok()) svc_->moved_out_bytes_->Inc(static_cast<double>(writer_->data_bytes()));
    writer_.reset();     // the record's bytes go now, not when gRPC lets the reactor go
    carried_.Release();  // a carrier that failed is aborted here
    End(s);
  }

  IdleWatch watch_;
  std::unique_ptr<TransferWriter> writer_;
  Carried carried_{svc_};
  v1::ExportSessionResponse resp_;
};

grpc::ServerWriteReactor<v1::ExportSessionResponse>* KvTierService::ExportSession(
    grpc::CallbackServerContext* ctx, const v1::ExportSessionRequest* req) {
  return new ExportReactor(this, ctx, req);
}

// Checks each part as it arrives (TransferReader: a session larger than the host tier is
// refused at its header, before its chunks come); the session is made when the client has
// sent the end part and closed its side.
class KvTierService::ImportReactor final
    : public Counted<grpc::ServerReadReactor<v1::ImportSessionRequest>> {
 public:
  ImportReactor(KvTierService* svc, grpc::CallbackServerContext* ctx,
                v1::CreateSessionResponse* resp)
      : Counted(svc, "ImportSession"),
        ctx_(ctx),
        watch_(svc, ctx),
        resp_(resp),
        reader_(svc->env_.host->options().capacity_bytes) {
    absl::StatusOr<Caller> caller = svc_->Admit(ctx);
    if (!caller.ok()) {
      Stop(caller.status());
      return;
    }
    tenant_ = std::move(caller->tenant);
    Read();
  }

  void OnReadDone(bool ok) override {
    KVTIER_TSAN_ACQUIRE(this);
    const bool woke = watch_.Woke();
    if (carried_.Reacted(ok && woke)) return;
    if (!woke) {
      Stop(watch_.Idle("ImportSession"));
      return;
    }
    if (!ok) {  // the client closed its side, or cancelled the call
      Stop(ImportUnlessCancelled());
      return;
    }
    const bool header = reader_.has_header();
    absl::Status s = Part();
    if (s.ok() && !header && reader_.carrier() != v1::CHUNK_CARRIER_PARTS) {
      // The bytes come beside the parts, from the exporting daemon: the rest runs on a thread
      // of its own, which joins the carrier and waits for those bytes.
      s = carried_.Count();
      if (s.ok()) {
        carried_.StartPump([this] { Pump(); });
        return;
      }
    }
    if (!s.ok()) {
      Stop(s);
      return;
    }
    Read();
  }

  void OnCancel() override { carried_.Cancel(); }

  void OnDone() override {
    watch_.Forget();
    // Cancelled after Import made the session (gRPC may hand a read that a cancel failed to
    // the reactor before the call is marked cancelled, and a cancel may come before the reply
    // is sent): its caller was told nothing was imported, and so it is.
    if (!made_.empty() && ctx_->IsCancelled()) {
      absl::StatusOr<bool> closed = svc_->env_.sessions->Close(tenant_, made_);
      KVLOG(warn, "transfer.import_undone", "session={} closed={}", LogValue(made_),
            closed.ok() && *closed);
    }
    Counted::OnDone();
  }

 private:
  // Ends the call; its carrier (aborted unless it finished), its count, the parts it holds
  // and their hold go first (gRPC may keep the reactor for a while: a slow reader's Finish).
  void Stop(const absl::Status& s) {
    carried_.Release();
    reader_ = TransferReader(0);
    v1::ImportSessionRequest().Swap(&req_);
    hold_.Release();
    End(s);
  }

  // A read that failed ends the client's side, or the call: a cancelled import (the mover
  // gave up, or it went) makes no session, even with every part in.
  absl::Status ImportUnlessCancelled() {
    if (ctx_->IsCancelled()) {
      return absl::CancelledError("ImportSession: the call was cancelled; nothing is imported");
    }
    return Import();
  }

  void Read() {
    watch_.Wait();
    KVTIER_TSAN_RELEASE(this);
    StartRead(&req_);
  }

  // The message just read: its id (the first message's only), then its part; once the end
  // part is in, a carrier's bytes are acknowledged.
  absl::Status Part() {
    if (first_) {
      // The id is checked before any chunk arrives (again when the session is made).
      session_id_ = req_.session_id();
      first_ = false;
      if (!session_id_.empty()) {
        RETURN_IF_ERROR(svc_->env_.sessions->CheckNewSessionId(tenant_, session_id_));
      }
    } else if (!req_.session_id().empty()) {
      return absl::InvalidArgumentError(
          "session_id: set on a later message of the stream; only the first names the session");
    }
    const bool header = reader_.has_header();
    RETURN_IF_ERROR(
        reader_.Add(req_.part(), [this](uint64_t n) { return carried_.carrier->Recv(n); }));
    // What the import holds: from the header on, the chunk data it names and a sixteenth
    // more for the records around it (their framing and fields, a few percent), short of the
    // bound; then the parts so far (a carrier's chunk data beside them), when they come to
    // more. So an import admitted at its header is seldom refused later for others'.
    part_bytes_ += req_.part().size();
    const uint64_t declared = reader_.declared_bytes();
    const uint64_t max = svc_->env_.max_import_bytes;
    const uint64_t named = declared > max ? declared : std::min(max, declared + declared / 16);
    const uint64_t carried =
        reader_.carrier() != v1::CHUNK_CARRIER_PARTS ? reader_.data_bytes() : 0;
    RETURN_IF_ERROR(hold_.GrowTo(std::max(named, part_bytes_ + carried)));
    if (!header && session_id_.empty()) {
      RETURN_IF_ERROR(svc_->env_.sessions->CheckNewSessionId(tenant_, reader_.session_id()));
    }
    if (reader_.complete() && carried_.carrier) return carried_.carrier->Finish();
    return absl::OkStatus();
  }

  // A carried import after its header, on its own thread.
  void Pump() {
    absl::StatusOr<std::unique_ptr<ByteCarrier>> joined =
        JoinCarrier(CarrierOf(reader_.carrier()), reader_.carrier_bootstrap(), carried_.Options());
    absl::Status s = joined.status();
    if (s.ok()) carried_.carrier = *std::move(joined);
    while (s.ok()) {
      Read();
      if (!carried_.Take()) {  // the client closed its side, or the call was cancelled
        Stop(watch_.ended() ? watch_.Idle("ImportSession") : ImportUnlessCancelled());
        return;
      }
      s = Part();
    }
    Stop(s);
  }

  absl::Status Import() {
    if (svc_->draining()) return Draining();
    ASSIGN_OR_RETURN(v1::SessionRecord record, reader_.Take());
    ASSIGN_OR_RETURN(*resp_, svc_->env_.sessions->Import(tenant_, std::move(record), session_id_));
    made_ = resp_->session_id();
    svc_->moved_in_bytes_->Inc(static_cast<double>(reader_.data_bytes()));
    return absl::OkStatus();
  }

  grpc::CallbackServerContext* const ctx_;
  IdleWatch watch_;
  v1::CreateSessionResponse* const resp_;
  std::string tenant_;
  std::string session_id_;
  bool first_ = true;
  TransferReader reader_;
  ImportHold hold_{svc_};
  uint64_t part_bytes_ = 0;  // the parts' bytes received
  std::string made_;         // the session Import made
  Carried carried_{svc_};    // its carrier is the header's, joined when it arrives
  v1::ImportSessionRequest req_;
};

grpc::ServerReadReactor<v1::ImportSessionRequest>* KvTierService::ImportSession(
    grpc::CallbackServerContext* ctx, v1::CreateSessionResponse* resp) {
  return new ImportReactor(this, ctx, resp);
}

}  // namespace kvtier
