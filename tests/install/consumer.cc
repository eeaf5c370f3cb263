// Uses the installed client as an application would: connects to the kvtierd at argv[1],
// appends 64 tokens of one layer, reads them back through ReadChunks and shared memory, and
// exits 0 only when every byte is the one it appended.
#include <cstdio>
#include <cstring>
#include <vector>

#include "kvtier/client.h"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: consumer unix:/path/to/kvtier.sock\n");
    return 2;
  }
  auto fail = [](const char* what, const absl::Status& s) {
    std::fprintf(stderr, "%s: %s\n", what, s.ToString().c_str());
    return 1;
  };
  auto client = kvtier::Client::Connect(argv[1]);
  if (!client.ok()) return fail("connect", client.status());
  kvtier::Client& c = **client;
  kvtier::v1::CreateSessionRequest create;
  create.mutable_shape()->set_num_layers(1);
  create.mutable_shape()->set_num_q_heads(2);
  create.mutable_shape()->set_num_kv_heads(1);
  create.mutable_shape()->set_head_dim(8);
  create.mutable_policy()->set_lossless(true);
  auto session = c.CreateSession(create);
  if (!session.ok()) return fail("CreateSession", session.status());
  const std::string sid = session->session_id();
  constexpr int kTokens = 64, kD = 8;
  std::vector<uint16_t> keys(kTokens * kD), values(kTokens * kD);
  for (int i = 0; i < kTokens * kD; ++i) {
    keys[i] = static_cast<uint16_t>(0x3c00 + i % 1000);  // finite fp16
    values[i] = static_cast<uint16_t>(0x3800 + i % 997);
  }
  kvtier::v1::AppendKVRequest append;
  append.set_session_id(sid);
  append.set_num_tokens(kTokens);
  append.set_keys(reinterpret_cast<const char*>(keys.data()), keys.size() * 2);
  append.set_values(reinterpret_cast<const char*>(values.data()), values.size() * 2);
  auto stored = c.AppendKV({append});
  if (!stored.ok()) return fail("AppendKV", stored.status());
  kvtier::v1::ListChunksRequest list;
  list.set_session_id(sid);
  auto chunks = c.ListChunks(list);
  if (!chunks.ok()) return fail("ListChunks", chunks.status());
  std::vector<uint64_t> ids;
  for (const auto& chunk : chunks->chunks()) ids.push_back(chunk.chunk_id());
  auto handles = c.ReadChunks(sid, ids);
  if (!handles.ok()) return fail("ReadChunks", handles.status());
  kvtier::SegmentMap map;
  int rows = 0;
  for (const kvtier::v1::BlockHandle& h : *handles) {
    std::vector<uint16_t> k(h.num_tokens() * kD), v(k.size());
    absl::Status s = map.CopyOut(c, h, k, v);
    if (!s.ok()) return fail("CopyOut", s);
    for (uint32_t r = 0; r < h.num_tokens(); ++r) {
      const uint64_t t = static_cast<uint64_t>(h.positions(static_cast<int>(r)));
      if (std::memcmp(&k[r * kD], &keys[t * kD], kD * 2) != 0 ||
          std::memcmp(&v[r * kD], &values[t * kD], kD * 2) != 0) {
        std::fprintf(stderr, "token %llu differs\n", static_cast<unsigned long long>(t));
        return 1;
      }
      ++rows;
    }
  }
  auto closed = c.CloseSession(sid);
  if (!closed.ok()) return fail("CloseSession", closed.status());
  std::printf("consumer: %d tokens read back exact from %zu chunks\n", rows, handles->size());
  return rows == kTokens ? 0 : 1;
}
