// CPU twin of gather_chunks_gpu_test: the reference gather, checked row by row against the
// tokens that were laid out, over odd head_dims and token counts, with guard bytes.
#include "kernels/gather_chunks.h"

#include <cstring>
#include <random>

#include "gtest/gtest.h"
#include "kernels/chunk_layout.h"

namespace kvtier {
namespace {

constexpr uint8_t kGuard = 0xA5;

TEST(GatherChunksReference, CopiesEveryRowAndNothingElse) {
  std::mt19937 rng(11);
  for (uint32_t d : {1u, 3u, 7u, 17u, 64u, 128u}) {
    for (uint32_t n : {1u, 3u, 7u, 16u}) {
      const ChunkLayout layout{d, n};
      const uint64_t slot = ChunkLayout::SlotBytes(d, 16);
      const int chunks = 5;
      // Token rows: value = (chunk, row, kv, element) mixed into 16 bits.
      auto value = [](int c, uint32_t r, int kv, uint32_t j) {
        return static_cast<uint16_t>(c * 7919 + r * 131 + kv * 17 + j * 3 + 1);
      };
      std::vector<uint8_t> src(slot * chunks, 0), dst(slot * chunks + 64, kGuard);
      for (int c = 0; c < chunks; ++c) {
        for (uint32_t r = 0; r < n; ++r) {
          for (uint32_t j = 0; j < d; ++j) {
            uint16_t kv[2] = {value(c, r, 0, j), value(c, r, 1, j)};
            std::memcpy(&src[c * slot + layout.key_offset(r) + j * 2], &kv[0], 2);
            std::memcpy(&src[c * slot + layout.value_offset(r) + j * 2], &kv[1], 2);
          }
        }
      }
      // Reverse order into the destination: entry i takes chunk (chunks-1-i).
      std::vector<GatherEntry> entries;
      for (int i = 0; i < chunks; ++i) {
        entries.push_back({&src[(chunks - 1 - i) * slot], &dst[i * slot], layout.bytes()});
      }
      GatherChunksReference(entries.data(), chunks);
      for (int i = 0; i < chunks; ++i) {
        const int c = chunks - 1 - i;
        for (uint32_t r = 0; r < n; ++r) {
          for (uint32_t j = 0; j < d; ++j) {
            uint16_t k, v;
            std::memcpy(&k, &dst[i * slot + layout.key_offset(r) + j * 2], 2);
            std::memcpy(&v, &dst[i * slot + layout.value_offset(r) + j * 2], 2);
            ASSERT_EQ(k, value(c, r, 0, j)) << "d " << d << " n " << n;
            ASSERT_EQ(v, value(c, r, 1, j)) << "d " << d << " n " << n;
          }
        }
        for (uint64_t b = layout.bytes(); b < slot; ++b) {
          ASSERT_EQ(dst[i * slot + b], kGuard) << "wrote past the chunk";
        }
      }
    }
  }
}

TEST(ChunkLayout, HandleCoversKThenV) {
  ChunkLayout l{64, 5};
  EXPECT_EQ(l.row_bytes(), 128u);
  EXPECT_EQ(l.key_offset(4), 512u);
  EXPECT_EQ(l.value_offset(0), 640u);  // right after the 5 key rows
  EXPECT_EQ(l.bytes(), 1280u);
  EXPECT_EQ(ChunkLayout::SlotBytes(64, 16), 4096u);
}

}  // namespace
}  // namespace kvtier
