// ExportSession and ImportSession: a session moved between daemons as the parts of
// server/session/transfer.h, relayed by the caller.
#include <memory>
#include <string>

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

}  // namespace

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
    Write();
  }

  void OnWriteDone(bool ok) override {
    KVTIER_TSAN_ACQUIRE(this);
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
    if (!writer_->Next(resp_.mutable_part(), &carried_)) {
      // The end part is out: with a carrier, the move is done when the importer acknowledges.
      Done(carrier_ ? carrier_->Finish() : absl::OkStatus());
      return;
    }
    if (!carried_.empty()) {  // on its way beside the part, before the part is
      absl::Status s = carrier_->Send(std::move(carried_));
      if (!s.ok()) {
        Done(s);
        return;
      }
    }
    KVTIER_TSAN_RELEASE(this);
    StartWrite(&resp_);
  }

  void Done(const absl::Status& s) {
    if (s.ok()) svc_->moved_out_bytes_->Inc(static_cast<double>(writer_->data_bytes()));
    writer_.reset();   // the record's bytes go now, not when gRPC lets the reactor go
    carrier_.reset();  // a carrier that failed is aborted here
    End(s);
  }

  std::unique_ptr<TransferWriter> writer_;
  std::atomic<bool> cancelled_{false};  // before carrier_, which reads it to its end
  std::unique_ptr<ByteCarrier> carrier_;
  std::string carried_;
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
      End(caller.status());
      return;
    }
    tenant_ = std::move(caller->tenant);
    Read();
  }

  void OnReadDone(bool ok) override {
    KVTIER_TSAN_ACQUIRE(this);
    if (!ok) {  // the client closed its side
      End(Import());
      return;
    }
    absl::Status s;
    if (first_) {
      // The id is checked before any chunk arrives (again when the session is made).
      session_id_ = req_.session_id();
      first_ = false;
      if (!session_id_.empty()) s = svc_->env_.sessions->CheckNewSessionId(tenant_, session_id_);
    } else if (!req_.session_id().empty()) {
      s = absl::InvalidArgumentError(
          "session_id: set on a later message of the stream; only the first names the session");
    }
    const bool header = reader_.has_header();
    if (s.ok()) {
      s = reader_.Add(req_.part(), [this](uint64_t n) { return carrier_->Recv(n); });
    }
    if (s.ok() && !header && session_id_.empty()) {
      s = svc_->env_.sessions->CheckNewSessionId(tenant_, reader_.session_id());
    }
    if (s.ok() && !header && reader_.carrier() != v1::CHUNK_CARRIER_PARTS) {
      // The bytes come beside the parts: join the exporter's carrier (this waits for it).
      absl::StatusOr<std::unique_ptr<ByteCarrier>> joined =
          JoinCarrier(CarrierOf(reader_.carrier()), reader_.carrier_bootstrap(),
                      svc_->CarrierOptionsHere(&cancelled_));
      s = joined.status();
      if (s.ok()) carrier_ = *std::move(joined);
    }
    // Everything arrived and checked: the exporter may count its bytes delivered.
    if (s.ok() && reader_.complete() && carrier_) s = carrier_->Finish();
    if (!s.ok()) {
      End(s);
      return;
    }
    Read();
  }

  void OnCancel() override { cancelled_.store(true, std::memory_order_relaxed); }

 private:
  void Read() {
    KVTIER_TSAN_RELEASE(this);
    StartRead(&req_);
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
  v1::ImportSessionRequest req_;
};

grpc::ServerReadReactor<v1::ImportSessionRequest>* KvTierService::ImportSession(
    grpc::CallbackServerContext* ctx, v1::CreateSessionResponse* resp) {
  return new ImportReactor(this, ctx, resp);
}

}  // namespace kvtier
