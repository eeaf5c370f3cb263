#include "kvtier/client.h"

#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <fstream>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "client/cpp/socket_io.h"
#include "grpc/grpc.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"

namespace kvtier {

absl::Status FromGrpcStatus(const grpc::Status& s) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
}

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(const std::string& address,
                                                        ClientOptions options) {
  if (address.empty()) return absl::InvalidArgumentError("address: empty");
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(options.max_message_bytes);
  args.SetMaxSendMessageSize(options.max_message_bytes);
  // A daemon that restarts is tried again within a second, however long it was away (gRPC's
  // own backoff grows to two minutes between tries).
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  std::shared_ptr<grpc::ChannelCredentials> creds = grpc::InsecureChannelCredentials();
  if (!options.tls_ca_file.empty()) {
    grpc::SslCredentialsOptions ssl;
    const std::pair<const std::string*, std::string*> files[] = {
        {&options.tls_ca_file, &ssl.pem_root_certs},
        {&options.tls_cert_file, &ssl.pem_cert_chain},
        {&options.tls_key_file, &ssl.pem_private_key}};
    for (const auto& [path, pem] : files) {
      if (path->empty()) continue;
      std::ifstream in(*path);
      pem->assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
      if (pem->empty()) {
        return absl::InvalidArgumentError(
            absl::StrCat("tls: \"", *path, "\" cannot be read or is empty"));
      }
    }
    if (ssl.pem_cert_chain.empty() != ssl.pem_private_key.empty()) {
      return absl::InvalidArgumentError("tls_cert_file and tls_key_file: both or neither");
    }
    creds = grpc::SslCredentials(ssl);
  } else if (!options.tls_cert_file.empty() || !options.tls_key_file.empty()) {
    return absl::InvalidArgumentError("tls_cert_file and tls_key_file need tls_ca_file");
  }
  auto channel = grpc::CreateCustomChannel(address, creds, args);
  if (channel == nullptr) {
    return absl::InvalidArgumentError("address: \"" + address + "\" is not a gRPC target");
  }
  return std::unique_ptr<Client>(new Client(address, std::move(channel), std::move(options)));
}

namespace {

// gRPC 1.51 shuts its library down when its last object goes, joining its executor threads; one
// of them can be inside a poll with a timer seconds away (after an Attach stream was cancelled:
// up to 10 s seen), so a worker's last ~Client would hang its exit. gRPC stays initialized for
// the rest of the process instead, whose exit ends those threads.
void KeepGrpcInitialized() { [[maybe_unused]] static const bool once = (grpc_init(), true); }

}  // namespace

// The Attach stream on gRPC's async API, with a completion queue of its own that no thread
// waits on: one read for the worker id, a second that completes when the stream ends, each
// taken from the queue only by the calls below (under the client's attach_mu_). gRPC's
// callback API would start two threads in the process (its callback queue's) that wait in
// gRPC's poller for as long as the channel lives, and take the socket's events from a worker
// blocked in a call, handing each of its answers over from one thread to another: some 60 us
// of CPU a Select (docs/design.md).
class Client::Attachment {
 public:
  Attachment(v1::KvTier::Stub& stub, const ClientOptions& options) {
    Client::AddCredentials(options, &ctx_);
    reader_ = stub.PrepareAsyncAttach(&ctx_, req_, &cq_);
    reader_->StartCall(Tag(kStarted));
    reader_->Read(&resp_, Tag(kRead));
    pending_ = 2;
  }
  ~Attachment() {
    ctx_.TryCancel();
    while (pending_ > 0 || !done_) {
      if (pending_ == 0) Finish();  // the read and the start are back: the status next
      void* tag = nullptr;
      bool ok = false;
      if (!cq_.Next(&tag, &ok)) break;
      Take(tag, ok);
    }
    cq_.Shutdown();
    void* tag = nullptr;
    bool ok = false;
    while (cq_.Next(&tag, &ok)) {
    }
  }

  // The worker id once the daemon sent it; the stream's status if it ended first; DEADLINE_
  // EXCEEDED after `timeout`.
  absl::StatusOr<std::string> Wait(absl::Duration timeout) {
    const auto deadline = absl::ToChronoTime(absl::Now() + timeout);  // (infinite: max())
    while (!done_ && (worker_.empty() || ended_)) {
      if (ended_ && pending_ == 0) Finish();
      void* tag = nullptr;
      bool ok = false;
      const auto got = cq_.AsyncNext(&tag, &ok, deadline);
      if (got != grpc::CompletionQueue::GOT_EVENT) break;
      Take(tag, ok);
    }
    if (!worker_.empty() && !ended_) return worker_;
    if (done_) return status_.ok() ? absl::UnavailableError("Attach: the stream ended") : status_;
    if (ended_) return absl::UnavailableError("Attach: the stream ended");
    return absl::DeadlineExceededError("Attach: no worker id from the daemon in time");
  }
  // Whether the stream has ended, from what its queue holds now (it does not wait).
  bool ended() {
    void* tag = nullptr;
    bool ok = false;
    while (cq_.AsyncNext(&tag, &ok, std::chrono::system_clock::time_point()) ==
           grpc::CompletionQueue::GOT_EVENT) {
      Take(tag, ok);
    }
    return ended_;
  }

 private:
  enum Op : intptr_t { kStarted = 1, kRead, kFinished };
  static void* Tag(Op op) { return reinterpret_cast<void*>(op); }

  // One operation back from the queue.
  void Take(void* tag, bool ok) {
    --pending_;
    switch (static_cast<Op>(reinterpret_cast<intptr_t>(tag))) {
      case kStarted:
        if (!ok) ended_ = true;  // no stream: its read fails too
        break;
      case kRead:
        if (!ok) {
          ended_ = true;
          break;
        }
        if (worker_.empty()) worker_ = resp_.worker_id();
        reader_->Read(&resp_, Tag(kRead));  // back only when the stream ends
        ++pending_;
        break;
      case kFinished:
        done_ = true;
        status_ = FromGrpcStatus(status_wire_);
        break;
    }
  }
  // Asks for the stream's status, once nothing else is outstanding.
  void Finish() {
    if (finishing_) return;
    finishing_ = true;
    reader_->Finish(&status_wire_, Tag(kFinished));
    ++pending_;
  }

  grpc::CompletionQueue cq_;
  grpc::ClientContext ctx_;
  v1::AttachRequest req_;
  v1::AttachResponse resp_;
  std::unique_ptr<grpc::ClientAsyncReader<v1::AttachResponse>> reader_;
  int pending_ = 0;     // operations asked for and not yet back from cq_
  bool ended_ = false;  // the start or a read failed: the stream is over
  bool finishing_ = false;
  bool done_ = false;  // the status is in
  grpc::Status status_wire_;
  absl::Status status_;
  std::string worker_;
};

// The calls of one client's moves that gRPC holds (MoveSession), counting those a mover gave
// up on (a stalled daemon). Its channel must not go while any are held: under ASan, one going
// then freed gRPC's callback queue twice.
namespace internal {
struct MoveCalls {
  std::mutex mu;
  std::condition_variable cv;
  int calls = 0;
  void Add() {
    std::lock_guard<std::mutex> lock(mu);
    ++calls;
  }
  void Done() {
    std::lock_guard<std::mutex> lock(mu);
    if (--calls == 0) cv.notify_all();
  }
};
}  // namespace internal

Client::Client(std::string address, std::shared_ptr<grpc::Channel> channel, ClientOptions options)
    : address_((KeepGrpcInitialized(), std::move(address))),
      channel_(std::move(channel)),
      moves_(std::make_shared<internal::MoveCalls>()),
      stub_(v1::KvTier::NewStub(channel_)),
      options_(std::move(options)) {}

Client::~Client() {
  {
    std::lock_guard lock(attach_mu_);
    attachment_.reset();
  }
  // Moves' calls gRPC still holds end once their daemon answers again: this waits for them,
  // at most the timeout (5 s when it is longer), so that a stalled daemon never holds it.
  std::unique_lock<std::mutex> lock(moves_->mu);
  const bool ended = moves_->cv.wait_for(
      lock, absl::ToChronoNanoseconds(std::min(options_.timeout, absl::Seconds(5))),
      [&] { return moves_->calls == 0; });
  // Else the channel stays for good (where a leak check still reaches it): the last of it
  // must never go on one of gRPC's threads.
  if (!ended) {
    static std::mutex kept_mu;
    static auto* kept = new std::vector<std::shared_ptr<grpc::Channel>>;
    std::lock_guard<std::mutex> keep(kept_mu);
    kept->push_back(channel_);
  }
}

absl::StatusOr<std::string> Client::WorkerId() { return AttachedWorker(/*recheck=*/true); }

absl::StatusOr<std::string> Client::AttachedWorker(bool recheck) {
  std::lock_guard lock(attach_mu_);
  if (!options_.attach || attach_unsupported_) return std::string();
  if (attachment_ != nullptr && recheck && attachment_->ended()) attachment_.reset();
  if (attachment_ == nullptr) attachment_ = std::make_unique<Attachment>(*stub_, options_);
  absl::StatusOr<std::string> id = attachment_->Wait(options_.timeout);
  if (id.ok()) return id;
  attachment_.reset();
  if (id.status().code() == absl::StatusCode::kUnimplemented) {  // an older daemon
    attach_unsupported_ = true;
    return std::string();
  }
  return id.status();
}

namespace {

// Names `worker` in each request that names none; true when one was named.
bool NameWorker(const std::string& worker, v1::SelectRequest* r) {
  if (worker.empty() || !r->worker_id().empty()) return false;
  r->set_worker_id(worker);
  return true;
}
bool NameWorker(const std::string& worker, v1::BatchSelectRequest* r) {
  bool any = false;
  for (auto& one : *r->mutable_requests()) any |= NameWorker(worker, &one);
  return any;
}

const absl::Status& StatusOf(const absl::Status& s) { return s; }
template <typename T>
const absl::Status& StatusOf(const absl::StatusOr<T>& s) {
  return s.status();
}

// The daemon no longer knows the worker id a request named.
bool LostWorker(const absl::Status& s) {
  return s.code() == absl::StatusCode::kNotFound && absl::StrContains(s.message(), "worker_id");
}

}  // namespace

template <typename Req, typename Call>
auto Client::WithWorker(const Req& req, Call&& call) -> decltype(call(req)) {
  if (!options_.attach) return call(req);
  for (int attempt = 0;; ++attempt) {
    // The stream is looked at again only after a call the daemon refused for naming a worker it
    // no longer has (it restarted, or the stream ended): a stream that ends detaches its worker
    // at once, so each call need not look first.
    absl::StatusOr<std::string> worker = AttachedWorker(/*recheck=*/attempt > 0);
    if (!worker.ok()) return worker.status();
    Req named = req;
    const bool set = NameWorker(*worker, &named);
    auto r = call(named);
    // It restarted, or the stream ended just now: attach anew, once.
    if (set && attempt == 0 && LostWorker(StatusOf(r))) continue;
    return r;
  }
}

void Client::Prepare(grpc::ClientContext* ctx) const {
  // absl saturates an infinite timeout to time_point::max(), which gRPC takes as no deadline
  // (now() plus the longest chrono duration overflowed, to a deadline in the past).
  ctx->set_deadline(absl::ToChronoTime(absl::Now() + options_.timeout));
  AddCredentials(options_, ctx);
}

void Client::AddCredentials(const ClientOptions& options, grpc::ClientContext* ctx) {
  if (!options.tenant.empty()) ctx->AddMetadata("x-kvtier-tenant", options.tenant);
  if (!options.token.empty()) ctx->AddMetadata("authorization", "Bearer " + options.token);
}

namespace {

// After a call that found the daemon unreachable. gRPC's channel only reconnects (to a daemon
// that restarted) while some thread of the process waits inside gRPC, and between calls none of
// this client's does (Attachment): a moment's wait here lets the next call find it connected,
// rather than failing again until gRPC's own timers come round (about 5 s seen).
void AwaitReconnect(grpc::Channel& channel) {
  if (channel.GetState(/*try_to_connect=*/true) == GRPC_CHANNEL_READY) return;
  channel.WaitForConnected(std::chrono::system_clock::now() + std::chrono::milliseconds(100));
}

// Calls a unary method of the stub into `resp` (cleared on an error: nothing of an earlier
// answer is taken for this one's) and returns its status.
template <typename Resp, typename Req, typename Method>
absl::Status CallInto(v1::KvTier::Stub& stub, grpc::Channel& channel, Method method, const Req& req,
                      Resp* resp, const std::function<void(grpc::ClientContext*)>& prepare) {
  grpc::ClientContext ctx;
  prepare(&ctx);
  const grpc::Status s = (stub.*method)(&ctx, req, resp);
  if (s.ok()) return absl::OkStatus();
  resp->Clear();
  if (s.error_code() == grpc::StatusCode::UNAVAILABLE) AwaitReconnect(channel);
  return FromGrpcStatus(s);
}

// Calls a unary method of the stub and returns its response or status.
template <typename Resp, typename Req, typename Method>
absl::StatusOr<Resp> Call(v1::KvTier::Stub& stub, grpc::Channel& channel, Method method,
                          const Req& req,
                          const std::function<void(grpc::ClientContext*)>& prepare) {
  Resp resp;
  if (absl::Status s = CallInto(stub, channel, method, req, &resp, prepare); !s.ok()) return s;
  return resp;
}

}  // namespace

#define KVTIER_CALL(Resp, Method, req)                          \
  Call<Resp>(*stub_, *channel_, &v1::KvTier::Stub::Method, req, \
             [this](grpc::ClientContext* c) { Prepare(c); })

absl::StatusOr<v1::CreateSessionResponse> Client::CreateSession(
    const v1::CreateSessionRequest& req) {
  return KVTIER_CALL(v1::CreateSessionResponse, CreateSession, req);
}

absl::StatusOr<uint64_t> Client::AppendKV(const std::vector<v1::AppendKVRequest>& requests) {
  std::unique_ptr<AppendWriter> writer = OpenAppend();
  for (const auto& r : requests) {
    if (!writer->Write(r)) break;  // the server ended the stream; Finish says why
  }
  return writer->Finish();
}

// The call under an AppendWriter, on a completion queue of its own that the writing thread
// polls for each step's end, one step at a time (as gRPC's blocking API does, with no other
// thread woken), bounded by the stream's deadline and a grace.
struct AppendWriter::Call {
  grpc::CompletionQueue cq;
  grpc::ClientContext ctx;
  v1::AppendKVResponse response;
  grpc::Status status;
  std::unique_ptr<grpc::ClientAsyncWriter<v1::AppendKVRequest>> writer;
  absl::Time give_up = absl::InfiniteFuture();

  // Whether the step in flight ended well; nullopt when it had not ended by give_up.
  std::optional<bool> Wait() {
    void* tag = nullptr;
    bool ok = false;
    const auto until = give_up == absl::InfiniteFuture()
                           ? std::chrono::system_clock::time_point::max()
                           : absl::ToChronoTime(give_up);
    switch (cq.AsyncNext(&tag, &ok, until)) {
      case grpc::CompletionQueue::GOT_EVENT:
        return ok;
      case grpc::CompletionQueue::TIMEOUT:
        return std::nullopt;
      case grpc::CompletionQueue::SHUTDOWN:
        break;
    }
    return false;
  }
};

AppendWriter::AppendWriter() : call_(std::make_unique<Call>()) {}

std::unique_ptr<AppendWriter> Client::OpenAppend() {
  std::unique_ptr<AppendWriter> w(new AppendWriter());
  AppendWriter::Call& c = *w->call_;
  Prepare(&c.ctx);
  // A grace past the deadline, within which gRPC itself ends every step that can end.
  if (options_.timeout < absl::Hours(24 * 365)) {
    c.give_up = absl::Now() + options_.timeout + absl::Seconds(1);
  }
  c.writer = stub_->PrepareAsyncAppendKV(&c.ctx, &c.response, &c.cq);
  c.writer->StartCall(&c);
  const std::optional<bool> started = c.Wait();
  if (!started) {
    w->GiveUp();
  } else if (!*started) {
    w->ended_ = true;
  }
  return w;
}

void AppendWriter::GiveUp() {
  call_->ctx.TryCancel();
  std::thread([c = std::move(call_)] {
    c->cq.Shutdown();
    void* tag;
    bool ok;
    while (c->cq.Next(&tag, &ok)) {
    }
  }).detach();
}

AppendWriter::~AppendWriter() {
  if (finished_ || call_ == nullptr) return;
  call_->ctx.TryCancel();
  call_->writer->Finish(&call_->status, call_.get());
  call_->give_up = std::max(call_->give_up, absl::Now() + absl::Seconds(1));  // cancelled: soon
  if (!call_->Wait()) GiveUp();
}

bool AppendWriter::Write(const v1::AppendKVRequest& request) {
  if (finished_ || ended_ || call_ == nullptr) return false;
  call_->writer->Write(request, call_.get());
  const std::optional<bool> ok = call_->Wait();
  if (!ok) {
    GiveUp();
    return false;
  }
  if (!*ok) ended_ = true;
  return *ok;
}

absl::StatusOr<uint64_t> AppendWriter::Finish() {
  if (finished_) return absl::FailedPreconditionError("AppendWriter: the stream is finished");
  finished_ = true;
  auto gave_up = [] {
    return absl::DeadlineExceededError(
        "AppendKV: the stream did not end within the client's timeout from its open and a "
        "second (a stalled daemon or link); it is cancelled, and what it stored stays stored");
  };
  if (call_ == nullptr) return gave_up();
  if (!ended_) {
    call_->writer->WritesDone(call_.get());
    if (!call_->Wait()) {
      GiveUp();
      return gave_up();
    }
  }
  call_->writer->Finish(&call_->status, call_.get());
  if (!call_->Wait()) {
    GiveUp();
    return gave_up();
  }
  if (!call_->status.ok()) return FromGrpcStatus(call_->status);
  return call_->response.num_tokens();
}

absl::StatusOr<v1::SelectResponse> Client::Select(const v1::SelectRequest& req) {
  return WithWorker(req, [this](const v1::SelectRequest& r) {
    return KVTIER_CALL(v1::SelectResponse, Select, r);
  });
}

absl::Status Client::Select(const v1::SelectRequest& req, v1::SelectResponse* out) {
  return WithWorker(req, [this, out](const v1::SelectRequest& r) {
    return CallInto(*stub_, *channel_, &v1::KvTier::Stub::Select, r, out,
                    [this](grpc::ClientContext* c) { Prepare(c); });
  });
}

absl::StatusOr<v1::BatchSelectResponse> Client::BatchSelect(const v1::BatchSelectRequest& req) {
  return WithWorker(req, [this](const v1::BatchSelectRequest& r) {
    return KVTIER_CALL(v1::BatchSelectResponse, BatchSelect, r);
  });
}

absl::Status Client::Release(const std::string& lease_id) {
  v1::ReleaseRequest req;
  req.set_lease_id(lease_id);
  return KVTIER_CALL(v1::ReleaseResponse, Release, req).status();
}

absl::StatusOr<std::vector<v1::BlockHandle>> Client::ReadChunks(
    const std::string& session_id, const std::vector<uint64_t>& chunk_ids) {
  grpc::ClientContext ctx;
  Prepare(&ctx);
  v1::ReadChunksRequest req;
  req.set_session_id(session_id);
  for (uint64_t id : chunk_ids) req.add_chunk_ids(id);
  auto reader = stub_->ReadChunks(&ctx, req);
  std::vector<v1::BlockHandle> out;
  v1::BlockHandle h;
  while (reader->Read(&h)) out.push_back(std::move(h));
  grpc::Status s = reader->Finish();
  if (!s.ok()) return FromGrpcStatus(s);
  return out;
}

absl::StatusOr<v1::CreateSessionResponse> Client::ForkSession(const v1::ForkSessionRequest& req) {
  return KVTIER_CALL(v1::CreateSessionResponse, ForkSession, req);
}

namespace {

// What a move's two calls report, for the thread that drives it (Client::MoveSession), which
// waits on `cv` for each step with its own bound.
struct MoveEvents {
  std::mutex mu;
  std::condition_variable cv;
  bool read = false, read_ok = false;    // the export's last read ended (a part, or none)
  bool wrote = false, wrote_ok = false;  // the import's last write ended
  bool export_done = false, import_done = false;
  grpc::Status exported, imported;
};

// One call of a move as a callback reactor (Reactor: gRPC's ClientReadReactor or
// ClientWriteReactor), which only reports to MoveEvents. The mover starts each step from its
// own thread, so the call starts with a hold (gRPC's AddHold) that the mover lets go once it
// starts no more: OnDone never comes before. It keeps itself alive until gRPC is done with it
// (`self_`), so that a mover that gives up on a stalled daemon returns while gRPC still holds
// the call (a write into a connection whose peer stopped reading completes only when that peer
// reads, cancelled or not), and counts in its client's MoveCalls meanwhile.
template <typename Reactor>
class MoveCall : public Reactor {
 public:
  MoveCall(std::shared_ptr<MoveEvents> events, std::shared_ptr<internal::MoveCalls> calls)
      : events_(std::move(events)), calls_(std::move(calls)) {}
  grpc::ClientContext ctx;

 protected:
  // After the call's own setup, before gRPC's StartCall. gRPC hands the reactor to its own
  // threads where ThreadSanitizer cannot see it: every callback reaches the reactor's fields
  // through `started_`'s acquire, which this store releases.
  void Started(std::shared_ptr<MoveCall> self) {
    self_ = std::move(self);
    calls_->Add();
    this->AddHold();
    started_.store(events_.get(), std::memory_order_release);
  }
  // The reactions gRPC runs before its own bookkeeping of the call, which the mover does not
  // wait for: each acquires `started_` too, so that ThreadSanitizer sees that bookkeeping
  // (made with the call, on the mover's thread) handed to gRPC's thread.
  void OnReadInitialMetadataDone(bool) override { Acquire(); }
  void Acquire() { (void)started_.load(std::memory_order_acquire); }
  // Under the events' lock: `f(events)`, then a notify.
  template <typename F>
  void Report(F f) {
    MoveEvents* e = started_.load(std::memory_order_acquire);
    std::lock_guard<std::mutex> lock(e->mu);
    f(*e);
    e->cv.notify_all();
  }
  void Done(grpc::Status MoveEvents::*status, bool MoveEvents::*done, const grpc::Status& s) {
    Report([&](MoveEvents& e) {
      e.*status = s;
      e.*done = true;
    });
    std::shared_ptr<internal::MoveCalls> calls = calls_;
    { auto last = std::move(self_); }  // the context (and its channel) may go here
    calls->Done();                     // only then: the channel's client may go
  }

 private:
  const std::shared_ptr<MoveEvents> events_;
  const std::shared_ptr<internal::MoveCalls> calls_;
  std::shared_ptr<MoveCall> self_;
  std::atomic<MoveEvents*> started_{nullptr};
};

class ExportReader : public MoveCall<grpc::ClientReadReactor<v1::ExportSessionResponse>> {
 public:
  using MoveCall::MoveCall;
  void Start(v1::KvTier::Stub* stub, std::shared_ptr<ExportReader> self) {
    stub->async()->ExportSession(&ctx, &req, this);
    StartRead(&part);
    Started(std::move(self));
    StartCall();
  }
  void OnReadDone(bool ok) override {
    Report([ok](MoveEvents& e) {
      e.read = true;
      e.read_ok = ok;
    });
  }
  void OnDone(const grpc::Status& s) override {
    Done(&MoveEvents::exported, &MoveEvents::export_done, s);
  }
  v1::ExportSessionRequest req;
  v1::ExportSessionResponse part;
};

class ImportWriter : public MoveCall<grpc::ClientWriteReactor<v1::ImportSessionRequest>> {
 public:
  using MoveCall::MoveCall;
  void Start(v1::KvTier::Stub* stub, std::shared_ptr<ImportWriter> self) {
    stub->async()->ImportSession(&ctx, &resp, this);
    Started(std::move(self));
    StartCall();
  }
  void OnWriteDone(bool ok) override {
    Report([ok](MoveEvents& e) {
      e.wrote = true;
      e.wrote_ok = ok;
    });
  }
  void OnWritesDoneDone(bool) override { Acquire(); }
  void OnDone(const grpc::Status& s) override {
    Done(&MoveEvents::imported, &MoveEvents::import_done, s);
  }
  v1::ImportSessionRequest req;
  v1::CreateSessionResponse resp;
};

}  // namespace

absl::StatusOr<v1::CreateSessionResponse> Client::MoveSession(const std::string& session_id,
                                                              Client& to,
                                                              const std::string& new_session_id,
                                                              v1::ChunkCarrier carrier,
                                                              const MoveProgress& progress) {
  auto events = std::make_shared<MoveEvents>();
  auto exporter = std::make_shared<ExportReader>(events, moves_);
  auto importer = std::make_shared<ImportWriter>(events, to.moves_);
  // No deadline on either call: the timeout bounds each step's wait instead (below). One
  // longer than a year is none (a wait that long would overflow the clock).
  AddCredentials(options_, &exporter->ctx);
  AddCredentials(to.options_, &importer->ctx);
  exporter->req.set_session_id(session_id);
  exporter->req.set_carrier(carrier);
  importer->req.set_session_id(new_session_id);
  const absl::Duration timeout = std::min(options_.timeout, to.options_.timeout);
  const bool bounded = timeout < absl::Hours(24 * 365);
  uint64_t parts = 0, bytes = 0;
  bool export_held = false, import_held = false;  // the holds Start takes, until let go
  // However this returns (a stall, an error, an exception from `progress`) before both calls'
  // outcomes are read, both are cancelled; a hold still taken is let go, so that gRPC ends them.
  bool answered = false;  // both calls' outcomes read
  absl::Cleanup let_go = [&] {
    if (!answered) {
      exporter->ctx.TryCancel();
      importer->ctx.TryCancel();
    }
    if (std::exchange(export_held, false)) exporter->RemoveHold();
    if (std::exchange(import_held, false)) importer->RemoveHold();
  };
  // Waits for `done` (read under the lock) at most the timeout; false when it did not come.
  auto wait = [&](auto done) {
    std::unique_lock<std::mutex> lock(events->mu);
    if (!bounded) {
      events->cv.wait(lock, done);
      return true;
    }
    return events->cv.wait_for(lock, absl::ToChronoNanoseconds(timeout), done);
  };
  auto stalled = [&](const char* outcome) {
    return absl::DeadlineExceededError(
        absl::StrCat("MoveSession of session_id \"", session_id, "\": nothing moved for ",
                     absl::FormatDuration(timeout), " (", parts, " parts, ", bytes,
                     " bytes moved): a daemon or the link stalled; ", outcome));
  };
  constexpr const char* kNothing = "nothing imported";
  exporter->Start(stub_.get(), exporter);
  export_held = true;
  importer->Start(to.stub_.get(), importer);
  import_held = true;
  bool import_open = true;
  for (;;) {
    if (!wait([&] { return events->read || events->export_done; })) return stalled(kNothing);
    {
      std::lock_guard<std::mutex> lock(events->mu);
      if (!events->read || !events->read_ok) break;  // the export ended (or failed)
      events->read = false;
    }
    importer->req.set_part(std::move(*exporter->part.mutable_part()));
    const size_t size = importer->req.part().size();
    importer->StartWrite(&importer->req);
    if (!wait([&] { return events->wrote || events->import_done; })) return stalled(kNothing);
    bool wrote_ok = false;
    {
      std::lock_guard<std::mutex> lock(events->mu);
      wrote_ok = events->wrote && events->wrote_ok;
      events->wrote = false;
    }
    if (!wrote_ok) {  // the importer refused: its status says why
      import_open = false;
      exporter->ctx.TryCancel();
      break;
    }
    ++parts;
    bytes += size;
    if (progress) progress(parts, bytes);
    importer->req.clear_session_id();
    exporter->StartRead(&exporter->part);
  }
  export_held = false;
  exporter->RemoveHold();  // no more reads
  if (!wait([&] { return events->export_done; })) return stalled(kNothing);
  grpc::Status exported, imported;
  {
    std::lock_guard<std::mutex> lock(events->mu);
    exported = events->exported;
  }
  if (import_open && !exported.ok()) importer->ctx.TryCancel();  // cut short: nothing imported
  if (import_open && exported.ok()) importer->StartWritesDone();
  import_held = false;
  importer->RemoveHold();  // no more writes
  if (!wait([&] { return events->import_done; })) {
    return stalled(import_open && exported.ok()
                       ? "every part was sent, and whether the import completed is unknown"
                       : kNothing);
  }
  {
    std::lock_guard<std::mutex> lock(events->mu);
    imported = events->imported;
  }
  answered = true;
  // An export cut short is why the import was cancelled; otherwise the importer's word.
  if (import_open && !exported.ok()) return FromGrpcStatus(exported);
  if (!imported.ok()) return FromGrpcStatus(imported);
  if (!exported.ok()) return FromGrpcStatus(exported);
  return importer->resp;
}

absl::StatusOr<bool> Client::CloseSession(const std::string& session_id) {
  v1::CloseSessionRequest req;
  req.set_session_id(session_id);
  auto r = KVTIER_CALL(v1::CloseSessionResponse, CloseSession, req);
  if (!r.ok()) return r.status();
  return r->existed();
}

absl::StatusOr<v1::ListSessionsResponse> Client::ListSessions() {
  return KVTIER_CALL(v1::ListSessionsResponse, ListSessions, v1::ListSessionsRequest());
}

absl::StatusOr<v1::DescribeSessionResponse> Client::DescribeSession(const std::string& id) {
  v1::DescribeSessionRequest req;
  req.set_session_id(id);
  return KVTIER_CALL(v1::DescribeSessionResponse, DescribeSession, req);
}

absl::StatusOr<v1::ListChunksResponse> Client::ListChunks(const v1::ListChunksRequest& req) {
  return KVTIER_CALL(v1::ListChunksResponse, ListChunks, req);
}

absl::StatusOr<v1::GetTierStatsResponse> Client::GetTierStats() {
  return KVTIER_CALL(v1::GetTierStatsResponse, GetTierStats, v1::GetTierStatsRequest());
}

absl::StatusOr<v1::ListSegmentsResponse> Client::ListSegments() {
  return KVTIER_CALL(v1::ListSegmentsResponse, ListSegments, v1::ListSegmentsRequest());
}

absl::StatusOr<v1::ListLeasesResponse> Client::ListLeases(const std::string& session_id,
                                                          uint32_t limit) {
  v1::ListLeasesRequest req;
  req.set_session_id(session_id);
  req.set_limit(limit);
  return KVTIER_CALL(v1::ListLeasesResponse, ListLeases, req);
}

namespace {

// Receives up to `want` descriptors in one message from `sock` into `out`; the message's
// bytes (one 'k', or "e<reason>") into `text`. Descriptors past `want` are closed.
absl::Status ReceiveFds(int sock, size_t want, std::vector<int>* out, std::string* text) {
  char buf[512];
  iovec iov{buf, sizeof buf};
  std::vector<char> control(CMSG_SPACE(sizeof(int) * 253));
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control.data();
  msg.msg_controllen = control.size();
  ssize_t n;
  do {
    n = recvmsg(sock, &msg, MSG_CMSG_CLOEXEC);
  } while (n < 0 && errno == EINTR);
  if (n <= 0) {
    return absl::UnavailableError(
        absl::StrCat("descriptor socket: ",
                     n == 0 ? "the daemon closed it unanswered (it drains; or, a kvtierd too old "
                              "to say so, this uid's descriptor connections are at its limit)"
                     : errno == EAGAIN || errno == EWOULDBLOCK
                         ? "no answer within the client's timeout (at most 5 s)"
                         : std::strerror(errno)));
  }
  text->assign(buf, static_cast<size_t>(n));
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    const size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < count; ++i) {
      int fd;
      std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof fd);
      if (out->size() < want) {
        out->push_back(fd);
      } else {
        close(fd);
      }
    }
  }
  if (msg.msg_flags & MSG_CTRUNC) {
    return absl::FailedPreconditionError("descriptor socket: more descriptors than asked for");
  }
  return absl::OkStatus();
}

}  // namespace

namespace client_internal {

absl::Status SendAll(int sock, absl::string_view data, absl::string_view what) {
  while (!data.empty()) {
    const ssize_t sent = send(sock, data.data(), data.size(), MSG_NOSIGNAL);
    if (sent < 0 && errno == EINTR) continue;
    if (sent <= 0) {
      const int error = sent < 0 ? errno : EPIPE;
      return absl::UnavailableError(
          absl::StrCat(what, ": ", std::strerror(error), " (", data.size(), " bytes unsent)"));
    }
    data.remove_prefix(static_cast<size_t>(sent));
  }
  return absl::OkStatus();
}

}  // namespace client_internal

absl::StatusOr<std::vector<int>> Client::CollectFds(const std::string& ticket, size_t want) {
  // The socket's path is this client's own address, never a name the daemon gave.
  const std::string path = address_.substr(5) + ".fds";
  sockaddr_un addr{};
  if (path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat("descriptor socket ", path, ": path too long"));
  }
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.data(), path.size());
  const int sock = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (sock < 0) return absl::InternalError(absl::StrCat("socket: ", std::strerror(errno)));
  // The daemon answers at once or not at all: the client's timeout, at most 5 s (an infinite
  // one too), at least a millisecond.
  const absl::Duration wait = std::clamp(options_.timeout, absl::Milliseconds(1), absl::Seconds(5));
  const timeval tv = absl::ToTimeval(wait);
  setsockopt(sock, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  setsockopt(sock, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  std::vector<int> fds;
  absl::Status s;
  const std::string line = ticket + "\n";
  if (connect(sock, reinterpret_cast<const sockaddr*>(&addr), sizeof addr) != 0) {
    s = absl::UnavailableError(
        absl::StrCat("descriptor socket ", path, ": ", std::strerror(errno)));
  } else {
    // The daemon closes a connection past its per-uid limit, or one it drains, at once.
    s = client_internal::SendAll(sock, line, absl::StrCat("descriptor socket ", path));
  }
  while (s.ok() && fds.size() < want) {
    std::string text;
    const size_t before = fds.size();
    s = ReceiveFds(sock, want, &fds, &text);
    if (s.ok() && text == "k" && fds.size() == before) {  // so that the loop ends
      s = absl::FailedPreconditionError("descriptor socket: a message without descriptors");
    }
    if (s.ok() && text != "k") {
      // "b": the daemon is busy (this uid's connections at its limit): try again later.
      const std::string why =
          absl::StrCat("descriptor socket: ", absl::CEscape(text.empty() ? text : text.substr(1)));
      s = text[0] == 'b' ? absl::UnavailableError(why) : absl::PermissionDeniedError(why);
    }
  }
  close(sock);
  if (s.ok() && fds.size() != want) {
    s = absl::FailedPreconditionError(
        absl::StrCat("descriptor socket: ", fds.size(), " descriptors for ", want, " asked for"));
  }
  if (!s.ok()) {
    for (int fd : fds) close(fd);
    return s;
  }
  return fds;
}

absl::StatusOr<std::vector<Client::SegmentFd>> Client::OpenSegments(
    const std::vector<uint64_t>& ids) {
  if (!absl::StartsWith(address_, "unix:")) {
    return absl::FailedPreconditionError(
        "OpenSegments: descriptors are handed over the Unix socket only");
  }
  v1::OpenSegmentsRequest req;
  for (uint64_t id : ids) req.add_segment_ids(id);
  auto resp = KVTIER_CALL(v1::OpenSegmentsResponse, OpenSegments, req);
  if (!resp.ok()) return resp.status();
  // The segments named must be those asked for, in order (all of them, when none was asked).
  bool as_asked = ids.empty() || resp->segments_size() == static_cast<int>(ids.size());
  for (size_t i = 0; as_asked && !ids.empty() && i < ids.size(); ++i) {
    as_asked = resp->segments(static_cast<int>(i)).segment_id() == ids[i];
  }
  if (!as_asked || resp->segments_size() > 4096) {
    return absl::FailedPreconditionError(absl::StrCat("OpenSegments: the daemon named ",
                                                      resp->segments_size(), " segments, not the ",
                                                      ids.size(), " asked for"));
  }
  const size_t want = static_cast<size_t>(resp->segments_size());
  absl::StatusOr<std::vector<int>> fds = CollectFds(resp->ticket(), want);
  if (!fds.ok()) return fds.status();
  std::vector<SegmentFd> out;
  for (size_t i = 0; i < want; ++i) out.push_back({resp->segments(static_cast<int>(i)), (*fds)[i]});
  return out;
}

StagingBuffer::~StagingBuffer() {
  if (data_ != nullptr) munmap(data_, size_);
}

absl::StatusOr<std::unique_ptr<StagingBuffer>> Client::OpenStaging(const std::string& session_id,
                                                                   uint64_t size_bytes) {
  if (!absl::StartsWith(address_, "unix:")) {
    return absl::FailedPreconditionError(
        "OpenStaging: staging areas are handed over the Unix socket only");
  }
  v1::OpenStagingRequest req;
  req.set_session_id(session_id);
  req.set_size_bytes(size_bytes);
  auto resp = KVTIER_CALL(v1::OpenStagingResponse, OpenStaging, req);
  if (!resp.ok()) return resp.status();
  absl::StatusOr<std::vector<int>> fds = CollectFds(resp->ticket(), 1);
  if (!fds.ok()) return fds.status();
  const int fd = (*fds)[0];
  // The size the descriptor has, not the one the daemon named, bounds every write.
  struct stat st {};
  const bool sized = fstat(fd, &st) == 0 && st.st_size > 0 &&
                     static_cast<uint64_t>(st.st_size) >= resp->size_bytes();
  void* p = sized ? mmap(nullptr, static_cast<size_t>(st.st_size), PROT_READ | PROT_WRITE,
                         MAP_SHARED, fd, 0)
                  : MAP_FAILED;
  const int err = errno;
  close(fd);
  if (p == MAP_FAILED) {
    return absl::FailedPreconditionError(
        absl::StrCat("OpenStaging: staging area ", resp->staging_id(), " cannot be mapped: ",
                     sized ? std::strerror(err) : "its descriptor is smaller than named"));
  }
  return std::unique_ptr<StagingBuffer>(new StagingBuffer(
      resp->staging_id(), static_cast<uint8_t*>(p), static_cast<uint64_t>(st.st_size)));
}

absl::StatusOr<uint64_t> Client::Evict(const std::string& session_id, v1::Tier tier) {
  v1::EvictRequest req;
  req.set_session_id(session_id);
  req.set_tier(tier);
  auto r = KVTIER_CALL(v1::EvictResponse, Evict, req);
  if (!r.ok()) return r.status();
  return r->bytes_moved();
}

absl::StatusOr<v1::SessionPolicy> Client::SetPolicy(const std::string& session_id,
                                                    const v1::SessionPolicy& policy) {
  v1::SetPolicyRequest req;
  req.set_session_id(session_id);
  *req.mutable_policy() = policy;
  auto r = KVTIER_CALL(v1::SetPolicyResponse, SetPolicy, req);
  if (!r.ok()) return r.status();
  return r->policy();
}

absl::StatusOr<uint32_t> Client::Drain() {
  auto r = KVTIER_CALL(v1::DrainResponse, Drain, v1::DrainRequest());
  if (!r.ok()) return r.status();
  return r->sessions();
}

absl::StatusOr<std::string> Client::Echo(const std::string& payload, uint32_t response_bytes) {
  v1::EchoRequest req;
  req.set_payload(payload);
  req.set_response_bytes(response_bytes);
  auto r = KVTIER_CALL(v1::EchoResponse, Echo, req);
  if (!r.ok()) return r.status();
  return std::move(*r->mutable_payload());
}

absl::StatusOr<bool> Client::Health() {
  // grpc.health.v1.HealthCheckRequest{service: ""} encodes to zero bytes; the response is
  // HealthCheckResponse{status = 1 (SERVING)}: field 1, varint.
  grpc::GenericStub generic(channel_);
  grpc::ClientContext ctx;
  Prepare(&ctx);
  grpc::ByteBuffer request, response;
  grpc::Slice empty;
  request = grpc::ByteBuffer(&empty, 1);
  // On a queue of its own that this thread waits on (not gRPC's callback API: see Attachment).
  grpc::CompletionQueue cq;
  grpc::Status status;
  auto call = generic.PrepareUnaryCall(&ctx, "/grpc.health.v1.Health/Check", request, &cq);
  call->StartCall();
  call->Finish(&response, &status, &cq);
  void* tag = nullptr;
  bool ok = false;
  const bool got = cq.Next(&tag, &ok);  // the one operation: its finish
  cq.Shutdown();
  for (void* t = nullptr; cq.Next(&t, &ok);) {
  }
  if (!got) return absl::InternalError("health: no answer from gRPC's queue");
  if (status.error_code() == grpc::StatusCode::UNAVAILABLE) AwaitReconnect(*channel_);
  if (!status.ok()) return FromGrpcStatus(status);
  std::vector<grpc::Slice> slices;
  if (!response.Dump(&slices).ok()) return absl::InternalError("health: unreadable response");
  std::string bytes;
  for (const auto& s : slices) bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  int status_value = 0;  // absent field: UNKNOWN
  if (bytes.size() >= 2 && bytes[0] == 0x08) status_value = static_cast<uint8_t>(bytes[1]);
  return status_value == 1;
}

absl::StatusOr<ChunkView> InlineView(const v1::BlockHandle& h) {
  const size_t half = h.length() / 2;
  if (h.keys().size() != half || h.values().size() != half || half % 2 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("handle of chunk ", h.chunk_id(), ": inline keys and values of ",
                     h.keys().size(), " and ", h.values().size(), " bytes, not ", half,
                     " each of its length ", h.length(), " (Select with include_data)"));
  }
  return ChunkView{
      {reinterpret_cast<const uint16_t*>(h.keys().data()), half / 2},
      {reinterpret_cast<const uint16_t*>(h.values().data()), half / 2},
  };
}

}  // namespace kvtier
