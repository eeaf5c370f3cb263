// kvtierctl: inspect and steer a running kvtierd. See `kvtierctl --help`.
#include <openssl/rand.h>
#include <openssl/sha.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "client/kvtierctl/format.h"
#include "kvtier/client.h"

namespace kvtier::ctl {
namespace {

constexpr char kUsage[] =
    R"(usage: kvtierctl [--addr unix:PATH|HOST:PORT] [-o table|json] [--tenant T]
                 [--token-file FILE] [--tls-ca FILE [--tls-cert FILE --tls-key FILE]]
                 COMMAND

commands:
  health                 the daemon's gRPC health (exit 0 when SERVING)
  sessions               the caller's sessions (an admin's: every tenant's): tenant,
                         shape, tokens, bytes per tier, leases
  session ID             one session: policy, usage, per-layer index statistics
  tiers                  capacity, use, pins, promotions, evictions; the copy cache's
                         policy, hit rate and prefetches, per tier
  segments               the caller's shared-memory segments (an admin's: all): names a
                         worker maps, sizes, owners
  chunks ID [--layer L] [--limit N]
                         chunks of a session: positions, precision, bytes, generation
  close ID               close a session (idempotent)
  token hash --tenant T [--admin]
                         reads a bearer token on stdin and prints the auth.tokens entry
                         that admits it (a fresh random salt and the SHA-256 of salt and
                         token), for kvtierd's config; the token itself is not printed

--addr defaults to $KVTIER_ADDR, else unix:/tmp/kvtier.sock. --token-file (default
$KVTIER_TOKEN_FILE) holds a bearer token sent with every call. --tls-ca speaks TLS to a TCP
address (the CA of the daemon's certificate); --tls-cert and --tls-key add a client
certificate (mTLS). A failed call exits 1 with the
server's message; bad usage exits 2.
)";

struct Args {
  std::string addr;
  std::string output = "table";
  std::string tenant;
  std::string token_file;
  std::string tls_ca, tls_cert, tls_key;
  bool admin = false;
  std::vector<std::string> positional;
  std::optional<uint32_t> layer;
  uint32_t limit = 0;
};

int64_t NowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// "TIER_HOST" -> "host", "PRECISION_INT4" -> "int4": an enum value name without its prefix.
std::string Label(const std::string& enum_name) {
  const auto cut = enum_name.find('_');
  return cut == std::string::npos ? enum_name : absl::AsciiStrToLower(enum_name.substr(cut + 1));
}
std::string TierName(v1::Tier t) { return Label(v1::Tier_Name(t)); }
std::string PrecisionName(v1::Precision p) { return Label(v1::Precision_Name(p)); }

uint64_t MapGet(const google::protobuf::Map<std::string, uint64_t>& m, const std::string& k) {
  auto it = m.find(k);
  return it == m.end() ? 0 : it->second;
}

int Fail(const absl::Status& s) {
  std::cerr << "kvtierctl: " << absl::StatusCodeToString(s.code()) << ": " << s.message() << "\n";
  return 1;
}

int Usage(const std::string& why) {
  std::cerr << "kvtierctl: " << why << "\n\n" << kUsage;
  return 2;
}

// A token as a file or stdin holds it: one trailing newline (LF or CRLF) dropped. It must be
// 1..4000 printable ASCII characters without spaces (a legal metadata value).
absl::StatusOr<std::string> ReadToken(std::istream& in, const std::string& from) {
  std::string token((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (absl::EndsWith(token, "\n")) token.pop_back();
  if (absl::EndsWith(token, "\r")) token.pop_back();
  const bool ok =
      !token.empty() && token.size() <= 4000 &&
      std::all_of(token.begin(), token.end(), [](char ch) { return ch > ' ' && ch < 127; });
  if (!ok) {
    return absl::InvalidArgumentError(absl::StrCat(
        from, ": a token is 1..4000 printable ASCII characters without spaces, on one line"));
  }
  return token;
}

// `token hash`: the config entry for the token on stdin.
int TokenHash(const Args& a) {
  if (a.positional.size() != 2 || a.positional[1] != "hash") return Usage("token takes: hash");
  // The daemon checks the whole rule at start-up; this keeps the printed entry well-formed.
  const bool tenant_ok = !a.tenant.empty() && a.tenant.size() <= 128 &&
                         std::all_of(a.tenant.begin(), a.tenant.end(), [](char ch) {
                           return absl::ascii_isalnum(ch) || absl::StrContains("_.:@-", ch);
                         });
  if (!tenant_ok) return Usage("token hash needs --tenant T, 1..128 of [A-Za-z0-9_.:@-]");
  absl::StatusOr<std::string> token = ReadToken(std::cin, "stdin");
  if (!token.ok()) return Fail(token.status());
  unsigned char raw[16];
  if (RAND_bytes(raw, sizeof raw) != 1) return Fail(absl::InternalError("no random bytes"));
  const std::string salt =
      absl::BytesToHexString(absl::string_view(reinterpret_cast<const char*>(raw), sizeof raw));
  const std::string salted = salt + *token;
  unsigned char digest[SHA256_DIGEST_LENGTH];
  SHA256(reinterpret_cast<const unsigned char*>(salted.data()), salted.size(), digest);
  std::cout << "tokens { tenant: \"" << a.tenant << "\" salt: \"" << salt << "\" sha256: \""
            << absl::BytesToHexString(
                   absl::string_view(reinterpret_cast<const char*>(digest), sizeof digest))
            << "\"" << (a.admin ? " admin: true" : "") << " }\n";
  return 0;
}

int Run(const Args& a, Client& c) {
  const std::string& cmd = a.positional[0];
  const bool json = a.output == "json";
  auto need_id = [&]() -> const std::string* {
    return a.positional.size() == 2 ? &a.positional[1] : nullptr;
  };
  if (cmd == "health") {
    auto r = c.Health();
    if (!r.ok()) return Fail(r.status());
    std::cout << (json ? absl::StrCat("{\"status\": \"", *r ? "SERVING" : "NOT_SERVING", "\"}")
                       : (*r ? "SERVING" : "NOT_SERVING"))
              << "\n";
    return *r ? 0 : 1;
  }
  if (cmd == "sessions") {
    auto r = c.ListSessions();
    if (!r.ok()) return Fail(r.status());
    if (json) {
      std::cout << ToJson(*r);
      return 0;
    }
    Table t({"SESSION", "TENANT", "LAYERS", "Q/KV HEADS", "HEAD_DIM", "TOKENS", "HOST", "DEVICE",
             "LEASES", "LAST ACCESS"},
            {false, false, true, true, true, true, true, true, true, false});
    const int64_t now = NowMs();
    for (const auto& s : r->sessions()) {
      t.Add({s.session_id(), s.tenant(), absl::StrCat(s.shape().num_layers()),
             absl::StrCat(s.shape().num_q_heads(), "/", s.shape().num_kv_heads()),
             absl::StrCat(s.shape().head_dim()), absl::StrCat(s.num_tokens()),
             Bytes(MapGet(s.bytes_by_tier(), "TIER_HOST")),
             Bytes(MapGet(s.bytes_by_tier(), "TIER_DEVICE")), absl::StrCat(s.active_leases()),
             Age(s.last_access_unix_ms(), now)});
    }
    std::cout << t.Render();
    return 0;
  }
  if (cmd == "session") {
    const std::string* id = need_id();
    if (id == nullptr) return Usage("session needs one ID");
    auto r = c.DescribeSession(*id);
    if (!r.ok()) return Fail(r.status());
    if (json) {
      std::cout << ToJson(*r);
      return 0;
    }
    const auto& i = r->info();
    const auto& p = i.policy();
    Table kv({"FIELD", "VALUE"});
    kv.Add({"session", i.session_id()});
    kv.Add({"tenant", i.tenant()});
    kv.Add({"shape", absl::StrFormat("%d layers, %d q heads, %d kv heads, head_dim %d, %s",
                                     i.shape().num_layers(), i.shape().num_q_heads(),
                                     i.shape().num_kv_heads(), i.shape().head_dim(),
                                     v1::DType_Name(i.shape().dtype()))});
    kv.Add({"policy", absl::StrFormat(
                          "sinks %d, window %d, budget %d, dense layers %d, "
                          "chunk %d tokens, cold %s%s, ranking %s",
                          p.sink_tokens(), p.recent_window(), p.default_budget(), p.dense_layers(),
                          p.chunk_tokens(), PrecisionName(p.cold_precision()),
                          p.lossless() ? ", lossless" : "", Label(v1::Ranking_Name(p.ranking())))});
    std::string refinement =
        p.refine_factor() > 1
            ? absl::StrFormat("rows from a pool of %dx the budget, by %s", p.refine_factor(),
                              absl::AsciiStrToLower(absl::StripPrefix(
                                  v1::RefineScore_Name(p.refine_score()), "REFINE_SCORE_")))
            : std::string("off (whole chunks)");
    if (p.mass_target() > 0.f) {
      absl::StrAppend(&refinement, absl::StrFormat(", mass target %.2f", p.mass_target()));
    }
    if (p.layer_budget() == v1::LAYER_BUDGET_BY_NEED) {
      absl::StrAppend(&refinement, ", layer budgets by need");
    }
    kv.Add({"refinement", refinement});
    kv.Add({"tokens", absl::StrCat(i.num_tokens())});
    for (const auto& [tier, bytes] : i.bytes_by_tier()) {
      kv.Add({absl::StrCat("bytes ", Label(tier)), Bytes(bytes)});
    }
    kv.Add({"metadata", Bytes(i.metadata_bytes())});
    kv.Add({"aging backlog", absl::StrCat(i.aging_backlog_tokens(), " tokens")});
    for (const auto& [prec, n] : i.chunks_by_precision()) {
      kv.Add({absl::StrCat("chunks ", Label(prec)), absl::StrCat(n)});
    }
    kv.Add({"leases", absl::StrCat(i.active_leases())});
    kv.Add({"last access", Age(i.last_access_unix_ms(), NowMs())});
    for (const auto& [k, v] : i.labels()) kv.Add({absl::StrCat("label ", k), v});
    std::cout << kv.Render() << "\n";
    // NEED and SHARE (layer budgets by need): the layer's measured need and the multiple of
    // the equal share of rows it gets.
    const bool by_need = p.layer_budget() == v1::LAYER_BUDGET_BY_NEED;
    std::vector<std::string> head = {"LAYER",    "TOKENS", "CHUNKS", "INDEXED",
                                     "CLUSTERS", "UNITS",  "SCORED"};
    if (by_need) head.insert(head.end(), {"NEED", "SHARE"});
    Table layers(head, std::vector<bool>(head.size(), true));
    for (const auto& l : r->layers()) {
      // SCORED: the share of Select's candidate chunks whose score was computed.
      const std::string scored =
          l.select_candidates()
              ? absl::StrFormat("%.1f%%", 100.0 * l.select_chunks_scored() / l.select_candidates())
              : "-";
      std::vector<std::string> row = {absl::StrCat(l.layer()),
                                      absl::StrCat(l.num_tokens()),
                                      absl::StrCat(l.chunks()),
                                      absl::StrCat(l.indexed_chunks()),
                                      absl::StrCat(l.clusters()),
                                      absl::StrCat(l.units()),
                                      scored};
      if (by_need) {
        row.push_back(l.budget_need() < 0 ? "-" : absl::StrFormat("%.3f", l.budget_need()));
        row.push_back(absl::StrFormat("%.2fx", l.budget_share()));
      }
      layers.Add(row);
    }
    std::cout << layers.Render();
    return 0;
  }
  if (cmd == "tiers") {
    auto r = c.GetTierStats();
    if (!r.ok()) return Fail(r.status());
    if (json) {
      std::cout << ToJson(*r);
      return 0;
    }
    Table t({"TIER", "CAPACITY", "USED", "METADATA", "USE%", "PINNED", "CHUNKS", "SEGMENTS",
             "PROMOTIONS", "EVICTIONS", "POLICY", "COPIES", "HIT%", "PREFETCHED", "PF_HITS"},
            {false, true, true, true, true, true, true, true, true, true, false, true, true, true,
             true});
    for (const auto& s : r->tiers()) {
      double pct = s.capacity_bytes()
                       ? 100.0 * (s.used_bytes() + s.metadata_bytes()) / s.capacity_bytes()
                       : 0.0;
      const uint64_t reads = s.cache_hits() + s.cache_misses();
      t.Add({TierName(s.tier()) + (s.emulated() ? " (emulated)" : ""), Bytes(s.capacity_bytes()),
             Bytes(s.used_bytes()), Bytes(s.metadata_bytes()), absl::StrFormat("%.1f", pct),
             Bytes(s.pinned_bytes()), absl::StrCat(s.num_chunks()), absl::StrCat(s.num_segments()),
             absl::StrCat(s.promotions()), absl::StrCat(s.evictions()), s.eviction_policy(),
             absl::StrCat(s.cached_copies()),
             reads ? absl::StrFormat("%.1f", 100.0 * s.cache_hits() / reads) : "-",
             absl::StrCat(s.prefetched()), absl::StrCat(s.prefetch_hits())});
    }
    std::cout << t.Render();
    return 0;
  }
  if (cmd == "segments") {
    auto r = c.ListSegments();
    if (!r.ok()) return Fail(r.status());
    if (json) {
      std::cout << ToJson(*r);
      return 0;
    }
    Table t({"SEGMENT", "TIER", "SHM NAME", "SIZE", "SLOT", "TENANT", "GENERATION"},
            {true, false, false, true, true, false, true});
    for (const auto& s : r->segments()) {
      // An unnamed (memfd) segment is reached by descriptor only.
      const std::string name = s.shm_name().empty() ? "(memfd)" : s.shm_name();
      t.Add({absl::StrCat(s.segment_id()), TierName(s.tier()), name, Bytes(s.size_bytes()),
             Bytes(s.slot_bytes()), s.tenant(), absl::StrCat(s.generation())});
    }
    std::cout << t.Render();
    return 0;
  }
  if (cmd == "chunks") {
    const std::string* id = need_id();
    if (id == nullptr) return Usage("chunks needs one ID");
    v1::ListChunksRequest req;
    req.set_session_id(*id);
    if (a.layer) req.set_layer(*a.layer);
    req.set_limit(a.limit);
    auto r = c.ListChunks(req);
    if (!r.ok()) return Fail(r.status());
    if (json) {
      std::cout << ToJson(*r);
      return 0;
    }
    Table t({"CHUNK", "LAYER", "HEAD", "INDEX", "TOKENS", "POSITIONS", "PRECISION", "HOST",
             "DEVICE", "GENERATION", "PINNED"},
            {true, true, true, true, true, false, false, true, true, true, false});
    for (const auto& ch : r->chunks()) {
      t.Add({absl::StrCat(ch.chunk_id()), absl::StrCat(ch.layer()), absl::StrCat(ch.kv_head()),
             absl::StrCat(ch.index()), absl::StrCat(ch.num_tokens()),
             absl::StrCat(ch.first_position(), "..", ch.first_position() + ch.num_tokens() - 1),
             PrecisionName(ch.precision()), Bytes(ch.host_bytes()),
             ch.device_bytes() ? Bytes(ch.device_bytes()) : "-", absl::StrCat(ch.generation()),
             ch.pinned() ? "yes" : "no"});
    }
    std::cout << t.Render();
    if (static_cast<uint64_t>(r->chunks_size()) < r->total()) {
      std::cout << absl::StrFormat("(%d of %d chunks; --limit N shows more)\n", r->chunks_size(),
                                   r->total());
    }
    return 0;
  }
  if (cmd == "close") {
    const std::string* id = need_id();
    if (id == nullptr) return Usage("close needs one ID");
    auto r = c.CloseSession(*id);
    if (!r.ok()) return Fail(r.status());
    std::cout << (json ? absl::StrCat("{\"session_id\": \"", *id,
                                      "\", \"existed\": ", *r ? "true" : "false", "}")
                       : absl::StrCat(*r ? "closed " : "no session ", *id))
              << "\n";
    return 0;
  }
  return Usage(absl::StrCat("unknown command \"", cmd, "\""));
}

}  // namespace
}  // namespace kvtier::ctl

int main(int argc, char** argv) {
  using namespace kvtier::ctl;
  Args a;
  if (const char* env = std::getenv("KVTIER_ADDR")) a.addr = env;
  if (a.addr.empty()) a.addr = "unix:/tmp/kvtier.sock";
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    auto value = [&]() -> std::optional<std::string> {
      if (i + 1 >= argc) return std::nullopt;
      return std::string(argv[++i]);
    };
    if (arg == "-h" || arg == "--help") {
      std::cout << kUsage;
      return 0;
    } else if (arg == "--admin") {
      a.admin = true;
    } else if (arg == "--addr" || arg == "-o" || arg == "--output" || arg == "--tenant" ||
               arg == "--layer" || arg == "--limit" || arg == "--token-file" || arg == "--tls-ca" ||
               arg == "--tls-cert" || arg == "--tls-key") {
      auto v = value();
      if (!v) return Usage(absl::StrCat(arg, " needs a value"));
      if (arg == "--addr") {
        a.addr = *v;
      } else if (arg == "--token-file") {
        a.token_file = *v;
      } else if (arg == "--tls-ca") {
        a.tls_ca = *v;
      } else if (arg == "--tls-cert") {
        a.tls_cert = *v;
      } else if (arg == "--tls-key") {
        a.tls_key = *v;
      } else if (arg == "--tenant") {
        a.tenant = *v;
      } else if (arg == "--layer" || arg == "--limit") {
        uint32_t n = 0;
        if (!absl::SimpleAtoi(*v, &n)) return Usage(absl::StrCat(arg, " takes a number"));
        if (arg == "--layer") {
          a.layer = n;
        } else {
          a.limit = n;
        }
      } else {
        if (*v != "table" && *v != "json") return Usage("-o takes table or json");
        a.output = *v;
      }
    } else if (!arg.empty() && arg[0] == '-') {
      return Usage(absl::StrCat("unknown option ", arg));
    } else {
      a.positional.push_back(arg);
    }
  }
  if (a.positional.empty()) return Usage("no command");
  if (a.positional[0] == "token") return TokenHash(a);
  kvtier::ClientOptions opts;
  opts.tenant = a.tenant;
  opts.tls_ca_file = a.tls_ca;
  opts.tls_cert_file = a.tls_cert;
  opts.tls_key_file = a.tls_key;
  if (a.token_file.empty()) {
    if (const char* env = std::getenv("KVTIER_TOKEN_FILE")) a.token_file = env;
  }
  if (!a.token_file.empty()) {
    std::ifstream in(a.token_file);
    if (!in)
      return Fail(
          absl::NotFoundError(absl::StrCat("--token-file ", a.token_file, ": cannot be read")));
    absl::StatusOr<std::string> token = ReadToken(in, "--token-file " + a.token_file);
    if (!token.ok()) return Fail(token.status());
    opts.token = *std::move(token);
  }
  opts.timeout = absl::Seconds(10);
  auto client = kvtier::Client::Connect(a.addr, opts);
  if (!client.ok()) return Fail(client.status());
  return Run(a, **client);
}
