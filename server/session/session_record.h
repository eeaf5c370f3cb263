// How a session is stored on the remote tier: one record per session,
//
//   offset 0      4          8                     16
//   +-------------+----------+---------------------+------------------------------+
//   | "KVTR"      | version  | FNV-1a 64 of payload| payload: v1.SessionRecord    |
//   +-------------+----------+---------------------+------------------------------+
//   (version and checksum little-endian)
//
// or, for a record whose payload passes one frame (protobuf's 2 GiB), "KVTX", the version,
// then the record's transfer parts (transfer.h), each after its size (u64 little-endian) and
// framed with its own checksum; under the key "kvtier:session:<session_id>" (a value past
// 64 MiB in parts of its own, the key holding their manifest: RemoteStore::StoreParts). The
// record carries the model shape and the policy; a record whose magic or checksum is wrong,
// or whose parts are not all there, is DATA_LOSS and is never served.
#ifndef KVTIER_SERVER_SESSION_SESSION_RECORD_H_
#define KVTIER_SERVER_SESSION_SESSION_RECORD_H_

#include <cstdint>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "google/protobuf/message_lite.h"
#include "kvtier/v1/record.pb.h"
#include "server/session/stream.h"
#include "server/tier/tier.h"

namespace kvtier {

// 2: cold chunks' value groups of 64 channels; 3: their zeros and scales as bytes under a
// header per chunk (kernels/quant_layout.h); 4: key groups over spans of 16 tokens (a chunk of
// more has a parameter set per span).
inline constexpr uint32_t kRecordVersion = 4;

std::string RecordKey(const std::string& session_id);
uint64_t Fnv1a64(std::string_view bytes);
// A message framed as a record is: the magic, the version, the checksum, the payload.
std::string Frame(const char (&magic)[4], uint32_t version,
                  const google::protobuf::MessageLite& message);
// The message of a frame. DATA_LOSS, naming `what`, for another magic, a checksum mismatch or
// an unparsable payload; FAILED_PRECONDITION for another version.
absl::Status Unframe(std::string_view bytes, const char (&magic)[4], uint32_t version,
                     absl::string_view what, google::protobuf::MessageLite* message);
// The most one frame's payload holds: protobuf serializes and parses up to INT_MAX bytes (past
// that SerializeAsString gives an empty string). A larger record is stored as parts.
inline constexpr uint64_t kMaxRecordBytes = (uint64_t{1} << 31) - 1;
// A record's bytes: one frame (magic "KVTR") when its payload is at most `max_frame_bytes`;
// past that (protobuf's limit, by default), the record cut into transfer parts (transfer.h),
// each framed with its own checksum, one after another, each after its size (u64 little-endian),
// behind the magic "KVTX" and the version: so a session's record is not bound by 2 GiB. (The
// parts are made from a copy of the record: for such a session, a third copy of its bytes for
// the moment of the encoding.)
absl::StatusOr<std::string> EncodeRecord(const v1::SessionRecord& record,
                                         uint64_t max_frame_bytes = kMaxRecordBytes);
// Either form. DATA_LOSS for a wrong magic, a checksum mismatch, an unparsable payload, or
// parts cut short, out of order or damaged; FAILED_PRECONDITION for a version this build does
// not read. `key` names the record.
absl::StatusOr<v1::SessionRecord> DecodeRecord(std::string_view bytes, const std::string& key);

// One stream's chunks in a record: per chunk its size, first position, offsets (u16
// little-endian pairs, regrouped chunks only), sealed mark, precision and stored bytes.
void EncodeStream(const Stream& stream, const ChunkFormat& f, v1::StreamRecord* out);
// The stream a record holds, its chunks in host slots of the account's (each chunk's statistics
// recomputed from its rows). INVALID_ARGUMENT, prefixed by `what`, for a chunk whose size,
// offsets or bytes do not fit `f`; the tier's RESOURCE_EXHAUSTED as it is.
absl::Status DecodeStream(const v1::StreamRecord& record, const ChunkFormat& f,
                          const TierAccount& host, absl::string_view what, Stream* out);

}  // namespace kvtier

#endif  // KVTIER_SERVER_SESSION_SESSION_RECORD_H_
