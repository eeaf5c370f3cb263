#include "server/session/session.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/cleanup/cleanup.h"
#include "absl/hash/hash.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "server/common/error.h"
#include "server/common/mutex.h"
#include "server/common/status_macros.h"
#include "server/config/policy.h"
#include "server/config/shape.h"
#include "server/index/chunking.h"
#include "server/index/stream_ranker.h"
#include "server/session/requests.h"
#include "server/session/selection.h"
#include "server/session/session_record.h"
#include "server/session/views.h"

namespace kvtier {

namespace {

// The bytes of an append's keys (or values): [num_kv_heads][num_tokens][head_dim], 2 each; what
// a staging area or a worker's device memory must hold from each offset.
uint64_t KvBytes(const v1::ModelShape& shape, uint32_t num_tokens) {
  return uint64_t{shape.num_kv_heads()} * num_tokens * shape.head_dim() * 2;
}

// Whether a chunk of `rows` rows whose last token has id `*id` (null: none given) ends.
bool Seals(const v1::SessionPolicy& policy, uint32_t rows, const int32_t* id) {
  if (policy.chunking() != v1::CHUNKING_BOUNDARY) return rows >= policy.chunk_tokens();
  const auto& delim = policy.delimiter_token_ids();
  return EndsChunk(rows, policy.chunk_tokens(), id != nullptr,
                   id != nullptr && std::find(delim.begin(), delim.end(), *id) != delim.end());
}

}  // namespace

Session::Session(std::string id, std::string tenant, v1::ModelShape shape, v1::SessionPolicy policy,
                 std::map<std::string, std::string> labels, const SessionEnv& env,
                 MetadataCharge charge)
    : id_(std::move(id)),
      tenant_(std::move(tenant)),
      tenant_leases_(env.leases != nullptr ? env.leases->Tenant(tenant_) : nullptr),
      shape_(std::move(shape)),
      labels_(std::move(labels)),
      env_(env),
      host_account_(env.host != nullptr ? env.host->Account(tenant_, std::hash<std::string>{}(id_))
                                        : TierAccount()),
      device_account_(env.device_copies != nullptr ? env.device_copies->tier()->Account(
                                                         tenant_, std::hash<std::string>{}(id_))
                                                   : TierAccount()),
      created_ms_(env.clock->NowMs()),
      policy_(std::move(policy)),
      last_access_ms_(created_ms_),
      layers_(shape_.num_layers()),
      needs_(shape_.num_layers()) {
  streams_.reserve(static_cast<size_t>(shape_.num_layers()) * shape_.num_kv_heads());
  for (size_t i = 0; i < static_cast<size_t>(shape_.num_layers()) * shape_.num_kv_heads(); ++i) {
    streams_.emplace_back(shape_.head_dim());
  }
  MutexLock lock(&mu_);
  charge_ = charge.bytes() > 0 ? std::move(charge) : MetadataCharge(host_account_);
  charge_.Set(std::max(charge_.bytes(), MeasureMetadata()));
}

Session::Session(const Session& parent, std::string new_id, v1::SessionPolicy policy,
                 MetadataCharge charge)
    : Session(std::move(new_id), parent.tenant_, parent.shape_, std::move(policy), parent.labels_,
              parent.env_, std::move(charge)) {}

namespace {

uint64_t LabelBytes(const std::map<std::string, std::string>& labels) {
  uint64_t bytes = 0;
  for (const auto& [k, v] : labels) bytes += k.size() + v.size() + 64;  // and a map node
  return bytes;
}

}  // namespace

uint64_t Session::CreationBytes(const v1::ModelShape& shape,
                                const std::map<std::string, std::string>& labels,
                                const std::string& id, const std::string& tenant) {
  const uint64_t layers = shape.num_layers();
  // The session's own bytes, and its streams' (each empty stream's heap is nothing).
  return sizeof(Session) + id.size() + tenant.size() + LabelBytes(labels) +
         layers * (sizeof(Layer) + sizeof(float)) + layers * shape.num_kv_heads() * sizeof(Stream);
}

uint64_t Session::ChunkRecordBytes() { return sizeof(Chunk) + kSlotHeapBytes + sizeof(uint32_t); }

uint64_t Session::ChunkBytesEstimate(const ChunkFormat& f) {
  // What one more chunk holds however it ages: its record, and its compact mean and peak,
  // bytes and a scale each, and their tiles where kept (a new chunk's float statistics are
  // more, until it is final: an append counts those blocks itself).
  // Arrays that double, row offsets and the index's share are counted as measured.
  return ChunkRecordBytes() + ChunkStats::CompactChunkBytes(static_cast<int>(f.head_dim));
}

uint64_t Session::MeasureMetadata() const {
  uint64_t bytes = CreationBytes(shape_, labels_, id_, tenant_);
  for (const Stream& s : streams_) bytes += s.HeapBytes();
  return bytes;
}

uint64_t Session::metadata_bytes() const {
  MutexLock lock(&mu_);
  return charge_.bytes();
}

absl::Status Session::CheckOpen() const {
  if (demoted_) {
    return WithReason(absl::UnavailableError(
                          absl::StrCat("session_id: \"", id_,
                                       "\" moved to the remote tier while this call waited; retry "
                                       "(the next call restores it)")),
                      ErrorReason::kSessionMoved);
  }
  if (closed_) return absl::NotFoundError(absl::StrCat("session_id: \"", id_, "\" is closed"));
  return absl::OkStatus();
}

uint64_t Session::MinTokens() const {
  uint64_t least = layers_[0].tokens;
  for (const Layer& l : layers_) least = std::min(least, l.tokens);
  return least;
}

absl::StatusOr<uint64_t> Session::Append(const v1::AppendKVRequest& req) {
  ASSIGN_OR_RETURN(const AppendBytes bytes, BytesOf(req));
  RETURN_IF_ERROR(CheckAppend(shape_, req, bytes.area != nullptr));
  absl::StatusOr<uint64_t> stored = AppendSized(req, bytes);
  if (!stored.ok()) {
    // A non-finite value is the error, whichever step stopped first (a rewrite's comparison,
    // a gap, the landing copy).
    RETURN_IF_ERROR(CheckAppendFinite(shape_, req, bytes.keys, bytes.values));
  }
  return stored;
}

absl::StatusOr<uint64_t> Session::AppendSized(const v1::AppendKVRequest& req,
                                              const AppendBytes& bytes) {
  const uint32_t kvh = shape_.num_kv_heads();
  const uint64_t n = req.num_tokens();
  ForegroundLock lock(&mu_, &foreground_);
  RETURN_IF_ERROR(CheckOpen());
  const bool defer = env_.aging != nullptr && !req.wait_aged();
  if (defer && env_.max_aging_backlog_tokens > 0) RETURN_IF_ERROR(WaitForBacklog());
  last_access_ms_ = env_.clock->NowMs();
  const uint32_t layer = req.layer();
  const uint64_t stored = layers_[layer].tokens;
  const uint64_t start = req.start_token();
  if (start > stored) {
    return absl::OutOfRangeError(absl::StrFormat(
        "start_token: %d leaves a gap; layer %d holds tokens [0, %d)", start, layer, stored));
  }
  const ChunkFormat f = format();
  const uint64_t rb = f.row_bytes();
  auto keys = [&](uint32_t h, uint64_t i) { return bytes.keys + (h * n + i) * rb; };
  auto values = [&](uint32_t h, uint64_t i) { return bytes.values + (h * n + i) * rb; };
  const uint64_t overlap = std::min(stored, start + n) - start;
  for (uint32_t h = 0; h < kvh; ++h) {
    if (auto t = stream(layer, h).FirstMismatch(start, overlap, keys(h, 0), values(h, 0), f)) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "start_token: token %d of layer %d (kv_head %d) is stored with other bytes; "
          "a stored token is not rewritten",
          *t, layer, h));
    }
  }
  if (overlap == n) return MinTokens();

  const int32_t* ids = req.token_ids_size() != 0 ? req.token_ids().data() : nullptr;
  // The plan runs now, under this call's lock (which the analysis cannot see in a lambda).
  const v1::SessionPolicy* policy = &policy_;
  const AppendPlan plan = PlanAppend(stream(layer, 0), overlap, n, [&](uint32_t rows, uint64_t i) {
    return Seals(*policy, rows, ids ? ids + i : nullptr);
  });
  if (stream(layer, 0).chunks().size() + plan.new_chunks() > kMaxChunksPerStream) {
    return InvalidField("start_token", "the stream would exceed 2^28 chunks");
  }
  // The metadata's growth, then every slot, first: a full tier or quota leaves the session
  // exactly as it was. The charge is set to what the append came to at the end.
  const uint64_t layer_bytes = LayerHeapBytes(layer);
  const uint64_t charged = charge_.bytes();
  // Each new chunk's record, and the larger of its statistics' two forms: the float ones it
  // holds until aged (in blocks: what each stream's next blocks take) or the compact ones.
  const uint64_t compact = ChunkStats::CompactChunkBytes(static_cast<int>(f.head_dim));
  uint64_t growth = kvh * plan.new_chunks() * ChunkRecordBytes();
  for (const Stream& s : heads(layer)) {
    growth += std::max<uint64_t>(plan.new_chunks() * compact,
                                 s.stats().LooseGrowthBytes(plan.new_chunks()));
  }
  RETURN_IF_ERROR(charge_.Grow(growth));
  absl::Cleanup settle = [&]() ABSL_NO_THREAD_SAFETY_ANALYSIS {  // under this call's lock
    charge_.Set(charged + LayerHeapBytes(layer) - layer_bytes);
  };
  uint64_t slots_needed = kvh * plan.new_chunks();
  for (const Stream& s : heads(layer)) slots_needed += s.CopiesOnGrow(plan);
  std::vector<SlotRef> fresh;
  fresh.reserve(slots_needed);
  RETURN_IF_ERROR(env_.host->AllocateMany(host_account_, f.slot_bytes(), slots_needed, &fresh));
  size_t next = 0;
  auto slot = [&] { return std::move(fresh[next++]); };
  // Every head's rows land in their slots first, the stream unchanged, each value checked
  // finite as it is copied (what is checked is what is stored, though the worker may write a
  // staging area meanwhile): a non-finite one leaves the session as it was.
  std::vector<LandedRows> landed(kvh);
  for (uint32_t h = 0; h < kvh; ++h) {
    if (!heads(layer)[h].Land(plan, keys(h, overlap), values(h, overlap), stored, f, slot,
                              &landed[h])) {
      // Append names the value when the bytes still hold it; staged bytes may not.
      return InvalidField("staged",
                          "a value was Inf or NaN as it was copied, and finite when looked at "
                          "again: the worker wrote the staging area while this append read it "
                          "(rewrite it only after the stream's reply)");
    }
  }
  Layer& l = layers_[layer];
  // Aged to its end by a run that left nothing waiting: the pool has something to do for this
  // append only if it moves a chunk out of the window.
  const bool settled = defer && l.aging_settled && l.aged_tokens == stored;
  const uint32_t out_before = settled ? AgedOutChunks(policy_, stored, stream(layer, 0)) : 0;
  for (uint32_t h = 0; h < kvh; ++h) heads(layer)[h].Take(plan, std::move(landed[h]), f, slot);
  l.tokens = start + n;  // the backlog is noted below, on each way out
  ++version_;
  std::weak_ptr<Session> self = weak_from_this();
  if (!defer || self.expired()) {
    AgeLayer(aging(), l.tokens, heads(layer), &l.aging);  // `settle` charges what it adds
    MarkAgedLocked(layer);
    l.aging_settled = false;  // a chunk short of slots waits for the pool's next run
    return MinTokens();
  }
  if (settled && AgedOutChunks(policy_, l.tokens, stream(layer, 0)) == out_before) {
    MarkAgedLocked(layer);  // no chunk left the window: nothing to age
    return MinTokens();
  }
  // The rest (peaks, regroup, quantize, index) on the pool; a Select before it gets there
  // computes the peaks it ranks by itself (Choose).
  NoteBacklogLocked();
  if (!l.aging_queued && !l.aging_busy) {  // a busy thread ages what arrives meanwhile too
    l.aging_queued = true;
    // The queue by session and layer: sessions' appends take different queues' locks.
    env_.aging->Submit(
        [self = std::move(self), layer] {
          if (std::shared_ptr<Session> s = self.lock()) s->AgeQueuedLayer(layer);
        },
        absl::HashOf(static_cast<const void*>(this), layer));
  }
  return MinTokens();
}

absl::Status Session::SetStaging(std::shared_ptr<StagingArea> area) {
  std::shared_ptr<StagingArea> old;
  MutexLock lock(&mu_);
  RETURN_IF_ERROR(CheckOpen());  // held on, so that a close cannot pass between
  MutexLock staging(&staging_mu_);
  old = std::exchange(staging_, std::move(area));
  return absl::OkStatus();  // (the old area ends after the locks, with `old`)
}

absl::StatusOr<Session::AppendBytes> Session::BytesOf(const v1::AppendKVRequest& req) const {
  if (!req.has_staged()) {
    return AppendBytes{reinterpret_cast<const uint8_t*>(req.keys().data()),
                       reinterpret_cast<const uint8_t*>(req.values().data()), nullptr};
  }
  if (!req.keys().empty() || !req.values().empty()) {
    return InvalidField(req.keys().empty() ? "values" : "keys",
                        "bytes sent inline beside `staged`; an append carries them one way");
  }
  const v1::StagedKV& staged = req.staged();
  std::shared_ptr<StagingArea> area;
  {
    MutexLock lock(&staging_mu_);  // a closed session's is gone: Append then says closed
    area = staging_;
  }
  if (area == nullptr || area->id() != staged.staging_id()) {
    {
      MutexLock lock(&mu_);  // a closed or moved session says so first
      RETURN_IF_ERROR(CheckOpen());
    }
    return absl::NotFoundError(
        absl::StrFormat("staged.staging_id: %d is not session_id \"%s\"'s staging area (%s)",
                        staged.staging_id(), id_,
                        area == nullptr ? "it has none; OpenStaging makes one"
                                        : absl::StrCat("it has ", area->id())));
  }
  // Sizes as the inline bytes'; a wrong num_tokens still reaches CheckAppend's message.
  const uint64_t want = KvBytes(shape_, req.num_tokens());
  for (const auto& [field, offset] : {std::pair{"staged.keys_offset", staged.keys_offset()},
                                      {"staged.values_offset", staged.values_offset()}}) {
    if (offset > area->size() || want > area->size() - offset) {
      return InvalidField(field, absl::StrFormat("%d + %d bytes passes the staging area's %d",
                                                 offset, want, area->size()));
    }
  }
  const uint8_t* base = area->data();
  return AppendBytes{base + staged.keys_offset(), base + staged.values_offset(), std::move(area)};
}

absl::Status Session::Undevice(v1::AppendKVRequest* req, DeviceSources* sources,
                               uint64_t max_bytes) const {
  if (!req->has_device()) return absl::OkStatus();
  if (!req->keys().empty() || !req->values().empty() || req->has_staged()) {
    return InvalidField(req->has_staged()     ? "staged"
                        : req->keys().empty() ? "values"
                                              : "keys",
                        "bytes sent beside `device`; an append carries them one way");
  }
  const v1::DeviceKV& device = req->device();
  if (device.cuda_ipc_handle().size() != kCudaIpcHandleBytes) {
    return InvalidField("device.cuda_ipc_handle",
                        absl::StrFormat("%d bytes, not a CUDA IPC handle's %d",
                                        device.cuda_ipc_handle().size(), kCudaIpcHandleBytes));
  }
  if (!env_.open_device_source) {
    return absl::FailedPreconditionError(
        "device: this kvtierd runs no GPU (--device); send the bytes, or stage them");
  }
  // The device's error, with the field it came of.
  auto naming = [](const absl::Status& s, absl::string_view field) {
    return absl::Status(s.code(), absl::StrCat(field, ": ", s.message()));
  };
  absl::StatusOr<const DeviceSource*> source =
      sources->Get(device.cuda_ipc_handle(), env_.open_device_source);
  if (!source.ok()) return naming(source.status(), "device.cuda_ipc_handle");
  // The host copy bounded, and both ranges within the allocation, before anything is
  // allocated for them: num_tokens is checked later (CheckAppend).
  const uint64_t want = KvBytes(shape_, req->num_tokens());
  if (want > max_bytes / 2) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "num_tokens: %d tokens are 2 x %d bytes of keys and values, past max_message_size %d, "
        "the most one append carries; append them in parts",
        req->num_tokens(), want, max_bytes));
  }
  const uint64_t size = (*source)->size();
  for (const auto& [field, offset] : {std::pair{"device.keys_offset", device.keys_offset()},
                                      {"device.values_offset", device.values_offset()}}) {
    if (offset > size || want > size - offset) {
      return InvalidField(field,
                          absl::StrFormat("%d bytes at %d pass the allocation's %d (%d "
                                          "tokens of [num_kv_heads][head_dim] 2-byte values)",
                                          want, offset, size, req->num_tokens()));
    }
  }
  std::string keys(want, '\0'), values(want, '\0');
  if (absl::Status s = (*source)->Read(device.keys_offset(), keys.data(), want); !s.ok()) {
    return naming(s, "device.keys_offset");
  }
  if (absl::Status s = (*source)->Read(device.values_offset(), values.data(), want); !s.ok()) {
    return naming(s, "device.values_offset");
  }
  *req->mutable_keys() = std::move(keys);
  *req->mutable_values() = std::move(values);
  req->clear_device();
  return absl::OkStatus();
}

void Session::AgeQueuedLayer(uint32_t l) {
  {
    BackgroundLock lock(&mu_, foreground_);
    layers_[l].aging_queued = false;    // an append from now on queues another task
    if (layers_[l].aging_busy) return;  // that thread ages what arrives meanwhile too
    layers_[l].aging_busy = true;
  }
  AgeLayerInPool(l);
}

void Session::AgeLayerInPool(uint32_t l) {
  // The heavy steps (regrouping a span, quantizing chunks) run without the lock; what runs
  // under it is bounded by kAgingSlice chunks of each head (and, indexing, kAgingSliceTime), so
  // that an append or a Select waits for at most one slice, not for a layer's whole backlog.
  bool quant_stuck = false;  // no slots for quantizing: the rest waits for the next run
  // The thread stays lifted from one hold to the next (index slices follow one another, a
  // span's commit the next span's choice), and goes back to idle priority for the work done
  // without the lock.
  std::optional<TaskPool::Boost> lifted(std::in_place);
  for (;;) {
    std::vector<SpanJob> jobs;
    std::optional<QuantJob> quant;
    std::optional<SpanContext> context;
    {
      BackgroundLock lock(&mu_, foreground_);
      Layer& layer = layers_[l];
      if (closed_ || layer.aged_tokens == layer.tokens) {
        layer.aging_busy = false;
        return;
      }
      // Up to kAgingSpans spans at once: each time without the lock costs the thread two
      // changes of its scheduling policy (TaskPool::Boost).
      AgingState next = layer.aging;
      while (jobs.size() < kAgingSpans) {
        std::optional<SpanJob> job = NextSpan(aging(), layer.tokens, heads(l), &next);
        // The first look moves the layer past its sinks, span or none, as NextSpan does.
        if (jobs.empty()) layer.aging.regrouped = next.regrouped;
        if (!job) break;
        next.regrouped = job->first + kSemanticSpanChunks;
        jobs.push_back(*std::move(job));
      }
      if (jobs.empty() && !quant_stuck) {
        quant = NextQuant(aging(), layer.tokens, heads(l), layer.aging, kAgingSlice);
      }
      if (jobs.empty() && !quant) {
        const uint64_t before = LayerHeapBytes(l);
        const bool more = IndexLayerSlice(aging(), layer.tokens, heads(l), &layer.aging,
                                          kAgingSlice, absl::Now() + kAgingSliceTime);
        charge_.Set(charge_.bytes() + LayerHeapBytes(l) - before);
        if (!more) {
          MarkAgedLocked(l);
          layer.aging_settled = !quant_stuck;
          aged_.SignalAll();
          quant_stuck = false;
        }
        continue;  // appends may have come meanwhile
      }
      context = SpanContext::Of(aging());
    }
    lifted.reset();
    if (quant) {
      RunQuant(*context, &*quant);
      lifted.emplace();
      BackgroundLock lock(&mu_, foreground_);
      if (closed_) continue;
      quant_stuck = !quant->progressed();
      const uint64_t before = LayerHeapBytes(l);
      CommitQuant(heads(l), &layers_[l].aging, std::move(*quant));
      charge_.Set(charge_.bytes() + LayerHeapBytes(l) - before);
      continue;
    }
    size_t made = 0;  // the first `made` jobs got their slots
    while (made < jobs.size() && RegroupSpan(*context, &jobs[made])) ++made;
    lifted.emplace();
    // Each span committed in order, under a hold of its own (an append or a Select waits for
    // one at most). False when the span changed meanwhile (a fork aged it) or the policy's
    // cold precision did: then its slots go back, and the later spans' with them.
    bool stopped = false;
    for (size_t i = 0; i < made && !stopped; ++i) {
      BackgroundLock lock(&mu_, foreground_);
      if (closed_) {
        stopped = true;  // the next round ends the task
        break;
      }
      const uint64_t before = LayerHeapBytes(l);
      const uint32_t first = jobs[i].first;
      const bool committed =
          CommitSpan(heads(l), &layers_[l].aging, std::move(jobs[i]), aging().cold_bits());
      charge_.Set(charge_.bytes() + LayerHeapBytes(l) - before);
      if (!committed) {
        jobs.clear();  // the later spans' slots go back before the layer ages here
        if (layers_[l].aging.regrouped == first) {  // never loop on one span
          AgeLayerLocked(l);
          aged_.SignalAll();
        }
        stopped = true;
      }
    }
    // Some spans short of slots while others got theirs (their commits free the sources):
    // the next round tries those again. None at all: what is left waits for the next append,
    // as on the append path.
    if (stopped || made > 0) continue;
    jobs.clear();
    BackgroundLock lock(&mu_, foreground_);
    if (closed_) continue;
    AgeLayerLocked(l);
    aged_.SignalAll();
    layers_[l].aging_busy = false;
    return;
  }
}

uint64_t Session::aging_backlog_tokens() const { return backlog_.load(std::memory_order_relaxed); }

void Session::NoteBacklogLocked() { backlog_.store(BacklogLocked(), std::memory_order_relaxed); }

void Session::MarkAgedLocked(uint32_t l) {
  layers_[l].aged_tokens = layers_[l].tokens;
  NoteBacklogLocked();
}

uint64_t Session::BacklogLocked() const {
  uint64_t backlog = 0;
  for (const Layer& l : layers_) backlog += l.tokens - l.aged_tokens;
  return backlog;
}

uint64_t Session::LayerHeapBytes(uint32_t l) const {
  uint64_t bytes = 0;
  for (uint32_t h = 0; h < shape_.num_kv_heads(); ++h) bytes += stream(l, h).HeapBytes();
  return bytes;
}

void Session::AgeLayerLocked(uint32_t l) {
  const uint64_t before = LayerHeapBytes(l);
  AgeLayer(aging(), layers_[l].tokens, heads(l), &layers_[l].aging);
  MarkAgedLocked(l);
  layers_[l].aging_settled = false;  // a chunk short of slots waits for the pool's next run
  charge_.Set(charge_.bytes() + LayerHeapBytes(l) - before);
}

void Session::AgeAllLocked() {
  for (uint32_t l = 0; l < shape_.num_layers(); ++l) {
    if (layers_[l].aged_tokens != layers_[l].tokens) AgeLayerLocked(l);
  }
}

absl::Status Session::WaitForBacklog() {
  if (BacklogLocked() < env_.max_aging_backlog_tokens) return absl::OkStatus();
  const absl::Time deadline = absl::Now() + absl::Milliseconds(env_.aging_wait_ms);
  // This append waits for the pool: its threads of normal (nice) priority join the idle ones.
  TaskPool::Press press(env_.aging);
  while (BacklogLocked() >= env_.max_aging_backlog_tokens) {
    if (WaitOnUntil(&aged_, &mu_, deadline) && BacklogLocked() >= env_.max_aging_backlog_tokens) {
      return absl::ResourceExhaustedError(absl::StrFormat(
          "aging backlog: session \"%s\" holds %d tokens not yet aged (max_aging_backlog_tokens "
          "%d) and the aging pool did not catch up within %d ms; retry, or add aging_threads",
          id_, BacklogLocked(), env_.max_aging_backlog_tokens, env_.aging_wait_ms));
    }
    RETURN_IF_ERROR(CheckOpen());
  }
  return absl::OkStatus();
}

absl::StatusOr<LayerChoice> Session::Choose(uint32_t layer, std::span<const float> q,
                                            uint64_t budget, uint32_t pool_factor, bool record,
                                            uint64_t extra_budget) {
  const uint32_t kvh = shape_.num_kv_heads();
  const uint32_t group = shape_.num_q_heads() / kvh;
  const size_t d = shape_.head_dim();
  const uint64_t total = layers_[layer].tokens;
  const uint64_t sink_end = std::min<uint64_t>(policy_.sink_tokens(), total);
  const uint64_t window_start = total - std::min<uint64_t>(policy_.recent_window(), total);
  LayerChoice c;
  c.everything = layer < policy_.dense_layers() || total <= budget;
  // Chunks that left the window are ranked beside the index by their peaks: those the aging
  // pool has not computed yet (the append path leaves them to it) are computed now, once.
  if (!c.everything) PeakLayer(aging(), total, heads(layer), &layers_[layer].aging);
  c.sink_end = sink_end;
  c.window_start = window_start;
  // Refinement returns rows, so the sinks and the window cost only their own rows.
  const bool by_rows = pool_factor > 1 || policy_.mass_target() > 0.f;
  c.chunks.assign(kvh, {});
  c.kept.assign(kvh, {});
  c.rows_left.assign(kvh, 0);
  c.extra.assign(kvh, {});
  const double share = policy_.layer_budget() == v1::LAYER_BUDGET_BY_NEED
                           ? needs_.Share(layer, policy_.dense_layers())
                           : 1.0;
  for (uint32_t h = 0; h < kvh; ++h) {
    const Stream& s = stream(layer, h);
    if (c.everything) {
      for (uint32_t i = 0; i < s.chunks().size(); ++i) c.chunks[h].push_back(i);
      continue;
    }
    // Always returned: every chunk with a row among the sinks or in the recent window (under
    // refinement only those rows of it, the others being candidates).
    uint64_t kept_tokens = 0, kept_rows = 0;
    c.kept[h] = s.Kept(sink_end, window_start, &kept_tokens, &kept_rows);
    const uint64_t fixed = by_rows ? kept_rows : kept_tokens;
    if (fixed > budget) {
      return InvalidField(
          "budget_tokens",
          absl::StrFormat("%d is below the %d tokens of the sink and recent-window %s "
                          "(sink_tokens %d, recent_window %d, chunk_tokens %d, %s)",
                          budget, fixed, by_rows ? "rows" : "chunks", policy_.sink_tokens(),
                          policy_.recent_window(), policy_.chunk_tokens(),
                          v1::Chunking_Name(policy_.chunking())));
    }
    c.rows_left[h] = static_cast<uint64_t>(std::llround(share * double(budget - fixed)));
    // The rows the larger budget would leave, as its own Choose would count them.
    const uint64_t wider_left =
        extra_budget == 0
            ? c.rows_left[h]
            : static_cast<uint64_t>(std::llround(share * double(budget + extra_budget - fixed)));
    RankResult r =
        RankStream(s.stats(), s.index(),
                   RankQuery{.ranking = policy_.ranking(),
                             .queries = q.subspan(h * group * d, group * d),
                             .group = static_cast<int>(group),
                             .budget = kept_tokens + pool_factor * c.rows_left[h],
                             .must = &c.kept[h],
                             .chunk_tokens = policy_.chunk_tokens(),
                             .extra_budget = pool_factor * (wider_left - c.rows_left[h])});
    c.extra[h] = std::move(r.extra);
    if (record) {
      layers_[layer].select_candidates += r.candidates;
      layers_[layer].select_scored += r.scored;
    }
    c.chunks[h] = std::move(r.chunks);
  }
  return c;
}

absl::Status Session::Select(const v1::SelectRequest& req, v1::SelectResponse* out, ReplyRoom* room,
                             PrefetchGuess* guess, uint32_t extra_percent) {
  out->Clear();
  ASSIGN_OR_RETURN(const std::vector<float> q,
                   CheckSelect(shape_, req, env_.lease_ttl_ms, env_.max_lease_ms));
  const uint32_t ttl = req.lease_ms() ? req.lease_ms() : env_.lease_ttl_ms;
  // Before any copy: a tenant at its lease limit gets nothing pinned.
  RETURN_IF_ERROR(tenant_leases_->CheckRoom(env_.max_leases_per_tenant));
  RETURN_IF_ERROR(env_.leases->CheckWorker(tenant_, req.worker_id()));
  ForegroundLock lock(&mu_, &foreground_);
  RETURN_IF_ERROR(CheckOpen());
  if (room != nullptr) RETURN_IF_ERROR(TakeReplyRoom("Select", ReplyBound(req), room));
  last_access_ms_ = env_.clock->NowMs();
  const uint32_t layer = req.layer();
  const uint64_t budget = req.budget_tokens() ? req.budget_tokens() : policy_.default_budget();
  const bool to_device = req.placement() == v1::TIER_DEVICE;
  const uint64_t extra_budget = guess != nullptr ? budget * extra_percent / 100 : 0;
  ASSIGN_OR_RETURN(LayerChoice c,
                   Choose(layer, q, budget, policy_.refine_factor(), true, extra_budget));
  if (guess != nullptr) {
    guess->layer = layer;
    guess->to_device = to_device;
    guess->chunks = std::move(c.extra);
    // Only what a prefetch would make: a chunk readable there already (warm, for the host; a
    // copy cached, as far as a look without the cache's lock sees) is left out, so that a
    // guess the last steps promoted wakes no prefetcher.
    for (uint32_t h = 0; h < guess->chunks.size(); ++h) {
      std::erase_if(guess->chunks[h], [&](uint32_t i) ABSL_NO_THREAD_SAFETY_ANALYSIS {
        const Chunk& ch = stream(layer, h).chunks()[i];  // under this call's lock
        if (!to_device && !ch.cold()) return true;
        return PromotionCache::Held(to_device ? ch.copies.device() : ch.copies.promoted());
      });
    }
  }
  const bool refine = refines() && !c.everything;
  if (refine) {
    const bool by_need = policy_.layer_budget() == v1::LAYER_BUDGET_BY_NEED;
    float need = 0.f;
    RETURN_IF_ERROR(RefineLayer(promotion(layer, /*to_device=*/false), heads(layer),
                                policy_.refine_score(), policy_.mass_target(), q,
                                static_cast<int>(shape_.num_q_heads() / shape_.num_kv_heads()), &c,
                                by_need ? &need : nullptr));
    if (by_need) needs_.Record(layer, need);
  }
  // Chunks with a row returned: what summaries leave out (copied only when asked for, before
  // GatherRows takes the gathered rows' chunks out of c.chunks).
  const bool summaries = req.include_summaries() && !c.everything;
  std::vector<std::vector<uint32_t>> returned;
  if (summaries) returned = c.chunks;
  std::vector<std::vector<GatheredBlock>> gathered(shape_.num_kv_heads());
  if (refine && !req.row_handles()) {
    ASSIGN_OR_RETURN(gathered, GatherRows(promotion(layer, to_device), heads(layer), &c,
                                          to_device ? &device_gathers_ : &host_gathers_));
  }
  std::vector<std::vector<SlotRef>> readable;
  if (!c.host_slots.empty() && !to_device) {
    readable = std::move(c.host_slots);  // what the refinement read is what the worker reads
  } else {
    ASSIGN_OR_RETURN(readable,
                     Readable(promotion(layer, to_device), heads(layer), c.chunks, false));
  }
  const ChunkFormat f = format();
  std::vector<SlotRef> pinned;
  size_t blocks = 0;
  for (uint32_t h = 0; h < shape_.num_kv_heads(); ++h) {
    blocks += c.chunks[h].size() + gathered[h].size();
  }
  pinned.reserve(blocks);
  out->set_context_tokens(layers_[layer].tokens);
  for (uint32_t h = 0; h < shape_.num_kv_heads(); ++h) {
    const Stream& s = stream(layer, h);
    v1::HeadSelection* hs = out->add_heads();
    hs->set_kv_head(h);
    for (size_t i = 0; i < c.chunks[h].size(); ++i) {
      const uint32_t chunk = c.chunks[h][i];
      SlotRef& slot = readable[h][i];
      RETURN_IF_ERROR(FillHandle(s.chunks()[chunk], f, slot.get(), slot->data(),
                                 EncodeChunkId({layer, h, chunk}), req.include_data(),
                                 c.rows.empty() ? std::span<const uint32_t>() : c.rows[h].of(i),
                                 hs->add_blocks()));
      pinned.push_back(std::move(slot));  // its last use here: no count taken and let go
    }
    for (GatheredBlock& g : gathered[h]) {
      RETURN_IF_ERROR(FillGatheredHandle(g.slot.get(), g.positions, f, layer, h, req.include_data(),
                                         hs->add_blocks()));
      pinned.push_back(std::move(g.slot));
    }
    if (summaries) AddSummaries(s, f, returned[h], hs);
  }
  ASSIGN_OR_RETURN(const LeaseTable::Granted lease,
                   env_.leases->Create(tenant_leases_, id_, std::move(pinned), ttl, req.worker_id(),
                                       leases_, env_.max_leases_per_tenant));
  out->set_lease_id(lease.lease_id);
  out->set_lease_expires_unix_ms(lease.expires_unix_ms);
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> Session::Prefetch(PrefetchGuess guess) {
  BackgroundLock lock(&mu_, foreground_);  // background work, as aging is
  RETURN_IF_ERROR(CheckOpen());
  if (guess.layer >= shape_.num_layers() || guess.chunks.size() != shape_.num_kv_heads()) {
    return 0;
  }
  // Indices past a stream's end (aging renumbered it meanwhile) are dropped.
  for (uint32_t h = 0; h < guess.chunks.size(); ++h) {
    const size_t n = stream(guess.layer, h).chunks().size();
    std::erase_if(guess.chunks[h], [n](uint32_t c) { return c >= n; });
  }
  size_t made = 0;
  RETURN_IF_ERROR(Readable(promotion(guess.layer, guess.to_device), heads(guess.layer),
                           guess.chunks, /*prefetch=*/true, &made)
                      .status());
  return made;
}

uint64_t Session::ReplyBytesBound(const v1::SelectRequest& req) const {
  ForegroundLock lock(&mu_, &foreground_);
  // A session closed or moved since the caller found it holds no streams; the Select that
  // follows says so (CheckOpen).
  if (closed_ || req.layer() >= shape_.num_layers()) return 0;
  return ReplyBound(req);
}

uint64_t Session::ReplyBound(const v1::SelectRequest& req) const {
  const ChunkFormat f = format();
  const uint64_t total = layers_[req.layer()].tokens;
  const uint64_t budget = req.budget_tokens() ? req.budget_tokens() : policy_.default_budget();
  // Rows per KV head: all of them, or the budget (times the largest share a layer's need can
  // give it) and the rest of the chunks that hold a sink or a window row.
  uint64_t rows = total;
  if (req.layer() >= policy_.dense_layers() && total > budget) {
    const double share =
        policy_.layer_budget() == v1::LAYER_BUDGET_BY_NEED ? LayerNeeds::kMaxShare : 1.0;
    rows =
        std::min<uint64_t>(total, static_cast<uint64_t>(share * double(budget)) + 2 * f.capacity);
    // Refined rows named in their chunks (row_handles) bring each such chunk whole, and every
    // one of them is of the chunk pool the rows were refined from: refine_factor (at least 1)
    // times the rows, and the chunk that crosses its end.
    if (req.row_handles() && refines()) {
      const uint64_t pool = std::max<uint64_t>(policy_.refine_factor(), 1) * rows + f.capacity;
      rows = std::min(total, std::max(rows, pool));
    }
  }
  const uint64_t d = shape_.head_dim();
  const uint64_t chunks = stream(req.layer(), 0).chunks().size();
  // K and V rows when asked for, and each row's position and row index as varints.
  const uint64_t per_row = (req.include_data() ? 2 * f.row_bytes() : 0) + 10 + 5;
  // A handle's other fields and framing; a handle per chunk and per gathered block.
  constexpr uint64_t kPerHandle = 128;
  const uint64_t handles = std::min(rows, chunks + rows / f.capacity + 1);
  uint64_t head = rows * per_row + handles * kPerHandle + 16;
  if (req.include_summaries()) head += chunks * (8 * d + 24);  // a summary's two float means
  return shape_.num_kv_heads() * head + 128;  // the lease id, its expiry, context_tokens
}

absl::Status Session::CheckChunkIds(const std::vector<uint64_t>& ids) const {
  MutexLock lock(&mu_);
  RETURN_IF_ERROR(CheckOpen());  // a closed or moved session holds no streams
  for (uint64_t id : ids) RETURN_IF_ERROR(CheckChunkId(id));
  return absl::OkStatus();
}

absl::Status Session::CheckChunkId(uint64_t id) const {
  ChunkAddress a = DecodeChunkId(id);
  if (EncodeChunkId(a) != id || a.layer >= shape_.num_layers() ||
      a.kv_head >= shape_.num_kv_heads() || a.index >= stream(a.layer, a.kv_head).chunks().size()) {
    return absl::NotFoundError(
        absl::StrFormat("chunk_ids: %d (layer %d, kv_head %d, index %d) is not in session \"%s\"",
                        id, a.layer, a.kv_head, a.index, id_));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<v1::BlockHandle>> Session::ReadChunks(const std::vector<uint64_t>& ids) {
  ForegroundLock lock(&mu_, &foreground_);
  RETURN_IF_ERROR(CheckOpen());
  last_access_ms_ = env_.clock->NowMs();
  const ChunkFormat f = format();
  std::vector<v1::BlockHandle> out;
  out.reserve(ids.size());
  for (uint64_t id : ids) {
    RETURN_IF_ERROR(CheckChunkId(id));
    const ChunkAddress a = DecodeChunkId(id);
    const Chunk& c = stream(a.layer, a.kv_head).chunks()[a.index];
    // A cold chunk with no fp16 copy comes dequantized, inline only (segment_id 0).
    const SlotRef promoted = c.cold() ? env_.host_copies->Peek(c.copies.promoted()) : nullptr;
    const Slot* readable = c.cold() ? promoted.get() : c.host.get();
    std::vector<uint16_t> scratch;
    const uint8_t* fp16 =
        readable ? readable->data() : reinterpret_cast<const uint8_t*>(f.Fp16Rows(c, scratch));
    RETURN_IF_ERROR(
        FillHandle(c, f, readable, fp16, id, /*include_data=*/true, {}, &out.emplace_back()));
  }
  return out;
}

absl::StatusOr<std::unique_ptr<Session>> Session::Fork(std::string new_id, uint64_t num_tokens) {
  MutexLock lock(&mu_);
  RETURN_IF_ERROR(CheckOpen());
  AgeAllLocked();  // the child starts from chunks in their final form
  const uint64_t have = MinTokens();
  if (num_tokens == 0) num_tokens = have;
  if (num_tokens > have) {
    return InvalidField(
        "num_tokens",
        absl::StrFormat("%d is above the %d tokens stored in every layer", num_tokens, have));
  }
  const uint32_t kvh = shape_.num_kv_heads();
  const bool boundary = policy_.chunking() == v1::CHUNKING_BOUNDARY;
  const ChunkFormat f = format();
  // Per layer, the chunks wholly below num_tokens are shared (a regrouped span only whole);
  // the rows from `from` up to num_tokens are copied, in position order, into fresh chunks
  // of at most `piece` rows. Chunk boundaries are the same for every KV head of a layer.
  const uint32_t piece = boundary ? f.capacity : policy_.chunk_tokens();
  std::vector<uint32_t> keep(shape_.num_layers(), 0);
  std::vector<uint64_t> from(shape_.num_layers(), 0);
  uint64_t slots_needed = 0;
  for (uint32_t l = 0; l < shape_.num_layers(); ++l) {
    const std::vector<Chunk>& chunks = stream(l, 0).chunks();
    uint32_t k = 0;
    while (k < chunks.size()) {
      uint32_t span_end = k + 1;  // a regrouped span goes whole or not at all
      while (span_end < chunks.size() && !chunks[k].offsets.empty() &&
             chunks[span_end].first == chunks[k].first) {
        ++span_end;
      }
      bool below = true;
      for (uint32_t c = k; c < span_end; ++c) below = below && chunks[c].end() <= num_tokens;
      if (!below) break;
      k = span_end;
    }
    keep[l] = k;
    from[l] = k < chunks.size() ? chunks[k].first : num_tokens;
    slots_needed += kvh * ((num_tokens - from[l] + piece - 1) / piece);
  }
  // The child's metadata (its shell, the shared chunks' records and statistics, the copies'),
  // then its slots, before any work.
  uint64_t child_chunks = slots_needed;
  for (uint32_t l = 0; l < shape_.num_layers(); ++l) child_chunks += uint64_t{kvh} * keep[l];
  MetadataCharge charge(host_account_);
  RETURN_IF_ERROR(charge.Grow(CreationBytes(shape_, labels_, new_id, tenant_) +
                              child_chunks * ChunkBytesEstimate(f)));
  auto child =
      std::unique_ptr<Session>(new Session(*this, std::move(new_id), policy_, std::move(charge)));
  std::vector<SlotRef> copies;
  for (uint64_t i = 0; i < slots_needed; ++i) {
    ASSIGN_OR_RETURN(SlotRef s, env_.host->Allocate(host_account_, f.slot_bytes()));
    copies.push_back(std::move(s));
  }
  size_t next = 0;
  MutexLock child_lock(&child->mu_);  // not yet visible to anyone else
  for (uint32_t l = 0; l < shape_.num_layers(); ++l) {
    for (uint32_t h = 0; h < kvh; ++h) {
      child->heads(l)[h].ForkFrom(stream(l, h), keep[l], from[l], num_tokens, piece,
                                  boundary ? 0 : policy_.chunk_tokens(), f,
                                  [&] { return std::move(copies[next++]); });
    }
    Layer& to = child->layers_[l];
    const AgingState& was = layers_[l].aging;
    to.tokens = num_tokens;
    to.aged_tokens = num_tokens;
    to.aging = {.regrouped = std::min(was.regrouped, keep[l]),
                .quantized = std::min(was.quantized, keep[l]),
                .peaked = std::min(was.peaked, keep[l])};
    IndexLayer(child->aging(), num_tokens, child->heads(l), &to.aging);  // its own index
  }
  child->charge_.Set(child->MeasureMetadata());
  return child;
}

absl::StatusOr<uint64_t> Session::Evict(v1::Tier tier) {
  MutexLock lock(&mu_);
  RETURN_IF_ERROR(CheckOpen());
  switch (tier) {
    case v1::TIER_DEVICE: {
      uint64_t bytes = 0;
      for (Stream& s : streams_) {
        for (uint32_t c = 0; c < s.chunks().size(); ++c) {
          if (!s.chunks()[c].copies.device()) continue;
          bytes += env_.device_copies->Drop(s.chunks()[c].copies.device());
          s.copies(c).reset_device();  // a lease still holding it keeps the memory until released
        }
      }
      device_gathers_.Clear();  // likewise
      return bytes;
    }
    case v1::TIER_HOST:
      return absl::FailedPreconditionError(absl::StrCat(
          "tier: TIER_HOST cannot be evicted: no remote tier is configured and session \"", id_,
          "\" is live"));
    default:
      return InvalidField("tier", absl::StrCat(v1::Tier_Name(tier),
                                               " has no tier below it; use TIER_DEVICE or "
                                               "TIER_HOST"));
  }
}

absl::StatusOr<v1::SessionPolicy> Session::SetPolicy(const v1::SessionPolicy& policy) {
  MutexLock lock(&mu_);
  RETURN_IF_ERROR(CheckOpen());
  ASSIGN_OR_RETURN(v1::SessionPolicy next, ResolvePolicy(policy, policy_, "policy"));
  const bool stored =
      std::any_of(layers_.begin(), layers_.end(), [](const Layer& l) { return l.tokens > 0; });
  if (stored && next.chunk_tokens() != policy_.chunk_tokens()) {
    return absl::FailedPreconditionError(
        absl::StrFormat("policy.chunk_tokens: cannot change from %d to %d once tokens are stored",
                        policy_.chunk_tokens(), next.chunk_tokens()));
  }
  if (stored && next.chunking() != policy_.chunking()) {
    return absl::FailedPreconditionError(
        absl::StrCat("policy.chunking: cannot change from ", v1::Chunking_Name(policy_.chunking()),
                     " to ", v1::Chunking_Name(next.chunking()), " once tokens are stored"));
  }
  policy_ = next;
  ++version_;
  // A smaller window or fewer sinks age chunks out now; the index takes them in.
  for (uint32_t l = 0; l < shape_.num_layers(); ++l) {
    IndexLayer(aging(), layers_[l].tokens, heads(l), &layers_[l].aging);
    layers_[l].aging_settled = false;  // their regrouping and quantizing wait for the pool
  }
  charge_.Set(MeasureMetadata());
  return policy_;
}

Session::Holdings Session::EndLocked() {
  closed_ = true;
  aged_.SignalAll();  // an append waiting on the backlog finds the session closed
  Holdings out;
  out.streams.swap(streams_);
  out.host_gathers.swap(host_gathers_);
  out.device_gathers.swap(device_gathers_);
  charge_.Set(0);
  MutexLock staging(&staging_mu_);
  out.staging.swap(staging_);
  return out;
}

void Session::Close() {
  Holdings ended;
  {
    MutexLock lock(&mu_);
    ended = EndLocked();
  }
  // Slots go back to their tiers here, outside the session lock.
}

v1::SessionRecord Session::Export() const {
  v1::SessionRecord r;
  r.set_session_id(id_);
  r.set_tenant(tenant_);
  *r.mutable_shape() = shape_;
  *r.mutable_policy() = policy_;
  r.mutable_labels()->insert(labels_.begin(), labels_.end());
  r.set_created_unix_ms(created_ms_);
  r.set_restored(restored());
  for (const Layer& l : layers_) r.add_layer_tokens(l.tokens);
  const ChunkFormat f = format();
  for (const Stream& s : streams_) EncodeStream(s, f, r.add_streams());
  return r;
}

absl::StatusOr<v1::SessionRecord> Session::ExportRecord() const {
  MutexLock lock(&mu_);
  RETURN_IF_ERROR(CheckOpen());
  return Export();
}

std::optional<Session::Snapshot> Session::SnapshotIfChanged() const {
  MutexLock lock(&mu_);
  if (closed_ || version_ == persisted_) return std::nullopt;
  return Snapshot{Export(), version_};
}

uint64_t Session::version() const {
  MutexLock lock(&mu_);
  return version_;
}

void Session::MarkPersisted(uint64_t version) {
  MutexLock lock(&mu_);
  persisted_ = std::max(persisted_, version);
}

absl::StatusOr<uint64_t> Session::Demote(
    const std::function<absl::Status(const v1::SessionRecord&)>& store) {
  Holdings ended;
  uint64_t bytes;
  {
    MutexLock lock(&mu_);
    RETURN_IF_ERROR(CheckOpen());
    if (size_t leases = live_leases(); leases > 0) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "session_id: \"%s\" has %d active leases; leased chunks are not moved", id_, leases));
    }
    const v1::SessionRecord record = Export();
    bytes = record.ByteSizeLong();
    RETURN_IF_ERROR(store(record));
    demoted_ = true;
    ended = EndLocked();
  }
  return bytes;  // the slots go back to their tiers here, outside the lock
}

absl::StatusOr<std::unique_ptr<Session>> Session::Import(const v1::SessionRecord& r,
                                                         const SessionEnv& env) {
  const std::string what = absl::StrCat("record of session ", Quoted(r.session_id()));
  // A record that passed its checksum but does not describe a session: lost, never served.
  auto bad = [&](absl::string_view why) {
    return absl::DataLossError(absl::StrCat(what, ": ", why));
  };
  auto resolved = ResolveShape(r.shape());
  if (!resolved.ok()) return bad(resolved.status().message());
  const v1::ModelShape& shape = *resolved;
  const size_t streams = static_cast<size_t>(shape.num_layers()) * shape.num_kv_heads();
  if (r.streams_size() != static_cast<int>(streams) ||
      r.layer_tokens_size() != static_cast<int>(shape.num_layers())) {
    return bad("streams or layer_tokens do not match its shape");
  }
  auto policy = ResolvePolicy(r.policy(), BuiltinPolicy(), "policy");
  if (!policy.ok()) return bad(policy.status().message());
  std::map<std::string, std::string> labels(r.labels().begin(), r.labels().end());
  // Its metadata is checked against the tier and the quota before anything is allocated.
  uint64_t chunks = 0;
  for (const v1::StreamRecord& sr : r.streams()) chunks += sr.chunks_size();
  MetadataCharge charge(env.host->Account(r.tenant()));
  RETURN_IF_ERROR(charge.Grow(CreationBytes(shape, labels, r.session_id(), r.tenant()) +
                              chunks * ChunkBytesEstimate(FormatOf(shape, *policy))));
  auto s = std::make_unique<Session>(r.session_id(), r.tenant(), shape, *policy, std::move(labels),
                                     env, std::move(charge));
  if (r.restored()) s->MarkRestored();
  MutexLock lock(&s->mu_);
  const ChunkFormat f = s->format();
  for (size_t i = 0; i < streams; ++i) {
    RETURN_IF_ERROR(
        DecodeStream(r.streams(static_cast<int>(i)), f, s->host_account_, what, &s->streams_[i]));
  }
  s->created_ms_ = r.created_unix_ms();
  // Every stream of a layer holds exactly the positions [0, layer_tokens) once each, in chunks
  // of the same boundaries in every KV head: what Locate, Select and appends rely on.
  for (uint32_t l = 0; l < shape.num_layers(); ++l) {
    const uint64_t tokens = r.layer_tokens(static_cast<int>(l));
    const std::vector<Chunk>& head0 = s->stream(l, 0).chunks();
    for (uint32_t h = 0; h < shape.num_kv_heads(); ++h) {
      const std::vector<Chunk>& chunks = s->stream(l, h).chunks();
      uint64_t rows = 0;
      for (size_t c = 0; c < chunks.size(); ++c) {
        if (chunks.size() != head0.size() || chunks[c].num_tokens != head0[c].num_tokens ||
            chunks[c].first != head0[c].first) {
          return bad(
              absl::StrFormat("layer %d: KV head %d's chunks differ from KV head 0's", l, h));
        }
        rows += chunks[c].num_tokens;
      }
      if (rows != tokens) {  // before anything is sized by the claim
        return bad(absl::StrFormat("layer %d, KV head %d: layer_tokens %d, its chunks hold %d", l,
                                   h, tokens, rows));
      }
      std::vector<bool> seen(tokens, false);
      for (const Chunk& c : chunks) {
        for (uint32_t row = 0; row < c.num_tokens; ++row) {
          const uint64_t p = c.position(row);
          if (p >= tokens || seen[p]) {
            return bad(absl::StrFormat(
                "layer %d, KV head %d: position %d is outside its %d tokens or held twice", l, h, p,
                tokens));
          }
          seen[p] = true;
        }
      }
      // In order as Locate searches them: by first position; chunks sharing one are a
      // regrouped span (each with its offsets), and a span's rows lie below the next span's
      // first position.
      for (size_t c = 1; c < chunks.size(); ++c) {
        if (chunks[c].first < chunks[c - 1].first) {
          return bad(
              absl::StrFormat("layer %d, KV head %d: chunk %d starts at %d, before chunk "
                              "%d's %d (chunks are in order of position)",
                              l, h, c, chunks[c].first, c - 1, chunks[c - 1].first));
        }
      }
      for (size_t c = 0, span_end = 0; c < chunks.size(); ++c) {
        if (c >= span_end) {  // the next span: its chunks, and where the span after it starts
          span_end = c + 1;
          while (span_end < chunks.size() && chunks[span_end].first == chunks[c].first) ++span_end;
        }
        const uint64_t limit = span_end < chunks.size() ? chunks[span_end].first : tokens;
        const bool regrouped =
            span_end - c > 1 || (c > 0 && chunks[c - 1].first == chunks[c].first);
        if ((regrouped && chunks[c].offsets.empty()) || chunks[c].end() > limit) {
          return bad(absl::StrFormat(
              "layer %d, KV head %d: chunk %d's rows (from %d) are not within its span [%d, %d)", l,
              h, c, chunks[c].position(0), chunks[c].first, limit));
        }
      }
    }
  }
  for (uint32_t l = 0; l < shape.num_layers(); ++l) {
    Layer& layer = s->layers_[l];
    layer.tokens = r.layer_tokens(static_cast<int>(l));
    const std::vector<Chunk>& chunks = s->stream(l, 0).chunks();
    layer.aging.peaked = static_cast<uint32_t>(chunks.size());  // every peak computed above
    for (uint32_t c = 0; c < chunks.size(); ++c) {
      if (!chunks[c].offsets.empty()) layer.aging.regrouped = c + 1;
    }
    // Regrouping and quantization resume where the record left them; the index is rebuilt
    // over the chunks that had left the window.
    AgeLayer(s->aging(), layer.tokens, s->heads(l), &layer.aging);
    layer.aged_tokens = layer.tokens;
  }
  s->charge_.Set(s->MeasureMetadata());
  return s;
}

bool Session::demoted() const { return demoted_.load(std::memory_order_acquire); }

bool Session::closed() const { return closed_.load(std::memory_order_acquire); }

int64_t Session::last_access_ms() const {
  MutexLock lock(&mu_);
  return last_access_ms_;
}

}  // namespace kvtier
