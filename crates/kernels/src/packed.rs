//! Weights re-laid out for batched multiplication: groups of [`PACK_ROWS`] rows whose blocks
//! are interleaved, so one vector instruction multiplies four quants of each of eight weight
//! rows by the same four activations.
//!
//! Every packed block covers 32 columns of a group of eight rows (block `b` of rows
//! `8g..8g+8`) and is multiplied with one Q8x32 activation block. Its layout depends on the
//! weight type:
//!
//! | weight types | header | quants |
//! |---|---|---|
//! | Q4_0 | `d` f16 ×8 | 4 chunks of nibbles |
//! | Q4_1 | `d` f16 ×8, `m` f16 ×8 | 4 chunks of nibbles |
//! | Q8_0 | `d` f16 ×8 | 8 chunks of signed bytes, or with VNNI of bytes `q + 128` |
//! | Q5_0 | `d` f16 ×8, fifth bits 32 bytes | 4 chunks of nibbles |
//! | Q5_1 | `d` f16 ×8, `m` f16 ×8, fifth bits 32 bytes | 4 chunks of nibbles |
//! | Q4_K at the AVX-512 level | per super-block of 256: `d` f16 ×8, `dmin` f16 ×8; per block: `sc` u8 ×8, `m` u8 ×8 | 4 chunks of nibbles |
//! | Q4_K below it | `scale` f32 ×8, `offset` f32 ×8 | 4 chunks of nibbles |
//! | Q5_K | `scale` f32 ×8, `offset` f32 ×8, fifth bits 32 bytes | 4 chunks of nibbles |
//! | Q6_K at the AVX-512 level | per super-block of 256: `d` f16 ×8; per block: `sc` i8 ×8 of elements 0..16, ×8 of 16..32, high bits 2 × 32 bytes | 4 chunks of nibbles |
//! | Q3_K, Q6_K below it | `scale` of elements 0..16 f32 ×8, of elements 16..32 f32 ×8 | 8 chunks of bytes `q + 32` |
//!
//! Chunk `c` holds bytes `4c..4c+4` of each row's quant bytes, row after row (nibbles: byte `j`
//! holds elements `j` and `j+16`; Q3_K's and Q6_K's bytes are their quants plus 32, 0..=63, so
//! that they multiply the signed activation bytes without a sign step and the bias comes off
//! with the activation's half-block sums). The fifth bits are laid out like a chunk: byte
//! `4r + k` holds row `r`'s fifth bits of elements `4c + k` (bit `c`) and `16 + 4c + k` (bit
//! `4 + c`) for the four chunks `c`, so a chunk's are one shift and one mask away in registers
//! (a little-endian u32 per row, as GGUF stores them, took five instructions per chunk). Q4_0,
//! Q4_1, Q5_0, Q5_1 and Q8_0 keep their GGUF blocks' sizes, interleaved. At the AVX-512 level
//! Q4_K keeps its f16 `d` and `dmin` per super-block and its 6-bit scales and mins, one byte
//! each ([`Layout::U4K`]), so it grows only from 4.5 to 4.625 bits per weight; the kernel
//! computes `d·sc` and `-(dmin·m)` per block in f32, exactly (an f16 times a 6-bit integer), the
//! values the reference uses. Below that level it is unpacked to f32 scales and offsets
//! ([`Layout::U4F`], 6 bits per weight): the 256-bit kernels measured 15–20% slower on
//! prefill-sized batches with the per-block scale arithmetic, so AVX2-only machines keep the
//! layout they had. Q6_K at the AVX-512 level ([`Layout::U6K`]) keeps the file's 6.5625 bits
//! per weight the same way: `d` as stored, the 8-bit scales, each quant `q + 32` split into a
//! nibble (chunked as Q4_K's) and two high bits ([`high_bit_bytes`]); the kernels rebuild the
//! bytes `q + 32` of [`Layout::U6H`] and form its scales `d·sc` exactly, so both layouts give the
//! same results bit for bit. The other
//! K-quants are unpacked at load to integers with exact f32 scales (`d·sc` of a K-quant
//! sub-block is a product of an f16 and a 6- or 8-bit integer, exact in f32), so they run on
//! the same integer kernel: Q5_K grows from 5.5 to 7 bits per weight, Q3_K (and Q6_K below the
//! AVX-512 level) to 10 (the trade is in docs/engine.md). Q2_K stays on its row kernel. Decode streams every weight once
//! per token, so these sizes are its cost.
//!
//! With VNNI (`vpdpbusd` multiplies unsigned by signed bytes) Q8_0 is packed as `q + 128`
//! ([`Layout::U8`]): the kernel multiplies the activations without the sign step that signed
//! weights need (two instructions of five per chunk and activation row), and the bias comes off
//! the block's integer dot product as 128 times the activation block's sum (from
//! [`act_block_sums`], once per matmul), so the result is Q8_0's, bit for bit. (An offset
//! of `-128·d` applied in f32, as Q4_0's `-8·d` is, lost half a logit on Gemma 3, whose
//! activations make the two terms large and nearly cancelling.) Without VNNI the 16-bit pair
//! sums of `vpmaddubsw` could saturate on such bytes, so Q8_0 keeps its signed bytes there;
//! which one a process packs follows [`Isa::detect`].
//!
//! Each (weight row, activation row) result is computed the same way whatever else is in the
//! batch: per block the exact integer dot product, then `acc = (d·d_a)·dot + acc` and
//! `acc = offset·s_a + acc` with fused multiply-adds (`offset` is `-8d` for Q4_0, `-16d` for
//! Q5_0, `m` for Q4_1 and Q5_1, `-(dmin·m)` for Q4_K, the stored offset for Q5_K; Q3_K and Q6_K add their two half-block dot
//! products, each with its own scale). The scalar reference performs the same fused operations,
//! so the SIMD kernel matches it bit for bit and a sequence's logits do not depend on what it is
//! batched with.

use half::f16;

use crate::dispatch::Isa;
use crate::dtype::{DType, Q8X32_BLOCK_BYTES, QK};
use crate::quant::{scale_min_k4, unpack32, unpack_k};

/// Weight rows per packed group.
pub const PACK_ROWS: usize = 8;

/// Activation rows one packed kernel call multiplies.
pub const PACK_ACTS: usize = 4;

/// How a weight type is laid out once packed (see the table in the module's documentation).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Layout {
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    /// Q8_0's bytes plus 128 (unsigned; packed so with VNNI).
    U8,
    /// Q4_K by super-block of 256 elements: the eight rows' f16 `d` and `dmin`, then per block of
    /// 32 their 6-bit scales and mins as bytes and the nibbles (4.625 bits per weight).
    U4K,
    /// Unsigned 4-bit quants with an f32 scale and offset per block (Q4_K below the AVX-512
    /// level: 6 bits per weight, but no scale arithmetic per block in the 256-bit kernels).
    U4F,
    /// Unsigned 5-bit quants (nibbles and fifth bits) with an f32 scale and offset (Q5_K).
    U5F,
    /// Quants of at most 6 bits stored as `q + 32` (unsigned, 0..=63) with an f32 scale per
    /// half block and no offset (Q3_K, and Q6_K below the AVX-512 level).
    U6H,
    /// Q6_K by super-block of 256 elements: the eight rows' f16 `d`, then per block of 32 their
    /// 8-bit scales of each half, the high two bits of `q + 32` and its low four as nibbles
    /// (6.5625 bits per weight, as in the file).
    U6K,
}

/// What is added to the quants of [`Layout::U6H`] to store them unsigned.
pub(crate) const U6H_BIAS: i32 = 32;

/// Bytes of the f32 header (eight scales, then eight offsets or second scales) of the unpacked
/// layouts.
const F32_HEADER: usize = 64;

/// [`Layout::U4K`]: the header of a super-block (eight rows' f16 `d`, then their f16 `dmin`).
pub(crate) const U4K_SUPER_HEADER: usize = 32;
/// [`Layout::U4K`]: one block of 32 elements of eight rows (their scales, their mins, then four
/// chunks of nibbles).
pub(crate) const U4K_BLOCK_BYTES: usize = 16 + 128;
/// [`Layout::U4K`]: one super-block of eight rows (256 elements each).
pub(crate) const U4K_SUPER_BYTES: usize = U4K_SUPER_HEADER + 8 * U4K_BLOCK_BYTES;

/// [`Layout::U6K`]: the header of a super-block (eight rows' f16 `d`).
pub(crate) const U6K_SUPER_HEADER: usize = 16;
/// [`Layout::U6K`]: one block of 32 elements of eight rows (the scales of their first halves,
/// of their second halves, 64 bytes of high bits, then four chunks of nibbles).
pub(crate) const U6K_BLOCK_BYTES: usize = 16 + 64 + 128;
/// [`Layout::U6K`]: one super-block of eight rows (256 elements each).
pub(crate) const U6K_SUPER_BYTES: usize = U6K_SUPER_HEADER + 8 * U6K_BLOCK_BYTES;

/// Where block `b` (of 32 elements) of a packed group starts, and where the header of its
/// super-block starts (the same place for the layouts without super-blocks).
pub(crate) fn block_offsets(layout: Layout, b: usize) -> (usize, usize) {
    if layout == Layout::U4K {
        let sb = b / 8 * U4K_SUPER_BYTES;
        (sb + U4K_SUPER_HEADER + b % 8 * U4K_BLOCK_BYTES, sb)
    } else if layout == Layout::U6K {
        let sb = b / 8 * U6K_SUPER_BYTES;
        (sb + U6K_SUPER_HEADER + b % 8 * U6K_BLOCK_BYTES, sb)
    } else {
        let at = b * layout_block_bytes(layout);
        (at, at)
    }
}

/// The layout this process packs `dtype` in (Q8_0's depends on [`Isa::detect`]).
pub(crate) fn layout(dtype: DType) -> Option<Layout> {
    layout_for(dtype, Isa::detect())
}

/// The layout `dtype` is packed in for kernels of level `isa` (at most what this CPU has).
pub(crate) fn layout_for(dtype: DType, isa: Isa) -> Option<Layout> {
    let level = [Isa::Avx512, Isa::Vnni, Isa::Avx2, Isa::Scalar]
        .into_iter()
        .find(|&l| isa.runs(l))
        .unwrap_or(Isa::Scalar);
    layout_for_level(dtype, level)
}

/// The layout `dtype` is packed in for kernels of level `level`, whatever this CPU has (every
/// kernel runs every layout; the level picks the fastest for it).
pub(crate) fn layout_for_level(dtype: DType, level: Isa) -> Option<Layout> {
    Some(match dtype {
        DType::Q4_0 => Layout::Q4_0,
        DType::Q4_1 => Layout::Q4_1,
        DType::Q8_0 if level >= Isa::Vnni => Layout::U8,
        DType::Q8_0 => Layout::Q8_0,
        DType::Q5_0 => Layout::Q5_0,
        DType::Q5_1 => Layout::Q5_1,
        DType::Q4_K if level >= Isa::Avx512 => Layout::U4K,
        DType::Q4_K => Layout::U4F,
        DType::Q5_K => Layout::U5F,
        DType::Q6_K if level >= Isa::Avx512 => Layout::U6K,
        DType::Q3_K | DType::Q6_K => Layout::U6H,
        _ => return None,
    })
}

fn layout_of(dtype: DType) -> Layout {
    layout(dtype).unwrap_or_else(|| panic!("{dtype} is not packable"))
}

/// Whether matrices of this type (with rows a multiple of [`PACK_ROWS`]) can be packed.
pub fn packable(dtype: DType) -> bool {
    layout(dtype).is_some()
}

/// Bytes of one packed block of a group.
pub fn packed_block_bytes(dtype: DType) -> usize {
    layout_block_bytes(layout_of(dtype))
}

/// Bytes of one packed block of `layout`.
pub(crate) fn layout_block_bytes(layout: Layout) -> usize {
    match layout {
        Layout::Q4_0 => 16 + 128,
        Layout::Q4_1 => 32 + 128,
        Layout::Q8_0 | Layout::U8 => 16 + 256,
        Layout::Q5_0 => 16 + 32 + 128,
        Layout::Q5_1 => 32 + 32 + 128,
        // On average: a super-block of eight blocks is 32 + 8·144 bytes.
        Layout::U4K => U4K_SUPER_BYTES / 8,
        // A super-block is 16 + 8·208 bytes.
        Layout::U6K => U6K_SUPER_BYTES / 8,
        Layout::U4F => F32_HEADER + 128,
        Layout::U5F => F32_HEADER + 32 + 128,
        Layout::U6H => F32_HEADER + 256,
    }
}

/// Bytes before a packed block's fifth bits (5-bit layouts) or quants: its scales and offsets.
pub(crate) fn header_bytes(layout: Layout) -> usize {
    match layout {
        Layout::Q4_0 | Layout::Q5_0 | Layout::Q8_0 | Layout::U8 => 16,
        Layout::Q4_1 | Layout::Q5_1 => 32,
        Layout::U4K => 16,
        // The scales, then 64 bytes of high bits before the nibbles.
        Layout::U6K => 16,
        Layout::U4F | Layout::U5F | Layout::U6H => F32_HEADER,
    }
}

/// Whether a layout's quants are 5-bit (nibbles plus 32 bytes of fifth bits, see
/// [`fifth_bit_bytes`]).
pub(crate) fn five_bit(layout: Layout) -> bool {
    matches!(layout, Layout::Q5_0 | Layout::Q5_1 | Layout::U5F)
}

/// A row's four bytes of fifth bits in a packed block, from GGUF's u32 (bit `i` for element
/// `i`): byte `k` has bit `c` for element `4c + k` and bit `4 + c` for element `16 + 4c + k`.
pub(crate) fn fifth_bit_bytes(fifth: u32) -> [u8; 4] {
    std::array::from_fn(|k| {
        (0..4).fold(0u8, |byte, c| {
            let lo = ((fifth >> (4 * c + k)) & 1) as u8;
            let hi = ((fifth >> (16 + 4 * c + k)) & 1) as u8;
            byte | lo << c | hi << (4 + c)
        })
    })
}

/// A row's four high-bit bytes of one half of a [`Layout::U6K`] block, from the high two bits
/// of its 16 quants `q + 32` (element `4c + k` of the half in `high[4c + k]`): byte `k` holds
/// element `4c + k`'s in bits `2c..2c + 2`, so shifting 16-bit lanes by `4 - 2c` and masking
/// with 0x30 puts chunk `c`'s where the nibble's fifth and sixth bits go.
pub(crate) fn high_bit_bytes(high: [u8; 16]) -> [u8; 4] {
    std::array::from_fn(|k| (0..4).fold(0u8, |byte, c| byte | (high[4 * c + k] & 3) << (2 * c)))
}

/// Bytes of the scale header of a GGUF block (before its fifth bits or quants) and the number
/// of quant bytes, for the layouts that keep GGUF's blocks.
fn source_layout(layout: Layout) -> (usize, usize) {
    match layout {
        Layout::Q4_0 => (2, 16),
        Layout::Q4_1 => (4, 16),
        Layout::Q5_0 => (2, 16),
        Layout::Q5_1 => (4, 16),
        _ => (2, 32),
    }
}

/// Packs a `rows × cols` matrix of `dtype` stored row after row (GGUF layout). `None` when the
/// type has no packed kernel or `rows` is not a multiple of [`PACK_ROWS`].
pub fn pack(dtype: DType, data: &[u8], rows: usize, cols: usize) -> Option<Vec<u8>> {
    pack_as(layout(dtype)?, dtype, data, rows, cols)
}

/// [`pack`] in a given layout of `dtype`'s.
pub(crate) fn pack_as(
    layout: Layout,
    dtype: DType,
    data: &[u8],
    rows: usize,
    cols: usize,
) -> Option<Vec<u8>> {
    if !rows.is_multiple_of(PACK_ROWS) || !cols.is_multiple_of(QK) || rows == 0 {
        return None;
    }
    let row_bytes = dtype.row_bytes(cols)?;
    if data.len() != rows * row_bytes {
        return None;
    }
    let nb = cols / QK;
    let pbb = layout_block_bytes(layout);
    let mut out = vec![0u8; rows / PACK_ROWS * nb * pbb];
    if dtype.block_size() == QK {
        let bb = dtype.block_bytes();
        let (header, quant_bytes) = source_layout(layout);
        let five = five_bit(layout);
        for g in 0..rows / PACK_ROWS {
            for b in 0..nb {
                let dst = &mut out[(g * nb + b) * pbb..][..pbb];
                for r in 0..PACK_ROWS {
                    let src = &data[(g * PACK_ROWS + r) * row_bytes + b * bb..][..bb];
                    dst[2 * r..2 * r + 2].copy_from_slice(&src[0..2]);
                    if header == 4 {
                        dst[16 + 2 * r..16 + 2 * r + 2].copy_from_slice(&src[2..4]);
                    }
                    let mut quants_at = header_bytes(layout);
                    let mut header = header;
                    if five {
                        let fifth = u32::from_le_bytes(src[header..header + 4].try_into().unwrap());
                        dst[quants_at + 4 * r..quants_at + 4 * r + 4]
                            .copy_from_slice(&fifth_bit_bytes(fifth));
                        quants_at += 32;
                        header += 4;
                    }
                    for c in 0..quant_bytes / 4 {
                        let to = quants_at + 32 * c + 4 * r;
                        dst[to..to + 4].copy_from_slice(&src[header + 4 * c..header + 4 * c + 4]);
                        if layout == Layout::U8 {
                            // `q + 128` of a signed byte is the byte with its top bit flipped.
                            dst[to..to + 4].iter_mut().for_each(|q| *q ^= 0x80);
                        }
                    }
                }
            }
        }
        return Some(out);
    }
    let (bs, bb) = (dtype.block_size(), dtype.block_bytes());
    if layout == Layout::U4K {
        // Q4_K's d and dmin bits as they are, each 6-bit scale and min as a byte.
        let group_bytes = nb * pbb;
        for g in 0..rows / PACK_ROWS {
            for r in 0..PACK_ROWS {
                let row = &data[(g * PACK_ROWS + r) * row_bytes..][..row_bytes];
                for (s, src) in row.chunks_exact(bb).enumerate() {
                    let sb = &mut out[g * group_bytes + s * U4K_SUPER_BYTES..][..U4K_SUPER_BYTES];
                    sb[2 * r..2 * r + 2].copy_from_slice(&src[0..2]);
                    sb[16 + 2 * r..16 + 2 * r + 2].copy_from_slice(&src[2..4]);
                    let q = unpack_k(dtype, src).q;
                    for j in 0..8 {
                        let (sc, m) = scale_min_k4(j, &src[4..16]);
                        let blk =
                            &mut sb[U4K_SUPER_HEADER + j * U4K_BLOCK_BYTES..][..U4K_BLOCK_BYTES];
                        blk[r] = sc;
                        blk[8 + r] = m;
                        for c in 0..4 {
                            for k in 0..4 {
                                let e = j * QK + 4 * c + k;
                                blk[16 + 32 * c + 4 * r + k] =
                                    (q[e] as u8 & 0x0f) | ((q[e + 16] as u8 & 0x0f) << 4);
                            }
                        }
                    }
                }
            }
        }
        return Some(out);
    }
    if layout == Layout::U6K {
        // Q6_K's d bits as they are, its 8-bit scales, each quant `q + 32` split into its high
        // two bits and its low nibble.
        let group_bytes = nb * pbb;
        for g in 0..rows / PACK_ROWS {
            for r in 0..PACK_ROWS {
                let row = &data[(g * PACK_ROWS + r) * row_bytes..][..row_bytes];
                for (s, src) in row.chunks_exact(bb).enumerate() {
                    let sb = &mut out[g * group_bytes + s * U6K_SUPER_BYTES..][..U6K_SUPER_BYTES];
                    sb[2 * r..2 * r + 2].copy_from_slice(&src[208..210]);
                    let q = unpack_k(dtype, src).q;
                    let biased = |e: usize| (i16::from(q[e]) + U6H_BIAS as i16) as u8;
                    for j in 0..8 {
                        let blk =
                            &mut sb[U6K_SUPER_HEADER + j * U6K_BLOCK_BYTES..][..U6K_BLOCK_BYTES];
                        blk[r] = src[192 + 2 * j];
                        blk[8 + r] = src[192 + 2 * j + 1];
                        for half in 0..2 {
                            let high = std::array::from_fn(|i| biased(j * QK + 16 * half + i) >> 4);
                            blk[16 + 32 * half + 4 * r..][..4]
                                .copy_from_slice(&high_bit_bytes(high));
                        }
                        for c in 0..4 {
                            for k in 0..4 {
                                let e = j * QK + 4 * c + k;
                                blk[80 + 32 * c + 4 * r + k] =
                                    (biased(e) & 0x0f) | ((biased(e + 16) & 0x0f) << 4);
                            }
                        }
                    }
                }
            }
        }
        return Some(out);
    }
    for g in 0..rows / PACK_ROWS {
        for r in 0..PACK_ROWS {
            let row = &data[(g * PACK_ROWS + r) * row_bytes..][..row_bytes];
            for (s, src) in row.chunks_exact(bb).enumerate() {
                for (k, block) in unpacked_blocks(dtype, src).iter().enumerate() {
                    let b = s * (bs / QK) + k;
                    put_block(layout, &mut out[(g * nb + b) * pbb..][..pbb], r, block);
                }
            }
        }
    }
    Some(out)
}

/// One 32-element block as integers: `value[i] = scales[i / 16] · q[i] + offset`.
struct IntBlock {
    q: [i8; QK],
    scales: [f32; 2],
    offset: f32,
}

/// The 32-element blocks of one GGUF block of a type packed by unpacking (one for Q5_x, eight
/// for a K-quant super-block).
fn unpacked_blocks(dtype: DType, src: &[u8]) -> Vec<IntBlock> {
    if dtype.block_size() == QK {
        let u = unpack32(dtype, src);
        return vec![IntBlock {
            q: u.q,
            scales: [u.scale; 2],
            offset: u.offset,
        }];
    }
    let u = unpack_k(dtype, src);
    (0..8)
        .map(|sub| IntBlock {
            q: std::array::from_fn(|i| u.q[sub * QK + i]),
            scales: [u.scales[2 * sub], u.scales[2 * sub + 1]],
            // Q4_K and Q5_K have one minimum per 32 elements; Q3_K and Q6_K none.
            offset: -u.mins[2 * sub],
        })
        .collect()
}

/// Writes row `r`'s block into a packed block of an unpacked layout.
fn put_block(layout: Layout, dst: &mut [u8], r: usize, block: &IntBlock) {
    let second = match layout {
        Layout::U6H => block.scales[1],
        _ => block.offset,
    };
    dst[4 * r..4 * r + 4].copy_from_slice(&block.scales[0].to_le_bytes());
    dst[32 + 4 * r..32 + 4 * r + 4].copy_from_slice(&second.to_le_bytes());
    if layout == Layout::U5F {
        let fifth = (0..QK).fold(0u32, |bits, i| {
            bits | (u32::from(block.q[i] as u8 >> 4) << i)
        });
        dst[F32_HEADER + 4 * r..F32_HEADER + 4 * r + 4].copy_from_slice(&fifth_bit_bytes(fifth));
    }
    if matches!(layout, Layout::U4F | Layout::U5F) {
        let at = header_bytes(layout) + if layout == Layout::U5F { 32 } else { 0 };
        for c in 0..4 {
            for k in 0..4 {
                let j = 4 * c + k;
                dst[at + 32 * c + 4 * r + k] =
                    (block.q[j] as u8 & 0x0f) | ((block.q[j + 16] as u8 & 0x0f) << 4);
            }
        }
    } else {
        for c in 0..8 {
            for k in 0..4 {
                let q = i16::from(block.q[4 * c + k]);
                debug_assert!((-32..32).contains(&q), "Q3_K and Q6_K quants are 6-bit");
                dst[F32_HEADER + 32 * c + 4 * r + k] = (q + U6H_BIAS as i16) as u8;
            }
        }
    }
}

fn f16_at(bytes: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([bytes[at], bytes[at + 1]]).to_f32()
}

fn f32_at(bytes: &[u8], at: usize) -> f32 {
    f32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]])
}

/// The scalar reference: one packed group (all its blocks) times one Q8x32 activation row of
/// `cols` elements; the eight rows' dot products.
pub fn dot_packed_ref(dtype: DType, group: &[u8], act: &[u8], cols: usize) -> [f32; PACK_ROWS] {
    dot_packed_ref_as(layout_of(dtype), dtype, group, act, cols)
}

/// [`dot_packed_ref`] of a group packed in `layout`.
pub(crate) fn dot_packed_ref_as(
    layout: Layout,
    _dtype: DType,
    group: &[u8],
    act: &[u8],
    cols: usize,
) -> [f32; PACK_ROWS] {
    let nb = cols / QK;
    let pbb = layout_block_bytes(layout);
    let mut acc = [0f32; PACK_ROWS];
    for b in 0..nb {
        let (at, header_at) = block_offsets(layout, b);
        let blk = &group[at..at + pbb.min(group.len() - at)];
        let super_header = &group[header_at..];
        let a = &act[b * Q8X32_BLOCK_BYTES..(b + 1) * Q8X32_BLOCK_BYTES];
        let (da, sa) = (f32_at(a, 0), f32_at(a, 4));
        let aq = |i: usize| i32::from(a[8 + i] as i8);
        for (r, acc) in acc.iter_mut().enumerate() {
            // The dot products of elements 0..16 and 16..32 of the bytes chunks (the halves
            // matter to Q3_K and Q6_K only), or of the whole block of nibbles.
            // (Q8_0's bytes are signed; Q3_K's and Q6_K's are `q + 32`.)
            let bytes_dot = |at: usize, chunks: std::ops::Range<usize>| {
                let mut dot = 0i32;
                for c in chunks {
                    for k in 0..4 {
                        let byte = blk[at + 32 * c + 4 * r + k];
                        let q = match layout {
                            Layout::U6H => i32::from(byte) - U6H_BIAS,
                            Layout::U8 => i32::from((byte ^ 0x80) as i8),
                            _ => i32::from(byte as i8),
                        };
                        dot += q * aq(4 * c + k);
                    }
                }
                dot
            };
            // Nibbles at `at`, with the rows' fifth bits at `at - 32` for the 5-bit layouts.
            let five = five_bit(layout);
            let nibbles_dot = |at: usize| {
                let mut dot = 0i32;
                for c in 0..4 {
                    for k in 0..4 {
                        let (j, byte) = (4 * c + k, blk[at + 32 * c + 4 * r + k]);
                        let fifth = if five {
                            u32::from(blk[at - 32 + 4 * r + k])
                        } else {
                            0
                        };
                        let lo = (byte & 0x0f) as u32 | ((fifth >> c) & 1) << 4;
                        let hi = (byte >> 4) as u32 | ((fifth >> (4 + c)) & 1) << 4;
                        dot += lo as i32 * aq(j);
                        dot += hi as i32 * aq(16 + j);
                    }
                }
                dot
            };
            let quants = header_bytes(layout) + if five { 32 } else { 0 };
            match layout {
                Layout::Q4_0
                | Layout::Q4_1
                | Layout::Q5_0
                | Layout::Q5_1
                | Layout::Q8_0
                | Layout::U8 => {
                    let d = f16_at(blk, 2 * r);
                    let dot = match layout {
                        Layout::Q8_0 | Layout::U8 => bytes_dot(16, 0..8),
                        _ => nibbles_dot(quants),
                    };
                    *acc = (d * da).mul_add(dot as f32, *acc);
                    match layout {
                        Layout::Q4_0 => *acc = (-8.0 * d).mul_add(sa, *acc),
                        Layout::Q5_0 => *acc = (-16.0 * d).mul_add(sa, *acc),
                        Layout::Q4_1 | Layout::Q5_1 => {
                            *acc = f16_at(blk, 16 + 2 * r).mul_add(sa, *acc)
                        }
                        _ => {}
                    }
                }
                Layout::U4K => {
                    // d·sc and dmin·m are exact in f32 (an f16 times a 6-bit integer).
                    let scale = f16_at(super_header, 2 * r) * f32::from(blk[r]);
                    let offset = -(f16_at(super_header, 16 + 2 * r) * f32::from(blk[8 + r]));
                    let dot = nibbles_dot(quants);
                    *acc = (scale * da).mul_add(dot as f32, *acc);
                    *acc = offset.mul_add(sa, *acc);
                }
                Layout::U4F | Layout::U5F => {
                    let dot = nibbles_dot(quants);
                    *acc = (f32_at(blk, 4 * r) * da).mul_add(dot as f32, *acc);
                    *acc = f32_at(blk, 32 + 4 * r).mul_add(sa, *acc);
                }
                Layout::U6H => {
                    let (lo, hi) = (bytes_dot(F32_HEADER, 0..4), bytes_dot(F32_HEADER, 4..8));
                    *acc = (f32_at(blk, 4 * r) * da).mul_add(lo as f32, *acc);
                    *acc = (f32_at(blk, 32 + 4 * r) * da).mul_add(hi as f32, *acc);
                }
                Layout::U6K => {
                    // Each half: `q + 32` from its nibble and high bits, the bias off with the
                    // activation's half sum; d·sc is exact in f32 (an f16 times an 8-bit
                    // integer), the scale the unpacked layout stores.
                    let (mut lo, mut hi) = (0i32, 0i32);
                    for c in 0..4 {
                        for k in 0..4 {
                            let (j, byte) = (4 * c + k, blk[80 + 32 * c + 4 * r + k]);
                            let high_lo = (blk[16 + 4 * r + k] >> (2 * c)) & 3;
                            let high_hi = (blk[48 + 4 * r + k] >> (2 * c)) & 3;
                            let q_lo = i32::from(byte & 0x0f | high_lo << 4) - U6H_BIAS;
                            let q_hi = i32::from(byte >> 4 | high_hi << 4) - U6H_BIAS;
                            lo += q_lo * aq(j);
                            hi += q_hi * aq(16 + j);
                        }
                    }
                    let d = f16_at(super_header, 2 * r);
                    let scale_lo = d * f32::from(blk[r] as i8);
                    let scale_hi = d * f32::from(blk[8 + r] as i8);
                    *acc = (scale_lo * da).mul_add(lo as f32, *acc);
                    *acc = (scale_hi * da).mul_add(hi as f32, *acc);
                }
            }
        }
    }
    acc
}

/// Whether the packed kernel for `dtype` needs the activation blocks' sums
/// ([`act_block_sums`]): Q8_0 packed unsigned.
pub fn needs_act_sums(dtype: DType) -> bool {
    layout(dtype) == Some(Layout::U8)
}

/// 128 times the sum of each Q8x32 activation block's 32 quants (what Q8_0 packed unsigned
/// takes off its dot products), for `cols` columns.
pub fn act_block_sums(act: &[u8], cols: usize, sums: &mut [i32]) {
    for (sum, block) in sums
        .iter_mut()
        .zip(act.chunks_exact(Q8X32_BLOCK_BYTES))
        .take(cols / QK)
    {
        *sum = 128 * block[8..].iter().map(|&q| i32::from(q as i8)).sum::<i32>();
    }
}

/// Groups `first_group..first_group + n_groups` of a packed matrix against `acts.len()`
/// (1..=[`PACK_ACTS`]) activation rows: the eight results of group `g` for activation row `i`
/// are written to `out[i·out_stride + 8g ..][..8]`. Groups up to `prefetch_end` (at least the
/// span's end) may be prefetched while the span runs, two groups ahead into L1; the groups in
/// `spread` are prefetched into L2 evenly over the span (a share of the next span on each pass
/// of several activation rows over this one, so its first pass need not wait on memory).
/// `sums` holds each activation row's [`act_block_sums`] where [`needs_act_sums`] says so
/// (else it may be empty).
///
/// # Safety
/// `out` must be valid for writes of every element named above, and no other thread may access
/// those elements during the call (threads of one matmul write disjoint column ranges).
#[allow(clippy::too_many_arguments)]
pub unsafe fn dot_packed_span(
    isa: Isa,
    dtype: DType,
    packed: &[u8],
    first_group: usize,
    n_groups: usize,
    (acts, sums): (&[&[u8]], &[&[i32]]),
    cols: usize,
    out: *mut f32,
    out_stride: usize,
    (prefetch_end, spread): (usize, std::ops::Range<usize>),
) {
    let layout = layout_of(dtype);
    // SAFETY: the caller's guarantees, passed on.
    unsafe {
        dot_packed_span_as(
            isa,
            layout,
            dtype,
            (packed, first_group, n_groups, prefetch_end, spread),
            (acts, sums),
            cols,
            out,
            out_stride,
        )
    }
}

/// [`dot_packed_span`] of a matrix packed in `layout` (`packed`, the first group, the number of
/// groups, the prefetch end and the groups to spread into L2).
///
/// # Safety
/// As for [`dot_packed_span`].
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn dot_packed_span_as(
    isa: Isa,
    layout: Layout,
    dtype: DType,
    (packed, first_group, n_groups, prefetch_end, spread): (
        &[u8],
        usize,
        usize,
        usize,
        std::ops::Range<usize>,
    ),
    (acts, sums): (&[&[u8]], &[&[i32]]),
    cols: usize,
    out: *mut f32,
    out_stride: usize,
) {
    let nb = cols / QK;
    let group_bytes = nb * layout_block_bytes(layout);
    assert!(
        (1..=PACK_ACTS).contains(&acts.len()),
        "1..={PACK_ACTS} activation rows"
    );
    let prefetch_end = prefetch_end.clamp(first_group + n_groups, packed.len() / group_bytes);
    let groups = &packed[first_group * group_bytes..prefetch_end * group_bytes];
    let all_groups = packed.len() / group_bytes;
    let (s0, s1) = (spread.start.min(all_groups), spread.end.min(all_groups));
    let spread = &packed[s0 * group_bytes..s1.max(s0) * group_bytes];
    assert!(
        acts.iter().all(|a| a.len() >= nb * Q8X32_BLOCK_BYTES),
        "activation row too short"
    );
    assert!(
        layout != Layout::U8 || (sums.len() >= acts.len() && sums.iter().all(|s| s.len() >= nb)),
        "Q8_0 packed unsigned needs the activation blocks' sums"
    );
    #[cfg(target_arch = "x86_64")]
    if isa.runs(Isa::Avx2) {
        // SAFETY: AVX2, FMA and F16C are present (AVX-512 where `isa.runs(Isa::Avx512)`); group
        // and activation extents were checked above, the output's by the caller.
        unsafe {
            crate::x86::dot_packed_span(
                (isa.runs(Isa::Vnni), isa.runs(Isa::Avx512)),
                layout,
                groups,
                n_groups,
                spread,
                acts,
                sums,
                nb,
                out.add(8 * first_group),
                out_stride,
            )
        };
        return;
    }
    let _ = isa;
    let groups = &groups[..n_groups * group_bytes];
    for g in 0..n_groups {
        let group = &groups[g * group_bytes..(g + 1) * group_bytes];
        for (i, a) in acts.iter().enumerate() {
            let values = dot_packed_ref_as(layout, dtype, group, a, cols);
            let at = i * out_stride + 8 * (first_group + g);
            // SAFETY: the caller vouches for these elements.
            unsafe { std::ptr::copy_nonoverlapping(values.as_ptr(), out.add(at), PACK_ROWS) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dispatch::quantize_activations;
    use crate::quant::vec_dot_ref;
    use crate::testing::{random_f32, random_row};

    /// Groups `first..first + count` of `packed` against activation rows `acts` (with their
    /// block sums), through the kernel of `isa`: the `acts.len() × rows` output.
    fn run_span(
        isa: Isa,
        (layout, dtype): (Layout, DType),
        packed: &[u8],
        (first, count): (usize, usize),
        acts: &[&[u8]],
        cols: usize,
        rows: usize,
    ) -> Vec<f32> {
        let sums: Vec<Vec<i32>> = acts
            .iter()
            .map(|a| {
                let mut s = vec![0; cols / QK];
                act_block_sums(a, cols, &mut s);
                s
            })
            .collect();
        let sums: Vec<&[i32]> = sums.iter().map(Vec::as_slice).collect();
        let mut out = vec![0f32; acts.len() * rows];
        // SAFETY: out is acts × rows, the span writes the named groups of each row.
        unsafe {
            dot_packed_span_as(
                isa,
                layout,
                dtype,
                (packed, first, count, first + count, 0..0),
                (acts, &sums),
                cols,
                out.as_mut_ptr(),
                rows,
            )
        };
        out
    }

    fn act_row(cols: usize, seed: u64) -> Vec<u8> {
        let x = random_f32(cols, seed);
        let mut out = vec![0u8; cols / QK * Q8X32_BLOCK_BYTES];
        quantize_activations(Isa::Scalar, crate::ActFormat::Q8x32, &x, &mut out);
        out
    }

    /// The exact dot product of a weight row (dequantized) with a Q8x32 activation row
    /// (dequantized), in f64.
    fn float_dot(dtype: DType, w: &[u8], a: &[u8], cols: usize) -> (f64, f64) {
        let mut wf = vec![0f32; cols];
        crate::quant::dequantize_row(dtype, w, &mut wf);
        let (mut dot, mut magnitude) = (0f64, 0f64);
        for (b, block) in a.chunks_exact(Q8X32_BLOCK_BYTES).enumerate() {
            let da = f64::from(f32_at(block, 0));
            for i in 0..QK {
                let p = f64::from(wf[b * QK + i]) * da * f64::from(block[8 + i] as i8);
                dot += p;
                magnitude += p.abs();
            }
        }
        (dot, magnitude)
    }

    #[test]
    fn packed_dots_match_the_row_reference_and_are_batch_invariant() {
        let cases = [
            (DType::Q4_0, vec![32usize, 96, 576]),
            (DType::Q4_1, vec![32, 96, 576]),
            // 4,160: a wide row (130 blocks).
            (DType::Q8_0, vec![32, 96, 576, 4160]),
            (DType::Q5_0, vec![32, 96, 576]),
            (DType::Q5_1, vec![32, 96, 576]),
            (DType::Q4_K, vec![256, 768]),
            (DType::Q5_K, vec![256, 768]),
            (DType::Q6_K, vec![256, 768]),
            (DType::Q3_K, vec![256, 768]),
        ];
        // Q8_0 in both its layouts, whatever this CPU packs it in.
        // Q8_0 and Q4_K in each of their layouts, whatever this CPU packs them in.
        let layouts = |dtype: DType| {
            let mut all = Vec::new();
            for isa in [Isa::Avx2, Isa::Vnni, Isa::Avx512] {
                let layout = layout_for_level(dtype, isa).unwrap();
                if !all.contains(&layout) {
                    all.push(layout);
                }
            }
            all
        };
        for (dtype, layout, widths) in cases
            .into_iter()
            .flat_map(|(d, w)| layouts(d).into_iter().map(move |l| (d, l, w.clone())))
        {
            for cols in widths {
                let rows = 16;
                let data: Vec<u8> = (0..rows)
                    .flat_map(|r| random_row(dtype, cols, 40 + r as u64))
                    .collect();
                let packed = pack_as(layout, dtype, &data, rows, cols).unwrap();
                let group_bytes = cols / QK * layout_block_bytes(layout);
                let acts: Vec<Vec<u8>> = (0..PACK_ACTS)
                    .map(|i| act_row(cols, 70 + i as u64))
                    .collect();
                let row_bytes = data.len() / rows;
                for g in 0..rows / PACK_ROWS {
                    let group = &packed[g * group_bytes..(g + 1) * group_bytes];
                    let reference: Vec<[f32; PACK_ROWS]> = acts
                        .iter()
                        .map(|a| dot_packed_ref_as(layout, dtype, group, a, cols))
                        .collect();
                    for (i, a) in acts.iter().enumerate() {
                        for r in 0..PACK_ROWS {
                            let w = &data[(g * PACK_ROWS + r) * row_bytes..][..row_bytes];
                            let got = reference[i][r];
                            if dtype.activation_format() == crate::ActFormat::Q8x32 {
                                let want = vec_dot_ref(dtype, w, a, cols);
                                assert!(
                                    (got - want).abs() <= 1e-4 * want.abs().max(1.0),
                                    "{dtype} {layout:?} cols {cols} g{g} r{r} i{i}: {got} vs {want}"
                                );
                            }
                            // Against the exact product of the dequantized weights and
                            // activations: only f32 rounding apart.
                            let (want, magnitude) = float_dot(dtype, w, a, cols);
                            assert!(
                                (f64::from(got) - want).abs() <= 1e-5 * magnitude.max(1.0),
                                "{dtype} {layout:?} cols {cols} g{g} r{r} i{i}: {got} vs exact {want}"
                            );
                        }
                    }
                    for isa in Isa::available() {
                        for n in 1..=PACK_ACTS {
                            for start in 0..=PACK_ACTS - n {
                                let rows_in: Vec<&[u8]> = acts[start..start + n]
                                    .iter()
                                    .map(|a| a.as_slice())
                                    .collect();
                                let out = run_span(
                                    isa,
                                    (layout, dtype),
                                    &packed,
                                    (g, 1),
                                    &rows_in,
                                    cols,
                                    rows,
                                );
                                for k in 0..n {
                                    let got = &out[k * rows + g * PACK_ROWS..][..PACK_ROWS];
                                    assert_eq!(
                                        got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                                        reference[start + k].map(f32::to_bits).to_vec(),
                                        "{dtype} {layout:?} cols {cols} {isa:?} n{n}: bit-identical"
                                    );
                                }
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn spans_of_many_groups_equal_the_reference_group_by_group() {
        // Five groups, every level, 1..=4 activation rows, in one call.
        let (rows, cols) = (40, 640);
        let nb = cols / QK;
        for (dtype, layout) in [
            (DType::Q8_0, Layout::U8),
            (DType::Q8_0, Layout::Q8_0),
            (DType::Q5_0, Layout::Q5_0),
            (DType::Q4_K, Layout::U4K),
            (DType::Q4_K, Layout::U4F),
            (DType::Q4_0, Layout::Q4_0),
            (DType::Q4_1, Layout::Q4_1),
            (DType::Q5_1, Layout::Q5_1),
            (DType::Q5_K, Layout::U5F),
            (DType::Q6_K, Layout::U6H),
            (DType::Q6_K, Layout::U6K),
            (DType::Q3_K, Layout::U6H),
        ] {
            let k_quant = dtype.block_size() == crate::dtype::QK_K;
            let cols = if k_quant { 768 } else { cols };
            let nb = if k_quant { cols / QK } else { nb };
            let data: Vec<u8> = (0..rows)
                .flat_map(|r| random_row(dtype, cols, 90 + r as u64))
                .collect();
            let packed = pack_as(layout, dtype, &data, rows, cols).unwrap();
            let group_bytes = nb * layout_block_bytes(layout);
            let acts: Vec<Vec<u8>> = (0..PACK_ACTS)
                .map(|i| act_row(cols, 300 + i as u64))
                .collect();
            for isa in Isa::available() {
                for n in 1..=PACK_ACTS {
                    let rows_in: Vec<&[u8]> = acts[..n].iter().map(|a| a.as_slice()).collect();
                    let out = run_span(
                        isa,
                        (layout, dtype),
                        &packed,
                        (0, rows / PACK_ROWS),
                        &rows_in,
                        cols,
                        rows,
                    );
                    for g in 0..rows / PACK_ROWS {
                        let group = &packed[g * group_bytes..(g + 1) * group_bytes];
                        for (i, a) in rows_in.iter().enumerate() {
                            let want = dot_packed_ref_as(layout, dtype, group, a, cols);
                            let got = &out[i * rows + g * PACK_ROWS..][..PACK_ROWS];
                            assert_eq!(
                                got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                                want.map(f32::to_bits).to_vec(),
                                "{dtype} {layout:?} {isa:?} n{n} group {g}"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn q6_k_compact_equals_q6_k_unpacked_bit_for_bit() {
        // The two Q6_K layouts hold the same integers and scales: every level's results on the
        // compact one equal the reference on the unpacked one (which the row kernel checks).
        let (rows, cols) = (24, 1024);
        let data: Vec<u8> = (0..rows)
            .flat_map(|r| random_row(DType::Q6_K, cols, 500 + r as u64))
            .collect();
        let compact = pack_as(Layout::U6K, DType::Q6_K, &data, rows, cols).unwrap();
        let unpacked = pack_as(Layout::U6H, DType::Q6_K, &data, rows, cols).unwrap();
        // 6.5625 bits per weight: the file's size.
        assert_eq!(compact.len(), data.len());
        let acts: Vec<Vec<u8>> = (0..PACK_ACTS)
            .map(|i| act_row(cols, 600 + i as u64))
            .collect();
        let rows_in: Vec<&[u8]> = acts.iter().map(|a| a.as_slice()).collect();
        let want = run_span(
            Isa::Scalar,
            (Layout::U6H, DType::Q6_K),
            &unpacked,
            (0, rows / PACK_ROWS),
            &rows_in,
            cols,
            rows,
        );
        for isa in Isa::available() {
            let got = run_span(
                isa,
                (Layout::U6K, DType::Q6_K),
                &compact,
                (0, rows / PACK_ROWS),
                &rows_in,
                cols,
                rows,
            );
            assert_eq!(
                got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                "Q6_K compact at {isa:?}"
            );
        }
    }

    #[test]
    fn only_whole_groups_of_supported_types_pack() {
        let q = random_row(DType::Q4_1, 64, 1);
        assert!(pack(DType::Q4_1, &q.repeat(7), 7, 64).is_none());
        assert!(pack(DType::Q4_1, &q.repeat(8), 8, 64).is_some());
        let k = random_row(DType::Q4_K, 256, 1);
        assert!(pack(DType::Q4_K, &k.repeat(7), 7, 256).is_none());
        assert!(pack(DType::Q4_K, &k.repeat(8), 8, 256).is_some());
        let q2 = random_row(DType::Q2_K, 256, 1);
        assert!(pack(DType::Q2_K, &q2.repeat(8), 8, 256).is_none());
    }
}
