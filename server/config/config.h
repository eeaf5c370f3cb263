// kvtierd's configuration: a `kvtier.v1.Config` in protobuf text format (--config FILE),
// overridden by flags of the same names (--host_capacity 8G), validated once at start-up
// into `ServerOptions`, which is handed down by const reference.
#ifndef KVTIER_SERVER_CONFIG_CONFIG_H_
#define KVTIER_SERVER_CONFIG_CONFIG_H_

#include <array>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kvtier/v1/config.pb.h"
#include "kvtier/v1/kvtier.pb.h"

namespace kvtier {

// Validated, parsed configuration. Every field holds its effective value.
struct ServerOptions {
  // "unix:PATH" or "HOST:PORT".
  std::string listen = "unix:/tmp/kvtier.sock";
  // Optional second listener, "HOST:PORT"; empty: none.
  std::string tcp_listen;
  // Names this daemon's shared-memory segments: /dev/shm/kvtier-<instance>-<tier>-<n>.
  std::string instance = "default";
  // Capacity of the device tier (a GPU's HBM, or host memory standing in for it).
  uint64_t device_capacity = 1ull << 30;
  // Capacity of the host tier, which holds every chunk of every live session.
  uint64_t host_capacity = 4ull << 30;
  // Remote tier address; empty: none.
  std::string remote;
  // Lease lifetime when a Select names none, and the longest a Select may name.
  uint32_t lease_ttl_ms = 30'000;
  uint32_t max_lease_ms = 600'000;
  // Live leases per tenant.
  uint32_t max_leases_per_tenant = 4096;
  // Prometheus exposition port (0: off) and bind address.
  uint32_t metrics_port = 0;
  std::string metrics_bind = "127.0.0.1";
  uint32_t max_sessions = 4096;
  // Each shared-memory segment a slab allocator maps.
  uint64_t segment_size = 64ull << 20;
  // Largest gRPC message in either direction.
  uint64_t max_message_size = 64ull << 20;
  // Time in-flight calls get to finish after SIGTERM or Drain.
  uint32_t drain_timeout_ms = 10'000;
  std::string log_level = "info";
  std::string log_format = "logfmt";
  // Promotion caches: eviction order, and prefetch after each Select.
  std::string eviction_policy = "lru";
  uint32_t eviction_half_life_ms = 10'000;
  bool prefetch = true;
  // Shared-memory Select channels: each channel's thread waits on its worker's CPU.
  bool channel_colocate = true;
  // With a remote tier: a shutdown demotes every session to it before closing.
  bool drain_to_remote = true;
  // The remote tier's connection pool, and the bound on each of its calls.
  uint32_t remote_connections = 4;
  uint32_t remote_timeout_ms = 5000;
  // Write-behind snapshots to the remote tier every this many ms; 0: off.
  uint32_t persist_interval_ms = 0;
  // Threads that age sessions off the append path (0: the core count),
  // and the un-aged tokens a session may hold (summed over layers) before appends wait.
  uint32_t aging_threads = 0;
  uint32_t max_aging_backlog_tokens = 262'144;
  // The device tier's memory: "auto", "emulated" or a CUDA device index (config.proto).
  std::string device = "auto";
  // Committed bytes of emptied segments each local tier keeps for reuse; 0: none kept.
  uint64_t retained_segment_size = 1ull << 30;
  // Staging areas' bytes alive at once (OpenStaging); 0: OpenStaging is refused.
  uint64_t max_staging_size = 1ull << 30;
  // Bytes that imports in progress hold at once (0: the host tier's capacity), and the time a
  // transfer may wait on its caller before it is cancelled (0: never).
  uint64_t max_import_size = 0;
  uint32_t transfer_idle_timeout_ms = 120'000;
  // Memory gRPC may hold over every connection (its resource quota); 0: eight times
  // max_message_size.
  uint64_t max_rpc_buffer_size = 0;
  // Unix-socket connections open at once per uid, the daemon's own uid aside.
  uint32_t max_connections_per_uid = 256;
  // Tenant quotas (0: no limit); "*" for every tenant not named.
  struct Quota {
    uint64_t host_bytes = 0;
    uint64_t device_bytes = 0;
    uint32_t max_sessions = 0;
  };
  std::map<std::string, Quota> quotas;
  // What gRPC may hold: max_rpc_buffer_size, or eight times max_message_size when 0.
  uint64_t RpcBufferBytes() const {
    return max_rpc_buffer_size != 0 ? max_rpc_buffer_size : 8 * max_message_size;
  }
  // The quota that applies to `tenant`: its own, else "*", else none.
  Quota QuotaFor(const std::string& tenant) const {
    auto it = quotas.find(tenant);
    if (it == quotas.end()) it = quotas.find("*");
    return it == quotas.end() ? Quota{} : it->second;
  }
  // What one credential gives: a tenant, and maybe the admin role.
  struct Grant {
    std::string tenant;
    bool admin = false;
    bool operator==(const Grant&) const = default;
  };
  // A bearer token's entry: its grant, its salt, and SHA-256(salt || token).
  struct Token {
    Grant grant;
    std::string salt;
    std::array<uint8_t, 32> sha256{};
  };
  // Unix-socket peers' grants by uid, bearer tokens, and whether the daemon's own uid names
  // its tenant (as an admin).
  std::map<uint32_t, Grant> unix_peers;
  std::vector<Token> tokens;
  // mTLS client certificates' subjects (RFC 2253) and their grants.
  std::map<std::string, Grant> cert_subjects;
  // TLS for TCP listeners; cert_file empty: none (then tcp_plaintext must be on for TCP).
  struct Tls {
    std::string cert_file, key_file, client_ca_file;
    uint32_t refresh_s = 1;
  };
  Tls tls;
  bool tcp_plaintext = false;
  // Whether some listener is TCP (tcp_listen, or a HOST:PORT listen).
  bool has_tcp() const { return !tcp_listen.empty() || listen.rfind("unix:", 0) != 0; }
  bool same_uid_by_metadata = true;
  // Segments unnamed (memfd: every worker maps them by descriptor) rather than files of
  // /dev/shm; config segment_memory, whose "auto" is memfd when same_uid_by_metadata is off.
  bool memfd_segments = false;
  // Complete: no zero fields.
  v1::SessionPolicy default_policy;
};

// The default configuration with every field set, as --print_default_config prints it.
v1::Config DefaultConfig();

// Parses protobuf text format. INVALID_ARGUMENT carries line:column and the parser's words.
absl::StatusOr<v1::Config> ParseConfigText(const std::string& text);

// Checks every field; INVALID_ARGUMENT names the first bad field and its value.
absl::StatusOr<ServerOptions> Validate(const v1::Config& config);

// What the command line asked for.
struct CommandLine {
  v1::Config config;  // file (if any) with flags applied over it
  bool print_default_config = false;
  bool help = false;
  bool version = false;
};

// Reads `--config FILE` first, then applies every other `--name value` or `--name=value`
// over it, where `name` is a Config field. INVALID_ARGUMENT on an unknown flag, a missing
// value, an unreadable file or a value of the wrong type.
absl::StatusOr<CommandLine> ParseCommandLine(const std::vector<std::string>& args);

// Usage text listing every flag.
std::string Usage();

}  // namespace kvtier

#endif  // KVTIER_SERVER_CONFIG_CONFIG_H_
