#include "server/session/transfer.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "server/common/check.h"
#include "server/common/status_macros.h"
#include "server/session/session_record.h"

namespace kvtier {
namespace {

constexpr char kPartMagic[4] = {'K', 'V', 'T', 'P'};
// More streams than any shape has (layers and KV heads are bounded far below): a header
// claiming more is damaged, and nothing is sized by it.
constexpr uint32_t kMaxStreams = 1u << 20;
constexpr uint64_t kMinChunkBytes = 4;  // one row of head_dim 1, K and V in fp16
constexpr uint64_t kMaxCarriedPartBytes = 2 * kTransferPartBytes;

}  // namespace

TransferWriter::TransferWriter(v1::SessionRecord record, v1::ChunkCarrier carrier,
                               std::string bootstrap)
    : record_(std::move(record)), carrier_(carrier), bootstrap_(std::move(bootstrap)) {
  for (const v1::StreamRecord& s : record_.streams()) {
    chunks_ += s.chunks_size();
    for (const v1::ChunkRecord& c : s.chunks()) data_bytes_ += c.data().size();
  }
}

bool TransferWriter::Next(std::string* part, std::string* carried) {
  if (carried != nullptr) carried->clear();
  v1::TransferPart p;
  switch (stage_) {
    case Stage::kHeader: {
      v1::TransferHeader* h = p.mutable_header();
      // The record without its streams, which stay here to follow.
      google::protobuf::RepeatedPtrField<v1::StreamRecord> streams;
      streams.Swap(record_.mutable_streams());
      *h->mutable_session() = record_;
      streams.Swap(record_.mutable_streams());
      h->set_chunks(chunks_);
      h->set_data_bytes(data_bytes_);
      h->set_streams(static_cast<uint32_t>(record_.streams_size()));
      h->set_carrier(carrier_);
      h->set_carrier_bootstrap(bootstrap_);
      stage_ = Stage::kChunks;
      break;
    }
    case Stage::kChunks: {
      while (stream_ < record_.streams_size() && chunk_ == record_.streams(stream_).chunks_size()) {
        ++stream_;
        chunk_ = 0;
      }
      if (stream_ == record_.streams_size()) {
        p.mutable_end();
        stage_ = Stage::kDone;
        break;
      }
      v1::TransferChunks* c = p.mutable_chunks();
      c->set_stream(static_cast<uint32_t>(stream_));
      c->set_first(static_cast<uint32_t>(chunk_));
      v1::StreamRecord* from = record_.mutable_streams(stream_);
      uint64_t bytes = 0;
      while (chunk_ < from->chunks_size() && bytes < kTransferPartBytes) {
        v1::ChunkRecord* moved = c->add_chunks();
        moved->Swap(from->mutable_chunks(chunk_++));  // its data leaves the record
        bytes += moved->data().size();
      }
      if (carrier_ != v1::CHUNK_CARRIER_PARTS) {  // the data goes beside the part
        CHECK(carried != nullptr) << "a carried transfer's chunk data needs somewhere to go";
        carried->reserve(bytes);
        for (v1::ChunkRecord& moved : *c->mutable_chunks()) {
          c->add_carried_sizes(moved.data().size());
          carried->append(moved.data());
          moved.clear_data();
        }
        c->set_carried_checksum(Fnv1a64(*carried));
      }
      break;
    }
    case Stage::kDone:
      return false;
  }
  *part = Frame(kPartMagic, kTransferVersion, p);
  return true;
}

absl::Status TransferReader::Add(std::string_view part, const CarriedBytes& carried) {
  const std::string what = absl::StrCat("part ", ++parts_);
  auto bad = [&](absl::string_view why) {
    return absl::DataLossError(absl::StrCat(what, ": ", why, "; nothing is imported"));
  };
  v1::TransferPart p;
  RETURN_IF_ERROR(Unframe(part, kPartMagic, kTransferVersion, what, &p));
  if (stage_ == Stage::kDone) return bad("comes after the end part");
  switch (p.part_case()) {
    case v1::TransferPart::kHeader: {
      if (stage_ != Stage::kHeader) return bad("a second header");
      v1::TransferHeader* h = p.mutable_header();
      if (h->data_bytes() > max_data_bytes_) {
        return absl::ResourceExhaustedError(absl::StrFormat(
            "%s: the session holds %d bytes of chunk data; this daemon takes at most %d (its "
            "host tier's capacity)",
            what, h->data_bytes(), max_data_bytes_));
      }
      if (h->session().streams_size() != 0 || h->streams() > kMaxStreams) {
        return bad("a header whose streams are out of range");
      }
      // Every chunk holds a row's K and V at least (4 bytes): so the chunk records a transfer
      // may bring, whatever their data, are bounded by the data the tier can hold.
      if (h->chunks() > h->data_bytes() / kMinChunkBytes) {
        return bad(absl::StrFormat("a header of %d chunks holding %d bytes of data", h->chunks(),
                                   h->data_bytes()));
      }
      if (!v1::ChunkCarrier_IsValid(h->carrier())) {
        return bad(absl::StrFormat("a header naming carrier %d, which this daemon does not know",
                                   h->carrier()));
      }
      carrier_ = h->carrier();
      bootstrap_ = std::move(*h->mutable_carrier_bootstrap());
      declared_chunks_ = h->chunks();
      declared_bytes_ = h->data_bytes();
      record_ = std::move(*h->mutable_session());
      for (uint32_t i = 0; i < h->streams(); ++i) record_.add_streams();
      stage_ = Stage::kChunks;
      return absl::OkStatus();
    }
    case v1::TransferPart::kChunks: {
      if (stage_ != Stage::kChunks) return bad("chunks before the header");
      v1::TransferChunks* c = p.mutable_chunks();
      const int s = static_cast<int>(c->stream());
      if (c->stream() >= static_cast<uint32_t>(record_.streams_size()) || s < stream_ ||
          c->chunks_size() == 0 ||
          c->first() != static_cast<uint32_t>(record_.streams(s).chunks_size())) {
        return bad(absl::StrFormat(
            "chunks %d.. of stream %d out of order (after stream %d of %d, which holds %d)",
            c->first(), c->stream(), stream_, record_.streams_size(),
            c->stream() < static_cast<uint32_t>(record_.streams_size())
                ? record_.streams(s).chunks_size()
                : 0));
      }
      stream_ = s;
      const bool carried_here = carrier_ != v1::CHUNK_CARRIER_PARTS;
      if (carried_here != (c->carried_sizes_size() > 0) ||
          (carried_here && c->carried_sizes_size() != c->chunks_size())) {
        return bad(absl::StrFormat("%d carried sizes for %d chunks, with carrier %s",
                                   c->carried_sizes_size(), c->chunks_size(),
                                   v1::ChunkCarrier_Name(carrier_)));
      }
      uint64_t bytes = 0;
      for (int i = 0; i < c->chunks_size(); ++i) {
        const uint64_t n = carried_here ? c->carried_sizes(i) : c->chunks(i).data().size();
        if (carried_here && !c->chunks(i).data().empty()) return bad("data in a carried chunk");
        bytes += std::min(n, declared_bytes_ + 1);  // no wrap: one past the header's is too many
      }
      chunks_ += c->chunks_size();
      data_bytes_ += bytes;
      if (chunks_ > declared_chunks_ || data_bytes_ > declared_bytes_) {
        return bad(
            absl::StrFormat("%d chunks and %d bytes so far, more than the header's %d and %d",
                            chunks_, data_bytes_, declared_chunks_, declared_bytes_));
      }
      if (carried_here) {  // sizes checked: now the bytes, from the carrier
        // A part holds about kTransferPartBytes, past it by one chunk at most (a chunk is far
        // smaller): so what one part makes this daemon receive at once stays bounded.
        if (bytes > kMaxCarriedPartBytes) {
          return bad(absl::StrFormat("%d carried bytes in one part; a part carries at most %d",
                                     bytes, kMaxCarriedPartBytes));
        }
        if (!carried) return absl::InternalError(absl::StrCat(what, ": no carrier to read from"));
        absl::StatusOr<std::string> data = carried(bytes);
        if (!data.ok()) {
          return absl::Status(data.status().code(),
                              absl::StrCat(what, ": ", data.status().message()));
        }
        if (data->size() != bytes || Fnv1a64(*data) != c->carried_checksum()) {
          return bad("its carried bytes do not match its checksum");
        }
        uint64_t at = 0;
        for (int i = 0; i < c->chunks_size(); ++i) {
          c->mutable_chunks(i)->set_data(data->substr(at, c->carried_sizes(i)));
          at += c->carried_sizes(i);
        }
      }
      v1::StreamRecord* to = record_.mutable_streams(s);
      for (v1::ChunkRecord& cr : *c->mutable_chunks()) to->add_chunks()->Swap(&cr);
      return absl::OkStatus();
    }
    case v1::TransferPart::kEnd:
      if (stage_ != Stage::kChunks) return bad("the end before the header");
      if (chunks_ != declared_chunks_ || data_bytes_ != declared_bytes_) {
        return bad(
            absl::StrFormat("the end after %d chunks and %d bytes, of the header's %d and %d",
                            chunks_, data_bytes_, declared_chunks_, declared_bytes_));
      }
      stage_ = Stage::kDone;
      return absl::OkStatus();
    case v1::TransferPart::PART_NOT_SET:
      break;
  }
  return bad("an empty part");
}

absl::StatusOr<v1::SessionRecord> TransferReader::Take() {
  if (stage_ != Stage::kDone) {
    return absl::DataLossError(absl::StrFormat(
        "part: the parts ended after %d (%d of %d chunks) without the end part; nothing is "
        "imported",
        parts_, chunks_, declared_chunks_));
  }
  stage_ = Stage::kHeader;
  return std::move(record_);
}

}  // namespace kvtier
