// The NCCL carrier (server/transfer/carrier.h): a two-rank communicator between the exporting
// daemon (rank 0) and the importing one (rank 1), made non-blocking so that every wait is a
// poll with a deadline, and aborted (ncclCommAbort) when one passes or the peer fails.
//
// libnccl.so.2 is loaded with dlopen when the carrier is first asked for: the daemon links
// only the CUDA runtime, and a machine without NCCL refuses this carrier and runs on. Bytes go
// host -> device staging -> ncclSend on the exporter and ncclRecv -> device staging -> host on
// the importer, kCarrierDepth staging buffers on each side, one stream per carrier.
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <nccl.h>

#include <algorithm>
#include <array>
#include <type_traits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "server/common/status_macros.h"
#include "server/transfer/carrier.h"
#include "server/transfer/cuda_status.h"

namespace kvtier {
namespace {

// The NCCL entry points the carrier calls, from the library dlopen found.
struct Nccl {
  decltype(&ncclGetUniqueId) GetUniqueId = nullptr;
  decltype(&ncclCommInitRankConfig) CommInitRankConfig = nullptr;
  decltype(&ncclCommGetAsyncError) CommGetAsyncError = nullptr;
  decltype(&ncclCommFinalize) CommFinalize = nullptr;
  decltype(&ncclCommDestroy) CommDestroy = nullptr;
  decltype(&ncclCommAbort) CommAbort = nullptr;
  decltype(&ncclSend) Send = nullptr;
  decltype(&ncclRecv) Recv = nullptr;
  decltype(&ncclGetErrorString) GetErrorString = nullptr;
};

absl::StatusOr<const Nccl*> LoadNccl() {
  static const absl::StatusOr<const Nccl*> loaded = []() -> absl::StatusOr<const Nccl*> {
    void* lib = dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      return absl::FailedPreconditionError(
          absl::StrCat("carrier: CHUNK_CARRIER_NCCL: dlopen(libnccl.so.2): ", dlerror(),
                       " (install NCCL, or put its directory on LD_LIBRARY_PATH)"));
    }
    static Nccl n;
    bool ok = true;
    auto get = [&](auto* fn, const char* name) {
      *fn = reinterpret_cast<std::remove_pointer_t<decltype(fn)>>(dlsym(lib, name));
      ok = ok && *fn != nullptr;
    };
    get(&n.GetUniqueId, "ncclGetUniqueId");
    get(&n.CommInitRankConfig, "ncclCommInitRankConfig");
    get(&n.CommGetAsyncError, "ncclCommGetAsyncError");
    get(&n.CommFinalize, "ncclCommFinalize");
    get(&n.CommDestroy, "ncclCommDestroy");
    get(&n.CommAbort, "ncclCommAbort");
    get(&n.Send, "ncclSend");
    get(&n.Recv, "ncclRecv");
    get(&n.GetErrorString, "ncclGetErrorString");
    if (!ok) {
      return absl::FailedPreconditionError(
          "carrier: CHUNK_CARRIER_NCCL: libnccl.so.2 lacks a call the carrier needs (NCCL 2.14 "
          "or later has them all)");
    }
    return &n;
  }();
  return loaded;
}

// One side of the communicator: its stream, staging buffers and the polls every wait is.
class NcclCarrier final : public ByteCarrier {
 public:
  NcclCarrier(const Nccl* nccl, int rank, const CarrierOptions& options)
      : nccl_(nccl),
        gpu_(options.gpu),
        rank_(rank),
        timeout_(options.timeout),
        cancelled_(options.cancelled) {}

  ~NcclCarrier() override {
    (void)cudaSetDevice(gpu_);
    if (comm_ != nullptr) {
      // Joined, nothing failed, nothing left half enqueued: finalize (it flushes nothing), then
      // destroy. Otherwise (a peer that never joined or went away, a wait that timed out, a
      // cancelled call) abort, which waits for nothing.
      bool clean = ok_ && joined_ && pending_ == nullptr;
      if (clean) {
        clean = Check(nccl_->CommFinalize(comm_), "ncclCommFinalize").ok() &&
                WaitComm("ncclCommFinalize").ok();
      }
      if (clean) {
        (void)nccl_->CommDestroy(comm_);
      } else {
        (void)nccl_->CommAbort(comm_);  // a peer gone or a wait timed out: nothing is awaited
      }
    }
    for (Slot& s : slots_) {
      if (s.done != nullptr) (void)cudaEventDestroy(s.done);
      if (s.buf != nullptr) (void)cudaFree(s.buf);
    }
    if (stream_ != nullptr) (void)cudaStreamDestroy(stream_);
  }

  // Creates the stream and the events, and starts joining the communicator without waiting.
  absl::Status Start(const ncclUniqueId& id) {
    KVTIER_CUDA_RETURN(cudaSetDevice(gpu_));
    KVTIER_CUDA_RETURN(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    for (Slot& s : slots_) {
      KVTIER_CUDA_RETURN(cudaEventCreateWithFlags(&s.done, cudaEventDisableTiming));
    }
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;  // every call returns at once; completion is polled
    RETURN_IF_ERROR(
        Check(nccl_->CommInitRankConfig(&comm_, 2, id, rank_, &config), "ncclCommInitRank"));
    return absl::OkStatus();
  }

  absl::Status Send(std::string bytes) override {
    RETURN_IF_ERROR(Ready());
    Slot& s = slots_[next_++ % slots_.size()];
    RETURN_IF_ERROR(WaitEvent(s, "the importing daemon's receive"));  // that buffer is free
    RETURN_IF_ERROR(Reserve(s, bytes.size()));
    s.host = std::move(bytes);  // kept until the copy out of it is done
    RETURN_IF_ERROR(
        Fail(cudaMemcpyAsync(s.buf, s.host.data(), s.host.size(), cudaMemcpyHostToDevice, stream_),
             "cudaMemcpyAsync"));
    const ncclResult_t r = nccl_->Send(s.buf, s.host.size(), ncclUint8, 1, comm_, stream_);
    RETURN_IF_ERROR(Check(r, "ncclSend"));
    if (r == ncclInProgress) {
      // Still being enqueued: the first send connects to the importer, which connects its
      // receive only once this part reaches it, so its part must go first. The next call
      // finishes the enqueue (Ready).
      pending_ = &s;
      return absl::OkStatus();
    }
    return Fail(cudaEventRecord(s.done, stream_), "cudaEventRecord");
  }

  absl::StatusOr<std::string> Recv(uint64_t n) override {
    RETURN_IF_ERROR(Ready());
    Slot& s = slots_[0];
    RETURN_IF_ERROR(Reserve(s, n));
    std::string out(n, '\0');
    RETURN_IF_ERROR(Enqueued(nccl_->Recv(s.buf, n, ncclUint8, 0, comm_, stream_), "ncclRecv"));
    RETURN_IF_ERROR(Fail(cudaMemcpyAsync(out.data(), s.buf, n, cudaMemcpyDeviceToHost, stream_),
                         "cudaMemcpyAsync"));
    RETURN_IF_ERROR(Fail(cudaEventRecord(s.done, stream_), "cudaEventRecord"));
    RETURN_IF_ERROR(WaitEvent(s, "the exporting daemon's send"));
    return out;
  }

  // One byte back from the importer once it checked everything: the exporter counts the move
  // done only when it arrives.
  absl::Status Finish() override {
    RETURN_IF_ERROR(Ready());
    for (Slot& other : slots_) RETURN_IF_ERROR(WaitEvent(other, "the peer daemon"));
    Slot& s = slots_[0];
    RETURN_IF_ERROR(Reserve(s, 1));
    if (rank_ == 0) {
      RETURN_IF_ERROR(Enqueued(nccl_->Recv(s.buf, 1, ncclUint8, 1, comm_, stream_), "ncclRecv"));
    } else {
      RETURN_IF_ERROR(Fail(cudaMemsetAsync(s.buf, 'K', 1, stream_), "cudaMemsetAsync"));
      RETURN_IF_ERROR(Enqueued(nccl_->Send(s.buf, 1, ncclUint8, 0, comm_, stream_), "ncclSend"));
    }
    RETURN_IF_ERROR(Fail(cudaEventRecord(s.done, stream_), "cudaEventRecord"));
    return WaitEvent(s, rank_ == 0 ? "the acknowledgement" : "the exporting daemon");
  }

 private:
  struct Slot {
    void* buf = nullptr;
    uint64_t capacity = 0;
    cudaEvent_t done = nullptr;
    std::string host;
  };

  absl::Status Check(ncclResult_t r, absl::string_view call) {
    if (r == ncclSuccess || r == ncclInProgress) return absl::OkStatus();
    ok_ = false;
    const std::string msg = absl::StrCat("carrier: ", call, ": ", nccl_->GetErrorString(r));
    return r == ncclSystemError || r == ncclRemoteError ? absl::UnavailableError(msg)
                                                        : absl::InternalError(msg);
  }
  absl::Status Fail(cudaError_t e, absl::string_view call) {
    if (e == cudaSuccess) return absl::OkStatus();
    ok_ = false;
    (void)cudaGetLastError();
    return CudaError(e, absl::StrCat("carrier: ", call));
  }

  // The communicator's state: OK when idle, an error, or still in progress (false).
  absl::StatusOr<bool> CommIdle(absl::string_view what) {
    ncclResult_t async = ncclSuccess;
    RETURN_IF_ERROR(Check(nccl_->CommGetAsyncError(comm_, &async), "ncclCommGetAsyncError"));
    if (async == ncclInProgress) return false;
    RETURN_IF_ERROR(Check(async, what));
    return true;
  }

  absl::Status Deadline(absl::string_view what) {
    ok_ = false;
    return absl::DeadlineExceededError(absl::StrCat("carrier: ", what, ": not done within ",
                                                    absl::FormatDuration(timeout_),
                                                    "; the NCCL communicator is aborted"));
  }

  // Polls `done` (with the communicator's errors) until it says true or the timeout passes.
  template <typename F>
  absl::Status Poll(absl::string_view what, F done) {
    const absl::Time deadline = absl::Now() + timeout_;
    absl::Duration nap = absl::Microseconds(20);
    for (;;) {
      ASSIGN_OR_RETURN(bool finished, done());
      if (finished) return absl::OkStatus();
      if (absl::Now() >= deadline) return Deadline(what);
      if (cancelled_ != nullptr && cancelled_->load(std::memory_order_relaxed)) {
        ok_ = false;
        return absl::CancelledError(absl::StrCat("carrier: ", what, ": the transfer ended"));
      }
      absl::SleepFor(nap);
      nap = std::min(nap * 2, absl::Milliseconds(2));
    }
  }

  absl::Status WaitComm(absl::string_view what) {
    return Poll(what, [&] { return CommIdle(what); });
  }
  // The communicator joined (both ranks called init), and this thread on the carrier's device
  // (each call may come on another of gRPC's threads).
  // A send left being enqueued is then on the stream, its slot's event recorded after it.
  absl::Status Ready() {
    if (!ok_) return absl::AbortedError("carrier: an earlier NCCL operation failed");
    RETURN_IF_ERROR(Fail(cudaSetDevice(gpu_), "cudaSetDevice"));
    if (!joined_) {
      RETURN_IF_ERROR(WaitComm("joining the NCCL communicator"));
      joined_ = true;
    }
    if (pending_ != nullptr) {
      RETURN_IF_ERROR(WaitComm("ncclSend"));
      RETURN_IF_ERROR(Fail(cudaEventRecord(pending_->done, stream_), "cudaEventRecord"));
      pending_ = nullptr;
    }
    return absl::OkStatus();
  }
  // A call of a non-blocking communicator may answer ncclInProgress: enqueued once it is idle.
  absl::Status Enqueued(ncclResult_t r, absl::string_view call) {
    RETURN_IF_ERROR(Check(r, call));
    return r == ncclInProgress ? WaitComm(call) : absl::OkStatus();
  }
  absl::Status WaitEvent(Slot& s, absl::string_view what) {
    return Poll(what, [&]() -> absl::StatusOr<bool> {
      const cudaError_t e = cudaEventQuery(s.done);
      if (e == cudaErrorNotReady) {
        ASSIGN_OR_RETURN(bool idle, CommIdle(what));  // a failed peer shows here
        (void)idle;
        return false;
      }
      RETURN_IF_ERROR(Fail(e, "cudaEventQuery"));
      return true;
    });
  }
  absl::Status Reserve(Slot& s, uint64_t n) {
    if (s.capacity >= n) return absl::OkStatus();
    if (s.buf != nullptr) RETURN_IF_ERROR(Fail(cudaFree(s.buf), "cudaFree"));
    s.buf = nullptr;
    s.capacity = 0;
    RETURN_IF_ERROR(Fail(cudaMalloc(&s.buf, n), "cudaMalloc"));
    s.capacity = n;
    return absl::OkStatus();
  }

  const Nccl* const nccl_;
  const int gpu_, rank_;
  const absl::Duration timeout_;
  const std::atomic<bool>* const cancelled_;
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  std::array<Slot, kCarrierDepth> slots_;
  uint64_t next_ = 0;
  Slot* pending_ = nullptr;  // the slot of a send still being enqueued
  bool joined_ = false;
  bool ok_ = true;  // false after any failure: the destructor aborts instead of finalizing
};

absl::Status NeedGpu(const CarrierOptions& options) {
  if (options.gpu >= 0) return absl::OkStatus();
  return absl::FailedPreconditionError(
      "carrier: CHUNK_CARRIER_NCCL needs the daemon's device tier on a CUDA device (--device); "
      "this one's is emulated");
}

}  // namespace

absl::StatusOr<OfferedCarrier> OfferNcclCarrier(const CarrierOptions& options) {
  RETURN_IF_ERROR(NeedGpu(options));
  ASSIGN_OR_RETURN(const Nccl* nccl, LoadNccl());
  KVTIER_CUDA_RETURN(cudaSetDevice(options.gpu));
  ncclUniqueId id;
  const ncclResult_t r = nccl->GetUniqueId(&id);
  if (r != ncclSuccess) {
    return absl::UnavailableError(
        absl::StrCat("carrier: ncclGetUniqueId: ", nccl->GetErrorString(r)));
  }
  auto carrier = std::make_unique<NcclCarrier>(nccl, 0, options);
  RETURN_IF_ERROR(carrier->Start(id));
  OfferedCarrier offered;
  offered.bootstrap.assign(id.internal, sizeof(id.internal));
  offered.carrier = std::move(carrier);
  return offered;
}

absl::StatusOr<std::unique_ptr<ByteCarrier>> JoinNcclCarrier(absl::string_view bootstrap,
                                                             const CarrierOptions& options) {
  RETURN_IF_ERROR(NeedGpu(options));
  ncclUniqueId id;
  if (bootstrap.size() != sizeof(id.internal)) {
    return absl::InvalidArgumentError(absl::StrCat("carrier: an NCCL bootstrap of ",
                                                   bootstrap.size(), " bytes; an ncclUniqueId has ",
                                                   sizeof(id.internal)));
  }
  ASSIGN_OR_RETURN(const Nccl* nccl, LoadNccl());
  std::copy(bootstrap.begin(), bootstrap.end(), id.internal);
  auto carrier = std::make_unique<NcclCarrier>(nccl, 1, options);
  RETURN_IF_ERROR(carrier->Start(id));
  return std::unique_ptr<ByteCarrier>(std::move(carrier));
}

}  // namespace kvtier
