// Socket helpers of the C++ client library (internal: not installed with its headers).
#ifndef KVTIER_CLIENT_CPP_SOCKET_IO_H_
#define KVTIER_CLIENT_CPP_SOCKET_IO_H_

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace kvtier::client_internal {

// Sends all of `data` on a connected stream socket, going on after a signal or a short send. A
// peer that has closed it is UNAVAILABLE naming `what` and the reason, never a SIGPIPE (which
// ends a process that does not ignore it: the worker this library is linked into).
absl::Status SendAll(int sock, absl::string_view data, absl::string_view what);

}  // namespace kvtier::client_internal

#endif  // KVTIER_CLIENT_CPP_SOCKET_IO_H_
