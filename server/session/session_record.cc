#include "server/session/session_record.h"

#include <algorithm>
#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "server/common/status_macros.h"
#include "server/quant/chunk_quant.h"
#include "server/session/transfer.h"

namespace kvtier {
namespace {

constexpr char kRecordMagic[4] = {'K', 'V', 'T', 'R'};
// A record too large for one frame, as transfer parts (EncodeRecord).
constexpr char kPartsMagic[4] = {'K', 'V', 'T', 'X'};
constexpr size_t kHeader = 16;

void PutLe(std::string& out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

uint64_t GetLe(std::string_view in, size_t at, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= uint64_t{static_cast<uint8_t>(in[at + i])} << (8 * i);
  return v;
}

}  // namespace

std::string RecordKey(const std::string& session_id) {
  return absl::StrCat("kvtier:session:", session_id);
}

uint64_t Fnv1a64(std::string_view bytes) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : bytes) {
    h ^= c;
    h *= 0x100000001b3ull;
  }
  return h;
}

std::string Frame(const char (&magic)[4], uint32_t version,
                  const google::protobuf::MessageLite& message) {
  const std::string payload = message.SerializeAsString();
  std::string out(magic, sizeof(magic));
  out.reserve(kHeader + payload.size());
  PutLe(out, version, 4);
  PutLe(out, Fnv1a64(payload), 8);
  out += payload;
  return out;
}

absl::Status Unframe(std::string_view bytes, const char (&magic)[4], uint32_t version,
                     absl::string_view what, google::protobuf::MessageLite* message) {
  if (bytes.size() < kHeader || std::memcmp(bytes.data(), magic, sizeof(magic)) != 0) {
    return absl::DataLossError(absl::StrCat(what, ": not a kvtier frame (no ",
                                            absl::string_view(magic, sizeof(magic)), " magic)"));
  }
  const uint32_t got_version = static_cast<uint32_t>(GetLe(bytes, 4, 4));
  if (got_version != version) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "%s: format version %d; this kvtierd reads version %d", what, got_version, version));
  }
  const std::string_view payload = bytes.substr(kHeader);
  if (payload.size() > kMaxRecordBytes) {  // a parse takes an int's size
    return absl::DataLossError(absl::StrCat(what, ": a payload of ", payload.size(),
                                            " bytes, past the ", kMaxRecordBytes, " one holds"));
  }
  const uint64_t want = GetLe(bytes, 8, 8), got = Fnv1a64(payload);
  if (want != got) {
    return absl::DataLossError(absl::StrFormat(
        "%s: checksum %016x, the bytes give %016x; it is not served", what, want, got));
  }
  if (!message->ParseFromArray(payload.data(), static_cast<int>(payload.size()))) {
    return absl::DataLossError(absl::StrCat(what, ": payload does not parse"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> EncodeRecord(const v1::SessionRecord& record,
                                         uint64_t max_frame_bytes) {
  if (record.ByteSizeLong() <= std::min(max_frame_bytes, kMaxRecordBytes)) {
    return Frame(kRecordMagic, kRecordVersion, record);
  }
  std::string out(kPartsMagic, sizeof(kPartsMagic));
  PutLe(out, kRecordVersion, 4);
  TransferWriter writer(record);
  for (std::string part; writer.Next(&part);) {
    PutLe(out, part.size(), 8);
    out += part;
  }
  return out;
}

absl::StatusOr<v1::SessionRecord> DecodeRecord(std::string_view bytes, const std::string& key) {
  const std::string what = absl::StrCat("remote record ", key);
  v1::SessionRecord r;
  if (bytes.size() < 8 || std::memcmp(bytes.data(), kPartsMagic, sizeof(kPartsMagic)) != 0) {
    RETURN_IF_ERROR(Unframe(bytes, kRecordMagic, kRecordVersion, what, &r));
    return r;
  }
  if (const uint32_t version = static_cast<uint32_t>(GetLe(bytes, 4, 4));
      version != kRecordVersion) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "%s: format version %d; this kvtierd reads version %d", what, version, kRecordVersion));
  }
  // No bound of the reader's own: what the parts declare is checked against what they hold,
  // and a record cut short ends early.
  TransferReader reader(std::numeric_limits<uint64_t>::max());
  for (size_t at = 8; at < bytes.size();) {
    if (bytes.size() - at < 8 || GetLe(bytes, at, 8) > bytes.size() - at - 8) {
      return absl::DataLossError(absl::StrCat(what, ": a part's size runs past its end at byte ",
                                              at, "; it is not served"));
    }
    const uint64_t n = GetLe(bytes, at, 8);
    if (absl::Status s = reader.Add(bytes.substr(at + 8, n)); !s.ok()) {
      return absl::Status(s.code(), absl::StrCat(what, ": ", s.message()));
    }
    if (reader.carrier() != v1::CHUNK_CARRIER_PARTS) {  // a stored record carries its bytes
      return absl::DataLossError(absl::StrCat(what, ": its header names a carrier"));
    }
    at += 8 + n;
  }
  if (!reader.complete()) {
    return absl::DataLossError(absl::StrCat(what, ": its parts end early; it is not served"));
  }
  return reader.Take();
}

void EncodeStream(const Stream& stream, const ChunkFormat& f, v1::StreamRecord* out) {
  for (const Chunk& c : stream.chunks()) {
    v1::ChunkRecord* cr = out->add_chunks();
    cr->set_num_tokens(c.num_tokens);
    cr->set_first(c.first);
    if (!c.offsets.empty()) {
      std::string off;
      for (uint32_t r = 0; r < c.offsets.size(); ++r) PutLe(off, c.offsets[r], 2);
      cr->set_offsets(std::move(off));
    }
    cr->set_sealed(c.sealed);
    cr->set_precision(f.precision(c));
    cr->set_data(c.host->data(), f.StoredBytes(c));
  }
}

absl::Status DecodeStream(const v1::StreamRecord& record, const ChunkFormat& f,
                          const TierAccount& host, absl::string_view what, Stream* out) {
  auto bad = [&](absl::string_view why) {
    return absl::DataLossError(absl::StrCat(what, ": ", why));
  };
  for (const v1::ChunkRecord& cr : record.chunks()) {
    Chunk c;
    if (cr.num_tokens() == 0 || cr.num_tokens() > f.capacity || cr.offsets().size() % 2 != 0 ||
        (!cr.offsets().empty() && cr.offsets().size() != 2 * cr.num_tokens())) {
      return bad("a chunk's size or offsets are out of range");
    }
    c.num_tokens = static_cast<uint16_t>(cr.num_tokens());  // at most the capacity, 128
    c.first = cr.first();
    c.sealed = cr.sealed();
    c.precision = cr.precision();
    if (c.precision != f.warm() && !c.cold()) return bad("a chunk's precision is not one stored");
    // A bf16 session is lossless: a cold chunk would dequantize to fp16 bits served as bf16.
    if (c.cold() && f.kind() == HalfKind::kBf16) return bad("a bf16 session's chunk is cold");
    std::vector<uint32_t> offsets;
    for (size_t j = 0; j < cr.offsets().size(); j += 2) {
      offsets.push_back(static_cast<uint32_t>(GetLe(cr.offsets(), j, 2)));
      if (offsets.size() > 1 && offsets.back() <= offsets[offsets.size() - 2]) {
        return bad("a chunk's offsets do not ascend");
      }
    }
    c.offsets = RowOffsets(offsets);
    const uint64_t bytes = f.StoredBytes(c);
    if (cr.data().size() != bytes) return bad("a chunk's bytes do not match its size");
    // What appends refuse, a record may not bring in: no Inf or NaN in rows, and no cold
    // parameters that dequantize to one.
    const auto* data = reinterpret_cast<const uint8_t*>(cr.data().data());
    if (c.cold()) {
      RETURN_IF_ERROR(CheckQuantHeaders(data, f.ColdLayout(c), what));
    } else if (FindNonFinite(f.kind(), reinterpret_cast<const uint16_t*>(data), bytes / 2) >= 0) {
      // Read in place, as AppendKV's check reads its request's bytes.
      return bad("a chunk holds a value that is Inf or NaN");
    }
    absl::StatusOr<SlotRef> slot = host.tier()->Allocate(host, c.cold() ? bytes : f.slot_bytes());
    if (!slot.ok()) return slot.status();
    c.host = *std::move(slot);
    std::memcpy(c.host->data(), data, bytes);
    out->Restore(std::move(c), f);
  }
  return absl::OkStatus();
}

}  // namespace kvtier
