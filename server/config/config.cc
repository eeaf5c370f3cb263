#include "server/config/config.h"

#include <algorithm>
#include <cstring>
#include <fstream>
#include <sstream>
#include <tuple>

#include "absl/algorithm/container.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/io/tokenizer.h"
#include "google/protobuf/text_format.h"
#include "server/common/names.h"
#include "server/common/size.h"
#include "server/common/status_macros.h"
#include "server/config/policy.h"

namespace kvtier {
namespace {

using google::protobuf::FieldDescriptor;

class CollectErrors : public google::protobuf::io::ErrorCollector {
 public:
  void AddError(int line, google::protobuf::io::ColumnNumber column,
                const std::string& message) override {
    if (first_.empty()) first_ = absl::StrFormat("config %d:%d: %s", line + 1, column + 1, message);
  }
  const std::string& first() const { return first_; }

 private:
  std::string first_;
};

absl::Status InvalidField(absl::string_view field, absl::string_view value, absl::string_view why) {
  return absl::InvalidArgumentError(absl::StrFormat("%s: \"%s\" %s", field, value, why));
}

// INVALID_ARGUMENT naming the field unless lo <= value <= hi.
absl::Status InRange(absl::string_view field, uint64_t value, uint64_t lo, uint64_t hi) {
  if (value >= lo && value <= hi) return absl::OkStatus();
  return InvalidField(field, absl::StrCat(value), absl::StrCat("is outside [", lo, ", ", hi, "]"));
}

// An on/off field's value (true: "on"); INVALID_ARGUMENT naming the field for anything else.
absl::StatusOr<bool> OnOff(absl::string_view field, absl::string_view value) {
  if (value != "on" && value != "off") return InvalidField(field, value, "is not on or off");
  return value == "on";
}

// "unix:PATH" (PATH absolute or relative, short enough for sun_path) or "HOST:PORT".
absl::Status CheckAddress(absl::string_view field, const std::string& addr) {
  if (absl::StartsWith(addr, "unix:")) {
    std::string path = addr.substr(5);
    if (path.empty()) return InvalidField(field, addr, "has an empty socket path");
    if (path.size() > 100) return InvalidField(field, addr, "socket path is over 100 bytes");
    return absl::OkStatus();
  }
  auto colon = addr.rfind(':');
  uint32_t port = 0;
  if (colon == std::string::npos || colon == 0 ||
      !absl::SimpleAtoi(addr.substr(colon + 1), &port) || port == 0 || port > 65535) {
    return InvalidField(field, addr, "is neither unix:PATH nor HOST:PORT with PORT in 1..65535");
  }
  return absl::OkStatus();
}

// Every scalar field of `config` left unset takes the default; one set, 0 and "" too, stays
// (Validate checks it).
v1::Config WithDefaults(const v1::Config& config) {
  v1::Config merged = DefaultConfig();
  const auto* desc = merged.GetDescriptor();
  const auto* refl = merged.GetReflection();
  for (int i = 0; i < desc->field_count(); ++i) {
    const FieldDescriptor* f = desc->field(i);
    if (f->type() == FieldDescriptor::TYPE_MESSAGE) continue;
    if (refl->HasField(config, f)) {  // the scalars are `optional`: "has" means set
      switch (f->cpp_type()) {
        case FieldDescriptor::CPPTYPE_STRING:
          refl->SetString(&merged, f, refl->GetString(config, f));
          break;
        case FieldDescriptor::CPPTYPE_UINT32:
          refl->SetUInt32(&merged, f, refl->GetUInt32(config, f));
          break;
        default:
          break;
      }
    }
  }
  if (config.has_default_policy()) *merged.mutable_default_policy() = config.default_policy();
  return merged;
}

absl::Status ApplyFlag(v1::Config* config, const std::string& name, const std::string& value) {
  const FieldDescriptor* f = config->GetDescriptor()->FindFieldByName(name);
  if (f == nullptr || f->type() == FieldDescriptor::TYPE_MESSAGE) {
    return absl::InvalidArgumentError(absl::StrCat("unknown flag --", name, "; see --help"));
  }
  const auto* refl = config->GetReflection();
  switch (f->cpp_type()) {
    case FieldDescriptor::CPPTYPE_STRING:
      refl->SetString(config, f, value);
      return absl::OkStatus();
    case FieldDescriptor::CPPTYPE_UINT32: {
      uint32_t v = 0;
      if (!absl::SimpleAtoi(value, &v)) {
        return InvalidField(name, value, "is not a non-negative 32-bit integer");
      }
      refl->SetUInt32(config, f, v);
      return absl::OkStatus();
    }
    default:
      return absl::InternalError(absl::StrCat("flag --", name, " has an unsupported type"));
  }
}

}  // namespace

v1::Config DefaultConfig() {
  ServerOptions o;
  v1::Config c;
  c.set_listen(o.listen);
  c.set_instance(o.instance);
  c.set_device_capacity("1G");
  c.set_host_capacity("4G");
  c.set_lease_ttl_ms(o.lease_ttl_ms);
  c.set_max_lease_ms(o.max_lease_ms);
  c.set_max_leases_per_tenant(o.max_leases_per_tenant);
  c.set_metrics_port(o.metrics_port);
  c.set_metrics_bind(o.metrics_bind);
  c.set_max_sessions(o.max_sessions);
  c.set_segment_size("64M");
  c.set_max_message_size("64M");
  c.set_drain_timeout_ms(o.drain_timeout_ms);
  c.set_log_level(o.log_level);
  c.set_log_format(o.log_format);
  c.set_eviction_policy(o.eviction_policy);
  c.set_eviction_half_life_ms(o.eviction_half_life_ms);
  c.set_prefetch(o.prefetch ? "on" : "off");
  c.set_channel_colocate(o.channel_colocate ? "on" : "off");
  c.set_drain_to_remote(o.drain_to_remote ? "on" : "off");
  c.set_remote_connections(o.remote_connections);
  c.set_remote_timeout_ms(o.remote_timeout_ms);
  c.set_persist_interval_ms(o.persist_interval_ms);
  c.mutable_auth()->set_same_uid_by_metadata(o.same_uid_by_metadata ? "on" : "off");
  c.set_tcp_plaintext(o.tcp_plaintext ? "on" : "off");
  c.set_segment_memory("auto");
  c.set_max_aging_backlog_tokens(o.max_aging_backlog_tokens);
  c.set_max_staging_size("1G");
  c.set_transfer_idle_timeout_ms(o.transfer_idle_timeout_ms);
  c.set_max_connections_per_uid(o.max_connections_per_uid);
  c.set_retained_segment_size("1G");
  c.set_device("auto");
  *c.mutable_default_policy() = BuiltinPolicy();
  return c;
}

absl::StatusOr<v1::Config> ParseConfigText(const std::string& text) {
  v1::Config config;
  google::protobuf::TextFormat::Parser parser;
  CollectErrors errors;
  parser.RecordErrorsTo(&errors);
  if (!parser.ParseFromString(text, &config)) {
    return absl::InvalidArgumentError(errors.first().empty() ? "config: parse error"
                                                             : errors.first());
  }
  return config;
}

absl::StatusOr<ServerOptions> Validate(const v1::Config& raw) {
  const v1::Config c = WithDefaults(raw);
  ServerOptions o;
  RETURN_IF_ERROR(CheckAddress("listen", c.listen()));
  o.listen = c.listen();
  if (!c.tcp_listen().empty()) {
    RETURN_IF_ERROR(CheckAddress("tcp_listen", c.tcp_listen()));
    if (absl::StartsWith(c.tcp_listen(), "unix:")) {
      return InvalidField("tcp_listen", c.tcp_listen(), "must be HOST:PORT");
    }
  }
  o.tcp_listen = c.tcp_listen();
  if (!IsName(c.instance(), "_.-", 63)) {
    return InvalidField("instance", c.instance(), "must be 1..63 of [A-Za-z0-9_.-]");
  }
  o.instance = c.instance();
  ASSIGN_OR_RETURN(o.device_capacity, ParseSize(c.device_capacity(), "device_capacity"));
  ASSIGN_OR_RETURN(o.host_capacity, ParseSize(c.host_capacity(), "host_capacity"));
  if (o.host_capacity == 0) return InvalidField("host_capacity", c.host_capacity(), "must be > 0");
  // At most a pebibyte each, so that sums of them (the shared memory a start-up checks) cannot
  // wrap.
  constexpr uint64_t kMaxCapacity = uint64_t{1} << 50;
  for (const auto& [field, text, bytes] :
       {std::tuple{"host_capacity", &c.host_capacity(), o.host_capacity},
        {"device_capacity", &c.device_capacity(), o.device_capacity}}) {
    if (bytes > kMaxCapacity) return InvalidField(field, *text, "is above 1P (1024T)");
  }
  ASSIGN_OR_RETURN(o.segment_size, ParseSize(c.segment_size(), "segment_size"));
  if (o.segment_size < (1ull << 20) || o.segment_size > (1ull << 40) ||
      o.segment_size % 4096 != 0) {
    return InvalidField("segment_size", c.segment_size(),
                        "must be a multiple of 4K between 1M and 1T");
  }
  ASSIGN_OR_RETURN(o.max_message_size, ParseSize(c.max_message_size(), "max_message_size"));
  if (o.max_message_size < (1ull << 20) || o.max_message_size > (1ull << 31) - 1) {
    return InvalidField("max_message_size", c.max_message_size(), "must be in [1M, 2G)");
  }
  if (!c.remote().empty()) {
    if (!absl::StartsWith(c.remote(), "redis://") && !absl::StartsWith(c.remote(), "unix:")) {
      return InvalidField("remote", c.remote(), "is neither redis://HOST:PORT nor unix:PATH");
    }
  }
  o.remote = c.remote();
  // Set to 0 (unset takes the default): none of these has a meaning at 0.
  for (const auto& [field, value] : {std::pair{"max_lease_ms", c.max_lease_ms()},
                                     {"lease_ttl_ms", c.lease_ttl_ms()},
                                     {"max_sessions", c.max_sessions()},
                                     {"eviction_half_life_ms", c.eviction_half_life_ms()}}) {
    if (value == 0) return InvalidField(field, "0", "must be at least 1");
  }
  if (c.metrics_bind().empty()) {
    return InvalidField("metrics_bind", "", "must be an address to bind (127.0.0.1, 0.0.0.0)");
  }
  o.max_lease_ms = c.max_lease_ms();
  if (o.max_lease_ms > 86'400'000) {
    return InvalidField("max_lease_ms", absl::StrCat(o.max_lease_ms), "is above 24 hours");
  }
  o.max_leases_per_tenant = c.max_leases_per_tenant();
  if (o.max_leases_per_tenant == 0) {
    return InvalidField("max_leases_per_tenant", "0", "must be at least 1");
  }
  o.lease_ttl_ms = c.lease_ttl_ms();
  if (o.lease_ttl_ms > o.max_lease_ms) {
    return InvalidField("lease_ttl_ms", absl::StrCat(o.lease_ttl_ms),
                        absl::StrCat("is above max_lease_ms ", o.max_lease_ms));
  }
  o.metrics_port = c.metrics_port();
  if (o.metrics_port > 65535) {
    return InvalidField("metrics_port", absl::StrCat(o.metrics_port), "is above 65535");
  }
  o.metrics_bind = c.metrics_bind();
  o.max_sessions = c.max_sessions();
  o.drain_timeout_ms = c.drain_timeout_ms();
  o.log_level = c.log_level();
  if (!c.log_format().empty()) o.log_format = c.log_format();
  o.eviction_policy = c.eviction_policy();
  if (o.eviction_policy != "lru" && o.eviction_policy != "frequency" &&
      o.eviction_policy != "cost") {
    return InvalidField("eviction_policy", o.eviction_policy, "is not one of lru, frequency, cost");
  }
  o.eviction_half_life_ms = c.eviction_half_life_ms();
  ASSIGN_OR_RETURN(o.prefetch, OnOff("prefetch", c.prefetch()));
  ASSIGN_OR_RETURN(o.channel_colocate, OnOff("channel_colocate", c.channel_colocate()));
  ASSIGN_OR_RETURN(o.drain_to_remote, OnOff("drain_to_remote", c.drain_to_remote()));
  o.remote_connections = c.remote_connections();
  RETURN_IF_ERROR(InRange("remote_connections", o.remote_connections, 1, 64));
  o.persist_interval_ms = c.persist_interval_ms();
  if (o.persist_interval_ms > 0 && c.remote().empty()) {
    return InvalidField("persist_interval_ms", absl::StrCat(o.persist_interval_ms),
                        "needs a remote tier (remote) to persist to");
  }
  if (o.persist_interval_ms > 0 && o.persist_interval_ms < 10) {
    return InvalidField("persist_interval_ms", absl::StrCat(o.persist_interval_ms),
                        "is below 10 (0: off)");
  }
  o.remote_timeout_ms = c.remote_timeout_ms();
  RETURN_IF_ERROR(InRange("remote_timeout_ms", o.remote_timeout_ms, 10, 600'000));
  for (const auto& [tenant, q] : raw.quotas()) {
    const std::string field = absl::StrCat("quotas[\"", tenant, "\"]");
    if (tenant != "*" && !IsTenantName(tenant)) {
      return InvalidField(field, tenant, absl::StrCat("is not \"*\" and ", kTenantRule));
    }
    ServerOptions::Quota quota;
    // A size of 0 would read as no limit (the tiers' 0), the opposite of what it says.
    for (const auto& [name, text, bytes] :
         {std::tuple{".host_bytes", &q.host_bytes(), &quota.host_bytes},
          {".device_bytes", &q.device_bytes(), &quota.device_bytes}}) {
      if (text->empty()) continue;
      ASSIGN_OR_RETURN(*bytes, ParseSize(*text, field + name));
      if (*bytes == 0) {
        return InvalidField(field + name, *text,
                            "is 0, which is not a quota (leave it unset for no limit)");
      }
    }
    quota.max_sessions = q.max_sessions();
    o.quotas[tenant] = quota;
  }
  ASSIGN_OR_RETURN(
      o.same_uid_by_metadata,
      OnOff("auth.same_uid_by_metadata",
            raw.auth().same_uid_by_metadata().empty() ? "on" : raw.auth().same_uid_by_metadata()));
  for (int i = 0; i < raw.auth().unix_peers_size(); ++i) {
    const v1::UnixPeer& p = raw.auth().unix_peers(i);
    const std::string field = absl::StrCat("auth.unix_peers[", i, "]");
    if (!IsTenantName(p.tenant())) return InvalidField(field + ".tenant", p.tenant(), kTenantRule);
    if (!o.unix_peers.emplace(p.uid(), ServerOptions::Grant{p.tenant(), p.admin()}).second) {
      return InvalidField(field + ".uid", absl::StrCat(p.uid()), "is named twice");
    }
  }
  for (int i = 0; i < raw.auth().tokens_size(); ++i) {
    const v1::Token& t = raw.auth().tokens(i);
    const std::string field = absl::StrCat("auth.tokens[", i, "]");
    if (!IsTenantName(t.tenant())) return InvalidField(field + ".tenant", t.tenant(), kTenantRule);
    const bool salt_ok = t.salt().size() >= 16 && t.salt().size() <= 128 &&
                         absl::c_all_of(t.salt(), [](char ch) { return absl::ascii_isalnum(ch); });
    if (!salt_ok) {
      return InvalidField(field + ".salt", t.salt(), "is not 16..128 characters of [A-Za-z0-9]");
    }
    ServerOptions::Token token{.grant = {t.tenant(), t.admin()}, .salt = t.salt()};
    const bool hex_ok = t.sha256().size() == 64 && absl::c_all_of(t.sha256(), [](char ch) {
                          return absl::ascii_isdigit(ch) || (ch >= 'a' && ch <= 'f');
                        });
    if (!hex_ok) {
      return InvalidField(field + ".sha256", t.sha256(), "is not 64 lowercase hex digits");
    }
    const std::string bytes = absl::HexStringToBytes(t.sha256());
    std::memcpy(token.sha256.data(), bytes.data(), token.sha256.size());
    for (const ServerOptions::Token& other : o.tokens) {
      if (other.sha256 == token.sha256 && other.salt == token.salt) {
        return InvalidField(field + ".sha256", t.sha256(), "is another entry's too");
      }
    }
    o.tokens.push_back(std::move(token));
  }
  for (int i = 0; i < raw.auth().cert_subjects_size(); ++i) {
    const v1::CertSubject& cs = raw.auth().cert_subjects(i);
    const std::string field = absl::StrCat("auth.cert_subjects[", i, "]");
    if (!IsTenantName(cs.tenant()))
      return InvalidField(field + ".tenant", cs.tenant(), kTenantRule);
    if (cs.subject().empty() || cs.subject().size() > 1024) {
      return InvalidField(field + ".subject", cs.subject(), "is not 1..1024 bytes");
    }
    if (!o.cert_subjects.emplace(cs.subject(), ServerOptions::Grant{cs.tenant(), cs.admin()})
             .second) {
      return InvalidField(field + ".subject", cs.subject(), "is named twice");
    }
  }
  const v1::Tls& tls = raw.tls();
  o.tls = {.cert_file = tls.cert_file(),
           .key_file = tls.key_file(),
           .client_ca_file = tls.client_ca_file(),
           .refresh_s = tls.refresh_s() == 0 ? 1 : tls.refresh_s()};
  if (o.tls.cert_file.empty() != o.tls.key_file.empty()) {
    return InvalidField(o.tls.cert_file.empty() ? "tls.cert_file" : "tls.key_file", "",
                        "is needed with the other (a certificate and its key)");
  }
  if (!o.tls.client_ca_file.empty() && o.tls.cert_file.empty()) {
    return InvalidField("tls.client_ca_file", o.tls.client_ca_file,
                        "needs tls.cert_file and tls.key_file");
  }
  RETURN_IF_ERROR(InRange("tls.refresh_s", o.tls.refresh_s, 1, 60));  // 0 was taken as 1
  if (!o.cert_subjects.empty() && o.tls.client_ca_file.empty()) {
    return InvalidField("auth.cert_subjects", raw.auth().cert_subjects(0).subject(),
                        "needs tls.client_ca_file to verify client certificates");
  }
  ASSIGN_OR_RETURN(o.tcp_plaintext,
                   OnOff("tcp_plaintext", c.tcp_plaintext().empty() ? "off" : c.tcp_plaintext()));
  if (o.has_tcp() && o.tls.cert_file.empty() && !o.tcp_plaintext) {
    return InvalidField(o.tcp_listen.empty() ? "listen" : "tcp_listen",
                        o.tcp_listen.empty() ? o.listen : o.tcp_listen,
                        "is TCP, which needs tls { cert_file key_file } in the config, or "
                        "--tcp_plaintext on for a trusted network");
  }
  o.aging_threads = c.aging_threads();  // 0: the core count, when the daemon starts
  if (o.aging_threads > 256) {
    return InvalidField("aging_threads", absl::StrCat(c.aging_threads()), "is outside [1, 256]");
  }
  o.max_aging_backlog_tokens = c.max_aging_backlog_tokens();
  if (o.max_aging_backlog_tokens < 1024 || o.max_aging_backlog_tokens > (1u << 31)) {
    return InvalidField("max_aging_backlog_tokens", absl::StrCat(o.max_aging_backlog_tokens),
                        "is outside [1024, 2^31]");
  }
  ASSIGN_OR_RETURN(o.max_staging_size, ParseSize(c.max_staging_size(), "max_staging_size"));
  if (o.max_staging_size > (1ull << 40)) {
    return InvalidField("max_staging_size", c.max_staging_size(), "must be at most 1T");
  }
  if (!c.max_import_size().empty()) {
    ASSIGN_OR_RETURN(o.max_import_size, ParseSize(c.max_import_size(), "max_import_size"));
    if (o.max_import_size == 0 || o.max_import_size > (1ull << 40)) {
      return InvalidField("max_import_size", c.max_import_size(), "is outside [1, 1T]");
    }
  }
  if (!c.max_rpc_buffer_size().empty()) {
    ASSIGN_OR_RETURN(o.max_rpc_buffer_size,
                     ParseSize(c.max_rpc_buffer_size(), "max_rpc_buffer_size"));
    if (o.max_rpc_buffer_size < 2 * o.max_message_size || o.max_rpc_buffer_size > (1ull << 40)) {
      return InvalidField("max_rpc_buffer_size", c.max_rpc_buffer_size(),
                          absl::StrCat("is outside [2 * max_message_size (", 2 * o.max_message_size,
                                       " bytes), 1T]"));
    }
  }
  o.max_connections_per_uid = c.max_connections_per_uid();
  RETURN_IF_ERROR(InRange("max_connections_per_uid", o.max_connections_per_uid, 1, 4096));
  o.transfer_idle_timeout_ms = c.transfer_idle_timeout_ms();
  if (o.transfer_idle_timeout_ms != 0 && o.transfer_idle_timeout_ms < 1000) {
    return InvalidField("transfer_idle_timeout_ms", absl::StrCat(o.transfer_idle_timeout_ms),
                        "is below 1000 (the daemon looks every 100 ms); 0 turns it off");
  }
  ASSIGN_OR_RETURN(o.retained_segment_size,
                   ParseSize(c.retained_segment_size(), "retained_segment_size"));
  if (o.retained_segment_size > (1ull << 40)) {
    return InvalidField("retained_segment_size", c.retained_segment_size(), "must be at most 1T");
  }
  o.device = c.device().empty() ? "auto" : c.device();
  if (int n = 0;
      o.device != "auto" && o.device != "emulated" &&
      (!absl::SimpleAtoi(o.device, &n) || n < 0 || n > 63 || o.device != absl::StrCat(n))) {
    return InvalidField("device", o.device, "is not auto, emulated or a CUDA device index 0..63");
  }
  const std::string memory = c.segment_memory().empty() ? "auto" : c.segment_memory();
  if (memory != "auto" && memory != "named" && memory != "memfd") {
    return InvalidField("segment_memory", memory, "is not one of auto, named, memfd");
  }
  // Descriptors are handed over the Unix socket only: without one, unnamed memory would be
  // unreachable to every worker.
  const bool unix_listener = absl::StartsWith(o.listen, "unix:");
  if (memory == "memfd" && !unix_listener) {
    return InvalidField("segment_memory", memory,
                        "needs a Unix-socket listen (workers collect descriptors there)");
  }
  o.memfd_segments =
      memory == "memfd" || (memory == "auto" && !o.same_uid_by_metadata && unix_listener);
  if (!o.has_tcp() && !o.tls.cert_file.empty()) {
    return InvalidField("tls.cert_file", o.tls.cert_file, "is set, but no listener is TCP");
  }
  static constexpr absl::string_view kLevels[] = {"trace", "debug", "info", "warn", "error", "off"};
  if (std::find(std::begin(kLevels), std::end(kLevels), o.log_level) == std::end(kLevels)) {
    return InvalidField("log_level", o.log_level,
                        "is not one of trace, debug, info, warn, error, off");
  }
  if (o.log_format != "logfmt" && o.log_format != "json") {
    return InvalidField("log_format", o.log_format, "is not one of logfmt, json");
  }
  ASSIGN_OR_RETURN(o.default_policy,
                   ResolvePolicy(c.default_policy(), BuiltinPolicy(), "default_policy"));
  return o;
}

absl::StatusOr<CommandLine> ParseCommandLine(const std::vector<std::string>& args) {
  CommandLine cl;
  std::vector<std::pair<std::string, std::string>> flags;
  std::string config_path;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (!absl::StartsWith(a, "--")) {
      return absl::InvalidArgumentError(absl::StrCat("unexpected argument \"", a, "\""));
    }
    std::string name = a.substr(2), value;
    if (name == "help" || name == "print_default_config" || name == "version") {
      (name == "help" ? cl.help : name == "version" ? cl.version : cl.print_default_config) = true;
      continue;
    }
    if (auto eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
    } else if (i + 1 < args.size()) {
      value = args[++i];
    } else {
      return absl::InvalidArgumentError(absl::StrCat("flag --", name, " needs a value"));
    }
    if (name == "config") {
      // An empty path (an unset variable) or a second file would be taken silently otherwise.
      if (value.empty()) return InvalidField("config", value, "names no file");
      if (!config_path.empty()) {
        return InvalidField(
            "config", value,
            absl::StrCat("is a second file, after \"", config_path, "\"; give one"));
      }
      config_path = value;
    } else {
      flags.emplace_back(name, value);
    }
  }
  if (!config_path.empty()) {
    std::ifstream in(config_path);
    if (!in) {
      return absl::InvalidArgumentError(absl::StrCat("config: cannot read \"", config_path, "\""));
    }
    std::stringstream text;
    text << in.rdbuf();
    auto parsed = ParseConfigText(text.str());
    if (!parsed.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(config_path, ": ", parsed.status().message()));
    }
    cl.config = *std::move(parsed);
  }
  for (const auto& [name, value] : flags) RETURN_IF_ERROR(ApplyFlag(&cl.config, name, value));
  return cl;
}

std::string Usage() {
  // {flag, meaning}: the comment above each Config field (scripts/config-help).
  static constexpr std::pair<const char*, const char*> kHelp[] = {
#include "config_help.inc"
  };
  std::string out =
      "usage: kvtierd [--config FILE] [--FIELD VALUE]... [--print_default_config]\n"
      "Every scalar field of the Config message is also a flag; flags override the file\n"
      "(text format of kvtier.v1.Config; --print_default_config prints one with every\n"
      "default). SIZE is bytes with an optional K, M, G or T suffix.\n\nflags:\n";
  const v1::Config defaults = DefaultConfig();
  const auto* desc = v1::Config::descriptor();
  const auto* refl = defaults.GetReflection();
  std::vector<std::string> file_only;
  for (const auto& [name, meaning] : kHelp) {
    const FieldDescriptor* f = desc->FindFieldByName(name);
    if (f == nullptr) continue;
    if (f->type() == FieldDescriptor::TYPE_MESSAGE) {
      file_only.push_back(name);
      continue;
    }
    std::string def;
    switch (f->cpp_type()) {
      case FieldDescriptor::CPPTYPE_STRING:
        def = absl::StrCat("\"", refl->GetString(defaults, f), "\"");
        break;
      case FieldDescriptor::CPPTYPE_UINT32:
        def = absl::StrCat(refl->GetUInt32(defaults, f));
        break;
      default:
        def = "?";
    }
    absl::StrAppend(&out, "  --", name, " (default ", def, ")\n");
    // The meaning, wrapped at 80 columns under the flag.
    std::string line = "     ";
    for (absl::string_view word : absl::StrSplit(meaning, ' ', absl::SkipEmpty())) {
      if (line.size() + 1 + word.size() > 80 && line.size() > 5) {
        absl::StrAppend(&out, line, "\n");
        line = "     ";
      }
      absl::StrAppend(&line, " ", word);
    }
    absl::StrAppend(&out, line, "\n");
  }
  absl::StrAppend(&out, "\nin the config file only: ", absl::StrJoin(file_only, ", "),
                  "\n\n  --config FILE           the config file\n"
                  "  --print_default_config  print the defaults as a config file, and exit\n"
                  "  --version               print the version, and exit\n"
                  "  --help                  this text\n");
  return out;
}

}  // namespace kvtier
