#include "client/kvtierctl/format.h"

#include <algorithm>
#include <bit>
#include <utility>
#include <vector>

#include "absl/strings/escaping.h"
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

namespace {

// A YAML double-quoted scalar: the escapes YAML defines, \xNN for other control bytes.
std::string YamlQuote(const std::string& s) {
  std::string out = "\"";
  for (unsigned char ch : s) {
    switch (ch) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\r':
        out += "\\r";
        break;
      default:
        if (ch < 0x20 || ch == 0x7f) {
          out += absl::StrFormat("\\x%02x", ch);
        } else {
          out += static_cast<char>(ch);
        }
    }
  }
  return out + "\"";
}

using google::protobuf::FieldDescriptor;
using google::protobuf::Message;
using google::protobuf::Reflection;

void YamlMessage(const Message& m, int indent, std::string* out);

// One scalar field value (element `i` of a repeated field, or the field itself when i < 0).
std::string YamlScalar(const Message& m, const FieldDescriptor* f, int i) {
  const Reflection* r = m.GetReflection();
  const bool rep = i >= 0;
  switch (f->cpp_type()) {
    case FieldDescriptor::CPPTYPE_INT32:
      return absl::StrCat(rep ? r->GetRepeatedInt32(m, f, i) : r->GetInt32(m, f));
    case FieldDescriptor::CPPTYPE_INT64:
      return absl::StrCat(rep ? r->GetRepeatedInt64(m, f, i) : r->GetInt64(m, f));
    case FieldDescriptor::CPPTYPE_UINT32:
      return absl::StrCat(rep ? r->GetRepeatedUInt32(m, f, i) : r->GetUInt32(m, f));
    case FieldDescriptor::CPPTYPE_UINT64:
      return absl::StrCat(rep ? r->GetRepeatedUInt64(m, f, i) : r->GetUInt64(m, f));
    case FieldDescriptor::CPPTYPE_DOUBLE:
      return absl::StrCat(rep ? r->GetRepeatedDouble(m, f, i) : r->GetDouble(m, f));
    case FieldDescriptor::CPPTYPE_FLOAT:
      return absl::StrCat(rep ? r->GetRepeatedFloat(m, f, i) : r->GetFloat(m, f));
    case FieldDescriptor::CPPTYPE_BOOL:
      return (rep ? r->GetRepeatedBool(m, f, i) : r->GetBool(m, f)) ? "true" : "false";
    case FieldDescriptor::CPPTYPE_ENUM:
      return (rep ? r->GetRepeatedEnum(m, f, i) : r->GetEnum(m, f))->name();
    case FieldDescriptor::CPPTYPE_STRING: {
      const std::string s = rep ? r->GetRepeatedString(m, f, i) : r->GetString(m, f);
      return YamlQuote(f->type() == FieldDescriptor::TYPE_BYTES ? absl::Base64Escape(s) : s);
    }
    case FieldDescriptor::CPPTYPE_MESSAGE:
      break;
  }
  return "null";
}

void YamlField(const Message& m, const FieldDescriptor* f, int indent, std::string* out) {
  const Reflection* r = m.GetReflection();
  const std::string pad(indent, ' ');
  if (f->is_map()) {
    // A map as a mapping of its keys (entries ordered by key, as JSON's are not).
    const int n = r->FieldSize(m, f);
    if (n == 0) {
      absl::StrAppend(out, pad, f->name(), ": {}\n");
      return;
    }
    std::vector<std::pair<std::string, std::string>> entries;
    for (int i = 0; i < n; ++i) {
      const Message& e = r->GetRepeatedMessage(m, f, i);
      const FieldDescriptor* k = e.GetDescriptor()->FindFieldByNumber(1);
      const FieldDescriptor* v = e.GetDescriptor()->FindFieldByNumber(2);
      std::string key = YamlScalar(e, k, -1);
      if (k->cpp_type() != FieldDescriptor::CPPTYPE_STRING) key = YamlQuote(key);
      if (v->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE) {
        std::string nested;
        YamlMessage(e.GetReflection()->GetMessage(e, v), indent + 4, &nested);
        entries.emplace_back(key, "\n" + nested);
      } else {
        entries.emplace_back(key, " " + YamlScalar(e, v, -1) + "\n");
      }
    }
    std::sort(entries.begin(), entries.end());
    absl::StrAppend(out, pad, f->name(), ":\n");
    for (const auto& [k, v] : entries) absl::StrAppend(out, pad, "  ", k, ":", v);
    return;
  }
  if (f->is_repeated()) {
    const int n = r->FieldSize(m, f);
    if (n == 0) {
      absl::StrAppend(out, pad, f->name(), ": []\n");
      return;
    }
    absl::StrAppend(out, pad, f->name(), ":\n");
    for (int i = 0; i < n; ++i) {
      if (f->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE) {
        std::string nested;
        YamlMessage(r->GetRepeatedMessage(m, f, i), indent + 4, &nested);
        // "- " takes the place of the first line's indent.
        if (nested.empty()) {
          absl::StrAppend(out, pad, "  - {}\n");
        } else {
          absl::StrAppend(out, pad, "  - ", nested.substr(indent + 4));
        }
      } else {
        absl::StrAppend(out, pad, "  - ", YamlScalar(m, f, i), "\n");
      }
    }
    return;
  }
  if (f->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE) {
    std::string nested;
    YamlMessage(r->GetMessage(m, f), indent + 2, &nested);
    absl::StrAppend(out, pad, f->name(), nested.empty() ? ": {}\n" : ":\n", nested);
    return;
  }
  absl::StrAppend(out, pad, f->name(), ": ", YamlScalar(m, f, -1), "\n");
}

// Every field, set or not (as ToJson prints primitive fields), but unset messages and
// optional fields left unset.
void YamlMessage(const Message& m, int indent, std::string* out) {
  const google::protobuf::Descriptor* d = m.GetDescriptor();
  const Reflection* r = m.GetReflection();
  for (int i = 0; i < d->field_count(); ++i) {
    const FieldDescriptor* f = d->field(i);
    if (!f->is_repeated() && f->has_presence() && !r->HasField(m, f)) continue;
    YamlField(m, f, indent, out);
  }
}

}  // namespace

std::string ToYaml(const google::protobuf::Message& m) {
  std::string out;
  YamlMessage(m, 0, &out);
  return out.empty() ? "{}\n" : out;
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
