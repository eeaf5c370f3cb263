// kvtierctl: inspect and steer a running kvtierd. See `kvtierctl --help`.
#include <openssl/rand.h>
#include <openssl/sha.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <functional>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "client/kvtierctl/format.h"
#include "kvtier/client.h"

#ifndef KVTIER_VERSION
#define KVTIER_VERSION "0.0.0"
#endif

namespace kvtier::ctl {
namespace {

struct Globals {
  std::string addr = "unix:/tmp/kvtier.sock";
  std::string output = "table";
  std::string tenant;
  std::string token_file;
  std::string tls_ca, tls_cert, tls_key;
  double timeout_s = 10;
};

// --watch: the command again every --interval seconds, --count times (0: until interrupted).
struct Watch {
  bool on = false;
  double interval_s = 2;
  int count = 0;
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

// A failed call: exit 1 with the server's code and message; when the daemon could not be
// reached at all, what to check.
int Fail(const absl::Status& s, const Globals* g = nullptr) {
  std::cerr << "kvtierctl: " << absl::StatusCodeToString(s.code()) << ": " << s.message() << "\n";
  if (g != nullptr && s.code() == absl::StatusCode::kUnavailable &&
      !absl::StrContains(s.message(), "draining")) {
    std::cerr << "hint: no kvtierd answered at " << g->addr << ". Is it running (kvtierd --listen "
              << g->addr << ", or make run)? Another address: --addr or $KVTIER_ADDR.\n";
  }
  return 1;
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
int TokenHash(const std::string& tenant, bool admin) {
  // The daemon checks the whole rule at start-up; this keeps the printed entry well-formed.
  const bool tenant_ok = !tenant.empty() && tenant.size() <= 128 &&
                         std::all_of(tenant.begin(), tenant.end(), [](char ch) {
                           return absl::ascii_isalnum(ch) || absl::StrContains("_.:@-", ch);
                         });
  if (!tenant_ok) {
    std::cerr << "kvtierctl: token hash needs --tenant T, 1..128 of [A-Za-z0-9_.:@-]\n";
    return 2;
  }
  absl::StatusOr<std::string> token = ReadToken(std::cin, "stdin");
  if (!token.ok()) return Fail(token.status());
  unsigned char raw[16];
  if (RAND_bytes(raw, sizeof raw) != 1) return Fail(absl::InternalError("no random bytes"));
  const std::string salt =
      absl::BytesToHexString(absl::string_view(reinterpret_cast<const char*>(raw), sizeof raw));
  const std::string salted = salt + *token;
  unsigned char digest[SHA256_DIGEST_LENGTH];
  SHA256(reinterpret_cast<const unsigned char*>(salted.data()), salted.size(), digest);
  std::cout << "tokens { tenant: \"" << tenant << "\" salt: \"" << salt << "\" sha256: \""
            << absl::BytesToHexString(
                   absl::string_view(reinterpret_cast<const char*>(digest), sizeof digest))
            << "\"" << (admin ? " admin: true" : "") << " }\n";
  return 0;
}

// A message in the output format asked for: json, yaml, or the table `render` makes.
int Print(const Globals& g, const google::protobuf::Message& m,
          const std::function<std::string()>& render) {
  if (g.output == "json") {
    std::cout << ToJson(m);
  } else if (g.output == "yaml") {
    std::cout << ToYaml(m);
  } else {
    std::cout << render();
  }
  return 0;
}

std::string SessionsTable(const v1::ListSessionsResponse& r, bool wide) {
  std::vector<std::string> head = {"SESSION", "TENANT", "LAYERS", "Q/KV HEADS", "HEAD_DIM",
                                   "TOKENS",  "HOST",   "DEVICE", "LEASES",     "LAST ACCESS"};
  std::vector<bool> right = {false, false, true, true, true, true, true, true, true, false};
  if (wide) {
    head.insert(head.end(), {"DTYPE", "MODEL", "METADATA", "AGING", "LABELS"});
    right.insert(right.end(), {false, false, true, true, false});
  }
  Table t(head, right);
  const int64_t now = NowMs();
  for (const auto& s : r.sessions()) {
    std::vector<std::string> row = {
        s.session_id(),
        s.tenant(),
        absl::StrCat(s.shape().num_layers()),
        absl::StrCat(s.shape().num_q_heads(), "/", s.shape().num_kv_heads()),
        absl::StrCat(s.shape().head_dim()),
        absl::StrCat(s.num_tokens()),
        Bytes(MapGet(s.bytes_by_tier(), "TIER_HOST")),
        Bytes(MapGet(s.bytes_by_tier(), "TIER_DEVICE")),
        absl::StrCat(s.active_leases()),
        Age(s.last_access_unix_ms(), now)};
    if (wide) {
      std::vector<std::string> labels;
      for (const auto& [k, v] : s.labels()) labels.push_back(absl::StrCat(k, "=", v));
      std::sort(labels.begin(), labels.end());
      row.insert(row.end(), {Label(v1::DType_Name(s.shape().dtype())),
                             s.shape().model_id().empty() ? "-" : s.shape().model_id(),
                             Bytes(s.metadata_bytes()), absl::StrCat(s.aging_backlog_tokens()),
                             labels.empty() ? "-" : absl::StrJoin(labels, ",")});
    }
    t.Add(row);
  }
  return t.Render();
}

std::string TiersTable(const v1::GetTierStatsResponse& r) {
  Table t(
      {"TIER", "CAPACITY", "USED", "METADATA", "USE%", "PINNED", "CHUNKS", "SEGMENTS", "RETAINED",
       "PROMOTIONS", "EVICTIONS", "POLICY", "COPIES", "HIT%", "PREFETCHED", "PF_HITS"},
      {false, true, true, true, true, true, true, true, true, true, true, false, true, true, true,
       true});
  for (const auto& s : r.tiers()) {
    const double pct = s.capacity_bytes()
                           ? 100.0 * (s.used_bytes() + s.metadata_bytes()) / s.capacity_bytes()
                           : 0.0;
    const uint64_t reads = s.cache_hits() + s.cache_misses();
    t.Add({TierName(s.tier()) + (s.emulated() ? " (emulated)" : ""), Bytes(s.capacity_bytes()),
           Bytes(s.used_bytes()), Bytes(s.metadata_bytes()), absl::StrFormat("%.1f", pct),
           Bytes(s.pinned_bytes()), absl::StrCat(s.num_chunks()), absl::StrCat(s.num_segments()),
           Bytes(s.retained_bytes()), absl::StrCat(s.promotions()), absl::StrCat(s.evictions()),
           s.eviction_policy(), absl::StrCat(s.cached_copies()),
           reads ? absl::StrFormat("%.1f", 100.0 * s.cache_hits() / reads) : "-",
           absl::StrCat(s.prefetched()), absl::StrCat(s.prefetch_hits())});
  }
  return t.Render();
}

std::string LeasesTable(const v1::ListLeasesResponse& r, bool wide) {
  std::vector<std::string> head = {"LEASE", "TENANT", "SESSION", "SLOTS", "PINNED", "EXPIRES"};
  std::vector<bool> right = {false, false, false, true, true, false};
  if (wide) {
    head.push_back("WORKER");
    right.push_back(false);
  }
  Table t(head, right);
  const int64_t now = NowMs();
  for (const auto& l : r.leases()) {
    std::vector<std::string> row = {
        l.lease_id(),
        l.tenant(),
        l.session_id(),
        absl::StrCat(l.slots()),
        Bytes(l.pinned_bytes()),
        absl::StrFormat("in %.1fs", std::max<int64_t>(0, l.expires_unix_ms() - now) / 1000.0)};
    if (wide) row.push_back(l.worker_id().empty() ? "-" : l.worker_id());
    t.Add(row);
  }
  std::string out = t.Render();
  if (static_cast<uint64_t>(r.leases_size()) < r.total()) {
    absl::StrAppend(&out, absl::StrFormat("(%d of %d leases; --limit N shows more)\n",
                                          r.leases_size(), r.total()));
  }
  return out;
}

int SessionCmd(Client& c, const Globals& g, const std::string& id) {
  auto r = c.DescribeSession(id);
  if (!r.ok()) return Fail(r.status(), &g);
  return Print(g, *r, [&] {
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
    return kv.Render() + "\n" + layers.Render();
  });
}

// `top`: the tiers, then the busiest sessions (most leases, then most host bytes).
int TopCmd(Client& c, const Globals& g, uint32_t limit) {
  auto tiers = c.GetTierStats();
  if (!tiers.ok()) return Fail(tiers.status(), &g);
  auto sessions = c.ListSessions();
  if (!sessions.ok()) return Fail(sessions.status(), &g);
  std::vector<v1::SessionInfo> all(sessions->sessions().begin(), sessions->sessions().end());
  std::sort(all.begin(), all.end(), [](const v1::SessionInfo& a, const v1::SessionInfo& b) {
    const uint64_t ha = MapGet(a.bytes_by_tier(), "TIER_HOST");
    const uint64_t hb = MapGet(b.bytes_by_tier(), "TIER_HOST");
    if (a.active_leases() != b.active_leases()) return a.active_leases() > b.active_leases();
    if (ha != hb) return ha > hb;
    return a.session_id() < b.session_id();
  });
  v1::ListSessionsResponse busiest;
  for (size_t i = 0; i < all.size() && i < limit; ++i) *busiest.add_sessions() = all[i];
  // One document: {"tiers": {"tiers": [...]}, "busiest": {"sessions": [...]}}.
  if (g.output == "json") {
    std::cout << "{\"tiers\": " << ToJson(*tiers) << ", \"busiest\": " << ToJson(busiest) << "}\n";
    return 0;
  }
  if (g.output == "yaml") {
    auto indent = [](const std::string& yaml) {
      std::string out;
      for (absl::string_view line : absl::StrSplit(yaml, '\n', absl::SkipEmpty())) {
        absl::StrAppend(&out, "  ", line, "\n");
      }
      return out;
    };
    std::cout << "tiers:\n" << indent(ToYaml(*tiers)) << "busiest:\n" << indent(ToYaml(busiest));
    return 0;
  }
  std::cout << absl::StrFormat("kvtierd at %s, %d sessions\n\n", g.addr, all.size())
            << TiersTable(*tiers) << "\n"
            << SessionsTable(busiest, g.output == "wide");
  if (all.size() > limit) {
    std::cout << absl::StrFormat("(the %d busiest of %d; --limit N shows more)\n", limit,
                                 all.size());
  }
  return 0;
}

// Runs `once` once, or every interval under --watch: a table on a terminal with the screen
// cleared first; YAML documents apart (---); JSON documents one after another (a stream, as jq
// reads it), never with a terminal's escapes among them.
int Repeat(const Globals& g, const Watch& w, const std::function<int()>& once) {
  if (!w.on) return once();
  const bool table = g.output != "json" && g.output != "yaml";
  const bool tty = table && isatty(STDOUT_FILENO);
  for (int n = 0;; ++n) {
    if (tty) std::cout << "\033[H\033[2J";
    if (g.output == "yaml" && n > 0) std::cout << "---\n";
    const int rc = once();
    std::cout.flush();
    if (rc != 0 || (w.count > 0 && n + 1 >= w.count)) return rc;
    std::this_thread::sleep_for(std::chrono::duration<double>(w.interval_s));
  }
}

// A number that is finite: CLI11's Range lets NaN through (every comparison with it is false).
CLI::Validator Finite() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        double v = 0;
        if (!absl::SimpleAtod(text, &v) || !std::isfinite(v)) return "not a finite number: " + text;
        return "";
      },
      "FINITE");
}

void AddWatch(CLI::App* sub, Watch* w) {
  sub->add_flag("-w,--watch", w->on, "show it again every --interval seconds");
  sub->add_option("--interval", w->interval_s, "seconds between refreshes (--watch)")
      ->check(Finite() & CLI::Range(0.1, 3600.0))
      ->capture_default_str();
  sub->add_option("--count", w->count, "stop after this many refreshes (0: never)")
      ->check(CLI::NonNegativeNumber);
}

// A bash completion script for the commands and options of `app`.
std::string BashCompletion(const CLI::App& app) {
  std::vector<std::string> commands, globals;
  std::string cases;
  for (const CLI::App* sub : app.get_subcommands([](const CLI::App*) { return true; })) {
    commands.push_back(sub->get_name());
    std::vector<std::string> words;
    for (const CLI::Option* o : sub->get_options()) {
      for (const std::string& n : o->get_lnames()) words.push_back("--" + n);
    }
    for (const CLI::App* subsub : sub->get_subcommands([](const CLI::App*) { return true; })) {
      words.push_back(subsub->get_name());
    }
    absl::StrAppend(&cases, "    ", sub->get_name(), ") words=\"", absl::StrJoin(words, " "),
                    "\" ;;\n");
  }
  for (const CLI::Option* o : app.get_options()) {
    for (const std::string& n : o->get_lnames()) globals.push_back("--" + n);
  }
  return absl::StrCat(
      "# kvtierctl completion for bash: source <(kvtierctl completion bash)\n"
      "_kvtierctl() {\n"
      "  local cur=${COMP_WORDS[COMP_CWORD]} cmd=\"\" w words\n"
      "  for w in \"${COMP_WORDS[@]:1:COMP_CWORD-1}\"; do\n"
      "    case \" ",
      absl::StrJoin(commands, " "),
      " \" in *\" $w \"*) cmd=$w; break ;; esac\n"
      "  done\n"
      "  case $cmd in\n",
      cases, "    \"\") words=\"", absl::StrJoin(commands, " "), " ", absl::StrJoin(globals, " "),
      "\" ;;\n"
      "  esac\n"
      "  COMPREPLY=($(compgen -W \"$words\" -- \"$cur\"))\n"
      "}\n"
      "complete -F _kvtierctl kvtierctl\n");
}

}  // namespace
}  // namespace kvtier::ctl

int main(int argc, char** argv) {
  using namespace kvtier::ctl;
  Globals g;
  CLI::App app{
      "kvtierctl: inspect and steer a running kvtierd.\n"
      "A failed call exits 1 with the daemon's code and message; bad usage exits 2."};
  app.set_version_flag("--version", "kvtierctl " KVTIER_VERSION);
  app.add_option("--addr", g.addr, "the daemon: unix:PATH or HOST:PORT")
      ->envname("KVTIER_ADDR")
      ->capture_default_str();
  app.add_option("-o,--output", g.output, "table, wide (more columns), json or yaml")
      ->check(CLI::IsMember({"table", "wide", "json", "yaml"}))
      ->capture_default_str();
  app.add_option("--tenant", g.tenant, "act as this tenant (x-kvtier-tenant)");
  app.add_option("--token-file", g.token_file, "a file holding a bearer token sent with every call")
      ->envname("KVTIER_TOKEN_FILE");
  app.add_option("--tls-ca", g.tls_ca, "speak TLS to a TCP address, trusting this CA (PEM)");
  app.add_option("--tls-cert", g.tls_cert, "this client's certificate, for mTLS (with --tls-key)");
  app.add_option("--tls-key", g.tls_key, "its private key");
  app.add_option("--timeout", g.timeout_s, "seconds each call may take (move: each part's wait)")
      ->check(Finite() & CLI::Range(0.1, 3600.0))
      ->capture_default_str();
  app.require_subcommand(1);
  app.fallthrough();  // the options above also after the command: kvtierctl sessions -o json

  app.add_subcommand("health", "the daemon's gRPC health (exit 0 when SERVING)");
  Watch sessions_w, session_w, tiers_w, leases_w, top_w;
  auto* sessions = app.add_subcommand(
      "sessions",
      "the caller's sessions (an admin's: every tenant's): shape, tokens, bytes, leases");
  AddWatch(sessions, &sessions_w);
  std::string id;
  auto* session =
      app.add_subcommand("session", "one session: policy, usage, per-layer index statistics");
  session->add_option("ID", id, "the session id")->required();
  AddWatch(session, &session_w);
  auto* tiers = app.add_subcommand(
      "tiers", "capacity, use, pins, promotions, evictions, copy cache and prefetch, per tier");
  AddWatch(tiers, &tiers_w);
  app.add_subcommand("segments",
                     "the caller's shared-memory segments (an admin's: all): names, sizes, owners");
  std::optional<uint32_t> layer;
  uint32_t limit = 0;
  auto* chunks = app.add_subcommand(
      "chunks", "chunks of a session: positions, precision, bytes, generation, pins");
  chunks->add_option("ID", id, "the session id")->required();
  chunks->add_option("--layer", layer, "one layer only");
  chunks->add_option("--limit", limit, "at most this many (0: the daemon's 10000)");
  std::string lease_session;
  uint32_t lease_limit = 0;
  auto* leases = app.add_subcommand(
      "leases", "live leases (the caller's; an admin's: every tenant's): pins and expiry");
  leases->add_option("--session", lease_session, "one session's only");
  leases->add_option("--limit", lease_limit, "at most this many (0: the daemon's 10000)");
  AddWatch(leases, &leases_w);
  auto* close = app.add_subcommand("close", "close a session (idempotent)");
  close->add_option("ID", id, "the session id")->required();
  std::string move_to, move_as;
  bool move_close = false;
  auto* move = app.add_subcommand(
      "move", "copy a session to another kvtierd (prefill here, decode there), same credentials");
  move->add_option("ID", id, "the session id")->required();
  move->add_option("--to", move_to, "the other daemon: unix:PATH or HOST:PORT")->required();
  move->add_option("--as", move_as, "its id there (default: the same)");
  move->add_flag("--close", move_close, "close it here once the other daemon holds it");
  std::string move_via = "parts";
  move->add_option("--via", move_via,
                   "how the chunks' bytes go: parts (through kvtierctl), nccl (GPU to GPU, "
                   "daemon to daemon), socket (daemon to daemon on one host)")
      ->check(CLI::IsMember({"parts", "nccl", "socket"}));
  std::string evict_tier;
  auto* evict = app.add_subcommand(
      "evict", "move a session's chunks off a tier: device (to host), host (to the remote tier)");
  evict->add_option("ID", id, "the session id")->required();
  evict->add_option("--tier", evict_tier, "device or host")
      ->required()
      ->check(CLI::IsMember({"device", "host"}));
  app.add_subcommand("drain",
                     "stop taking calls, let those in flight finish, then exit (an admin's call)");
  uint32_t top_limit = 10;
  auto* top = app.add_subcommand("top", "tiers and the busiest sessions, refreshed (--watch on)");
  top->add_option("--limit", top_limit, "sessions shown")->capture_default_str();
  AddWatch(top, &top_w);
  top_w.on = true;  // a table refreshed; -o json or yaml once, unless --watch is given
  auto* token = app.add_subcommand("token", "bearer tokens for kvtierd's config");
  std::string hash_tenant;
  bool hash_admin = false;
  auto* hash = token->add_subcommand(
      "hash",
      "read a token on stdin, print the auth.tokens entry that admits it (a fresh salt and the "
      "SHA-256 of salt and token); the token itself is not printed");
  hash->add_option("--tenant", hash_tenant, "the tenant it acts as")->required();
  hash->add_flag("--admin", hash_admin, "an admin token");
  token->require_subcommand(1);
  std::string shell;
  auto* completion = app.add_subcommand("completion", "a shell completion script");
  completion->add_option("SHELL", shell, "bash")->required()->check(CLI::IsMember({"bash"}));

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);  // prints help, the version, or the error
    return rc == 0 ? 0 : 2;
  }
  if (token->parsed()) return TokenHash(hash_tenant, hash_admin);
  if (completion->parsed()) {
    std::cout << BashCompletion(app);
    return 0;
  }

  // Usage the parser cannot see, by the flags' own names, exit 2 as every usage error.
  auto usage = [](const std::string& why) {
    std::cerr << "kvtierctl: " << why << "\nRun with --help for more information.\n";
    return 2;
  };
  if (g.tls_cert.empty() != g.tls_key.empty())
    return usage("--tls-cert and --tls-key: both or neither");
  if (!g.tls_cert.empty() && g.tls_ca.empty()) return usage("--tls-cert needs --tls-ca");
  kvtier::ClientOptions opts;
  opts.tenant = g.tenant;
  opts.tls_ca_file = g.tls_ca;
  opts.tls_cert_file = g.tls_cert;
  opts.tls_key_file = g.tls_key;
  if (!g.token_file.empty()) {
    std::ifstream in(g.token_file);
    if (!in) return usage(absl::StrCat("--token-file ", g.token_file, ": cannot be read"));
    absl::StatusOr<std::string> t = ReadToken(in, "--token-file " + g.token_file);
    if (!t.ok()) return usage(std::string(t.status().message()));
    opts.token = *std::move(t);
  }
  opts.timeout = absl::Milliseconds(static_cast<int64_t>(g.timeout_s * 1000));
  auto client = kvtier::Client::Connect(g.addr, opts);
  if (!client.ok()) return Fail(client.status(), &g);
  kvtier::Client& c = **client;
  const bool wide = g.output == "wide";

  if (app.got_subcommand("health")) {
    auto r = c.Health();
    if (!r.ok()) return Fail(r.status(), &g);
    const char* status = *r ? "SERVING" : "NOT_SERVING";
    if (g.output == "json") {
      std::cout << "{\"status\": \"" << status << "\"}\n";
    } else if (g.output == "yaml") {
      std::cout << "status: " << status << "\n";
    } else {
      std::cout << status << "\n";
    }
    return *r ? 0 : 1;
  }
  if (sessions->parsed()) {
    return Repeat(g, sessions_w, [&] {
      auto r = c.ListSessions();
      if (!r.ok()) return Fail(r.status(), &g);
      return Print(g, *r, [&] { return SessionsTable(*r, wide); });
    });
  }
  if (session->parsed()) return Repeat(g, session_w, [&] { return SessionCmd(c, g, id); });
  if (tiers->parsed()) {
    return Repeat(g, tiers_w, [&] {
      auto r = c.GetTierStats();
      if (!r.ok()) return Fail(r.status(), &g);
      return Print(g, *r, [&] { return TiersTable(*r); });
    });
  }
  if (app.got_subcommand("segments")) {
    auto r = c.ListSegments();
    if (!r.ok()) return Fail(r.status(), &g);
    return Print(g, *r, [&] {
      Table t({"SEGMENT", "TIER", "SHM NAME", "SIZE", "SLOT", "TENANT", "GENERATION"},
              {true, false, false, true, true, false, true});
      for (const auto& s : r->segments()) {
        // An unnamed (memfd) segment is reached by descriptor only.
        const std::string name = s.shm_name().empty() ? "(memfd)" : s.shm_name();
        t.Add({absl::StrCat(s.segment_id()), TierName(s.tier()), name, Bytes(s.size_bytes()),
               Bytes(s.slot_bytes()), s.tenant(), absl::StrCat(s.generation())});
      }
      return t.Render();
    });
  }
  if (chunks->parsed()) {
    kvtier::v1::ListChunksRequest req;
    req.set_session_id(id);
    if (layer) req.set_layer(*layer);
    req.set_limit(limit);
    auto r = c.ListChunks(req);
    if (!r.ok()) return Fail(r.status(), &g);
    return Print(g, *r, [&] {
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
      std::string out = t.Render();
      if (static_cast<uint64_t>(r->chunks_size()) < r->total()) {
        absl::StrAppend(&out, absl::StrFormat("(%d of %d chunks; --limit N shows more)\n",
                                              r->chunks_size(), r->total()));
      }
      return out;
    });
  }
  if (leases->parsed()) {
    return Repeat(g, leases_w, [&] {
      auto r = c.ListLeases(lease_session, lease_limit);
      if (!r.ok()) return Fail(r.status(), &g);
      return Print(g, *r, [&] { return LeasesTable(*r, wide); });
    });
  }
  if (close->parsed()) {
    auto r = c.CloseSession(id);
    if (!r.ok()) return Fail(r.status(), &g);
    kvtier::v1::CloseSessionResponse resp;
    resp.set_existed(*r);
    return Print(g, resp, [&] { return absl::StrCat(*r ? "closed " : "no session ", id, "\n"); });
  }
  if (move->parsed()) {
    auto to = kvtier::Client::Connect(move_to, opts);
    if (!to.ok()) return Fail(to.status(), &g);
    const auto via = move_via == "nccl"     ? kvtier::v1::CHUNK_CARRIER_NCCL
                     : move_via == "socket" ? kvtier::v1::CHUNK_CARRIER_SOCKET
                                            : kvtier::v1::CHUNK_CARRIER_PARTS;
    auto r = c.MoveSession(id, **to, move_as, via);
    if (!r.ok()) return Fail(r.status(), &g);
    if (move_close) {
      if (auto closed = c.CloseSession(id); !closed.ok()) return Fail(closed.status(), &g);
    }
    return Print(g, *r, [&] {
      return absl::StrCat(move_close ? "moved " : "copied ", id, " to ", move_to, " as ",
                          r->session_id(), "\n");
    });
  }
  if (evict->parsed()) {
    const auto tier = evict_tier == "device" ? kvtier::v1::TIER_DEVICE : kvtier::v1::TIER_HOST;
    auto r = c.Evict(id, tier);
    if (!r.ok()) return Fail(r.status(), &g);
    kvtier::v1::EvictResponse resp;
    resp.set_bytes_moved(*r);
    return Print(g, resp, [&] {
      return absl::StrCat("moved ", Bytes(*r), " of ", id, " off the ", evict_tier, " tier\n");
    });
  }
  if (app.got_subcommand("drain")) {
    auto r = c.Drain();
    if (!r.ok()) return Fail(r.status(), &g);
    kvtier::v1::DrainResponse resp;
    resp.set_sessions(*r);
    return Print(g, resp, [&] {
      return absl::StrCat("draining: ", *r,
                          " sessions live; kvtierd exits once the calls in "
                          "flight end\n");
    });
  }
  if (top->parsed()) {
    if ((g.output == "json" || g.output == "yaml") && top->count("--watch") == 0) top_w.on = false;
    return Repeat(g, top_w, [&] { return TopCmd(c, g, top_limit); });
  }
  return 2;
}
