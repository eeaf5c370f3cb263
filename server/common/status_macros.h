// Status plumbing shared by every server module.
#ifndef KVTIER_SERVER_COMMON_STATUS_MACROS_H_
#define KVTIER_SERVER_COMMON_STATUS_MACROS_H_

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define KVTIER_CONCAT_INNER_(a, b) a##b
#define KVTIER_CONCAT_(a, b) KVTIER_CONCAT_INNER_(a, b)

// Returns the status from the enclosing function when `expr` is not OK.
#define RETURN_IF_ERROR(expr)                        \
  do {                                               \
    ::absl::Status _kvtier_status = (expr);          \
    if (!_kvtier_status.ok()) return _kvtier_status; \
  } while (0)

// `ASSIGN_OR_RETURN(auto x, F())` binds the value of an OK StatusOr, else returns its status.
#define ASSIGN_OR_RETURN(lhs, expr) \
  ASSIGN_OR_RETURN_IMPL_(KVTIER_CONCAT_(_kvtier_statusor_, __LINE__), lhs, expr)
#define ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                           \
  if (!tmp.ok()) return tmp.status();          \
  lhs = std::move(tmp).value()

#endif  // KVTIER_SERVER_COMMON_STATUS_MACROS_H_
