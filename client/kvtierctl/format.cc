#include "client/kvtierctl/format.h"

#include <algorithm>
#include <bit>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "google/protobuf/util/json_util.h"

namespace kvtier::ctl {

Table::Table(std::vector<std::string> header, std::vector<bool> right) : right_(std::move(right)) {
  right_.resize(header.size(), false);
  rows_.push_back(std::move(header));
}

void Table::Add(std::vector<std::string> row) {
  row.resize(rows_[0].size());
  rows_.push_back(std::move(row));
}

std::string Table::Render() const {
  std::vector<size_t> width(rows_[0].size(), 0);
  for (const auto& r : rows_) {
    for (size_t i = 0; i < r.size(); ++i) width[i] = std::max(width[i], r[i].size());
  }
  std::string out;
  for (const auto& r : rows_) {
    std::string line;
    for (size_t i = 0; i < r.size(); ++i) {
      const std::string pad(width[i] - r[i].size(), ' ');
      const bool last = i + 1 == r.size();
      if (right_[i]) {
        absl::StrAppend(&line, pad, r[i]);
      } else {
        absl::StrAppend(&line, r[i], last ? "" : pad);
      }
      if (!last) line += "  ";
    }
    absl::StrAppend(&out, line, "\n");
  }
  return out;
}

std::string ToJson(const google::protobuf::Message& m) {
  google::protobuf::util::JsonPrintOptions o;
  o.add_whitespace = true;
  o.always_print_primitive_fields = true;
  o.preserve_proto_field_names = true;
  std::string out;
  (void)google::protobuf::util::MessageToJsonString(m, &out, o);
  return out;
}

std::string Age(int64_t unix_ms, int64_t now_ms) {
  int64_t s = std::max<int64_t>(0, (now_ms - unix_ms) / 1000);
  if (s < 120) return absl::StrCat(s, "s ago");
  if (s < 7200) return absl::StrCat(s / 60, "m ago");
  if (s < 172800) return absl::StrCat(s / 3600, "h ago");
  return absl::StrCat(s / 86400, "d ago");
}

std::string Bytes(uint64_t bytes) {
  if (bytes < 1024) return absl::StrCat(bytes, " B");
  // Binary units up to TiB: the unit is the number of whole 10-bit steps in the value.
  const int unit = std::min(4, (63 - std::countl_zero(bytes)) / 10);
  return absl::StrFormat("%.1f %ciB",
                         static_cast<double>(bytes) / static_cast<double>(1ull << (10 * unit)),
                         "KMGT"[unit - 1]);
}

}  // namespace kvtier::ctl
