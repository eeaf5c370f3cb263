// libFuzzer target: the daemon's configuration. Each input is read twice:
//  - as a config file (protobuf text format): ParseConfigText, then Validate;
//  - as a command line, one argument per line: ParseCommandLine, then Validate.
// Every outcome must be a value or an INVALID_ARGUMENT naming what is wrong; a validated
// config must print (Usage and DebugString) and validate again to the same options.
// `--config` lines are dropped: they name files, which are not this target's input.
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "server/config/config.h"

namespace {

void CheckError(const absl::Status& s, const char* what) {
  if (s.ok() || s.code() == absl::StatusCode::kInvalidArgument) return;
  std::fprintf(stderr, "config_fuzz: %s returned %s\n", what, s.ToString().c_str());
  std::abort();
}

void CheckValid(const kvtier::v1::Config& config) {
  auto options = kvtier::Validate(config);
  CheckError(options.status(), "Validate");
  if (!options.ok()) return;
  // What validated once validates again from its own text.
  auto again = kvtier::ParseConfigText(config.DebugString());
  if (!again.ok() || !kvtier::Validate(*again).ok()) {
    std::fprintf(stderr, "config_fuzz: a valid config does not survive its own text: %s\n",
                 config.DebugString().c_str());
    std::abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  auto config = kvtier::ParseConfigText(text);
  CheckError(config.status(), "ParseConfigText");
  if (config.ok()) CheckValid(*config);

  std::vector<std::string> args;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (absl::StrContains(line, "config")) continue;
    args.emplace_back(line);
  }
  auto cmd = kvtier::ParseCommandLine(args);
  CheckError(cmd.status(), "ParseCommandLine");
  if (cmd.ok()) CheckValid(cmd->config);
  return 0;
}
