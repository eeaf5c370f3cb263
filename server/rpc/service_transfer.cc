// ExportSession and ImportSession: a session moved between daemons as the parts of
// server/session/transfer.h, relayed by the caller.
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>

#include "server/common/mutex.h"
#include "server/common/status_macros.h"
#include "server/rpc/service.h"
#include "server/session/transfer.h"
#include "server/transfer/carrier.h"

namespace kvtier {
namespace {

CarrierKind CarrierOf(v1::ChunkCarrier c) {
  return c == v1::CHUNK_CARRIER_NCCL ? CarrierKind::kNccl : CarrierKind::kSocket;
}

// A transfer with a carrier waits for the other daemon (to join, to take bytes, to
// acknowledge), which gRPC's own threads must never do: such a transfer runs on a thread of its
// own (its pump), and its reactions only hand their outcome over to it.
class Handoff {
 public:
  void Give(bool ok) {
    MutexLock lock(&mu_);
    ok_ = ok;
    cv_.Signal();
  }
  // The next reaction's outcome, once it came (gRPC always delivers one).
  bool Take() {
    MutexLock lock(&mu_);
    while (!ok_.has_value()) WaitOn(&cv_, &mu_);
    return *std::exchange(ok_, std::nullopt);
  }

 private:
  absl::Mutex mu_;  // lock order 21 (server/common/lock_order.h)
  absl::CondVar cv_;
  std::optional<bool> ok_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

// Carried transfers at once, exports and imports together: each holds a thread of its own
// while it waits on the other daemon, for up to the carrier's timeout per wait.
constexpr int kMaxCarried = 4;

absl::Status KvTierService::StartCarried() {
  if (carried_.fetch_add(1, std::memory_order_acq_rel) < kMaxCarried) return absl::OkStatus();
  EndCarried();
  return absl::ResourceExhaustedError(absl::StrCat(
      "carrier: ", kMaxCarried,
      " transfers with a carrier are in progress on this daemon, the most it runs at once; "
      "retry, or move with CHUNK_CARRIER_PARTS"));
}

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

CarrierOptions KvTierService::CarrierOptionsHere(const std::atomic<bool>* cancelled) const {
  CarrierOptions o;
  o.gpu = env_.device != nullptr ? env_.device->options().gpu : -1;
  o.cancelled = cancelled;
  return o;
}

// Writes the parts one at a time: the record is taken under the session's lock when the call
// starts, and each part's chunk data leaves it as the part is made.
class KvTierService::ExportReactor final
    : public Counted<grpc::ServerWriteReactor<v1::ExportSessionResponse>> {
 public:
  ExportReactor(KvTierService* svc, grpc::CallbackServerContext* ctx,
                const v1::ExportSessionRequest* req)
      : Counted(svc, "ExportSession") {
    absl::Status s = Start(ctx, *req);
    if (!s.ok()) {
      Done(s);
      return;
    }
    if (carrier_) {
      pumped_ = true;
      svc_->StartPump([this] { Pump(); });  // it touches nothing of this after Done
      return;
    }
    Write();
  }

  void OnWriteDone(bool ok) override {
    KVTIER_TSAN_ACQUIRE(this);
    if (pumped_) {
      handoff_.Give(ok);
      return;
    }
    if (!ok) {
      Done(absl::CancelledError("ExportSession: the client went away"));
      return;
    }
    Write();
  }

  // May run beside another reaction: ends the carrier's waits, whose reaction then finishes.
  void OnCancel() override { cancelled_.store(true, std::memory_order_relaxed); }

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
      RETURN_IF_ERROR(svc_->StartCarried());
      counted_ = true;
      ASSIGN_OR_RETURN(OfferedCarrier offered, OfferCarrier(CarrierOf(req.carrier()),
                                                            svc_->CarrierOptionsHere(&cancelled_)));
      carrier_ = std::move(offered.carrier);
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
    KVTIER_TSAN_RELEASE(this);
    StartWrite(&resp_);
  }

  // A carried export, on its own thread: each part's bytes go to the carrier before the part
  // goes to the caller; after the end part, the move is done when the importer acknowledges.
  void Pump() {
    std::string carried;
    while (writer_->Next(resp_.mutable_part(), &carried)) {
      if (!carried.empty()) {
        absl::Status s = carrier_->Send(std::move(carried));
        if (!s.ok()) {
          Done(s);
          return;
        }
      }
      KVTIER_TSAN_RELEASE(this);
      StartWrite(&resp_);
      if (!handoff_.Take()) {
        Done(absl::CancelledError("ExportSession: the client went away"));
        return;
      }
    }
    Done(carrier_->Finish());
  }

  void Done(const absl::Status& s) {
    if (s.ok()) svc_->moved_out_bytes_->Inc(static_cast<double>(writer_->data_bytes()));
    writer_.reset();   // the record's bytes go now, not when gRPC lets the reactor go
    carrier_.reset();  // a carrier that failed is aborted here
    if (std::exchange(counted_, false)) svc_->EndCarried();
    End(s);
  }

  std::unique_ptr<TransferWriter> writer_;
  std::atomic<bool> cancelled_{false};  // before carrier_, which reads it to its end
  std::unique_ptr<ByteCarrier> carrier_;
  bool counted_ = false;  // in the service's carried transfers
  bool pumped_ = false;   // run by Pump (set before it starts)
  Handoff handoff_;
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
    if (pumped_) {
      handoff_.Give(ok);
      return;
    }
    if (!ok) {  // the client closed its side
      Stop(Import());
      return;
    }
    const bool header = reader_.has_header();
    absl::Status s = Part();
    if (s.ok() && !header && reader_.carrier() != v1::CHUNK_CARRIER_PARTS) {
      // The bytes come beside the parts, from the exporting daemon: the rest runs on a thread
      // of its own, which joins the carrier and waits for those bytes.
      s = svc_->StartCarried();
      if (s.ok()) {
        counted_ = true;
        pumped_ = true;
        svc_->StartPump([this] { Pump(); });  // it touches nothing of this after Stop
        return;
      }
    }
    if (!s.ok()) {
      Stop(s);
      return;
    }
    Read();
  }

  void OnCancel() override { cancelled_.store(true, std::memory_order_relaxed); }

 private:
  // Ends the call; its carrier (aborted unless it finished) and its count go first.
  void Stop(const absl::Status& s) {
    carrier_.reset();
    if (std::exchange(counted_, false)) svc_->EndCarried();
    End(s);
  }

  void Read() {
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
    RETURN_IF_ERROR(reader_.Add(req_.part(), [this](uint64_t n) { return carrier_->Recv(n); }));
    if (!header && session_id_.empty()) {
      RETURN_IF_ERROR(svc_->env_.sessions->CheckNewSessionId(tenant_, reader_.session_id()));
    }
    if (reader_.complete() && carrier_) return carrier_->Finish();
    return absl::OkStatus();
  }

  // A carried import after its header, on its own thread.
  void Pump() {
    absl::StatusOr<std::unique_ptr<ByteCarrier>> joined =
        JoinCarrier(CarrierOf(reader_.carrier()), reader_.carrier_bootstrap(),
                    svc_->CarrierOptionsHere(&cancelled_));
    absl::Status s = joined.status();
    if (s.ok()) carrier_ = *std::move(joined);
    while (s.ok()) {
      Read();
      if (!handoff_.Take()) {  // the client closed its side
        Stop(Import());
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
    svc_->moved_in_bytes_->Inc(static_cast<double>(reader_.data_bytes()));
    return absl::OkStatus();
  }

  v1::CreateSessionResponse* const resp_;
  std::string tenant_;
  std::string session_id_;
  bool first_ = true;
  TransferReader reader_;
  std::atomic<bool> cancelled_{false};    // before carrier_, which reads it to its end
  std::unique_ptr<ByteCarrier> carrier_;  // the header's, joined when it arrives
  bool counted_ = false;                  // in the service's carried transfers
  bool pumped_ = false;                   // run by Pump after the header (set before it starts)
  Handoff handoff_;
  v1::ImportSessionRequest req_;
};

grpc::ServerReadReactor<v1::ImportSessionRequest>* KvTierService::ImportSession(
    grpc::CallbackServerContext* ctx, v1::CreateSessionResponse* resp) {
  return new ImportReactor(this, ctx, resp);
}

}  // namespace kvtier
