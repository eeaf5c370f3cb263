// Sessions in the remote tier, and which daemon holds each id. Besides a demoted session's
// record ("kvtier:session:<id>", session_record.h), each id a daemon holds live has an owner
// key "kvtier:owner:<id>" naming that daemon ("<instance>@<hostname>"). Every change of hands
// is one Lua script run atomically by Redis, so one id has one owner however many daemons
// share the Redis:
//
//   Claim    a new session: refused while a record lies there or another daemon holds the id
//   Put      a demotion: the record is stored and the id let go, unless another daemon holds it
//            (a receipt of its token, "kvtier:put:<id>:<token>", left for ten minutes for a
//            second sending)
//   Finish   a restore, after the record was read and imported: the id is taken and the record
//            deleted, unless another daemon took it (or closed it) meanwhile
//   Drop     a close: this daemon's hold let go, and the record deleted (leaving the tombstone
//            "kvtier:closed:<id>" for a day)
//   Release  a live session's close: this daemon's hold let go (leaving the tombstone too when
//            the session had been restored from a record)
//
// A record larger than a part is stored in parts first (RemoteStore::StoreParts), and its key
// holds their manifest: Put's script stores the manifest, and every script that deletes or
// replaces a record (Put, Finish, Drop) deletes its parts with it; Get reads them back.
//
// A daemon killed with SIGKILL leaves its owner keys: its ids stay held until the same
// instance, started again, takes them back (its write-behind snapshots) or closes them, or an
// operator deletes the keys.
#ifndef KVTIER_SERVER_SESSION_REMOTE_RECORDS_H_
#define KVTIER_SERVER_SESSION_REMOTE_RECORDS_H_

#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "server/tier/remote_store.h"

namespace kvtier {

class RemoteRecords {
 public:
  // `store` outlives this; `self` names this daemon.
  RemoteRecords(RemoteStore* store, std::string self) : store_(store), self_(std::move(self)) {}
  const std::string& self() const { return self_; }

  // True when the id was not held before (false: this daemon held it already). ALREADY_EXISTS
  // when its record lies in the remote tier or another daemon holds it (named).
  absl::StatusOr<bool> Claim(const std::string& session_id);
  // Stores `record` and lets the id go. FAILED_PRECONDITION when another daemon holds it. A
  // script whose reply is lost (a timeout) is sent once more, its answer the outcome: the put
  // leaves a receipt of a random token ("kvtier:put:<id>:<token>", ten minutes) by which a
  // second sending knows that the first ran. The second form takes the token (a put sent
  // again, in tests).
  absl::Status Put(const std::string& session_id, const std::string& record);
  absl::Status Put(const std::string& session_id, const std::string& record,
                   const std::string& token);
  // The record, for a restore (nullopt: none). NOT_FOUND naming the holder when another
  // daemon holds the id.
  absl::StatusOr<std::optional<std::string>> Get(const std::string& session_id);
  // Takes the id and deletes the record the restore read. NOT_FOUND when another daemon took
  // it meanwhile (named) or the record went (closed): the restore is to be thrown away.
  absl::Status Finish(const std::string& session_id);
  // Lets this daemon's hold go and deletes the record; whether a record existed. False, and
  // nothing touched, when another daemon holds the id.
  absl::StatusOr<bool> Drop(const std::string& session_id);
  // Lets this daemon's hold of a session live here go (closed, or never made), leaving any
  // record of the id alone: one can lie there only for another session of the id, demoted
  // before this one was made while the claim could not be checked. Nothing when another
  // daemon holds the id. With `tombstone` (a session restored from a record: the daemon that
  // demoted it may ask for it), the tombstone a Drop leaves is left too.
  absl::Status Release(const std::string& session_id, bool tombstone = false);
  // Whether a record of the id was closed (by Drop, on any daemon) within the last day.
  absl::StatusOr<bool> ClosedLately(const std::string& session_id);

 private:
  RemoteStore* const store_;
  const std::string self_;
};

}  // namespace kvtier

#endif  // KVTIER_SERVER_SESSION_REMOTE_RECORDS_H_
