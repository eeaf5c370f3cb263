// ExportSession and ImportSession: a session moved between daemons as the parts of
// server/session/transfer.h, relayed by the caller.
#include <memory>
#include <string>

#include "server/common/mutex.h"
#include "server/common/status_macros.h"
#include "server/rpc/service.h"
#include "server/session/transfer.h"

namespace kvtier {

// Writes the parts one at a time: the record is taken under the session's lock when the call
// starts, and each part's chunk data leaves it as the part is made.
class KvTierService::ExportReactor final
    : public Counted<grpc::ServerWriteReactor<v1::ExportSessionResponse>> {
 public:
  ExportReactor(KvTierService* svc, grpc::CallbackServerContext* ctx,
                const v1::ExportSessionRequest* req)
      : Counted(svc, "ExportSession") {
    absl::StatusOr<Caller> caller = svc_->Admit(ctx);
    absl::Status s = caller.status();
    if (s.ok()) {
      absl::StatusOr<v1::SessionRecord> record =
          svc_->env_.sessions->Export(caller->tenant, req->session_id());
      s = record.status();
      if (s.ok()) writer_ = std::make_unique<TransferWriter>(*std::move(record));
    }
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

 private:
  void Write() {
    if (!writer_->Next(resp_.mutable_part())) {
      Done(absl::OkStatus());
      return;
    }
    KVTIER_TSAN_RELEASE(this);
    StartWrite(&resp_);
  }

  void Done(const absl::Status& s) {
    if (s.ok()) svc_->moved_out_bytes_->Inc(static_cast<double>(writer_->data_bytes()));
    writer_.reset();  // the record's bytes go now, not when gRPC lets the reactor go
    End(s);
  }

  std::unique_ptr<TransferWriter> writer_;
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
    if (s.ok()) s = reader_.Add(req_.part());
    if (s.ok() && !header && session_id_.empty()) {
      s = svc_->env_.sessions->CheckNewSessionId(tenant_, reader_.session_id());
    }
    if (!s.ok()) {
      End(s);
      return;
    }
    Read();
  }

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
  v1::ImportSessionRequest req_;
};

grpc::ServerReadReactor<v1::ImportSessionRequest>* KvTierService::ImportSession(
    grpc::CallbackServerContext* ctx, v1::CreateSessionResponse* resp) {
  return new ImportReactor(this, ctx, resp);
}

}  // namespace kvtier
