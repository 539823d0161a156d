/******************************************************************************
 * vegas: selection scores written from inside FlashAttention-3's sm90 forward mainloop (issue 22).
 * The project's own code, written for FlashAttention-3 (vllm-project/flash-attention 803020a8,
 * BSD-3-Clause, Tri Dao et al.), whose headers it includes; csrc/README.md says where it hooks in.
 *
 * What is written. For request b and slot h (the KV head under PackGQA, the query head otherwise):
 *   scores[h, b, p] = softmax_scale * sum over the tile's rows r that are a scored row (token
 *                     score_rows[b, 0] or score_rows[b, 1] of the request's chunk) of S[r, p]
 * for key positions p < score_ctx[b], S = Q K^T in fp32 straight from the QK GEMM (before softcap,
 * masking and the online softmax). Under PackGQA a tile row is (token, head of the group), so the
 * sum runs over the group's query heads and both scored tokens. Nothing else is written: positions
 * >= score_ctx[b] and requests whose score row is -1 keep what the caller put there.
 *
 * Where. Only the tile of m_block 0 of each (request, slot, split) writes, and only its first MMA
 * warpgroup (packed rows 0..63): the host (vegas_set_score_params in flash_api.cpp) checks that
 * every scored row is there (pack_gqa and max_seqlen_q * qhead_per_khead <= 64). Each split covers
 * its own key blocks, so split-KV writes every position once, with no atomics.
 *
 * How, per key block (kBlockN positions): each thread adds the scored rows it holds per column;
 * the 8 row groups of a warp are summed by a 3-step reduce-scatter butterfly over lanes
 * (7 shuffles per 8 columns). When a single warp holds every scored row (SmolLM2: G = 3, rows
 * 0-2 and 12-14), its lanes store their column sums straight to global memory: no shared memory,
 * no barrier. Otherwise each warp holding scored rows writes its column sums to shared memory and,
 * after a named barrier of the warpgroup, each thread sums one column over those warps in a fixed
 * order and stores it (coalesced, predicated on p < score_ctx). Which warps hold scored rows is
 * settled once per tile (a flag per warp in shared memory, one barrier). The order of every
 * addition is fixed, so the scores are deterministic. The attention itself is untouched: tSrS is
 * only read.
 ******************************************************************************/

#pragma once

#include <cute/tensor.hpp>

#include "cutlass/fast_math.h"  // For cutlass::FastDivmod
#include "cutlass/arch/barrier.h"

#include "named_barrier.hpp"
#include "utils.h"

namespace flash {

using namespace cute;

template <int kBlockM, int kBlockN, bool PackGQA, typename TiledMmaQK, bool Enabled, int kBufs>
struct VegasScores {

    static constexpr int kWarps = cutlass::NumThreadsPerWarpGroup / cutlass::NumThreadsPerWarp;
    // shared memory of the per-warp column sums (floats); 1 when disabled (no zero-size arrays)
    static constexpr int kSmemFloats = Enabled ? kBufs * kWarps * kBlockN + kWarps : 1;  // + a flag per warp
    // FwdNamedBarriers::QueryRotated is only used by AppendKV with rotary, which the enabled
    // configurations exclude (see CollectiveMainloopFwdSm90::kVegasScores)
    static constexpr uint32_t kBarrierId = static_cast<uint32_t>(FwdNamedBarriers::QueryRotated);
    static_assert(kBufs == 1 || kBufs == 2);

    // few registers: the decode kernel runs at the 255-register cap (the shared-memory address and
    // the thread index are passed to write() by the caller, which holds them anyway)
    float* gmem = nullptr;  // scores[slot, bidb, :] of this tile; nullptr: this thread writes nothing
    int ctx = 0;
    float scale = 0.f;
    // bits 0..15: row m of this thread's accumulator fragment is a scored row; bit 16: some lane of
    // this warp holds one; bits 20..23: warp w of the warpgroup holds one (same in every thread)
    uint32_t bits = 0;
    static constexpr uint32_t kWarpActive = 1u << 16;
    static constexpr int kWarpMaskShift = 20;

    template <typename Params>
    CUTLASS_DEVICE
    VegasScores(Params const& params, float* smem_, int const thread_idx_, int const m_block,
                int const bidh, int const bidb, int const seqlen_q) {
        if constexpr (Enabled) {
            // uniform per warpgroup: the first MMA warpgroup of the m_block-0 tile, when asked for
            if (params.ptr_vegas_scores == nullptr || m_block != 0 || thread_idx_ >= cutlass::NumThreadsPerWarpGroup) { return; }
            int const thread_idx = thread_idx_;
            int r0 = params.ptr_vegas_score_rows[2 * bidb];
            int r1 = params.ptr_vegas_score_rows[2 * bidb + 1];
            if (r0 >= seqlen_q) { r0 = -1; }
            if (r1 >= seqlen_q) { r1 = -1; }
            ctx = params.ptr_vegas_score_ctx[bidb];
            scale = params.vegas_softmax_scale;
            gmem = params.ptr_vegas_scores + bidh * params.vegas_scores_slot_stride + bidb * params.vegas_scores_batch_stride;
            auto thread_mma = TiledMmaQK{}.get_thread_slice(thread_idx);
            Tensor cS = cute::make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{});
            Tensor tScS = thread_mma.partition_C(cS);
            Tensor tScS_rowcol = make_tensor(tScS.data(), flash::convert_layout_acc_rowcol(tScS.layout()));
            static_assert(CUTE_STATIC_V(size<0>(tScS_rowcol)) <= 16);
            #pragma unroll
            for (int m = 0; m < size<0>(tScS_rowcol); ++m) {
                int const row = get<0>(tScS_rowcol(m, _0{}));  // m_block == 0
                int const token = !PackGQA ? row : params.qhead_per_khead_divmod.divide(row);
                if (token == r0 || token == r1) { bits |= 1u << m; }
            }
            bool const warp_active = __any_sync(0xffffffff, bits != 0);
            if (warp_active) { bits |= kWarpActive; }
            // which warps hold scored rows: a flag per warp after the column buffers, one barrier
            // (the previous tile's reads of the flags are behind its finish() barrier)
            float* flags = smem_ + kBufs * kWarps * kBlockN;
            int const warp = thread_idx / cutlass::NumThreadsPerWarp;
            if (thread_idx % cutlass::NumThreadsPerWarp == 0) { flags[warp] = warp_active ? 1.f : 0.f; }
            cutlass::arch::NamedBarrier::sync(cutlass::NumThreadsPerWarpGroup, kBarrierId);
            #pragma unroll
            for (int w = 0; w < kWarps; ++w) { if (flags[w] != 0.f) { bits |= 1u << (kWarpMaskShift + w); } }
        }
    }

    CUTLASS_DEVICE
    bool active() const { return Enabled && gmem != nullptr; }

    // After the QK GEMM of key block n_block (tSrS complete, before softcap/mask/softmax); smem and
    // thread_idx as given to the constructor.
    template <typename Engine, typename Layout>
    CUTLASS_DEVICE
    void write(Tensor<Engine, Layout> const& tSrS, int const n_block, float* smem, int const thread_idx) const {
        if constexpr (Enabled) {
            if (gmem == nullptr) { return; }
            Tensor tSrS_rowcol = make_tensor(tSrS.data(), flash::convert_layout_acc_rowcol(tSrS.layout()));
            static constexpr int kRows = CUTE_STATIC_V(size<0>(tSrS_rowcol));
            static constexpr int kCols = CUTE_STATIC_V(size<1>(tSrS_rowcol));
            static constexpr int kChunks = (kCols + 7) / 8;
            auto thread_mma = TiledMmaQK{}.get_thread_slice(thread_idx);
            Tensor cS = cute::make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{});
            Tensor tScS = thread_mma.partition_C(cS);
            Tensor tScS_rowcol = make_tensor(tScS.data(), flash::convert_layout_acc_rowcol(tScS.layout()));
            int const lane = thread_idx % cutlass::NumThreadsPerWarp;
            int const warp = thread_idx / cutlass::NumThreadsPerWarp;
            // after the butterfly, lane holds index 4*b2 + 2*b3 + b4 of each chunk of 8 (b_i: lane bit i)
            int const lane_idx = ((lane >> 2) & 1) * 4 + ((lane >> 3) & 1) * 2 + ((lane >> 4) & 1);
            uint32_t const warp_mask = bits >> kWarpMaskShift;
            bool const single = (warp_mask & (warp_mask - 1)) == 0;  // one warp holds every scored row
            float* buf = smem + (kBufs == 1 ? 0 : (n_block & 1) * (kWarps * kBlockN)) + warp * kBlockN;
            if constexpr (kBufs == 1) {  // the previous block's sums must have been read
                if (!single) { cutlass::arch::NamedBarrier::sync(cutlass::NumThreadsPerWarpGroup, kBarrierId); }
            }
            if (bits & kWarpActive) {
                #pragma unroll
                for (int c = 0; c < kChunks; ++c) {
                    float v[8];
                    #pragma unroll
                    for (int i = 0; i < 8; ++i) {
                        v[i] = 0.f;
                        if (c * 8 + i < kCols) {
                            #pragma unroll
                            for (int m = 0; m < kRows; ++m) {
                                // select, not multiply: rows beyond the chunk may hold anything
                                if (bits & (1u << m)) { v[i] += tSrS_rowcol(m, c * 8 + i); }
                            }
                        }
                    }
                    bool up = lane & 4;
                    #pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        float const send = up ? v[i] : v[i + 4];
                        float const keep = up ? v[i + 4] : v[i];
                        v[i] = keep + __shfl_xor_sync(0xffffffff, send, 4);
                    }
                    up = lane & 8;
                    #pragma unroll
                    for (int i = 0; i < 2; ++i) {
                        float const send = up ? v[i] : v[i + 2];
                        float const keep = up ? v[i + 2] : v[i];
                        v[i] = keep + __shfl_xor_sync(0xffffffff, send, 8);
                    }
                    up = lane & 16;
                    float const send = up ? v[0] : v[1];
                    float const keep = up ? v[1] : v[0];
                    v[0] = keep + __shfl_xor_sync(0xffffffff, send, 16);
                    int const n = c * 8 + lane_idx;
                    if (n < kCols) {
                        int const col = get<1>(tScS_rowcol(_0{}, n));
                        if (single) {  // the whole sum: straight to global memory
                            int const pos = n_block * kBlockN + col;
                            if (pos < ctx) { gmem[pos] = v[0] * scale; }
                        } else {
                            buf[col] = v[0];
                        }
                    }
                }
            }
            if (single) { return; }
            cutlass::arch::NamedBarrier::sync(cutlass::NumThreadsPerWarpGroup, kBarrierId);
            float const* sums = smem + (kBufs == 1 ? 0 : (n_block & 1) * (kWarps * kBlockN));
            #pragma unroll
            for (int col = thread_idx; col < kBlockN; col += cutlass::NumThreadsPerWarpGroup) {
                int const pos = n_block * kBlockN + col;
                if (pos < ctx) {
                    float s = 0.f;
                    #pragma unroll
                    for (int w = 0; w < kWarps; ++w) {  // fixed order; 0 + x = x exactly
                        if (warp_mask & (1u << w)) { s += sums[w * kBlockN + col]; }
                    }
                    gmem[pos] = s * scale;
                }
            }
        }
    }

    // End of the tile: the next tile of this CTA may reuse the buffers and the flags.
    CUTLASS_DEVICE
    void finish() const {
        if constexpr (Enabled) {
            if (gmem != nullptr) { cutlass::arch::NamedBarrier::sync(cutlass::NumThreadsPerWarpGroup, kBarrierId); }
        }
    }

};

} // namespace flash
