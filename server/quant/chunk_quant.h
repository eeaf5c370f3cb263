// Chunk quantization on the CPU: the AVX2 path when the CPU has AVX2 and F16C, else the
// scalar reference (kernels/quant_ref.cc). Both give the same bytes; layout and rounding are
// kernels/quant_layout.h.
#ifndef KVTIER_SERVER_QUANT_CHUNK_QUANT_H_
#define KVTIER_SERVER_QUANT_CHUNK_QUANT_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "kernels/quant.h"
#include "server/common/vec.h"

namespace kvtier {

// keys, values: finite fp16 [n][d]; out: layout.Bytes() bytes.
void QuantizeChunk(const uint16_t* keys, const uint16_t* values, const QuantLayout& layout,
                   uint8_t* out);

// keys_out, values_out: fp16 [n][d].
void DequantizeChunk(const uint8_t* in, const QuantLayout& layout, uint16_t* keys_out,
                     uint16_t* values_out);

// True when the calls above take the AVX2 path for `layout` on this machine.
bool QuantIsVectorized(const QuantLayout& layout);

// True when fp16 rows k_row and v_row (d values each) could have been row `row` of the
// quantized chunk: every element within half a quantization step plus fp16 rounding of the
// stored value. (A cold chunk keeps no exact bytes to compare a rewrite against.)
bool MatchesQuantizedRow(const uint8_t* quant, const QuantLayout& layout, uint32_t row,
                         const uint16_t* k_row, const uint16_t* v_row);

// First non-finite (Inf or NaN) element of `n` halves, or -1.
int64_t FindNonFinite(const uint16_t* halves, uint64_t n);
// The same for `n` 2-byte floats of `kind` (fp16 as above; bf16: an all-ones exponent).
int64_t FindNonFinite(HalfKind kind, const uint16_t* h, uint64_t n);
// Copies `n` 2-byte floats of `kind` from `src` to `dst` (not overlapping) in one pass, and
// says whether every one was finite (dst then holds them all; otherwise its contents are
// unspecified). FindNonFinite says which one was not. `stream`: the stores bypass the cache
// where they can (dst 32-byte aligned), for bytes not read again soon (a slot's rows); they
// are weakly ordered, so the caller calls FenceStreamedStores before it publishes dst (one
// fence for many copies: each waits for every streamed store to reach memory).
bool CopyFinite(HalfKind kind, uint16_t* dst, const uint16_t* src, uint64_t n, bool stream = false);
// The same for `rows` rows of `d`, which it also adds to sums[d] as floats, each channel's
// rows in order, as AddRows does (the same bits). Once it returns false, sums is unspecified.
bool CopyFiniteRows(HalfKind kind, uint16_t* dst, const uint16_t* src, uint32_t rows, int d,
                    float* sums, bool stream = false);
// Orders the streamed stores of CopyFinite and CopyFiniteRows before every store after it.
void FenceStreamedStores();
// CopyFinite with the scalar code alone (tests compare the two).
bool CopyFiniteReference(HalfKind kind, uint16_t* dst, const uint16_t* src, uint64_t n);

// OK when a cold chunk's parameter headers (key and value: zero base, zero step, scale base)
// are what an encoder writes for fp16 rows: finite, the base within +-65504, the steps and
// scale bases in [0, 65504], so that no dequantized value is NaN. `what` prefixes the error.
absl::Status CheckQuantHeaders(const uint8_t* quant, const QuantLayout& layout,
                               absl::string_view what);

}  // namespace kvtier

#endif  // KVTIER_SERVER_QUANT_CHUNK_QUANT_H_
