// A session on its way between daemons (ExportSession, ImportSession), as a sequence of parts:
//
//   header   the session record without its streams, and how many chunks and bytes of chunk
//            data follow
//   chunks   one stream's next chunks (stream = layer * num_kv_heads + kv_head, and the
//            index of the first), streams in order, about kTransferPartBytes of data each;
//            with a carrier (NCCL GPU to GPU, or a socket), their sizes and checksum only,
//            the bytes going daemon to daemon beside the part
//   end      nothing more follows
//
// each a v1.TransferPart framed as a remote record is (server/session/session_record.h: magic
// "KVTP", version, FNV-1a checksum), so that a part damaged or reordered on its way through a
// worker is refused, never imported. The parts of one export are made from one record taken
// under the session's lock, so they describe the session at one moment.
#ifndef KVTIER_SERVER_SESSION_TRANSFER_H_
#define KVTIER_SERVER_SESSION_TRANSFER_H_

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "kvtier/v1/record.pb.h"

namespace kvtier {

inline constexpr uint32_t kTransferVersion = 1;
inline constexpr uint64_t kTransferPartBytes = 1 << 20;

// Cuts one record into parts, one at a time: the record's chunk data moves into each part as
// it is made, so an export holds the session's bytes about once.
class TransferWriter {
 public:
  // With a carrier other than PARTS, the header names it and its bootstrap, and each chunks
  // part holds its chunks' sizes and checksum instead of their data (server/transfer/carrier.h).
  explicit TransferWriter(v1::SessionRecord record,
                          v1::ChunkCarrier carrier = v1::CHUNK_CARRIER_PARTS,
                          std::string bootstrap = "");
  // The next part's bytes; false once the end part was returned. With a carrier, the data of
  // a chunks part's chunks goes to *carried instead, in order, for the caller to send through
  // it (empty for the other parts).
  bool Next(std::string* part, std::string* carried = nullptr);
  uint64_t chunks() const { return chunks_; }
  uint64_t data_bytes() const { return data_bytes_; }

 private:
  v1::SessionRecord record_;
  v1::ChunkCarrier carrier_;
  std::string bootstrap_;
  uint64_t chunks_ = 0, data_bytes_ = 0;
  int stream_ = 0;  // the next chunk to send: stream_, chunk_
  int chunk_ = 0;
  enum class Stage { kHeader, kChunks, kDone } stage_ = Stage::kHeader;
};

// Puts a record together from the parts of one export, checking each as it comes: the header
// first (its declared data at most `max_data_bytes`, else RESOURCE_EXHAUSTED), then chunks of
// streams in order, no more than declared, then the end. DATA_LOSS, naming the part, for a
// part out of order, damaged, or beyond the header's counts; FAILED_PRECONDITION for another
// version (an export by another kvtierd release).
class TransferReader {
 public:
  // The data of one chunks part from the carrier the header named: its next `n` bytes.
  using CarriedBytes = std::function<absl::StatusOr<std::string>(uint64_t n)>;

  explicit TransferReader(uint64_t max_data_bytes) : max_data_bytes_(max_data_bytes) {}
  // `carried` is asked for each chunks part's data when the header named a carrier (after the
  // part's sizes were checked against the header's); DATA_LOSS when those bytes do not match
  // the part's checksum.
  absl::Status Add(std::string_view part, const CarriedBytes& carried = nullptr);
  // The header's carrier and bootstrap, once the header is in.
  v1::ChunkCarrier carrier() const { return carrier_; }
  const std::string& carrier_bootstrap() const { return bootstrap_; }
  bool complete() const { return stage_ == Stage::kDone; }
  // The record once complete (FAILED_PRECONDITION, "ended early", before that).
  absl::StatusOr<v1::SessionRecord> Take();
  uint64_t data_bytes() const { return data_bytes_; }
  // The chunk data the header names (0 before it).
  uint64_t declared_bytes() const { return declared_bytes_; }
  // The exported session's id, once the header is in.
  const std::string& session_id() const { return record_.session_id(); }
  bool has_header() const { return stage_ != Stage::kHeader; }

 private:
  v1::SessionRecord record_;
  v1::ChunkCarrier carrier_ = v1::CHUNK_CARRIER_PARTS;
  std::string bootstrap_;
  uint64_t max_data_bytes_;
  uint64_t declared_chunks_ = 0, declared_bytes_ = 0;
  uint64_t chunks_ = 0, data_bytes_ = 0;
  uint64_t parts_ = 0;
  int stream_ = 0;  // the stream the last chunks went to
  enum class Stage { kHeader, kChunks, kDone } stage_ = Stage::kHeader;
};

}  // namespace kvtier

#endif  // KVTIER_SERVER_SESSION_TRANSFER_H_
