#include <cstring>

#include "kernels/gather_chunks.h"

namespace kvtier {

void GatherChunksReference(const GatherEntry* entries, int num_entries) {
  for (int i = 0; i < num_entries; ++i) {
    std::memcpy(entries[i].dst, entries[i].src, entries[i].bytes);
  }
}

}  // namespace kvtier
