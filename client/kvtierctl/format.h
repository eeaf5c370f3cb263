// Output for kvtierctl: aligned tables for people, JSON (proto field names) for scripts.
#ifndef KVTIER_CLIENT_KVTIERCTL_FORMAT_H_
#define KVTIER_CLIENT_KVTIERCTL_FORMAT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "google/protobuf/message.h"

namespace kvtier::ctl {

// Columns padded to their widest cell; numbers right-aligned when `right` says so.
class Table {
 public:
  explicit Table(std::vector<std::string> header, std::vector<bool> right = {});
  void Add(std::vector<std::string> row);
  std::string Render() const;

 private:
  std::vector<std::vector<std::string>> rows_;
  std::vector<bool> right_;
};

// The message as indented JSON with proto field names (snake_case) and zero fields shown.
std::string ToJson(const google::protobuf::Message& m);

// The same as YAML: every field, maps as mappings ordered by key, strings double-quoted,
// enums by name, 64-bit integers as numbers (JSON quotes them), bytes as base64.
std::string ToYaml(const google::protobuf::Message& m);

// "3s ago", "5m ago", "2h ago", "4d ago" from a Unix time in ms and now.
std::string Age(int64_t unix_ms, int64_t now_ms);

// "17 B", "4.0 KiB", "1.5 GiB": byte counts for people, in binary units.
std::string Bytes(uint64_t bytes);

}  // namespace kvtier::ctl

#endif  // KVTIER_CLIENT_KVTIERCTL_FORMAT_H_
