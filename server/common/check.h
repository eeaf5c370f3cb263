// CHECK for broken invariants (never for bad input): prints the condition and a message,
// then aborts. Debian's Abseil (20220623) predates absl/log/check.h.
#ifndef KVTIER_SERVER_COMMON_CHECK_H_
#define KVTIER_SERVER_COMMON_CHECK_H_

#include <cstdlib>
#include <iostream>
#include <sstream>

namespace kvtier::internal {

class CheckFailure {
 public:
  CheckFailure(const char* file, int line, const char* cond) {
    stream_ << file << ":" << line << ": CHECK failed: " << cond << " ";
  }
  [[noreturn]] ~CheckFailure() {
    std::cerr << stream_.str() << std::endl;
    std::abort();
  }
  std::ostream& stream() { return stream_; }

 private:
  std::ostringstream stream_;
};

}  // namespace kvtier::internal

#define CHECK(cond)   \
  if (cond) {         \
  } else /* NOLINT */ \
    ::kvtier::internal::CheckFailure(__FILE__, __LINE__, #cond).stream()

#define CHECK_EQ(a, b) CHECK((a) == (b))
#define CHECK_LT(a, b) CHECK((a) < (b))
#define CHECK_GT(a, b) CHECK((a) > (b))
#define CHECK_GE(a, b) CHECK((a) >= (b))

#endif  // KVTIER_SERVER_COMMON_CHECK_H_
