// Select RPC latency over the Unix socket against a bare Echo RPC carrying the same bytes
// (request: the query; response: as many bytes as the Select response) on the same channel,
// interleaved so both see the same machine. Prints p50 and p99 ratios (median over reps), for
// whole-chunk selection (refine_factor 1), with the bytes inline, and with the default
// token-level refinement (refine_factor 8), its rows gathered into compact blocks
// (select_rpc_p50_refined) or named in place (row_handles: select_rpc_p50_refined_rows).
// Each Select parses into one response reused call after call (Client::Select's second form),
// as a decode loop does; select_rpc_p50_fresh_response is the first form's (a response of its
// own every call, its handles allocated and freed each time), in the same loop.
// select_shm_p50/p99: the same whole-chunk Select through a shared-memory Select channel
// (OpenChannel), its answers parsed into one response reused as a decode loop would, each
// after an Echo RPC and a wait in the worker past the channel thread's watch for a next call
// (so it finds the thread asleep), in a loop of their own (that watch would hold a core while
// the gRPC calls are timed), against the gRPC loop's Echo figures. The daemon runs with its
// defaults, so the channel's thread waits on the worker's CPU (--channel_colocate on): the
// call is handed over on that core, with no other core woken.
//
// select_shm_p50_back_to_back: channel Selects one after another (the decode loop's pattern)
// against Echo RPCs one after another.
//
// select_scaling: gRPC Select throughput of two worker processes at once, each with its own
// gRPC connection and session, against one worker process alone (a fleet's workers are
// processes of their own), each Select ending the previous one's lease (release_lease_ids) as
// a decode loop's next step does, one call a Select. select_scaling_shm: the same through a
// Select channel each (the decode loop's path), where gRPC's own scaling is not in the way.
//
// decode_step_kvtier_ms: what kvtier adds to one decoded token, 30 sequential layer Selects
// (each ending the previous one's lease: release_lease_ids) through a Select channel, at 4K
// and 32K tokens, against the
// worker's own exact attention of the same 30 layers over the whole context (fp32 arithmetic
// on fp16 K and V held in its memory). `select_bench --decode_tokens 65536,131072` measures it
// alone at other contexts. `select_bench --daemon_flags "--channel_colocate off"` runs it all
// against a daemon with more flags (named in each figure's parameters).
#include <sched.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "bench/bench_util.h"
#include "kvtier/client.h"
#include "server/common/fp16.h"
#include "server/rpc/select_channel.h"

using namespace kvtier;
using namespace kvtier::bench;

namespace {

constexpr int kLayers = 30, kQ = 9, kKv = 3, kD = 64;  // SmolLM2-135M

// Flags the daemon gets beyond the bench's own (--daemon_flags), named in every figure's
// parameters when there are any.
std::string daemon_flags;
void NameDaemonFlags(std::map<std::string, std::string>* params) {
  if (!daemon_flags.empty()) (*params)["daemon_flags"] = daemon_flags;
}

// A Select of the middle layer with a fixed random query.
v1::SelectRequest Request(const std::string& sid, uint32_t budget) {
  std::mt19937 rng(1);
  std::normal_distribution<float> n(0, 1);
  std::vector<float> q(kQ * kD);
  for (auto& x : q) x = n(rng);
  v1::SelectRequest req;
  req.set_session_id(sid);
  req.set_layer(kLayers / 2);
  req.set_query(std::string(reinterpret_cast<const char*>(q.data()), q.size() * 4));
  req.set_budget_tokens(budget);
  return req;
}

// The bytes of this Select's response (one Select, released): what its Echo carries back.
uint32_t ResponseBytes(Client& c, const v1::SelectRequest& req) {
  auto probe = c.Select(req);
  if (!probe.ok()) {
    std::fprintf(stderr, "select: %s\n", std::string(probe.status().message()).c_str());
    std::exit(1);
  }
  (void)c.Release(probe->lease_id());
  return static_cast<uint32_t>(probe->ByteSizeLong());
}

// One Select through `channel`, timed (in microseconds), then its Release. Into one response
// reused call after call, as a decode loop does (SelectChannel::Select's second form).
double ChannelSelectUs(SelectChannel* channel, const v1::SelectRequest& req,
                       v1::SelectResponse* resp) {
  const double t0 = NowSeconds();
  const absl::Status s = channel->Select(req, resp);
  const double t1 = NowSeconds();
  if (!s.ok()) std::exit(1);
  (void)channel->Release(resp->lease_id());
  return (t1 - t0) * 1e6;
}

void Run(Client& c, const std::string& sid, int context, uint32_t budget, bool include_data,
         bool row_handles, const std::string& mode, const std::string& suffix, int reps, int iters,
         SelectChannel* channel = nullptr) {
  v1::SelectRequest req = Request(sid, budget);
  req.set_include_data(include_data);
  req.set_row_handles(row_handles);
  const uint32_t resp_bytes = ResponseBytes(c, req);
  std::vector<double> p50_ratio, p99_ratio, sel50, echo50, sel99, echo99, shm50, shm99, fresh50;
  v1::SelectResponse resp;
  for (int r = 0; r < reps; ++r) {
    std::vector<double> sel, echo, shm, fresh;
    for (int i = 0; i < iters + 50; ++i) {
      double t0 = NowSeconds();
      const absl::Status s = c.Select(req, &resp);
      double t1 = NowSeconds();
      auto e = c.Echo(req.query(), resp_bytes);
      double t2 = NowSeconds();
      if (!s.ok() || !e.ok()) std::exit(1);
      (void)c.Release(resp.lease_id());
      const double t3 = NowSeconds();
      auto own = c.Select(req);  // the first form: a response of its own
      const double t4 = NowSeconds();
      if (!own.ok()) std::exit(1);
      (void)c.Release(own->lease_id());
      if (i >= 50) {  // warm-up
        sel.push_back((t1 - t0) * 1e6);
        echo.push_back((t2 - t1) * 1e6);
        fresh.push_back((t4 - t3) * 1e6);
      }
    }
    // The channel's Selects in a loop of their own (its thread's watch for a next call after
    // each answer would otherwise hold one of the cores while the gRPC calls above are timed),
    // each after an Echo RPC and as much work in the worker as the thread's watch lasts: the
    // call finds the thread asleep, as a worker's call after its layer's attention does.
    for (int i = 0; channel != nullptr && i < iters + 50; ++i) {
      if (!c.Echo(req.query(), resp_bytes).ok()) std::exit(1);
      for (const double until = NowSeconds() + 2e-6 * ChannelHub::kSpinUs; NowSeconds() < until;) {
      }
      const double us = ChannelSelectUs(channel, req, &resp);
      if (i >= 50) shm.push_back(us);
    }
    sel50.push_back(Quantile(sel, 0.5));
    fresh50.push_back(Quantile(fresh, 0.5));
    echo50.push_back(Quantile(echo, 0.5));
    sel99.push_back(Quantile(sel, 0.99));
    echo99.push_back(Quantile(echo, 0.99));
    shm50.push_back(Quantile(shm, 0.5));
    shm99.push_back(Quantile(shm, 0.99));
    p50_ratio.push_back(sel50.back() / echo50.back());
    p99_ratio.push_back(sel99.back() / echo99.back());
  }
  std::map<std::string, std::string> params = {{"context_tokens", std::to_string(context)},
                                               {"budget_tokens", std::to_string(budget)},
                                               {"include_data", include_data ? "true" : "false"},
                                               {"selection", mode},
                                               {"response_bytes", std::to_string(resp_bytes)},
                                               {"shape", "30x9/3x64"},
                                               {"reps", std::to_string(reps)},
                                               {"iters", std::to_string(iters)},
                                               {"client", "one response reused"},
                                               {"target_ratio", "1.3"}};
  NameDaemonFlags(&params);
  // value/baseline: medians over reps of each rep's quantile; ratio printed = value/baseline.
  Print({"select_rpc_p50" + suffix, Median(sel50), "us", Median(echo50), "echo_rpc_p50", params});
  Print({"select_rpc_p99" + suffix, Median(sel99), "us", Median(echo99), "echo_rpc_p99", params});
  params["client"] = "a response of its own every call";
  Print({"select_rpc_p50_fresh_response" + suffix, Median(fresh50), "us", Median(echo50),
         "echo_rpc_p50", params});
  params.erase("client");
  if (channel == nullptr) return;
  params["target_ratio"] = "0.25";
  params["path"] =
      "shared-memory Select channel (OpenChannel), one response reused, its thread held on the "
      "worker's CPU (--channel_colocate on, the default); the echo is the gRPC one";
  Print({"select_shm_p50" + suffix, Median(shm50), "us", Median(echo50), "echo_rpc_p50", params});
  Print({"select_shm_p99" + suffix, Median(shm99), "us", Median(echo99), "echo_rpc_p99", params});
}

// The decode loop's pattern: `iters` channel Select+Release pairs one after another (the
// channel's thread finds each call while it still watches for the next), against `iters`
// gRPC Echo calls of the same bytes one after another; `reps` rounds alternate the two, and
// each figure is the median over rounds of a round's quantile. The interleaved figures above
// catch the channel's thread asleep after each gRPC call; these do not.
void BackToBack(Client& c, const std::string& sid, uint32_t budget, int reps, int iters,
                SelectChannel* channel) {
  const v1::SelectRequest req = Request(sid, budget);
  const uint32_t resp_bytes = ResponseBytes(c, req);
  std::vector<double> shm50, shm99, echo50, echo99;
  v1::SelectResponse resp;
  for (int r = 0; r < reps; ++r) {
    std::vector<double> shm, echo;
    for (int i = 0; i < iters + 50; ++i) {
      const double us = ChannelSelectUs(channel, req, &resp);
      if (i >= 50) shm.push_back(us);
    }
    for (int i = 0; i < iters + 50; ++i) {
      const double t0 = NowSeconds();
      auto e = c.Echo(req.query(), resp_bytes);
      const double t1 = NowSeconds();
      if (!e.ok()) std::exit(1);
      if (i >= 50) echo.push_back((t1 - t0) * 1e6);
    }
    shm50.push_back(Quantile(shm, 0.5));
    shm99.push_back(Quantile(shm, 0.99));
    echo50.push_back(Quantile(echo, 0.5));
    echo99.push_back(Quantile(echo, 0.99));
  }
  std::map<std::string, std::string> params = {
      {"context_tokens", "4096"},
      {"budget_tokens", std::to_string(budget)},
      {"selection", "whole chunks"},
      {"response_bytes", std::to_string(resp_bytes)},
      {"shape", "30x9/3x64"},
      {"reps", std::to_string(reps)},
      {"iters", std::to_string(iters)},
      {"path",
       "shared-memory Select channel, calls one after another, one response reused; the echo "
       "likewise"},
      {"target_ratio", "0.25"}};
  NameDaemonFlags(&params);
  Print({"select_shm_p50_back_to_back", Median(shm50), "us", Median(echo50),
         "echo_rpc_p50_back_to_back", params});
  Print({"select_shm_p99_back_to_back", Median(shm99), "us", Median(echo99),
         "echo_rpc_p99_back_to_back", params});
}

// A worker process of Scaling (select_bench --scaling_worker
// ADDRESS,SESSION,BUDGET,ITERS,ECHO,CHANNEL_CPU): connects, warms up with 50 calls, says
// "ready", waits for a line on stdin, then times `iters` Selects, each ending the previous
// one's lease (release_lease_ids), as a decode loop's next step does (or, with `echo_bytes`
// nonzero, Echo calls carrying that many bytes back; with `channel_cpu` 0 or more, the Selects
// through a Select channel of its own, the worker held on that CPU, as an engine's worker is
// on its own; either way into one response reused) and prints the seconds they took. The last
// lease is released after the clock stops.
int ScalingWorker(const std::string& address, const std::string& sid, uint32_t budget, int iters,
                  uint32_t echo_bytes, int channel_cpu) {
  auto c = Client::Connect(address);
  if (!c.ok()) return 1;
  const v1::SelectRequest req = Request(sid, budget);
  std::unique_ptr<SelectChannel> ch;
  if (channel_cpu >= 0) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(channel_cpu, &set);
    if (sched_setaffinity(0, sizeof set, &set) != 0) return 1;
    auto opened = (*c)->OpenChannel();
    if (!opened.ok()) return 1;
    ch = *std::move(opened);
  }
  v1::SelectResponse resp;
  v1::SelectRequest next = req;  // names the previous Select's lease once there is one
  auto call = [&] {
    if (echo_bytes > 0) {
      if (!(*c)->Echo(req.query(), echo_bytes).ok()) std::exit(1);
      return;
    }
    if (!(ch != nullptr ? ch->Select(next, &resp) : (*c)->Select(next, &resp)).ok()) std::exit(1);
    next.clear_release_lease_ids();
    next.add_release_lease_ids(resp.lease_id());
  };
  for (int i = 0; i < 50; ++i) call();
  std::printf("ready\n");
  std::fflush(stdout);
  char line[16];
  if (std::fgets(line, sizeof line, stdin) == nullptr) return 1;
  const double t0 = NowSeconds();
  for (int i = 0; i < iters; ++i) call();
  std::printf("%.9f\n", NowSeconds() - t0);
  std::fflush(stdout);
  if (echo_bytes == 0)
    (void)(ch != nullptr ? ch->Release(resp.lease_id()) : (*c)->Release(resp.lease_id()));
  return 0;
}

// Calls per second of one worker process per session of `sids` (ScalingWorker), all at once:
// they start together once each is connected and warm, and the slowest one's time counts.
double ProcessThroughput(const std::string& address, const std::vector<std::string>& sids,
                         uint32_t budget, int iters, uint32_t echo_bytes, bool channel = false) {
  struct Worker {
    pid_t pid;
    FILE* to;
    FILE* from;
  };
  std::vector<Worker> workers;
  const int cpus = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  for (const std::string& sid : sids) {
    int in[2], out[2];
    if (pipe(in) != 0 || pipe(out) != 0) std::exit(1);
    const int cpu = channel ? static_cast<int>(workers.size()) % cpus : -1;
    const std::string args =
        absl::StrCat(address, ",", sid, ",", budget, ",", iters, ",", echo_bytes, ",", cpu);
    const pid_t pid = fork();
    if (pid < 0) std::exit(1);
    if (pid == 0) {  // only async-signal-safe calls until exec
      dup2(in[0], 0);
      dup2(out[1], 1);
      execl("/proc/self/exe", "select_bench", "--scaling_worker", args.c_str(), nullptr);
      _exit(127);
    }
    close(in[0]);
    close(out[1]);
    workers.push_back({pid, fdopen(in[1], "w"), fdopen(out[0], "r")});
  }
  char line[64];
  for (Worker& w : workers) {
    if (std::fgets(line, sizeof line, w.from) == nullptr) std::exit(1);  // "ready"
  }
  for (Worker& w : workers) {
    std::fputs("go\n", w.to);
    std::fflush(w.to);
  }
  double slowest = 0;
  for (Worker& w : workers) {
    if (std::fgets(line, sizeof line, w.from) == nullptr) std::exit(1);
    slowest = std::max(slowest, std::atof(line));
    std::fclose(w.to);
    std::fclose(w.from);
    int status = 0;
    if (waitpid(w.pid, &status, 0) != w.pid || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      std::exit(1);
    }
  }
  return static_cast<double>(sids.size()) * iters / slowest;
}

// Selects per second (each ending the previous one's lease) of one worker process on
// `sids[0]` and of two at once on both sessions, each worker a process with its own gRPC
// connection, doing `iters` Selects after a warm-up; interleaved over `reps`, medians printed
// (the ratio is theirs). In the parameters: the same for bare Echo calls of the same bytes
// (how far the machine and gRPC alone scale), and the ratio of two threads of one process to
// one thread (a process's threads share its gRPC client's poller, so that ratio says what one
// process's workers get).
void Scaling(Client& c, const std::string& address, const std::vector<std::string>& sids,
             int context, uint32_t budget, int reps, int iters) {
  const uint32_t resp_bytes = ResponseBytes(c, Request(sids[0], budget));
  std::vector<std::unique_ptr<Client>> clients;
  for (int w = 0; w < 2; ++w) {
    auto made = Client::Connect(address);
    if (!made.ok()) std::exit(1);
    clients.push_back(*std::move(made));
  }
  auto work = [&](int w, int n) {
    v1::SelectRequest req = Request(sids[w], budget);
    v1::SelectResponse resp;
    for (int i = 0; i < n; ++i) {
      if (!clients[w]->Select(req, &resp).ok()) std::exit(1);
      req.clear_release_lease_ids();
      req.add_release_lease_ids(resp.lease_id());
    }
    (void)clients[w]->Release(resp.lease_id());
  };
  auto threads_throughput = [&](int workers) {
    std::vector<std::thread> threads;
    const double t0 = NowSeconds();
    for (int w = 0; w < workers; ++w) threads.emplace_back(work, w, iters);
    for (std::thread& t : threads) t.join();
    return workers * iters / (NowSeconds() - t0);
  };
  work(0, 50);  // warm-up, each connection
  work(1, 50);
  const std::vector<std::string> first = {sids[0]};
  std::vector<double> one, two, echo_ratio, threads_ratio, shm_one, shm_two;
  for (int r = 0; r < reps; ++r) {
    one.push_back(ProcessThroughput(address, first, budget, iters, 0));
    two.push_back(ProcessThroughput(address, sids, budget, iters, 0));
    shm_one.push_back(ProcessThroughput(address, first, budget, iters, 0, true));
    shm_two.push_back(ProcessThroughput(address, sids, budget, iters, 0, true));
    const double echo_one = ProcessThroughput(address, first, budget, iters, resp_bytes);
    echo_ratio.push_back(ProcessThroughput(address, sids, budget, iters, resp_bytes) / echo_one);
    const double threads_one = threads_throughput(1);
    threads_ratio.push_back(threads_throughput(2) / threads_one);
  }
  std::map<std::string, std::string> params = {
      {"context_tokens", std::to_string(context)},
      {"budget_tokens", std::to_string(budget)},
      {"workers",
       "2 processes, each its own gRPC connection and session; each Select ends the previous "
       "one's lease (release_lease_ids)"},
      {"shape", "30x9/3x64"},
      {"cores", std::to_string(std::thread::hardware_concurrency())},
      {"reps", std::to_string(reps)},
      {"iters", std::to_string(iters)},
      {"echo_scaling", absl::StrFormat("%.3f", Median(echo_ratio))},
      {"threads_in_one_process_scaling", absl::StrFormat("%.3f", Median(threads_ratio))},
      {"target_ratio", "1.7"}};
  NameDaemonFlags(&params);
  Print({"select_scaling", Median(two), "selects/s", Median(one), "one_worker", params});
  params.erase("echo_scaling");
  params.erase("threads_in_one_process_scaling");
  params["workers"] =
      "2 processes, each its own Select channel (OpenChannel) and session, each held on a CPU "
      "of its own (one alone: on the first); each Select ends the previous one's lease "
      "(release_lease_ids)";
  Print(
      {"select_scaling_shm", Median(shm_two), "selects/s", Median(shm_one), "one_worker", params});
}

// Exact attention of one layer in the worker: every query head over all `n` tokens of its KV
// head (K and V fp32 [kv][n][d]); `out` [q][d].
void ExactAttention(const std::vector<float>& q, const std::vector<float>& k,
                    const std::vector<float>& v, int n, std::vector<float>* out,
                    std::vector<float>* scores) {
  const float scale = 1.0f / std::sqrt(static_cast<float>(kD));
  scores->resize(n);
  for (int h = 0; h < kQ; ++h) {
    const int g = h / (kQ / kKv);
    const float* qh = q.data() + h * kD;
    const float* kg = k.data() + size_t(g) * n * kD;
    const float* vg = v.data() + size_t(g) * n * kD;
    float peak = -1e30f;
    for (int t = 0; t < n; ++t) {
      float dot = 0;
      for (int i = 0; i < kD; ++i) dot += qh[i] * kg[size_t(t) * kD + i];
      (*scores)[t] = dot * scale;
      peak = std::max(peak, (*scores)[t]);
    }
    float sum = 0;
    for (int t = 0; t < n; ++t) sum += (*scores)[t] = std::exp((*scores)[t] - peak);
    float* o = out->data() + h * kD;
    std::fill(o, o + kD, 0.0f);
    for (int t = 0; t < n; ++t) {
      const float p = (*scores)[t] / sum;
      for (int i = 0; i < kD; ++i) o[i] += p * vg[size_t(t) * kD + i];
    }
  }
}

void DecodeStep(Client& c, int context, int steps) {
  auto s = c.CreateSession(SmolLm2Session());
  if (!s.ok()) std::exit(1);
  std::mt19937 rng(7);
  std::normal_distribution<float> n(0, 1);
  constexpr int kPart = 512;
  std::vector<float> k0(size_t(kKv) * context * kD), v0(k0.size());  // layer 0's, in fp32
  std::vector<uint16_t> keys(size_t(kKv) * kPart * kD), values(keys.size());
  for (int start = 0; start < context; start += kPart) {
    std::vector<v1::AppendKVRequest> reqs;
    for (int l = 0; l < kLayers; ++l) {
      for (auto& h : keys) h = FloatToHalf(n(rng));
      for (auto& h : values) h = FloatToHalf(n(rng));
      if (l == 0) {
        for (int g = 0; g < kKv; ++g) {
          for (size_t i = 0; i < size_t(kPart) * kD; ++i) {
            const size_t at = (size_t(g) * context + start) * kD + i;
            k0[at] = HalfToFloat(keys[size_t(g) * kPart * kD + i]);
            v0[at] = HalfToFloat(values[size_t(g) * kPart * kD + i]);
          }
        }
      }
      v1::AppendKVRequest r;
      r.set_session_id(s->session_id());
      r.set_layer(l);
      r.set_start_token(start);
      r.set_num_tokens(kPart);
      r.set_keys(std::string(reinterpret_cast<const char*>(keys.data()), keys.size() * 2));
      r.set_values(std::string(reinterpret_cast<const char*>(values.data()), values.size() * 2));
      reqs.push_back(std::move(r));
    }
    if (!c.AppendKV(reqs).ok()) std::exit(1);
  }
  for (;;) {  // every chunk aged, as in a decode after the prefill
    auto d = c.DescribeSession(s->session_id());
    if (!d.ok()) std::exit(1);
    if (d->info().aging_backlog_tokens() == 0) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  // Room for a dense layer's reply (every chunk's handle: about 93 bytes a token).
  auto channel = c.OpenChannel(std::max<uint64_t>(4 << 20, uint64_t{160} * context));
  if (!channel.ok()) std::exit(1);
  std::vector<v1::SelectRequest> layers;
  for (int l = 0; l < kLayers; ++l) {
    v1::SelectRequest r = Request(s->session_id(), 256);
    r.set_layer(l);
    layers.push_back(std::move(r));
  }
  std::vector<float> q(size_t(kQ) * kD), out(q.size()), scores;
  for (auto& x : q) x = n(rng);
  std::vector<double> kvtier_ms, exact_ms;
  v1::SelectResponse m;  // reused layer after layer
  for (int step = 0; step < steps + 3; ++step) {
    const double t0 = NowSeconds();
    for (v1::SelectRequest& r : layers) {
      // The previous Select's lease (the layer before, its attention done) ends in this call.
      r.clear_release_lease_ids();
      if (!m.lease_id().empty()) r.add_release_lease_ids(m.lease_id());
      if (!(*channel)->Select(r, &m).ok()) std::exit(1);
    }
    const double t1 = NowSeconds();
    for (int l = 0; l < kLayers; ++l) ExactAttention(q, k0, v0, context, &out, &scores);
    const double t2 = NowSeconds();
    if (out[0] == 12345.0f) std::puts("");  // keep the arithmetic
    if (step >= 3) {                        // warm-up
      kvtier_ms.push_back((t1 - t0) * 1e3);
      exact_ms.push_back((t2 - t1) * 1e3);
    }
  }
  (void)(*channel)->Release(m.lease_id());
  (void)c.CloseSession(s->session_id());
  std::map<std::string, std::string> params = {
      {"context_tokens", std::to_string(context)},
      {"budget_tokens", "256"},
      {"layers", std::to_string(kLayers)},
      {"shape", "30x9/3x64"},
      {"path",
       "Select channel, each Select ending the previous Select's lease (release_lease_ids), "
       "one response reused; default policy"},
      {"baseline",
       "the worker's exact attention over the whole context, fp32 arithmetic, one thread"},
      {"steps", std::to_string(steps)}};
  NameDaemonFlags(&params);
  Print({"decode_step_kvtier_ms", Median(kvtier_ms), "ms", Median(exact_ms), "exact_attention_ms",
         params});
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 3 && std::string(argv[1]) == "--scaling_worker") {
    const std::vector<std::string> a = absl::StrSplit(argv[2], ',');
    if (a.size() != 6) return 2;
    return ScalingWorker(a[0], a[1], static_cast<uint32_t>(std::stoul(a[2])), std::stoi(a[3]),
                         static_cast<uint32_t>(std::stoul(a[4])), std::stoi(a[5]));
  }
  // --daemon_flags "FLAG VALUE ...": more flags for the daemon the bench starts (an A/B of a
  // daemon setting with the same binaries), before any other argument.
  std::vector<std::string> extra;
  if (argc >= 3 && std::string(argv[1]) == "--daemon_flags") {
    daemon_flags = argv[2];
    extra = absl::StrSplit(daemon_flags, ' ', absl::SkipEmpty());
    argc -= 2;
    argv += 2;
  }
  auto flags = [&](std::vector<std::string> own) {
    own.insert(own.end(), extra.begin(), extra.end());
    return own;
  };
  if (argc == 3 && std::string(argv[1]) == "--decode_tokens") {
    // decode_step_kvtier_ms alone, at each context of a comma-separated list (not in make bench:
    // 128K tokens take about a minute, most of it the worker's exact attention).
    Daemon d(flags({"--host_capacity", "10G"}));
    auto client = Client::Connect(d.address());
    if (!client.ok()) return 1;
    for (const absl::string_view n : absl::StrSplit(argv[2], ',')) {
      DecodeStep(**client, std::stoi(std::string(n)), 10);
    }
    return 0;
  }
  const int context = 4096;
  Daemon d(flags({"--host_capacity", "2G"}));
  auto client = Client::Connect(d.address());
  if (!client.ok()) return 1;
  Client& c = **client;
  v1::CreateSessionRequest create = SmolLm2Session();
  create.mutable_policy()->set_refine_factor(1);  // whole chunks first
  auto s = c.CreateSession(create);
  if (!s.ok()) return 1;
  std::mt19937 rng(2);
  std::normal_distribution<float> n(0, 1);
  std::vector<uint16_t> kv(size_t(kKv) * 512 * kD);
  for (int start = 0; start < context; start += 512) {
    std::vector<v1::AppendKVRequest> reqs;
    for (int l = 0; l < kLayers; ++l) {
      for (auto& h : kv) h = FloatToHalf(n(rng));
      v1::AppendKVRequest r;
      r.set_session_id(s->session_id());
      r.set_layer(l);
      r.set_start_token(start);
      r.set_num_tokens(512);
      r.set_keys(std::string(reinterpret_cast<const char*>(kv.data()), kv.size() * 2));
      r.set_values(r.keys());
      // The last append returns once every chunk is aged and indexed: the Selects below are
      // timed on a settled session, not beside the aging pool's work.
      r.set_wait_aged(start + 512 >= context);
      reqs.push_back(std::move(r));
    }
    if (!c.AppendKV(reqs).ok()) return 1;
  }
  auto channel = c.OpenChannel();
  if (!channel.ok()) return 1;
  Run(c, s->session_id(), context, 256, false, false, "whole chunks", "", 5, 400, channel->get());
  BackToBack(c, s->session_id(), 256, 5, 400, channel->get());
  v1::ForkSessionRequest fork;  // a second session of the same tokens, for a second worker
  fork.set_session_id(s->session_id());
  fork.set_num_tokens(context);
  auto forked = c.ForkSession(fork);
  if (!forked.ok()) return 1;
  Scaling(c, d.address(), {s->session_id(), forked->session_id()}, context, 256, 5, 1000);
  Run(c, s->session_id(), context, 256, true, false, "whole chunks", "_inline", 5, 400);
  v1::SessionPolicy refine;
  refine.set_refine_factor(8);  // the default
  if (!c.SetPolicy(s->session_id(), refine).ok()) return 1;
  Run(c, s->session_id(), context, 256, false, false, "rows of an 8x pool, gathered", "_refined", 5,
      400, channel->get());
  Run(c, s->session_id(), context, 256, false, true, "rows of an 8x pool, row handles",
      "_refined_rows", 5, 400);
  (void)c.CloseSession(s->session_id());
  (void)c.CloseSession(forked->session_id());
  DecodeStep(c, 4096, 20);
  DecodeStep(c, 32768, 10);
  return 0;
}
