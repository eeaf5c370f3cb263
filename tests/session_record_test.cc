// Session records: a session demoted to a record and imported back, every byte and the same
// selection; records that fail their checks; a record cut into transfer parts and put together.
#include "server/session/session_record.h"

#include <atomic>
#include <cstring>
#include <limits>
#include <thread>

#include "server/common/error.h"
#include "server/common/status_macros.h"
#include "server/quant/chunk_quant.h"
#include "server/session/transfer.h"
#include "server/transfer/carrier.h"
#include "tests/session_fixture.h"

namespace kvtier {
namespace {

using namespace ::kvtier::testing;

TEST(Remote, DemoteAndImportRestoreEveryByteAndTheSameSelection) {
  std::vector<std::pair<std::string, v1::SessionPolicy>> policies = {
      {"lossless", Lossless()},
      {"int4", Cold()},
      {"semantic", SemanticPolicy(false)},
      {"boundary", BoundaryPolicy(false)}};
  for (const auto& [name, policy] : policies) {
    Env e;
    Fixture f = Make(e, 3, 4, 2, 64, 700, policy, 11);
    const std::vector<int32_t> ids = TokenIds(700, 12);
    for (int s = 0; s < 700; s += 100) {
      for (int l = 0; l < 3; ++l) ASSERT_OK(f.session->Append(ReqIds(f, l, s, 100, ids)).status());
    }
    const std::vector<v1::BlockHandle> before = AllChunks(*f.session);
    const uint64_t indexed = f.session->Layers()->at(2).indexed_chunks();
    std::vector<v1::SelectResponse> selected(3);
    for (uint32_t q = 0; q < 3; ++q) {
      ASSERT_OK(f.session->Select(SelectReq(f, 2, 200, q), &selected[q]));
      ASSERT_OK(e.leases.Release("t", selected[q].lease_id()));
    }
    std::string stored;
    ASSERT_OK_AND_ASSIGN(uint64_t bytes, f.session->Demote([&](const v1::SessionRecord& r) {
      stored = *EncodeRecord(r);
      return absl::OkStatus();
    }));
    EXPECT_GT(bytes, 0u);
    EXPECT_EQ(e.host.Stats().used_bytes, 0u) << name << ": the demoted session's slots went back";
    v1::SelectResponse late;
    EXPECT_THAT(f.session->Select(SelectReq(f, 2, 200, 0), &late),
                StatusIs(Code::kUnavailable, "remote tier"));
    ASSERT_OK_AND_ASSIGN(v1::SessionRecord record, DecodeRecord(stored, "k"));
    EXPECT_EQ(record.shape().head_dim(), 64u);
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<Session> back, Session::Import(record, e.env));
    const std::vector<v1::BlockHandle> after = AllChunks(*back);
    ASSERT_EQ(after.size(), before.size()) << name;
    for (size_t i = 0; i < after.size(); ++i) {
      EXPECT_EQ(after[i].keys(), before[i].keys()) << name << " chunk " << i;
      EXPECT_EQ(after[i].values(), before[i].values()) << name << " chunk " << i;
      EXPECT_EQ(after[i].stored_precision(), before[i].stored_precision());
      EXPECT_EQ(std::vector<int64_t>(after[i].positions().begin(), after[i].positions().end()),
                std::vector<int64_t>(before[i].positions().begin(), before[i].positions().end()));
    }
    EXPECT_EQ(back->Info().num_tokens(), 700u);
    EXPECT_EQ(back->Layers()->at(2).indexed_chunks(), indexed) << name << ": the index is rebuilt";
    EXPECT_EQ(back->Info().policy().chunking(),
              policy.chunking() ? policy.chunking() : v1::CHUNKING_CONTIGUOUS);
    for (uint32_t q = 0; q < 3; ++q) {
      v1::SelectResponse again;
      auto req = SelectReq(f, 2, 200, q);
      ASSERT_OK(back->Select(req, &again));
      for (int h = 0; h < 2; ++h) {
        ASSERT_EQ(again.heads(h).blocks_size(), selected[q].heads(h).blocks_size()) << name;
        for (int b = 0; b < again.heads(h).blocks_size(); ++b) {
          EXPECT_EQ(again.heads(h).blocks(b).chunk_id(), selected[q].heads(h).blocks(b).chunk_id());
          EXPECT_EQ(again.heads(h).blocks(b).keys(), selected[q].heads(h).blocks(b).keys());
        }
      }
      ASSERT_OK(e.leases.Release("t", again.lease_id()));
    }
  }
}

TEST(Remote, BadRecordsAreRefusedAndLeasedSessionsStay) {
  Env e;
  Fixture f = Make(e, 1, 2, 1, 16, 100);
  ASSERT_OK(AppendAll(f, 100, 100));
  v1::SelectResponse held;
  ASSERT_OK(f.session->Select(SelectReq(f, 0, 100), &held));
  auto keep = [](const v1::SessionRecord&) { return absl::OkStatus(); };
  EXPECT_THAT(f.session->Demote(keep), StatusIs(Code::kFailedPrecondition, "1 active leases"));
  ASSERT_OK(e.leases.Release("t", held.lease_id()));
  std::string stored;
  auto fail = [](const v1::SessionRecord&) { return absl::UnavailableError("redis down"); };
  EXPECT_THAT(f.session->Demote(fail), StatusIs(Code::kUnavailable, "redis down"));
  ExpectStreamExact(f, 0, 0, 100);  // a failed store leaves the session as it was
  ASSERT_OK(f.session
                ->Demote([&](const v1::SessionRecord& r) {
                  stored = *EncodeRecord(r);
                  return absl::OkStatus();
                })
                .status());
  std::string flipped = stored;
  flipped[flipped.size() / 2] ^= 0x10;
  EXPECT_THAT(DecodeRecord(flipped, "kvtier:session:s"), StatusIs(Code::kDataLoss, "checksum"));
  std::string versioned = stored;
  versioned[4] = 9;
  EXPECT_THAT(DecodeRecord(versioned, "k"), StatusIs(Code::kFailedPrecondition, "version 9"));
  EXPECT_THAT(DecodeRecord("KVT", "k"),
              StatusIs(Code::kDataLoss, "not a kvtier frame (no KVTR magic)"));
  ASSERT_OK_AND_ASSIGN(v1::SessionRecord r, DecodeRecord(stored, "k"));
  r.mutable_streams(0)->mutable_chunks(0)->mutable_data()->pop_back();
  EXPECT_THAT(Session::Import(r, e.env), StatusIs(Code::kDataLoss, "bytes"));
  EXPECT_EQ(e.host.Stats().used_bytes, 0u);
  // Records that pass their checksum and lie: more tokens than the chunks hold (this crashed
  // the restore), a position held twice, a precision never stored. Each is DATA_LOSS and
  // leaves nothing allocated.
  ASSERT_OK_AND_ASSIGN(const v1::SessionRecord good, DecodeRecord(stored, "k"));
  ASSERT_OK(Session::Import(good, e.env).status());
  v1::SessionRecord more = good;
  more.set_layer_tokens(0, good.layer_tokens(0) + 1000);
  EXPECT_THAT(Session::Import(more, e.env), StatusIs(Code::kDataLoss, "layer_tokens 1100"));
  v1::SessionRecord twice = good;
  ASSERT_GE(twice.streams(0).chunks_size(), 2);
  twice.mutable_streams(0)->mutable_chunks(1)->set_first(0);
  EXPECT_THAT(Session::Import(twice, e.env), StatusIs(Code::kDataLoss, "held twice"));
  v1::SessionRecord odd = good;
  odd.mutable_streams(0)->mutable_chunks(0)->set_precision(v1::PRECISION_BF16);
  EXPECT_THAT(Session::Import(odd, e.env), StatusIs(Code::kDataLoss, "precision"));
  // Chunks that hold every position once but not in the order Locate searches them (a
  // binary search by first position): the restored session aborted on its next append. Out
  // of order; a contiguous chunk in a regrouped span; a span's row past the next span's first.
  ASSERT_GE(good.streams(0).chunks_size(), 3);
  ASSERT_EQ(good.streams(0).chunks(1).first(), 16u);
  v1::SessionRecord shuffled = good;
  shuffled.mutable_streams(0)->mutable_chunks()->SwapElements(0, 2);
  EXPECT_THAT(Session::Import(shuffled, e.env),
              StatusIs(Code::kDataLoss, "chunk 1 starts at 16, before chunk 0's 32"));
  auto offsets = [](std::vector<uint16_t> rows) {
    std::string out;
    for (uint16_t r : rows)
      out += std::string{static_cast<char>(r & 0xff), static_cast<char>(r >> 8)};
    return out;
  };
  v1::SessionRecord spanned = good;  // chunk 1 as rows 16..31 of a span from 0
  spanned.mutable_streams(0)->mutable_chunks(1)->set_first(0);
  spanned.mutable_streams(0)->mutable_chunks(1)->set_offsets(
      offsets({16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31}));
  EXPECT_THAT(Session::Import(spanned, e.env),
              StatusIs(Code::kDataLoss, "chunk 0's rows (from 0) are not within its span"));
  v1::SessionRecord crossing = good;  // 0..14 and 16 from 0; 15 and 17..31 from 15
  crossing.mutable_streams(0)->mutable_chunks(0)->set_offsets(
      offsets({0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 16}));
  crossing.mutable_streams(0)->mutable_chunks(1)->set_first(15);
  crossing.mutable_streams(0)->mutable_chunks(1)->set_offsets(
      offsets({0, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16}));
  EXPECT_THAT(Session::Import(crossing, e.env),
              StatusIs(Code::kDataLoss, "chunk 0's rows (from 0) are not within its span [0, 15)"));
  EXPECT_EQ(e.host.Stats().used_bytes, 0u);
}

// A record past what one frame holds (protobuf's 2 GiB; here 1000 bytes) is stored as transfer
// parts, each with its own checksum, and comes back the same record, every chunk's bytes; a
// damaged, cut or reordered one is refused, never served.
TEST(Remote, ARecordPastOneFrameIsStoredAsPartsAndComesBackWhole) {
  Env e;
  Fixture f = Make(e, 2, 2, 1, 16, 100);
  ASSERT_OK(AppendAll(f, 100, 100));
  const std::vector<v1::BlockHandle> before = AllChunks(*f.session);
  v1::SessionRecord record;
  std::string stored;
  ASSERT_OK(f.session
                ->Demote([&](const v1::SessionRecord& r) -> absl::Status {
                  record = r;
                  ASSIGN_OR_RETURN(stored, EncodeRecord(r, 1000));
                  return absl::OkStatus();
                })
                .status());
  ASSERT_GT(record.ByteSizeLong(), 1000u);
  EXPECT_EQ(stored.substr(0, 4), "KVTX");
  ASSERT_OK_AND_ASSIGN(v1::SessionRecord back, DecodeRecord(stored, "k"));
  EXPECT_EQ(back.SerializeAsString(), record.SerializeAsString());
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Session> imported, Session::Import(back, e.env));
  const std::vector<v1::BlockHandle> after = AllChunks(*imported);
  ASSERT_EQ(after.size(), before.size());
  for (size_t i = 0; i < after.size(); ++i) {
    EXPECT_EQ(after[i].keys(), before[i].keys()) << i;
    EXPECT_EQ(after[i].values(), before[i].values()) << i;
  }
  // The one-frame form of the same record decodes to it too.
  ASSERT_OK_AND_ASSIGN(const std::string framed, EncodeRecord(record));
  EXPECT_EQ(framed.substr(0, 4), "KVTR");
  ASSERT_OK_AND_ASSIGN(v1::SessionRecord same, DecodeRecord(framed, "k"));
  EXPECT_EQ(same.SerializeAsString(), record.SerializeAsString());

  std::string flipped = stored;
  flipped[stored.size() / 2] ^= 0x10;
  EXPECT_THAT(DecodeRecord(flipped, "kvtier:session:s"),
              StatusIs(Code::kDataLoss, "remote record kvtier:session:s"));
  // Cut after its first part (the header): ends early; cut inside a part: runs past its end.
  const uint64_t first = 8 + 8 + [&] {
    uint64_t n = 0;
    for (int i = 0; i < 8; ++i) n |= uint64_t{static_cast<uint8_t>(stored[8 + i])} << (8 * i);
    return n;
  }();
  EXPECT_THAT(DecodeRecord(stored.substr(0, first), "k"), StatusIs(Code::kDataLoss, "end early"));
  EXPECT_THAT(DecodeRecord(stored.substr(0, stored.size() - 3), "k"),
              StatusIs(Code::kDataLoss, "runs past its end"));
  std::string versioned = stored;
  versioned[4] = 9;
  EXPECT_THAT(DecodeRecord(versioned, "k"), StatusIs(Code::kFailedPrecondition, "version 9"));
}

// One stream through its record and back: the same chunks, bytes, offsets and precisions, and
// statistics recomputed to the same bits (the sums add the same rows in the same order).
TEST(StreamRecord, RoundTripKeepsEveryChunkAndItsStatistics) {
  Env e;
  Fixture f = Make(e, 1, 2, 1, 64, 700, SemanticPolicy(false), 21);  // regrouped int4 chunks
  PlantClusters(f, 21);
  ASSERT_OK(AppendAll(f, 700, 100));
  std::string stored;
  ASSERT_OK(f.session
                ->Demote([&](const v1::SessionRecord& r) {
                  stored = *EncodeRecord(r);
                  return absl::OkStatus();
                })
                .status());
  ASSERT_OK_AND_ASSIGN(v1::SessionRecord record, DecodeRecord(stored, "k"));
  const ChunkFormat fmt = FormatOf(record.shape(), record.policy());
  Stream s(64);
  ASSERT_OK(DecodeStream(record.streams(0), fmt, e.host.Account("t"), "stream 0", &s));
  v1::StreamRecord again;
  EncodeStream(s, fmt, &again);
  EXPECT_EQ(again.SerializeAsString(), record.streams(0).SerializeAsString());
  ASSERT_EQ(s.chunks().size(), size_t(record.streams(0).chunks_size()));
  bool regrouped = false, cold = false;
  for (uint32_t c = 0; c < s.chunks().size(); ++c) {
    regrouped = regrouped || !s.chunks()[c].offsets.empty();
    cold = cold || s.chunks()[c].cold();
    // The statistics are those of the rows as attention reads them (here, in double).
    std::vector<uint16_t> scratch;
    const uint16_t* rows = fmt.Fp16Rows(s.chunks()[c], scratch);
    for (int j = 0; j < 64; ++j) {
      double sum = 0;
      for (uint32_t r = 0; r < s.chunks()[c].num_tokens; ++r) sum += HalfToFloat(rows[r * 64 + j]);
      EXPECT_NEAR(s.stats().key_sum(c)[j], sum, 1e-3) << c;
    }
  }
  EXPECT_TRUE(regrouped && cold) << "the record should hold regrouped int4 chunks";
  EXPECT_EQ(s.stats().final_chunks(), 0u);  // the importing session's aging finalizes
}

TEST(StreamRecord, ChunksThatDoNotFitAreRefusedAndAFullTierSaysSo) {
  Env e;
  const ChunkFormat fmt{.head_dim = 8, .dtype = v1::DTYPE_FP16, .capacity = 16};
  auto record = [](uint32_t tokens, size_t bytes, std::string offsets = "") {
    v1::StreamRecord r;
    v1::ChunkRecord* c = r.add_chunks();
    c->set_num_tokens(tokens);
    c->set_precision(v1::PRECISION_FP16);
    c->set_data(std::string(bytes, '\1'));
    c->set_offsets(std::move(offsets));
    return r;
  };
  Stream s(8);
  EXPECT_OK(DecodeStream(record(4, 4 * 32), fmt, e.host.Account("t"), "rec", &s));
  EXPECT_EQ(s.chunks().size(), 1u);
  EXPECT_EQ(s.stats().tokens(0), 4u);
  EXPECT_THAT(DecodeStream(record(17, 17 * 32), fmt, e.host.Account("t"), "rec", &s),
              StatusIs(Code::kDataLoss, "rec: a chunk's size or offsets are out of range"));
  EXPECT_THAT(DecodeStream(record(0, 0), fmt, e.host.Account("t"), "rec", &s),
              StatusIs(Code::kDataLoss, "size or offsets"));
  EXPECT_THAT(DecodeStream(record(4, 4 * 32, "abc"), fmt, e.host.Account("t"), "rec", &s),
              StatusIs(Code::kDataLoss, "size or offsets"));
  EXPECT_THAT(DecodeStream(record(4, 100), fmt, e.host.Account("t"), "rec", &s),
              StatusIs(Code::kDataLoss, "rec: a chunk's bytes do not match its size"));
  // A record's chunk size beyond what a chunk may hold is refused before it is narrowed (65536
  // + 4 would read as 4 in the chunk's 16 bits), and offsets must ascend, as Locate searches.
  EXPECT_THAT(DecodeStream(record(65536 + 4, 4 * 32), fmt, e.host.Account("t"), "rec", &s),
              StatusIs(Code::kDataLoss, "size or offsets"));
  EXPECT_THAT(DecodeStream(record(2, 2 * 32, std::string("\3\0\1\0", 4)), fmt, e.host.Account("t"),
                           "rec", &s),
              StatusIs(Code::kDataLoss, "rec: a chunk's offsets do not ascend"));
  // What an append refuses, a record may not bring in: a NaN or Inf row (fp16: 0x7e00, 0x7c00),
  // or cold parameters that dequantize to NaN.
  for (uint16_t bad : {uint16_t{0x7e00}, uint16_t{0x7c00}}) {
    v1::StreamRecord r = record(4, 4 * 32);
    std::string* data = r.mutable_chunks(0)->mutable_data();
    std::memcpy(data->data() + 2 * 37, &bad, 2);
    EXPECT_THAT(DecodeStream(r, fmt, e.host.Account("t"), "rec", &s),
                StatusIs(Code::kDataLoss, "rec: a chunk holds a value that is Inf or NaN"));
  }
  {
    const QuantLayout L{8, 4, 4};
    std::vector<uint16_t> k(4 * 8, FloatToHalf(1.5f)), v(4 * 8, FloatToHalf(-2.f));
    std::string quant(L.Bytes(), '\0');
    QuantizeChunk(k.data(), v.data(), L, reinterpret_cast<uint8_t*>(quant.data()));
    v1::StreamRecord r;
    v1::ChunkRecord* c = r.add_chunks();
    c->set_num_tokens(4);
    c->set_precision(v1::PRECISION_INT4);
    c->set_data(quant);
    Stream cold(8);
    EXPECT_OK(DecodeStream(r, fmt, e.host.Account("t"), "rec", &cold));  // an encoder's: accepted
    // Not in a bf16 session's stream, which is lossless: its rows would dequantize to fp16 bits
    // served as bf16.
    ChunkFormat bf16 = fmt;
    bf16.dtype = v1::DTYPE_BF16;
    EXPECT_THAT(DecodeStream(r, bf16, e.host.Account("t"), "rec", &cold),
                StatusIs(Code::kDataLoss, "rec: a bf16 session's chunk is cold"));
    const float nan = std::numeric_limits<float>::quiet_NaN(), huge = 1e30f;
    for (auto [at, value] : {std::pair{L.key_header() + 4 * kZeroStep, nan},
                             std::pair{L.value_header() + 4 * kScaleBase, huge},
                             std::pair{L.value_header() + 4 * kZeroBase, -huge}}) {
      v1::StreamRecord broken = r;
      std::memcpy(broken.mutable_chunks(0)->mutable_data()->data() + at, &value, 4);
      EXPECT_THAT(DecodeStream(broken, fmt, e.host.Account("t"), "rec", &cold),
                  StatusIs(Code::kDataLoss, "parameters are not an encoder's"))
          << at;
    }
  }
  Env small(/*host_capacity=*/512);  // less than one 512-byte slot once one is taken
  Stream t(8);
  ASSERT_OK(DecodeStream(record(4, 4 * 32), fmt, small.host.Account("t"), "rec", &t));
  const absl::Status full =
      DecodeStream(record(4, 4 * 32), fmt, small.host.Account("t"), "rec", &t);
  EXPECT_THAT(full, StatusIs(Code::kResourceExhausted, "host tier full"));
  EXPECT_EQ(ReasonOf(full), ErrorReason::kHostTierFull);  // the tier's reason, passed on
  EXPECT_EQ(t.chunks().size(), 1u);
}

// A record with streams of chunks of several sizes (one larger than a part, one stream empty).
v1::SessionRecord TransferRecord() {
  v1::SessionRecord r;
  r.set_session_id("moving");
  r.set_tenant("t");
  r.add_layer_tokens(7);
  const uint64_t sizes[][3] = {{1000, 300000, 5}, {0, 0, 0}, {kTransferPartBytes + 3, 2, 700000}};
  for (const auto& stream : sizes) {
    v1::StreamRecord* s = r.add_streams();
    for (uint64_t bytes : stream) {
      if (bytes == 0) continue;
      v1::ChunkRecord* c = s->add_chunks();
      c->set_num_tokens(static_cast<uint32_t>(bytes % 64 + 1));
      c->set_first(bytes);
      c->set_data(std::string(bytes, static_cast<char>('a' + bytes % 26)));
    }
  }
  return r;
}

std::vector<std::string> Parts(const v1::SessionRecord& r) {
  TransferWriter w(r);
  std::vector<std::string> parts;
  std::string p;
  while (w.Next(&p)) parts.push_back(p);
  return parts;
}

TEST(Transfer, PartsPutTogetherAreTheRecordAndAreBoundedInSize) {
  const v1::SessionRecord r = TransferRecord();
  const std::vector<std::string> parts = Parts(r);
  // The header, stream 0's three chunks in one part, stream 1 in none, stream 2 in two (its
  // first chunk alone is larger than a part, which closes once past kTransferPartBytes), the
  // end.
  ASSERT_EQ(parts.size(), 5u);
  for (size_t i = 1; i + 1 < parts.size(); ++i) {
    EXPECT_LE(parts[i].size(), 2 * kTransferPartBytes + 4096);
  }
  TransferReader reader(uint64_t{1} << 30);
  for (const std::string& p : parts) ASSERT_OK(reader.Add(p));
  ASSERT_TRUE(reader.complete());
  ASSERT_OK_AND_ASSIGN(const v1::SessionRecord back, reader.Take());
  EXPECT_EQ(back.SerializeAsString(), r.SerializeAsString());
}

TEST(Transfer, AReaderRefusesWhatIsNotOneWholeTransferInOrder) {
  const std::vector<std::string> parts = Parts(TransferRecord());
  auto run = [&](const std::vector<std::string>& in, uint64_t limit = uint64_t{1} << 30) {
    TransferReader reader(limit);
    for (const std::string& p : in) RETURN_IF_ERROR(reader.Add(p));
    return reader.Take().status();
  };
  EXPECT_OK(run(parts));
  const uint64_t data = 1000 + 300000 + 5 + kTransferPartBytes + 3 + 2 + 700000;
  EXPECT_THAT(run(parts, data - 1),
              StatusIs(Code::kResourceExhausted, absl::StrCat("holds ", data, " bytes")));
  EXPECT_OK(run(parts, data));
  EXPECT_THAT(run({parts[0], parts[2], parts[1], parts[3], parts[4]}),
              StatusIs(Code::kDataLoss, "part 3: chunks 0.. of stream 0 out of order"));
  EXPECT_THAT(run({parts[0], parts[1], parts[3], parts[2], parts[4]}),
              StatusIs(Code::kDataLoss, "part 3: chunks 1.. of stream 2 out of order"));
  EXPECT_THAT(run({parts[0], parts[1], parts[2], parts[4]}),
              StatusIs(Code::kDataLoss, "part 4: the end after 4 chunks"));
  EXPECT_THAT(run({parts[0], parts[1], parts[2], parts[3]}),
              StatusIs(Code::kDataLoss, "without the end part"));
  EXPECT_THAT(run({parts[0], parts[0]}), StatusIs(Code::kDataLoss, "part 2: a second header"));
  EXPECT_THAT(run({parts[1]}), StatusIs(Code::kDataLoss, "part 1: chunks before the header"));
  std::string damaged = parts[3];
  damaged[damaged.size() / 2] ^= 1;
  EXPECT_THAT(run({parts[0], parts[1], parts[2], damaged, parts[4]}),
              StatusIs(Code::kDataLoss, "part 4: checksum"));
  std::string other = parts[0];
  other[4] = 9;  // another version
  EXPECT_THAT(run({other}), StatusIs(Code::kFailedPrecondition, "format version 9"));
  // Chunks without data: a header may not bring more chunk records than its data can hold.
  v1::SessionRecord empty = TransferRecord();
  for (auto& c : *empty.mutable_streams(0)->mutable_chunks()) c.clear_data();
  empty.mutable_streams(2)->Clear();
  EXPECT_THAT(run(Parts(empty)),
              StatusIs(Code::kDataLoss, "part 1: a header of 3 chunks holding 0 bytes"));
  // More chunks than the header declared: a header from a smaller record.
  v1::SessionRecord small = TransferRecord();
  small.mutable_streams(2)->mutable_chunks()->RemoveLast();
  const std::vector<std::string> fewer = Parts(small);
  EXPECT_THAT(run({fewer[0], parts[1], parts[2], parts[3]}),
              StatusIs(Code::kDataLoss, "more than the header's"));
}

// A transfer whose chunk bytes go beside its parts: what Next puts in `carried` per part, in
// order, is what the reader is handed back.
struct Carried {
  std::vector<std::string> parts, bytes;
};
Carried CarriedParts(const v1::SessionRecord& r) {
  TransferWriter w(r, v1::CHUNK_CARRIER_SOCKET, "bootstrap");
  Carried out;
  std::string p, c;
  while (w.Next(&p, &c)) {
    out.parts.push_back(p);
    if (!c.empty()) out.bytes.push_back(c);
  }
  return out;
}

TEST(Transfer, CarriedBytesGoBesideThePartsAndAreCheckedAgainstThem) {
  const v1::SessionRecord r = TransferRecord();
  const Carried t = CarriedParts(r);
  ASSERT_EQ(t.parts.size(), 5u);
  ASSERT_EQ(t.bytes.size(), 3u);  // one per chunks part
  for (size_t i = 1; i + 1 < t.parts.size(); ++i) EXPECT_LT(t.parts[i].size(), 200u);
  auto run = [&](const Carried& in, std::vector<uint64_t>* asked = nullptr) {
    TransferReader reader(uint64_t{1} << 30);
    size_t next = 0;
    auto carried = [&](uint64_t n) -> absl::StatusOr<std::string> {
      if (asked != nullptr) asked->push_back(n);
      if (next == in.bytes.size()) return absl::UnavailableError("the peer closed");
      return in.bytes[next++];
    };
    for (const std::string& p : in.parts) RETURN_IF_ERROR(reader.Add(p, carried));
    EXPECT_EQ(reader.carrier(), v1::CHUNK_CARRIER_SOCKET);
    EXPECT_EQ(reader.carrier_bootstrap(), "bootstrap");
    ASSIGN_OR_RETURN(v1::SessionRecord back, reader.Take());
    EXPECT_EQ(back.SerializeAsString(), r.SerializeAsString());
    return absl::OkStatus();
  };
  std::vector<uint64_t> asked;
  EXPECT_OK(run(t, &asked));
  EXPECT_EQ(asked, (std::vector<uint64_t>{1000 + 300000 + 5, kTransferPartBytes + 3, 2 + 700000}));
  Carried damaged = t;
  damaged.bytes[1][12345] ^= 1;
  EXPECT_THAT(run(damaged), StatusIs(Code::kDataLoss, "part 3: its carried bytes do not match"));
  Carried cut = t;
  cut.bytes.pop_back();
  EXPECT_THAT(run(cut), StatusIs(Code::kUnavailable, "part 4: the peer closed"));
  // Parts of a transfer without a carrier, read as carried ones (and the reverse): refused.
  const std::vector<std::string> inline_parts = Parts(r);
  Carried mixed = t;
  mixed.parts[2] = inline_parts[2];
  EXPECT_THAT(run(mixed), StatusIs(Code::kDataLoss, "part 3: 0 carried sizes for 1 chunks"));
  TransferReader plain(uint64_t{1} << 30);
  ASSERT_OK(plain.Add(inline_parts[0]));
  EXPECT_THAT(plain.Add(t.parts[1]), StatusIs(Code::kDataLoss, "3 carried sizes for 3 chunks"));
  // Sizes beyond the header's data are refused before the carrier is asked for them: the
  // header of a record holding stream 0 only, then a part whose first chunk grew.
  v1::SessionRecord small = TransferRecord();
  small.mutable_streams(2)->Clear();
  v1::SessionRecord big = small;
  big.mutable_streams(0)->mutable_chunks(0)->set_data(std::string(5000, 'x'));
  std::vector<uint64_t> none;
  EXPECT_THAT(run({{CarriedParts(small).parts[0], CarriedParts(big).parts[1]}, t.bytes}, &none),
              StatusIs(Code::kDataLoss, "more than the header's"));
  EXPECT_TRUE(none.empty());
  // One part may not make the importer take more than two parts' worth at once.
  v1::SessionRecord huge = TransferRecord();
  huge.mutable_streams(2)->mutable_chunks(0)->set_data(
      std::string(2 * kTransferPartBytes + 1, 'h'));
  const Carried too_big = CarriedParts(huge);
  EXPECT_THAT(run({{too_big.parts[0], too_big.parts[1], too_big.parts[2]}, too_big.bytes}, &none),
              StatusIs(Code::kDataLoss, "part 3: 2097153 carried bytes in one part"));
  EXPECT_TRUE(none.size() == 1);  // part 2's bytes only
}

// The socket carrier (the NCCL carrier's CPU twin) between two threads of this process.
TEST(Carrier, SocketBytesArriveInOrderAndTheExporterWaitsForTheAcknowledgement) {
  CarrierOptions o;
  o.timeout = absl::Seconds(20);
  ASSERT_OK_AND_ASSIGN(OfferedCarrier offered, OfferCarrier(CarrierKind::kSocket, o));
  EXPECT_THAT(offered.bootstrap, ::testing::MatchesRegex("127\\.0\\.0\\.1:[0-9]+/[0-9a-f]{32}"));
  std::vector<std::string> sent;
  for (int i = 0; i < 6; ++i) sent.push_back(std::string(300000 + i, static_cast<char>('a' + i)));
  absl::Status exported;
  std::thread exporter([&] {
    exported = [&]() -> absl::Status {
      for (const std::string& b : sent) RETURN_IF_ERROR(offered.carrier->Send(b));
      return offered.carrier->Finish();
    }();
  });
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<ByteCarrier> joined,
                       JoinCarrier(CarrierKind::kSocket, offered.bootstrap, o));
  for (const std::string& b : sent) {
    ASSERT_OK_AND_ASSIGN(std::string got, joined->Recv(b.size()));
    EXPECT_EQ(got, b);
  }
  ASSERT_OK(joined->Finish());
  exporter.join();
  EXPECT_OK(exported);
}

TEST(Carrier, ASocketPeerThatIsWrongOrAbsentOrCancelledEndsTheTransferWithAnError) {
  CarrierOptions o;
  o.timeout = absl::Milliseconds(300);
  // Nobody joins: the exporter's wait for the acknowledgement ends at the timeout.
  {
    ASSERT_OK_AND_ASSIGN(OfferedCarrier offered, OfferCarrier(CarrierKind::kSocket, o));
    ASSERT_OK(offered.carrier->Send("abc"));
    EXPECT_THAT(offered.carrier->Finish(), StatusIs(Code::kDeadlineExceeded));
  }
  // A peer with another token is refused, and the importer sees the connection close.
  {
    ASSERT_OK_AND_ASSIGN(OfferedCarrier offered, OfferCarrier(CarrierKind::kSocket, o));
    std::string forged = offered.bootstrap;
    forged.back() = forged.back() == '0' ? '1' : '0';
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<ByteCarrier> joined,
                         JoinCarrier(CarrierKind::kSocket, forged, o));
    EXPECT_THAT(offered.carrier->Finish(), StatusIs(Code::kPermissionDenied, "wrong token"));
    EXPECT_FALSE(joined->Recv(1).ok());
  }
  // Bootstraps that are not a socket carrier's.
  for (const char* bad : {"", "127.0.0.1:0/00", "10.0.0.1:80/00112233445566778899aabbccddeeff",
                          "127.0.0.1:80/zz112233445566778899aabbccddeeff"}) {
    EXPECT_THAT(JoinCarrier(CarrierKind::kSocket, bad, o),
                StatusIs(Code::kInvalidArgument, "bootstrap"))
        << bad;
  }
  // A cancelled call's carrier stops waiting well before its timeout.
  std::atomic<bool> cancelled{false};
  o.timeout = absl::Seconds(60);
  o.cancelled = &cancelled;
  ASSERT_OK_AND_ASSIGN(OfferedCarrier offered, OfferCarrier(CarrierKind::kSocket, o));
  std::thread cancel([&] {
    absl::SleepFor(absl::Milliseconds(200));
    cancelled.store(true);
  });
  EXPECT_THAT(offered.carrier->Finish(), StatusIs(Code::kCancelled));
  cancel.join();
  // Without a CUDA device, the NCCL carrier is refused with the reason.
  CarrierOptions cpu;
  EXPECT_THAT(OfferCarrier(CarrierKind::kNccl, cpu), StatusIs(Code::kFailedPrecondition));
  EXPECT_THAT(JoinCarrier(CarrierKind::kNccl, std::string(128, 'x'), cpu),
              StatusIs(Code::kFailedPrecondition));
}

}  // namespace
}  // namespace kvtier
