#include "server/session/views.h"

#include <array>
#include <map>

#include "server/common/mutex.h"
#include "server/common/status_macros.h"
#include "server/common/vec.h"
#include "server/session/session.h"

namespace kvtier {
namespace {

// The bytes of a cached copy, 0 when there is none.
uint64_t CopyBytes(const PromotionCache& cache, const CopyRef& copy) {
  const SlotRef slot = cache.Peek(copy);
  return slot ? slot->bytes() : 0;
}

}  // namespace

namespace {

// A handle's K and V bytes, inline: from `fp16` where they are mapped here, else read out of
// `slot` (a device slot's).
absl::Status SetData(const Slot* slot, const uint8_t* fp16, uint64_t half, v1::BlockHandle* h) {
  if (fp16 != nullptr) {
    h->set_keys(fp16, half);
    h->set_values(fp16 + half, half);
    return absl::OkStatus();
  }
  std::string* keys = h->mutable_keys();
  std::string* values = h->mutable_values();
  keys->resize(half);
  values->resize(half);
  RETURN_IF_ERROR(slot->Read(0, keys->data(), half));
  return slot->Read(half, values->data(), half);
}

}  // namespace

absl::Status FillHandle(const Chunk& c, const ChunkFormat& f, const Slot* slot, const uint8_t* fp16,
                        uint64_t chunk_id, bool include_data, std::span<const uint32_t> rows,
                        v1::BlockHandle* h) {
  const uint64_t half = c.num_tokens * f.row_bytes();
  const ChunkAddress a = DecodeChunkId(chunk_id);
  h->set_chunk_id(chunk_id);
  h->set_tier(slot ? slot->tier() : v1::TIER_HOST);
  h->set_segment_id(slot ? slot->segment_id() : 0);
  h->set_offset(slot ? slot->offset() : 0);
  h->set_length(2 * half);
  h->set_precision(f.warm());
  h->set_stored_precision(f.precision(c));
  h->set_num_tokens(c.num_tokens);
  h->set_generation((slot ? slot : c.host.get())->generation());
  h->set_layer(a.layer);
  h->set_kv_head(a.kv_head);
  // Written in place: adding them one by one regrows the field a few times per handle.
  google::protobuf::RepeatedField<int64_t>* positions = h->mutable_positions();
  positions->Resize(static_cast<int>(c.num_tokens), 0);
  int64_t* p = positions->mutable_data();
  for (uint32_t r = 0; r < c.num_tokens; ++r) p[r] = static_cast<int64_t>(c.position(r));
  h->mutable_rows()->Add(rows.begin(), rows.end());
  return include_data ? SetData(slot, fp16, half, h) : absl::OkStatus();
}

absl::Status FillGatheredHandle(const Slot* slot, std::span<const int64_t> positions,
                                const ChunkFormat& f, uint32_t layer, uint32_t kv_head,
                                bool include_data, v1::BlockHandle* h) {
  const uint64_t half = positions.size() * f.row_bytes();
  h->set_chunk_id(0);
  h->set_gathered(true);
  h->set_tier(slot->tier());
  h->set_segment_id(slot->segment_id());
  h->set_offset(slot->offset());
  h->set_length(2 * half);
  h->set_precision(f.warm());
  h->set_stored_precision(f.warm());
  h->set_num_tokens(static_cast<uint32_t>(positions.size()));
  h->set_generation(slot->generation());
  h->set_layer(layer);
  h->set_kv_head(kv_head);
  h->mutable_positions()->Add(positions.begin(), positions.end());
  return include_data ? SetData(slot, slot->data(), half, h) : absl::OkStatus();
}

void AddSummaries(const Stream& s, const ChunkFormat& f, const std::vector<uint32_t>& chosen,
                  v1::HeadSelection* out) {
  const int d = static_cast<int>(f.head_dim);
  struct Group {
    uint32_t tokens = 0;
    std::vector<float> key_sum, value_sum;
  };
  std::vector<Group> groups;
  std::map<uint32_t, size_t> group_of_cluster;
  std::vector<uint16_t> scratch;
  std::vector<float> mean(d);
  size_t next = 0;
  for (uint32_t c = 0; c < s.chunks().size(); ++c) {
    if (next < chosen.size() && chosen[next] == c) {
      ++next;
      continue;
    }
    const uint32_t cluster = s.index() ? s.index()->cluster_of(c) : ClusterIndex::kNoCluster;
    size_t g = groups.size();
    if (cluster != ClusterIndex::kNoCluster) {
      g = group_of_cluster.emplace(cluster, groups.size()).first->second;
    }
    if (g == groups.size()) {
      groups.push_back({0, std::vector<float>(d, 0.f), std::vector<float>(d, 0.f)});
    }
    Group& grp = groups[g];
    const uint32_t n = s.chunks()[c].num_tokens;
    grp.tokens += n;
    s.stats().Mean(c, mean.data());
    for (int j = 0; j < d; ++j) grp.key_sum[j] += mean[j] * static_cast<float>(n);
    const uint16_t* v_rows = f.Fp16Rows(s.chunks()[c], scratch) + static_cast<size_t>(n) * d;
    AddRows(f.kind(), v_rows, static_cast<int>(n), d, grp.value_sum.data());
  }
  for (Group& grp : groups) {
    for (int j = 0; j < d; ++j) {
      grp.key_sum[j] /= static_cast<float>(grp.tokens);
      grp.value_sum[j] /= static_cast<float>(grp.tokens);
    }
    v1::ClusterSummary* sum = out->add_summaries();
    sum->set_mean_key(grp.key_sum.data(), d * sizeof(float));
    sum->set_mean_value(grp.value_sum.data(), d * sizeof(float));
    sum->set_num_tokens(grp.tokens);
  }
}

void FillChunkInfo(const Chunk& c, const ChunkFormat& f, ChunkAddress at,
                   const PromotionCache& host_copies, const PromotionCache& device_copies,
                   v1::ChunkInfo* info) {
  info->set_chunk_id(EncodeChunkId(at));
  info->set_layer(at.layer);
  info->set_kv_head(at.kv_head);
  info->set_index(at.index);
  info->set_num_tokens(c.num_tokens);
  info->set_first_position(static_cast<int64_t>(c.position(0)));
  info->set_precision(f.precision(c));
  info->set_host_bytes(c.host->bytes() + CopyBytes(host_copies, c.copies.promoted()));
  info->set_device_bytes(CopyBytes(device_copies, c.copies.device()));
  info->set_generation(c.host->generation());
  info->set_pinned(c.host->pinned());
  info->set_shared(c.host.use_count() > 1);
}

v1::SessionInfo Session::Info() const {
  MutexLock lock(&mu_);
  v1::SessionInfo info;
  info.set_session_id(id_);
  info.set_tenant(tenant_);
  *info.mutable_shape() = shape_;
  *info.mutable_policy() = policy_;
  info.set_num_tokens(closed_ ? 0 : MinTokens());
  info.set_created_unix_ms(created_ms_);
  info.set_last_access_unix_ms(last_access_ms_);
  info.mutable_labels()->insert(labels_.begin(), labels_.end());
  // A step per stream, not per chunk (a long session has hundreds of thousands, and a decode
  // loop waits for this lock): each stream keeps its slots' bytes and its chunks' precisions,
  // and the caches count this session's copies. A fork's copies of its parent's, read through
  // the chunks they share, count to the parent.
  uint64_t host = host_copy_bytes_->bytes.load(std::memory_order_relaxed);
  const uint64_t device = device_copy_bytes_->bytes.load(std::memory_order_relaxed);
  const ChunkFormat f = format();
  std::array<uint64_t, v1::Precision_ARRAYSIZE> counts{};
  for (const Stream& s : streams_) {
    host += s.slot_bytes();
    for (int p = 0; p < v1::Precision_ARRAYSIZE; ++p) {
      counts[f.precision(static_cast<v1::Precision>(p))] += s.chunks_by_precision()[p];
    }
  }
  auto& by_precision = *info.mutable_chunks_by_precision();
  for (int p = 0; p < v1::Precision_ARRAYSIZE; ++p) {
    if (counts[p] != 0) by_precision[v1::Precision_Name(static_cast<v1::Precision>(p))] = counts[p];
  }
  (*info.mutable_bytes_by_tier())[v1::Tier_Name(v1::TIER_HOST)] = host;
  (*info.mutable_bytes_by_tier())[v1::Tier_Name(v1::TIER_DEVICE)] = device;
  info.set_active_leases(static_cast<uint32_t>(live_leases()));
  info.set_metadata_bytes(charge_.bytes());
  info.set_aging_backlog_tokens(BacklogLocked());
  return info;
}

absl::StatusOr<v1::ListChunksResponse> Session::ListChunks(std::optional<uint32_t> layer,
                                                           uint32_t limit) const {
  MutexLock lock(&mu_);
  RETURN_IF_ERROR(CheckOpen());  // a moved session's streams are gone: never an empty list
  v1::ListChunksResponse out;
  const ChunkFormat f = format();
  uint64_t total = 0;
  for (uint32_t l = 0; l < shape_.num_layers(); ++l) {
    if (layer.has_value() && *layer != l) continue;
    for (uint32_t h = 0; h < shape_.num_kv_heads(); ++h) {
      const std::vector<Chunk>& chunks = stream(l, h).chunks();
      for (uint32_t i = 0; i < chunks.size(); ++i, ++total) {
        if (out.chunks_size() >= static_cast<int>(limit)) continue;
        FillChunkInfo(chunks[i], f, {l, h, i}, *env_.host_copies, *env_.device_copies,
                      out.add_chunks());
      }
    }
  }
  out.set_total(total);
  return out;
}

absl::StatusOr<std::vector<v1::LayerStats>> Session::Layers() const {
  MutexLock lock(&mu_);
  RETURN_IF_ERROR(CheckOpen());
  std::vector<v1::LayerStats> out;
  for (uint32_t l = 0; l < shape_.num_layers(); ++l) {
    v1::LayerStats& st = out.emplace_back();
    st.set_layer(l);
    st.set_num_tokens(layers_[l].tokens);
    uint64_t chunks = 0, clusters = 0, units = 0, indexed = 0;
    for (uint32_t h = 0; h < shape_.num_kv_heads(); ++h) {
      const Stream& s = stream(l, h);
      chunks += s.chunks().size();
      if (!s.index()) continue;
      clusters += s.index()->num_clusters();
      units += s.index()->num_units();
      indexed += s.index()->num_chunks();
    }
    st.set_chunks(chunks);
    st.set_clusters(clusters);
    st.set_units(units);
    st.set_indexed_chunks(indexed);
    st.set_depth(indexed ? 2 : 0);  // coarse units, then fine clusters
    st.set_select_candidates(layers_[l].select_candidates);
    st.set_select_chunks_scored(layers_[l].select_scored);
    if (policy_.layer_budget() == v1::LAYER_BUDGET_BY_NEED) {
      st.set_budget_need(needs_.need(l));
      st.set_budget_share(static_cast<float>(needs_.Share(l, policy_.dense_layers())));
    } else {
      st.set_budget_share(1.f);
    }
  }
  return out;
}

}  // namespace kvtier
