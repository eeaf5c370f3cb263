#include "server/rpc/daemon.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/health_check_service_interface.h"
#include "server/common/check.h"
#include "server/common/log.h"
#include "server/common/mutex.h"
#include "server/common/size.h"
#include "server/common/status_macros.h"
#include "server/rpc/tls.h"

namespace kvtier {
namespace {

// After the drain, how long calls arriving at a daemon with nothing in flight get to be answered
// UNAVAILABLE before its connections are cut (Shutdown below).
constexpr absl::Duration kIdleShutdownGrace = absl::Milliseconds(200);

// The server for connections served apart: what gRPC may hold over all of them, and their
// largest message (a refused call's message is never read; the health check's is a few bytes).
constexpr size_t kApartRpcBufferBytes = 8 << 20;
constexpr int kApartMaxMessageBytes = 4096;

TierOptions MakeTier(const ServerOptions& o, v1::Tier tier, int gpu) {
  TierOptions t;
  t.tier = tier;
  t.instance = o.instance;
  t.capacity_bytes = tier == v1::TIER_HOST ? o.host_capacity : o.device_capacity;
  t.segment_bytes = o.segment_size;
  t.retain_bytes = o.retained_segment_size;
  // The device tier on a GPU: slots in its memory, exported by CUDA IPC handles. Else host
  // shared memory, through the same interface.
  const bool on_gpu = tier == v1::TIER_DEVICE && gpu >= 0;
  t.emulated = tier == v1::TIER_DEVICE && !on_gpu;
  if (on_gpu) {
    t.gpu = gpu;
    t.device_memory = [gpu](uint64_t bytes) { return AllocateGpuMemory(gpu, bytes); };
  }
  t.naming = o.memfd_segments ? ShmSegment::Naming::kMemfd : ShmSegment::Naming::kNamed;
  if (!o.quotas.empty()) {
    t.tenant_limit = [&o, tier](const std::string& tenant) {
      const ServerOptions::Quota q = o.QuotaFor(tenant);
      return tier == v1::TIER_HOST ? q.host_bytes : q.device_bytes;
    };
  }
  return t;
}

std::unique_ptr<EvictionPolicy> MakePolicy(const ServerOptions& o) {
  auto policy = MakeEvictionPolicy(o.eviction_policy, o.eviction_half_life_ms);
  CHECK(policy.ok());  // Validate checked the name
  return *std::move(policy);
}

absl::StatusOr<std::unique_ptr<RemoteStore>> ConnectRemote(const ServerOptions& o) {
  if (o.remote.empty()) return std::unique_ptr<RemoteStore>();
  return RemoteStore::Connect(o.remote, {.connections = static_cast<int>(o.remote_connections),
                                         .timeout_ms = o.remote_timeout_ms});
}

SessionEnv MakeSessionEnv(const ServerOptions& o, Tier* host, PromotionCache* host_copies,
                          PromotionCache* device_copies, LeaseTable* leases, const Clock* clock,
                          TaskPool* aging, int gpu) {
  SessionEnv env;
  env.aging = aging;
  if (gpu >= 0) {  // ingest from workers' device memory, copied on this daemon's GPU
    env.open_device_source =
        [gpu](absl::string_view handle) -> absl::StatusOr<std::unique_ptr<DeviceSource>> {
      absl::StatusOr<std::unique_ptr<GpuMapping>> m = GpuMapping::Open(gpu, handle);
      if (!m.ok()) return m.status();
      return std::unique_ptr<DeviceSource>(*std::move(m));
    };
  }
  env.max_aging_backlog_tokens = o.max_aging_backlog_tokens;
  env.host = host;
  env.host_copies = host_copies;
  env.device_copies = device_copies;
  env.leases = leases;
  env.clock = clock;
  env.lease_ttl_ms = o.lease_ttl_ms;
  env.max_lease_ms = o.max_lease_ms;
  env.max_leases_per_tenant = o.max_leases_per_tenant;
  return env;
}

std::string SocketPath(const std::string& listen) {
  return absl::StartsWith(listen, "unix:") ? listen.substr(5) : "";
}

// Writes this process's pid into the lock file `fd` holds; returns fd.
int WritePid(int fd, const std::string& path) {
  const std::string pid = absl::StrCat(getpid(), "\n");
  if (ftruncate(fd, 0) != 0 || pwrite(fd, pid.data(), pid.size(), 0) < 0) {
    KVLOG(warn, "lock.pid", "path={} error={}", LogValue(path), LogValue(std::strerror(errno)));
  }
  return fd;
}

// An exclusive flock on `path` (created 0600), with this process's pid written in it; the fd,
// or FAILED_PRECONDITION naming `flag` and the holder's pid when another process holds it.
absl::StatusOr<int> TakeLock(const std::string& path, absl::string_view flag,
                             absl::string_view what) {
  for (int attempt = 0;; ++attempt) {
    const int fd = open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (fd < 0) {
      return absl::InternalError(
          absl::StrCat(flag, ": cannot open the lock ", path, ": ", std::strerror(errno)));
    }
    if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
      char buf[32] = {};
      const ssize_t n = pread(fd, buf, sizeof buf - 1, 0);
      close(fd);
      return absl::FailedPreconditionError(absl::StrCat(
          flag, ": another kvtierd (pid ", n > 0 ? absl::StripAsciiWhitespace(buf) : "?",
          ") holds ", path, "; ", what));
    }
    // Another daemon reclaiming a dead instance unlinks its lock file while holding it; a lock
    // on the file it unlinked is no lock on the path, so take the path's file again.
    struct stat held {
    }, named{};
    if (fstat(fd, &held) == 0 && stat(path.c_str(), &named) == 0 && held.st_dev == named.st_dev &&
        held.st_ino == named.st_ino) {
      return WritePid(fd, path);
    }
    close(fd);
    if (attempt == 8) {
      return absl::InternalError(
          absl::StrCat(flag, ": the lock ", path, " was replaced 8 times while being taken"));
    }
  }
}

// The segments of every other instance whose daemon is dead: its lock in /dev/shm is free
// (the kernel let go of it when the process died, SIGKILL included), so nothing maps them
// any more but workers that already did, whose mappings outlive the names. The lock file goes
// too, unlinked while it is held: a daemon of that instance starting meanwhile finds that the
// file it locked is no longer the path's and takes the lock again (TakeLock), so two never
// both believe they hold it. /dev/shm is read once for the locks and once for the segments,
// however many dead instances it holds.
void ReclaimDeadInstances(const std::string& own) {
  DIR* dir = opendir("/dev/shm");
  if (dir == nullptr) return;
  std::vector<std::string> locks;
  while (dirent* e = readdir(dir)) {
    const absl::string_view name(e->d_name);
    if (!absl::StartsWith(name, "kvtier-") || !absl::EndsWith(name, ".lock")) continue;
    const std::string instance(name.substr(7, name.size() - 7 - 5));
    if (instance == own || instance.empty()) continue;
    locks.emplace_back(name);
  }
  closedir(dir);
  std::vector<int> held;
  std::vector<std::string> prefixes, instances;
  for (const std::string& name : locks) {
    const std::string path = absl::StrCat("/dev/shm/", name);
    const int fd = open(path.c_str(), O_RDWR | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0) continue;
    if (flock(fd, LOCK_EX | LOCK_NB) != 0) {  // a live daemon's
      close(fd);
      continue;
    }
    const std::string instance = name.substr(7, name.size() - 7 - 5);
    for (v1::Tier t : {v1::TIER_HOST, v1::TIER_DEVICE})
      prefixes.push_back(Tier::ShmPrefixOf(instance, t));
    instances.push_back(instance);
    held.push_back(fd);
  }
  // Removed under their locks: none of those instances can start meanwhile.
  const int n = ShmSegment::RemoveStale(prefixes);
  if (n > 0) {
    KVLOG(warn, "shm.reclaimed", "instances={} removed={}", LogValue(absl::StrJoin(instances, ",")),
          n);
  }
  for (size_t i = 0; i < held.size(); ++i) {
    unlink(absl::StrCat("/dev/shm/kvtier-", instances[i], ".lock").c_str());
    close(held[i]);
  }
}

}  // namespace

absl::StatusOr<Daemon::DeviceChoice> Daemon::ChooseDevice(const std::string& device) {
  auto emulated = [](absl::string_view why) {
    DeviceChoice c;
    c.why_emulated = std::string(why);
    return c;
  };
  auto gpu = [](int n, GpuInfo info) {
    DeviceChoice c;
    c.gpu = n;
    c.info = std::move(info);
    return c;
  };
  if (device == "emulated") return emulated("--device emulated");
  absl::StatusOr<std::vector<GpuInfo>> gpus = ProbeGpus();
  if (device == "auto") {
    if (!gpus.ok()) return emulated(gpus.status().message());
    return gpu(0, gpus->front());
  }
  int n = 0;
  CHECK(absl::SimpleAtoi(device, &n));  // Validate checked it
  if (!gpus.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("device: ", device, " names a CUDA device, and this process can use none (",
                     gpus.status().message(), "); --device auto or emulated uses host memory"));
  }
  if (n >= static_cast<int>(gpus->size())) {
    return absl::FailedPreconditionError(absl::StrCat("device: ", device, " names CUDA device ", n,
                                                      "; this machine has ", gpus->size(), " (0..",
                                                      gpus->size() - 1, ")"));
  }
  return gpu(n, (*gpus)[n]);
}

Daemon::Daemon(const ServerOptions& options, DeviceChoice device, const Clock* clock)
    : options_(options),
      device_choice_(std::move(device)),
      host_(MakeTier(options_, v1::TIER_HOST, -1)),
      device_(MakeTier(options_, v1::TIER_DEVICE, device_choice_.gpu)),
      host_copies_(&host_, clock, MakePolicy(options_),
                   {.half_life_ms = options_.eviction_half_life_ms}),
      device_copies_(&device_, clock, MakePolicy(options_),
                     {.half_life_ms = options_.eviction_half_life_ms}),
      remote_(ConnectRemote(options_)),
      leases_(clock),
      prefetcher_(options_.prefetch ? std::make_unique<Prefetcher>() : nullptr),
      staging_(absl::StrCat("kvtier-", options_.instance), options_.max_staging_size),
      aging_(std::make_unique<TaskPool>(TaskPool::Options{
          .threads = static_cast<int>(std::max(1u, options_.aging_threads
                                                       ? options_.aging_threads
                                                       : std::thread::hardware_concurrency())),
          .nice = TaskPool::kBackgroundNice,
          .idle_priority = true,
          .idle_only_if_boostable = true,
          .pressable = true,
          .name = "kvtier-aging"})),
      sessions_(options_,
                MakeSessionEnv(options_, &host_, &host_copies_, &device_copies_, &leases_, clock,
                               aging_.get(), device_choice_.gpu),
                remote_.ok() ? remote_->get() : nullptr),
      auth_(options_, getuid()),
      service_(ServiceEnv{.sessions = &sessions_,
                          .leases = &leases_,
                          .host = &host_,
                          .device = &device_,
                          .host_copies = &host_copies_,
                          .device_copies = &device_copies_,
                          .metrics = &metrics_,
                          .prefetcher = prefetcher_.get(),
                          .on_drain = [this] { RequestShutdown(); },
                          .max_message_bytes = options_.max_message_size,
                          .lease_ttl_ms = options_.lease_ttl_ms,
                          .metric_tenants = MetricTenants(options_),
                          .unix_peer =
                              [this](absl::string_view peer) {
                                const UnixListener* l =
                                    serving_listener_.load(std::memory_order_acquire);
                                return l ? l->Lookup(peer) : std::nullopt;
                              },
                          .auth = &auth_,
                          .fds_of = [this] { return fds_.get(); },
                          .channels_of = [this] { return channels_.get(); },
                          .staging = &staging_,
                          .max_import_bytes = options_.max_import_size,
                          .transfer_idle_timeout_ms = options_.transfer_idle_timeout_ms}) {}

absl::StatusOr<std::unique_ptr<Daemon>> Daemon::Start(const ServerOptions& options,
                                                      const Clock* clock) {
  ASSIGN_OR_RETURN(DeviceChoice device, ChooseDevice(options.device));
  auto d = std::unique_ptr<Daemon>(new Daemon(options, std::move(device), clock));
  const ServerOptions& o = d->options_;
  // Nothing is touched before both locks are held: a second daemon of this instance, or on
  // this socket, refuses to start and leaves the first one's segments and socket alone.
  ASSIGN_OR_RETURN(const int instance_lock,
                   TakeLock(absl::StrCat("/dev/shm/kvtier-", o.instance, ".lock"), "instance",
                            "pick another --instance"));
  d->instance_lock_.Reset(instance_lock);
  const std::string sock = SocketPath(o.listen);
  if (!sock.empty()) {
    ASSIGN_OR_RETURN(const int socket_lock,
                     TakeLock(absl::StrCat(sock, ".lock"), "listen", "it serves this socket"));
    d->socket_lock_.Reset(socket_lock);
    struct stat st {};
    if (lstat(sock.c_str(), &st) == 0) {
      if (!S_ISSOCK(st.st_mode)) {
        return absl::FailedPreconditionError(
            absl::StrCat("listen: ", sock, " exists and is not a socket; it is not removed"));
      }
      unlink(sock.c_str());  // a killed daemon's: its lock is free, so it is gone
    }
    const std::string fds = sock + ".fds";
    if (lstat(fds.c_str(), &st) == 0 && S_ISSOCK(st.st_mode)) unlink(fds.c_str());
  }
  if (!d->remote_.ok()) return d->remote_.status();
  if (*d->remote_) KVLOG(info, "remote.connected", "address={}", o.remote);
  // The instance's lock is free, so whoever made its segments is dead.
  const int stale = ShmSegment::RemoveStale({d->host_.ShmPrefix(), d->device_.ShmPrefix()});
  if (stale > 0) KVLOG(warn, "shm.stale", "instance={} removed={}", o.instance, stale);
  ReclaimDeadInstances(o.instance);
  // Each slot's pages are committed when it is handed out, so a /dev/shm smaller than the
  // tiers makes appends RESOURCE_EXHAUSTED once it fills; say so at start. (Unnamed segments
  // are not held to /dev/shm's size.)
  struct statvfs fs {};
  const uint64_t tiers = o.host_capacity + o.device_capacity;
  if (!o.memfd_segments && statvfs("/dev/shm", &fs) == 0 &&
      uint64_t{fs.f_bavail} * fs.f_frsize < tiers) {
    KVLOG(warn, "shm.small", "dev_shm_free={} tier_capacity={}",
          FormatBytes(uint64_t{fs.f_bavail} * fs.f_frsize), FormatBytes(tiers));
  }

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  if (!o.tls.cert_file.empty()) {
    ASSIGN_OR_RETURN(d->tls_, TlsStage::Create(o.tls));
  }
  grpc::ServerBuilder builder;
  int tcp_port = 0;
  // Calls the TLS listeners refuse at their headers, logged and counted by the service.
  const RefusedCall refused = [service = &d->service_](absl::string_view method,
                                                       const absl::Status& why) {
    service->RecordRefused(method, why);
  };
  if (sock.empty()) {
    builder.AddListeningPort(o.listen, TcpCredentials(d->tls_.get(), &d->auth_, refused),
                             &tcp_port);
  } else {  // accepted by the listener, which knows each connection's peer
    ASSIGN_OR_RETURN(d->listener_, UnixListener::Bind(sock));
    d->owns_socket_ = true;
    KvTierService* service = &d->service_;
    LeaseTable* leases = &d->leases_;
    d->channels_ = std::make_unique<ChannelHub>(
        absl::StrCat("kvtier-", o.instance),
        ChannelHub::Hooks{
            .serve = [service](const ChannelHub::Call& call,
                               std::string* out) { return service->ServeChannel(call, out); },
            .attach = [leases](const std::string& tenant) { return leases->Attach(tenant); },
            .detach = [leases](const std::string& worker) { leases->Detach(worker); }},
        o.channel_colocate);
    ASSIGN_OR_RETURN(
        d->fds_,
        FdChannel::Start(sock + ".fds", [raw = d.get()](const std::string& tenant, uint64_t id,
                                                        FdChannel::Grant grant, size_t index) {
          if (grant == FdChannel::Grant::kStaging) return raw->staging_.OpenWritable(id, tenant);
          if (grant == FdChannel::Grant::kChannel) return raw->channels_->OpenFd(id, tenant, index);
          absl::StatusOr<int> fd = raw->host_.OpenReadOnly(id, tenant);
          return fd.ok() ? fd : raw->device_.OpenReadOnly(id, tenant);
        }));
  }
  if (!o.tcp_listen.empty()) {
    builder.AddListeningPort(o.tcp_listen, TcpCredentials(d->tls_.get(), &d->auth_, refused));
  }
  // gRPC's memory over every connection, bounded: past it, gRPC cancels calls and reads less.
  // A message is held whole before its handler sees it (a unary request, each message of a
  // stream), so without a bound callers sending many large messages at once, or holding each
  // half sent, would grow the daemon without limit before any of kvtier's own checks ran.
  grpc::ResourceQuota quota("kvtierd");
  quota.Resize(static_cast<size_t>(o.RpcBufferBytes()));
  builder.SetResourceQuota(quota);  // the server holds its own reference
  builder.SetMaxReceiveMessageSize(static_cast<int>(o.max_message_size));
  builder.SetMaxSendMessageSize(static_cast<int>(o.max_message_size));
  builder.RegisterService(&d->service_);
  // Calls reach the service on gRPC's threads, through its own (uninstrumented) queues, which
  // may have started for another server in this process: the service's calls acquire this.
  KVTIER_TSAN_RELEASE(&d->service_);
  d->server_ = builder.BuildAndStart();
  if (d->server_ == nullptr) {
    return absl::UnavailableError(absl::StrCat("listen: cannot serve on ", o.listen,
                                               o.tcp_listen.empty() ? "" : " or " + o.tcp_listen,
                                               " (address in use or not permitted)"));
  }
  if (d->listener_) {
    RETURN_IF_ERROR(d->ServeUnixSocket());
  }
  d->server_->GetHealthCheckService()->SetServingStatus(true);
  if (o.metrics_port != 0) {
    // Ready (/readyz) until the drain starts; alive (/healthz) until the process ends.
    auto exporter =
        metrics::HttpExporter::Start(o.metrics_bind, static_cast<int>(o.metrics_port), &d->metrics_,
                                     [raw = d.get()] { return !raw->service_.draining(); });
    if (!exporter.ok()) return exporter.status();
    d->exporter_ = *std::move(exporter);
  }
  if (const DeviceChoice& dev = d->device_choice_; dev.gpu >= 0) {
    KVLOG(info, "device.tier", "mode=cuda device={} name={} memory={} compute={}.{} pci={}",
          dev.gpu, LogValue(dev.info.name), FormatBytes(dev.info.memory_bytes),
          dev.info.compute_major, dev.info.compute_minor, LogValue(dev.info.pci_bus_id));
  } else {
    KVLOG(info, "device.tier", "mode=emulated reason={}", LogValue(dev.why_emulated));
  }
  d->RegisterGauges();
  d->reaper_ = std::thread([raw = d.get()] { raw->Reap(); });
  if (d->sessions_.persisting()) d->persister_ = std::thread([raw = d.get()] { raw->Persist(); });
  KVLOG(info, "daemon.start",
        "version={} listen={} tcp_listen={} tcp={} instance={} segments={} host_capacity={} "
        "device_capacity={} device={} remote={} aging_threads={} aging_priority={} "
        "eviction_policy={} prefetch={} channel_colocate={} max_rpc_buffer_size={} "
        "max_connections_per_uid={} metrics_port={}",
        KVTIER_VERSION, LogValue(o.listen), LogValue(o.tcp_listen),
        !o.has_tcp()                   ? "none"
        : o.tls.cert_file.empty()      ? "plaintext"
        : o.tls.client_ca_file.empty() ? "tls"
                                       : "mtls",
        o.instance, o.memfd_segments ? "memfd" : "named", o.host_capacity, o.device_capacity,
        d->DeviceName(), o.remote.empty() ? "none" : "redis", d->aging_->threads(),
        d->aging_->idle() ? "idle" : "nice10", o.eviction_policy, o.prefetch ? "on" : "off",
        o.channel_colocate ? "on" : "off", o.RpcBufferBytes(), o.max_connections_per_uid,
        o.metrics_port);
  return d;
}

absl::Status Daemon::ReloadTls() {
  if (tls_ == nullptr) return absl::OkStatus();
  return tls_->Reload();
}

absl::Status Daemon::ServeUnixSocket() {
  // Uids the config grants nothing can only be refused, so their connections are served by a
  // server of their own, as small as that needs: they cannot fill the daemon's transport
  // bound, or make gRPC reset other callers' calls to stay under it.
  grpc::ServerBuilder apart;
  grpc::ResourceQuota apart_quota("kvtierd-apart");
  apart_quota.Resize(kApartRpcBufferBytes);
  apart.SetResourceQuota(apart_quota);
  apart.SetMaxReceiveMessageSize(kApartMaxMessageBytes);
  apart.RegisterCallbackGenericService(&apart_service_);
  KVTIER_TSAN_RELEASE(&apart_service_);  // as the service's, through gRPC's own queues
  apart_ = apart.BuildAndStart();
  if (apart_ == nullptr) {
    return absl::InternalError("listen: cannot start the server for connections served apart");
  }
  apart_->GetHealthCheckService()->SetServingStatus(true);
  serving_listener_.store(listener_.get(), std::memory_order_release);
  // Connections past a uid's bound: counted each, logged at most once a second (a flood of
  // them is one line a second, naming the uid it fell on, with the count since the last line
  // over every uid).
  metrics::Counter& refused_connections = metrics_.GetCounter(
      "kvtier_unix_connections_refused_total",
      "Unix-socket connections closed as accepted: their uid held --max_connections_per_uid");
  struct RefusalLog {
    absl::Time last = absl::InfinitePast();
    uint64_t since = 0;
  };
  auto refused = [&refused_connections, log = std::make_shared<RefusalLog>(),
                  limit = options_.max_connections_per_uid](const PeerCredentials& cred,
                                                            size_t open) {
    refused_connections.Inc();
    ++log->since;
    if (const absl::Time now = absl::Now(); now - log->last >= absl::Seconds(1)) {
      KVLOG(warn, "listen.refused",
            "uid={} pid={} open={} limit={} refused_since_last_line={} "
            "field=max_connections_per_uid",
            cred.uid, cred.pid, open, limit, log->since);
      log->last = now;
      log->since = 0;
    }
  };
  listener_->Serve(server_.get(),
                   UnixListener::ConnectionLimit{.per_uid = options_.max_connections_per_uid,
                                                 .exempt = getuid(),
                                                 .refused = std::move(refused)},
                   UnixListener::Apart{.server = apart_.get(), .uid = [auth = &auth_](uid_t uid) {
                                         return auth->GrantsNothingTo(uid);
                                       }});
  return absl::OkStatus();
}

void Daemon::RegisterGauges() {
  // Always 1; its labels say what runs, for joins in queries and dashboards.
  metrics_
      .GetGauge("kvtier_build_info", "kvtierd's version and the backends it runs with (always 1)",
                {{"version", KVTIER_VERSION},
                 {"segments", options_.memfd_segments ? "memfd" : "named"},
                 {"device", DeviceName()},
                 {"remote", options_.remote.empty() ? "none" : "redis"}})
      .Set(1);
  metrics_.OnScrape([this] {
    for (const Tier* t : {&host_, &device_}) {
      TierSnapshot s = t->Stats();
      metrics::Labels l{{"tier", TierShortName(s.tier)}};
      metrics_.GetGauge("kvtier_tier_capacity_bytes", "Tier capacity", l).Set(s.capacity_bytes);
      metrics_.GetGauge("kvtier_tier_used_bytes", "Bytes of allocated slots", l).Set(s.used_bytes);
      metrics_
          .GetGauge("kvtier_tier_metadata_bytes",
                    "Heap bytes of session metadata charged to the tier beside its slots", l)
          .Set(s.metadata_bytes);
      metrics_.GetGauge("kvtier_tier_occupancy_ratio", "(used + metadata) / capacity", l)
          .Set(s.capacity_bytes
                   ? static_cast<double>(s.used_bytes + s.metadata_bytes) / s.capacity_bytes
                   : 0.0);
      metrics_.GetGauge("kvtier_tier_pinned_bytes", "Bytes pinned by leases", l)
          .Set(s.pinned_bytes);
      metrics_.GetGauge("kvtier_tier_chunks", "Slots allocated", l).Set(s.num_slots);
      metrics_.GetGauge("kvtier_tier_segments", "Shared-memory segments mapped", l)
          .Set(s.num_segments);
      metrics_
          .GetGauge("kvtier_tier_retained_bytes",
                    "Committed bytes of emptied segments kept for reuse", l)
          .Set(s.retained_bytes);
      metrics_
          .GetCounter("kvtier_tier_allocation_failures_total",
                      "Allocations refused (tier full or shm error)", l)
          .IncreaseTo(s.allocation_failures);
    }
    for (const PromotionCache* c : {&host_copies_, &device_copies_}) {
      const PromotionCache::Counters n = c->counters();
      metrics::Labels l{{"tier", TierShortName(c->tier()->options().tier)},
                        {"policy", c->policy().name()}};
      metrics_.GetGauge("kvtier_cache_copies", "Promoted fp16 copies cached on the tier", l)
          .Set(static_cast<double>(c->size()));
      metrics_.GetCounter("kvtier_cache_hits_total", "Selected chunks whose copy was cached", l)
          .IncreaseTo(n.hits);
      metrics_.GetCounter("kvtier_cache_misses_total", "Selected chunks promoted on demand", l)
          .IncreaseTo(n.misses);
      metrics_.GetCounter("kvtier_cache_evictions_total", "Copies evicted to make room", l)
          .IncreaseTo(n.evictions);
      // The tier's view of the same: copies made on it, and copies that left it.
      metrics::Labels tl{{"tier", TierShortName(c->tier()->options().tier)}};
      metrics_.GetCounter("kvtier_tier_promotions_total", "Chunks copied into the tier", tl)
          .IncreaseTo(n.promotions);
      metrics_.GetCounter("kvtier_tier_evictions_total", "Chunks moved out of the tier", tl)
          .IncreaseTo(n.evictions + n.drops);
      metrics_.GetCounter("kvtier_prefetched_total", "Copies promoted ahead of a Select", l)
          .IncreaseTo(n.prefetched);
      metrics_
          .GetCounter("kvtier_prefetch_hits_total", "Prefetched copies that a later Select read", l)
          .IncreaseTo(n.prefetch_hits);
    }
    if (channels_) {
      metrics_.GetGauge("kvtier_channels_open", "Shared-memory Select channels open")
          .Set(static_cast<double>(channels_->open_channels()));
      const ChannelHub::Counters n = channels_->counters();
      const char* help =
          "Select channel calls answered, by where the channel's thread was: on the CPU the "
          "worker called from (--channel_colocate) or elsewhere";
      metrics_.GetCounter("kvtier_channel_calls_total", help, {{"served", "beside_worker"}})
          .IncreaseTo(n.beside_worker);
      metrics_.GetCounter("kvtier_channel_calls_total", help, {{"served", "elsewhere"}})
          .IncreaseTo(n.elsewhere);
    }
    if (prefetcher_) {
      const Prefetcher::Counters p = prefetcher_->counters();
      metrics_.GetCounter("kvtier_prefetch_tasks_total", "Prefetches run after a Select")
          .IncreaseTo(p.tasks);
      metrics_.GetCounter("kvtier_prefetch_dropped_total", "Prefetches dropped, queue full")
          .IncreaseTo(p.dropped);
      metrics_
          .GetCounter("kvtier_prefetch_failed_total",
                      "Prefetches that ended early (full tier, closed session)")
          .IncreaseTo(p.failed);
    }
    {
      const TaskPool::Counters a = aging_->counters();
      metrics_.GetCounter("kvtier_aging_tasks_total", "Aging passes the aging pool ran")
          .IncreaseTo(a.tasks);
      metrics_
          .GetCounter("kvtier_aging_pressed_tasks_total",
                      "Aging passes run by the pool's nice-priority threads, while an append "
                      "waited on its session's aging backlog")
          .IncreaseTo(a.pressed);
      metrics_
          .GetGauge("kvtier_aging_queued",
                    "Aging tasks waiting for the pool (one per session layer with un-aged tokens)")
          .Set(static_cast<double>(a.queued));
      uint64_t backlog = 0;
      for (const std::shared_ptr<Session>& s : sessions_.List())
        backlog += s->aging_backlog_tokens();
      metrics_
          .GetGauge("kvtier_aging_backlog_tokens",
                    "Tokens appended but not yet aged, summed over sessions and layers")
          .Set(static_cast<double>(backlog));
    }
    if (sessions_.has_remote()) {
      const SessionManager::RemoteCounters r = sessions_.remote_counters();
      metrics_.GetCounter("kvtier_remote_demotions_total", "Sessions moved to the remote tier")
          .IncreaseTo(r.demotions);
      metrics_.GetCounter("kvtier_remote_demoted_bytes_total", "Record bytes written to it")
          .IncreaseTo(r.demoted_bytes);
      metrics_.GetCounter("kvtier_remote_restores_total", "Sessions restored from it")
          .IncreaseTo(r.restores);
      metrics_.GetCounter("kvtier_remote_restored_bytes_total", "Record bytes read back")
          .IncreaseTo(r.restored_bytes);
      metrics_
          .GetCounter("kvtier_remote_restore_seconds_total",
                      "Time spent restoring (divide by restores for the mean latency)")
          .IncreaseTo(r.restore_seconds);
      metrics_
          .GetCounter("kvtier_remote_corrupt_records_total",
                      "Records refused for a bad checksum or format (never served)")
          .IncreaseTo(r.corrupt);
      metrics_
          .GetCounter("kvtier_remote_lost_records_total",
                      "Sessions this daemon demoted whose record vanished from Redis (DATA_LOSS)")
          .IncreaseTo(r.lost);
    }
    metrics_.GetGauge("kvtier_sessions", "Live sessions").Set(sessions_.size());
    metrics_.GetGauge("kvtier_leases", "Live leases").Set(leases_.size());
    metrics_.GetGauge("kvtier_workers_attached", "Workers holding an Attach stream open")
        .Set(leases_.workers());
    metrics_.GetGauge("kvtier_draining", "1 while draining").Set(service_.draining() ? 1 : 0);
  });
}

// Every --persist_interval_ms, the sessions that changed go to the remote tier as snapshots;
// a session's export is taken under its lock, its put outside every lock.
void Daemon::Persist() {
  auto& sessions = metrics_.GetCounter("kvtier_persisted_sessions_total",
                                       "Session snapshots stored by write-behind");
  auto& bytes = metrics_.GetCounter("kvtier_persisted_bytes_total",
                                    "Bytes of session snapshots stored by write-behind");
  auto& failed = metrics_.GetCounter("kvtier_persist_failures_total",
                                     "Session snapshots the remote tier refused");
  const absl::Duration every = absl::Milliseconds(options_.persist_interval_ms);
  while (!shutdown_requested_.WaitForNotificationWithTimeout(every)) {
    // A pass stops at a shutdown (each put may wait on a hung Redis): the drain that follows
    // does not wait for the rest of it.
    const SessionManager::PersistCounts n =
        sessions_.PersistChanged([this] { return shutdown_requested_.HasBeenNotified(); });
    sessions.Inc(static_cast<double>(n.sessions));
    bytes.Inc(static_cast<double>(n.bytes));
    failed.Inc(static_cast<double>(n.failed));
  }
}

void Daemon::Reap() {
  auto& expired = metrics_.GetCounter("kvtier_leases_expired_total", "Leases ended by their TTL");
  while (!shutdown_requested_.WaitForNotificationWithTimeout(absl::Milliseconds(100))) {
    if (int n = leases_.ExpireDue(); n > 0) expired.Inc(n);
    service_.EndIdleTransfers();
  }
}

void Daemon::RequestShutdown() {
  MutexLock lock(&mu_);
  if (!shutdown_requested_.HasBeenNotified()) shutdown_requested_.Notify();
}

void Daemon::WaitForShutdownRequest() { shutdown_requested_.WaitForNotification(); }

void Daemon::StartDrain() {
  if (service_.draining()) return;
  service_.StartDraining();
  if (server_) server_->GetHealthCheckService()->SetServingStatus(false);
  if (apart_) apart_->GetHealthCheckService()->SetServingStatus(false);
}

void Daemon::Shutdown() {
  {
    MutexLock lock(&mu_);
    if (stopped_) return;
    stopped_ = true;
    if (!shutdown_requested_.HasBeenNotified()) shutdown_requested_.Notify();
  }
  StartDrain();
  // Calls in flight get the drain timeout; new ones are already answered UNAVAILABLE by the
  // service, which gRPC's own shutdown (below) would answer CANCELLED instead.
  const absl::Time deadline = absl::Now() + absl::Milliseconds(options_.drain_timeout_ms);
  while (service_.in_flight() > 0 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(5));
  KVLOG(info, "daemon.drain", "sessions={} leases={} in_flight={}", sessions_.size(),
        leases_.size(), service_.in_flight());
  if (listener_) listener_->Stop();  // new connections are refused from here on
  if (apart_) {                      // its calls end as they start: nothing to wait for
    apart_->Shutdown(absl::ToChronoTime(absl::Now()));
    apart_->Wait();
  }
  if (server_) {
    // gRPC's shutdown also waits, up to its deadline, for every connection to close after its
    // GOAWAY, and an idle client that is not polling its channel (a blocking Python client
    // between calls) never reads it. Once nothing is in flight there is nothing to wait for:
    // a moment for calls racing in to get their UNAVAILABLE, then connections are cut.
    const absl::Time cut = service_.in_flight() == 0
                               ? std::min(deadline, absl::Now() + kIdleShutdownGrace)
                               : std::max(deadline, absl::Now());
    server_->Shutdown(absl::ToChronoTime(cut));
    server_->Wait();
    service_.JoinPumps();
  }
  if (reaper_.joinable()) reaper_.join();
  if (persister_.joinable()) persister_.join();
  if (sessions_.has_remote() && options_.drain_to_remote) {
    // Nobody can read a handle of this daemon's any more: its leases end, and every session
    // goes to the remote tier whole, for the next daemon on that Redis to serve.
    const int leases = leases_.EndAll();
    const SessionManager::DrainCounts n =
        sessions_.DemoteAll(absl::Now() + absl::Milliseconds(options_.drain_timeout_ms));
    KVLOG(info, "daemon.drain_to_remote", "demoted={} bytes={} failed={} left={} leases_ended={}",
          n.demoted, n.bytes, n.failed, n.left, leases);
  }
  // Only now: a liveness probe (/healthz) answered throughout the drain, the sessions' trip to
  // the remote tier included, and the metrics showed it.
  exporter_.reset();
  if (channels_) channels_->Stop();  // each worker sees its channel hang up
  sessions_.CloseAll();
  fds_.reset();  // stops handing out descriptors, removes <socket>.fds
  const std::string sock = SocketPath(options_.listen);
  if (owns_socket_) unlink(sock.c_str());
  owns_socket_ = false;
  KVLOG(info, "daemon.stop", "instance={}", options_.instance);
}

Daemon::~Daemon() { Shutdown(); }

}  // namespace kvtier
