#include "server/session/remote_records.h"

#include <vector>

#include "absl/strings/str_cat.h"
#include "server/common/error.h"
#include "server/common/status_macros.h"
#include "server/session/session_record.h"

namespace kvtier {
namespace {

// KEYS[1] the record, KEYS[2] the owner key, ARGV[1] this daemon. Each returns an array whose
// first element says what happened.

// The guard of every change but a claim: nothing happens while another daemon holds the id
// (`o`, its owner or false, is left for the script).
#define KVTIER_UNLESS_HELD_ELSEWHERE       \
  "local o = redis.call('GET', KEYS[2])\n" \
  "if o and o ~= ARGV[1] then return {'held', o} end\n"

constexpr char kClaim[] = R"lua(
if redis.call('EXISTS', KEYS[1]) == 1 then return {'record'} end
local o = redis.call('GET', KEYS[2])
if o == ARGV[1] then return {'mine'} end
if o then return {'held', o} end
redis.call('SET', KEYS[2], ARGV[1])
return {'new'}
)lua";

// ARGV[2] the record (or the manifest of its parts: RemoteStore::StoreParts, kept here), ARGV[3]
// this put's token, whose receipt the put leaves ("<KEYS[4]>:<token>", a key of its own, so
// that no later put of the id erases it) for ten minutes: the same put sent again (its reply
// lost) finds it and is done, whatever happened to the record since (restored, closed or
// demoted anew by another daemon: never stored again). A record of the id lying there already
// (another session's: RemoteRecords::Release) goes, with its parts.
constexpr char kPut[] = R"lua(
local receipt = KEYS[4] .. ':' .. ARGV[3]
if redis.call('EXISTS', receipt) == 1 then return {'ok'} end
)lua" KVTIER_UNLESS_HELD_ELSEWHERE KVTIER_KEEP_PARTS_LUA KVTIER_DROP_PARTS_LUA R"lua(
if not keep_parts(ARGV[2]) then return {'parts gone'} end
drop_parts(KEYS[1], ARGV[2])
redis.call('SET', KEYS[1], ARGV[2])
redis.call('DEL', KEYS[2])
redis.call('SET', receipt, '1', 'PX', 600000)
return {'ok'}
)lua";

constexpr char kGet[] = KVTIER_UNLESS_HELD_ELSEWHERE R"lua(
local r = redis.call('GET', KEYS[1])
if not r then return {'none'} end
return {'record', r}
)lua";

// Idempotent: a Finish sent again after its reply was lost (a connection dropped after the
// script ran, which the store resends) finds the id this daemon's and the record gone, and is
// done; any other missing record was closed meanwhile.
constexpr char kFinish[] = KVTIER_UNLESS_HELD_ELSEWHERE KVTIER_DROP_PARTS_LUA R"lua(
if redis.call('EXISTS', KEYS[1]) == 0 then
  if o == ARGV[1] then return {'ok'} end
  return {'gone'}
end
redis.call('SET', KEYS[2], ARGV[1])
drop_parts(KEYS[1], nil)
redis.call('DEL', KEYS[1])
return {'ok'}
)lua";

// KEYS[3] the tombstone a closed record leaves for a day, so that the daemon that demoted
// it can tell a close elsewhere from a record lost: a function each closing script defines.
#define KVTIER_TOMBSTONE \
  "local function tombstone() redis.call('SET', KEYS[3], ARGV[1], 'EX', 86400) end\n"

constexpr char kDrop[] = KVTIER_UNLESS_HELD_ELSEWHERE KVTIER_TOMBSTONE KVTIER_DROP_PARTS_LUA R"lua(
if o then redis.call('DEL', KEYS[2]) end
drop_parts(KEYS[1], nil)
local n = redis.call('DEL', KEYS[1])
if n == 1 then tombstone() end
return {'ok', n}
)lua";

// The hold of a session live here let go (it closed, or its creation failed): its record, if
// one lies there, is another session's of the same id (demoted before this one was made while
// Redis was out of reach), never this one's, and stays. ARGV[2] "1": the session was restored
// from a record (a daemon that demoted it may look for it): the close leaves the tombstone.
constexpr char kRelease[] = KVTIER_UNLESS_HELD_ELSEWHERE KVTIER_TOMBSTONE R"lua(
if o then redis.call('DEL', KEYS[2]) end
if ARGV[2] == '1' then tombstone() end
return {'ok'}
)lua";

constexpr char kClosed[] = R"lua(
if redis.call('EXISTS', KEYS[3]) == 1 then return {'closed'} end
return {'none'}
)lua";

absl::Status Bad(const std::string& id) {
  return absl::InternalError(
      absl::StrCat("remote: an unexpected reply about session_id ", Quoted(id)));
}

std::string OwnerKey(const std::string& session_id) {
  return absl::StrCat("kvtier:owner:", session_id);
}

// The script's reply: its first element, and the second when there is one.
struct Outcome {
  std::string what;
  std::optional<std::string> value;
};

absl::StatusOr<Outcome> Run(RemoteStore* store, const char* script, const std::string& id,
                            const std::string& self, std::vector<std::string_view> extra = {}) {
  const std::string record = RecordKey(id), owner = OwnerKey(id),
                    tombstone = absl::StrCat("kvtier:closed:", id),
                    receipt = absl::StrCat("kvtier:put:", id);
  std::vector<std::string_view> args = {self};
  args.insert(args.end(), extra.begin(), extra.end());
  ASSIGN_OR_RETURN(auto reply, store->Eval(script, {record, owner, tombstone, receipt}, args));
  if (reply.empty() || !reply[0]) return Bad(id);
  Outcome o{*reply[0], std::nullopt};
  if (reply.size() > 1) o.value = reply[1];
  return o;
}

absl::Status HeldBy(const std::string& id, const std::optional<std::string>& holder,
                    absl::StatusCode code) {
  return absl::Status(code, absl::StrCat("session_id: ", Quoted(id), " is held by kvtierd ",
                                         Quoted(holder.value_or("?"))));
}

}  // namespace

absl::StatusOr<bool> RemoteRecords::Claim(const std::string& session_id) {
  ASSIGN_OR_RETURN(Outcome o, Run(store_, kClaim, session_id, self_));
  if (o.what == "new") return true;
  if (o.what == "mine") return false;
  if (o.what == "record") {
    return absl::AlreadyExistsError(
        absl::StrCat("session_id: ", Quoted(session_id), " already exists (in the remote tier)"));
  }
  if (o.what == "held") return HeldBy(session_id, o.value, absl::StatusCode::kAlreadyExists);
  return Bad(session_id);
}

absl::Status RemoteRecords::Put(const std::string& session_id, const std::string& record) {
  return Put(session_id, record, RemoteStore::Nonce());
}

absl::Status RemoteRecords::Put(const std::string& session_id, const std::string& record,
                                const std::string& token) {
  // A record larger than a part goes first, in parts; the script stores their manifest.
  ASSIGN_OR_RETURN(const std::optional<std::string> manifest, store_->StoreParts(record));
  const std::string& stored = manifest ? *manifest : record;
  absl::StatusOr<Outcome> o = Run(store_, kPut, session_id, self_, {stored, token});
  // Its reply lost (a timeout): the script may have run, the record stored and the id let go,
  // while the session would stay live here too. Sent once more: the receipt of its token says
  // it ran (whatever another daemon did with the record since), and otherwise it runs now, so
  // the answer is the outcome.
  if (absl::IsUnavailable(o.status())) o = Run(store_, kPut, session_id, self_, {stored, token});
  // Its outcome unknown still: stored after all (the id let go with it), or its parts go.
  if (!o.ok()) return store_->Settle(RecordKey(session_id), stored, o.status());
  if (o->what == "ok") return absl::OkStatus();
  if (o->what == "parts gone") return store_->PartsGone(stored);
  store_->DropParts(stored).IgnoreError();  // refused: never stored
  if (o->what == "held") return HeldBy(session_id, o->value, absl::StatusCode::kFailedPrecondition);
  return Bad(session_id);
}

absl::StatusOr<std::optional<std::string>> RemoteRecords::Get(const std::string& session_id) {
  std::optional<std::string> last;  // the manifest whose parts the last try missed
  for (;;) {
    ASSIGN_OR_RETURN(Outcome o, Run(store_, kGet, session_id, self_));
    if (o.what == "none") return std::optional<std::string>();
    if (o.what == "held") return HeldBy(session_id, o.value, absl::StatusCode::kNotFound);
    if (o.what != "record" || !o.value) return Bad(session_id);
    // A manifest, kept for the comparison below (what else a key holds needs no copy).
    const std::string stored = RemoteStore::IsManifest(*o.value) ? *o.value : "";
    absl::StatusOr<std::string> record = store_->LoadParts(*std::move(o.value));
    if (record.ok()) return std::optional<std::string>(*std::move(record));
    // A part gone: the record was closed or replaced since the script read its manifest (its
    // parts go with it), unless the same manifest is there still.
    if (record.status().code() != absl::StatusCode::kDataLoss || last == stored) {
      return record.status();
    }
    last = stored;
  }
}

absl::Status RemoteRecords::Finish(const std::string& session_id) {
  ASSIGN_OR_RETURN(Outcome o, Run(store_, kFinish, session_id, self_));
  if (o.what == "ok") return absl::OkStatus();
  if (o.what == "held") return HeldBy(session_id, o.value, absl::StatusCode::kNotFound);
  if (o.what == "gone") {
    return absl::NotFoundError(
        absl::StrCat("session_id: ", Quoted(session_id), " was closed while it was restored"));
  }
  return Bad(session_id);
}

absl::StatusOr<bool> RemoteRecords::Drop(const std::string& session_id) {
  ASSIGN_OR_RETURN(Outcome o, Run(store_, kDrop, session_id, self_));
  if (o.what == "held") return false;
  if (o.what == "ok") return o.value.has_value() && *o.value != "0";
  return Bad(session_id);
}

absl::Status RemoteRecords::Release(const std::string& session_id, bool tombstone) {
  ASSIGN_OR_RETURN(Outcome o, Run(store_, kRelease, session_id, self_, {tombstone ? "1" : "0"}));
  if (o.what == "ok" || o.what == "held") return absl::OkStatus();
  return Bad(session_id);
}

absl::StatusOr<bool> RemoteRecords::ClosedLately(const std::string& session_id) {
  ASSIGN_OR_RETURN(Outcome o, Run(store_, kClosed, session_id, self_));
  return o.what == "closed";
}

}  // namespace kvtier
